//! The seeded fault schedule, as pure decisions: which fault comes next, at which process, and
//! when. The runner (`inject.rs`) observes the processes, asks here, and carries the plan out;
//! given the same seed and the same observations, the same plans come out in the same order.
//! Every draw from the [`Rng`] happens here, in the order the schedule has always drawn them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use idem_core::crash::{CrashPoint, Mechanism};
use idem_kafka::admin::PartitionInfo;

use super::kafka::{self, BrokerFault};
use super::procs::{Rng, Role};

/// A broker fault is due this long after the last one.
const BROKER_EVERY: Duration = Duration::from_secs(15);
/// The first broker fault is due this long after the start: after the slow points-API window has
/// opened (8 s) and had traffic, which the `key-lock-renewal` negative control needs. A long
/// lock that is due but not yet open does not hold it back ([`may_run`]).
pub(super) const FIRST_BROKER_FAULT: Duration = BROKER_EVERY;

/// The kind of the next fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FaultKind {
    /// Restart a process with a crash point armed.
    CrashPoint,
    /// SIGKILL a process; it is restarted shortly.
    Sigkill,
    /// SIGSTOP a process for a while.
    Sigstop,
    /// Kill or pause a Kafka node.
    Broker,
    /// Stop a process gracefully (SIGTERM) and restart it.
    SigtermRestart,
}

impl FaultKind {
    /// The name the report's `faults` counts it under (crash points and broker faults are
    /// counted under names of their own).
    pub(super) fn name(self) -> &'static str {
        match self {
            FaultKind::CrashPoint => "crash_point",
            FaultKind::Sigkill => "sigkill",
            FaultKind::Sigstop => "sigstop",
            FaultKind::Broker => "broker",
            FaultKind::SigtermRestart => "sigterm_restart",
        }
    }
}

/// What a process looks like to the schedule at one instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Slot {
    /// Its role.
    pub role: Role,
    /// Its current incarnation is alive.
    pub running: bool,
    /// It is SIGSTOPped.
    pub paused: bool,
    /// A crash point is armed in it and still given time to fire.
    pub armed: bool,
}

/// One planned fault, drawn from the seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Plan {
    /// SIGKILL process `proc` and restart it at once with `point` armed to fire at its `hit`th
    /// reach.
    Arm {
        /// Index of the process.
        proc: usize,
        /// The crash point.
        point: CrashPoint,
        /// The reach at which it fires (1 to 3).
        hit: u64,
    },
    /// Kill or pause the Kafka node of `fault` for `down`.
    Broker {
        /// The fault, naming the node.
        fault: BrokerFault,
        /// How long until the node is restarted (a kill) or resumed (a pause).
        down: Duration,
    },
    /// SIGKILL process `proc`; restart it after `down`.
    Kill {
        /// Index of the process.
        proc: usize,
        /// How long it stays dead.
        down: Duration,
    },
    /// SIGSTOP process `proc`; resume it after `down`.
    Pause {
        /// Index of the process.
        proc: usize,
        /// How long it stays paused.
        down: Duration,
    },
    /// Stop process `proc` gracefully and restart it shortly.
    Restart {
        /// Index of the process.
        proc: usize,
    },
    /// Nothing to do now: try again after `after` (`None`: at once, without waiting).
    Retry {
        /// When to try again.
        after: Option<Duration>,
    },
}

/// The schedule's state between faults.
pub(super) struct Schedule {
    /// The crash points this run arms.
    points: &'static [CrashPoint],
    /// Every crash point, in a seeded order: each is armed early until it has fired once.
    first_round: Vec<CrashPoint>,
    /// The window a negative control's broken mechanism opens, aimed at every other time.
    focus: Option<CrashPoint>,
    /// Faults planned so far.
    tick: u64,
    /// When the next fault is due.
    pub next_fault: Instant,
    /// When a broker fault is next due.
    next_broker_fault: Instant,
}

impl Schedule {
    /// The schedule of a run started at `started`, breaking `mechanism` if any.
    #[cfg(test)]
    pub(super) fn new(started: Instant, mechanism: Option<Mechanism>, rng: &mut Rng) -> Self {
        Self::with_points(started, mechanism, rng, CrashPoint::POLLING_PIPELINE)
    }

    /// A schedule arming `points` (the crash points of the pipeline the run has:
    /// [`run_points`]).
    pub(super) fn with_points(
        started: Instant,
        mechanism: Option<Mechanism>,
        rng: &mut Rng,
        points: &'static [CrashPoint],
    ) -> Self {
        Schedule {
            points,
            first_round: first_round(rng, points),
            focus: mechanism.and_then(window_of),
            tick: 0,
            next_fault: started + Duration::from_secs(2),
            next_broker_fault: started + FIRST_BROKER_FAULT,
        }
    }

    /// Is a fault due at `now`?
    pub(super) fn due(&self, now: Instant) -> bool {
        now >= self.next_fault
    }

    /// Is the run's first broker fault due at `now` (none happened yet)?
    pub(super) fn first_broker_due(&self, now: Instant, faults: &BTreeMap<String, u64>) -> bool {
        now >= self.next_broker_fault && first_broker_fault(faults)
    }

    /// The crash points of the first round that have not fired yet.
    pub(super) fn unfired(&self, fired: &BTreeMap<String, u64>) -> Vec<CrashPoint> {
        self.first_round
            .iter()
            .copied()
            .filter(|p| fired.get(p.as_str()).copied().unwrap_or(0) == 0)
            .collect()
    }

    /// The kind of the fault due at `now`, given what `faults` counted so far.
    pub(super) fn kind(
        &mut self,
        now: Instant,
        unfired: &[CrashPoint],
        faults: &BTreeMap<String, u64>,
        rng: &mut Rng,
    ) -> FaultKind {
        self.tick += 1;
        let roll = rng.below(100);
        let broker_due = now >= self.next_broker_fault;
        let kind = choose_kind(
            roll,
            self.tick,
            unfired.is_empty(),
            broker_due,
            first_broker_fault(faults),
        );
        first_of_each_signal(kind, faults)
    }

    /// Plans a crash point: the unfired one armed least often so far (a negative control's
    /// window every other time), in a process of its role that has none armed.
    pub(super) fn crash_point(
        &self,
        unfired: &[CrashPoint],
        faults: &BTreeMap<String, u64>,
        slots: &[Slot],
        rng: &mut Rng,
    ) -> Plan {
        let point = choose_point(self.focus, unfired, faults, self.points, rng);
        let role = role_of_point(point);
        let candidates: Vec<usize> = (0..slots.len())
            .filter(|i| slots[*i].role == role && !slots[*i].armed)
            .collect();
        if candidates.is_empty() {
            return Plan::Retry { after: None };
        }
        let proc = candidates[rng.index(candidates.len())];
        let hit = 1 + rng.below(3);
        Plan::Arm { proc, point, hit }
    }

    /// Records that a fault was carried out at `now` (`broker`: a broker fault) and draws when
    /// the next one is due.
    pub(super) fn done(&mut self, now: Instant, broker: bool, rng: &mut Rng) {
        if broker {
            self.next_broker_fault = now + BROKER_EVERY;
        }
        self.next_fault =
            now + rng.between(Duration::from_millis(400), Duration::from_millis(1600));
    }

    /// Puts the next fault off: `after` from `now`, or at once.
    pub(super) fn retry(&mut self, now: Instant, after: Option<Duration>) {
        if let Some(after) = after {
            self.next_fault = now + after;
        }
    }
}

/// The crash points of a run's pipeline: the polling relay's and the rest, or with `cdc` the
/// CDC relay's instead of the polling relay's.
pub(super) fn run_points(cdc: bool) -> &'static [CrashPoint] {
    if cdc {
        CDC_RUN_POINTS
    } else {
        CrashPoint::POLLING_PIPELINE
    }
}

/// [`run_points`] of a run with CDC relays.
const CDC_RUN_POINTS: &[CrashPoint] = &[
    CrashPoint::CdcAfterPublishBeforeConfirm,
    CrashPoint::ConsumerAfterDedupBeforeHandler,
    CrashPoint::ConsumerAfterDbCommitBeforeOffsetCommit,
    CrashPoint::EffectBeforeHttp,
    CrashPoint::EffectAfterHttpSuccessBeforeRecord,
];

/// Whether a due fault may run: not while the long lock is held; while it is only due
/// (`held`, not `lock_open`), only the run's first broker fault, which a short run under load
/// would otherwise never reach (the lock waits for the pipeline).
pub(super) fn may_run(held: bool, lock_open: bool, first_broker_due: bool) -> bool {
    !held || (!lock_open && first_broker_due)
}

/// Every crash point of `points`, shuffled by the seed (Fisher–Yates).
pub(super) fn first_round(rng: &mut Rng, points: &[CrashPoint]) -> Vec<CrashPoint> {
    let mut round: Vec<CrashPoint> = points.to_vec();
    for i in (1..round.len()).rev() {
        round.swap(i, rng.index(i + 1));
    }
    round
}

/// Whether no broker fault happened yet (the first is not left to the dice).
pub(super) fn first_broker_fault(faults: &BTreeMap<String, u64>) -> bool {
    !faults.keys().any(|k| is_broker_fault(k))
}

/// The signals every run sends at least once, in this order, before the dice choose among
/// them (as the first broker fault, they are not left to chance: a short run whose dice never
/// rolled a pause would not have tested one).
const EVERY_RUN_SIGNALS: [FaultKind; 3] = [
    FaultKind::Sigkill,
    FaultKind::Sigstop,
    FaultKind::SigtermRestart,
];

/// `kind`, unless it is a signal (or a restart) while one of [`EVERY_RUN_SIGNALS`] never
/// happened: then the first that never did.
pub(super) fn first_of_each_signal(kind: FaultKind, faults: &BTreeMap<String, u64>) -> FaultKind {
    if !EVERY_RUN_SIGNALS.contains(&kind) {
        return kind;
    }
    EVERY_RUN_SIGNALS
        .into_iter()
        .find(|k| faults.get(k.name()).copied().unwrap_or(0) == 0)
        .unwrap_or(kind)
}

/// The kind of a fault from the dice (`roll` below 100) and the run's state: the first broker
/// fault as soon as one is due, crash points every other tick while some never fired, then a mix.
pub(super) fn choose_kind(
    roll: u64,
    tick: u64,
    all_fired: bool,
    broker_due: bool,
    no_broker_fault_yet: bool,
) -> FaultKind {
    if broker_due && no_broker_fault_yet {
        FaultKind::Broker
    } else if (!all_fired && tick % 2 == 1) || roll < 30 {
        FaultKind::CrashPoint
    } else if roll < 60 {
        FaultKind::Sigkill
    } else if roll < 80 {
        FaultKind::Sigstop
    } else if roll < 90 && broker_due {
        FaultKind::Broker
    } else {
        FaultKind::SigtermRestart
    }
}

/// The crash point to arm. Draws exactly as the schedule always has: the focus coin only while
/// some point never fired, and the fallback point whenever the focus is not taken.
pub(super) fn choose_point(
    focus: Option<CrashPoint>,
    unfired: &[CrashPoint],
    faults: &BTreeMap<String, u64>,
    points: &[CrashPoint],
    rng: &mut Rng,
) -> CrashPoint {
    match focus {
        Some(f) if unfired.is_empty() || rng.below(2) == 0 => f,
        _ => {
            let fallback = points[rng.index(points.len())];
            unfired
                .iter()
                .copied()
                .min_by_key(|p| armed_count(faults, *p))
                .unwrap_or(fallback)
        }
    }
}

/// How often `point` was armed so far.
fn armed_count(faults: &BTreeMap<String, u64>, point: CrashPoint) -> u64 {
    faults.get(&armed_key(point)).copied().unwrap_or(0)
}

/// The `faults` key counting how often `point` was armed.
pub(super) fn armed_key(point: CrashPoint) -> String {
    format!("crash_point_armed:{point}")
}

/// Plans a broker fault. `partition` is the partition in use drawn from `partitions` (three
/// nodes only); `all_up`: every node runs unpaused (one fault at a time).
pub(super) fn broker(
    nodes: usize,
    partitions: Option<&[PartitionInfo]>,
    all_up: bool,
    first: bool,
    rng: &mut Rng,
) -> Plan {
    let partition = partitions.and_then(|parts| parts.get(rng.index(parts.len().max(1))));
    let Some(fault) = kafka::choose(nodes, rng.next(), first, partition).filter(|_| all_up) else {
        return Plan::Retry {
            after: Some(Duration::from_millis(500)),
        };
    };
    let down = match fault {
        BrokerFault::Kill(_) | BrokerFault::LeaderKill(_) => {
            rng.between(Duration::from_secs(1), Duration::from_secs(4))
        }
        BrokerFault::FollowerPause(_) | BrokerFault::Pause(_) => {
            rng.between(Duration::from_secs(1), Duration::from_secs(3))
        }
    };
    Plan::Broker { fault, down }
}

/// Plans a signal fault (`kind`: sigkill, sigstop or a graceful restart) at any process but the
/// brokers; a dead, paused or armed one is spared (retry shortly).
pub(super) fn signal(kind: FaultKind, slots: &[Slot], rng: &mut Rng) -> Plan {
    let others: Vec<usize> = (0..slots.len())
        .filter(|i| slots[*i].role != Role::Broker)
        .collect();
    let proc = others[rng.index(others.len())];
    let s = slots[proc];
    if !s.running || s.paused || s.armed {
        return Plan::Retry {
            after: Some(Duration::from_millis(100)),
        };
    }
    match kind {
        FaultKind::Sigkill => Plan::Kill {
            proc,
            down: rng.between(Duration::from_millis(200), Duration::from_millis(1500)),
        },
        FaultKind::Sigstop => Plan::Pause {
            proc,
            down: rng.between(Duration::from_secs(1), Duration::from_secs(4)),
        },
        _ => Plan::Restart { proc },
    }
}

/// What supervision does with a process that is not running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Revival {
    /// Its restart is due: start it.
    Start,
    /// Its restart is planned for later.
    Wait,
    /// It died by itself (an armed crash point): restart it after this long, without the point.
    Plan(Duration),
}

/// The revival of a process that is not running, whose restart was planned for `restart_at`.
pub(super) fn revival(restart_at: Option<Instant>, now: Instant, rng: &mut Rng) -> Revival {
    match restart_at {
        Some(t) if now >= t => Revival::Start,
        Some(_) => Revival::Wait,
        None => Revival::Plan(rng.between(Duration::from_millis(200), Duration::from_millis(800))),
    }
}

/// When the next round of hostile rows comes: in 20 to 40 s.
pub(super) fn hostile_interval(rng: &mut Rng) -> Duration {
    rng.between(Duration::from_secs(20), Duration::from_secs(40))
}

/// When the outbox's pending rows are locked next: in 20 to 40 s.
pub(super) fn lock_interval(rng: &mut Rng) -> Duration {
    rng.between(Duration::from_secs(20), Duration::from_secs(40))
}

/// How long a lock of the outbox's pending rows is held before its waiters are terminated.
pub(super) fn lock_hold(rng: &mut Rng) -> Duration {
    rng.between(Duration::from_secs(1), Duration::from_secs(4))
}

/// The role of the processes that reach `point`.
pub(super) fn role_of_point(point: CrashPoint) -> Role {
    match point {
        CrashPoint::RelayAfterClaimBeforePublish
        | CrashPoint::RelayAfterPublishBeforeMark
        | CrashPoint::CdcAfterPublishBeforeConfirm => Role::Relay,
        CrashPoint::ConsumerAfterDedupBeforeHandler
        | CrashPoint::ConsumerAfterDbCommitBeforeOffsetCommit => Role::Settlement,
        CrashPoint::EffectBeforeHttp | CrashPoint::EffectAfterHttpSuccessBeforeRecord => {
            Role::Dispatcher
        }
    }
}

/// The crash point whose window a broken mechanism turns into a violation.
pub(super) fn window_of(mechanism: Mechanism) -> Option<CrashPoint> {
    match mechanism {
        Mechanism::MarkBeforeReport => Some(CrashPoint::RelayAfterClaimBeforePublish),
        Mechanism::OffsetBeforeCommit => Some(CrashPoint::ConsumerAfterDedupBeforeHandler),
        Mechanism::SelectThenInsert | Mechanism::KafkaTransactions => {
            Some(CrashPoint::ConsumerAfterDbCommitBeforeOffsetCommit)
        }
        Mechanism::NewKeyPerRetry => Some(CrashPoint::EffectAfterHttpSuccessBeforeRecord),
        Mechanism::InboxIgnoresGroup
        | Mechanism::IdWatermark
        | Mechanism::NeverPark
        | Mechanism::KeyLockRenewal
        | Mechanism::TransientDeadLetters
        | Mechanism::SkipSendingMark => None,
    }
}

/// Whether a `faults` key counts a broker fault.
pub(super) fn is_broker_fault(kind: &str) -> bool {
    matches!(
        kind,
        "broker_kill" | "broker_pause" | "leader_kill" | "follower_pause"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(role: Role) -> Slot {
        Slot {
            role,
            running: true,
            paused: false,
            armed: false,
        }
    }

    fn slots() -> Vec<Slot> {
        [
            Role::Broker,
            Role::Api,
            Role::Writer,
            Role::Relay,
            Role::Relay,
            Role::Settlement,
            Role::Settlement,
            Role::Audit,
            Role::Dispatcher,
        ]
        .into_iter()
        .map(slot)
        .collect()
    }

    /// Plans `n` faults against processes that stay up, as the runner would.
    fn plans(seed: u64, mechanism: Option<Mechanism>, n: usize) -> Vec<(FaultKind, Plan)> {
        let mut rng = Rng::new(seed);
        let started = Instant::now();
        let mut s = Schedule::new(started, mechanism, &mut rng);
        let (mut faults, fired) = (BTreeMap::new(), BTreeMap::new());
        let mut out = vec![];
        for i in 0..n {
            let now = started + Duration::from_secs(2 * i as u64);
            let unfired = s.unfired(&fired);
            let kind = s.kind(now, &unfired, &faults, &mut rng);
            let plan = match kind {
                FaultKind::CrashPoint => s.crash_point(&unfired, &faults, &slots(), &mut rng),
                FaultKind::Broker => broker(1, None, true, first_broker_fault(&faults), &mut rng),
                k => signal(k, &slots(), &mut rng),
            };
            if let Plan::Broker { fault, .. } = &plan {
                *faults.entry(fault.kind().to_owned()).or_default() += 1;
            }
            s.done(now, matches!(plan, Plan::Broker { .. }), &mut rng);
            out.push((kind, plan));
        }
        out
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        assert_eq!(plans(7, None, 200), plans(7, None, 200));
        assert_ne!(plans(7, None, 200), plans(8, None, 200));
        assert_eq!(
            first_round(&mut Rng::new(3), CrashPoint::POLLING_PIPELINE),
            first_round(&mut Rng::new(3), CrashPoint::POLLING_PIPELINE)
        );
    }

    #[test]
    fn the_first_round_is_every_crash_point_once() {
        let mut round = first_round(&mut Rng::new(11), CrashPoint::POLLING_PIPELINE);
        round.sort_unstable();
        let mut all = CrashPoint::POLLING_PIPELINE.to_vec();
        all.sort_unstable();
        assert_eq!(round, all);
    }

    #[test]
    fn every_signal_comes_once_before_the_dice_choose_among_them() {
        use FaultKind::*;
        let mut faults = BTreeMap::new();
        assert_eq!(first_of_each_signal(SigtermRestart, &faults), Sigkill);
        assert_eq!(first_of_each_signal(CrashPoint, &faults), CrashPoint);
        assert_eq!(first_of_each_signal(Broker, &faults), Broker);
        faults.insert("sigkill".to_owned(), 3);
        assert_eq!(first_of_each_signal(Sigkill, &faults), Sigstop);
        faults.insert("sigstop".to_owned(), 1);
        assert_eq!(first_of_each_signal(Sigkill, &faults), SigtermRestart);
        faults.insert("sigterm_restart".to_owned(), 1);
        for kind in EVERY_RUN_SIGNALS {
            assert_eq!(first_of_each_signal(kind, &faults), kind, "the dice again");
        }
    }

    #[test]
    fn the_first_broker_fault_passes_a_long_lock_that_is_only_due() {
        // (held, lock open, first broker fault due) → may run
        let table = [
            ((false, false, false), true),
            ((false, false, true), true),
            // Due, not yet open: only the first broker fault goes.
            ((true, false, false), false),
            ((true, false, true), true),
            // Held: nothing goes.
            ((true, true, true), false),
            ((true, true, false), false),
        ];
        for ((held, open, first), runs) in table {
            assert_eq!(may_run(held, open, first), runs, "{held} {open} {first}");
        }
        for seed in 0..50 {
            let first = plans(seed, None, 10)
                .iter()
                .position(|(_, p)| matches!(p, Plan::Broker { .. }));
            // `plans` ticks every 2 s: the first tick past 15 s is the ninth.
            assert_eq!(first, Some(8), "seed {seed}");
        }
    }

    #[test]
    fn the_first_broker_fault_comes_when_due_whatever_the_dice() {
        use FaultKind::*;
        // (roll, tick, all fired, broker due, no broker fault yet) → kind
        let table = [
            ((0, 1, false, true, true), Broker),
            // Not yet due: the dice (and the unfired crash points) decide.
            ((0, 1, false, false, true), CrashPoint),
            ((45, 2, false, false, true), Sigkill),
            ((70, 2, true, false, true), Sigstop),
            ((85, 2, true, true, false), Broker),
            ((85, 2, true, false, false), SigtermRestart),
            ((95, 2, true, true, false), SigtermRestart),
            // Crash points every other tick while some never fired.
            ((95, 3, false, false, false), CrashPoint),
            ((95, 3, true, false, false), SigtermRestart),
        ];
        for ((roll, tick, all_fired, due, first), kind) in table {
            assert_eq!(
                choose_kind(roll, tick, all_fired, due, first),
                kind,
                "roll {roll} tick {tick}"
            );
        }
    }

    #[test]
    fn a_crash_point_goes_to_a_process_that_reaches_it_and_has_none_armed() {
        let mut rng = Rng::new(5);
        let s = Schedule::new(Instant::now(), None, &mut rng);
        let faults = BTreeMap::new();
        let mut all = slots();
        for _ in 0..50 {
            let unfired = s.unfired(&BTreeMap::new());
            let Plan::Arm { proc, point, hit } = s.crash_point(&unfired, &faults, &all, &mut rng)
            else {
                panic!("a process of every role is free");
            };
            assert_eq!(all[proc].role, role_of_point(point));
            assert!((1..=3).contains(&hit));
        }
        for s in &mut all {
            s.armed = true;
        }
        let unfired = s.unfired(&BTreeMap::new());
        assert_eq!(
            s.crash_point(&unfired, &faults, &all, &mut rng),
            Plan::Retry { after: None }
        );
    }

    #[test]
    fn a_negative_control_aims_at_its_window_once_every_point_fired() {
        let mechanism = Mechanism::MarkBeforeReport;
        let mut rng = Rng::new(9);
        let s = Schedule::new(Instant::now(), Some(mechanism), &mut rng);
        for _ in 0..20 {
            let plan = s.crash_point(&[], &BTreeMap::new(), &slots(), &mut rng);
            let Plan::Arm { point, .. } = plan else {
                panic!("{plan:?}");
            };
            assert_eq!(Some(point), window_of(mechanism));
        }
    }

    #[test]
    fn the_least_armed_unfired_point_comes_first() {
        let mut rng = Rng::new(1);
        let unfired = [
            CrashPoint::POLLING_PIPELINE[0],
            CrashPoint::POLLING_PIPELINE[1],
        ];
        let faults = [(armed_key(CrashPoint::POLLING_PIPELINE[0]), 2)]
            .into_iter()
            .collect();
        assert_eq!(
            choose_point(
                None,
                &unfired,
                &faults,
                CrashPoint::POLLING_PIPELINE,
                &mut rng
            ),
            CrashPoint::POLLING_PIPELINE[1]
        );
    }

    #[test]
    fn a_busy_process_is_spared_and_brokers_are_never_signalled() {
        let mut rng = Rng::new(2);
        let mut all = slots();
        for _ in 0..100 {
            match signal(FaultKind::Sigkill, &all, &mut rng) {
                Plan::Kill { proc, down } => {
                    assert_ne!(all[proc].role, Role::Broker);
                    assert!(down >= Duration::from_millis(200));
                }
                p => panic!("{p:?}"),
            }
        }
        for s in &mut all {
            s.paused = true;
        }
        assert_eq!(
            signal(FaultKind::Sigstop, &all, &mut rng),
            Plan::Retry {
                after: Some(Duration::from_millis(100))
            }
        );
    }

    #[test]
    fn a_broker_fault_waits_while_a_node_is_down() {
        let mut rng = Rng::new(4);
        assert_eq!(
            broker(1, None, false, true, &mut rng),
            Plan::Retry {
                after: Some(Duration::from_millis(500))
            }
        );
        let Plan::Broker { fault, .. } = broker(1, None, true, true, &mut rng) else {
            panic!("one node up");
        };
        assert_eq!(fault, BrokerFault::Kill(1));
    }

    #[test]
    fn a_process_that_died_by_itself_is_restarted_shortly_and_a_planned_restart_waits() {
        let mut rng = Rng::new(6);
        let now = Instant::now();
        let Revival::Plan(after) = revival(None, now, &mut rng) else {
            panic!("no restart was planned");
        };
        assert!((Duration::from_millis(200)..=Duration::from_millis(800)).contains(&after));
        assert_eq!(revival(Some(now), now, &mut rng), Revival::Start);
        let later = now + Duration::from_secs(1);
        assert_eq!(revival(Some(later), now, &mut rng), Revival::Wait);
        let next = hostile_interval(&mut rng);
        assert!((Duration::from_secs(20)..=Duration::from_secs(40)).contains(&next));
    }

    #[test]
    fn every_crash_point_has_a_process_that_reaches_it() {
        for p in CrashPoint::ALL {
            let role = role_of_point(*p);
            assert!(matches!(
                role,
                Role::Relay | Role::Settlement | Role::Dispatcher
            ));
        }
    }
}
