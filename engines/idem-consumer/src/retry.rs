//! What the consumer does after a failed attempt at a batch: pure bookkeeping of refused
//! events, failures and isolation, so the retry policy is unit-tested without a database.

use std::collections::HashMap;

use idem_core::{Error, EventId};

use crate::attempt::Attempt;

/// The next step after a failed attempt.
#[derive(Debug)]
pub(crate) enum Step {
    /// Try again at once (an event was set apart, or the batch is now isolated).
    Again,
    /// The event failed `max_unclassified_failures` times with a database error the rule does
    /// not classify: it is set apart, dead-lettered with `reason`; try again at once.
    SetApart {
        /// The event.
        event: EventId,
        /// Its dead letter's reason.
        reason: String,
    },
    /// Back off, then try again.
    BackOff {
        /// The failure.
        error: Error,
        /// The event it is charged to, if any.
        event: Option<EventId>,
    },
    /// The database failed `max_batch_retries` times with no event to charge: give up on the
    /// batch (its offset is not committed).
    GiveUp {
        /// The last failure.
        error: Error,
        /// The event it is charged to, if any.
        event: Option<EventId>,
    },
    /// A crash point fired in error mode.
    Fatal(Error),
}

/// The reason to dead-letter an event after its `n`th transient failure `e`, when the policy
/// (a negative control) says so; `None` otherwise.
pub(crate) type TransientBudget = fn(u32, &Error) -> Option<String>;

/// The retry state of one batch.
#[derive(Debug)]
pub(crate) struct Retries {
    /// Events refused permanently, with the reasons: recorded dead-lettered, not applied.
    pub(crate) poison: HashMap<EventId, String>,
    /// A savepoint per event from now on. After a first refused event (or a failed attempt) the
    /// batch is retried this way, so any number of refused events costs one extra attempt, not
    /// one per event, and each failure is charged to the event that caused it.
    pub(crate) isolate: bool,
    /// Attempts rolled back and retried.
    pub(crate) retries: u64,
    /// Failures no event is charged with (the database down).
    batch_failures: u32,
    /// Transient failures per event.
    event_failures: HashMap<EventId, u32>,
    /// Unclassified failures per event.
    unclassified_failures: HashMap<EventId, u32>,
    max_batch_retries: u32,
    max_unclassified_failures: u32,
    budget: TransientBudget,
}

impl Retries {
    /// A batch not attempted yet.
    pub(crate) fn new(
        max_batch_retries: u32,
        max_unclassified_failures: u32,
        budget: TransientBudget,
    ) -> Self {
        Retries {
            poison: HashMap::new(),
            isolate: false,
            retries: 0,
            batch_failures: 0,
            event_failures: HashMap::new(),
            unclassified_failures: HashMap::new(),
            max_batch_retries,
            max_unclassified_failures,
            budget,
        }
    }

    /// How many times `event` failed with an unclassified database error in this batch.
    pub(crate) fn unclassified_failures(&self, event: EventId) -> u32 {
        self.unclassified_failures.get(&event).copied().unwrap_or(0)
    }

    /// Events the handler refused in the attempt that committed.
    pub(crate) fn refused(&mut self, refused: Vec<(EventId, String)>) {
        self.poison.extend(refused);
    }

    /// Takes a failed attempt into account and says what to do next. A transient failure never
    /// dead-letters: the batch is retried until it commits. Only failures no event is charged
    /// with end the run after `max_batch_retries`, for a supervisor to restart it. An
    /// unclassified failure is retried like a transient one until its event has failed so
    /// `max_unclassified_failures` times; then the event is set apart, to be dead-lettered.
    pub(crate) fn after(&mut self, failure: Attempt) -> Step {
        match failure {
            Attempt::Fatal(e) => Step::Fatal(e),
            Attempt::Unusable(_) | Attempt::Refused(_) => {
                self.retries += 1;
                self.isolate = true;
                Step::Again
            }
            Attempt::Poison(id, reason) => {
                self.poison.insert(id, reason);
                self.isolate = true;
                Step::Again
            }
            Attempt::Unclassified(id, what, error) => {
                self.retries += 1;
                self.isolate = true;
                let n = self.unclassified_failures.entry(id).or_default();
                *n = n.saturating_add(1);
                if *n >= self.max_unclassified_failures {
                    let reason = format!(
                        "{what} is neither transient nor permanent by the consumer's rule; dead-lettered after {n} failures (max_unclassified_failures): {error}"
                    );
                    self.poison.insert(id, reason.clone());
                    return Step::SetApart { event: id, reason };
                }
                Step::BackOff {
                    error,
                    event: Some(id),
                }
            }
            Attempt::Transient(event, error) => {
                self.retries += 1;
                self.isolate = true;
                match event {
                    None => self.batch_failures += 1,
                    Some(id) => {
                        let n = self.event_failures.entry(id).or_default();
                        *n += 1;
                        if let Some(reason) = (self.budget)(*n, &error) {
                            // Negative control: the old policy, a transient failure
                            // dead-letters the event.
                            self.poison.insert(id, reason);
                            return Step::Again;
                        }
                    }
                }
                if self.batch_failures > self.max_batch_retries {
                    Step::GiveUp { error, event }
                } else {
                    Step::BackOff { error, event }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn down() -> Attempt {
        Attempt::Transient(None, Error::Config("down".into()))
    }

    fn never(_: u32, _: &Error) -> Option<String> {
        None
    }

    #[test]
    fn the_database_down_gives_up_after_max_batch_retries() {
        let mut r = Retries::new(2, 10, never);
        assert!(matches!(r.after(down()), Step::BackOff { event: None, .. }));
        assert!(matches!(r.after(down()), Step::BackOff { .. }));
        assert!(matches!(r.after(down()), Step::GiveUp { .. }));
        assert_eq!((r.retries, r.isolate), (3, true));
    }

    #[test]
    fn an_event_failing_transiently_is_retried_without_limit_and_never_poisoned() {
        let mut r = Retries::new(2, 10, never);
        let id = EventId::new();
        for _ in 0..100 {
            let step = r.after(Attempt::Transient(Some(id), Error::Config("locked".into())));
            assert!(matches!(step, Step::BackOff { event: Some(e), .. } if e == id));
        }
        assert!(r.poison.is_empty());
    }

    #[test]
    fn a_refused_event_is_set_apart_and_the_batch_isolated_without_counting_a_retry() {
        let mut r = Retries::new(2, 10, never);
        let id = EventId::new();
        assert!(matches!(
            r.after(Attempt::Poison(id, "no".into())),
            Step::Again
        ));
        assert_eq!(
            (r.poison.get(&id).map(String::as_str), r.isolate, r.retries),
            (Some("no"), true, 0)
        );
        assert!(matches!(
            r.after(Attempt::Unusable(Error::Config("aborted".into()))),
            Step::Again
        ));
        assert_eq!(r.retries, 1);
        assert!(matches!(
            r.after(Attempt::Refused("a CHECK refused the batch".into())),
            Step::Again
        ));
        assert_eq!((r.retries, r.isolate), (2, true));
        assert!(matches!(
            r.after(Attempt::Fatal(Error::Config("crash".into()))),
            Step::Fatal(_)
        ));
    }

    #[test]
    fn a_spent_budget_dead_letters_the_event_when_the_control_is_on() {
        fn budget(n: u32, e: &Error) -> Option<String> {
            (n > 2).then(|| format!("gave up after {n} transient failures; last: {e}"))
        }
        let mut r = Retries::new(2, 10, budget);
        let id = EventId::new();
        let fail = || Attempt::Transient(Some(id), Error::Config("locked".into()));
        assert!(matches!(r.after(fail()), Step::BackOff { .. }));
        assert!(matches!(r.after(fail()), Step::BackOff { .. }));
        assert!(matches!(r.after(fail()), Step::Again));
        assert!(r.poison[&id].starts_with("gave up after 3 transient failures"));
    }

    #[test]
    fn an_unclassified_failure_is_retried_then_set_apart_and_a_transient_one_never() {
        let mut r = Retries::new(2, 3, never);
        let (odd, locked) = (EventId::new(), EventId::new());
        let unclassified =
            || Attempt::Unclassified(odd, "SQLSTATE ZZ001".into(), Error::Config("odd".into()));
        assert!(
            matches!(r.after(unclassified()), Step::BackOff { event: Some(e), .. } if e == odd)
        );
        for _ in 0..50 {
            let step = r.after(Attempt::Transient(
                Some(locked),
                Error::Config("locked".into()),
            ));
            assert!(matches!(step, Step::BackOff { .. }), "{step:?}");
        }
        assert!(matches!(r.after(unclassified()), Step::BackOff { .. }));
        assert_eq!(r.unclassified_failures(odd), 2);
        match r.after(unclassified()) {
            Step::SetApart { event, reason } => {
                assert_eq!(event, odd);
                assert!(
                    reason.starts_with("SQLSTATE ZZ001 is neither transient nor permanent"),
                    "{reason}"
                );
                assert!(reason.contains("after 3 failures"), "{reason}");
                assert!(reason.ends_with("odd"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(r.poison.contains_key(&odd));
        assert!(
            !r.poison.contains_key(&locked),
            "a transient failure never dead-letters"
        );
    }
}
