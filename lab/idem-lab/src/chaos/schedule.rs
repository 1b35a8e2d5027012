//! The seeded decisions of a chaos run's schedule, as pure functions: which crash point to
//! arm, which broker fault comes, when a dead process comes back. The runner
//! (`pipeline/drive.rs`) observes the processes, asks here, and carries the plan out; given the
//! same seed and the same observations, the same plans come out in the same order.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use idem_core::crash::{CrashPoint, Mechanism};
use idem_kafka::admin::PartitionInfo;

use super::kafka::{self, BrokerFault};
use super::procs::Rng;

/// One planned fault, drawn from the seed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Plan {
    /// Kill or pause the Kafka node of `fault` for `down`.
    Broker {
        /// The fault, naming the node.
        fault: BrokerFault,
        /// How long until the node is restarted (a kill) or resumed (a pause).
        down: Duration,
    },
    /// Nothing to do now: try again after `after` (`None`: at once, without waiting).
    Retry {
        /// When to try again.
        after: Option<Duration>,
    },
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

    #[test]
    fn the_first_round_is_every_crash_point_once() {
        let mut round = first_round(&mut Rng::new(11), CrashPoint::POLLING_PIPELINE);
        round.sort_unstable();
        let mut all = CrashPoint::POLLING_PIPELINE.to_vec();
        all.sort_unstable();
        assert_eq!(round, all);
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
}
