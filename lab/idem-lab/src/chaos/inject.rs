//! The injection phase: for `--duration`, supervise the processes, open and close the windows,
//! write hostile rows, scrape metrics, and carry out the faults the seeded [`Schedule`] plans.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;
use idem_core::crash::Mechanism;

use super::kafka::BrokerFault;
use super::procs::{Proc, Rng, Role};
use super::schedule::{self, FaultKind, Plan, Revival, Schedule, Slot};
use super::topology::Topology;
use super::windows::Windows;
use super::{burst, crash_counts, hostile, locker};
use crate::demo::world::Databases;

/// The counters scraped from the processes' metrics.
pub(super) const COUNTERS: [&str; 5] = [
    "idem_duplicate_delivery_total",
    "idem_duplicate_skip_total",
    "idem_outbox_republish_total",
    // What the long lock did to the settlement handlers (windows.rs).
    "idem_consumer_retry_total",
    "idem_consumer_processed_total",
];

/// What the injection phase leaves for settling and the report.
pub(super) struct Injected {
    /// Faults by kind.
    pub faults: BTreeMap<String, u64>,
    /// The hostile rows the outbox stored.
    pub hostile_accepted: Vec<hostile::Accepted>,
    /// Hostile rows the contract treated otherwise than it should.
    pub hostile_violations: Vec<String>,
    /// The windows, still to be closed.
    pub windows: Windows,
    /// The burst written before the relays started, and how fast it drained.
    pub burst: burst::Burst,
}

/// The run's processes and where they report.
pub(super) struct World<'a> {
    /// The supervised processes, brokers first.
    pub procs: &'a mut [Proc],
    /// The databases.
    pub dbs: &'a Databases,
    /// The topology (brokers, topic).
    pub topology: &'a Topology,
    /// Kafka nodes.
    pub nodes: usize,
    /// Where armed crash points log that they fired.
    pub crash_log: &'a Path,
    /// The burst's aggregate prefix and size (written before the processes started).
    pub burst: (&'a str, i64),
}

/// Timers of the injection loop.
struct Timers {
    started: Instant,
    next_hostile: Instant,
    hostile_round: u64,
    last_scrape: Instant,
    last_progress: Instant,
    next_lock: Instant,
    /// Locks of the outbox under way.
    locks: Vec<tokio::task::JoinHandle<anyhow::Result<locker::Locked>>>,
    /// The burst draining.
    burst: burst::Watch,
}

/// Injects faults until `seconds` have passed.
pub(super) async fn inject(
    w: &mut World<'_>,
    seconds: u64,
    mechanism: Option<Mechanism>,
    rng: &mut Rng,
) -> anyhow::Result<Injected> {
    let started = Instant::now();
    let mut schedule = Schedule::with_points(started, mechanism, rng, w.topology.points());
    let end = started + Duration::from_secs(seconds);
    let mut t = Timers {
        started,
        next_hostile: started + Duration::from_secs(5),
        hostile_round: 0,
        last_scrape: started,
        last_progress: started,
        next_lock: started + Duration::from_secs(10),
        locks: vec![],
        burst: burst::Watch::new(burst::AGGREGATE_TYPE, w.burst.0, w.burst.1, started),
    };
    let mut out = Injected {
        faults: BTreeMap::new(),
        hostile_accepted: vec![],
        hostile_violations: vec![],
        windows: Windows::new(started, w.crash_log.with_file_name("faults.log")),
        burst: burst::Burst::default(),
    };
    while Instant::now() < end {
        supervise(w.procs, rng);
        let now = Instant::now();
        out.windows
            .tick(now, end, w.procs, &w.dbs.settlement, &mut out.faults)
            .await?;
        if now >= t.next_hostile {
            let denied = w.topology.secure.is_some();
            hostile_round(w.dbs, denied, &mut t, &mut out, now, rng).await?;
        }
        if now >= t.next_lock {
            let (orders, hold) = (w.dbs.orders.clone(), schedule::lock_hold(rng));
            t.locks.push(tokio::spawn(async move {
                locker::lock_pending(&orders, hold).await
            }));
            t.next_lock = now + schedule::lock_interval(rng);
        }
        t.burst.tick(&w.dbs.orders, now).await;
        if now >= t.last_scrape + Duration::from_secs(1) {
            for p in w.procs.iter_mut().filter(|p| p.role != Role::Broker) {
                p.scrape(&COUNTERS);
            }
            t.last_scrape = now;
        }
        // No other fault while the long lock is due or held (see `Windows::holds_faults`).
        let held = out.windows.holds_faults(now, end);
        let may_run = schedule::may_run(
            held,
            out.windows.lock_open(),
            schedule.first_broker_due(now, &out.faults),
        );
        if schedule.due(now)
            && may_run
            && !fault(w, &mut schedule, &mut out.faults, now, rng).await?
        {
            // Nothing could be done: plan again at once.
            continue;
        }
        if now >= t.last_progress + Duration::from_secs(5) {
            progress(w, &t, &out.faults).await;
            t.last_progress = now;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    count_locks(t.locks, &mut out.faults).await;
    out.burst = t.burst.burst;
    Ok(out)
}

/// Counts what the outbox locks of the run did.
async fn count_locks(
    locks: Vec<tokio::task::JoinHandle<anyhow::Result<locker::Locked>>>,
    faults: &mut BTreeMap<String, u64>,
) {
    for lock in locks {
        // A lock that a crash of its session cut short did nothing to count.
        let Ok(Ok(locked)) = lock.await else {
            *faults.entry("outbox_lock_lost".to_owned()).or_default() += 1;
            continue;
        };
        *faults.entry("outbox_locked".to_owned()).or_default() += 1;
        *faults
            .entry("outbox_lock_waiters_terminated".to_owned())
            .or_default() += u64::try_from(locked.terminated).unwrap_or(0);
    }
}

/// A foreign writer's round of hostile rows; the next comes in 20 to 40 s.
async fn hostile_round(
    dbs: &Databases,
    denied: bool,
    t: &mut Timers,
    out: &mut Injected,
    now: Instant,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    t.hostile_round += 1;
    let round = hostile::insert_round(
        &dbs.orders,
        t.hostile_round,
        &hostile::Shape::reference(denied),
    )
    .await?;
    *out.faults.entry("hostile_rows".to_owned()).or_default() +=
        (round.accepted.len() + round.refused) as u64;
    *out.faults
        .entry("hostile_rows_refused".to_owned())
        .or_default() += round.refused as u64;
    out.hostile_accepted.extend(round.accepted);
    out.hostile_violations.extend(round.violations);
    t.next_hostile = now + schedule::hostile_interval(rng);
    Ok(())
}

/// Plans the fault due and carries it out; `false` when nothing could be done (the schedule
/// says when to try again).
async fn fault(
    w: &mut World<'_>,
    schedule: &mut Schedule,
    faults: &mut BTreeMap<String, u64>,
    now: Instant,
    rng: &mut Rng,
) -> anyhow::Result<bool> {
    let unfired = schedule.unfired(&crash_counts(w.crash_log, w.topology.points()));
    let kind = schedule.kind(now, &unfired, faults, rng);
    let plan = match kind {
        FaultKind::CrashPoint => schedule.crash_point(&unfired, faults, &slots(w.procs, now), rng),
        FaultKind::Broker => {
            let partitions = if w.nodes > 1 {
                Some(partitions(&w.topology.kafka, &w.topology.topic).await?)
            } else {
                None
            };
            let all_up = w
                .procs
                .iter_mut()
                .filter(|p| p.role == Role::Broker)
                .all(|p| p.running() && p.paused_until.is_none());
            let first = schedule::first_broker_fault(faults);
            schedule::broker(w.nodes, partitions.as_deref(), all_up, first, rng)
        }
        signal => schedule::signal(signal, &slots(w.procs, now), rng),
    };
    if let Plan::Retry { after } = plan {
        schedule.retry(now, after);
        return Ok(false);
    }
    let counted = apply(w.procs, &plan, kind, now)?;
    timeline(w.crash_log, &counted, &plan, w.procs);
    *faults.entry(counted).or_default() += 1;
    schedule.done(now, matches!(plan, Plan::Broker { .. }), rng);
    Ok(true)
}

/// Appends the fault to `faults.log` beside the crash log: when, what, and which incarnation
/// of which process, so that a failed run's logs say what happened when.
fn timeline(crash_log: &Path, counted: &str, plan: &Plan, procs: &[Proc]) {
    let target = match *plan {
        Plan::Arm { proc, .. } | Plan::Kill { proc, .. } | Plan::Pause { proc, .. } => {
            procs.get(proc)
        }
        Plan::Restart { proc } => procs.get(proc),
        Plan::Broker { .. } | Plan::Retry { .. } => None,
    };
    let who = target.map_or_else(String::new, |p| {
        format!(" {} incarnation {}", p.name, p.incarnation)
    });
    timeline_line(crash_log, &format!("{counted}{who} {plan:?}"));
}

/// Appends `what`, stamped with the time, to `faults.log` beside the crash log.
fn timeline_line(crash_log: &Path, what: &str) {
    append_timeline(&crash_log.with_file_name("faults.log"), what);
}

/// Appends `what`, stamped with the time, to the fault timeline at `path`.
pub(super) fn append_timeline(path: &Path, what: &str) {
    let line = format!("{} {what}\n", chrono::Utc::now().format("%H:%M:%S%.3f"));
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
    if let Err(e) = appended {
        tracing::warn!(error = %e, path = %path.display(), "cannot write the fault timeline");
    }
}

/// Carries a plan out; returns the name the report counts it under.
fn apply(procs: &mut [Proc], plan: &Plan, kind: FaultKind, now: Instant) -> anyhow::Result<String> {
    match *plan {
        Plan::Arm { proc, point, hit } => {
            let p = &mut procs[proc];
            p.kill9();
            p.start(&[("IDEM_CRASH_POINTS", format!("{point}@{hit}"))])?;
            // Left alone for a while, so that the point has work to reach it.
            p.armed_until = Some(now + Duration::from_secs(8));
            Ok(schedule::armed_key(point))
        }
        Plan::Broker { fault, down } => {
            hit_broker(procs, fault, down, now)?;
            Ok(fault.kind().to_owned())
        }
        Plan::Kill { proc, down } => {
            procs[proc].kill9();
            procs[proc].restart_at = Some(now + down);
            Ok(kind.name().to_owned())
        }
        Plan::Pause { proc, down } => {
            procs[proc].signal(19);
            procs[proc].paused_until = Some(now + down);
            Ok(kind.name().to_owned())
        }
        Plan::Restart { proc } => {
            procs[proc].stop(Duration::from_secs(10));
            procs[proc].restart_at = Some(now + Duration::from_millis(200));
            Ok(kind.name().to_owned())
        }
        Plan::Retry { .. } => bail!("a retry is no fault to carry out"),
    }
}

/// The processes as the schedule sees them at `now`.
fn slots(procs: &mut [Proc], now: Instant) -> Vec<Slot> {
    procs
        .iter_mut()
        .map(|p| Slot {
            role: p.role,
            running: p.running(),
            paused: p.paused_until.is_some(),
            armed: p.armed(now),
        })
        .collect()
}

/// Kills the node of `fault` (restarted after `down`) or pauses it for `down`.
pub(super) fn hit_broker(
    procs: &mut [Proc],
    fault: BrokerFault,
    down: Duration,
    now: Instant,
) -> anyhow::Result<()> {
    let (BrokerFault::Kill(id)
    | BrokerFault::LeaderKill(id)
    | BrokerFault::FollowerPause(id)
    | BrokerFault::Pause(id)) = fault;
    let Some(node) = procs.iter_mut().find(|p| p.name == format!("kafka-{id}")) else {
        bail!("the cluster reported broker {id}, which this run did not start");
    };
    match fault {
        BrokerFault::Kill(_) | BrokerFault::LeaderKill(_) => {
            node.kill9();
            node.restart_at = Some(now + down);
        }
        BrokerFault::FollowerPause(_) | BrokerFault::Pause(_) => {
            node.signal(19);
            node.paused_until = Some(now + down);
        }
    }
    Ok(())
}

/// The partitions of the run's topic (none when the cluster cannot say in time).
pub(super) async fn partitions(
    kafka: &idem_kafka::Connection,
    topic: &str,
) -> anyhow::Result<Vec<idem_kafka::admin::PartitionInfo>> {
    let (conn, t) = (kafka.client_config(), topic.to_owned());
    Ok(tokio::task::spawn_blocking(move || {
        idem_kafka::admin::partitions(&conn, &t, Duration::from_secs(2))
    })
    .await?
    .unwrap_or_default())
}

/// The progress line, every five seconds.
async fn progress(w: &World<'_>, t: &Timers, faults: &BTreeMap<String, u64>) {
    let fired: u64 = crash_counts(w.crash_log, w.topology.points())
        .values()
        .sum();
    eprintln!(
        "idem chaos: {:>4} s  orders {}  settled {}  awarded {}  faults {}  crash points fired {fired}",
        t.started.elapsed().as_secs(),
        count(&w.dbs.orders, "SELECT count(*) FROM orders").await,
        count(&w.dbs.settlement, "SELECT count(*) FROM settlements").await,
        count(&w.dbs.points, "SELECT count(*) FROM points_awards").await,
        faults.values().sum::<u64>(),
    );
}

/// A count for the progress line (-1 when the database cannot say).
async fn count(pool: &idem_sql::AnyPool, sql: &str) -> i64 {
    pool.scalar(sql).await.unwrap_or(-1)
}

/// Resumes paused processes and restarts dead ones when their time comes. A process that
/// died by itself (an armed crash point) is restarted shortly, without the crash point.
fn supervise(procs: &mut [Proc], rng: &mut Rng) {
    let now = Instant::now();
    for p in procs.iter_mut() {
        if let Some(t) = p.paused_until
            && now >= t
        {
            p.signal(18);
            p.paused_until = None;
        }
        if !p.running() {
            match schedule::revival(p.restart_at, now, rng) {
                Revival::Start => {
                    if let Err(e) = p.start(&[]) {
                        tracing::error!(error = %e, process = %p.name, "restart failed");
                    }
                }
                Revival::Wait => {}
                Revival::Plan(after) => p.restart_at = Some(now + after),
            }
        }
    }
}
