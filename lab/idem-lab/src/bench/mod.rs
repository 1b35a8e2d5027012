//! `idem-lab bench`: what idem costs on this hardware, next to same-run baselines of the same
//! PostgreSQL server and broker (see docs/operating/performance.md).
//!
//! The baselines run first — durable single-row inserts, the consumer's and the relay's own SQL
//! called directly, bare rdkafka produce and consume — then the system: the relay and the
//! settlement consumer run as child processes (`idem relay`, `idem-lab settlement`) draining a
//! backlog, then together under closed-loop and open-loop load. Each ratio divides a system
//! figure by the baseline that bounds it.

mod child;
mod kafka;
mod latency;
mod noinbox;
mod pg;
mod report;
mod verify;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::{Args, Subcommand};
use sqlx::PgPool;

use crate::broker::Broker;
use child::Child;
use kafka::TempDir;
use pg::{Databases, OrderWrite};
use report::Report;

/// The default PostgreSQL server.
pub const DEFAULT_DB: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Topics and consumer groups of one run, unique to it: a run on a shared broker (or a second
/// run on the same one) never reads another run's records.
struct Names {
    /// The relay's `--topic-prefix`.
    topic_prefix: String,
    /// The relay's topic for orders: the prefix and the aggregate type.
    topic: String,
    /// The raw baselines' topic.
    raw_topic: String,
    /// The settlement consumer's group.
    group: String,
    /// The consumer without the inbox's group.
    group_no_inbox: String,
}

impl Names {
    fn new() -> Self {
        let run = uuid::Uuid::new_v4().simple().to_string();
        let topic_prefix = format!("idem-bench-{run}.");
        Names {
            topic: format!("{topic_prefix}order"),
            raw_topic: format!("idem-bench-{run}.raw"),
            group: format!("idem-bench-{run}"),
            group_no_inbox: format!("idem-bench-{run}-no-inbox"),
            topic_prefix,
        }
    }
}

/// `idem-lab bench`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    mode: Option<Mode>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// Time and peak memory of `idem verify` over two tables of --rows rows each.
    Verify(verify::VerifyBenchArgs),
    /// (internal) the settlement consumer without its inbox, to price the inbox.
    #[command(hide = true)]
    NoInboxConsumer(crate::lab_consumer::LabConsumerArgs),
}

/// Options of a full bench run.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// PostgreSQL server URL (any database on it); the bench creates and drops its own databases.
    #[arg(long, env = "IDEM_BENCH_DB", default_value = DEFAULT_DB)]
    db: String,
    /// `kafka` (start a single-node Apache Kafka with scripts/kafka, stopped at the end),
    /// `embedded` (librdkafka's mock cluster in this process) or bootstrap servers.
    #[arg(long, default_value = "kafka")]
    brokers: String,
    /// Rows in the relay's backlog and events in the consumer's.
    #[arg(long, default_value_t = 100_000)]
    backlog: u64,
    /// Consumer records per transaction (`idem-lab settlement --batch-size`).
    #[arg(long, default_value_t = 200)]
    batch_size: usize,
    /// Relay rows per claim (`idem relay --batch-size`).
    #[arg(long, default_value_t = 500)]
    relay_batch_size: u32,
    /// Size of each event's JSON payload, bytes (the Kafka record value).
    #[arg(long, default_value_t = 256)]
    message_size: usize,
    /// Seconds of each timed phase.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Connections of the many-connection phases (inserts, business transactions, writers).
    #[arg(long, default_value_t = 16)]
    connections: u32,
    /// Partitions of the topics (more on the embedded broker when the backlog needs them).
    #[arg(long, default_value_t = 3)]
    partitions: i32,
    /// librdkafka consumer setting KEY=VALUE for the settlement consumers (repeatable), as
    /// `idem-lab settlement --consumer-config`.
    #[arg(long = "consumer-config", value_parser = idem_kafka::parse_setting)]
    consumer_config: Vec<(String, String)>,
    /// librdkafka producer setting KEY=VALUE for the relay (repeatable), as `idem relay
    /// --producer-config`.
    #[arg(long = "producer-config", value_parser = idem_kafka::parse_setting)]
    producer_config: Vec<(String, String)>,
    /// Print the report as JSON on stdout (progress stays on stderr).
    #[arg(long)]
    json: bool,
}

/// Runs `idem-lab bench`.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.mode {
        Some(Mode::Verify(a)) => verify::run(a).await,
        Some(Mode::NoInboxConsumer(a)) => noinbox::run(a).await,
        None => run_all(args.run).await,
    }
}

/// Progress lines on stderr.
struct Progress {
    step: usize,
    total: usize,
    started: Instant,
}

impl Progress {
    fn phase(&mut self, what: &str) {
        self.step += 1;
        eprintln!(
            "idem bench [{}/{}] {:>6.1}s  {what}",
            self.step,
            self.total,
            self.started.elapsed().as_secs_f64()
        );
    }

    fn note(&self, what: &str) {
        eprintln!(
            "idem bench          {:>6.1}s    {what}",
            self.started.elapsed().as_secs_f64()
        );
    }
}

async fn run_all(args: RunArgs) -> anyhow::Result<()> {
    if args.backlog == 0 || args.seconds <= 0.0 {
        bail!("--backlog and --seconds must be positive");
    }
    let mut progress = Progress {
        step: 0,
        total: 17,
        started: Instant::now(),
    };
    progress.phase("starting the broker and creating the databases");
    let broker = Broker::start(&args.brokers).await?;
    let logs = TempDir::new("logs")?;
    let mut dbs = Databases::new(&args.db);
    let mut report = Report::new(&args, broker.kind());
    // Ctrl-C or SIGTERM stops the run but still drops its databases (children die with it).
    let interrupted = idem_cli::util::shutdown_signal()?;
    let result = tokio::select! {
        r = phases(&args, &broker, &mut dbs, &logs, &mut progress, &mut report) => r,
        () = interrupted => Err(anyhow::anyhow!("interrupted; the bench databases are dropped")),
    };
    if let Err(e) = dbs.drop_all().await {
        tracing::warn!(error = %e, "could not drop the bench databases");
    }
    drop(broker);
    result?;
    report.finish();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.json())?);
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

/// Every phase; figures go into `report` as they are measured.
async fn phases(
    args: &RunArgs,
    broker: &Broker,
    dbs: &mut Databases,
    logs: &TempDir,
    progress: &mut Progress,
    report: &mut Report,
) -> anyhow::Result<()> {
    let secs = Duration::from_secs_f64(args.seconds);
    let n = args.connections.max(1);
    let pad = pg::padding(args.message_size);
    let brokers = broker.bootstrap();
    // A record: the payload, about 450 bytes of relay headers, the key and framing.
    let partitions = kafka::partitions_for(
        broker,
        args.partitions,
        args.backlog,
        args.message_size + 512,
    );
    report.environment("partitions", &partitions.to_string());
    let names = Names::new();
    broker.create_topic(&names.topic, partitions).await?;
    broker.create_topic(&names.raw_topic, partitions).await?;
    let (_, scratch) = dbs.create("scratch", n + 4).await?;
    let (orders_url, orders) = dbs.create("orders", n + 4).await?;
    let (settle_url, settle) = dbs.create("settle", 4).await?;
    let (noinbox_url, noinbox) = dbs.create("noinbox", 4).await?;
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&scratch)
        .await?;
    report.environment("postgres", &version);
    let outbox = idem_postgres::Outbox::default();

    // ---- baselines -------------------------------------------------------------------------
    progress.phase("baseline: durable single-row inserts, 1 connection");
    let v = pg::insert_rate(&scratch, 1, secs, args.message_size).await?;
    report.figure("pg_insert_1conn_per_s", v);
    progress.phase(&format!(
        "baseline: durable single-row inserts, {n} connections"
    ));
    let v = pg::insert_rate(&scratch, n, secs, args.message_size).await?;
    report.figure("pg_insert_nconn_per_s", v);

    sqlx::query(pg::PLAIN_TABLE).execute(&scratch).await?;
    for (conns, suffix) in [(1, "1conn"), (n, "nconn")] {
        progress.phase(&format!(
            "business transactions: alone, with the outbox insert, with a plain second row; {conns} connection(s)"
        ));
        for (how, key) in [
            (OrderWrite::Alone, format!("business_tx_{suffix}_per_s")),
            (
                OrderWrite::Outbox(outbox.clone()),
                format!("business_tx_outbox_{suffix}_per_s"),
            ),
            (
                OrderWrite::PlainRow,
                format!("business_tx_plain_{suffix}_per_s"),
            ),
        ] {
            let prefix = format!("{key}-");
            let v = business_rate(&scratch, how, conns, secs, &prefix, pad).await?;
            report.figure(&key, v);
        }
    }

    progress.phase(&format!(
        "baseline: the consumer's SQL directly (inbox insert + settlement), batches of {}",
        args.batch_size
    ));
    let v = pg::consumer_sql_rate(&scratch, args.batch_size, secs, pad, true, "s1-").await?;
    report.figure("consumer_sql_per_s", v);
    let v = pg::consumer_sql_rate(&scratch, args.batch_size, secs, pad, false, "s2-").await?;
    report.figure("consumer_sql_no_inbox_per_s", v);

    progress.phase(&format!(
        "baseline: the relay's claim-and-mark SQL directly, {} rows, batches of {}",
        args.backlog, args.relay_batch_size
    ));
    sqlx::query("TRUNCATE idem_outbox, idem_outbox_aggregates")
        .execute(&scratch)
        .await?;
    pg::fill_backlog(&scratch, "r-", args.backlog, pad).await?;
    let mut tick = Ticker::new();
    let v = pg::relay_sql_rate(&scratch, args.relay_batch_size, |rows| {
        tick.every_second(|| progress.note(&format!("claimed and marked {rows} rows")));
    })
    .await?;
    report.figure("relay_sql_per_s", v);

    progress.phase(&format!(
        "baseline: raw rdkafka produce of {} records of {} bytes",
        args.backlog, args.message_size
    ));
    let payload = pg::order_event("b-", 1, pad)?
        .1
        .payload()
        .as_bytes()
        .to_vec();
    let mut tick = Ticker::new();
    let v = kafka::produce_rate(&brokers, &names.raw_topic, args.backlog, &payload, |done| {
        tick.every_second(|| progress.note(&format!("{done} records acknowledged")));
    })
    .await?;
    report.figure("kafka_produce_per_s", v);

    progress.phase("baseline: raw rdkafka consume of the same records");
    let mut tick = Ticker::new();
    let v = kafka::consume_rate(
        &brokers,
        &names.raw_topic,
        args.backlog,
        drain_timeout(args),
        |done| {
            tick.every_second(|| progress.note(&format!("{done} records consumed")));
        },
    )
    .await?;
    report.figure("kafka_consume_per_s", v);

    // ---- the system ------------------------------------------------------------------------
    progress.phase(&format!(
        "writing a backlog of {} paid orders",
        args.backlog
    ));
    pg::fill_backlog(&orders, "b-", args.backlog, pad).await?;

    progress.phase("relay drain (idem relay as a child process)");
    let mut relay_args = args_of(&[
        "relay",
        "--db",
        &orders_url,
        "--brokers",
        &brokers,
        "--topic-prefix",
        &names.topic_prefix,
        "--batch-size",
        &args.relay_batch_size.to_string(),
        "--no-prune",
    ]);
    for (k, v) in &args.producer_config {
        relay_args.extend(["--producer-config".to_owned(), format!("{k}={v}")]);
    }
    let published = "idem_outbox WHERE status = 'published'";
    let mut ctx = DrainCtx {
        progress,
        logs,
        target: args.backlog,
        timeout: drain_timeout(args),
    };
    let (relay, elapsed) = ctx
        .drain(
            "relay",
            &relay_args,
            &orders,
            published,
            "rows published",
            &mut [],
        )
        .await?;
    report.peak("relay_peak_rss_mib", relay.peak_rss());
    relay.stop().await?;
    let v = pg::stamped_rate(
        &orders,
        "idem_outbox",
        "published_at",
        "status = 'published'",
        elapsed,
    )
    .await?;
    report.figure("relay_drain_per_s", v);

    ctx.progress
        .phase("consumer drain (idem settlement as a child process)");
    let batch = args.batch_size.to_string();
    let consumer_config: Vec<String> = args
        .consumer_config
        .iter()
        .flat_map(|(k, v)| ["--consumer-config".to_owned(), format!("{k}={v}")])
        .collect();
    let mut settlement_args = args_of(&[
        "settlement",
        "--db",
        &settle_url,
        "--brokers",
        &brokers,
        "--topic",
        &names.topic,
        "--group",
        &names.group,
        "--batch-size",
        &batch,
    ]);
    settlement_args.extend(consumer_config.iter().cloned());
    let (settlement, elapsed) = ctx
        .drain(
            "settlement",
            &settlement_args,
            &settle,
            "settlements",
            "events settled",
            &mut [],
        )
        .await?;
    report.peak("consumer_peak_rss_mib", settlement.peak_rss());
    settlement.stop().await?;
    let v = pg::stamped_rate(&settle, "settlements", "settled_at", "true", elapsed).await?;
    report.figure("consumer_drain_per_s", v);

    ctx.progress
        .phase("consumer drain without the inbox (same consumer, inbox insert left out)");
    let mut bare_args = args_of(&[
        "bench",
        "no-inbox-consumer",
        "--db",
        &noinbox_url,
        "--brokers",
        &brokers,
        "--topic",
        &names.topic,
        "--group",
        &names.group_no_inbox,
        "--batch-size",
        &batch,
    ]);
    bare_args.extend(consumer_config);
    let (bare, elapsed) = ctx
        .drain(
            "no-inbox-consumer",
            &bare_args,
            &noinbox,
            "settlements",
            "events settled",
            &mut [],
        )
        .await?;
    bare.stop().await?;
    let v = pg::stamped_rate(&noinbox, "settlements", "settled_at", "true", elapsed).await?;
    report.figure("consumer_no_inbox_drain_per_s", v);
    noinbox.close().await;

    ctx.progress
        .phase("republishing the whole backlog (every event a second time)");
    sqlx::query("UPDATE idem_outbox SET status = 'pending', published_at = NULL")
        .execute(&orders)
        .await?;
    let (mut relay, _) = ctx
        .drain(
            "relay-2",
            &relay_args,
            &orders,
            published,
            "rows republished",
            &mut [],
        )
        .await?;

    ctx.progress
        .phase("consumer drain of 100 % redelivered duplicates");
    // The group is ours (a UUID), never input.
    let dups = format!("consumer_group = '{}' AND delivery_count >= 2", names.group);
    let (mut settlement, elapsed) = ctx
        .drain(
            "settlement-2",
            &settlement_args,
            &settle,
            &format!("idem_inbox WHERE {dups}"),
            "duplicates skipped",
            &mut [&mut relay],
        )
        .await?;
    let v = pg::stamped_rate(&settle, "idem_inbox", "last_delivered_at", &dups, elapsed).await?;
    report.figure("duplicates_drain_per_s", v);
    let progress = ctx.progress;

    progress.phase(&format!(
        "sustained end to end: {n} writers as fast as they can, relay and consumer running"
    ));
    let (sustained, writers) = sustained(args, &orders, &settle, &outbox, pad, progress).await?;
    report.figure("e2e_writers_per_s", writers);
    report.figure("e2e_sustained_per_s", sustained);
    let expected = pg::count(&orders, "orders").await?;
    wait_for(
        progress,
        &settle,
        "settlements",
        expected,
        "settled (draining what the writers left)",
        &mut [&mut settlement, &mut relay],
        drain_timeout(args),
    )
    .await?;

    progress.phase(
        "commit → settlement latency, open-loop arrivals at 25, 50 and 80 % of the sustained rate",
    );
    for pct in [25u32, 50, 80] {
        let rate = sustained * f64::from(pct) / 100.0;
        progress.note(&format!(
            "{pct} %: {rate:.0} orders/s for {:.0} s",
            args.seconds
        ));
        relay.check_alive()?;
        settlement.check_alive()?;
        let run = latency::open_loop(
            &orders,
            &settle,
            &outbox,
            &format!("l{pct}-"),
            pad,
            rate,
            secs,
            n,
        )
        .await?;
        progress.note(&format!(
            "{pct} %: p50 {:.1} ms, p99 {:.1} ms, p99.9 {:.1} ms ({} samples); relay stage p50 {:.1} p99 {:.1} ms, consumer stage p50 {:.1} p99 {:.1} ms",
            run.p50_ms, run.p99_ms, run.p999_ms, run.samples,
            run.relay_stage_ms.0, run.relay_stage_ms.1, run.consumer_stage_ms.0, run.consumer_stage_ms.1
        ));
        report.latency(pct, &run);
    }
    settlement.stop().await?;
    relay.stop().await?;
    Ok(())
}

/// Business transactions per second on `conns` connections, writing their event as `how` says.
async fn business_rate(
    pool: &PgPool,
    how: OrderWrite,
    conns: u32,
    secs: Duration,
    prefix: &str,
    pad: usize,
) -> anyhow::Result<f64> {
    let (pool, prefix) = (pool.clone(), prefix.to_owned());
    pg::closed_loop(conns, secs, move |i| {
        let (pool, how, prefix) = (pool.clone(), how.clone(), prefix.clone());
        async move { pg::place_order(&pool, &how, &prefix, i, pad).await }
    })
    .await
}

/// Writers as fast as they can for `--seconds` while the relay and consumer run: settlements
/// per second over the run after a warm-up fifth, and orders written per second.
async fn sustained(
    args: &RunArgs,
    orders: &PgPool,
    settle: &PgPool,
    outbox: &idem_postgres::Outbox,
    pad: usize,
    progress: &Progress,
) -> anyhow::Result<(f64, f64)> {
    let secs = Duration::from_secs_f64(args.seconds);
    let (pool, how) = (orders.clone(), OrderWrite::Outbox(outbox.clone()));
    let written = Arc::new(AtomicU64::new(0));
    let w = written.clone();
    let writers = tokio::spawn(pg::closed_loop(args.connections, secs, move |i| {
        let (pool, how, w) = (pool.clone(), how.clone(), w.clone());
        async move {
            pg::place_order(&pool, &how, "e-", i, pad).await?;
            w.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }));
    let start = Instant::now();
    tokio::time::sleep(secs / 5).await;
    let (c0, t0) = (pg::count(settle, "settlements").await?, Instant::now());
    let mut tick = Ticker::new();
    while !writers.is_finished() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        tick.every_second(|| {
            progress.note(&format!(
                "{} orders written, {:.0} s",
                written.load(Ordering::Relaxed),
                start.elapsed().as_secs_f64()
            ))
        });
    }
    let (c1, t1) = (pg::count(settle, "settlements").await?, Instant::now());
    let writer_rate = writers.await??;
    let rate = (c1 - c0) as f64 / t1.duration_since(t0).as_secs_f64().max(1e-9);
    Ok((rate, writer_rate))
}

fn args_of(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}

/// What the drain phases share.
struct DrainCtx<'a> {
    progress: &'a mut Progress,
    logs: &'a TempDir,
    target: u64,
    timeout: Duration,
}

impl DrainCtx<'_> {
    /// Starts child `name` (`idem ARGS`) and waits until `SELECT count(*) FROM what` on `pool`
    /// reaches the backlog; returns the still-running child and the time it took.
    #[allow(clippy::too_many_arguments)]
    async fn drain(
        &mut self,
        name: &str,
        args: &[String],
        pool: &PgPool,
        what: &str,
        label: &str,
        others: &mut [&mut Child],
    ) -> anyhow::Result<(Child, Duration)> {
        let started = Instant::now();
        let mut child = Child::spawn(name, args, &self.logs.0)?;
        let mut watched: Vec<&mut Child> = vec![&mut child];
        watched.extend(others.iter_mut().map(|c| &mut **c));
        wait_for(
            self.progress,
            pool,
            what,
            self.target,
            label,
            &mut watched,
            self.timeout,
        )
        .await?;
        Ok((child, started.elapsed()))
    }
}

/// How long a drain may take before the bench gives up.
fn drain_timeout(args: &RunArgs) -> Duration {
    Duration::from_secs(120 + args.backlog / 100)
}

/// Polls `SELECT count(*) FROM <what>` until it reaches `target`, failing if a child exits or
/// the time runs out.
async fn wait_for(
    progress: &Progress,
    pool: &PgPool,
    what: &str,
    target: u64,
    label: &str,
    children: &mut [&mut Child],
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut tick = Ticker::new();
    loop {
        let n = pg::count(pool, what).await?;
        if n >= target {
            return Ok(());
        }
        for c in children.iter_mut() {
            c.check_alive()?;
        }
        if Instant::now() > deadline {
            let logs: Vec<String> = children.iter().map(|c| c.log_tail()).collect();
            bail!(
                "{label}: {n} of {target} after {timeout:?}; logs:\n{}",
                logs.join("\n---\n")
            );
        }
        tick.every_second(|| progress.note(&format!("{n}/{target} {label}")));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs something at most once a second.
struct Ticker(Instant);

impl Ticker {
    fn new() -> Self {
        Ticker(Instant::now())
    }

    fn every_second(&mut self, f: impl FnOnce()) {
        if self.0.elapsed() >= Duration::from_secs(1) {
            self.0 = Instant::now();
            f();
        }
    }
}
