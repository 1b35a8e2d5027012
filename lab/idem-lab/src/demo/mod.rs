//! `idem-lab demo`: the reference pipeline in one process — order writer, two relays, two
//! settlement consumers, the effect dispatcher and the points API — on SQLite files and
//! librdkafka's in-process mock cluster (or PostgreSQL and real brokers), with every named crash
//! point fired several times, the crashed component restarted in-process, duplicate deliveries
//! and idempotency conflicts injected; it ends with `idem verify`'s verdict.

pub(crate) mod world;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use idem_consumer::{Consumer, ConsumerConfig, ConsumerMetrics};
use idem_core::crash::{self, Action, CRASH_POINTS};
use idem_core::publish::{Message, Publisher};
use idem_core::{Error, TableNames};
use idem_effects::{Dispatcher, DispatcherConfig, EffectMetrics};
use idem_kafka::{KafkaPublisher, KafkaSource, consumer_config};
use idem_reference::{PaidOrder, Settlement};
use idem_relay::{Relay, RelayConfig, RelayMetrics, TopicNaming};
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::broker::Broker;
use world::{Databases, Pool};

#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Paid orders to write (each one transaction: order row + order.paid event).
    #[arg(long, default_value_t = 10_000)]
    pub orders: u64,
    /// A PostgreSQL server URL: the demo creates (and drops) three databases on it. Default:
    /// SQLite files.
    #[arg(long)]
    pub db: Option<String>,
    /// `embedded` (librdkafka's in-process mock cluster), `kafka` (start a single-node Apache
    /// Kafka with scripts/kafka, stopped at the end) or bootstrap servers.
    #[arg(long, default_value = "embedded")]
    pub brokers: String,
    /// Directory for the SQLite files (default: a temporary directory, deleted afterwards).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// How many times each named crash point fires.
    #[arg(long, default_value_t = 3)]
    pub crashes: u64,
    /// Published events forced to be published again (extra duplicate deliveries).
    #[arg(long, default_value_t = 200)]
    pub republish: u64,
    /// Copies of published events sent with a changed payload (idempotency conflicts).
    #[arg(long, default_value_t = 3)]
    pub conflicts: u64,
    /// Relays.
    #[arg(long, default_value_t = 2)]
    pub relays: usize,
    /// Settlement consumers (one group).
    #[arg(long, default_value_t = 2)]
    pub consumers: usize,
    /// Give up (a liveness failure) if the pipeline has not settled by then.
    #[arg(long, default_value = "10m", value_parser = idem_cli::util::parse_duration)]
    pub deadline: Duration,
    /// Keep the databases afterwards.
    #[arg(long)]
    pub keep: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What the demo shows at the end.
#[derive(Debug, Serialize)]
pub struct DemoReport {
    pub ok: bool,
    pub failures: Vec<String>,
    pub databases: String,
    /// What the broker is (`Broker::kind`).
    pub broker: &'static str,
    /// Its bootstrap servers.
    pub brokers: String,
    pub seconds: f64,
    pub orders: i64,
    pub events_published: i64,
    pub deliveries: i64,
    pub duplicate_deliveries: u64,
    pub duplicate_skips: u64,
    pub republishes: u64,
    pub retries: u64,
    pub idempotency_conflicts: u64,
    pub dead_letters: i64,
    pub settlements: i64,
    pub points_awards: i64,
    pub effect_attempts: i64,
    pub crash_points_fired: BTreeMap<String, u64>,
    pub restarts: BTreeMap<String, u64>,
    pub lost: u64,
    pub duplicate_effects: u64,
    pub verify: idem_verify::Report,
}

/// Shared stop signal and counters.
#[derive(Clone)]
struct Ctl {
    stop: watch::Receiver<bool>,
    restarts: Arc<BTreeMap<&'static str, AtomicU64>>,
}

impl Ctl {
    fn shutdown(&self) -> impl Future<Output = ()> + Send + use<> {
        let mut rx = self.stop.clone();
        async move {
            let _ = rx.wait_for(|v| *v).await;
        }
    }

    fn stopped(&self) -> bool {
        *self.stop.borrow()
    }

    fn restarted(&self, component: &'static str) {
        if let Some(c) = self.restarts.get(component) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Runs `attempt` until it ends without a crash point; a crash point "kills" the component
/// (its state is dropped, nothing is cleaned up) and a new instance starts.
async fn supervise<F, Fut>(ctl: Ctl, component: &'static str, mut attempt: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = idem_core::Result<()>>,
{
    loop {
        match attempt().await {
            Ok(()) => return Ok(()),
            Err(Error::CrashPoint(point)) => {
                tracing::info!(
                    component,
                    point,
                    "crash point fired; restarting the component"
                );
                ctl.restarted(component);
                if ctl.stopped() {
                    return Ok(());
                }
            }
            Err(e) => return Err(e).with_context(|| format!("{component} failed")),
        }
    }
}

const RUN_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

fn run_id() -> String {
    let mut n = u64::from(std::process::id())
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
    (0..8)
        .map(|_| {
            let c = RUN_ALPHABET[(n % RUN_ALPHABET.len() as u64) as usize];
            n /= RUN_ALPHABET.len() as u64;
            char::from(c)
        })
        .collect()
}

fn registry_sum(registries: &[&prometheus::Registry], name: &str) -> u64 {
    registries
        .iter()
        .flat_map(|r| r.gather())
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().to_vec())
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    if !crash::ENABLED {
        bail!("this idem binary was built without crash points (the `failpoints` feature)");
    }
    let started = Instant::now();
    let run = run_id();
    let tables = TableNames::default();
    let dbs = Databases::create(args.db.as_deref(), args.dir.clone(), &run, &tables).await?;
    let prefix = format!("idem-demo-{run}.");
    let topic = format!("{prefix}order");
    let broker = Broker::start(&args.brokers).await?;
    broker.create_topic(&topic, 4).await?;
    eprintln!(
        "idem demo: {} orders through {} relays, {} consumers, the dispatcher and the points API; {}; broker {} at {}",
        args.orders,
        args.relays,
        args.consumers,
        dbs.location,
        broker.kind(),
        broker.bootstrap()
    );
    // Ctrl-C or SIGTERM ends the demo early: the databases are still dropped and a Kafka node
    // it started is stopped (when `broker` is dropped).
    let interrupted = idem_cli::util::shutdown_signal()?;
    let result = tokio::select! {
        r = drive(&args, &dbs, &broker, &tables, &topic, &prefix, started) => r,
        () = interrupted => Err(anyhow::anyhow!("interrupted; the demo's databases are dropped")),
    };
    crash::disarm_all();
    let cleanup = dbs.cleanup(args.keep).await;
    let report = result?;
    cleanup?;
    idem_cli::verify_cmd::emit(&report, args.json, report.ok, print_report)
}

#[allow(clippy::too_many_lines)]
async fn drive(
    args: &DemoArgs,
    dbs: &Databases,
    broker: &Broker,
    tables: &TableNames,
    topic: &str,
    prefix: &str,
    started: Instant,
) -> anyhow::Result<DemoReport> {
    let (stop_tx, stop) = watch::channel(false);
    let components = ["relay", "settlement", "dispatcher"];
    let ctl = Ctl {
        stop,
        restarts: Arc::new(components.iter().map(|c| (*c, AtomicU64::new(0))).collect()),
    };
    let (relay_reg, consumer_reg, effect_reg) = (
        prometheus::Registry::new(),
        prometheus::Registry::new(),
        prometheus::Registry::new(),
    );
    let relay_metrics = RelayMetrics::new(&relay_reg)?;
    let consumer_metrics = ConsumerMetrics::new(&consumer_reg)?;
    let effect_metrics = EffectMetrics::new(&effect_reg)?;
    let mut tasks: Vec<(&'static str, JoinHandle<anyhow::Result<()>>)> = vec![];

    // The points API on a loopback port.
    let app = match &dbs.points {
        Pool::Pg(p) => idem_reference::points::router(
            idem_reference::points::PointsDb::Postgres(p.clone()),
            idem_postgres::PgKeyStore::new(p.clone(), tables.clone()),
            idem_http::IdempotencyConfig::default(),
        ),
        Pool::Lite(p) => idem_reference::points::router(
            idem_reference::points::PointsDb::Sqlite(p.clone()),
            idem_sqlite::SqliteKeyStore::new(p.clone(), tables.clone()),
            idem_http::IdempotencyConfig::default(),
        ),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let target = format!("http://{}/awards", listener.local_addr()?);
    let api_stop = ctl.shutdown();
    tasks.push((
        "points-api",
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(api_stop)
                .await
                .context("the points API")
        }),
    ));

    // Relays: short message timeout and lease so that a crashed relay's rows come back soon.
    let producer = idem_kafka::producer_config(
        &broker.bootstrap(),
        &[("message.timeout.ms".to_owned(), "1000".to_owned())],
    )?;
    let publisher = Arc::new(KafkaPublisher::new(producer)?);
    for i in 0..args.relays {
        let (ctl2, publisher, metrics) = (ctl.clone(), publisher.clone(), relay_metrics.clone());
        let orders = dbs.orders.clone();
        let config = RelayConfig {
            relay_id: format!("demo-relay-{i}"),
            batch_size: 100,
            lease: Duration::from_millis(2500),
            topics: TopicNaming {
                prefix: prefix.to_owned(),
                overrides: BTreeMap::new(),
            },
            prune: None,
            ..RelayConfig::default()
        };
        let tables = tables.clone();
        tasks.push((
            "relay",
            tokio::spawn(supervise(ctl.clone(), "relay", move || {
                let (orders, publisher, config, metrics, tables) = (
                    orders.clone(),
                    publisher.clone(),
                    config.clone(),
                    metrics.clone(),
                    tables.clone(),
                );
                let shutdown = ctl2.shutdown();
                async move {
                    match orders {
                        Pool::Pg(p) => {
                            Relay::new(
                                idem_postgres::PgStore::new(p, tables),
                                publisher,
                                config,
                                metrics,
                            )
                            .run(shutdown)
                            .await
                        }
                        Pool::Lite(p) => {
                            Relay::new(
                                idem_sqlite::SqliteStore::new(p, tables),
                                publisher,
                                config,
                                metrics,
                            )
                            .run(shutdown)
                            .await
                        }
                    }
                }
            })),
        ));
    }

    // Settlement consumers, one group; each restart is a new group member.
    // The Kafka group is unique to the run (a shared broker may hold other runs' groups); the
    // inbox's group is "settlement", as `idem verify`'s reference configuration expects, in
    // databases that are this run's alone.
    let kafka = consumer_config(&broker.bootstrap(), &format!("{prefix}settlement"), &[])?;
    for _ in 0..args.consumers {
        let (ctl2, metrics, kafka) = (ctl.clone(), consumer_metrics.clone(), kafka.clone());
        let (settle, tables, target, topic) = (
            dbs.settlement.clone(),
            tables.clone(),
            target.clone(),
            topic.to_owned(),
        );
        tasks.push((
            "settlement",
            tokio::spawn(supervise(ctl.clone(), "settlement", move || {
                let (settle, tables, target, metrics) = (
                    settle.clone(),
                    tables.clone(),
                    target.clone(),
                    metrics.clone(),
                );
                let source = KafkaSource::new(&kafka, std::slice::from_ref(&topic));
                let shutdown = ctl2.shutdown();
                async move {
                    let source = source?;
                    let mut config = ConsumerConfig::new("settlement");
                    config.batch_size = 100;
                    match settle {
                        Pool::Pg(p) => {
                            let handler = Settlement::with_points(
                                idem_postgres::PgIntents::new(p.clone(), tables.clone()),
                                target,
                            );
                            let inbox = idem_postgres::PgInbox::new(p, tables);
                            Consumer::new(inbox, handler, source, config, metrics)
                                .run(shutdown)
                                .await
                        }
                        Pool::Lite(p) => {
                            let handler = Settlement::with_points(
                                idem_sqlite::SqliteIntents::new(p.clone(), tables.clone()),
                                target,
                            );
                            let inbox = idem_sqlite::SqliteInbox::new(p, tables);
                            Consumer::new(inbox, handler, source, config, metrics)
                                .run(shutdown)
                                .await
                        }
                    }
                }
            })),
        ));
    }

    // The effect dispatcher.
    {
        let (ctl2, metrics, settle, tables) = (
            ctl.clone(),
            effect_metrics.clone(),
            dbs.settlement.clone(),
            tables.clone(),
        );
        let config = DispatcherConfig {
            batch: 50,
            // A probe and a request fit in the lease (2 × timeout + margin).
            lease: Duration::from_secs(3),
            timeout: Duration::from_secs(1),
            backoff: Duration::from_millis(50),
            backoff_max: Duration::from_secs(1),
            authorization: Some("Bearer settlement".to_owned()),
            concurrency: 16,
            ..DispatcherConfig::default()
        };
        tasks.push((
            "dispatcher",
            tokio::spawn(supervise(ctl.clone(), "dispatcher", move || {
                let (settle, tables, config, metrics) = (
                    settle.clone(),
                    tables.clone(),
                    config.clone(),
                    metrics.clone(),
                );
                let ctl3 = ctl2.clone();
                async move {
                    match settle {
                        Pool::Pg(p) => {
                            dispatch_loop(
                                Dispatcher::new(
                                    idem_postgres::PgIntents::new(p, tables),
                                    config,
                                    metrics,
                                )?,
                                &ctl3,
                            )
                            .await
                        }
                        Pool::Lite(p) => {
                            dispatch_loop(
                                Dispatcher::new(
                                    idem_sqlite::SqliteIntents::new(p, tables),
                                    config,
                                    metrics,
                                )?,
                                &ctl3,
                            )
                            .await
                        }
                    }
                }
            })),
        ));
    }

    // Faults, orders, duplicates, conflicts; then wait for the pipeline to settle.
    let target_fires = args.crashes;
    let faults_done = || crash::fired().iter().all(|(_, n)| *n >= target_fires);
    let mut written: u64 = 0;
    let mut republished: u64 = 0;
    let mut conflicts: u64 = 0;
    let mut forged_up_to: i64 = 0;
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut last_progress = Instant::now();
    let deadline = started + args.deadline;
    let orders_total = args.orders;
    loop {
        if Instant::now() > deadline {
            let _ = stop_tx.send(true);
            bail!(
                "liveness: the pipeline did not settle within {:?} (orders written {written}, crash points {:?})",
                args.deadline,
                crash::fired()
            );
        }
        // Crash points: keep each armed (error mode, on one of its next few hits) until it has
        // fired often enough.
        for p in CRASH_POINTS {
            let fired = crash::fired()
                .iter()
                .find(|(n, _)| n == p)
                .map_or(0, |(_, c)| *c);
            if fired < target_fires && !crash::is_armed(p) {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                crash::arm(p, Action::Error, 1 + (seed >> 60) % 4)?;
            }
        }
        // Orders: the requested number, then a few more at a time while crash points still
        // wait for work to pass through them (only when everything else is idle).
        let idle = {
            let w = i64::try_from(written).unwrap_or(i64::MAX);
            dbs.settlement
                .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'done'")
                .await?
                >= w
        };
        let pending = dbs
            .orders
            .scalar("SELECT count(*) FROM idem_outbox WHERE status <> 'published'")
            .await?;
        let batch = if written < orders_total {
            (orders_total - written).min(200)
        } else if !faults_done() && pending == 0 && idle {
            20
        } else {
            0
        };
        for n in written + 1..=written + batch {
            let order = PaidOrder::numbered("", n);
            match &dbs.orders {
                Pool::Pg(p) => {
                    idem_reference::place_order_postgres(
                        p,
                        &idem_postgres::Outbox::new(tables.clone()),
                        &order,
                    )
                    .await?
                }
                Pool::Lite(p) => {
                    idem_reference::place_order_sqlite(
                        p,
                        &idem_sqlite::Outbox::new(tables.clone()),
                        &order,
                    )
                    .await?
                }
            }
        }
        written += batch;
        // Extra duplicate deliveries: published rows sent again.
        if republished < args.republish && written >= orders_total / 4 {
            let k = (args.republish - republished).min(20);
            let sql = match &dbs.orders {
                Pool::Pg(_) => format!(
                    "UPDATE idem_outbox SET status = 'pending', next_attempt_at = '-infinity', published_at = NULL \
                     WHERE id IN (SELECT id FROM idem_outbox WHERE status = 'published' ORDER BY random() LIMIT {k})"
                ),
                Pool::Lite(_) => format!(
                    "UPDATE idem_outbox SET status = 'pending', next_attempt_at = 0, published_at = NULL \
                     WHERE id IN (SELECT id FROM idem_outbox WHERE status = 'published' ORDER BY random() LIMIT {k})"
                ),
            };
            republished += dbs.orders.exec(&sql).await?;
        }
        // Idempotency conflicts: a published event id sent again with another payload.
        if conflicts < args.conflicts && written >= orders_total / 2 {
            conflicts += inject_conflict(&dbs.orders, &publisher, topic, &mut forged_up_to).await?;
        }
        let settled = dbs
            .settlement
            .scalar("SELECT count(*) FROM settlements")
            .await?;
        let done = dbs
            .settlement
            .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'done'")
            .await?;
        let dead = dbs
            .settlement
            .scalar("SELECT count(*) FROM idem_dead_letters")
            .await?;
        let w = i64::try_from(written).unwrap_or(i64::MAX);
        let fired: u64 = crash::fired().iter().map(|(_, n)| *n).sum();
        if last_progress.elapsed() >= Duration::from_secs(1) {
            eprintln!(
                "idem demo: {:>5.1}s  orders {written}  unpublished {pending}  settled {settled}  awarded {done}  crash points fired {fired}/{}  republished {republished}  conflicts {conflicts}  restarts {}",
                started.elapsed().as_secs_f64(),
                CRASH_POINTS.len() as u64 * target_fires,
                ctl.restarts
                    .values()
                    .map(|c| c.load(Ordering::Relaxed))
                    .sum::<u64>()
            );
            last_progress = Instant::now();
        }
        let quiet = written >= orders_total
            && faults_done()
            && republished >= args.republish
            && conflicts >= args.conflicts
            && pending == 0
            && settled == w
            && done == w
            && u64::try_from(dead).unwrap_or(0) >= conflicts;
        if quiet {
            break;
        }
        tokio::time::sleep(Duration::from_millis(if batch > 0 { 0 } else { 100 })).await;
    }
    crash::disarm_all();
    let _ = stop_tx.send(true);
    for (name, task) in tasks {
        match tokio::time::timeout(Duration::from_secs(30), task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => return Err(e.context(format!("{name} stopped with an error"))),
            Ok(Err(e)) => bail!("{name} panicked: {e}"),
            Err(_) => bail!("{name} did not stop within 30 s"),
        }
    }
    eprintln!("idem demo: settled; verifying");
    let config =
        idem_verify::VerifyConfig::reference(&dbs.urls[0], &dbs.urls[1], Some(&dbs.urls[2]));
    let verify = idem_verify::verify(&config, &idem_verify::Options::default()).await?;
    let regs = [&relay_reg, &consumer_reg, &effect_reg];
    let inbox = verify.attempts.inbox.first().cloned().unwrap_or_default();
    let effects = verify.attempts.effects.first().cloned().unwrap_or_default();
    let mut report = DemoReport {
        ok: false,
        failures: vec![],
        databases: dbs.location.clone(),
        broker: broker.kind(),
        brokers: broker.bootstrap(),
        seconds: started.elapsed().as_secs_f64(),
        orders: dbs.orders.scalar("SELECT count(*) FROM orders").await?,
        events_published: dbs
            .orders
            .scalar("SELECT count(*) FROM idem_outbox WHERE status = 'published'")
            .await?,
        deliveries: inbox.deliveries,
        duplicate_deliveries: registry_sum(&regs, "idem_duplicate_delivery_total"),
        duplicate_skips: registry_sum(&regs, "idem_duplicate_skip_total"),
        republishes: registry_sum(&regs, "idem_outbox_republish_total"),
        retries: registry_sum(&regs, "idem_consumer_retry_total")
            + registry_sum(&regs, "idem_effect_retry_total"),
        idempotency_conflicts: registry_sum(&regs, "idem_idempotency_conflict_total"),
        dead_letters: dbs
            .settlement
            .scalar("SELECT count(*) FROM idem_dead_letters")
            .await?,
        settlements: dbs
            .settlement
            .scalar("SELECT count(*) FROM settlements")
            .await?,
        points_awards: dbs
            .points
            .scalar("SELECT count(*) FROM points_awards")
            .await?,
        effect_attempts: effects.attempts,
        crash_points_fired: crash::fired()
            .into_iter()
            .map(|(n, c)| (n.to_owned(), c))
            .collect(),
        restarts: ctl
            .restarts
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.load(Ordering::Relaxed)))
            .collect(),
        lost: verify.lost(),
        duplicate_effects: verify.duplicate_effects(),
        verify,
    };
    let mut failures = vec![];
    if !report.verify.clean {
        failures.push("idem verify found violations (see the report)".to_owned());
    }
    for (point, n) in &report.crash_points_fired {
        if *n < target_fires {
            failures.push(format!(
                "crash point {point} fired {n} times, fewer than {target_fires}"
            ));
        }
    }
    if report.duplicate_deliveries == 0 {
        failures.push("no duplicate delivery happened: the run proves nothing".to_owned());
    }
    if report.idempotency_conflicts < conflicts {
        failures.push(format!(
            "{conflicts} conflicting copies were sent but {} idempotency conflicts were counted",
            report.idempotency_conflicts
        ));
    }
    report.ok = failures.is_empty();
    report.failures = failures;
    Ok(report)
}

async fn dispatch_loop<S: idem_core::idempotency::IntentStore>(
    d: Dispatcher<S>,
    ctl: &Ctl,
) -> idem_core::Result<()> {
    let mut idle = Duration::from_millis(2);
    while !ctl.stopped() {
        if d.run_once().await? > 0 {
            idle = Duration::from_millis(2);
        } else {
            tokio::time::sleep(idle).await;
            idle = (idle * 2).min(Duration::from_millis(50));
        }
    }
    Ok(())
}

/// Sends a published event again under its own id with a changed amount: the consumer must
/// refuse it as an idempotency conflict (dead-lettered with the reason), never apply it.
///
/// Each conflict forges another event (the first published row after `forged_up_to`, which it
/// then advances): two copies of one forgery could meet in one consumer batch, where the second
/// is a duplicate of the first rather than a conflict, and only one would be dead-lettered.
async fn inject_conflict(
    orders: &Pool,
    publisher: &KafkaPublisher,
    topic: &str,
    forged_up_to: &mut i64,
) -> anyhow::Result<u64> {
    let sql = "SELECT id, event_id, aggregate_id FROM idem_outbox \
               WHERE status = 'published' AND id > $1 ORDER BY id LIMIT 1";
    let row: Option<(i64, String, String)> = match orders {
        Pool::Pg(p) => sqlx::query_as::<_, (i64, uuid::Uuid, String)>(sql)
            .bind(*forged_up_to)
            .fetch_optional(p)
            .await?
            .map(|(row_id, id, agg)| (row_id, id.to_string(), agg)),
        Pool::Lite(p) => {
            sqlx::query_as(sql)
                .bind(*forged_up_to)
                .fetch_optional(p)
                .await?
        }
    };
    let Some((row_id, event_id, order_id)) = row else {
        return Ok(0);
    };
    *forged_up_to = row_id;
    let payload = serde_json::json!({
        "order_id": order_id,
        "payment_id": "forged",
        "amount": "0.01",
        "currency": "EUR",
    });
    let h = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    let message = Message {
        topic: topic.to_owned(),
        key: order_id.clone(),
        payload: payload.to_string(),
        headers: vec![
            h("ce_id", &event_id),
            h("ce_type", idem_reference::ORDER_PAID),
            h("idem_aggregate_type", idem_reference::ORDER),
            h("idem_aggregate_id", &order_id),
        ],
    };
    let results = publisher.publish(std::slice::from_ref(&message)).await;
    Ok(u64::from(results.iter().all(Result::is_ok)))
}

fn print_report(r: &DemoReport) {
    println!();
    println!(
        "idem demo: {}",
        if r.ok {
            "OK: every effect happened once"
        } else {
            "FAILED"
        }
    );
    println!("  {} in {:.1} s", r.databases, r.seconds);
    let rows: [(&str, String); 17] = [
        ("orders (events written)", r.orders.to_string()),
        ("events published", r.events_published.to_string()),
        ("deliveries to the consumer", r.deliveries.to_string()),
        ("duplicate deliveries", r.duplicate_deliveries.to_string()),
        ("duplicate skips (inbox)", r.duplicate_skips.to_string()),
        ("republishes (relay)", r.republishes.to_string()),
        ("retries (consumer + effects)", r.retries.to_string()),
        ("idempotency conflicts", r.idempotency_conflicts.to_string()),
        ("dead letters (with reasons)", r.dead_letters.to_string()),
        ("settlements", r.settlements.to_string()),
        ("points awards", r.points_awards.to_string()),
        (
            "effect attempts (same key each)",
            r.effect_attempts.to_string(),
        ),
        (
            "crash points fired",
            r.crash_points_fired
                .iter()
                .map(|(k, v)| format!("{k} ×{v}"))
                .collect::<Vec<_>>()
                .join(", "),
        ),
        (
            "component restarts",
            r.restarts
                .iter()
                .map(|(k, v)| format!("{k} ×{v}"))
                .collect::<Vec<_>>()
                .join(", "),
        ),
        ("lost effects", r.lost.to_string()),
        ("duplicate effects", r.duplicate_effects.to_string()),
        (
            "verification",
            if r.verify.clean {
                "clean".to_owned()
            } else {
                "VIOLATIONS".to_owned()
            },
        ),
    ];
    for (k, v) in rows {
        println!("  {k:<34} {v}");
    }
    if !r.verify.clean {
        println!();
        print!("{}", r.verify.table());
    }
    for f in &r.failures {
        println!("  FAILED: {f}");
    }
}
