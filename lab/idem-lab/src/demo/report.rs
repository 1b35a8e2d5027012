//! What the demo shows at the end: the figures, the verdict, and their human form.

use std::collections::BTreeMap;

use serde::Serialize;

use super::world::Databases;

/// What the demo shows at the end.
#[derive(Debug, Serialize)]
pub(super) struct DemoReport {
    pub ok: bool,
    pub failures: Vec<Failure>,
    pub databases: String,
    /// What the broker is (`Broker::kind`).
    pub broker: &'static str,
    /// Its bootstrap servers.
    pub brokers: String,
    pub seconds: f64,
    pub orders: i64,
    pub events_published: i64,
    pub deliveries: i64,
    pub duplicate_deliveries: u64,
    pub duplicate_skips: u64,
    pub republishes: u64,
    pub retries: u64,
    pub idempotency_conflicts: u64,
    pub dead_letters: i64,
    pub settlements: i64,
    pub points_awards: i64,
    pub effect_attempts: i64,
    pub crash_points_fired: BTreeMap<String, u64>,
    pub restarts: BTreeMap<String, u64>,
    pub lost: u64,
    pub duplicate_effects: u64,
    pub verify: idem_verify::Report,
}

/// Why a run failed; shown (and serialised) as its sentence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Failure {
    /// `idem verify` was not clean.
    Violations,
    /// A crash point fired fewer times than asked.
    CrashPointShort {
        /// The point.
        point: String,
        /// How often it fired.
        fired: u64,
        /// How often it should have.
        target: u64,
    },
    /// Nothing was delivered twice.
    NoDuplicateDelivery,
    /// Fewer conflicts were counted than sent.
    ConflictsUncounted {
        /// Conflicting copies sent.
        sent: u64,
        /// Idempotency conflicts counted.
        counted: u64,
    },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Violations => write!(f, "idem verify found violations (see the report)"),
            Failure::CrashPointShort {
                point,
                fired,
                target,
            } => write!(
                f,
                "crash point {point} fired {fired} times, fewer than {target}"
            ),
            Failure::NoDuplicateDelivery => {
                write!(f, "no duplicate delivery happened: the run proves nothing")
            }
            Failure::ConflictsUncounted { sent, counted } => write!(
                f,
                "{sent} conflicting copies were sent but {counted} idempotency conflicts were counted"
            ),
        }
    }
}

impl Serialize for Failure {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// What the verdict is drawn from.
pub(super) struct Evidence<'a> {
    /// `idem verify` found nothing.
    pub verify_clean: bool,
    /// How often each crash point fired.
    pub fired: &'a BTreeMap<String, u64>,
    /// Duplicate deliveries counted.
    pub duplicate_deliveries: u64,
    /// Idempotency conflicts counted.
    pub conflicts_counted: u64,
}

/// The verdict: every crash point fired `target_fires` times, duplicates happened, each of the
/// `conflicts_sent` conflicts was counted, and `idem verify` is clean. Empty means OK.
pub(super) fn verdict(e: &Evidence<'_>, target_fires: u64, conflicts_sent: u64) -> Vec<Failure> {
    let mut failures = vec![];
    if !e.verify_clean {
        failures.push(Failure::Violations);
    }
    for (point, n) in e.fired {
        if *n < target_fires {
            failures.push(Failure::CrashPointShort {
                point: point.clone(),
                fired: *n,
                target: target_fires,
            });
        }
    }
    if e.duplicate_deliveries == 0 {
        failures.push(Failure::NoDuplicateDelivery);
    }
    if e.conflicts_counted < conflicts_sent {
        failures.push(Failure::ConflictsUncounted {
            sent: conflicts_sent,
            counted: e.conflicts_counted,
        });
    }
    failures
}

/// The sum of counter `name` over `registries`.
pub(super) fn registry_sum(registries: &[&prometheus::Registry], name: &str) -> u64 {
    registries
        .iter()
        .flat_map(|r| r.gather())
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().to_vec())
        .map(|m| crate::num::whole(m.get_counter().get_value()))
        .sum()
}

/// What the databases hold at the end.
pub(super) struct Rows {
    pub orders: i64,
    pub events_published: i64,
    pub dead_letters: i64,
    pub settlements: i64,
    pub points_awards: i64,
}

impl Rows {
    /// Counts them.
    pub(super) async fn count(dbs: &Databases) -> anyhow::Result<Rows> {
        let (o, s) = (&dbs.orders, &dbs.settlement);
        Ok(Rows {
            orders: o.scalar("SELECT count(*) FROM orders").await?,
            events_published: o
                .scalar("SELECT count(*) FROM idem_outbox WHERE status = 'published'")
                .await?,
            dead_letters: s.scalar("SELECT count(*) FROM idem_dead_letters").await?,
            settlements: s.scalar("SELECT count(*) FROM settlements").await?,
            points_awards: dbs
                .points
                .scalar("SELECT count(*) FROM points_awards")
                .await?,
        })
    }
}

fn joined(m: &BTreeMap<String, u64>) -> String {
    m.iter()
        .map(|(k, v)| format!("{k} ×{v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The report's table rows.
fn rows(r: &DemoReport) -> [(&'static str, String); 17] {
    [
        ("orders (one event each)", r.orders.to_string()),
        ("events published", r.events_published.to_string()),
        ("deliveries to the consumers", r.deliveries.to_string()),
        ("of which duplicates", r.duplicate_deliveries.to_string()),
        (
            "duplicates skipped by the inbox",
            r.duplicate_skips.to_string(),
        ),
        ("events published again (relay)", r.republishes.to_string()),
        ("retries (consumer + effects)", r.retries.to_string()),
        (
            "conflicting deliveries refused",
            r.idempotency_conflicts.to_string(),
        ),
        ("dead letters (with reasons)", r.dead_letters.to_string()),
        ("settlements", r.settlements.to_string()),
        ("points awards", r.points_awards.to_string()),
        (
            "effect attempts (same key each)",
            r.effect_attempts.to_string(),
        ),
        ("crash points fired", joined(&r.crash_points_fired)),
        ("component restarts", joined(&r.restarts)),
        ("lost effects", r.lost.to_string()),
        ("duplicate effects", r.duplicate_effects.to_string()),
        (
            "verification",
            if r.verify.clean {
                "clean"
            } else {
                "VIOLATIONS"
            }
            .to_owned(),
        ),
    ]
}

/// Prints the report for a person.
pub(super) fn print_report(r: &DemoReport) {
    println!();
    println!(
        "idem demo: {}",
        if r.ok {
            "OK: every effect happened once"
        } else {
            "FAILED"
        }
    );
    println!("  {} in {:.1} s", r.databases, r.seconds);
    for (k, v) in rows(r) {
        println!("  {k:<34} {v}");
    }
    if !r.verify.clean {
        println!();
        print!("{}", r.verify.table());
    }
    for f in &r.failures {
        println!("  FAILED: {f}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clean_run_passes_and_each_shortfall_is_named() {
        let fired = BTreeMap::from([("a".to_owned(), 3), ("b".to_owned(), 5)]);
        let clean = Evidence {
            verify_clean: true,
            fired: &fired,
            duplicate_deliveries: 7,
            conflicts_counted: 3,
        };
        assert_eq!(verdict(&clean, 3, 3), vec![]);
        let short = BTreeMap::from([("a".to_owned(), 2), ("b".to_owned(), 5)]);
        let bad = Evidence {
            verify_clean: false,
            fired: &short,
            duplicate_deliveries: 0,
            conflicts_counted: 2,
        };
        assert_eq!(
            verdict(&bad, 3, 3),
            vec![
                Failure::Violations,
                Failure::CrashPointShort {
                    point: "a".to_owned(),
                    fired: 2,
                    target: 3
                },
                Failure::NoDuplicateDelivery,
                Failure::ConflictsUncounted {
                    sent: 3,
                    counted: 2
                },
            ]
        );
    }

    #[test]
    fn failures_serialise_as_their_sentences() {
        let f = [
            Failure::CrashPointShort {
                point: "relay.after_publish".to_owned(),
                fired: 1,
                target: 3,
            },
            Failure::ConflictsUncounted {
                sent: 3,
                counted: 2,
            },
        ];
        assert_eq!(
            serde_json::to_value(f).unwrap(),
            serde_json::json!([
                "crash point relay.after_publish fired 1 times, fewer than 3",
                "3 conflicting copies were sent but 2 idempotency conflicts were counted"
            ])
        );
        assert_eq!(
            Failure::NoDuplicateDelivery.to_string(),
            "no duplicate delivery happened: the run proves nothing"
        );
    }
}
