//! The verdict of a chaos run, as pure decisions: from the numbers collected after the run
//! settled to the failures the report lists (none: the run passed).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use super::hostile;

/// The numbers a verdict is drawn from.
#[derive(Debug, Default)]
pub(super) struct Numbers {
    /// The pipeline settled before the deadline.
    pub live: bool,
    /// The settle deadline.
    pub settle_deadline: Duration,
    /// How long faults were injected, in seconds.
    pub seconds: u64,
    /// Overlapping executions of one Idempotency-Key in the points API.
    pub overlapping_executions: i64,
    /// Hostile rows the contract treated otherwise than it should, or left uncontained.
    pub hostile_violations: Vec<String>,
    /// Why the burst written before the relays started fails the run (a crawl), if it does.
    pub burst: Option<String>,
    /// Panics in the processes' logs.
    pub panics: Vec<String>,
    /// Per check, missing effects whose events their group has not consumed yet.
    pub unconsumed: BTreeMap<String, u64>,
    /// The final verification found nothing.
    pub verify_clean: bool,
    /// Missing effects, as the final verification counted them (`unconsumed` included).
    pub verify_lost: u64,
    /// Duplicate effects, as the final verification counted them.
    pub duplicate_effects: u64,
    /// Violations other than missing effects (duplicates, amount mismatches, unexpected rows).
    pub other_violations: u64,
    /// Per crash point, how often it fired.
    pub crash_points_fired: BTreeMap<String, u64>,
    /// Duplicate deliveries the consumers' metrics counted.
    pub duplicate_deliveries: u64,
    /// Deliveries beyond the first, from the inboxes.
    pub inbox_duplicate_deliveries: i64,
    /// A secured run's shortfalls: a connection not secured as it should be, a password in a
    /// log.
    pub unsecured: Vec<String>,
}

impl Numbers {
    /// Missing effects that are not merely unconsumed: lost.
    pub(super) fn lost(&self) -> u64 {
        self.verify_lost.saturating_sub(self.unconsumed_total())
    }

    fn unconsumed_total(&self) -> u64 {
        self.unconsumed.values().sum()
    }
}

/// Why a chaos run failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Failure {
    /// The pipeline did not settle within the deadline after the faults stopped.
    NotSettled(Duration),
    /// Executions of one Idempotency-Key overlapped.
    OverlappingExecutions(i64),
    /// A hostile row was mishandled or left open (the description says how).
    Hostile(String),
    /// The burst written before the relays started drained too slowly, or not at all.
    Burst(String),
    /// Processes panicked.
    Panics {
        /// How many panics.
        count: usize,
        /// The first one.
        first: String,
    },
    /// Missing effects wait in the topic for a group that has not consumed them.
    Unconsumed(BTreeMap<String, u64>),
    /// The verification found effects lost or doubled.
    Verification {
        /// Lost effects.
        lost: u64,
        /// Duplicate effects.
        duplicate_effects: u64,
    },
    /// A crash point never fired in a full-length run.
    NeverFired(String),
    /// No duplicate delivery happened: nothing was proved.
    Vacuous,
    /// A secured run was not secured as it should be, or a password reached a log.
    NotSecured(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::NotSettled(deadline) => write!(
                f,
                "liveness: the pipeline did not settle within {deadline:?} after the faults stopped"
            ),
            Failure::OverlappingExecutions(n) => write!(
                f,
                "duplicate execution: {n} overlapping executions of one Idempotency-Key in the slow points API"
            ),
            Failure::Hostile(s) => f.write_str(s),
            Failure::Burst(s) => write!(f, "liveness: {s}"),
            Failure::Panics { count, first } => {
                write!(f, "{count} panic(s) in process logs, first: {first}")
            }
            Failure::Unconsumed(per_check) => write!(
                f,
                "liveness: {} missing effects wait for events still in the topic at or beyond their group's committed offset ({}); not lost — the group resumes from there — but the broker gave them to no live consumer",
                per_check.values().sum::<u64>(),
                per_check
                    .iter()
                    .map(|(c, n)| format!("check {c}: {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Failure::Verification {
                lost,
                duplicate_effects,
            } => write!(
                f,
                "verification: {lost} lost, {duplicate_effects} duplicate effects (see the report)"
            ),
            Failure::NeverFired(point) => write!(f, "crash point {point} never fired"),
            Failure::Vacuous => {
                f.write_str("vacuous: no duplicate delivery happened, so nothing was proved")
            }
            Failure::NotSecured(s) => write!(f, "security: {s}"),
        }
    }
}

/// Runs shorter than this are not expected to reach every crash point.
pub(super) const FULL_RUN_SECONDS: u64 = 120;

/// The failures of a run, in the order the report lists them; none: it passed.
pub(super) fn verdict(n: &Numbers) -> Vec<Failure> {
    let mut failures = vec![];
    if !n.live {
        failures.push(Failure::NotSettled(n.settle_deadline));
    }
    if n.overlapping_executions > 0 {
        failures.push(Failure::OverlappingExecutions(n.overlapping_executions));
    }
    failures.extend(n.hostile_violations.iter().cloned().map(Failure::Hostile));
    failures.extend(n.burst.iter().cloned().map(Failure::Burst));
    if let Some(first) = n.panics.first() {
        failures.push(Failure::Panics {
            count: n.panics.len(),
            first: first.clone(),
        });
    }
    if n.unconsumed_total() > 0 {
        failures.push(Failure::Unconsumed(n.unconsumed.clone()));
    }
    if !n.verify_clean && (n.lost() > 0 || n.other_violations > 0) {
        failures.push(Failure::Verification {
            lost: n.lost(),
            duplicate_effects: n.duplicate_effects,
        });
    }
    if n.seconds >= FULL_RUN_SECONDS {
        for (point, fired) in &n.crash_points_fired {
            if *fired == 0 {
                failures.push(Failure::NeverFired(point.clone()));
            }
        }
    }
    if n.duplicate_deliveries == 0 && n.inbox_duplicate_deliveries == 0 {
        failures.push(Failure::Vacuous);
    }
    failures.extend(n.unsecured.iter().cloned().map(Failure::NotSecured));
    failures
}

/// Violations of a verification other than missing effects: duplicates, amount mismatches,
/// unexpected rows, duplicated unique keys.
pub(super) fn other_violations(verify: &idem_verify::Report) -> u64 {
    verify
        .checks
        .iter()
        .flat_map(|c| &c.by_event_type)
        .map(|t| t.unexpected + t.duplicate_effects + t.amount_mismatches + t.duplicate_source_keys)
        .sum::<u64>()
        + verify.unique.iter().map(|u| u.duplicated_keys).sum::<u64>()
}

/// Where each stored hostile row ended (keyed by name and event id), and the rows not
/// contained by `groups`, as violations.
pub(crate) fn hostile_rows(
    fates: &[(hostile::Accepted, hostile::Fate)],
    groups: &[String],
) -> (BTreeMap<String, String>, Vec<String>) {
    let mut rows = BTreeMap::new();
    let mut violations = vec![];
    for (a, fate) in fates {
        let key = format!("{} {}", a.name, a.event_id);
        match hostile::contained(fate, groups) {
            Ok(how) => {
                rows.insert(key, how);
            }
            Err(open) => {
                violations.push(format!("hostile row {key}: {open}"));
                rows.insert(key, open);
            }
        }
    }
    (rows, violations)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A clean run's numbers: settled, duplicates delivered and absorbed, nothing lost.
    fn clean() -> Numbers {
        Numbers {
            live: true,
            settle_deadline: Duration::from_secs(180),
            seconds: 30,
            verify_clean: true,
            duplicate_deliveries: 3,
            inbox_duplicate_deliveries: 2,
            ..Numbers::default()
        }
    }

    #[test]
    fn a_clean_run_passes() {
        assert_eq!(verdict(&clean()), vec![]);
    }

    #[test]
    fn a_run_with_one_lost_event_fails_naming_the_loss() {
        let n = Numbers {
            verify_clean: false,
            verify_lost: 1,
            ..clean()
        };
        let failures = verdict(&n);
        assert_eq!(
            failures,
            vec![Failure::Verification {
                lost: 1,
                duplicate_effects: 0
            }]
        );
        assert_eq!(
            failures[0].to_string(),
            "verification: 1 lost, 0 duplicate effects (see the report)"
        );
    }

    #[test]
    fn missing_effects_still_in_the_topic_are_late_not_lost() {
        let n = Numbers {
            verify_clean: false,
            verify_lost: 2,
            unconsumed: [("audit".to_owned(), 2)].into_iter().collect(),
            ..clean()
        };
        assert_eq!(n.lost(), 0);
        let failures = verdict(&n);
        assert_eq!(failures, vec![Failure::Unconsumed(n.unconsumed.clone())]);
        assert!(
            failures[0]
                .to_string()
                .starts_with("liveness: 2 missing effects")
        );
        assert!(failures[0].to_string().contains("(check audit: 2)"));
    }

    #[test]
    fn a_hostile_row_not_contained_fails_the_run() {
        let accepted = hostile::Accepted {
            name: "payload_over_a_megabyte".to_owned(),
            event_id: "e1".to_owned(),
        };
        let pending = hostile::Fate {
            status: "pending".to_owned(),
            ..hostile::Fate::default()
        };
        let (rows, violations) = hostile_rows(&[(accepted, pending)], &hostile::reference_groups());
        assert_eq!(rows.len(), 1);
        assert_eq!(violations.len(), 1);
        assert!(violations[0].starts_with("hostile row payload_over_a_megabyte e1: "));
        let n = Numbers {
            hostile_violations: violations,
            ..clean()
        };
        assert!(matches!(verdict(&n).as_slice(), [Failure::Hostile(_)]));
    }

    #[test]
    fn a_run_without_duplicate_deliveries_proved_nothing() {
        let n = Numbers {
            duplicate_deliveries: 0,
            inbox_duplicate_deliveries: 0,
            ..clean()
        };
        assert_eq!(verdict(&n), vec![Failure::Vacuous]);
    }

    #[test]
    fn only_a_full_length_run_must_fire_every_crash_point() {
        let fired: BTreeMap<String, u64> = [("relay.a".to_owned(), 0)].into_iter().collect();
        let short = Numbers {
            crash_points_fired: fired.clone(),
            ..clean()
        };
        assert_eq!(verdict(&short), vec![]);
        let full = Numbers {
            seconds: 120,
            ..short
        };
        assert_eq!(
            verdict(&full),
            vec![Failure::NeverFired("relay.a".to_owned())]
        );
    }

    #[test]
    fn a_secured_runs_shortfall_fails_it() {
        let n = Numbers {
            unsecured: vec![
                "a password of the run in the logs: 1 line(s), first at a.log:3".to_owned(),
            ],
            ..clean()
        };
        assert_eq!(
            verdict(&n)
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["security: a password of the run in the logs: 1 line(s), first at a.log:3"]
        );
    }

    #[test]
    fn failures_come_in_the_reports_order() {
        let n = Numbers {
            live: false,
            overlapping_executions: 1,
            panics: vec!["p1".to_owned(), "p2".to_owned()],
            duplicate_deliveries: 0,
            inbox_duplicate_deliveries: 0,
            ..clean()
        };
        let text: Vec<String> = verdict(&n).iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            vec![
                "liveness: the pipeline did not settle within 180s after the faults stopped",
                "duplicate execution: 1 overlapping executions of one Idempotency-Key in the slow points API",
                "2 panic(s) in process logs, first: p1",
                "vacuous: no duplicate delivery happened, so nothing was proved",
            ]
        );
    }
}
