//! The pure decisions of [`Dispatcher::run`](crate::Dispatcher::run)'s pipeline: when to claim
//! and how many, and when the buffered outcomes are written.
//!
//! `run` claims whenever enough of its `concurrency` slots are free (no barrier per claim: one
//! slow request holds one slot, not the next claim), and records the outcomes of finished
//! attempts in batches: one write when `outcome_batch` of them are waiting, or `outcome_delay`
//! after the first one, and whatever is left on shutdown. A kill loses at most the buffered
//! outcomes; their intents are claimed again after the lease and sent with the same key.
//!
//! A claim or a write the database fails does not stop `run`: the claim is tried again, and the
//! outcomes are kept and written again, after a wait from [`STORE_BACKOFF_MIN`] doubling per
//! failure in a row up to [`STORE_BACKOFF_MAX`] ([`store_backoff`]).

use std::time::{Duration, Instant};

use idem_core::idempotency::FinishedAttempt;

/// How many intents to claim with `in_flight` requests running: `None` while fewer than half
/// of the `concurrency` slots are free (claim in groups, not one slot at a time), at most the
/// free slots and at most `batch`.
pub fn claim_size(in_flight: usize, concurrency: usize, batch: u32) -> Option<u32> {
    let concurrency = concurrency.max(1);
    let free = concurrency.saturating_sub(in_flight);
    let worth = concurrency.div_ceil(2);
    if free == 0 || (in_flight > 0 && free < worth) {
        return None;
    }
    Some(u32::try_from(free).unwrap_or(u32::MAX).min(batch.max(1)))
}

/// Whether a claim may start with `buffered` outcomes not yet written: not while a full batch
/// waits (the write in progress is slow), so that a stalled database does not let unrecorded
/// outcomes pile up while their leases run out.
pub fn may_claim(buffered: usize, outcome_batch: usize) -> bool {
    buffered < outcome_batch.max(1)
}

/// The wait after the first failed claim or write of an outage.
pub const STORE_BACKOFF_MIN: Duration = Duration::from_millis(200);

/// The longest wait between failed claims or writes: an outage's end is noticed this soon.
pub const STORE_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// The wait after a failed claim or write, `previous` being the wait after the failure before
/// it in a row (`None`: the store's last operation succeeded).
pub fn store_backoff(previous: Option<Duration>) -> Duration {
    previous.map_or(STORE_BACKOFF_MIN, |d| {
        idem_core::backoff::Backoff::new(STORE_BACKOFF_MIN, STORE_BACKOFF_MAX).next(d)
    })
}

/// A finished attempt waiting to be recorded, with the labels its metrics use (effect, host).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Buffered {
    /// What is written.
    pub(crate) finished: FinishedAttempt,
    /// The effect name and the target host.
    pub(crate) labels: [String; 2],
}

/// The outcomes not yet written, and since when the oldest one waits.
#[derive(Debug, Default)]
pub(crate) struct OutcomeBuffer {
    entries: Vec<Buffered>,
    since: Option<Instant>,
}

impl OutcomeBuffer {
    /// Adds an outcome that finished at `now`.
    pub(crate) fn push(&mut self, entry: Buffered, now: Instant) {
        self.since.get_or_insert(now);
        self.entries.push(entry);
    }

    /// How many outcomes wait.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// When the buffer must be written: at once when `max` outcomes wait, `delay` after the
    /// oldest otherwise; `None` when empty.
    pub(crate) fn deadline(&self, max: usize, delay: Duration) -> Option<Instant> {
        let since = self.since?;
        if self.entries.len() >= max.max(1) {
            return Some(since);
        }
        Some(since + delay)
    }

    /// Takes every waiting outcome.
    pub(crate) fn take(&mut self) -> Vec<Buffered> {
        self.since = None;
        std::mem::take(&mut self.entries)
    }

    /// Puts back, first, the outcomes of a write that failed at `now`, to be written again.
    pub(crate) fn restore(&mut self, mut kept: Vec<Buffered>, now: Instant) {
        if kept.is_empty() {
            return;
        }
        kept.append(&mut self.entries);
        self.entries = kept;
        self.since = Some(self.since.map_or(now, |s| s.min(now)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::idempotency::IntentOutcome;

    fn entry(id: i64) -> Buffered {
        Buffered {
            finished: FinishedAttempt {
                id,
                attempt: 1,
                outcome: IntentOutcome::Park { reason: "x".into() },
            },
            labels: ["points.award".into(), "h:1".into()],
        }
    }

    #[test]
    fn claims_wait_for_half_the_slots_and_never_exceed_the_free_ones_or_the_batch() {
        assert_eq!(claim_size(0, 8, 50), Some(8));
        assert_eq!(claim_size(0, 8, 3), Some(3));
        assert_eq!(
            claim_size(1, 8, 50),
            Some(7),
            "one slow request holds one slot"
        );
        assert_eq!(claim_size(4, 8, 50), Some(4));
        assert_eq!(claim_size(5, 8, 50), None, "3 free of 8: wait for more");
        assert_eq!(claim_size(8, 8, 50), None);
        assert_eq!(claim_size(9, 8, 50), None);
        assert_eq!(claim_size(0, 1, 50), Some(1));
        assert_eq!(claim_size(0, 0, 50), Some(1), "concurrency 0 means 1");
        assert_eq!(claim_size(0, 8, 0), Some(1), "batch 0 means 1");
        assert_eq!(claim_size(1, 3, 50), Some(2));
    }

    #[test]
    fn claims_stop_while_a_full_batch_of_outcomes_waits() {
        assert!(may_claim(0, 64));
        assert!(may_claim(63, 64));
        assert!(!may_claim(64, 64), "the write in progress is slow");
        assert!(may_claim(0, 0));
        assert!(!may_claim(1, 0));
    }

    #[test]
    fn a_failing_store_is_tried_again_after_a_wait_that_doubles_up_to_a_bound() {
        assert_eq!(store_backoff(None), STORE_BACKOFF_MIN);
        assert_eq!(
            store_backoff(Some(STORE_BACKOFF_MIN)),
            STORE_BACKOFF_MIN * 2
        );
        let mut wait = None;
        for _ in 0..20 {
            wait = Some(store_backoff(wait));
        }
        assert_eq!(wait, Some(STORE_BACKOFF_MAX));
        assert_eq!(store_backoff(Some(Duration::ZERO)), STORE_BACKOFF_MIN);
    }

    #[test]
    fn the_outcomes_of_a_failed_write_are_written_again_first() {
        let t0 = Instant::now();
        let mut b = OutcomeBuffer::default();
        b.push(entry(1), t0);
        b.push(entry(2), t0);
        let taken = b.take();
        b.push(entry(3), t0 + Duration::from_millis(3));
        b.restore(taken, t0 + Duration::from_millis(5));
        assert_eq!(b.len(), 3);
        assert_eq!(
            b.deadline(10, Duration::from_millis(5)),
            Some(t0 + Duration::from_millis(8)),
            "from the oldest waiting"
        );
        let ids: Vec<i64> = b.take().iter().map(|e| e.finished.id).collect();
        assert_eq!(ids, [1, 2, 3]);
        b.restore(vec![], t0);
        assert!(b.is_empty());
        assert_eq!(b.deadline(10, Duration::ZERO), None);
    }

    #[test]
    fn the_buffer_is_due_when_full_or_after_the_delay_of_its_oldest_outcome() {
        let t0 = Instant::now();
        let delay = Duration::from_millis(5);
        let mut b = OutcomeBuffer::default();
        assert_eq!(b.deadline(3, delay), None);
        b.push(entry(1), t0);
        b.push(entry(2), t0 + Duration::from_millis(4));
        assert_eq!(b.len(), 2);
        assert_eq!(b.deadline(3, delay), Some(t0 + delay), "from the oldest");
        b.push(entry(3), t0 + Duration::from_millis(4));
        assert_eq!(b.deadline(3, delay), Some(t0), "full: at once");
        assert_eq!(b.take().len(), 3);
        assert!(b.is_empty());
        assert_eq!(b.deadline(3, delay), None);
        let later = t0 + Duration::from_secs(1);
        b.push(entry(4), later);
        assert_eq!(b.deadline(0, delay), Some(later), "max 0 means 1");
    }
}
