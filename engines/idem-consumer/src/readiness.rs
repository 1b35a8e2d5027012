//! What the consumer reports about its database for `/readyz` ([`Consumer::with_health`]): the
//! probe of an idle consumer and the decision when to send it.
//!
//! [`Consumer::with_health`]: crate::Consumer::with_health

use std::time::{Duration, Instant};

/// The dependency name of the consumer's database.
pub const DATABASE: &str = "database";

/// How often the database is probed while no transaction commits.
pub(crate) const PROBE_EVERY: Duration = Duration::from_secs(5);

/// How long a probe (a connection from the pool, `BEGIN`, `ROLLBACK`) may take.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether to probe at `now`, the last transaction having committed at `committed`: not when
/// one committed within `every` (the database answered; a probe would only wait for a
/// connection the lanes use).
pub(crate) fn probe_due(committed: Option<Instant>, now: Instant, every: Duration) -> bool {
    committed.is_none_or(|at| now.saturating_duration_since(at) >= every)
}

/// Why a probe that took longer than `timeout` failed.
pub(crate) fn timed_out(timeout: Duration) -> String {
    format!(
        "no answer within {timeout:?}: the database is unreachable, or every connection of the \
         pool is busy"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_consumer_probes_and_a_committing_one_does_not() {
        let t0 = Instant::now();
        let every = Duration::from_secs(5);
        assert!(probe_due(None, t0, every), "nothing committed yet");
        assert!(!probe_due(Some(t0), t0, every));
        assert!(!probe_due(Some(t0), t0 + Duration::from_secs(4), every));
        assert!(probe_due(Some(t0), t0 + every, every));
        assert!(timed_out(every).contains("5s"));
    }
}
