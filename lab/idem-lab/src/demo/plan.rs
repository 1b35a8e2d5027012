//! The demo's decisions, apart from its I/O: which crash points to arm and on which hit, how
//! many orders to write next, when to republish and forge conflicts, and when the pipeline has
//! settled.

use std::time::Duration;

use idem_core::crash::CrashPoint;

/// What the demo was asked to inject.
#[derive(Clone, Copy, Debug)]
pub(super) struct Targets {
    /// Paid orders to write (at least).
    pub orders: u64,
    /// How many times each crash point must fire.
    pub crashes: u64,
    /// Published events to publish again.
    pub republish: u64,
    /// Conflicting copies to send.
    pub conflicts: u64,
}

/// What has been injected so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Tally {
    /// Orders written.
    pub written: u64,
    /// Published events made pending again.
    pub republished: u64,
    /// Conflicting copies sent.
    pub conflicts: u64,
}

impl Tally {
    /// Orders written, as the databases count them.
    pub(super) fn written_i64(&self) -> i64 {
        i64::try_from(self.written).unwrap_or(i64::MAX)
    }
}

/// What the databases show after a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Counts {
    /// Outbox rows not (or no longer) published.
    pub pending: i64,
    /// Settlement rows.
    pub settled: i64,
    /// Effect intents done (points awarded).
    pub done: i64,
    /// Dead letters.
    pub dead: i64,
}

/// Most orders written in one step.
const ORDER_BATCH: u64 = 200;
/// Orders written in one step once the requested ones are, while crash points still wait.
const EXTRA_ORDERS: u64 = 20;
/// Most rows made pending again in one step.
const REPUBLISH_BATCH: u64 = 20;

/// The generator that picks the hit on which an armed crash point fires: one run's crashes
/// are the same from run to run.
#[derive(Clone, Copy, Debug)]
pub(super) struct Seed(u64);

impl Default for Seed {
    fn default() -> Self {
        Seed(0x9e37_79b9_7f4a_7c15)
    }
}

impl Seed {
    /// The next hit to fire on: 1 to 4.
    pub(super) fn next_fire_on(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        1 + (self.0 >> 60) % 4
    }
}

/// One crash point as the demo sees it: its name, how often it fired, whether it is armed.
pub(super) type PointState = (CrashPoint, u64, bool);

/// The crash points to arm (error mode) and the hit each fires on: each one that has fired
/// fewer than `target` times and is not armed.
pub(super) fn crash_arming(
    points: &[PointState],
    target: u64,
    seed: &mut Seed,
) -> Vec<(CrashPoint, u64)> {
    points
        .iter()
        .filter(|(_, fired, armed)| *fired < target && !armed)
        .map(|(p, _, _)| (*p, seed.next_fire_on()))
        .collect()
}

/// Whether every crash point in `fired` has fired `target` times.
pub(super) fn faults_done(fired: &[(CrashPoint, u64)], target: u64) -> bool {
    fired.iter().all(|(_, n)| *n >= target)
}

/// Orders to write in this step: the requested number (200 at a time), then a few more while
/// crash points still wait for work to pass through them (only when everything else is idle:
/// nothing unpublished and every written order's effect done).
pub(super) fn order_batch(
    t: &Targets,
    tally: &Tally,
    faults_done: bool,
    pending: i64,
    idle: bool,
) -> u64 {
    if tally.written < t.orders {
        (t.orders - tally.written).min(ORDER_BATCH)
    } else if !faults_done && pending == 0 && idle {
        EXTRA_ORDERS
    } else {
        0
    }
}

/// Published rows to make pending again in this step, once a quarter of the orders are
/// written.
pub(super) fn republish_batch(t: &Targets, tally: &Tally) -> Option<u64> {
    (tally.republished < t.republish && tally.written >= t.orders / 4)
        .then(|| (t.republish - tally.republished).min(REPUBLISH_BATCH))
}

/// Whether to forge a conflict in this step, once half the orders are written.
pub(super) fn conflict_due(t: &Targets, tally: &Tally) -> bool {
    tally.conflicts < t.conflicts && tally.written >= t.orders / 2
}

/// Whether the pipeline has settled: everything injected, nothing unpublished, every order
/// settled and awarded, and a dead letter for each conflict.
pub(super) fn settled(t: &Targets, tally: &Tally, faults_done: bool, c: &Counts) -> bool {
    let w = tally.written_i64();
    tally.written >= t.orders
        && faults_done
        && tally.republished >= t.republish
        && tally.conflicts >= t.conflicts
        && c.pending == 0
        && c.settled == w
        && c.done == w
        && u64::try_from(c.dead).unwrap_or(0) >= tally.conflicts
}

/// The pause before the next step: none after writing orders.
pub(super) fn pause(batch: u64) -> Duration {
    Duration::from_millis(if batch > 0 { 0 } else { 100 })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: CrashPoint = CrashPoint::RelayAfterClaimBeforePublish;
    const B: CrashPoint = CrashPoint::RelayAfterPublishBeforeMark;
    const C: CrashPoint = CrashPoint::ConsumerAfterDedupBeforeHandler;
    const D: CrashPoint = CrashPoint::EffectBeforeHttp;

    const T: Targets = Targets {
        orders: 1000,
        crashes: 3,
        republish: 200,
        conflicts: 3,
    };

    #[test]
    fn the_seed_picks_the_same_hits_from_run_to_run_within_one_to_four() {
        let (mut a, mut b) = (Seed::default(), Seed::default());
        let hits: Vec<u64> = (0..64).map(|_| a.next_fire_on()).collect();
        assert_eq!(hits, (0..64).map(|_| b.next_fire_on()).collect::<Vec<_>>());
        assert!(hits.iter().all(|h| (1..=4).contains(h)));
        assert!((1..=4).all(|h| hits.contains(&h)), "{hits:?}");
    }

    #[test]
    fn only_points_short_of_the_target_and_unarmed_are_armed() {
        let [a, b, c, d] = [A, B, C, D];
        let points = [(a, 0, false), (b, 3, false), (c, 1, true), (d, 2, false)];
        let mut seed = Seed::default();
        let armed = crash_arming(&points, 3, &mut seed);
        let mut again = Seed::default();
        assert_eq!(
            armed,
            vec![(a, again.next_fire_on()), (d, again.next_fire_on())]
        );
    }

    #[test]
    fn faults_are_done_when_every_point_reached_the_target() {
        assert!(faults_done(&[(A, 3), (B, 4)], 3));
        assert!(!faults_done(&[(A, 3), (B, 2)], 3));
    }

    #[test]
    fn orders_come_in_batches_then_a_few_more_only_when_idle_and_faults_wait() {
        let tally = |written| Tally {
            written,
            ..Tally::default()
        };
        assert_eq!(order_batch(&T, &tally(0), false, 5, false), 200);
        assert_eq!(order_batch(&T, &tally(950), true, 5, false), 50);
        assert_eq!(order_batch(&T, &tally(1000), false, 0, true), 20);
        assert_eq!(order_batch(&T, &tally(1000), false, 1, true), 0);
        assert_eq!(order_batch(&T, &tally(1000), false, 0, false), 0);
        assert_eq!(order_batch(&T, &tally(1000), true, 0, true), 0);
    }

    #[test]
    fn republishes_start_at_a_quarter_and_conflicts_at_half_of_the_orders() {
        let mut tally = Tally {
            written: 249,
            ..Tally::default()
        };
        assert_eq!(republish_batch(&T, &tally), None);
        tally.written = 250;
        assert_eq!(republish_batch(&T, &tally), Some(20));
        tally.republished = 195;
        assert_eq!(republish_batch(&T, &tally), Some(5));
        tally.republished = 200;
        assert_eq!(republish_batch(&T, &tally), None);
        assert!(!conflict_due(&T, &tally));
        tally.written = 500;
        assert!(conflict_due(&T, &tally));
        tally.conflicts = 3;
        assert!(!conflict_due(&T, &tally));
    }

    #[test]
    fn settled_needs_everything_injected_and_every_order_through() {
        let tally = Tally {
            written: 1000,
            republished: 200,
            conflicts: 3,
        };
        let c = Counts {
            pending: 0,
            settled: 1000,
            done: 1000,
            dead: 3,
        };
        assert!(settled(&T, &tally, true, &c));
        assert!(!settled(&T, &tally, false, &c));
        assert!(!settled(&T, &tally, true, &Counts { pending: 1, ..c }));
        assert!(!settled(&T, &tally, true, &Counts { done: 999, ..c }));
        assert!(!settled(&T, &tally, true, &Counts { dead: 2, ..c }));
        let short = Tally {
            republished: 180,
            ..tally
        };
        assert!(!settled(&T, &short, true, &c));
    }

    #[test]
    fn the_loop_pauses_only_when_it_wrote_nothing() {
        assert_eq!(pause(20), Duration::ZERO);
        assert_eq!(pause(0), Duration::from_millis(100));
    }
}
