//! `idem-lab bench`: what idem does on this hardware, next to what the hardware does for the
//! same work in the same run (see docs/operating/performance.md).
//!
//! The system runs as child processes (`idem relay`, `idem-lab settlement`) draining a backlog,
//! then together under closed-loop and open-loop load. Each system phase is bracketed by its
//! ceiling, the leanest SQL (or raw rdkafka) for the same work, run just before and just after
//! it ([`ceilings`]); a ratio divides the system figure by the median of its ceiling's samples,
//! and the report keeps their spread. Every phase has a deadline: a stuck phase is reported
//! with its reason and the run goes on.

mod baselines;
mod ceilings;
mod child;
mod claims;
mod compare;
mod console;
mod cpu;
mod figures;
mod kafka;
mod latency;
mod noinbox;
mod pg;
mod plan;
mod report;
mod spread;
mod system;
mod verify;

use std::time::{Duration, Instant};

use anyhow::bail;
use clap::{Args, Subcommand};

use crate::broker::{Broker, SecuredMode};
use idem_cli::kafka_args::KafkaArgs;
use idem_kafka::{Connection, KafkaSecurity};
use kafka::TempDir;
use pg::Databases;
use plan::{PHASES, Phase};
use report::Report;
use spread::{Outcome, within};

/// The default PostgreSQL server.
pub(crate) const DEFAULT_DB: &str = "postgres://postgres@127.0.0.1:5432/postgres";

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
    /// The CDC relay's `--topic-prefix`.
    cdc_topic_prefix: String,
    /// Its topic for orders.
    cdc_topic: String,
    /// Its replication slot.
    cdc_slot: String,
}

impl Names {
    fn new() -> Self {
        let run = uuid::Uuid::new_v4().simple().to_string();
        let topic_prefix = format!("idem-bench-{run}.");
        let cdc_topic_prefix = format!("idem-bench-{run}-cdc.");
        Names {
            cdc_topic: format!("{cdc_topic_prefix}order"),
            cdc_slot: format!("idem_bench_{run}"),
            cdc_topic_prefix,
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
pub(crate) struct BenchArgs {
    #[command(subcommand)]
    mode: Option<Mode>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// Time and peak memory of `idem verify` over two tables of --rows rows each.
    Verify(verify::VerifyBenchArgs),
    /// Server time per page of `idem console` (p50, p99, max) over a million outbox and inbox
    /// rows and 100 000 dead letters, next to `SELECT 1` and a page that reads nothing.
    Console(console::ConsoleBenchArgs),
    /// The polling relay's claim and mark (no broker) over backlogs of each --shapes and
    /// --depths, each drain between two lean claim-and-mark drains of the same backlog.
    Claims(claims::ClaimsBenchArgs),
    /// Two runs' reports side by side: each figure of the second divided by the first's
    /// (TLS over plain text, a change over the code before it).
    Compare(compare::CompareArgs),
    /// (internal) the settlement consumer without its inbox, to price the inbox.
    #[command(hide = true)]
    NoInboxConsumer(crate::lab_consumer::LabConsumerArgs),
}

/// Options of a full bench run.
#[derive(Args, Debug, Clone)]
pub(crate) struct RunArgs {
    /// PostgreSQL server URL (any database on it); the bench creates and drops its own databases.
    #[arg(long, env = "IDEM_BENCH_DB", default_value = DEFAULT_DB)]
    db: String,
    /// `kafka` (start a single-node Apache Kafka with scripts/kafka, stopped at the end),
    /// `embedded` (librdkafka's mock cluster in this process) or bootstrap servers.
    #[arg(long, default_value = "kafka")]
    brokers: String,
    /// With `--brokers kafka`: the broker the bench starts secures its client listener
    /// (`scripts/kafka up --security`, a PKI and users made for the run), and every Kafka client
    /// of the run, idem's and the ceilings' alike, connects as that broker's client: `sasl_ssl`
    /// logs in with SCRAM-SHA-512 over TLS, `ssl` with a client certificate (mutual TLS).
    #[arg(long, value_enum, value_name = "MODE")]
    broker_security: Option<SecuredMode>,
    /// How every Kafka client of the run (the relays, the consumers, the raw produce and
    /// consume ceilings, the topics' admin client) connects to --brokers: the `--kafka-*` flags
    /// of `idem relay`.
    #[command(flatten)]
    kafka: Box<KafkaArgs>,
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
    /// How long each timed phase runs (`5s`, `500ms`).
    #[arg(long = "phase", default_value = "5s", value_parser = crate::num::seconds)]
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
    /// Runs of each ceiling just before and just after the system phase it bounds (the report
    /// gives min, median and max of the samples; ratios use the median).
    #[arg(long, default_value_t = 2)]
    ceiling_runs: u32,
    /// How long a drain may make no progress before it is reported stuck and the run goes on.
    #[arg(long = "stall", default_value = "60s", value_parser = crate::num::seconds)]
    stall_seconds: f64,
    /// (test) Holds a lock on every outbox row while the relay republishes, so that phase
    /// makes no progress: proves a stuck phase is reported and the run goes on.
    #[arg(long, hide = true)]
    lock_outbox_during_republish: bool,
    /// Print the report as JSON on stdout (progress stays on stderr).
    #[arg(long)]
    json: bool,
}

/// Runs `idem-lab bench`.
pub(crate) async fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.mode {
        Some(Mode::Verify(a)) => verify::run(a).await,
        Some(Mode::Console(a)) => console::run(a).await,
        Some(Mode::Claims(a)) => claims::run(a).await,
        Some(Mode::Compare(a)) => compare::run(&a),
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

    fn skipped(&mut self, title: &str, why: &str) {
        self.phase(&format!("skipped: {title} ({why})"));
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
        bail!("--backlog and --phase must be positive");
    }
    let mut progress = Progress {
        step: 0,
        total: PHASES.len(),
        started: Instant::now(),
    };
    progress.phase(&Phase::Setup.title(&args));
    let setup = Instant::now();
    let (broker, security) = start_broker(&args).await?;
    let kafka = Connection::new(broker.bootstrap(), security)?;
    if !matches!(broker, Broker::Embedded(_)) {
        args.kafka
            .check(&kafka.client_config(), "idem-lab bench")
            .await?;
    }
    let logs = TempDir::new("logs")?;
    // The children's secrets (the SASL password, a key's passphrase), a file each.
    let secrets = TempDir::new("secrets")?;
    let child_env = idem_cli::kafka_args::child_env(kafka.security(), &secrets.0)?;
    let mut dbs = Databases::new(&args.db);
    let mut report = Report::new(&args, broker.kind(), kafka.security());
    report.outcome(Phase::Setup, &Outcome::Done, setup.elapsed());
    // Ctrl-C or SIGTERM stops the run but still drops its databases (children die with it).
    let interrupted = idem_cli::util::shutdown_signal()?;
    let result = tokio::select! {
        r = phases(&args, &broker, &kafka, child_env, &mut dbs, &logs, &mut progress, &mut report) => r,
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

/// The broker of `--brokers` and the security its clients connect with: that of the
/// `--kafka-*` flags, or the run-made login of the broker `--broker-security` starts.
async fn start_broker(args: &RunArgs) -> anyhow::Result<(Broker, KafkaSecurity)> {
    let flags = args.kafka.security()?;
    let local = [crate::broker::KAFKA, idem_kafka::EMBEDDED].contains(&args.brokers.as_str());
    match args.broker_security {
        Some(_) if args.brokers != crate::broker::KAFKA => bail!(
            "--broker-security secures the broker the bench starts: use it with --brokers kafka"
        ),
        Some(_) if !flags.is_plaintext_default() => bail!(
            "--broker-security logs in as the started broker's own user: drop the --kafka-* security flags (IDEM_KAFKA_*)"
        ),
        Some(mode) => Broker::start_secured(mode).await,
        None if local && !flags.is_plaintext_default() => bail!(
            "--brokers {} is a plaintext broker: use --broker-security with --brokers kafka, or give the bootstrap servers of the secured cluster the --kafka-* flags are for",
            args.brokers
        ),
        None => Ok((Broker::start(&args.brokers).await?, flags)),
    }
}

/// What the phases share: the run's settings and figures, and the progress lines.
pub(crate) struct Ctx<'a> {
    args: &'a RunArgs,
    progress: &'a mut Progress,
    report: &'a mut Report,
    /// Each timed phase's length (`--phase`).
    secs: Duration,
    /// Connections of the many-connection phases.
    n: u32,
    /// Padding that makes each event's payload `--message-size` bytes.
    pad: usize,
    /// The broker's bootstrap servers and how every client of the run connects to them.
    kafka: Connection,
    /// The `IDEM_KAFKA_…` environment of the child processes: the same security.
    child_env: Vec<(&'static str, String)>,
    /// The orders' outbox.
    outbox: &'a idem_sql::postgres::Outbox,
    /// The ceilings' database (same schema as the system's, nothing else running on it).
    scratch: &'a sqlx::PgPool,
    /// Its URL.
    scratch_url: &'a str,
    /// The writers-alone ceiling's database: created empty at the start and written only by
    /// that ceiling, so it starts as empty as the sustained run's databases.
    writers: &'a sqlx::PgPool,
    /// The raw produce and consume baselines' topic.
    raw_topic: &'a str,
}

impl Ctx<'_> {
    /// Runs `phase` within its deadline unless a phase it needs did not end well, and records
    /// how it ended: its value when it ended well.
    async fn guarded<T>(
        &mut self,
        phase: Phase,
        f: impl AsyncFnOnce(&mut Self) -> anyhow::Result<T>,
    ) -> Option<T> {
        if let Some(missing) = phase.needs().iter().find(|p| !self.report.ended_well(**p)) {
            let why = format!("needs {}, which did not end well", missing.key());
            self.progress.skipped(&phase.title(self.args), &why);
            self.report
                .outcome(phase, &Outcome::Skipped(why), Duration::ZERO);
            return None;
        }
        self.progress.phase(&phase.title(self.args));
        let started = Instant::now();
        let limit = phase.deadline(self.args);
        let ended = within(limit, f(self)).await;
        let (outcome, value) = match ended {
            Ok(v) => (Outcome::Done, Some(v)),
            Err(o) => (o, None),
        };
        if let Some(why) = outcome.reason() {
            self.progress
                .note(&format!("{} {}: {why}", phase.key(), outcome.status()));
        }
        self.report.outcome(phase, &outcome, started.elapsed());
        value
    }
}

/// Every phase; figures go into `report` as they are measured.
#[allow(clippy::too_many_arguments)] // the run's parts, each owned by `run_all`
async fn phases(
    args: &RunArgs,
    broker: &Broker,
    kafka: &Connection,
    child_env: Vec<(&'static str, String)>,
    dbs: &mut Databases,
    logs: &TempDir,
    progress: &mut Progress,
    report: &mut Report,
) -> anyhow::Result<()> {
    // A record: the payload, about 450 bytes of relay headers, the key and framing.
    let partitions = kafka::partitions_for(
        broker,
        args.partitions,
        args.backlog,
        args.message_size + 512,
    );
    report.environment("partitions", &partitions.to_string());
    let names = Names::new();
    for topic in [&names.topic, &names.raw_topic, &names.cdc_topic] {
        broker.create_topic_over(kafka, topic, partitions).await?;
    }
    let n = plan::connections(args);
    let (scratch_url, scratch) = dbs.create("scratch", n + 4).await?;
    let (orders_url, orders) = dbs.create("orders", n + 4).await?;
    let (cdc_url, cdc) = dbs.create("cdc", 4).await?;
    let (settle_url, settle) = dbs.create("settle", 4).await?;
    let (noinbox_url, noinbox) = dbs.create("noinbox", 4).await?;
    // The sustained and latency runs and the writers-alone ceiling that bounds them each get
    // databases nothing else wrote to: late in a run the drains' databases hold the backlog
    // twice over (published, then republished), the scratch one every ceiling's rows.
    let (_, writers) = dbs.create("writers", n + 4).await?;
    let (live_orders_url, live_orders) = dbs.create("live_orders", n + 4).await?;
    let (live_settle_url, live_settle) = dbs.create("live_settle", 4).await?;
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&scratch)
        .await?;
    report.environment("postgres", &version);
    report.environment("postgres_tls_bench", &pg::session_tls(&scratch).await?);
    let outbox = idem_sql::postgres::Outbox::default();
    let mut c = Ctx {
        args,
        progress,
        report,
        secs: Duration::from_secs_f64(args.seconds),
        n,
        pad: pg::padding(args.message_size),
        kafka: kafka.clone(),
        child_env,
        outbox: &outbox,
        scratch: &scratch,
        scratch_url: &scratch_url,
        writers: &writers,
        raw_topic: &names.raw_topic,
    };
    baselines::run(&mut c).await;
    let system = system::SystemDbs {
        orders_url,
        orders,
        cdc_url,
        cdc,
        settle_url,
        settle,
        noinbox_url,
        noinbox,
        live: system::Pipeline {
            orders_url: live_orders_url,
            orders: live_orders,
            settle_url: live_settle_url,
            settle: live_settle,
        },
        names: &names,
        logs,
        db_prefix: dbs.prefix(),
    };
    system::run(&mut c, &system).await
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
