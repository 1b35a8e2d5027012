//! `idem-lab demo`: the reference pipeline in one process — order writer, two relays, two
//! settlement consumers, the effect dispatcher and the points API — on SQLite files and
//! librdkafka's in-process mock cluster (or PostgreSQL and real brokers), with every named crash
//! point fired several times, the crashed component restarted in-process, duplicate deliveries
//! and idempotency conflicts injected; it ends with `idem verify`'s verdict.
//!
//! [`plan`] decides (pure), [`inject`] drives the loop, [`components`] wires the pipeline under
//! [`supervise`], [`report`] draws the verdict, [`world`] holds the databases.

mod components;
mod inject;
mod plan;
mod report;
mod supervise;
pub(crate) mod world;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Args;
use idem_consumer::ConsumerMetrics;
use idem_core::TableNames;
use idem_core::crash;
use idem_effects::EffectMetrics;
use idem_kafka::{KafkaPublisher, consumer_config};
use idem_relay::RelayMetrics;
use idem_sql::AnyStore;

use crate::broker::Broker;
use components::Tasks;
use inject::Injector;
use plan::Targets;
use report::{DemoReport, Evidence, Rows, print_report, registry_sum};
use supervise::Ctl;
use world::Databases;

#[derive(Args, Debug, Clone)]
pub(crate) struct DemoArgs {
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

const RUN_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

fn run_id() -> String {
    let mut n = u64::from(std::process::id())
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0);
    (0..8)
        .map(|_| {
            let base = u64::try_from(RUN_ALPHABET.len()).unwrap_or(1);
            let c = RUN_ALPHABET[usize::try_from(n % base).unwrap_or(0)];
            n /= base;
            char::from(c)
        })
        .collect()
}

pub(crate) async fn run(args: DemoArgs) -> anyhow::Result<()> {
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
    let mut report = result?;
    cleanup?;
    if !args.keep {
        report.databases.push_str(" (removed; --keep keeps them)");
    }
    idem_cli::verify_cmd::emit(&report, args.json, report.ok, print_report)
}

/// The pipeline's metrics, one registry per engine, shared by every restart.
struct Metrics {
    relay_reg: prometheus::Registry,
    consumer_reg: prometheus::Registry,
    effect_reg: prometheus::Registry,
    relay: RelayMetrics,
    consumer: ConsumerMetrics,
    effect: EffectMetrics,
}

impl Metrics {
    fn new() -> anyhow::Result<Self> {
        let (relay_reg, consumer_reg, effect_reg) = (
            prometheus::Registry::new(),
            prometheus::Registry::new(),
            prometheus::Registry::new(),
        );
        Ok(Metrics {
            relay: RelayMetrics::new(&relay_reg)?,
            consumer: ConsumerMetrics::new(&consumer_reg)?,
            effect: EffectMetrics::new(&effect_reg)?,
            relay_reg,
            consumer_reg,
            effect_reg,
        })
    }

    /// The sum of counter `name` over the three registries.
    fn sum(&self, name: &str) -> u64 {
        registry_sum(
            &[&self.relay_reg, &self.consumer_reg, &self.effect_reg],
            name,
        )
    }
}

/// Starts the pipeline, injects until it settles, stops it and draws the verdict.
async fn drive(
    args: &DemoArgs,
    dbs: &Databases,
    broker: &Broker,
    tables: &TableNames,
    topic: &str,
    prefix: &str,
    started: Instant,
) -> anyhow::Result<DemoReport> {
    let (ctl, stop) = Ctl::new();
    let metrics = Metrics::new()?;
    let mut tasks = Tasks::default();
    let orders = AnyStore::open(dbs.orders.clone(), tables.clone());
    let settlement = AnyStore::open(dbs.settlement.clone(), tables.clone());
    let target = components::points_api(&mut tasks, &ctl, &dbs.points.clone(), tables).await?;
    // Relays: short message timeout so that a crashed relay's rows come back soon.
    let producer = idem_kafka::producer_config(
        &broker.bootstrap(),
        &[("message.timeout.ms".to_owned(), "1000".to_owned())],
    )?;
    let publisher = Arc::new(KafkaPublisher::new(producer)?);
    let relay_metrics = &metrics.relay;
    components::relays(
        &mut tasks,
        &ctl,
        args.relays,
        &orders,
        &publisher,
        prefix,
        relay_metrics,
    );
    let kafka = consumer_config(
        &broker.bootstrap(),
        &format!("{prefix}settlement"),
        &components::consumer_settings(matches!(broker, Broker::Embedded(_))),
    )?;
    let consumer_metrics = &metrics.consumer;
    components::consumers(
        &mut tasks,
        &ctl,
        args.consumers,
        &settlement,
        &kafka,
        topic,
        &target,
        consumer_metrics,
    );
    components::dispatcher(&mut tasks, &ctl, &settlement, &metrics.effect);

    let targets = Targets {
        orders: args.orders,
        crashes: args.crashes,
        republish: args.republish,
        conflicts: args.conflicts,
    };
    let mut injector = Injector::new(targets, orders, dbs.settlement.clone(), &publisher, topic);
    injector
        .until_settled(&ctl, &stop, started, args.deadline)
        .await?;
    crash::disarm_all();
    stop.stop();
    tasks.join().await?;
    eprintln!("idem demo: settled; verifying");
    let end = End {
        broker,
        ctl: &ctl,
        metrics: &metrics,
        started,
    };
    end.report(dbs, &targets, injector.tally.conflicts).await
}

/// What the report is drawn from once the pipeline has stopped.
struct End<'a> {
    broker: &'a Broker,
    ctl: &'a Ctl,
    metrics: &'a Metrics,
    started: Instant,
}

impl End<'_> {
    /// Runs `idem verify` over the three databases and assembles the report and its verdict.
    async fn report(
        &self,
        dbs: &Databases,
        targets: &Targets,
        conflicts_sent: u64,
    ) -> anyhow::Result<DemoReport> {
        let config = idem_reference::verify_config(&dbs.urls[0], &dbs.urls[1], Some(&dbs.urls[2]));
        let verify = idem_verify::verify(&config, &idem_verify::Options::default()).await?;
        let inbox = verify.attempts.inbox.first().cloned().unwrap_or_default();
        let effects = verify.attempts.effects.first().cloned().unwrap_or_default();
        let m = self.metrics;
        let seconds = self.started.elapsed().as_secs_f64();
        let rows = Rows::count(dbs).await?;
        let mut report = DemoReport {
            ok: false,
            failures: vec![],
            databases: dbs.location.clone(),
            broker: self.broker.kind(),
            brokers: self.broker.bootstrap(),
            seconds,
            orders: rows.orders,
            events_published: rows.events_published,
            deliveries: inbox.deliveries,
            duplicate_deliveries: m.sum("idem_duplicate_delivery_total"),
            duplicate_skips: m.sum("idem_duplicate_skip_total"),
            republishes: m.sum("idem_outbox_republish_total"),
            retries: m.sum("idem_consumer_retry_total") + m.sum("idem_effect_retry_total"),
            idempotency_conflicts: m.sum("idem_idempotency_conflict_total"),
            dead_letters: rows.dead_letters,
            settlements: rows.settlements,
            points_awards: rows.points_awards,
            effect_attempts: effects.attempts,
            crash_points_fired: inject::pipeline_fired()
                .into_iter()
                .map(|(p, c)| (p.to_string(), c))
                .collect(),
            restarts: self.ctl.restarts(),
            lost: verify.lost(),
            duplicate_effects: verify.duplicate_effects(),
            verify,
        };
        let evidence = Evidence {
            verify_clean: report.verify.clean,
            fired: &report.crash_points_fired,
            duplicate_deliveries: report.duplicate_deliveries,
            conflicts_counted: report.idempotency_conflicts,
        };
        report.failures = report::verdict(&evidence, targets.crashes, conflicts_sent);
        report.ok = report.failures.is_empty();
        Ok(report)
    }
}
