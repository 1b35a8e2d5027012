//! `idem orders`, `idem settlement` and `idem dead-letters`: the reference pipeline's services,
//! each runnable as its own process.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use idem_consumer::{Consumer, ConsumerConfig, ConsumerMetrics};
use idem_core::InboxStore;
use idem_kafka::{KafkaSource, consumer_config};
use idem_postgres::PgInbox;
use idem_reference::{PaidOrder, Settlement};
use idem_sqlite::SqliteInbox;

use crate::DbArgs;
use crate::db::{self, Store};

#[derive(Args, Debug)]
pub struct OrdersArgs {
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
    /// Hold every Nth order's transaction open for --slow-ms before committing (PostgreSQL):
    /// commit-order skew for chaos runs.
    #[arg(long, hide = true)]
    slow_every: Option<u64>,
    /// How long a slow transaction stays open.
    #[arg(long, hide = true, default_value_t = 300)]
    slow_ms: u64,
}

pub async fn orders(args: OrdersArgs) -> anyhow::Result<()> {
    let store = db::open(&args.db, 2).await?;
    let interval = (args.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / args.rate));
    let mut next = tokio::time::Instant::now();
    match &store {
        Store::Postgres(s) => idem_reference::ensure_schema_postgres(s.pool()).await?,
        Store::Sqlite(s) => idem_reference::ensure_schema_sqlite(s.pool()).await?,
    }
    for n in args.start..args.start + args.count {
        let order = PaidOrder::numbered(&args.prefix, n);
        match &store {
            Store::Postgres(s) => {
                let hold = match args.slow_every {
                    Some(every) if every > 0 && n % every == 0 => {
                        Duration::from_millis(args.slow_ms)
                    }
                    _ => Duration::ZERO,
                };
                idem_reference::place_order_postgres_held(s.pool(), s.outbox(), &order, hold)
                    .await?
            }
            Store::Sqlite(s) => {
                idem_reference::place_order_sqlite(s.pool(), s.outbox(), &order).await?
            }
        }
        if let Some(i) = interval {
            next += i;
            tokio::time::sleep_until(next).await;
        }
    }
    println!("wrote {} paid orders", args.count);
    Ok(())
}

#[derive(Args, Debug)]
pub struct SettlementArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Kafka bootstrap servers.
    #[arg(long, env = "IDEM_BROKERS")]
    brokers: String,
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
}

pub async fn settlement(args: SettlementArgs) -> anyhow::Result<()> {
    let shutdown = crate::relay_cmd::shutdown_signal()?;
    let store = db::open(&args.db, 4).await?;
    let tables = db::tables(&args.db)?;
    let registry = prometheus::Registry::new();
    let metrics = ConsumerMetrics::new(&registry)?;
    if let Some(addr) = args.metrics_addr {
        let bound = crate::metrics_server::serve(addr, registry.clone()).await?;
        eprintln!("idem settlement: metrics on http://{bound}/metrics");
    }
    let kafka = consumer_config(&args.brokers, &args.group, &args.consumer_config)?;
    let source = KafkaSource::new(&kafka, &args.topics)?;
    let mut config = ConsumerConfig::new(&args.group);
    config.batch_size = args.batch_size.max(1);
    eprintln!(
        "idem settlement: group {} consuming {}",
        args.group,
        args.topics.join(", ")
    );
    match store {
        Store::Postgres(s) => {
            idem_reference::ensure_schema_postgres(s.pool())
                .await
                .context("creating the settlements table")?;
            let inbox = PgInbox::new(s.pool().clone(), tables.clone());
            match args.points_url {
                _ if args.handler == "audit" => {
                    Consumer::new(inbox, idem_reference::Audit, source, config, metrics)
                        .run(shutdown)
                        .await?;
                }
                Some(url) => {
                    let intents = idem_postgres::PgIntents::new(s.pool().clone(), tables);
                    let handler = Settlement::with_points(intents, url);
                    Consumer::new(inbox, handler, source, config, metrics)
                        .run(shutdown)
                        .await?;
                }
                None => {
                    Consumer::new(inbox, Settlement::new(), source, config, metrics)
                        .run(shutdown)
                        .await?;
                }
            }
        }
        Store::Sqlite(s) => {
            idem_reference::ensure_schema_sqlite(s.pool())
                .await
                .context("creating the settlements table")?;
            let inbox = SqliteInbox::new(s.pool().clone(), tables.clone());
            match args.points_url {
                _ if args.handler == "audit" => {
                    Consumer::new(inbox, idem_reference::Audit, source, config, metrics)
                        .run(shutdown)
                        .await?;
                }
                Some(url) => {
                    let intents = idem_sqlite::SqliteIntents::new(s.pool().clone(), tables);
                    let handler = Settlement::with_points(intents, url);
                    Consumer::new(inbox, handler, source, config, metrics)
                        .run(shutdown)
                        .await?;
                }
                None => {
                    Consumer::new(inbox, Settlement::new(), source, config, metrics)
                        .run(shutdown)
                        .await?;
                }
            }
        }
    }
    eprintln!("idem settlement: stopped cleanly");
    Ok(())
}

#[derive(Args, Debug)]
pub struct DeadLettersArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Consumer group.
    #[arg(long, default_value = "settlement")]
    group: String,
    /// At most this many.
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub async fn dead_letters(args: DeadLettersArgs) -> anyhow::Result<()> {
    let store = db::open(&args.db, 1).await?;
    let tables = db::tables(&args.db)?;
    let rows = match store {
        Store::Postgres(s) => {
            PgInbox::new(s.pool().clone(), tables)
                .dead_letters(&args.group, args.limit)
                .await?
        }
        Store::Sqlite(s) => {
            SqliteInbox::new(s.pool().clone(), tables)
                .dead_letters(&args.group, args.limit)
                .await?
        }
    };
    if args.json {
        println!("{}", serde_json::to_string(&rows)?);
    } else if rows.is_empty() {
        println!("no dead letters for group {}", args.group);
    } else {
        for r in rows {
            println!(
                "{}/{}@{}  event {}  reason: {}",
                r.topic,
                r.partition,
                r.offset,
                r.event_id.as_deref().unwrap_or("-"),
                r.reason
            );
        }
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct PointsApiArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Address to listen on (loopback; port 0 picks one).
    #[arg(long, default_value = "127.0.0.1:8088")]
    listen: SocketAddr,
    /// How long an in-flight Idempotency-Key claim is exclusive without renewal (the layer
    /// renews it every third of this while an award runs).
    #[arg(long, default_value = "30s", value_parser = crate::relay_cmd::parse_duration)]
    key_lock: Duration,
    /// Lab only: every keyed award waits this long before it is stored (a points API slower
    /// than its key lock), and `GET /lab/award-executions` counts executions of one key that
    /// overlap (stored in `points_lab_overlaps`).
    #[arg(long, value_parser = crate::relay_cmd::parse_duration)]
    award_delay: Option<Duration>,
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
                "idem points-api: LAB: every award waits {award_delay:?} (key lock {:?})",
                args.key_lock
            );
            lab_router(db, keys, config, Lab { award_delay })
        }
        None => router(db, keys, config),
    }
}

/// Runs the reference points API until SIGTERM/SIGINT.
pub async fn points_api(args: PointsApiArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.key_lock >= Duration::from_millis(100),
        "--key-lock {:?} is too short: the lock is renewed every third of it, and must outlast a \
         key-store round trip (use 100ms or more; the default is 30s)",
        args.key_lock
    );
    let shutdown = crate::relay_cmd::shutdown_signal()?;
    let store = db::open(&args.db, 8).await?;
    let tables = db::tables(&args.db)?;
    let app = match &store {
        Store::Postgres(s) => {
            idem_postgres::migrate(s.pool(), &tables).await?;
            idem_reference::ensure_schema_postgres(s.pool()).await?;
            let keys = idem_postgres::PgKeyStore::new(s.pool().clone(), tables);
            idem_http::spawn_sweeper(keys.clone(), Duration::from_secs(60));
            points_router(
                idem_reference::points::PointsDb::Postgres(s.pool().clone()),
                keys,
                &args,
            )
        }
        Store::Sqlite(s) => {
            idem_sqlite::migrate(s.pool(), &tables).await?;
            idem_reference::ensure_schema_sqlite(s.pool()).await?;
            let keys = idem_sqlite::SqliteKeyStore::new(s.pool().clone(), tables);
            idem_http::spawn_sweeper(keys.clone(), Duration::from_secs(60));
            points_router(
                idem_reference::points::PointsDb::Sqlite(s.pool().clone()),
                keys,
                &args,
            )
        }
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    eprintln!(
        "idem points-api: listening on http://{}",
        listener.local_addr()?
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    eprintln!("idem points-api: stopped cleanly");
    Ok(())
}
