//! Retention of the consumer's inbox and of finished effect intents, bounded below by the
//! **redelivery horizon**: how long after an event was processed a copy of it can still be
//! delivered. That is at least the topic's retention (`retention.ms`; Kafka deletes whole
//! segments, so add `segment.ms` for the time a record can really still be read), and longer if
//! outbox rows can wait parked or pending for longer before the relay publishes them again.
//!
//! The inbox is what makes a redelivered event a duplicate: an inbox row deleted while a copy of
//! its event can still arrive lets that copy be **applied a second time**. So a window shorter
//! than the horizon is refused, by construction: a store prunes only with a [`RetentionWindow`],
//! and one exists only if it is at least the horizon.
//!
//! The outbox's per-aggregate counters (`<prefix>outbox_aggregates` on PostgreSQL) are pruned
//! only when asked ([`RetentionStore::prune_aggregate_counters`]): the row holds the last
//! `aggregate_seq` handed out, and deleting it restarts the aggregate at 1 with its next event.
//! The relay's order is safe (only aggregates with no pending or parked row lose their counter,
//! so the restarted numbers are above every pending row of theirs), but a consumer that keeps
//! the last applied number per aggregate ([`crate::ordering`]) would take the restarted
//! aggregate's events for copies of events it applied and skip them. Prune the counters only
//! where no consumer keeps such state, or together with it.

use std::future::Future;
use std::time::Duration;

use crate::Result;

/// What a store can prune beyond a [`RetentionWindow`].
/// Exhaustive on purpose: a new kind must be handled by every store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prunable {
    /// `processed` inbox rows (every consumer group) processed and last delivered before the
    /// window; `dead_lettered` rows stay.
    Inbox,
    /// `done` effect intents finished before the window; pending, parked and unknown ones stay.
    DoneIntents,
}

impl Prunable {
    /// Words for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Prunable::Inbox => "inbox rows",
            Prunable::DoneIntents => "done effect intents",
        }
    }
}

/// A store that prunes [`Prunable`] rows (the PostgreSQL and SQLite stores).
pub trait RetentionStore {
    /// Deletes up to `batch` rows of `what` older than `window`; returns how many.
    fn prune_older(
        &self,
        what: Prunable,
        window: &RetentionWindow,
        batch: u32,
    ) -> impl Future<Output = Result<u64>> + Send;

    /// Deletes up to `batch` per-aggregate counter rows of the outbox (PostgreSQL's
    /// `<prefix>outbox_aggregates`) whose aggregate has no pending or parked outbox row; returns
    /// how many. The aggregate's next event is numbered 1 again (see the module's note on
    /// consumers that keep sequence numbers). A counter a writer holds is skipped, and one whose
    /// aggregate got a pending row after the candidates were chosen stays. SQLite keeps no
    /// counters (its `aggregate_seq` is the row id): 0.
    fn prune_aggregate_counters(&self, batch: u32) -> impl Future<Output = Result<u64>> + Send;
}

/// Why a retention window was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RetentionError {
    /// The window is shorter than the redelivery horizon.
    #[error(
        "refusing to prune {what} younger than the redelivery horizon: the window is {window_s} s, \
         the horizon {horizon_s} s. A copy of an event can still be delivered during the horizon \
         (the topic's retention), and without its inbox row it would be applied twice; use a window \
         of at least {horizon_s} s, or a shorter horizon only if the topic really keeps records \
         for less"
    )]
    ShorterThanHorizon {
        /// What was to be pruned.
        what: &'static str,
        /// The window asked for, in seconds.
        window_s: u64,
        /// The horizon, in seconds.
        horizon_s: u64,
    },
    /// No horizon was given (zero).
    #[error(
        "the redelivery horizon must be above zero: give the topic's retention (retention.ms, plus \
         segment.ms); if the topic keeps records for ever, do not prune {what}"
    )]
    NoHorizon {
        /// What was to be pruned.
        what: &'static str,
    },
}

/// An age beyond which rows may be pruned, checked against the redelivery horizon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionWindow {
    older_than: Duration,
}

impl RetentionWindow {
    /// A window of `older_than` for `what` (named in the error), refused when it is shorter than
    /// `horizon` or when `horizon` is zero.
    pub fn new(
        what: Prunable,
        older_than: Duration,
        horizon: Duration,
    ) -> std::result::Result<Self, RetentionError> {
        let what = what.describe();
        if horizon.is_zero() {
            return Err(RetentionError::NoHorizon { what });
        }
        if older_than < horizon {
            return Err(RetentionError::ShorterThanHorizon {
                what,
                window_s: older_than.as_secs(),
                horizon_s: horizon.as_secs(),
            });
        }
        Ok(RetentionWindow { older_than })
    }

    /// Rows older than this may go.
    pub fn older_than(&self) -> Duration {
        self.older_than
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn a_window_shorter_than_the_horizon_is_refused() {
        let err = RetentionWindow::new(Prunable::Inbox, 6 * DAY, 7 * DAY).unwrap_err();
        assert_eq!(
            err,
            RetentionError::ShorterThanHorizon {
                what: "inbox rows",
                window_s: 6 * 86_400,
                horizon_s: 7 * 86_400
            }
        );
        assert!(err.to_string().contains("applied twice"), "{err}");
        assert_eq!(
            RetentionWindow::new(Prunable::Inbox, DAY, Duration::ZERO),
            Err(RetentionError::NoHorizon { what: "inbox rows" })
        );
        let ok = RetentionWindow::new(Prunable::Inbox, 7 * DAY, 7 * DAY).unwrap();
        assert_eq!(ok.older_than(), 7 * DAY);
    }
}
