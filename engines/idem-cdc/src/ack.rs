//! Which log position the CDC relay may confirm to PostgreSQL.
//!
//! Confirming a position tells the server the relay never needs anything before it again: after
//! a restart, the slot resumes there and skips every transaction whose commit record starts
//! before it. So the relay confirms a transaction's Commit `end_lsn` (never its `commit_lsn`:
//! the server would send that transaction again) and only once Kafka acknowledged every event of
//! it **and of every transaction before it** (confirming past an unacknowledged one loses it).
//!
//! [`AckTracker`] is that rule as a FIFO. Transactions enter in stream order, which is commit
//! order ([`AckTracker::begin`], then [`AckTracker::commit`] with their `end_lsn` and the number
//! of messages the relay published for them); delivery reports arrive per message in any order
//! ([`AckTracker::delivered`]); [`AckTracker::confirmable`] is the `end_lsn` of the longest
//! prefix of fully acknowledged transactions. Several batches may be in flight at once. A
//! transaction with no message of the relay's (every row refused and parked, or none of ours)
//! is confirmable as soon as everything before it is.
//!
//! A row or message the relay refuses instead of publishing (parked, dead-lettered) is done
//! only once that is durable: confirming first and crashing before the park commits loses it,
//! since the slot never sends it again. So either make the refusal durable before
//! [`AckTracker::commit`] and leave it out of the count, or count it and report it with
//! [`AckTracker::delivered`] when the refusal is durable.
//! A message whose delivery failed is not reported: its transaction holds the position back
//! until the relay publishes it again or restarts from the slot (which sends it again).
//!
//! The idle rule: with no transaction open or in flight, a keepalive's `wal_end` may be
//! confirmed ([`AckTracker::keepalive`]), so that an idle slot does not hold WAL that other
//! tables or databases write. While a transaction is open (Begin seen, Commit not yet) or
//! waits for reports, a keepalive changes nothing.
//!
//! **Invariant**: [`AckTracker::confirmable`] never returns a position at or past the
//! `end_lsn` of a transaction with an unacknowledged message, and never decreases.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

/// A transaction handed to [`AckTracker::commit`]; pass it with each delivery report.
///
/// It names its tracker too: after a reconnection the relay starts a new tracker while the
/// producer may still report messages of the old session, and such a late report must not
/// count for the new session's transaction of the same number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TxnId {
    tracker: u64,
    seq: u64,
}

/// Tells the trackers of one process apart.
static TRACKERS: AtomicU64 = AtomicU64::new(0);

/// A wrong use of the tracker: each one means the relay's bookkeeping is broken, and
/// confirming anything after it could lose an event, so the relay stops.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AckError {
    /// Begin arrived while another transaction was open.
    #[error("a Begin arrived while a transaction was open (the stream lost a Commit)")]
    AlreadyOpen,
    /// Commit arrived with no transaction open.
    #[error("a Commit arrived with no transaction open")]
    NotOpen,
    /// A commit's `end_lsn` is not after the previous one (or after the confirmed position).
    #[error(
        "commit end_lsn {end_lsn:#x} is not after {previous:#x}: the stream is not in commit order"
    )]
    OutOfOrder {
        /// The commit's `end_lsn`.
        end_lsn: u64,
        /// The last `end_lsn` pushed or confirmed.
        previous: u64,
    },
    /// A delivery report names a transaction that is already confirmed, was never pushed, or
    /// belongs to another tracker (an earlier replication session).
    #[error("a delivery report names transaction {0:?}, which is not in flight")]
    UnknownTransaction(TxnId),
    /// More delivery reports than the transaction has messages.
    #[error("transaction {0:?} received more delivery reports than it has messages")]
    TooManyReports(TxnId),
}

#[derive(Debug)]
struct InFlight {
    end_lsn: u64,
    pending: u64,
}

/// The acknowledgement FIFO; see the [module docs](self).
#[derive(Debug)]
pub struct AckTracker {
    /// This tracker's number in the process, part of every [`TxnId`] it hands out.
    tracker: u64,
    /// Transactions not yet confirmable, in commit order; the front one has id `front_id`.
    queue: VecDeque<InFlight>,
    front_id: u64,
    open: bool,
    /// The highest position that may be confirmed (it only grows).
    confirmed: u64,
    /// The last `end_lsn` pushed.
    last_end: u64,
}

impl AckTracker {
    /// A tracker for a stream that starts after `start`: the slot's `confirmed_flush_lsn` as
    /// read when the session started, or 0. A commit at or before it is an error
    /// ([`AckError::OutOfOrder`]), so pass the server's value, not one remembered from an earlier
    /// session (after a crash the server may resume from an earlier position). One tracker per
    /// replication session.
    pub fn new(start: u64) -> Self {
        AckTracker {
            tracker: TRACKERS.fetch_add(1, Ordering::Relaxed),
            queue: VecDeque::new(),
            front_id: 0,
            open: false,
            confirmed: start,
            last_end: start,
        }
    }

    /// A Begin arrived: until its Commit, keepalives confirm nothing.
    pub fn begin(&mut self) -> Result<(), AckError> {
        if self.open {
            return Err(AckError::AlreadyOpen);
        }
        self.open = true;
        Ok(())
    }

    /// The open transaction committed at `end_lsn` and the relay publishes `messages` events of
    /// it; each of them must then be reported with [`Self::delivered`].
    pub fn commit(&mut self, end_lsn: u64, messages: u64) -> Result<TxnId, AckError> {
        if !self.open {
            return Err(AckError::NotOpen);
        }
        if end_lsn <= self.last_end {
            return Err(AckError::OutOfOrder {
                end_lsn,
                previous: self.last_end,
            });
        }
        self.open = false;
        self.last_end = end_lsn;
        let id = self.next_id();
        self.queue.push_back(InFlight {
            end_lsn,
            pending: messages,
        });
        self.advance();
        Ok(id)
    }

    /// Kafka acknowledged one message of `txn`.
    pub fn delivered(&mut self, txn: TxnId) -> Result<(), AckError> {
        if txn.tracker != self.tracker {
            return Err(AckError::UnknownTransaction(txn));
        }
        let slot = txn
            .seq
            .checked_sub(self.front_id)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.queue.get_mut(i))
            .ok_or(AckError::UnknownTransaction(txn))?;
        slot.pending = slot
            .pending
            .checked_sub(1)
            .ok_or(AckError::TooManyReports(txn))?;
        self.advance();
        Ok(())
    }

    /// A keepalive reported the server's position `wal_end`. With no transaction open or in
    /// flight, everything before it was delivered, so it becomes confirmable; otherwise it is
    /// ignored. Returns whether it was taken.
    pub fn keepalive(&mut self, wal_end: u64) -> bool {
        if self.open || !self.queue.is_empty() || wal_end <= self.confirmed {
            return false;
        }
        self.confirmed = wal_end;
        self.last_end = self.last_end.max(wal_end);
        true
    }

    /// The highest position that may be confirmed now: the `end_lsn` of the last transaction of
    /// the longest fully acknowledged prefix, or a keepalive's position taken while idle.
    pub fn confirmable(&self) -> u64 {
        self.confirmed
    }

    /// Transactions committed and not yet fully acknowledged.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }

    /// Whether a transaction is open (Begin seen, Commit not yet).
    pub fn is_open(&self) -> bool {
        self.open
    }

    fn next_id(&self) -> TxnId {
        // At most u64::MAX transactions ever fit: a wrap would take centuries.
        TxnId {
            tracker: self.tracker,
            seq: self
                .front_id
                .wrapping_add(u64::try_from(self.queue.len()).unwrap_or(u64::MAX)),
        }
    }

    /// Pops the fully acknowledged prefix and moves the confirmable position to its end.
    fn advance(&mut self) {
        while let Some(front) = self.queue.front() {
            if front.pending > 0 {
                break;
            }
            self.confirmed = self.confirmed.max(front.end_lsn);
            self.queue.pop_front();
            self.front_id = self.front_id.wrapping_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pgoutput::tests::Rng;

    fn push(t: &mut AckTracker, end_lsn: u64, messages: u64) -> TxnId {
        t.begin().unwrap();
        t.commit(end_lsn, messages).unwrap()
    }

    #[test]
    fn a_transaction_is_confirmable_only_when_every_message_is_delivered() {
        let mut t = AckTracker::new(0);
        let a = push(&mut t, 100, 2);
        t.delivered(a).unwrap();
        assert_eq!(t.confirmable(), 0);
        t.delivered(a).unwrap();
        assert_eq!(t.confirmable(), 100);
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn a_later_transaction_waits_for_an_earlier_one() {
        let mut t = AckTracker::new(0);
        let a = push(&mut t, 100, 1);
        let b = push(&mut t, 200, 1);
        t.delivered(b).unwrap();
        assert_eq!(
            t.confirmable(),
            0,
            "confirmed past an unacknowledged transaction"
        );
        t.delivered(a).unwrap();
        assert_eq!(t.confirmable(), 200);
    }

    #[test]
    fn an_empty_transaction_follows_the_one_before_it() {
        let mut t = AckTracker::new(0);
        push(&mut t, 50, 0);
        assert_eq!(t.confirmable(), 50);
        let a = push(&mut t, 100, 1);
        push(&mut t, 150, 0);
        assert_eq!(t.confirmable(), 50);
        t.delivered(a).unwrap();
        assert_eq!(t.confirmable(), 150);
    }

    #[test]
    fn keepalives_count_only_when_nothing_is_open_or_in_flight() {
        let mut t = AckTracker::new(10);
        assert!(t.keepalive(20));
        assert_eq!(t.confirmable(), 20);
        t.begin().unwrap();
        assert!(
            !t.keepalive(30),
            "keepalive taken inside an open transaction"
        );
        let a = t.commit(40, 1).unwrap();
        assert!(
            !t.keepalive(50),
            "keepalive taken while a transaction is in flight"
        );
        assert_eq!(t.confirmable(), 20);
        t.delivered(a).unwrap();
        assert_eq!(t.confirmable(), 40);
        assert!(!t.keepalive(35), "keepalive moved the position back");
        assert!(t.keepalive(60));
        assert_eq!(t.confirmable(), 60);
    }

    #[test]
    fn misuse_is_a_typed_error() {
        let mut t = AckTracker::new(100);
        assert_eq!(t.commit(200, 1), Err(AckError::NotOpen));
        t.begin().unwrap();
        assert_eq!(t.begin(), Err(AckError::AlreadyOpen));
        assert!(matches!(t.commit(100, 1), Err(AckError::OutOfOrder { .. })));
        let a = t.commit(200, 1).unwrap();
        t.delivered(a).unwrap();
        assert_eq!(t.delivered(a), Err(AckError::UnknownTransaction(a)));
        let b = push(&mut t, 300, 1);
        let c = push(&mut t, 400, 1);
        t.delivered(c).unwrap();
        assert_eq!(t.delivered(c), Err(AckError::TooManyReports(c)));
        let never = TxnId {
            tracker: b.tracker,
            seq: 99,
        };
        assert_eq!(t.delivered(never), Err(AckError::UnknownTransaction(never)));
        t.delivered(b).unwrap();
        assert_eq!(t.confirmable(), 400);
        assert!(t.keepalive(500));
        t.begin().unwrap();
        assert!(matches!(t.commit(450, 0), Err(AckError::OutOfOrder { .. })));
    }

    #[test]
    fn a_late_report_of_an_earlier_session_counts_for_nothing() {
        let mut old = AckTracker::new(0);
        let stale = push(&mut old, 100, 1);
        // Reconnected: a new session, a new tracker, the same transaction again.
        let mut new = AckTracker::new(0);
        let again = push(&mut new, 100, 1);
        assert_eq!(
            new.delivered(stale),
            Err(AckError::UnknownTransaction(stale))
        );
        assert_eq!(
            new.confirmable(),
            0,
            "a stale report confirmed an undelivered transaction"
        );
        new.delivered(again).unwrap();
        assert_eq!(new.confirmable(), 100);
    }

    /// Random transactions, message counts, report orders, interleaved keepalives and several
    /// batches in flight: the confirmable position never reaches a transaction with an
    /// unacknowledged message, never decreases, and reaches the last commit in the end.
    #[test]
    fn random_report_orders_never_confirm_past_an_unacknowledged_transaction() {
        let mut rng = Rng(0x0123_4567_89ab_cdef);
        for _ in 0..300 {
            let mut t = AckTracker::new(0);
            let mut lsn = 0u64;
            // (end_lsn, id, reports left)
            let mut txns: Vec<(u64, TxnId, u64)> = Vec::new();
            let mut reports: Vec<usize> = Vec::new();
            let mut previous = 0;
            for _ in 0..rng.below(30) + 1 {
                lsn += rng.below(1000) + 51;
                let n = rng.below(4);
                let id = push(&mut t, lsn, n);
                reports.extend(std::iter::repeat_n(txns.len(), usize::try_from(n).unwrap()));
                txns.push((lsn, id, n));
                // Deliver some reports now, in random order, before more commits arrive.
                for _ in 0..rng.below(3) {
                    deliver_one(&mut t, &mut rng, &mut reports, &mut txns);
                    check(&t, &txns, &mut previous);
                }
                t.keepalive(lsn + rng.below(50));
                check(&t, &txns, &mut previous);
            }
            while !reports.is_empty() {
                deliver_one(&mut t, &mut rng, &mut reports, &mut txns);
                check(&t, &txns, &mut previous);
            }
            // Everything delivered: the last commit, or an idle keepalive after it.
            assert!(
                (lsn..lsn + 50).contains(&t.confirmable()),
                "{}",
                t.confirmable()
            );
            assert_eq!(t.in_flight(), 0);
        }
    }

    fn deliver_one(
        t: &mut AckTracker,
        rng: &mut Rng,
        reports: &mut Vec<usize>,
        txns: &mut [(u64, TxnId, u64)],
    ) {
        if reports.is_empty() {
            return;
        }
        let pick = rng.index(reports.len());
        let txn = reports.swap_remove(pick);
        let entry = &mut txns[txn];
        entry.2 -= 1;
        t.delivered(entry.1).unwrap();
    }

    fn check(t: &AckTracker, txns: &[(u64, TxnId, u64)], previous: &mut u64) {
        let c = t.confirmable();
        assert!(
            c >= *previous,
            "confirmable went back from {previous} to {c}"
        );
        *previous = c;
        if let Some((end, _, _)) = txns.iter().find(|(_, _, left)| *left > 0) {
            assert!(
                c < *end,
                "confirmed {c}, at or past unacknowledged end_lsn {end}"
            );
        }
    }
}
