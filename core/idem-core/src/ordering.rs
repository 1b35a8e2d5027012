//! Strict per-aggregate order on the consumer side, without losing an event.
//!
//! On PostgreSQL the relay stamps each record with `idem_aggregate_seq`, the event's position in
//! its aggregate's commit order: 1, 2, 3, … with no gap (a rolled-back or conflicting insert
//! takes no number). Records of one aggregate usually arrive in that order, but not always: when
//! the broker acknowledged event 2 while event 1 failed *after* it was sent, the relay publishes
//! 1 and then 2 again, so a consumer sees `2, 1, 2`; and a parked row reaches Kafka after the
//! later events of its aggregate once `idem outbox retry` returns it.
//!
//! "Skip copies older than what you applied" loses event 1 in `2, 1, 2`. [`InOrder`] applies an
//! event only when it is the next one (`seq == last + 1`), skips copies of applied events
//! (`seq <= last`) and **holds** an event that arrives ahead of a gap until the gap fills. It is
//! a pure decision: the caller keeps `last` and the held events in its own database, written in
//! the transaction that applies (or holds) the event, so that a restart resumes where it
//! stopped. Holding is required, not an optimisation: dropping the early copy is safe only when
//! the relay will publish it again (`2, 1, 2`), and not after a park, where the later rows were
//! marked published and never come again. Events held for long mean the missing one is
//! parked (`idem outbox parked`): watch the held count per aggregate and bound it, since a
//! hostile or broken producer can send numbers far ahead.
//!
//! `idem prune --outbox-counters` restarts an idle aggregate's numbers at 1 (its counter row is
//! deleted): an `InOrder` kept for that aggregate would skip its new events as copies. Do not
//! prune the counters of aggregates whose `InOrder` state you keep (docs/operating/retention.md).
//!
//! SQLite outboxes stamp the row id instead, which increases within an aggregate but skips
//! numbers: there a gap cannot be told apart, so rely on the inbox for duplicates and make
//! handlers tolerate reordering (compare a version kept in the business row).

use std::collections::BTreeMap;

/// What [`InOrder::decide`] says about one delivered copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sequenced {
    /// The next event of the aggregate: apply it.
    Next,
    /// A copy of an event already applied: skip it.
    AlreadyApplied,
    /// Earlier events (from `last + 1` to `seq - 1`) have not been applied: hold it.
    AheadOfGap {
        /// The first sequence number still missing.
        missing: i64,
    },
}

/// One aggregate's position: the last event applied and the events held ahead of a gap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InOrder<T> {
    last: i64,
    held: BTreeMap<i64, T>,
}

impl<T> Default for InOrder<T> {
    fn default() -> Self {
        InOrder::new(0)
    }
}

impl<T> InOrder<T> {
    /// An aggregate whose events up to `last_applied` are applied (0: none yet).
    pub fn new(last_applied: i64) -> Self {
        InOrder {
            last: last_applied,
            held: BTreeMap::new(),
        }
    }

    /// Restores a held event (read back from the caller's database).
    pub fn restore_held(&mut self, seq: i64, event: T) {
        if seq > self.last {
            self.held.insert(seq, event);
        }
    }

    /// The last sequence number applied.
    pub fn last_applied(&self) -> i64 {
        self.last
    }

    /// The events held ahead of a gap, in sequence order (to store with `last_applied`).
    pub fn held(&self) -> impl Iterator<Item = (i64, &T)> {
        self.held.iter().map(|(s, e)| (*s, e))
    }

    /// The decision for a copy numbered `seq`, without changing anything.
    pub fn decide(&self, seq: i64) -> Sequenced {
        if seq <= self.last {
            Sequenced::AlreadyApplied
        } else if seq == self.last.saturating_add(1) {
            Sequenced::Next
        } else {
            Sequenced::AheadOfGap {
                missing: self.last.saturating_add(1),
            }
        }
    }

    /// Takes a delivered copy and returns the events to apply now, in order: none (a copy of
    /// an applied or already held event, or an event held ahead of a gap), or this one followed
    /// by every held event it made contiguous.
    pub fn offer(&mut self, seq: i64, event: T) -> Vec<(i64, T)> {
        match self.decide(seq) {
            Sequenced::AlreadyApplied => Vec::new(),
            Sequenced::AheadOfGap { .. } => {
                self.held.entry(seq).or_insert(event);
                Vec::new()
            }
            Sequenced::Next => {
                let mut ready = vec![(seq, event)];
                self.last = seq;
                while let Some(following) = self.last.checked_add(1)
                    && let Some(next) = self.held.remove(&following)
                {
                    self.last = following;
                    ready.push((following, next));
                }
                ready
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `arrivals` (sequence numbers) and returns what was applied, in order.
    fn applied(arrivals: &[i64]) -> Vec<i64> {
        let mut agg = InOrder::default();
        let mut out = Vec::new();
        for &seq in arrivals {
            out.extend(agg.offer(seq, seq).into_iter().map(|(s, _)| s));
        }
        out
    }

    /// A tempting but wrong rule: apply a copy unless it is older than (or equal to) the last
    /// applied one.
    fn skip_older(arrivals: &[i64]) -> Vec<i64> {
        let mut last = 0;
        let mut out = Vec::new();
        for &seq in arrivals {
            if seq > last {
                out.push(seq);
                last = seq;
            }
        }
        out
    }

    #[test]
    fn the_2_1_2_sequence_applies_1_then_2_once_each() {
        assert_eq!(applied(&[2, 1, 2]), vec![1, 2]);
        // The old advice applied 2 first and then skipped 1 for ever.
        assert_eq!(skip_older(&[2, 1, 2]), vec![2]);
    }

    #[test]
    fn a_parked_head_retried_later_releases_the_events_held_behind_it() {
        // 1 is parked; 2 and 3 are published and marked (they never come again); 1 arrives
        // after `idem outbox retry`; then a stray duplicate of 3.
        assert_eq!(applied(&[2, 3, 1, 3]), vec![1, 2, 3]);
        assert_eq!(
            skip_older(&[2, 3, 1, 3]),
            vec![2, 3],
            "the old advice lost 1"
        );
    }

    #[test]
    fn decisions_and_held_state_survive_a_restart() {
        let mut agg = InOrder::new(4);
        assert_eq!(agg.decide(4), Sequenced::AlreadyApplied);
        assert_eq!(agg.decide(5), Sequenced::Next);
        assert_eq!(agg.decide(7), Sequenced::AheadOfGap { missing: 5 });
        assert!(agg.offer(7, "seven").is_empty());
        assert!(agg.offer(7, "seven again").is_empty(), "held once");
        let stored: Vec<(i64, &str)> = agg.held().map(|(s, e)| (s, *e)).collect();
        assert_eq!(stored, vec![(7, "seven")]);
        // A new process reads last = 4 and the held event back.
        let mut again = InOrder::new(agg.last_applied());
        again.restore_held(7, "seven");
        again.restore_held(3, "stale");
        assert_eq!(again.offer(6, "six"), Vec::new());
        assert_eq!(
            again.offer(5, "five"),
            vec![(5, "five"), (6, "six"), (7, "seven")]
        );
        assert_eq!(again.last_applied(), 7);
        assert_eq!(again.held().count(), 0);
    }

    #[test]
    fn hostile_numbers_neither_overflow_nor_apply_out_of_order() {
        let mut agg = InOrder::new(i64::MAX - 1);
        assert_eq!(agg.offer(i64::MAX, 'x'), vec![(i64::MAX, 'x')]);
        assert_eq!(agg.decide(i64::MAX), Sequenced::AlreadyApplied);
        let mut fresh = InOrder::default();
        assert!(
            fresh.offer(-3, 'n').is_empty(),
            "no event has a number below 1"
        );
        assert!(fresh.offer(i64::MAX, 'm').is_empty(), "held ahead of a gap");
    }
}
