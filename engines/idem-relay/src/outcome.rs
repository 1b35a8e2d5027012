//! What the relay decides for each claimed row once the delivery reports are in: pure, so that
//! the ordering and parking rules are unit-tested without a store or a broker. The decisions
//! are mapped to the store's [`ClaimOutcome`] at the boundary ([`mark`]).

use std::collections::HashSet;
use std::time::Duration;

use idem_core::outbox::{ClaimOutcome, Disposition, Failure, OutboxRecord};
use idem_core::publish::{FailureKind, PublishError};

/// The reason stored for a row that was acknowledged after an earlier row of its aggregate
/// failed.
pub(crate) const HELD_BEHIND: &str =
    "delivered, but an earlier event of the aggregate failed; will be published again after it";

/// What becomes of one claimed row.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum RowOutcome {
    /// Acknowledged, and no earlier row of its aggregate failed: marked published.
    Published,
    /// Acknowledged, but an earlier row of its aggregate failed: released, to be published
    /// again after that one (a later row is never marked before an earlier one).
    HeldBehind,
    /// Not acknowledged.
    Failed {
        /// The publisher's report.
        error: PublishError,
        /// Retried later, or parked.
        next: Next,
    },
}

/// What happens next to a row that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Released for a later attempt.
    Retry,
    /// Parked: not retried until a person retries it.
    Park,
}

/// The rules a row's failure is judged by.
pub(crate) struct Policy<'a> {
    /// Permanent failures before a row is parked.
    pub(crate) max_attempts: i32,
    /// The `never-park` negative control: asked only when a row would be parked.
    pub(crate) never_park: &'a (dyn Fn() -> bool + Sync),
}

/// Per aggregate, only the prefix of rows before the first failure may be marked: a row
/// acknowledged after its aggregate failed is [`RowOutcome::HeldBehind`]. Only permanent
/// failures count towards parking: a broker outage never parks.
pub(crate) fn classify(
    records: &[OutboxRecord],
    results: Vec<Result<(), PublishError>>,
    policy: &Policy<'_>,
) -> Vec<RowOutcome> {
    let mut blocked: HashSet<(&str, &str)> = HashSet::new();
    records
        .iter()
        .zip(results)
        .map(|(r, res)| {
            let key = (r.aggregate_type.as_str(), r.aggregate_id.as_str());
            match res {
                Ok(()) if !blocked.contains(&key) => RowOutcome::Published,
                Ok(()) => RowOutcome::HeldBehind,
                Err(error) => {
                    blocked.insert(key);
                    let park = match error.kind {
                        FailureKind::Permanent => r.permanent_failures + 1 >= policy.max_attempts,
                        FailureKind::Unwritable => true,
                        FailureKind::Transient | FailureKind::NotSent => false,
                    } && !(policy.never_park)();
                    let next = if park { Next::Park } else { Next::Retry };
                    RowOutcome::Failed { error, next }
                }
            }
        })
        .collect()
}

pub(crate) use idem_core::backoff::Backoff;

/// The store's [`Failure`] for a row that could not be decoded: parked at once.
pub(crate) fn corrupt(id: i64, reason: &str) -> Failure {
    Failure {
        id,
        reason: reason.to_owned(),
        backoff: Duration::ZERO,
        disposition: Disposition::Park,
    }
}

/// What the store does with a row that failed with `kind`, given the decision `next`. Only a
/// permanent failure, or one to a topic the cluster says is unwritable, parks.
fn disposition(kind: FailureKind, next: Next) -> Disposition {
    match (kind, next) {
        (FailureKind::Permanent | FailureKind::Unwritable, Next::Park) => Disposition::Park,
        (FailureKind::Permanent, Next::Retry) => Disposition::Permanent,
        (FailureKind::NotSent, _) => Disposition::NotSent,
        (_, _) => Disposition::Retry,
    }
}

/// The store's [`Failure`] for `r`, or `None` when it is marked published.
pub(crate) fn failure(r: &OutboxRecord, outcome: &RowOutcome, backoff: Backoff) -> Option<Failure> {
    match outcome {
        RowOutcome::Published => None,
        RowOutcome::HeldBehind => Some(Failure {
            id: r.id,
            reason: HELD_BEHIND.to_owned(),
            backoff: Duration::ZERO,
            disposition: Disposition::Retry,
        }),
        RowOutcome::Failed { error, next } => {
            let disposition = disposition(error.kind, *next);
            Some(Failure {
                id: r.id,
                reason: error.reason.clone(),
                // A message never handed to the broker is not an attempt: no backoff.
                backoff: if disposition.attempted() {
                    backoff.after(u32::try_from(r.attempt).unwrap_or(0))
                } else {
                    Duration::ZERO
                },
                disposition,
            })
        }
    }
}

/// The mark for the whole claim: corrupt rows parked first, then each row in claim order.
pub(crate) fn mark(
    corrupt_rows: &[(i64, String)],
    records: &[OutboxRecord],
    outcomes: &[RowOutcome],
    backoff: Backoff,
) -> ClaimOutcome {
    let mut outcome = ClaimOutcome::default();
    outcome
        .failed
        .extend(corrupt_rows.iter().map(|(id, reason)| corrupt(*id, reason)));
    for (r, o) in records.iter().zip(outcomes) {
        match failure(r, o, backoff) {
            None => outcome.published.push(r.id),
            Some(f) => outcome.failed.push(f),
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, aggregate_id: &str, permanent_failures: i32) -> OutboxRecord {
        OutboxRecord {
            attempt: 3,
            permanent_failures,
            ..crate::test_row(id, "order", aggregate_id)
        }
    }

    fn err(kind: FailureKind) -> Result<(), PublishError> {
        Err(PublishError {
            kind,
            reason: "no".into(),
        })
    }

    const POLICY: Policy<'static> = Policy {
        max_attempts: 3,
        never_park: &|| false,
    };

    #[test]
    fn a_row_acknowledged_after_its_aggregate_failed_is_held_behind_and_others_are_not() {
        let rows = [row(1, "a", 0), row(2, "a", 0), row(3, "b", 0)];
        let out = classify(
            &rows,
            vec![err(FailureKind::Transient), Ok(()), Ok(())],
            &POLICY,
        );
        assert!(matches!(
            out[0],
            RowOutcome::Failed {
                next: Next::Retry,
                ..
            }
        ));
        assert_eq!(out[1], RowOutcome::HeldBehind);
        assert_eq!(out[2], RowOutcome::Published);
    }

    #[test]
    fn only_permanent_failures_reaching_the_limit_park() {
        let rows = [row(1, "a", 2), row(2, "b", 2), row(3, "c", 1)];
        let results = vec![
            err(FailureKind::Permanent),
            err(FailureKind::Transient),
            err(FailureKind::Permanent),
        ];
        let next: Vec<Next> = classify(&rows, results, &POLICY)
            .into_iter()
            .map(|o| match o {
                RowOutcome::Failed { next, .. } => next,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(next, [Next::Park, Next::Retry, Next::Retry]);
        let never = Policy {
            never_park: &|| true,
            ..POLICY
        };
        let out = classify(&rows[..1], vec![err(FailureKind::Permanent)], &never);
        assert!(matches!(
            out[0],
            RowOutcome::Failed {
                next: Next::Retry,
                ..
            }
        ));
    }

    #[test]
    fn the_mark_parks_corrupt_rows_first_and_a_row_never_sent_is_not_an_attempt() {
        let rows = [row(1, "a", 0), row(2, "a", 0), row(3, "b", 0)];
        let backoff = Backoff {
            first: Duration::from_secs(1),
            max: Duration::from_secs(3),
        };
        let outcomes = classify(
            &rows,
            vec![
                err(FailureKind::Transient),
                err(FailureKind::NotSent),
                Ok(()),
            ],
            &POLICY,
        );
        let m = mark(&[(9, "bad row".into())], &rows, &outcomes, backoff);
        assert_eq!(m.published, [3]);
        assert_eq!(m.failed[0], corrupt(9, "bad row"));
        assert_eq!(
            (
                m.failed[1].id,
                m.failed[1].disposition.attempted(),
                m.failed[1].backoff
            ),
            (1, true, Duration::from_secs(3))
        );
        assert_eq!(
            (
                m.failed[2].id,
                m.failed[2].disposition.attempted(),
                m.failed[2].backoff
            ),
            (2, false, Duration::ZERO)
        );
        let held = failure(&rows[1], &RowOutcome::HeldBehind, backoff).unwrap();
        assert_eq!(
            (held.reason.as_str(), held.disposition),
            (HELD_BEHIND, Disposition::Retry)
        );
    }
}
