//! `idem console`: the operator console ([`idem_console`]) over its own pool, on loopback unless
//! told otherwise.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use idem_console::{Console, ConsoleConfig, Token};
use idem_sql::{AnyPool, AnyStore, Scheme};
use sqlx::Executor;

use crate::DbArgs;
use crate::kafka_args::KafkaArgs;
use crate::util::parse_duration;

/// `idem console`.
#[derive(Args)]
pub struct ConsoleArgs {
    #[command(flatten)]
    db: DbArgs,
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
    };
    for url in &config.metrics_urls {
        idem_console::check_metrics_url(url).map_err(anyhow::Error::msg)?;
    }
    let store = open(&args.db).await?;
    idem_sql::with_store!(&store, s => s.ops().audit_rows(0, 1).await).context(
        "reading the audit table (a database below idem's schema version 23 needs `idem migrate`)",
    )?;
    let actions = config.actions();
    let console = Console::new(store, config);
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
