//! What `idem verify --watch` exports. Every run replaces the previous findings (a series that
//! the run no longer produces is removed), and a run that could not verify says so
//! (`idem_reconciliation_up` 0, the gap series removed) instead of leaving the last result up.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use prometheus::{Gauge, IntGauge, IntGaugeVec, Opts, Registry};

use crate::VerifyError;
use crate::report::Report;

/// The labels of one gap series: check, event type, kind.
pub(crate) type GapLabels = [String; 3];

/// The gap series of `report`: per check and event type, every kind of violation that
/// [`crate::report::TypeTotals::violations`] counts — `missing`, `unexpected`, `duplicate`,
/// `amount`, `currency`, `duplicate_source` (keys repeated in the source) and `sum` (the absolute
/// difference of the source and target sums) — `duplicate` for each `[[unique]]` check and
/// `rows` for each `[[empty]]` check (event type empty). Values saturate at `i64::MAX`.
pub fn gap_values(report: &Report) -> BTreeMap<GapLabels, i64> {
    let sat = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let mut out = BTreeMap::new();
    for c in &report.checks {
        for t in &c.by_event_type {
            let sum_gap = (t.source_sum - t.target_sum).unsigned_abs();
            for (kind, v) in [
                ("missing", sat(t.missing)),
                ("unexpected", sat(t.unexpected)),
                ("duplicate", sat(t.duplicate_effects)),
                ("amount", sat(t.amount_mismatches)),
                ("currency", sat(t.currency_mismatches)),
                ("duplicate_source", sat(t.duplicate_source_keys)),
                ("sum", i64::try_from(sum_gap).unwrap_or(i64::MAX)),
            ] {
                let labels = [c.name.clone(), t.event_type.clone(), kind.to_owned()];
                out.insert(labels, v);
            }
        }
    }
    for u in &report.unique {
        let labels = [u.name.clone(), String::new(), "duplicate".to_owned()];
        out.insert(labels, sat(u.duplicated_keys));
    }
    for e in &report.empty {
        let labels = [e.name.clone(), String::new(), "rows".to_owned()];
        out.insert(labels, sat(e.rows));
    }
    out
}

fn registration(what: &'static str) -> impl Fn(prometheus::Error) -> VerifyError {
    move |source| VerifyError::Metrics { what, source }
}

/// `idem_reconciliation_gap{check,event_type,kind}`: the findings of the last successful run.
#[derive(Clone)]
pub struct GapGauge {
    gauge: IntGaugeVec,
    /// The series the last run set, so that the next run can remove the ones it no longer sets.
    exported: Arc<Mutex<BTreeSet<GapLabels>>>,
}

impl std::fmt::Debug for GapGauge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GapGauge").finish_non_exhaustive()
    }
}

impl GapGauge {
    /// Creates and registers the gauge.
    pub fn new(registry: &Registry) -> Result<Self, VerifyError> {
        let gauge = IntGaugeVec::new(
            Opts::new(
                "idem_reconciliation_gap",
                "Source facts without exactly one matching effect, by kind: missing (lost or in flight), unexpected, duplicate, amount and currency (mismatched keys), duplicate_source (keys repeated in the source), sum (difference of the sums).",
            ),
            &["check", "event_type", "kind"],
        )
        .map_err(registration("the gap gauge"))?;
        registry
            .register(Box::new(gauge.clone()))
            .map_err(registration("the gap gauge"))?;
        Ok(GapGauge {
            gauge,
            exported: Arc::default(),
        })
    }

    /// Replaces the exported findings with `report`'s: series the report does not produce (an
    /// event type that disappeared) are removed, the others set, without a moment at which a
    /// scrape would see no series.
    pub fn set(&self, report: &Report) {
        self.replace(gap_values(report));
    }

    /// Removes every series: the last findings are not current any more.
    pub fn clear(&self) {
        self.replace(BTreeMap::new());
    }

    fn replace(&self, values: BTreeMap<GapLabels, i64>) {
        let mut exported = self.exported.lock().unwrap_or_else(|e| e.into_inner());
        for (labels, v) in &values {
            self.gauge.with_label_values(labels).set(*v);
        }
        for gone in exported.iter().filter(|l| !values.contains_key(*l)) {
            // Err means the series is not there: nothing to remove.
            let _ = self.gauge.remove_label_values(gone);
        }
        *exported = values.into_keys().collect();
    }
}

/// Everything `idem verify --watch` exports: the gap gauge, `idem_reconciliation_up` (1 after
/// a run that verified, 0 after one that could not) and
/// `idem_reconciliation_last_success_timestamp_seconds` (Unix time of the last run that
/// verified, clean or not).
#[derive(Clone)]
pub struct WatchMetrics {
    gap: GapGauge,
    up: IntGauge,
    last_success: Gauge,
}

impl std::fmt::Debug for WatchMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchMetrics")
            .field("up", &self.up.get())
            .finish_non_exhaustive()
    }
}

impl WatchMetrics {
    /// Creates and registers the metrics.
    pub fn new(registry: &Registry) -> Result<Self, VerifyError> {
        let up = IntGauge::new(
            "idem_reconciliation_up",
            "1 if the last verification run could read every side, 0 if it failed (a database refused, a query failed): the gap gauge then says nothing.",
        )
        .map_err(registration("idem_reconciliation_up"))?;
        let last_success = Gauge::new(
            "idem_reconciliation_last_success_timestamp_seconds",
            "Unix time at which the last verification run that could read every side ended (clean or not).",
        )
        .map_err(registration("the last-success gauge"))?;
        for m in [
            Box::new(up.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(last_success.clone()),
        ] {
            registry
                .register(m)
                .map_err(registration("a verify gauge"))?;
        }
        Ok(WatchMetrics {
            gap: GapGauge::new(registry)?,
            up,
            last_success,
        })
    }

    /// A run verified: its findings replace the previous ones; `now` is Unix seconds.
    pub fn verified(&self, report: &Report, now: f64) {
        self.gap.set(report);
        self.last_success.set(now);
        self.up.set(1);
    }

    /// A run could not verify: up 0 and no gap series (no answer is not a zero). The last
    /// success time stays.
    pub fn failed(&self) {
        self.up.set(0);
        self.gap.clear();
    }
}
