//! `idem-lab chaos`: the reference pipeline as separate OS processes against PostgreSQL and an
//! Apache Kafka node — two order writers, two relays, two settlement consumers in one group, an
//! audit consumer group, the effect dispatcher and the points API — while a seeded schedule
//! kills them (SIGKILL), pauses them (SIGSTOP/SIGCONT), restarts them with named crash points
//! armed, kills and restarts the broker, writes hostile rows through the SQL contract and opens
//! slow windows (a locked table, a slow remote). Then it stops injecting, waits for the pipeline to settle
//! (a deadline: missing it is a liveness failure), runs `idem verify`, and reports.
//!
//! `--break MECHANISM` runs a negative control: one mechanism deliberately broken, which the
//! run must report as a violation.
//!
//! `--pipeline FILE` runs a pipeline a file describes instead (`pipeline/`), the reference
//! pipeline's own file included (`pipelines/reference`): PostgreSQL crashes, 3-node clusters and
//! leader kills, network faults to PostgreSQL and Kafka, crash points and the negative controls
//! that need no hostile row or slow window run there.
//!
//! `--tls` runs it secured: Kafka over SASL_SSL with SCRAM, PostgreSQL under `verify-full` as a
//! password role, the points API over HTTPS, secrets in files; afterwards every log of the run
//! is searched for its passwords (`secure`).

mod burst;
mod diagnose;
mod hostile;
mod inject;
pub(crate) mod kafka;
pub(crate) mod kafka_txn;
mod locker;
mod network;
mod pipeline;
pub(crate) use hostile::install_business_rule;
mod procs;
mod report;
mod schedule;
mod secure;
mod settle;
mod topic;
mod topology;
mod verdict;
mod windows;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::bail;
use clap::Args;
use idem_core::TableNames;
use idem_core::crash::{CrashPoint, Mechanism};
use serde::Serialize;

use crate::demo::world::{Databases, Owner};
use idem_conformance::ports::Ports;
use procs::{Proc, Rng};
use topology::Topology;

#[derive(Args, Debug, Clone)]
pub(crate) struct ChaosArgs {
    /// How long to inject faults (`40s`, `10m`; whole seconds).
    #[arg(long = "duration", default_value = "2m", value_parser = crate::num::whole_seconds)]
    pub seconds: u64,
    /// Seed of the fault schedule (the same seed, the same schedule).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Run the pipeline a file describes instead of the reference pipeline: its databases,
    /// Kafka, its components as command lines, the verify config
    /// (`docs/operating/chaos-your-pipeline.md`). `--duration`, `--seed`, `--settle-deadline`,
    /// `--break`, `--keep` and `--json` apply; the reference pipeline's options do not.
    #[arg(long, conflicts_with_all = ["tls", "cdc"])]
    pub pipeline: Option<PathBuf>,
    /// PostgreSQL server URL: the run creates (and drops) its own databases on it.
    #[arg(
        long,
        env = "IDEM_CHAOS_PG",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub db: String,
    /// Orders per second, per writer.
    #[arg(long, default_value_t = 25.0)]
    pub rate: f64,
    /// Break one mechanism on purpose (a negative control): the run must report a violation.
    /// Its variable is `IDEM_CHAOS_BREAK`: `IDEM_BREAK` is the fault the runner hands its
    /// processes.
    #[arg(long = "break", env = "IDEM_CHAOS_BREAK", value_parser = negative_controls())]
    pub break_mechanism: Option<Mechanism>,
    /// How long the pipeline may take to settle after the faults stop.
    #[arg(long, default_value = "180s", value_parser = idem_cli::util::parse_duration)]
    pub settle_deadline: Duration,
    /// Keep the databases and logs afterwards.
    #[arg(long)]
    pub keep: bool,
    /// The relays are CDC relays (`idem cdc relay`) on one slot of the orders database: one
    /// reads it, the other waits to take over; the CDC relay's crash point replaces the polling
    /// relay's.
    #[arg(long, conflicts_with = "break_mechanism")]
    pub cdc: bool,
    /// Run secured: Kafka (one node) over SASL_SSL with SCRAM-SHA-512, with a CA, a broker
    /// certificate and SCRAM users made for the run (`scripts/kafka prepare --security
    /// sasl_ssl`); PostgreSQL under `sslmode=verify-full` (which `--db` must use) as
    /// `--tls-db-role`, owner of the run's databases; the points API over HTTPS with the run's
    /// certificate. Passwords reach the processes in files, never on a command line, and every
    /// log of the run is searched for them afterwards: a hit fails the run.
    #[arg(long)]
    pub tls: bool,
    /// With `--tls`: the password role the processes and the runner's pools connect as (the
    /// user of `--db` creates the run's databases and gives them to it).
    #[arg(long, env = "IDEM_CHAOS_TLS_DB_ROLE", default_value = "idem_tls")]
    pub tls_db_role: String,
    /// With `--tls`: the file holding `--tls-db-role`'s password (one trailing newline is
    /// dropped).
    #[arg(long, env = "IDEM_CHAOS_TLS_DB_PASSWORD_FILE", value_name = "FILE")]
    pub tls_db_password_file: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The report.
#[derive(Debug, Serialize)]
pub(crate) struct ChaosReport {
    pub ok: bool,
    pub failures: Vec<String>,
    pub seed: u64,
    pub seconds: u64,
    pub negative_control: Option<String>,
    pub orders: i64,
    pub faults: BTreeMap<String, u64>,
    pub crash_points_fired: BTreeMap<String, u64>,
    /// Counted by the consumers' metrics (lower bound: a killed process loses what it counted
    /// since its last scrape).
    pub duplicate_deliveries: u64,
    pub duplicate_skips: u64,
    /// Counted by the relays' metrics (lower bound, as above).
    pub republishes: u64,
    /// Deliveries beyond the first, from the inboxes (exact).
    pub inbox_duplicate_deliveries: i64,
    /// Copies in the topic beyond the first per event id (exact).
    pub topic_duplicates: i64,
    pub settle_seconds: f64,
    /// Missing effects whose event is still in the topic at or beyond its consumer group's
    /// committed offset, per check: the group has not read past it, so it is not lost but
    /// late — a liveness failure (the broker left the group without a working
    /// assignment), reported apart from losses.
    pub unconsumed: BTreeMap<String, u64>,
    /// Missing effects that are not `unconsumed`: the event never reached the topic, or its
    /// group read past it without applying it.
    pub lost: u64,
    pub duplicate_effects: u64,
    /// Hostile rows written through the SQL contract: per row (name and event id), where it
    /// ended; refused rows are counted in `faults` (`hostile_rows_refused`).
    pub hostile_rows: BTreeMap<String, String>,
    /// The orders written in one burst just before the relays started, and how fast they
    /// drained.
    pub burst: burst::Burst,
    /// Panics in any process's log (a process a foreign writer or a remote can panic).
    pub panics: Vec<String>,
    /// Processes that exited on their own: not killed or stopped by the runner, not a crash
    /// point's abort (a relay giving up while PostgreSQL restarts, say). Reported, not yet a
    /// failure: a consumer whose static member id the broker fenced stops by design (and is
    /// restarted by the runner as a supervisor would).
    pub unexpected_exits: Vec<String>,
    /// Executions of one Idempotency-Key that overlapped in the points API during slow
    /// windows (`points_lab_overlaps`): each is an effect the key failed to make once.
    pub overlapping_executions: i64,
    /// `--tls`: how each connection was secured, what `pg_stat_ssl` and the broker's log showed,
    /// and the search of every log of the run for every password it used
    /// (`tls.secret_search.hits`: where one was found; any fails the run).
    pub tls: Option<secure::Tls>,
    pub logs: Option<String>,
    pub verify: idem_verify::Report,
}

/// The negative controls: the mechanisms idem can break (`IDEM_BREAK`). One of them,
/// [`Mechanism::KafkaTransactions`], replaces the settlement consumers' inbox with Kafka transactions
/// (read_committed, offsets committed in a transaction after the database commit): "we turned
/// on Kafka exactly-once" does not make a database side effect happen once.
///
/// `skip-sending-mark` is left out: the run's points route honours keys, so breaking the mark
/// for keyless remotes would go unnoticed — a control that cannot fail. The battery catches it
/// (`without_the_sending_mark_the_same_crash_awards_twice`, real processes killed).
fn negative_controls() -> impl clap::builder::TypedValueParser<Value = Mechanism> {
    use clap::builder::TypedValueParser as _;
    let names = Mechanism::ALL
        .iter()
        .filter(|m| **m != Mechanism::SkipSendingMark)
        .map(|m| m.as_str());
    clap::builder::PossibleValuesParser::new(names).try_map(|name| name.parse::<Mechanism>())
}

/// Per crash point, how often it fired, from the log the armed processes write (none yet when
/// it cannot be read).
fn crash_counts(log: &Path, points: &[CrashPoint]) -> BTreeMap<String, u64> {
    fired(&std::fs::read_to_string(log).unwrap_or_default(), points)
}

/// Per crash point, how often the crash log `text` (one fired point a line) says it fired.
fn fired(text: &str, points: &[CrashPoint]) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = points.iter().map(|p| (p.to_string(), 0)).collect();
    for line in text.lines() {
        if let Some(n) = out.get_mut(line.trim()) {
            *n += 1;
        }
    }
    out
}

/// The checks of a chaos run: the reference pipeline's, plus the audit group's log.
fn verify_config(urls: &[String; 3]) -> idem_verify::VerifyConfig {
    let mut config = idem_reference::verify_config(&urls[0], &urls[1], Some(&urls[2]));
    config.checks.push(idem_verify::Check {
        name: "audit".to_owned(),
        event_type: Some("order.paid".to_owned()),
        source: idem_verify::Side {
            db: urls[0].clone(),
            query: "SELECT payment_id, amount_minor, order_id FROM orders".to_owned(),
            key: "payment_id".to_owned(),
            amount: Some("amount_minor".to_owned()),
            event_type_column: None,
            aggregate_id: Some("order_id".to_owned()),
        },
        target: idem_verify::Side {
            db: urls[1].clone(),
            query: "SELECT payment_id, amount_minor FROM audit_log".to_owned(),
            key: "payment_id".to_owned(),
            amount: Some("amount_minor".to_owned()),
            event_type_column: None,
            aggregate_id: None,
        },
        locate: Some(idem_verify::Locate {
            outbox_db: None,
            aggregate_type: "order".to_owned(),
            event_type: "order.paid".to_owned(),
            inbox_db: urls[1].clone(),
            consumer_group: "audit".to_owned(),
            intents_db: None,
            effect: None,
        }),
    });
    config
}

pub(crate) async fn run(args: ChaosArgs) -> anyhow::Result<()> {
    if let Some(file) = &args.pipeline {
        return pipeline::run(&args, file).await;
    }
    if !idem_core::crash::ENABLED {
        bail!("this idem binary was built without crash points (the `failpoints` feature)");
    }
    let run = format!("c{}{}", args.seed, std::process::id());
    let tables = TableNames::default();
    let role = secured_role(&args)?;
    let db = args.db.clone();
    let dbs = match &role {
        Some(role) => {
            let url_of = |name: &str| role.url(&db, name);
            let owner = Owner {
                role: &role.name,
                url_of: &url_of,
            };
            Databases::create_postgres_for(&db, &run, &tables, Some(owner)).await?
        }
        None => Databases::create(Some(&db), None, &run, &tables).await?,
    };
    let dir = tempfile::Builder::new().prefix("idem-chaos-").tempdir()?;
    // Ctrl-C or SIGTERM ends the run: dropping `drive` kills every process it started, brokers
    // included (`Proc` kills its child on drop), and the databases are still dropped.
    let interrupted = idem_cli::util::shutdown_signal()?;
    let result = tokio::select! {
        r = drive(&args, &dbs, dir.path(), &run, role.as_ref()) => r,
        () = interrupted => Err(anyhow::anyhow!(
            "interrupted: every process of the run was killed and its databases are dropped"
        )),
    };
    if args.cdc && !args.keep {
        drop_slot(&dbs.orders, &format!("idem_chaos_{run}")).await;
    }
    let cleanup = dbs.cleanup(args.keep).await;
    let mut report = result?;
    cleanup?;
    if args.keep || !report.ok {
        let kept = dir.keep();
        report.logs = Some(kept.display().to_string());
    }
    idem_cli::verify_cmd::emit(&report, args.json, report.ok, report::print)
}

/// With `--tls`, the role the run's processes connect as; refuses what `--tls` cannot run
/// with.
fn secured_role(args: &ChaosArgs) -> anyhow::Result<Option<secure::DbRole>> {
    if !args.tls {
        return Ok(None);
    }
    if args.break_mechanism == Some(Mechanism::KafkaTransactions) {
        bail!(
            "--tls cannot run the kafka-transactions control: its consumer connects in plain text"
        );
    }
    secure::check_admin_url(&args.db)?;
    let Some(file) = &args.tls_db_password_file else {
        bail!(
            "--tls needs the password of --tls-db-role {} in a file: --tls-db-password-file              (IDEM_CHAOS_TLS_DB_PASSWORD_FILE)",
            args.tls_db_role
        );
    };
    Ok(Some(secure::DbRole::new(&args.tls_db_role, file)?))
}

/// Drops the CDC relays' slot (every process is stopped by now; a killed relay's session may
/// take a moment to end): a slot left behind would pin WAL and keep its database from being
/// dropped.
async fn drop_slot(orders: &idem_sql::AnyPool, slot: &str) {
    let idem_sql::AnyPool::Postgres(pool) = orders else {
        return;
    };
    let drop = "SELECT count(pg_drop_replication_slot(slot_name)) FROM pg_replication_slots \
                WHERE slot_name = $1 AND NOT active";
    let left = "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1";
    for _ in 0..100 {
        let _ = sqlx::query(drop).bind(slot).execute(pool).await;
        let n: i64 = sqlx::query_scalar(left)
            .bind(slot)
            .fetch_one(pool)
            .await
            .unwrap_or(1);
        if n == 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    tracing::warn!(
        slot,
        "the CDC slot of the run could not be dropped: drop it by hand"
    );
}

/// The reference runner's Kafka nodes (a pipeline file runs three: `[kafka] nodes = 3`).
const NODES: usize = 1;

/// One run: the processes, the faults, settling, the exact numbers and the verdict.
async fn drive(
    args: &ChaosArgs,
    dbs: &Databases,
    dir: &Path,
    run: &str,
    role: Option<&secure::DbRole>,
) -> anyhow::Result<ChaosReport> {
    let mut rng = Rng::new(args.seed);
    let crash_log = dir.join("crashes.log");
    let prepared = kafka::prepare(NODES, dir, args.tls, 0)?;
    let mut ports = Ports::new();
    ports.reserve(prepared.ports.iter().copied());
    let api_port = ports.pick()?;
    let prepared_dir = prepared.dir.clone();
    let (secure, kafka) = match role {
        Some(role) => {
            let (s, k) =
                secure::Secured::new(&prepared.dir, &prepared.bootstrap, dir, &dbs.urls, role)?;
            (Some(s), k)
        }
        None => (None, idem_kafka::Connection::plaintext(&prepared.bootstrap)),
    };
    let mut topology = topology_of(args, dbs, run, api_port, prepared.bootstrap);
    topology.kafka = kafka;
    topology.secure = secure;
    let idem_sql::AnyPool::Postgres(settlement) = &dbs.settlement else {
        anyhow::bail!("the business rule is PostgreSQL's PL/pgSQL");
    };
    hostile::install_business_rule(settlement).await?;
    let burst_prefix = format!("burst-{run}-");
    let burst_rows = burst::rows_for(args.seconds);
    burst::write(
        &dbs.orders,
        burst::AGGREGATE_TYPE,
        &burst_prefix,
        burst_rows,
    )
    .await?;
    let specs = topology::specs(&topology);
    let mut procs = processes(args, specs, prepared.nodes, dir, &crash_log)?;
    topology::start(&mut procs, &topology, NODES, dir).await?;
    if let Some(s) = &topology.secure {
        deny_topic(&prepared_dir, &s.scram_user, hostile::DENIED_TOPIC)?;
    }
    eprintln!(
        "idem chaos: seed {} for {} s; {}; Kafka ({} node(s)) on {}{}; logs in {}{}",
        args.seed,
        args.seconds,
        dbs.location,
        NODES,
        topology.brokers,
        topology
            .secure
            .as_ref()
            .map_or_else(String::new, |s| format!(
                " (SASL_SSL as {}; PostgreSQL verify-full as {}; points API over HTTPS)",
                s.scram_user, s.db_role
            )),
        dir.display(),
        args.break_mechanism
            .map(|b| format!("; NEGATIVE CONTROL: {b} broken"))
            .unwrap_or_default()
    );
    let mut world = inject::World {
        procs: &mut procs,
        dbs,
        topology: &topology,
        nodes: NODES,
        crash_log: &crash_log,
        burst: (&burst_prefix, burst_rows),
    };
    let mechanism = args.break_mechanism;
    let mut injected = inject::inject(&mut world, args.seconds, mechanism, &mut rng).await?;
    settle::stop_faults(&mut injected.windows, &mut procs).await?;
    let config = verify_config(&dbs.urls);
    let hostile = std::mem::take(&mut injected.hostile_accepted);
    let pipe = settle::Pipeline {
        dbs,
        kafka: &topology.kafka,
        topic: &topology.topic,
        config: &config,
        hostile: &hostile,
        counters: &inject::COUNTERS,
    };
    let mut settled = settle::settle(&pipe, &mut procs, args.settle_deadline).await?;
    if !settled.live {
        diagnose::write(&pipe, &mut procs, dir).await;
    }
    if !settled.verify.clean {
        settled.verify = idem_verify::verify(&config, &idem_verify::Options::default()).await?;
    }
    let place = report::Run {
        topology: &topology,
        dir,
        crash_log: &crash_log,
    };
    report::report(args, &pipe, &mut procs, &place, injected, settled).await
}

/// Denies `user` every operation on `topic` with an ACL on the secured cluster in `dir`
/// (`scripts/kafka deny`).
fn deny_topic(dir: &Path, user: &str, topic: &str) -> anyhow::Result<()> {
    let out = std::process::Command::new(crate::broker::script())
        .arg("deny")
        .arg(dir)
        .args([&format!("User:{user}"), topic])
        .output()?;
    if !out.status.success() {
        bail!(
            "scripts/kafka deny: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// What the run's processes connect to: the points API on `api_port`, the brokers at
/// `brokers`.
fn topology_of(
    args: &ChaosArgs,
    dbs: &Databases,
    run: &str,
    api_port: u16,
    brokers: String,
) -> Topology {
    let prefix = format!("chaos-{run}.");
    let [orders_url, settle_url, points_url] = dbs.urls.clone();
    Topology {
        orders_url,
        settle_url,
        points_url,
        api_port,
        kafka: idem_kafka::Connection::plaintext(&brokers),
        brokers,
        topic: format!("{prefix}order"),
        prefix,
        rate: args.rate,
        kafka_transactions: args.break_mechanism == Some(Mechanism::KafkaTransactions),
        cdc_slot: args.cdc.then(|| format!("idem_chaos_{run}")),
        secure: None,
    }
}

/// The supervised processes: the brokers first (`brokers`, each node a child of this runner),
/// then the pipeline's, every one told where to log crash points and what to break.
fn processes(
    args: &ChaosArgs,
    specs: Vec<topology::Spec>,
    brokers: Vec<Proc>,
    dir: &Path,
    crash_log: &Path,
) -> anyhow::Result<Vec<Proc>> {
    let mut env: Vec<(&'static str, String)> =
        vec![("IDEM_CRASH_LOG", crash_log.display().to_string())];
    if let Some(b) = args.break_mechanism {
        env.push(("IDEM_BREAK", b.to_string()));
    }
    let mut procs = brokers;
    for spec in specs {
        procs.push(topology::spawn(spec, dir, &env)?);
    }
    Ok(procs)
}

#[cfg(test)]
mod tests {
    use super::fired;
    use idem_core::crash::CrashPoint;

    #[test]
    fn the_crash_log_counts_every_point_and_ignores_other_lines() {
        let points = CrashPoint::POLLING_PIPELINE;
        let text = format!("{p}\n  {p}  \nnot a point\n", p = points[0]);
        let counts = fired(&text, points);
        assert_eq!(counts.len(), points.len());
        assert_eq!(counts[points[0].as_str()], 2);
        assert_eq!(counts.values().sum::<u64>(), 2);
    }
}
