//! What a running process depends on and whether it has it now: the answer of `/readyz`, and
//! the one place a dependency's outage is logged — by its cause, once when it starts, then at
//! most once per [`REMIND_EVERY`] while it lasts, and once when it ends — instead of a line per
//! failed attempt.
//!
//! A stage names its dependencies ([`Health::expect`]) and reports each attempt's outcome
//! ([`Health::ok`], [`Health::failed`]); a dependency not yet reached is not ready.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How often an outage that goes on is logged again.
pub const REMIND_EVERY: Duration = Duration::from_secs(30);

/// The dependencies of a process and their state; cheap to clone (one shared state).
#[derive(Clone, Default)]
pub struct Health {
    deps: Arc<Mutex<BTreeMap<&'static str, State>>>,
}

impl fmt::Debug for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Health")
            .field("report", &self.report())
            .finish()
    }
}

#[derive(Clone, Debug)]
enum State {
    /// Never reached yet.
    Starting,
    Up,
    Down(Outage),
}

#[derive(Clone, Debug)]
struct Outage {
    cause: String,
    since: Instant,
    failures: u64,
    logged: Instant,
}

/// One dependency in a [`Report`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Check {
    /// Its name (`database`, `broker`, `slot`, …).
    pub name: &'static str,
    /// Whether it is usable now.
    pub ready: bool,
    /// Why not, when it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Every dependency's state, as `/readyz` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Report {
    /// Whether every dependency is usable.
    pub ready: bool,
    /// Each dependency, by name.
    pub checks: Vec<Check>,
}

/// What to log for an attempt's outcome: the decision, apart from the logging.
#[derive(Debug, PartialEq, Eq)]
enum Note {
    Nothing,
    Down,
    StillDown { for_secs: u64, failures: u64 },
    Recovered { after_secs: u64, failures: u64 },
}

impl Health {
    /// No dependency yet.
    pub fn new() -> Health {
        Health::default()
    }

    /// `name` is needed: not ready until an attempt reaches it.
    pub fn expect(&self, name: &'static str) {
        self.with(|deps| {
            deps.entry(name).or_insert(State::Starting);
        });
    }

    /// An attempt reached `name`.
    pub fn ok(&self, name: &'static str) {
        let note = self.with(|deps| {
            let note = match deps.get(name) {
                Some(State::Down(o)) => Note::Recovered {
                    after_secs: o.since.elapsed().as_secs(),
                    failures: o.failures,
                },
                _ => Note::Nothing,
            };
            deps.insert(name, State::Up);
            note
        });
        if let Note::Recovered {
            after_secs,
            failures,
        } = note
        {
            tracing::info!(
                dependency = name,
                after_secs,
                failures,
                "{name} is reachable again"
            );
        }
    }

    /// An attempt to use `name` failed with `cause`. Logged when the outage starts, then at most
    /// every [`REMIND_EVERY`] with the count of failures so far.
    pub fn failed(&self, name: &'static str, cause: &dyn fmt::Display) {
        let cause = cause.to_string();
        let now = Instant::now();
        let note = self.with(|deps| fail(deps.entry(name).or_insert(State::Starting), &cause, now));
        match note {
            Note::Down => {
                tracing::warn!(dependency = name, cause = %cause, "{name} is unavailable: {cause}");
            }
            Note::StillDown { for_secs, failures } => tracing::warn!(
                dependency = name,
                cause = %cause,
                for_secs,
                failures,
                "{name} still unavailable after {for_secs} s ({failures} failed attempts): {cause}"
            ),
            _ => {}
        }
    }

    /// Every dependency's state.
    pub fn report(&self) -> Report {
        self.with(|deps| {
            let checks: Vec<Check> = deps
                .iter()
                .map(|(name, s)| Check {
                    name,
                    ready: matches!(s, State::Up),
                    reason: match s {
                        State::Up => None,
                        State::Starting => Some("not reached yet".to_owned()),
                        State::Down(o) => Some(o.cause.clone()),
                    },
                })
                .collect();
            Report {
                ready: checks.iter().all(|c| c.ready),
                checks,
            }
        })
    }

    fn with<T>(&self, f: impl FnOnce(&mut BTreeMap<&'static str, State>) -> T) -> T {
        // A panic elsewhere while holding the lock leaves a map that is still well formed.
        let mut deps = self.deps.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut deps)
    }
}

/// The new state of a dependency after a failure at `now`, and what to log.
fn fail(state: &mut State, cause: &str, now: Instant) -> Note {
    match state {
        State::Down(o) => {
            o.failures += 1;
            o.cause = cause.to_owned();
            if now.duration_since(o.logged) >= REMIND_EVERY {
                o.logged = now;
                Note::StillDown {
                    for_secs: now.duration_since(o.since).as_secs(),
                    failures: o.failures,
                }
            } else {
                Note::Nothing
            }
        }
        State::Up | State::Starting => {
            *state = State::Down(Outage {
                cause: cause.to_owned(),
                since: now,
                failures: 1,
                logged: now,
            });
            Note::Down
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dependency_not_reached_yet_is_not_ready() {
        let h = Health::new();
        h.expect("database");
        h.expect("broker");
        h.ok("database");
        let r = h.report();
        assert!(!r.ready);
        assert_eq!(
            r.checks,
            vec![
                Check {
                    name: "broker",
                    ready: false,
                    reason: Some("not reached yet".to_owned())
                },
                Check {
                    name: "database",
                    ready: true,
                    reason: None
                },
            ]
        );
        h.ok("broker");
        assert!(h.report().ready);
        h.failed("broker", &"all brokers down");
        assert_eq!(
            h.report().checks[0].reason.as_deref(),
            Some("all brokers down")
        );
        assert!(!h.report().ready);
    }

    #[test]
    fn an_outage_is_logged_once_then_at_most_every_remind_interval() {
        let t0 = Instant::now();
        let mut s = State::Up;
        assert_eq!(fail(&mut s, "refused", t0), Note::Down);
        for i in 1..100 {
            let at = t0 + REMIND_EVERY * i / 100;
            assert_eq!(fail(&mut s, "refused", at), Note::Nothing, "attempt {i}");
        }
        assert_eq!(
            fail(&mut s, "refused", t0 + REMIND_EVERY),
            Note::StillDown {
                for_secs: REMIND_EVERY.as_secs(),
                failures: 101
            }
        );
        assert_eq!(
            fail(
                &mut s,
                "refused",
                t0 + REMIND_EVERY + Duration::from_secs(1)
            ),
            Note::Nothing
        );
    }
}
