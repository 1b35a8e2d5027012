//! What `idem verify --watch` exports: every kind of violation, reset on every run, so that a
//! finding that went away (or an event type that disappeared) does not keep its old value.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_verify::report::{CheckReport, TypeTotals, UniqueReport};
use idem_verify::{GapGauge, Report};
use prometheus::Registry;

fn gauge_values(registry: &Registry) -> Vec<(String, String, String, f64)> {
    let mut out = Vec::new();
    for family in registry.gather() {
        if family.name() != "idem_reconciliation_gap" {
            continue;
        }
        for m in family.get_metric() {
            let label = |n: &str| {
                m.get_label()
                    .iter()
                    .find(|l| l.name() == n)
                    .map(|l| l.value().to_owned())
                    .unwrap_or_default()
            };
            out.push((
                label("check"),
                label("event_type"),
                label("kind"),
                m.get_gauge().get_value(),
            ));
        }
    }
    out.sort_by(|a, b| (&a.0, &a.1, &a.2).cmp(&(&b.0, &b.1, &b.2)));
    out
}

fn value(registry: &Registry, check: &str, event_type: &str, kind: &str) -> Option<f64> {
    gauge_values(registry)
        .into_iter()
        .find(|(c, t, k, _)| c == check && t == event_type && k == kind)
        .map(|v| v.3)
}

fn report(types: Vec<TypeTotals>) -> Report {
    Report {
        clean: false,
        checks: vec![CheckReport {
            name: "orders".to_owned(),
            by_event_type: types,
            ..CheckReport::default()
        }],
        unique: vec![UniqueReport {
            name: "apps".to_owned(),
            rows: 3,
            duplicated_keys: 1,
            duplicates: vec![],
        }],
        empty: vec![],
        attempts: Default::default(),
    }
}

#[test]
fn sum_gaps_and_duplicate_source_keys_are_exported() {
    let registry = Registry::new();
    let gauge = GapGauge::new(&registry).unwrap();
    // Two source rows with key k (amounts 5 and 7), one target row (amount 5): the pairwise
    // comparison sees a duplicate source key and the sums differ by 7.
    gauge.set(&report(vec![TypeTotals {
        event_type: "order.paid".to_owned(),
        source_rows: 2,
        source_sum: 12,
        target_rows: 1,
        target_sum: 5,
        duplicate_source_keys: 1,
        ..TypeTotals::default()
    }]));
    assert_eq!(
        value(&registry, "orders", "order.paid", "duplicate_source"),
        Some(1.0),
        "{:?}",
        gauge_values(&registry)
    );
    assert_eq!(
        value(&registry, "orders", "order.paid", "sum"),
        Some(7.0),
        "{:?}",
        gauge_values(&registry)
    );
    assert_eq!(value(&registry, "apps", "", "duplicate"), Some(1.0));
}

#[test]
fn every_run_replaces_the_previous_values() {
    let registry = Registry::new();
    let gauge = GapGauge::new(&registry).unwrap();
    let gap = |event_type: &str, missing| TypeTotals {
        event_type: event_type.to_owned(),
        missing,
        ..TypeTotals::default()
    };
    gauge.set(&report(vec![
        gap("order.paid", 0),
        gap("order.refunded", 3),
    ]));
    assert_eq!(
        value(&registry, "orders", "order.refunded", "missing"),
        Some(3.0)
    );
    // The next run no longer sees order.refunded at all (its rows were archived, or the check
    // was renamed): its series must go, not stay at 3 forever.
    gauge.set(&report(vec![gap("order.paid", 2)]));
    assert_eq!(
        value(&registry, "orders", "order.paid", "missing"),
        Some(2.0)
    );
    assert_eq!(
        value(&registry, "orders", "order.refunded", "missing"),
        None,
        "{:?}",
        gauge_values(&registry)
    );
}
