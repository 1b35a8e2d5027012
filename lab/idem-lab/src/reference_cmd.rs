//! `idem-lab orders`, `idem-lab settlement` and `idem-lab points-api`: the reference pipeline's
//! services, each runnable as its own process.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use idem_consumer::{Consumer, ConsumerConfig, ConsumerMetrics};
use idem_core::health::Health;
use idem_core::store::InboxStore;
use idem_kafka::KafkaSource;
use idem_reference::{EventPath, PaidOrder, Settlement};
use idem_sql::Dialect;

use idem_cli::DbArgs;
use idem_cli::db::{self, Store};

#[derive(Args, Debug)]
pub(crate) struct OrdersArgs {
    #[command(flatten)]
    db: DbArgs,
    /// How many paid orders to write, each with its order.paid event in one transaction.
    #[arg(long, default_value_t = 100)]
    count: u64,
    /// Number of the first order (orders are `<prefix>order-N`, payments `<prefix>pay-N`).
    #[arg(long, default_value_t = 1)]
    start: u64,
    /// Prefix of order and payment ids.
    #[arg(long, default_value = "")]
    prefix: String,
    /// Orders per second (0: as fast as the database allows).
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Hold every Nth order's transaction open for --slow before committing (PostgreSQL):
    /// commit-order skew for chaos runs.
    #[arg(long, hide = true)]
    slow_every: Option<u64>,
    /// How long a slow transaction stays open.
    #[arg(long, hide = true, default_value = "300ms", value_parser = idem_cli::util::parse_duration)]
    slow: Duration,
    /// How each order's event reaches the pipeline (`sql` and `messages`: PostgreSQL only).
    #[arg(long, value_enum, default_value_t = Events::Outbox)]
    events: Events,
}

/// How the order writer hands each event to the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Events {
    /// idem's outbox library (`Outbox::enqueue`).
    Outbox,
    /// A plain SQL `INSERT` into the outbox table: the contract a writer in any language uses.
    Sql,
    /// Logical decoding messages, for the CDC relay in message mode (`--messages`).
    Messages,
}

pub(crate) async fn orders(args: OrdersArgs) -> anyhow::Result<()> {
    let store = db::open_checked(&args.db, 2, checked).await?;
    let path = event_path(&store, args.events, &args.db)?;
    let interval = (args.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / args.rate));
    let mut next = tokio::time::Instant::now();
    for n in args.start..args.start + args.count {
        let order = PaidOrder::numbered(&args.prefix, n);
        let hold = match args.slow_every {
            Some(every) if every > 0 && n % every == 0 => args.slow,
            _ => Duration::ZERO,
        };
        place(&store, path.as_ref(), &order, hold).await?;
        if let Some(i) = interval {
            next += i;
            tokio::time::sleep_until(next).await;
        }
    }
    println!("wrote {} paid orders", args.count);
    Ok(())
}

/// How long a writer retries one order while its database is unreachable.
const UNREACHABLE_FOR: Duration = Duration::from_secs(120);

/// Writes `order` with its event, retrying while the database is unreachable (as a service
/// retries a request whose transaction failed on the network). An attempt whose `COMMIT`
/// answer got lost may have committed: a retry that finds the order written is done, so each
/// order is written once either way.
async fn place(
    store: &Store,
    path: Option<&EventPath>,
    order: &PaidOrder,
    hold: Duration,
) -> anyhow::Result<()> {
    let started = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(100);
    let mut retried = false;
    loop {
        let e = match place_once(store, path, order, hold).await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if retried && e.is_already_written() {
            tracing::warn!(order = %order.order_id, "the order is written already: an attempt whose answer was lost committed it");
            return Ok(());
        }
        if !e.is_unreachable() || started.elapsed() > UNREACHABLE_FOR {
            return Err(e.into());
        }
        tracing::warn!(order = %order.order_id, error = %anyhow::Error::from(e), "database unreachable; writing the order again");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
        retried = true;
    }
}

/// The event path of a PostgreSQL writer (`None` on SQLite, which has idem's outbox only).
fn event_path(store: &Store, events: Events, db: &DbArgs) -> anyhow::Result<Option<EventPath>> {
    let Store::Postgres(s) = store else {
        if events != Events::Outbox {
            anyhow::bail!("--events {events:?} needs PostgreSQL: SQLite has idem's outbox only");
        }
        return Ok(None);
    };
    Ok(Some(match events {
        Events::Outbox => EventPath::Outbox(s.outbox()),
        Events::Sql => EventPath::Sql {
            table: db::tables(db)?.qualified("outbox"),
        },
        Events::Messages => EventPath::Messages(idem_sql::postgres::MessageOutbox::default()),
    }))
}

async fn place_once(
    store: &Store,
    path: Option<&EventPath>,
    order: &PaidOrder,
    hold: Duration,
) -> Result<(), idem_reference::OrderError> {
    match (store, path) {
        (Store::Postgres(s), Some(path)) => {
            idem_reference::place_order_via(s.pool(), path, order, hold).await
        }
        (Store::Postgres(s), None) => {
            idem_reference::place_order_postgres_held(s.pool(), &s.outbox(), order, hold).await
        }
        (Store::Sqlite(s), _) => {
            idem_reference::place_order_sqlite(s.pool(), &s.outbox(), order).await
        }
    }
}

#[derive(Args)]
pub(crate) struct SettlementArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Kafka bootstrap servers.
    #[arg(long, env = "IDEM_BROKERS")]
    brokers: String,
    /// How to reach and authenticate to the cluster (TLS, SASL).
    #[command(flatten)]
    kafka: Box<idem_cli::kafka_args::KafkaArgs>,
    /// Consumer group (the inbox is keyed by group and event id).
    #[arg(long, default_value = "settlement")]
    group: String,
    /// Topic(s) to consume (repeatable).
    #[arg(long = "topic", default_values_t = vec!["outbox.event.order".to_owned()])]
    topics: Vec<String>,
    /// Records per transaction.
    #[arg(long, default_value_t = 200)]
    batch_size: usize,
    /// Serve Prometheus metrics on this address (port 0 picks one).
    #[arg(long, env = "IDEM_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// librdkafka consumer setting KEY=VALUE (repeatable); offset auto-commit/auto-store are refused.
    #[arg(long = "consumer-config", value_parser = idem_kafka::parse_setting)]
    consumer_config: Vec<(String, String)>,
    /// The handler: `settlement` (settlements, and points with --points-url) or `audit` (one
    /// audit_log row per event; the chaos runner's second consumer group).
    #[arg(long, default_value = "settlement", value_parser = ["settlement", "audit"])]
    handler: String,
    /// Award points for each paid order at this URL (`http://127.0.0.1:8088/awards`): the
    /// handler records one `points.award` effect intent per payment in its transaction, and
    /// `idem effects dispatch` delivers it.
    #[arg(long)]
    points_url: Option<String>,
    /// PostgreSQL: the settlement handler gives up on a lock held longer than this on its tables
    /// (a transient failure, retried until the lock is released; never a dead letter). The
    /// chaos runner's long-lock fault class uses it.
    #[arg(long, value_parser = idem_cli::util::parse_duration)]
    lock_timeout: Option<Duration>,
    /// Lab only, with `--handler audit`: every batch's transaction is held open this long after
    /// the handler wrote, before the consumer commits it, so that network faults land inside
    /// open transactions.
    #[arg(long, value_parser = idem_cli::util::parse_duration)]
    hold: Option<Duration>,
}

impl std::fmt::Debug for SettlementArgs {
    /// The `--consumer-config` values of secret settings (`sasl.password=…`) are redacted.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SettlementArgs")
            .field("db", &self.db)
            .field("brokers", &self.brokers)
            .field("kafka", &self.kafka)
            .field("group", &self.group)
            .field("topics", &self.topics)
            .field("batch_size", &self.batch_size)
            .field("metrics_addr", &self.metrics_addr)
            .field(
                "consumer_config",
                &idem_kafka::security::describe_settings(&self.consumer_config),
            )
            .field("handler", &self.handler)
            .field("points_url", &self.points_url)
            .field("lock_timeout", &self.lock_timeout)
            .field("hold", &self.hold)
            .finish()
    }
}

/// The settlement handler with `--lock-timeout` applied.
fn settlement_handler(args: &SettlementArgs) -> Settlement {
    let handler = match &args.points_url {
        Some(url) => Settlement::with_points(url.clone()),
        None => Settlement::new(),
    };
    match args.lock_timeout {
        Some(timeout) => handler.with_lock_timeout(timeout),
        None => handler,
    }
}

pub(crate) async fn settlement(args: SettlementArgs) -> anyhow::Result<()> {
    let mut shutdown = Box::pin(idem_cli::util::shutdown_signal()?);
    let store = tokio::select! {
        store = db::open_checked(&args.db, 4, checked) => store?,
        () = &mut shutdown => return Ok(()),
    };
    let registry = prometheus::Registry::new();
    let metrics = ConsumerMetrics::new(&registry)?;
    // Ready while the database answers, the broker answers and the member is in its group;
    // each expected before the probes are served (not ready until reached).
    let health = Health::new();
    for name in [
        idem_consumer::DATABASE,
        idem_cli::readiness::BROKER,
        idem_kafka::GROUP,
    ] {
        health.expect(name);
    }
    if let Some(addr) = args.metrics_addr {
        let bound =
            idem_cli::metrics_server::serve_with(addr, registry.clone(), health.clone()).await?;
        eprintln!("idem settlement: metrics on http://{bound}/metrics (probes /healthz, /readyz)");
    }
    let kafka = args
        .kafka
        .connection(&args.brokers)?
        .consumer_config(&args.group, &args.consumer_config)?;
    args.kafka.check(&kafka, "idem settlement").await?;
    idem_cli::readiness::watch_broker(&kafka, &health);
    let source = KafkaSource::with_health(&kafka, &args.topics, &health)?;
    let mut config = ConsumerConfig::new(&args.group);
    config.batch_size = args.batch_size.max(1);
    eprintln!(
        "idem settlement: group {} consuming {}",
        args.group,
        args.topics.join(", ")
    );
    if args.hold.is_some() && args.handler != "audit" {
        anyhow::bail!("--hold is for --handler audit");
    }
    if args.lock_timeout.is_some() && matches!(store, Store::Sqlite(_)) {
        anyhow::bail!("--lock-timeout is for PostgreSQL (SQLite has no lock_timeout)");
    }
    let consumer = Consumed {
        source,
        config,
        metrics,
        health,
    };
    idem_sql::with_store!(store, s => consume(&s, &args, consumer, shutdown).await)?;
    eprintln!("idem settlement: stopped cleanly");
    Ok(())
}

/// `idem-lab setup`: idem's tables (as `idem migrate`) and the reference tables (orders,
/// settlements, points) in the database `--db` names.
#[derive(Args, Debug)]
pub(crate) struct SetupArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Also install the chaos runs' business rule (PostgreSQL): the settlement and audit
    /// tables refuse payments named `refused-by-rule-…`, so that a well-formed hostile event
    /// is dead-lettered (`[hostile] business_rule = true` of a pipeline file).
    #[arg(long)]
    business_rule: bool,
}

/// Creates (or upgrades) idem's tables and the reference tables in one database, and says so.
pub(crate) async fn setup(args: SetupArgs) -> anyhow::Result<()> {
    let store = db::open(&args.db, 2).await?;
    let report = idem_sql::with_store!(&store, s => s.migrate().await)?;
    match &store {
        Store::Postgres(s) => idem_reference::ensure_schema_postgres(s.pool()).await,
        Store::Sqlite(s) => idem_reference::ensure_schema_sqlite(s.pool()).await,
    }
    .context("creating the reference tables")?;
    if args.business_rule {
        let Store::Postgres(s) = &store else {
            anyhow::bail!("--business-rule is PL/pgSQL: give a PostgreSQL --db");
        };
        crate::chaos::install_business_rule(s.pool()).await?;
    }
    println!(
        "idem-lab setup: idem's tables at schema version {}, reference tables ({}) ready",
        report.current,
        idem_reference::TABLES.join(", ")
    );
    Ok(())
}

/// Refuses a database the reference services were not set up in: the services create no
/// table in a database they are given, so a wrong `--db` stops them at start instead of
/// filling someone's database. `idem-lab setup --db URL` creates the tables, once.
/// [`require_schemas`] of an opened store (the start-up check of the services).
async fn checked(store: Store) -> anyhow::Result<()> {
    require_schemas(&store).await
}

async fn require_schemas(store: &Store) -> anyhow::Result<()> {
    const SETUP: &str = "create them with `idem-lab setup --db <the same URL>` first";
    match idem_sql::with_store!(store, s => idem_sql::check_schema(s.pool(), s.tables()).await) {
        Err(e) if e.kind() == idem_core::ErrorKind::NotMigrated => {
            anyhow::bail!("{e}; {SETUP}")
        }
        checked => checked.context("reading idem's schema version")?,
    }
    let missing = match store {
        Store::Postgres(s) => idem_reference::missing_tables(s.pool()).await,
        Store::Sqlite(s) => idem_reference::missing_tables(s.pool()).await,
    }
    .context("looking for the reference tables")?;
    if !missing.is_empty() {
        anyhow::bail!(
            "the reference tables {} are missing from this database: {SETUP}",
            missing.join(", ")
        );
    }
    Ok(())
}

/// What the consumer of `idem-lab settlement` runs with, besides its store and handler.
struct Consumed {
    source: KafkaSource,
    config: ConsumerConfig,
    metrics: ConsumerMetrics,
    /// The process's readiness: the consumer reports its database into it.
    health: Health,
}

/// Runs the consumer with the handler `args` name, written once over the dialect: the audit
/// log, or settlements (recording a points intent per payment with `--points-url`).
async fn consume<DB: Dialect>(
    s: &idem_sql::Store<DB>,
    args: &SettlementArgs,
    c: Consumed,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()>
where
    idem_sql::Inbox<DB>: InboxStore<Conn = DB::Connection>,
    idem_reference::Audit: idem_consumer::Handler<DB::Connection>,
    Settlement: idem_consumer::Handler<DB::Connection>,
{
    let inbox = s.inbox();
    let Consumed {
        source,
        config,
        metrics,
        health,
    } = c;
    if args.handler == "audit" {
        let hold = args.hold.unwrap_or_default();
        let handler = Held {
            inner: idem_reference::Audit,
            hold,
        };
        Consumer::new(inbox, handler, source, config, metrics)
            .with_health(health)
            .run(shutdown)
            .await?;
    } else {
        Consumer::new(inbox, settlement_handler(args), source, config, metrics)
            .with_health(health)
            .run(shutdown)
            .await?;
    }
    Ok(())
}

/// A handler whose batches' transactions stay open `hold` longer (`--hold`).
struct Held<H> {
    inner: H,
    hold: Duration,
}

impl<C: Send, H: idem_consumer::Handler<C>> idem_consumer::Handler<C> for Held<H> {
    fn handle(
        &self,
        cx: &mut idem_consumer::HandlerContext<'_, C>,
        event: &idem_core::InboundEvent,
    ) -> impl std::future::Future<Output = Result<(), idem_consumer::HandlerError>> + Send {
        self.inner.handle(cx, event)
    }

    fn business_key(&self, event: &idem_core::InboundEvent) -> String {
        self.inner.business_key(event)
    }

    fn validate(&self, event: &idem_core::InboundEvent) -> Result<(), String> {
        self.inner.validate(event)
    }

    async fn handle_batch(
        &self,
        cx: &mut idem_consumer::BatchContext<'_, C>,
        events: &[&idem_core::InboundEvent],
    ) -> Result<Vec<idem_consumer::Outcome>, idem_consumer::BatchError> {
        let outcomes = self.inner.handle_batch(cx, events).await?;
        tokio::time::sleep(self.hold).await;
        Ok(outcomes)
    }
}

#[derive(Args, Debug)]
pub(crate) struct PointsApiArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Address to listen on (loopback; port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:8088")]
    listen: SocketAddr,
    /// How long an in-flight Idempotency-Key claim is exclusive without renewal (the layer
    /// renews it every third of this while an award runs).
    #[arg(long, env = "IDEM_POINTS_KEY_LOCK", default_value = "30s", value_parser = idem_cli::util::parse_duration)]
    key_lock: Duration,
    /// Lab only: every keyed award waits this long before it is stored (a points API slower
    /// than its key lock), and `GET /lab/award-executions` counts executions of one key that
    /// overlap (stored in `points_lab_overlaps`).
    /// (`IDEM_LAB_AWARD_DELAY`: how the chaos runner opens a slow window.)
    #[arg(long, env = "IDEM_LAB_AWARD_DELAY", value_parser = idem_cli::util::parse_duration)]
    award_delay: Option<Duration>,
    /// Lab only, with `--award-delay`: only one key in this many is slow (by a hash of the key),
    /// so the API keeps up while its slow awards are retried (`IDEM_LAB_SLOW_ONE_IN`).
    #[arg(long, env = "IDEM_LAB_SLOW_ONE_IN", default_value_t = 1)]
    award_delay_one_in: u32,
    /// Serve HTTPS with this certificate chain (PEM, the server's certificate first); needs
    /// `--tls-key`.
    #[arg(long, env = "IDEM_POINTS_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key of `--tls-cert` (PEM; read once at start, never logged).
    #[arg(long, env = "IDEM_POINTS_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// With `--tls-cert`: require a client certificate issued by a CA in this PEM file
    /// (mutual TLS); a client without one is refused in the handshake.
    #[arg(long, env = "IDEM_POINTS_CLIENT_CA", requires = "tls_cert")]
    client_ca: Option<std::path::PathBuf>,
}

fn points_router<K: idem_core::idempotency::IdempotencyStore>(
    db: idem_reference::points::PointsDb,
    keys: K,
    args: &PointsApiArgs,
) -> axum::Router {
    use idem_reference::points::{Lab, lab_router, router};
    let config = idem_http::IdempotencyConfig {
        lock: args.key_lock,
        ..idem_http::IdempotencyConfig::default()
    };
    match args.award_delay {
        Some(award_delay) => {
            eprintln!(
                "idem points-api: LAB: one key in {} waits {award_delay:?} per award (key lock {:?})",
                args.award_delay_one_in.max(1),
                args.key_lock
            );
            lab_router(
                db,
                keys,
                config,
                Lab {
                    award_delay,
                    slow_one_in: args.award_delay_one_in,
                },
            )
        }
        None => router(db, keys, config),
    }
}

/// Runs the reference points API until SIGTERM/SIGINT.
pub(crate) async fn points_api(args: PointsApiArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.key_lock >= Duration::from_millis(100),
        "--key-lock {:?} is too short: the lock is renewed every third of it, and must outlast a \
         key-store round trip (use 100ms or more; the default is 30s)",
        args.key_lock
    );
    let mut shutdown = Box::pin(idem_cli::util::shutdown_signal()?);
    let store = tokio::select! {
        store = db::open_checked(&args.db, 8, checked) => store?,
        () = &mut shutdown => return Ok(()),
    };
    let app = idem_sql::with_store!(&store, s => {
        let keys = s.keys();
        idem_http::spawn_sweeper(keys.clone(), Duration::from_secs(60));
        points_router(store.pool(), keys, &args)
    });
    // Read and checked before binding: a wrong file stops the API at start, naming it.
    let acceptor = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(
            idem_reference::points::https::ServerTls {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: args.client_ca.clone(),
            }
            .acceptor()?,
        ),
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    match acceptor {
        Some(acceptor) => {
            eprintln!(
                "idem points-api: listening on https://{addr}{}",
                if args.client_ca.is_some() {
                    " (client certificates required)"
                } else {
                    ""
                }
            );
            idem_reference::points::https::serve(listener, acceptor, app, shutdown).await?;
        }
        None => {
            eprintln!("idem points-api: listening on http://{addr}");
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await?;
        }
    }
    eprintln!("idem points-api: stopped cleanly");
    Ok(())
}

/// `idem-lab verify-config`: the reference pipeline's checks as TOML, for `idem verify --config`.
#[derive(Args, Debug)]
pub(crate) struct VerifyConfigArgs {
    /// The order database (orders and the outbox).
    #[arg(long)]
    orders_db: String,
    /// The settlement database (settlements, the inbox, the effect intents).
    #[arg(long)]
    settlement_db: String,
    /// The points API's database (points awards), to check the effect stage too.
    #[arg(long)]
    points_db: Option<String>,
    /// Write the config here (mode 0600: the URLs may hold passwords) instead of standard output.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

/// Prints (or writes) the reference pipeline's verify config.
pub(crate) fn verify_config(args: &VerifyConfigArgs) -> anyhow::Result<()> {
    let config = idem_reference::verify_config(
        &args.orders_db,
        &args.settlement_db,
        args.points_db.as_deref(),
    );
    let text = config.to_toml()?;
    match &args.out {
        // The URLs may hold passwords: the file is the owner's alone.
        Some(path) => {
            write_private(path, &text).with_context(|| format!("writing {}", path.display()))?;
        }
        None => print!("{text}"),
    }
    Ok(())
}

fn write_private(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(text.as_bytes())
}
