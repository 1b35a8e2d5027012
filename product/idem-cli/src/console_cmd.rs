//! `idem console`: the operator console ([`idem_console`]) over its own pool, on loopback unless
//! told otherwise.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use idem_console::{Console, ConsoleConfig, Database, Token};
use idem_sql::{AnyPool, AnyStore, Scheme};
use sqlx::Executor;

use crate::DbArgs;
use crate::effects_cmd::CompensateArgs;
use crate::kafka_args::KafkaArgs;
use crate::util::parse_duration;

/// `idem console`.
#[derive(Args)]
pub struct ConsoleArgs {
    /// A database whose idem tables the console shows, as `URL` or `NAME=URL` (repeatable: the
    /// service's, with its outbox, and the consumer's, with its inbox). The name defaults to
    /// the database's own.
    #[arg(
        long = "db",
        env = "IDEM_DB",
        required = true,
        value_name = "[NAME=]URL"
    )]
    dbs: Vec<String>,
    /// PostgreSQL schema of idem's tables (default: the search path).
    #[arg(long, env = "IDEM_SCHEMA")]
    schema: Option<String>,
    /// Prefix of idem's table names.
    #[arg(long, env = "IDEM_TABLE_PREFIX", default_value = "idem_")]
    table_prefix: String,
    /// Where to serve the console. A loopback address unless --allow-remote.
    #[arg(long, default_value = "127.0.0.1:9480")]
    listen: SocketAddr,
    /// Serve on an address other hosts reach (put TLS in front: the console speaks plain HTTP).
    /// Needs --token.
    #[arg(long)]
    allow_remote: bool,
    /// The operators' token (16 characters or more): pages and actions need a login with it.
    /// Prefer IDEM_CONSOLE_TOKEN_FILE or the environment: a command line is visible to every
    /// user of the host. Without a token the console is read-only.
    #[arg(
        long,
        env = "IDEM_CONSOLE_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    token: Option<String>,
    /// Show no action at all, whoever logs in.
    #[arg(long)]
    read_only: bool,
    /// The checks the Proof page runs (the file `idem verify --config` reads).
    #[arg(long, value_name = "FILE")]
    verify_config: Option<PathBuf>,
    /// Kafka bootstrap servers, to show each consumer group's committed offsets and lag.
    #[arg(long)]
    brokers: Option<String>,
    #[command(flatten)]
    kafka: KafkaArgs,
    /// A topic whose lag is shown (repeatable; default: every topic of the cluster, at most 50).
    #[arg(long = "topic", value_name = "TOPIC")]
    topics: Vec<String>,
    /// A service's metrics endpoint (`http://host:port/metrics`, repeatable): stalled consumers
    /// and retries come from there.
    #[arg(long = "metrics-url", value_name = "URL")]
    metrics_urls: Vec<String>,
    /// How often the console samples the pipeline (the step of its rate charts).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    sample_every: Duration,
    #[command(flatten)]
    compensate: CompensateArgs,
}

impl std::fmt::Debug for ConsoleArgs {
    /// Without the token and the Kafka secrets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleArgs")
            .field("listen", &self.listen)
            .field("read_only", &self.read_only)
            .field("token", &self.token.as_ref().map(|_| "set"))
            .finish_non_exhaustive()
    }
}

/// How long one statement of the console may run on PostgreSQL: a slow page is cut short, and
/// the pipeline's statements never wait behind it for long.
const STATEMENT_TIMEOUT_MS: u32 = 5_000;

/// Runs `idem console` until interrupted.
pub async fn run(args: ConsoleArgs) -> anyhow::Result<()> {
    if !args.listen.ip().is_loopback() && !args.allow_remote {
        bail!(
            "idem console serves on loopback only: {} is not a loopback address (add --allow-remote, with --token and TLS in front)",
            args.listen
        );
    }
    let token = args
        .token
        .as_deref()
        .map(Token::new)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    if args.allow_remote && token.is_none() {
        bail!("idem console --allow-remote needs --token (or IDEM_CONSOLE_TOKEN_FILE)");
    }
    let config = ConsoleConfig {
        token,
        read_only: args.read_only,
        verify: args
            .verify_config
            .as_deref()
            .map(verify_config)
            .transpose()?,
        kafka: args
            .brokers
            .as_deref()
            .map(|b| args.kafka.connection(b))
            .transpose()?,
        topics: args.topics.clone(),
        metrics_urls: args.metrics_urls.clone(),
        sample_every: args.sample_every,
        compensations: args.compensate.compensations()?,
    };
    for url in &config.metrics_urls {
        idem_console::check_metrics_url(url).map_err(anyhow::Error::msg)?;
    }
    let databases = open_all(&args).await?;
    let actions = config.actions();
    let console = Console::new(databases, config);
    let _sampler = console.spawn_sampler();
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    let mode = if actions {
        "actions need a login"
    } else {
        "read-only"
    };
    tracing::info!(%addr, mode, "idem console: listening on http://{addr}");
    axum::serve(listener, console.router())
        .with_graceful_shutdown(crate::util::shutdown_signal()?)
        .await
        .context("serving the console")
}

/// Opens every `--db`, each with its own pool, after checking it is migrated for the console.
async fn open_all(args: &ConsoleArgs) -> anyhow::Result<Vec<Database>> {
    let mut databases: Vec<Database> = vec![];
    for given in &args.dbs {
        let (name, url) = named(given)?;
        if databases.iter().any(|d| d.name == name) {
            bail!("two --db are named {name}: name them (--db NAME=URL)");
        }
        let db = DbArgs {
            db: url.to_owned(),
            schema: args.schema.clone(),
            table_prefix: args.table_prefix.clone(),
        };
        let store = open(&db).await?;
        idem_sql::with_store!(&store, s => s.ops().audit_rows(0, 1).await).with_context(|| {
            format!("reading the audit table of {name} (a database below idem's schema version 23 needs `idem migrate`)")
        })?;
        databases.push(Database { name, store });
    }
    Ok(databases)
}

/// A `--db` value's name and URL: `NAME=URL`, or a URL named after its database (the last
/// segment of its path, without a SQLite file's extension).
fn named(given: &str) -> anyhow::Result<(String, &str)> {
    let fine = |n: &str| {
        !n.is_empty()
            && n.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    if let Some((name, url)) = given.split_once('=')
        && !name.contains(':')
        && !name.contains('/')
    {
        if !fine(name) {
            bail!("--db {name}=…: a name is letters, digits, '-', '_' or '.'");
        }
        return Ok((name.to_owned(), url));
    }
    let path = given.split(['?', '#']).next().unwrap_or_default();
    let last = path.rsplit('/').next().unwrap_or_default();
    let name = last.split('.').next().unwrap_or_default();
    if !fine(name) {
        bail!("--db {}: name it (--db NAME=URL)", idem_sql::redact(given));
    }
    Ok((name.to_owned(), given))
}

/// Reads the verify config the Proof page runs.
fn verify_config(path: &std::path::Path) -> anyhow::Result<idem_verify::VerifyConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    idem_verify::VerifyConfig::from_toml(&text)
        .with_context(|| format!("reading the checks of {}", path.display()))
}

/// The console's own pool: four connections, and on PostgreSQL a statement timeout and an
/// application name that says whose statements these are.
async fn open(args: &DbArgs) -> anyhow::Result<AnyStore> {
    let tables = crate::db::tables(args)?;
    if tables.schema().is_some() && Scheme::of(&args.db)? == Scheme::Sqlite {
        bail!("--schema is for PostgreSQL; SQLite has no schemas");
    }
    let pool = match Scheme::of(&args.db)? {
        Scheme::Postgres => {
            let target = idem_sql::postgres::PgUrl::parse(&args.db)?;
            let options = sqlx::postgres::PgPoolOptions::new()
                .max_connections(4)
                .after_connect(|conn, _| {
                    Box::pin(async move {
                        conn.execute(
                            format!(
                                "SET statement_timeout = {STATEMENT_TIMEOUT_MS}; SET application_name = 'idem console'"
                            )
                            .as_str(),
                        )
                        .await
                        .map(|_| ())
                    })
                });
            AnyPool::Postgres(idem_sql::postgres::connect_to(&target, options).await?)
        }
        Scheme::Sqlite => AnyPool::connect(&args.db, 4).await?,
    };
    Ok(AnyStore::open(pool, tables))
}

#[cfg(test)]
mod tests {
    use super::named;

    #[test]
    fn a_database_is_named_by_its_flag_or_its_own_name() {
        let n = |s| {
            named(s)
                .map(|(n, u)| (n, u.to_owned()))
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            n("orders=postgres://u@h/db"),
            Ok(("orders".into(), "postgres://u@h/db".into()))
        );
        assert_eq!(
            n("postgres://u:p@h:5432/settlement?sslmode=require"),
            Ok((
                "settlement".into(),
                "postgres://u:p@h:5432/settlement?sslmode=require".into()
            ))
        );
        assert_eq!(
            n("sqlite:///var/lib/idem/shop.db"),
            Ok(("shop".into(), "sqlite:///var/lib/idem/shop.db".into()))
        );
        assert!(n("bad name=postgres://h/db").is_err());
        let refused = n("postgres://u:secret@h/").unwrap_err();
        assert!(!refused.contains("secret"), "{refused}");
    }
}
