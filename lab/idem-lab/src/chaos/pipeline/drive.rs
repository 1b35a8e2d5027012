//! One run of a pipeline file: start, faults, settle, verify, report.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;

use idem_conformance::ports::Ports;
use idem_netfault::ProxiedListener;

use super::arm::{Arming, arm_env};
use super::file::{
    BurstSection, Component, Fault, PipelineFile, Places, Ready, expand, with_database_urls,
};
use super::foreign::ForeignWriter;
use super::postgres::{self, Server};
use super::secrets::KafkaLogin;
use super::{lock, secured, window};
use crate::chaos::ChaosArgs;
use crate::chaos::burst;
use crate::chaos::kafka;
use crate::chaos::network::{Dependency, Link, Network, postgres_link};
use crate::chaos::procs::{Proc, Rng, Role};
use crate::chaos::schedule::{self, Plan};
use crate::chaos::timeline::append_timeline;
use idem_core::crash::CrashPoint;
use idem_sql::AnyPool;

/// The verify config, as written: `{db.NAME}` stands for database `NAME`'s URL (the one the
/// runner created, or the file's).
struct Verify {
    text: String,
    path: std::path::PathBuf,
}

impl Verify {
    /// The config, with the URLs of the databases (`urls`, by name).
    fn config(&self, urls: &BTreeMap<String, String>) -> anyhow::Result<idem_verify::VerifyConfig> {
        let reading = || format!("reading the verify config {}", self.path.display());
        let mut config: toml::Value = toml::from_str(&self.text).with_context(reading)?;
        with_database_urls(&mut config, urls);
        if let Some(name) = unfilled(&config) {
            anyhow::bail!(
                "the verify config {} names {name}, a database [databases] does not define",
                self.path.display()
            );
        }
        let text = toml::to_string(&config).with_context(reading)?;
        idem_verify::VerifyConfig::from_toml(&text).with_context(reading)
    }
}

/// The first `{db.NAME}` left in a string value of verify config `config`, if any.
fn unfilled(config: &toml::Value) -> Option<String> {
    match config {
        toml::Value::String(s) => {
            let at = s.find("{db.")?;
            let end = s[at..].find('}').map_or(s.len(), |e| at + e + 1);
            Some(s[at..end].to_owned())
        }
        toml::Value::Array(a) => a.iter().find_map(unfilled),
        toml::Value::Table(t) => t.values().find_map(unfilled),
        _ => None,
    }
}

/// The report of a pipeline run.
#[derive(Debug, Serialize)]
pub(crate) struct PipelineReport {
    pub ok: bool,
    pub failures: Vec<String>,
    pub seed: u64,
    pub seconds: u64,
    /// `--break`: the mechanism broken on purpose (the run must find a violation).
    pub negative_control: Option<String>,
    /// Faults by kind (`sigkill`, `sigstop`, `sigterm_restart`, `broker_kill`,
    /// `net_<kind>_<dependency>`, `crash_point_armed:<point>`, …); `faults.log` has each with
    /// its time.
    pub faults: BTreeMap<String, u64>,
    /// Per crash point the components list, how often it fired (the crash log).
    pub crash_points_fired: BTreeMap<String, u64>,
    /// Per `[[remote]]`, the connections its proxy carried: none means no component called it
    /// through `{remote.NAME}`, and its faults tested nothing (a failure).
    pub remote_connections: BTreeMap<String, u64>,
    /// Where each stored `[hostile]` row ended, by name and event id.
    pub hostile_rows: BTreeMap<String, String>,
    /// Hostile rows the contract or the pipeline treated otherwise than it must.
    pub hostile_violations: Vec<String>,
    /// The `[burst]` written before the components started, and how fast it drained.
    pub burst: Option<burst::Burst>,
    /// `[kafka] security`: how the run was secured, what `pg_stat_ssl` showed, and the search
    /// of every log for every password of the run (`tls.secret_search.hits`: any fails it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<secured::PipelineTls>,
    /// Was every effect there before `--settle-deadline`? (Missing ones that stopped moving
    /// end the wait early: they are lost.)
    pub settled: bool,
    pub settle_seconds: f64,
    /// Missing effects, each located in the verify report's `losses`.
    pub lost: u64,
    pub duplicate_effects: u64,
    /// Exits the runner did not cause (the process was restarted).
    pub unexpected_exits: Vec<String>,
    /// `panicked at` lines of any process's log.
    pub panics: Vec<String>,
    pub verify: idem_verify::Report,
    /// The run's directory (logs, `faults.log`), kept when the run failed or with `--keep`.
    pub logs: Option<String>,
}

/// Runs the pipeline file at `path` and prints the report. Exit status: 0 the run passed, 1
/// it found a violation, 2 it could not run (the file, a component that never got ready, a
/// database that refused), with the reason on standard error.
pub(crate) async fn run(args: &ChaosArgs, path: &Path) -> anyhow::Result<()> {
    let report = match run_file(args, path).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("idem-lab: error: {e:#}");
            return Err(idem_cli::verify_cmd::ExitWith(2).into());
        }
    };
    idem_cli::verify_cmd::emit(&report, args.json, report.ok, print)
}

async fn run_file(args: &ChaosArgs, path: &Path) -> anyhow::Result<PipelineReport> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the pipeline file {}", path.display()))?;
    let file = PipelineFile::parse(&text)?;
    let verify_path = file.verify_path(path);
    let verify_text = std::fs::read_to_string(&verify_path)
        .with_context(|| format!("reading the verify config {}", verify_path.display()))?;
    // Checked now, with made-up URLs for the databases the runner will create.
    let made_up = file
        .started()
        .map(|(name, _)| (name.to_owned(), format!("postgres://127.0.0.1:1/{name}")))
        .collect();
    let probe = file.urls(&made_up);
    let verify = Verify {
        text: verify_text,
        path: verify_path,
    };
    verify.config(&probe)?;
    let dir = tempfile::Builder::new()
        .prefix("idem-pipeline-")
        .tempdir()?;
    let interrupted = idem_cli::util::shutdown_signal()?;
    let result = tokio::select! {
        r = drive(args, &file, &verify, dir.path()) => r,
        () = interrupted => Err(anyhow::anyhow!(
            "interrupted: every process of the run was killed"
        )),
    };
    let mut report = match result {
        Ok(r) => r,
        Err(e) => {
            let kept = dir.keep();
            return Err(e.context(format!("the run's logs are in {}", kept.display())));
        }
    };
    if args.keep || !report.ok {
        report.logs = Some(dir.keep().display().to_string());
    }
    Ok(report)
}

fn print(r: &PipelineReport) {
    let verdict = if r.ok { "ok" } else { "FAILED" };
    println!(
        "idem chaos --pipeline: {verdict} (seed {}, {} s)",
        r.seed, r.seconds
    );
    for f in &r.failures {
        println!("  failure: {f}");
    }
    let faults: Vec<String> = r.faults.iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!("  faults: {}", faults.join(", "));
    if !r.crash_points_fired.is_empty() {
        let fired: Vec<String> = r
            .crash_points_fired
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        println!("  crash points fired: {}", fired.join(", "));
    }
    if !r.hostile_rows.is_empty() {
        println!(
            "  hostile rows: {} stored, {} violations",
            r.hostile_rows.len(),
            r.hostile_violations.len()
        );
    }
    if let Some(t) = &r.tls {
        println!(
            "  secured: Kafka {} (principal logged: {}); PostgreSQL backends {}; {} password(s) \
             searched in {} log lines: {} hit(s)",
            t.kafka,
            t.scram_principal_logged,
            t.pg_backends.map_or_else(
                || "not watched (no URL asks for TLS)".to_owned(),
                |b| format!(
                    "{} seen, {} in clear, {} of another role",
                    b.all, b.in_clear, b.other_roles
                )
            ),
            t.secret_search.secrets,
            t.secret_search.lines,
            t.secret_search.hits.len()
        );
    }
    println!(
        "  lost {}, duplicate effects {}, settled {} after {:.1} s",
        r.lost, r.duplicate_effects, r.settled, r.settle_seconds
    );
    println!();
    print!("{}", r.verify.table());
    for e in &r.unexpected_exits {
        println!("  exited on its own: {e}");
    }
    if let Some(l) = &r.logs {
        println!("  logs and faults.log: {l}");
    }
}

async fn drive(
    args: &ChaosArgs,
    file: &PipelineFile,
    verify: &Verify,
    dir: &Path,
) -> anyhow::Result<PipelineReport> {
    let timeline = dir.join("faults.log");
    let mut rng = Rng::new(args.seed);
    let mut faults = BTreeMap::new();
    let listed = all(file).flat_map(|c| c.crash_points.iter().copied());
    let crash_log = dir.join("crashes.log");
    let arming = Arming::new(listed, args.break_mechanism, &crash_log, &mut rng);
    eprintln!(
        "idem chaos --pipeline: seed {} for {} s; logs in {}{}",
        args.seed,
        args.seconds,
        dir.display(),
        args.break_mechanism
            .map(|b| format!("; NEGATIVE CONTROL: {b} broken"))
            .unwrap_or_default()
    );
    let server = postgres::start(file, dir).await?;
    let started = server.as_ref().map(|s| s.urls.clone()).unwrap_or_default();
    let databases = file.urls(&started);
    let verify = &verify.config(&databases)?;
    let burst = match &file.burst {
        Some(b) => Some(write_burst(b, &databases, args).await?),
        None => None,
    };
    let (cluster, brokers) = prepare_kafka(file, dir)?;
    let env = process_env(&crash_log, args);
    let (mut fleet, mut net) = build(
        file,
        &databases,
        dir,
        cluster.as_ref(),
        brokers,
        args.seed,
        &env,
    )
    .await?;
    start_in_order(&mut fleet, file, cluster.as_ref()).await?;
    let login = cluster.as_ref().and_then(|c| c.login.as_ref());
    let (mut foreign, backends) = observers(file, cluster.as_ref(), &databases).await?;
    let mut run = RunState {
        rng: &mut rng,
        faults: &mut faults,
        timeline: &timeline,
        arming,
    };
    let kafka = KafkaTargets::of(file, cluster.as_ref());
    let end = Instant::now() + Duration::from_secs(args.seconds);
    let mut targets = Targets {
        kafka,
        postgres: server.as_ref(),
        failover: file.postgres.failover,
        after_failover: after_failover(file),
        foreign: foreign.as_mut(),
        windows: window::all(file, Instant::now()),
        locks: lock::all(&file.locks, &databases, Instant::now()).await?,
        burst,
        backends,
    };
    inject(&mut fleet, &mut net, &mut targets, end, &mut run).await?;
    let backends = targets
        .backends
        .as_ref()
        .and_then(secured::BackendWatch::seen);
    let burst = end_periods(targets, &mut fleet).await?;
    calm(&mut fleet, &mut net, &mut run)?;
    stop_loads(&mut fleet);
    let started = Instant::now();
    let until = started + args.settle_deadline;
    let settled = settle(&mut fleet, verify, foreign.as_ref(), until, &mut run).await?;
    let settle_seconds = started.elapsed().as_secs_f64();
    let report = idem_verify::verify(verify, &idem_verify::Options::default()).await?;
    let hostile = match &foreign {
        Some(f) => Some(f.outcome().await?),
        None => None,
    };
    let panics: Vec<String> = fleet.procs.iter().flat_map(Proc::panics).collect();
    for p in &mut fleet.procs {
        p.stop(Duration::from_secs(10));
    }
    let unexpected_exits = fleet
        .procs
        .iter()
        .flat_map(|p| p.unexpected_exits.iter().cloned())
        .collect();
    // Every process has stopped: its log is complete.
    let tls =
        login.map(|l| secured::report(l, backends, dir, &secured::database_secrets(&databases)));
    let numbers = Numbers {
        settled,
        settle_seconds,
        panics,
        unexpected_exits,
        crash_points_fired: run.arming.fired(),
        remote_connections: net.remote_connections(),
        hostile,
        burst,
        tls,
        failover: file.postgres.failover,
    };
    Ok(verdict(args, faults, report, numbers))
}

/// The `[hostile]` section's foreign writer (on a secured node, one of its rows names a topic
/// an ACL denies the run's user), and on a secured node the watch of the backends on the
/// databases whose URL asks for TLS.
async fn observers(
    file: &PipelineFile,
    cluster: Option<&Cluster>,
    databases: &BTreeMap<String, String>,
) -> anyhow::Result<(Option<ForeignWriter>, Option<secured::BackendWatch>)> {
    let login = cluster.and_then(|c| c.login.as_ref().map(|l| (c, l)));
    if let (Some((c, l)), Some(_)) = (login, &file.hostile) {
        crate::chaos::deny_topic(&c.dir, &l.user, crate::chaos::hostile::DENIED_TOPIC)?;
    }
    let foreign = match &file.hostile {
        Some(h) => {
            let denied = login.is_some();
            Some(ForeignWriter::open(h, databases, Instant::now(), denied).await?)
        }
        None => None,
    };
    let backends = match login {
        Some(_) => Some(secured::BackendWatch::open(databases).await?),
        None => None,
    };
    Ok((foreign, backends))
}

/// Closes the windows and releases the locks once the faults are over: how the burst
/// drained, looked at once more.
async fn end_periods(
    mut targets: Targets<'_>,
    fleet: &mut Fleet,
) -> anyhow::Result<Option<burst::Burst>> {
    for w in &mut targets.windows {
        w.close(&mut fleet.procs)?;
    }
    for l in &mut targets.locks {
        l.release().await;
    }
    if let Some((outbox, watch)) = &mut targets.burst {
        watch.finish(outbox).await;
    }
    Ok(targets.burst.map(|(_, w)| w.burst))
}

/// Writes the `[burst]` into its outbox (reached directly): the outbox and the watch of its
/// drain.
async fn write_burst(
    b: &BurstSection,
    databases: &BTreeMap<String, String>,
    args: &ChaosArgs,
) -> anyhow::Result<(AnyPool, burst::Watch)> {
    let url = databases
        .get(&b.outbox)
        .with_context(|| format!("[burst] database {} has no URL", b.outbox))?;
    let pool = postgres::runner_pool(url, 1)
        .await
        .with_context(|| format!("[burst] connecting to database {}", b.outbox))?;
    let outbox = AnyPool::Postgres(pool);
    let rows = b
        .rows
        .map_or_else(|| burst::rows_for(args.seconds), i64::from);
    // Aggregates of their own, in an outbox that may hold an earlier run's.
    let prefix = format!("burst-{}-{}-", args.seed, std::process::id());
    burst::write(&outbox, &b.aggregate_type, &prefix, rows)
        .await
        .with_context(|| format!("[burst] writing {rows} events into {}", b.outbox))?;
    let watch = burst::Watch::new(&b.aggregate_type, &prefix, rows, Instant::now());
    Ok((outbox, watch))
}

/// What every process of the run is told beside its own environment (which takes
/// precedence): where to log crash points that fire, and the mechanism `--break` breaks.
fn process_env(crash_log: &Path, args: &ChaosArgs) -> Vec<(String, String)> {
    let mut env = vec![("IDEM_CRASH_LOG".to_owned(), crash_log.display().to_string())];
    if let Some(b) = args.break_mechanism {
        env.push(("IDEM_BREAK".to_owned(), b.to_string()));
    }
    env
}

/// How settling ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Settled {
    /// No effect is missing, no hostile row open.
    Complete,
    /// Effects are missing (or hostile rows open), and nothing changed for [`STILL_FOR`].
    Still,
    /// Effects were still missing (or hostile rows open), and still moving, at the deadline.
    Deadline,
}

/// How long a pipeline with missing effects must not change to be taken as still: longer than
/// a consumer group takes to evict a killed member and rebalance (a session timeout, then up
/// to a poll interval while the others rejoin).
const STILL_FOR: Duration = Duration::from_secs(60);

/// Verifies every second (restarting what goes down meanwhile) until no effect is missing and
/// every hostile row of `foreign` is contained, nothing changes any more, or `deadline`
/// passes.
async fn settle(
    fleet: &mut Fleet,
    verify: &idem_verify::VerifyConfig,
    foreign: Option<&ForeignWriter>,
    deadline: Instant,
    run: &mut RunState<'_>,
) -> anyhow::Result<Settled> {
    let quick = idem_verify::Options { locate_limit: 0 };
    let (mut last, mut changed) = (None, Instant::now());
    loop {
        let r = idem_verify::verify(verify, &quick).await?;
        let open = match foreign {
            Some(f) => f.open_rows().await?,
            None => 0,
        };
        if r.lost() == 0 && open == 0 {
            return Ok(Settled::Complete);
        }
        let now = Some((progress(&r), open));
        if last != now {
            (last, changed) = (now, Instant::now());
        }
        if changed.elapsed() >= STILL_FOR {
            return Ok(Settled::Still);
        }
        if Instant::now() >= deadline {
            return Ok(Settled::Deadline);
        }
        supervise(fleet, Instant::now(), run)?;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// What moves while a pipeline settles: missing and doubled effects, target rows.
fn progress(r: &idem_verify::Report) -> (u64, u64, u64) {
    let rows = r.checks.iter().map(|c| c.total().target_rows).sum();
    (r.lost(), r.duplicate_effects(), rows)
}

/// What a run measured beside verification.
struct Numbers {
    settled: Settled,
    settle_seconds: f64,
    panics: Vec<String>,
    unexpected_exits: Vec<String>,
    crash_points_fired: BTreeMap<String, u64>,
    remote_connections: BTreeMap<String, u64>,
    /// Where the `[hostile]` rows ended.
    hostile: Option<super::foreign::Outcome>,
    /// How the `[burst]` drained.
    burst: Option<burst::Burst>,
    /// How a secured run was secured.
    tls: Option<secured::PipelineTls>,
    /// `[postgres] failover`: the server was to fail over once.
    failover: bool,
}

/// Runs shorter than this are not expected to reach every crash point.
const FULL_RUN_SECONDS: u64 = 120;

/// From the run's numbers to the report: a loss, a duplicate effect, any other violation, a
/// pipeline that did not settle, or a panic fails it.
fn verdict(
    args: &ChaosArgs,
    faults: BTreeMap<String, u64>,
    verify: idem_verify::Report,
    n: Numbers,
) -> PipelineReport {
    let (lost, duplicate_effects) = (verify.lost(), verify.duplicate_effects());
    let mut failures = vec![];
    if lost > 0 {
        failures.push(format!("{lost} effects missing (see the losses' stages)"));
    }
    if duplicate_effects > 0 {
        failures.push(format!("{duplicate_effects} duplicate effects"));
    }
    if n.settled == Settled::Deadline {
        failures.push(format!(
            "effects still arriving at --settle-deadline ({:?}): a stall, or too short a \
             deadline for the load",
            args.settle_deadline
        ));
    }
    for e in verify.empty.iter().filter(|e| e.rows > 0) {
        failures.push(format!(
            "{} rows in {:?}, which must have none",
            e.rows, e.name
        ));
    }
    let named = lost + duplicate_effects + verify.invariant_violations();
    if named == 0 && !verify.clean {
        failures.push("verification found other violations".to_owned());
    }
    if !n.panics.is_empty() {
        failures.push(format!("{} panics in the processes' logs", n.panics.len()));
    }
    failures.extend(unused_remotes(&n.remote_connections));
    let (hostile_rows, hostile_violations) = match n.hostile {
        Some(h) => (h.rows, h.violations),
        None => Default::default(),
    };
    failures.extend(hostile_violations.iter().cloned());
    failures.extend(n.burst.as_ref().and_then(burst::Burst::shortfall));
    failures.extend(n.tls.iter().flat_map(secured::shortfalls));
    if n.failover && faults.get("postgres_failover").copied().unwrap_or(0) == 0 {
        failures.push(
            "the server never failed over (a window on its users held it off to the end)"
                .to_owned(),
        );
    }
    if args.seconds >= FULL_RUN_SECONDS {
        let never = n.crash_points_fired.iter().filter(|(_, n)| **n == 0);
        failures.extend(never.map(|(p, _)| format!("crash point {p} never fired")));
    }
    PipelineReport {
        ok: failures.is_empty(),
        failures,
        seed: args.seed,
        seconds: args.seconds,
        negative_control: args.break_mechanism.map(|m| m.to_string()),
        faults,
        crash_points_fired: n.crash_points_fired,
        remote_connections: n.remote_connections,
        hostile_rows,
        hostile_violations,
        burst: n.burst,
        tls: n.tls,
        settled: n.settled == Settled::Complete,
        settle_seconds: n.settle_seconds,
        lost,
        duplicate_effects,
        unexpected_exits: n.unexpected_exits,
        panics: n.panics,
        verify,
        logs: None,
    }
}

/// A failure per remote whose proxy carried no connection (`connections`, by remote): no
/// component called it through `{remote.NAME}`, so the faults on its way tested nothing.
fn unused_remotes(connections: &BTreeMap<String, u64>) -> Vec<String> {
    connections
        .iter()
        .filter(|(_, n)| **n == 0)
        .map(|(remote, _)| {
            format!(
                "remote {remote} carried no connection: no component called it through \
                 {{remote.{remote}}}, so its faults tested nothing"
            )
        })
        .collect()
}

/// A Kafka cluster the runner started: where `scripts/kafka` prepared it, and its clients'
/// connection.
struct Cluster {
    dir: std::path::PathBuf,
    topics: Vec<String>,
    bootstrap: String,
    nodes: usize,
    conn: idem_kafka::Connection,
    /// Every port chosen for it, bound only once its nodes and proxies run.
    ports: Vec<u16>,
    /// Its clients' login when it is secured (`[kafka] security`).
    login: Option<KafkaLogin>,
    /// Processes with network faults reach it through proxies (a plaintext cluster only).
    proxied: bool,
}

/// Prepares the runner's own cluster (`[kafka] nodes`), with a proxied listener for every
/// process that takes network faults and reaches Kafka (a secured node has none: its listener
/// is SASL_SSL, and `scripts/kafka` proxies plaintext listeners only): the cluster and its
/// nodes' processes.
fn prepare_kafka(file: &PipelineFile, dir: &Path) -> anyhow::Result<(Option<Cluster>, Vec<Proc>)> {
    let Some(nodes) = file.kafka.nodes else {
        return Ok((None, vec![]));
    };
    let secured = file.kafka.security.is_some();
    let listeners: usize = all(file)
        .filter(|c| c.faults.contains(&Fault::Network) && c.uses("kafka") && !secured)
        .map(|c| c.replicas)
        .sum();
    if listeners > 8 {
        bail!(
            "{listeners} processes reach Kafka with network faults; the runner proxies at most 8"
        );
    }
    let prepared = kafka::prepare(nodes, dir, secured, listeners)?;
    let login = match secured {
        true => Some(KafkaLogin::new(
            &prepared.dir,
            &prepared.bootstrap,
            &super::secrets::secret_dir(dir)?,
        )?),
        false => None,
    };
    let cluster = Cluster {
        conn: match &login {
            Some(l) => l.conn.clone(),
            None => idem_kafka::Connection::plaintext(&prepared.bootstrap),
        },
        ports: prepared.ports,
        dir: prepared.dir,
        topics: file.kafka.topics.clone(),
        bootstrap: prepared.bootstrap,
        nodes,
        login,
        proxied: listeners > 0,
    };
    Ok((Some(cluster), prepared.nodes))
}

fn all(file: &PipelineFile) -> impl Iterator<Item = &Component> {
    file.components.iter().chain(&file.loads)
}

/// The processes of a run and what the schedule may do to each, brokers first.
struct Fleet {
    procs: Vec<Proc>,
    /// Per process: the signal faults it may receive (none for the brokers).
    signals: Vec<Vec<Fault>>,
    /// Per process: is it a load (stopped when the faults stop)?
    load: Vec<bool>,
    /// Per process: its readiness, filled in.
    ready: Vec<Option<Ready>>,
    /// Per process: stopped for good (a load after the faults).
    done: Vec<bool>,
    /// Per process: the crash points its component lists.
    points: Vec<Vec<CrashPoint>>,
}

/// Builds every process (not started yet): the brokers, then each replica of each component
/// and load, its placeholders filled with its own proxies' addresses when it takes network
/// faults.
async fn build(
    file: &PipelineFile,
    databases: &BTreeMap<String, String>,
    dir: &Path,
    cluster: Option<&Cluster>,
    brokers: Vec<Proc>,
    seed: u64,
    env: &[(String, String)],
) -> anyhow::Result<(Fleet, Network)> {
    let n = brokers.len();
    let mut fleet = Fleet {
        procs: brokers,
        signals: vec![vec![]; n],
        load: vec![false; n],
        ready: vec![None; n],
        done: vec![false; n],
        points: vec![vec![]; n],
    };
    let mut links = vec![];
    let mut listeners = 0;
    let bootstrap = match (cluster, &file.kafka.bootstrap) {
        (Some(c), _) => c.bootstrap.clone(),
        (None, Some(b)) => b.clone(),
        (None, None) => bail!("[kafka] names no cluster"),
    };
    // The cluster's ports are bound only once its nodes and proxies run.
    let mut book = Ports::new();
    book.reserve(cluster.iter().flat_map(|c| c.ports.iter().copied()));
    let mut ports = BTreeMap::new();
    for c in all(file) {
        ports.insert(c.name.clone(), book.pick()?);
    }
    let remotes = remote_links(file, &ports, seed, &mut links).await?;
    for (k, c) in all(file).enumerate() {
        for replica in 0..c.replicas {
            let name = format!("{}-{replica}", c.name);
            let seed = seed.wrapping_add(1000 * (fleet.procs.len() as u64 + 1));
            let mut places = Places {
                databases: databases.clone(),
                kafka: bootstrap.clone(),
                replica,
                incarnation: 1,
                port: match replica {
                    0 => ports[&c.name],
                    _ => book.pick()?,
                },
                ports: ports.clone(),
                remotes: remotes.clone(),
                secured: cluster
                    .and_then(|c| c.login.as_ref())
                    .map(secured::places)
                    .unwrap_or_default(),
                dir: dir.display().to_string(),
            };
            if c.faults.contains(&Fault::Network) {
                // A PostgreSQL server is reached over TCP, through a proxy; an SQLite
                // database is a file, with no link to fault.
                for (db, url) in databases {
                    if c.uses(&format!("db.{db}")) && is_postgres(url) {
                        let (proxy, routed) = postgres_link(url, seed).await?;
                        places.databases.insert(db.clone(), routed);
                        links.push(Link::new(&name, Dependency::Postgres, vec![proxy]));
                    }
                }
                if let (Some(cl), true) = (cluster.filter(|cl| cl.proxied), c.uses("kafka")) {
                    listeners += 1;
                    let tag = format!("P{listeners}");
                    let l = ProxiedListener::start(&cl.dir, &tag, seed).await?;
                    places.kafka = l.bootstrap();
                    links.push(Link::new(&name, Dependency::Kafka, l.proxies));
                }
            }
            fleet
                .ready
                .push(c.ready.as_ref().map(|r| filled(r, &places)));
            let command = builder(c.clone(), places, env.to_vec());
            fleet
                .procs
                .push(Proc::new(Role::Component, name, dir, command));
            let signals = c.faults.iter().copied().filter(|f| *f != Fault::Network);
            fleet.signals.push(signals.collect());
            fleet.load.push(k >= file.components.len());
            fleet.done.push(false);
            fleet.points.push(c.crash_points.clone());
        }
    }
    Ok((fleet, Network::new(links).with_kills()))
}

/// Starts a fault proxy in front of each of the file's remotes and adds its link (process
/// `remote NAME`) to `links`: `{remote.NAME}` of every process, the proxy's address.
async fn remote_links(
    file: &PipelineFile,
    ports: &BTreeMap<String, u16>,
    seed: u64,
    links: &mut Vec<Link>,
) -> anyhow::Result<BTreeMap<String, String>> {
    let places = Places {
        ports: ports.clone(),
        ..Places::default()
    };
    let mut remotes = BTreeMap::new();
    for (i, r) in file.remotes.iter().enumerate() {
        // Checked when the file was read: every placeholder is defined.
        let address = expand(&r.address, &places).unwrap_or_else(|_| r.address.clone());
        let upstream = std::net::ToSocketAddrs::to_socket_addrs(address.as_str())
            .ok()
            .and_then(|mut a| a.next())
            .with_context(|| format!("remote {}: {address} is no host:port", r.name))?;
        let listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let seed = seed.wrapping_add(7 * (i as u64 + 1));
        let proxy = idem_netfault::Proxy::start(listen, upstream, seed).await?;
        remotes.insert(r.name.clone(), proxy.addr().to_string());
        let process = format!("remote {}", r.name);
        links.push(Link::new(&process, Dependency::Remote, vec![proxy]));
    }
    Ok(remotes)
}

/// Whether `url` names a PostgreSQL server (as opposed to an SQLite file).
fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// A readiness with its placeholders filled in.
fn filled(r: &Ready, p: &Places) -> Ready {
    // Checked when the file was read: every placeholder is defined.
    let fill = |t: &String| expand(t, p).unwrap_or_else(|_| t.clone());
    match r {
        Ready::Log(s) => Ready::Log(fill(s)),
        Ready::Tcp(s) => Ready::Tcp(fill(s)),
        Ready::Http(s) => Ready::Http(fill(s)),
    }
}

/// The command of a replica's incarnation `n`: `env`, then the component's own environment.
fn builder(
    c: Component,
    places: Places,
    env: Vec<(String, String)>,
) -> Box<dyn Fn(u32) -> Command + Send> {
    Box::new(move |n| {
        let p = Places {
            incarnation: n,
            ..places.clone()
        };
        // Checked when the file was read: every placeholder is defined.
        let fill = |t: &str| expand(t, &p).unwrap_or_else(|_| t.to_owned());
        let mut cmd = Command::new(fill(&c.command[0]));
        cmd.args(c.command[1..].iter().map(|a| fill(a)));
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        for (k, v) in &c.env {
            cmd.env(k, fill(v));
        }
        cmd
    })
}

/// How long a process may take to be ready at start.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// Starts the brokers and creates the topics, then every component in the file's order (each
/// replica ready before the next starts), then the loads.
async fn start_in_order(
    fleet: &mut Fleet,
    file: &PipelineFile,
    cluster: Option<&Cluster>,
) -> anyhow::Result<()> {
    let brokers = fleet
        .procs
        .iter()
        .filter(|p| p.role == Role::Broker)
        .count();
    for p in fleet.procs.iter_mut().take(brokers) {
        p.start(&[])?;
    }
    let conn = match cluster {
        Some(c) => {
            kafka::wait_ready(&c.conn, c.nodes, Duration::from_secs(120)).await?;
            c.conn.clone()
        }
        None => idem_kafka::Connection::plaintext(file.kafka.bootstrap.as_deref().unwrap_or("")),
    };
    if !file.kafka.topics.is_empty() {
        let replication = i32::try_from(cluster.map_or(1, |c| c.nodes.min(3)))?;
        let (topics, partitions) = (&file.kafka.topics, file.kafka.partitions);
        idem_kafka::ensure_topics_with(&conn.client_config(), topics, partitions, replication)
            .await
            .context("creating the pipeline's topics")?;
    }
    for loads in [false, true] {
        for i in brokers..fleet.procs.len() {
            if fleet.load[i] != loads {
                continue;
            }
            fleet.procs[i].start(&[])?;
            let ready = fleet.ready[i].clone();
            if let Some(r) = ready {
                wait_ready(&mut fleet.procs[i], &r).await?;
            }
        }
    }
    Ok(())
}

/// Waits until `p` is ready by `r`; fails when it exits first or takes longer than
/// [`READY_WITHIN`].
async fn wait_ready(p: &mut Proc, r: &Ready) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        let ready = match r {
            Ready::Log(line) => p.current_log().contains(line.as_str()),
            Ready::Tcp(addr) => tcp_answers(addr),
            Ready::Http(url) => http_ok(url),
        };
        if ready {
            return Ok(());
        }
        if !p.running() {
            bail!(
                "{} exited before it was ready: {}",
                p.name,
                p.unexpected_exits.last().map_or("", String::as_str)
            );
        }
        if Instant::now() >= deadline {
            bail!("{} was not ready by {r:?} within {READY_WITHIN:?}", p.name);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn tcp_answers(addr: &str) -> bool {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|a| {
            std::net::TcpStream::connect_timeout(&a, Duration::from_millis(300)).is_ok()
        })
}

/// Does `url` (`http://host:port/path`) answer 2xx?
fn http_ok(url: &str) -> bool {
    use std::io::{Read, Write};
    use std::net::ToSocketAddrs;
    let Some(rest) = url.strip_prefix("http://") else {
        return false;
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let path = if path.is_empty() { "/" } else { path };
    let Some(addr) = authority.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return false;
    };
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if write!(s, "GET {path} HTTP/1.0\r\nHost: {authority}\r\n\r\n").is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.") && head[9] == b'2'
}

/// The faults until `end`: a signal every 0.5–2 s at a process that may receive one, a broker
/// fault every 15–25 s (a cluster of the runner's), a PostgreSQL crash at 40 % and 70 % of the
/// run (a server of the runner's), the network faults of `net`.
async fn inject(
    fleet: &mut Fleet,
    net: &mut Network,
    targets: &mut Targets<'_>,
    end: Instant,
    run: &mut RunState<'_>,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let kafka = &targets.kafka;
    let mut server_faults = match targets.postgres {
        Some(_) => postgres::server_faults(
            start,
            end.saturating_duration_since(start).as_secs(),
            targets.failover,
        ),
        None => vec![],
    };
    let mut next_signal = start + Duration::from_secs(1);
    let mut next_broker = start + Duration::from_secs(15);
    let mut next_copies = start + Duration::from_secs(5);
    let mut calm = window::Calm::default();
    let mut next_note = start;
    loop {
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        supervise(fleet, now, run)?;
        let faults = run.faults.values().sum();
        let up = not_up(fleet, &targets.windows, now).is_empty();
        let calm = calm.observe(now, up, faults);
        // A quiet one opens once the run is calm; one waiting or open holds the others too
        // (their opening is a fault).
        let held = quiet(targets, now, end);
        let may_open = |p: &window::Period| if p.is_quiet() { calm } else { !held };
        for w in &mut targets.windows {
            let open = may_open(w.period());
            move_window(w, fleet, net, (now, end, open), run)?;
        }
        for l in &mut targets.locks {
            let open = may_open(l.period());
            move_lock(l, net, (now, end, open), run).await;
        }
        observe(&mut targets.burst, &mut targets.backends, now).await;
        if quiet(targets, now, end) {
            if !calm && now >= next_note {
                let down = not_up(fleet, &targets.windows, now);
                append_timeline(
                    run.timeline,
                    &format!("quiet: waiting for calm; not up: {down:?}"),
                );
                next_note = now + Duration::from_secs(1);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let timeline = run.timeline;
        net.tick(now, run.rng, run.faults, &|l| append_timeline(timeline, l));
        kill_in_partitions(fleet, net.due_kills(now), now, run);
        if now >= next_signal {
            if signal(fleet, now, run) {
                next_signal = now
                    + run
                        .rng
                        .between(Duration::from_millis(500), Duration::from_secs(2));
            } else {
                next_signal = now + Duration::from_millis(100);
            }
        }
        server_fault(&mut server_faults, targets, fleet, now, run).await?;
        if let Some(f) = targets.foreign.as_deref_mut()
            && let Some(what) = f.tick(now, run.rng, run.faults).await?
        {
            append_timeline(run.timeline, &what);
        }
        if kafka.redeliver && now >= next_copies {
            redeliver(kafka, run).await;
            next_copies = now
                + run
                    .rng
                    .between(Duration::from_secs(5), Duration::from_secs(10));
        }
        if let Some(c) = kafka.cluster
            && now >= next_broker
        {
            next_broker = match broker(fleet, c, now, run).await? {
                true => {
                    now + run
                        .rng
                        .between(Duration::from_secs(15), Duration::from_secs(25))
                }
                false => now + Duration::from_millis(500),
            };
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Is a quiet window open or due, or a quiet lock held or due: no other fault now?
fn quiet(targets: &Targets<'_>, now: Instant, end: Instant) -> bool {
    let windows = targets.windows.iter().map(window::Timed::period);
    let locks = targets.locks.iter().map(lock::Timed::period);
    windows.chain(locks).any(|p| p.holds_all(now, end))
}

/// The processes that are down, paused, or armed with a crash point (a replica spared by an
/// open window of its component is up).
fn not_up(fleet: &mut Fleet, windows: &[window::Timed], now: Instant) -> Vec<String> {
    let done = &fleet.done;
    let spared = |name: &str| {
        windows
            .iter()
            .any(|w| w.covers(name) && w.period().is_open(now))
    };
    fleet
        .procs
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| !done[*i])
        .filter_map(|(_, p)| {
            let armed = p.armed(now) && !spared(&p.name);
            let up = p.running() && p.paused_until.is_none() && !armed;
            (!up).then(|| p.name.clone())
        })
        .collect()
}

/// Takes a table's lock when due, and notes its release.
async fn move_lock(
    l: &mut lock::Timed,
    net: &mut Network,
    (now, end, may_open): (Instant, Instant, bool),
    run: &mut RunState<'_>,
) {
    match l.tick((now, end, may_open)).await {
        Some(lock::Moved::Taken { key, what, until }) => {
            if l.period().holds_all(now, end) {
                net.heal_all();
                net.postpone(until);
            }
            run.count(&key, &what);
        }
        Some(lock::Moved::Released { what, count }) => {
            append_timeline(run.timeline, &what);
            if let Some((key, n)) = count {
                *run.faults.entry(key).or_default() += n;
            }
        }
        None => {}
    }
}

/// Opens or closes a component's window when due; while it is open, the network faults spare
/// the links of its replicas.
fn move_window(
    w: &mut window::Timed,
    fleet: &mut Fleet,
    net: &mut Network,
    (now, end, may_open): (Instant, Instant, bool),
    run: &mut RunState<'_>,
) -> anyhow::Result<()> {
    match w.tick((now, end, may_open), &mut fleet.procs)? {
        Some(window::Moved::Opened { key, what, until }) => {
            if w.period().holds_all(now, end) {
                net.heal_all();
                net.postpone(until);
            }
            for p in fleet.procs.iter().filter(|p| w.covers(&p.name)) {
                net.spare(&p.name, until);
            }
            run.count(&key, &what);
        }
        Some(window::Moved::Closed { what }) => append_timeline(run.timeline, &what),
        None => {}
    }
    Ok(())
}

/// What the faults beside signals and the network hit: Kafka, and the runner's PostgreSQL
/// server when it started one.
struct Targets<'a> {
    kafka: KafkaTargets<'a>,
    postgres: Option<&'a Server>,
    /// `[postgres] failover`: the server fails over to its standby once.
    failover: bool,
    /// The components restarted after the failover, each with the environment it adds.
    after_failover: Vec<(String, Vec<(String, String)>)>,
    /// The `[hostile]` section's writer.
    foreign: Option<&'a mut ForeignWriter>,
    /// The components' windows.
    windows: Vec<window::Timed>,
    /// The tables locked for a while.
    locks: Vec<lock::Timed>,
    /// The `[burst]`'s outbox and its drain.
    burst: Option<(AnyPool, burst::Watch)>,
    /// The backends on the databases whose URL asks for TLS (a secured run).
    backends: Option<secured::BackendWatch>,
}

/// Looks at what the run watches whatever else waits (a quiet period included): the burst's
/// drain, and the backends of a secured run.
async fn observe(
    burst: &mut Option<(AnyPool, burst::Watch)>,
    backends: &mut Option<secured::BackendWatch>,
    now: Instant,
) {
    if let Some((outbox, watch)) = burst {
        watch.tick(outbox, now).await;
    }
    if let Some(b) = backends {
        b.tick(now).await;
    }
}

/// The server fault that is due, if any, unless a window's replicas that use the run's
/// server keep it while the window is open.
async fn server_fault(
    due: &mut Vec<(Instant, postgres::ServerFault)>,
    targets: &Targets<'_>,
    fleet: &mut Fleet,
    now: Instant,
    run: &mut RunState<'_>,
) -> anyhow::Result<()> {
    let spared = targets
        .windows
        .iter()
        .any(|w| w.uses_server() && w.period().is_open(now));
    let Some(server) = targets.postgres else {
        return Ok(());
    };
    if spared || due.last().is_none_or(|(t, _)| now < *t) {
        return Ok(());
    }
    match due.pop() {
        Some((_, postgres::ServerFault::Crash)) => crash_postgres(server, run).await,
        Some((_, postgres::ServerFault::Failover)) => {
            fail_over(server, fleet, &targets.after_failover, run).await
        }
        None => Ok(()),
    }
}

/// Crashes the runner's PostgreSQL server and starts it again (`postgres_restart`).
async fn crash_postgres(server: &Server, run: &mut RunState<'_>) -> anyhow::Result<()> {
    postgres::crash_and_restart(server).await?;
    run.count(
        "postgres_restart",
        "the run's PostgreSQL server (pg_ctl stop -m immediate, start)",
    );
    Ok(())
}

/// Fails the runner's server over to its standby (`postgres_failover`), then restarts the
/// replicas of each component of `after` with its environment added to this start and every
/// later one (`restarted_after_failover`, one per replica).
async fn fail_over(
    server: &Server,
    fleet: &mut Fleet,
    after: &[(String, Vec<(String, String)>)],
    run: &mut RunState<'_>,
) -> anyhow::Result<()> {
    postgres::fail_over(server).await?;
    run.count(
        "postgres_failover",
        "the run's PostgreSQL server (primary stopped as by a crash, its synchronous standby \
         promoted in its place)",
    );
    for (component, env) in after {
        for (i, p) in fleet.procs.iter_mut().enumerate() {
            if fleet.done[i] || !window::is_replica(&p.name, component) {
                continue;
            }
            if p.paused_until.take().is_some() {
                p.signal(18);
            }
            p.kill9();
            // Every later start too: a replica killed before it acted on it (made the slot
            // again, say) still does.
            p.lasting_env.clone_from(env);
            p.start(&[])?;
            p.restart_at = None;
            let what = format!("{} with {env:?} from now on", p.name);
            run.count("restarted_after_failover", &what);
        }
    }
    Ok(())
}

/// Each component's `after_failover` environment, by component name.
fn after_failover(file: &PipelineFile) -> Vec<(String, Vec<(String, String)>)> {
    all(file)
        .filter_map(|c| {
            let env = c.after_failover.as_ref()?.env.clone().into_iter().collect();
            Some((c.name.clone(), env))
        })
        .collect()
}

/// The Kafka side of the faults: the runner's cluster (broker faults), and the topics whose
/// records are produced again.
struct KafkaTargets<'a> {
    cluster: Option<&'a Cluster>,
    conn: idem_kafka::Connection,
    topics: &'a [String],
    redeliver: bool,
}

impl<'a> KafkaTargets<'a> {
    /// The `[kafka]` section's cluster: the one the runner started, or its bootstrap.
    fn of(file: &'a PipelineFile, cluster: Option<&'a Cluster>) -> Self {
        let conn = match cluster {
            Some(c) => c.conn.clone(),
            None => {
                idem_kafka::Connection::plaintext(file.kafka.bootstrap.as_deref().unwrap_or(""))
            }
        };
        Self {
            cluster,
            conn,
            topics: &file.kafka.topics,
            redeliver: file.kafka.redeliver,
        }
    }
}

/// Copies of three recent records of each topic (`redelivered_records`); a copy that cannot
/// be made now (a broker down) is written to the timeline and skipped.
async fn redeliver(kafka: &KafkaTargets<'_>, run: &mut RunState<'_>) {
    for topic in kafka.topics {
        let picks: Vec<u64> = (0..3).map(|_| run.rng.next()).collect();
        let (conn, t) = (kafka.conn.client_config(), topic.clone());
        let copied = tokio::task::spawn_blocking(move || {
            let mut i = 0;
            let mut pick = |len: usize| {
                i += 1;
                usize::try_from(picks[i - 1] % len.max(1) as u64).unwrap_or(0)
            };
            super::redeliver::copy_recent(&conn, &t, picks.len(), &mut pick)
        })
        .await;
        match copied {
            Ok(Ok(copied)) if !copied.is_empty() => {
                let n = copied.len() as u64;
                *run.faults
                    .entry("redelivered_records".to_owned())
                    .or_default() += n;
                let at: Vec<String> = copied.iter().map(|(p, o)| format!("{p}/{o}")).collect();
                let line = format!("redelivered_records {topic}: copies of {}", at.join(", "));
                append_timeline(run.timeline, &line);
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => append_timeline(
                run.timeline,
                &format!("redelivered_records {topic} failed: {e:#}"),
            ),
            Err(e) => append_timeline(
                run.timeline,
                &format!("redelivered_records {topic} failed: {e}"),
            ),
        }
    }
}

/// What the fault loop carries along: the dice, the counts, the timeline and the crash
/// points.
struct RunState<'a> {
    rng: &'a mut Rng,
    faults: &'a mut BTreeMap<String, u64>,
    timeline: &'a Path,
    arming: Arming,
}

impl RunState<'_> {
    fn count(&mut self, kind: &str, what: &str) {
        *self.faults.entry(kind.to_owned()).or_default() += 1;
        append_timeline(self.timeline, &format!("{kind} {what}"));
    }
}

/// SIGKILLs the processes of `names` (killed inside their partition), restarted after
/// 0.2–1.5 s.
fn kill_in_partitions(fleet: &mut Fleet, names: Vec<String>, now: Instant, run: &mut RunState<'_>) {
    for name in names {
        let Some(p) = fleet.procs.iter_mut().find(|p| p.name == name) else {
            continue;
        };
        // An armed process is left alone until its point has had time to fire.
        if !p.running() || p.armed(now) {
            continue;
        }
        p.kill9();
        let down = run
            .rng
            .between(Duration::from_millis(200), Duration::from_millis(1500));
        p.restart_at = Some(now + down);
        let line = format!(
            "net_partition_kill: SIGKILL {name} incarnation {}",
            p.incarnation
        );
        append_timeline(run.timeline, &line);
    }
}

/// A crash point armed, or a signal at a process that may receive one, drawn by the dice:
/// `false` when the one drawn is down, paused or armed (tried again shortly).
fn signal(fleet: &mut Fleet, now: Instant, run: &mut RunState<'_>) -> bool {
    if let Some(point) = run.arming.next(run.faults, run.rng) {
        return arm(fleet, point, now, run);
    }
    let eligible: Vec<usize> = (0..fleet.procs.len())
        .filter(|i| !fleet.signals[*i].is_empty() && !fleet.done[*i])
        .collect();
    if eligible.is_empty() {
        return true;
    }
    let i = eligible[run.rng.index(eligible.len())];
    let p = &mut fleet.procs[i];
    if !p.running() || p.paused_until.is_some() || p.armed(now) {
        return false;
    }
    let kinds = &fleet.signals[i];
    let what = format!("{} incarnation {}", p.name, p.incarnation);
    // Every kind a process allows comes once before the dice choose: a short run tests each.
    let unsent = kinds
        .iter()
        .copied()
        .find(|k| !run.faults.contains_key(signal_name(*k)));
    let kind = unsent.unwrap_or_else(|| kinds[run.rng.index(kinds.len())]);
    match kind {
        Fault::Kill => {
            p.kill9();
            p.restart_at = Some(
                now + run
                    .rng
                    .between(Duration::from_millis(200), Duration::from_millis(1500)),
            );
            run.count(signal_name(kind), &what);
        }
        Fault::Pause => {
            p.signal(19);
            p.paused_until = Some(
                now + run
                    .rng
                    .between(Duration::from_secs(1), Duration::from_secs(4)),
            );
            run.count(signal_name(kind), &what);
        }
        Fault::Restart => {
            p.stop(Duration::from_secs(10));
            p.restart_at = Some(now + Duration::from_millis(200));
            run.count(signal_name(kind), &what);
        }
        Fault::Network => {}
    }
    true
}

/// SIGKILLs a running replica of a component that lists `point` (none armed already) and
/// starts it again with `point` armed, left alone for 8 s so that the point has work to reach
/// it; `false` when no replica can take it now.
fn arm(fleet: &mut Fleet, point: CrashPoint, now: Instant, run: &mut RunState<'_>) -> bool {
    let candidates: Vec<usize> = (0..fleet.procs.len())
        .filter(|i| fleet.points[*i].contains(&point) && !fleet.done[*i])
        .filter(|i| {
            let p = &mut fleet.procs[*i];
            p.running() && p.paused_until.is_none() && !p.armed(now)
        })
        .collect();
    if candidates.is_empty() {
        return false;
    }
    let p = &mut fleet.procs[candidates[run.rng.index(candidates.len())]];
    let hit = 1 + run.rng.below(3);
    let (env, counted) = arm_env(point, hit);
    p.kill9();
    if let Err(e) = p.start(&[(env.0, env.1)]) {
        // Restarted plainly by the supervisor; the fault is on the timeline.
        append_timeline(run.timeline, &format!("arming {point} failed: {e:#}"));
        p.restart_at = Some(now);
        return true;
    }
    p.armed_until = Some(now + Duration::from_secs(8));
    let what = format!("{} incarnation {} at hit {hit}", p.name, p.incarnation);
    run.count(&counted, &what);
    true
}

/// The name a signal fault is counted under.
fn signal_name(kind: Fault) -> &'static str {
    match kind {
        Fault::Kill => "sigkill",
        Fault::Pause => "sigstop",
        Fault::Restart => "sigterm_restart",
        Fault::Network => "network",
    }
}

/// A broker fault on the runner's cluster, as the reference run chooses them (`false`: the
/// cluster is still recovering from the last one; tried again shortly).
async fn broker(
    fleet: &mut Fleet,
    c: &Cluster,
    now: Instant,
    run: &mut RunState<'_>,
) -> anyhow::Result<bool> {
    let partitions = if c.nodes > 1 {
        Some(partitions_of_first_topic(c).await?)
    } else {
        None
    };
    let all_up = fleet
        .procs
        .iter_mut()
        .filter(|p| p.role == Role::Broker)
        .all(|p| p.running() && p.paused_until.is_none());
    let first = schedule::first_broker_fault(run.faults);
    let Plan::Broker { fault, down } =
        schedule::broker(c.nodes, partitions.as_deref(), all_up, first, run.rng)
    else {
        return Ok(false);
    };
    crate::chaos::kafka::hit_broker(&mut fleet.procs, fault, down, now)?;
    run.count(
        fault.kind(),
        &format!("{fault:?} for {:.1} s", down.as_secs_f64()),
    );
    Ok(true)
}

/// The partitions of the file's first topic (none: nothing to choose from).
async fn partitions_of_first_topic(
    c: &Cluster,
) -> anyhow::Result<Vec<idem_kafka::admin::PartitionInfo>> {
    let Some(topic) = c.topics.first() else {
        return Ok(vec![]);
    };
    crate::chaos::kafka::partitions(&c.conn, topic).await
}

/// Resumes what is due, restarts what is down: a process killed by the runner at its planned
/// time, one that exited on its own (listed in its `unexpected_exits`) after a short wait.
fn supervise(fleet: &mut Fleet, now: Instant, run: &mut RunState<'_>) -> anyhow::Result<()> {
    for (i, p) in fleet.procs.iter_mut().enumerate() {
        if fleet.done[i] {
            continue;
        }
        if p.paused_until.is_some_and(|t| now >= t) {
            p.signal(18);
            p.paused_until = None;
        }
        if p.running() {
            continue;
        }
        match schedule::revival(p.restart_at, now, run.rng) {
            schedule::Revival::Start => p.start(&[])?,
            schedule::Revival::Wait => {}
            schedule::Revival::Plan(after) => p.restart_at = Some(now + after),
        }
    }
    Ok(())
}

/// The faults are over: every link healed, every paused process resumed, every dead one due
/// for a restart now.
fn calm(fleet: &mut Fleet, net: &mut Network, run: &mut RunState<'_>) -> anyhow::Result<()> {
    net.heal_all();
    append_timeline(run.timeline, "faults stopped; every link healed");
    let now = Instant::now();
    for p in &mut fleet.procs {
        if p.paused_until.is_some() {
            p.paused_until = Some(now);
        }
        if p.restart_at.is_some() {
            p.restart_at = Some(now);
        }
    }
    supervise(fleet, now, run)
}

/// Stops the loads for good (SIGTERM, then SIGKILL after 10 s).
fn stop_loads(fleet: &mut Fleet) {
    for i in 0..fleet.procs.len() {
        if fleet.load[i] {
            fleet.procs[i].stop(Duration::from_secs(10));
            fleet.done[i] = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_placeholder_left_in_a_value_is_found_and_one_in_a_comment_is_not() {
        let text = "# {db.NAME} is a database's URL\n[[check]]\ndb = \"postgres://h/o\"\n\
                    [[check.effect]]\ndb = \"x{db.ledger}y\"\n";
        let value = |text: &str| toml::from_str::<toml::Value>(text).unwrap();
        assert_eq!(unfilled(&value(text)), Some("{db.ledger}".to_owned()));
        assert_eq!(
            unfilled(&value(&text.replace("x{db.ledger}y", "postgres://h/l"))),
            None
        );
    }

    #[test]
    fn a_remote_no_component_called_fails_the_run_and_a_called_one_does_not() {
        let connections = [("bank".to_owned(), 0), ("points".to_owned(), 12)].into();
        let failures = unused_remotes(&connections);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].starts_with("remote bank carried no connection"));
        assert!(failures[0].contains("{remote.bank}"));
        assert_eq!(unused_remotes(&BTreeMap::new()), Vec::<String>::new());
    }
}
