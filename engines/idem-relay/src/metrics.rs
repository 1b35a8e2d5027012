//! Relay metrics. Names are stable; labels are bounded (topic, event type, aggregate type).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry,
};

use chrono::TimeDelta;
use idem_core::publish::FailureKind;
use idem_core::{Error, Result};

use crate::outcome::Next;

/// Prometheus metrics of one relay process.
#[derive(Clone)]
pub struct RelayMetrics {
    /// `idem_outbox_published_total{topic,event_type,aggregate_type}`: rows acknowledged by the
    /// broker in a batch that this relay then marked.
    pub published: IntCounterVec,
    /// `idem_outbox_republish_total{topic,event_type,aggregate_type}`: acknowledged rows whose
    /// attempt number was above 1, i.e. rows that an earlier attempt may already have put in
    /// Kafka. An upper bound on the duplicates the relay caused.
    pub republished: IntCounterVec,
    /// `idem_outbox_publish_failures_total{topic,event_type,aggregate_type,kind}`.
    pub failures: IntCounterVec,
    /// `idem_outbox_parked_total{topic,event_type,aggregate_type}`: rows parked by this relay.
    pub parked: IntCounterVec,
    /// `idem_outbox_lease_lost_total`: rows this relay could not mark because another relay had
    /// taken over its expired lease.
    pub lease_lost: IntCounter,
    /// `idem_outbox_abandoned_total`: claimed rows not produced because the claim left less of
    /// the lease than one publish can take ([`idem_core::publish::Publisher::longest_publish`]); they
    /// are claimed again after the lease expires.
    pub abandoned: IntCounter,
    /// `idem_outbox_pruned_total`: published rows deleted or archived.
    pub pruned: IntCounter,
    /// `idem_outbox_relay_errors_total`: failed cycles (database or broker errors).
    pub errors: IntCounter,
    /// `idem_outbox_pending{aggregate_type}`: pending rows at the last status refresh
    /// (every `status_interval`, from [`idem_core::store::OutboxStore::backlog`]). Every relay of an
    /// outbox exports the same value: aggregate with `max`, not `sum`.
    pub pending: IntGaugeVec,
    /// `idem_outbox_parked{aggregate_type}`: parked rows at the last status refresh.
    pub parked_rows: IntGaugeVec,
    /// `idem_outbox_oldest_pending_age_seconds{aggregate_type}`: age of the oldest pending row
    /// (from its `created_at`) at the last status refresh; 0 when nothing is pending.
    pub oldest_pending_age: GaugeVec,
    /// `idem_outbox_batch_seconds`: claim → publish → mark cycle duration.
    pub batch_seconds: Histogram,
    /// `idem_outbox_commit_to_publish_seconds{topic,event_type,aggregate_type}`: for each row
    /// this relay marked published, the time from its `created_at` (the writing transaction,
    /// on PostgreSQL its start) to the moment the batch's delivery reports were all in. Includes
    /// the time spent waiting in the outbox, failed attempts and backoff.
    pub commit_to_publish: HistogramVec,
    /// Aggregate types the backlog gauges have shown, so a type whose backlog drained is set
    /// to 0 instead of keeping its last value.
    seen_aggregate_types: Arc<Mutex<BTreeSet<String>>>,
}

const LABELS: &[&str] = &["topic", "event_type", "aggregate_type"];
const BACKLOG_LABELS: &[&str] = &["aggregate_type"];

impl RelayMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &Registry) -> Result<Self> {
        let m = Self::unregistered()?;
        m.register(registry)?;
        Ok(m)
    }

    /// Creates the metrics without registering them anywhere: a relay built without a
    /// registry counts into these, and nothing exports them.
    pub fn unregistered() -> Result<Self> {
        Ok(RelayMetrics {
            published: IntCounterVec::new(
                Opts::new("idem_outbox_published_total", "Outbox rows acknowledged by the broker and marked published."),
                LABELS,
            )
            .map_err(reg_err)?,
            republished: IntCounterVec::new(
                Opts::new(
                    "idem_outbox_republish_total",
                    "Acknowledged outbox rows that had been attempted before (possible duplicates in Kafka).",
                ),
                LABELS,
            )
            .map_err(reg_err)?,
            failures: IntCounterVec::new(
                Opts::new("idem_outbox_publish_failures_total", "Outbox rows the broker did not acknowledge."),
                &["topic", "event_type", "aggregate_type", "kind"],
            )
            .map_err(reg_err)?,
            parked: IntCounterVec::new(
                Opts::new("idem_outbox_parked_total", "Outbox rows parked after repeated permanent failures."),
                LABELS,
            )
            .map_err(reg_err)?,
            lease_lost: IntCounter::new(
                "idem_outbox_lease_lost_total",
                "Rows not marked because another relay took over an expired lease.",
            )
            .map_err(reg_err)?,
            abandoned: IntCounter::new(
                "idem_outbox_abandoned_total",
                "Claimed rows not produced because too little of the lease was left to publish them.",
            )
            .map_err(reg_err)?,
            pruned: IntCounter::new("idem_outbox_pruned_total", "Published rows deleted or archived.").map_err(reg_err)?,
            errors: IntCounter::new("idem_outbox_relay_errors_total", "Relay cycles that failed and were retried.")
                .map_err(reg_err)?,
            pending: IntGaugeVec::new(
                Opts::new("idem_outbox_pending", "Pending outbox rows, by aggregate type."),
                BACKLOG_LABELS,
            )
            .map_err(reg_err)?,
            parked_rows: IntGaugeVec::new(
                Opts::new("idem_outbox_parked", "Parked outbox rows, by aggregate type."),
                BACKLOG_LABELS,
            )
            .map_err(reg_err)?,
            oldest_pending_age: GaugeVec::new(
                Opts::new(
                    "idem_outbox_oldest_pending_age_seconds",
                    "Age of the oldest pending outbox row, by aggregate type (0 when none is pending).",
                ),
                BACKLOG_LABELS,
            )
            .map_err(reg_err)?,
            batch_seconds: Histogram::with_opts(
                HistogramOpts::new("idem_outbox_batch_seconds", "Duration of one claim, publish and mark cycle.")
                    .buckets(vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            )
            .map_err(reg_err)?,
            commit_to_publish: HistogramVec::new(
                HistogramOpts::new(
                    "idem_outbox_commit_to_publish_seconds",
                    "Time from an outbox row's created_at to the broker's acknowledgement of the publish that marked it.",
                )
                .buckets(idem_core::metrics::LATENCY_BUCKETS.to_vec()),
                LABELS,
            )
            .map_err(reg_err)?,
            seen_aggregate_types: Arc::default(),
        })
    }

    /// Registers every metric in `registry`; fails when one of the names is registered there
    /// already (by another relay, for instance).
    pub fn register(&self, registry: &Registry) -> Result<()> {
        let m = self;
        for c in [&m.published, &m.republished, &m.parked] {
            registry.register(Box::new(c.clone())).map_err(reg_err)?;
        }
        registry
            .register(Box::new(m.failures.clone()))
            .map_err(reg_err)?;
        for c in [&m.lease_lost, &m.abandoned, &m.pruned, &m.errors] {
            registry.register(Box::new(c.clone())).map_err(reg_err)?;
        }
        for g in [&m.pending, &m.parked_rows] {
            registry.register(Box::new(g.clone())).map_err(reg_err)?;
        }
        registry
            .register(Box::new(m.oldest_pending_age.clone()))
            .map_err(reg_err)?;
        registry
            .register(Box::new(m.batch_seconds.clone()))
            .map_err(reg_err)?;
        registry
            .register(Box::new(m.commit_to_publish.clone()))
            .map_err(reg_err)?;
        Ok(())
    }

    /// Counts a row the broker did not acknowledge (unless it was never sent) and, when it is
    /// parked, the parking. `labels`: topic, event type, aggregate type.
    pub(crate) fn count_failed(&self, labels: &[&str; 3], kind: FailureKind, next: Next) {
        if kind != FailureKind::NotSent {
            let [topic, event_type, aggregate_type] = *labels;
            self.failures
                .with_label_values(&[topic, event_type, aggregate_type, kind_label(kind)])
                .inc();
        }
        if next == Next::Park {
            self.parked.with_label_values(labels).inc();
        }
    }

    /// Counts a row marked published `waited` after its `created_at`; `republish` when it had
    /// been attempted before.
    pub(crate) fn count_published(&self, labels: &[&str; 3], waited: TimeDelta, republish: bool) {
        self.published.with_label_values(labels).inc();
        self.commit_to_publish
            .with_label_values(labels)
            .observe(waited.as_seconds_f64().max(0.0));
        if republish {
            self.republished.with_label_values(labels).inc();
        }
    }

    /// Sets the backlog gauges from a [`idem_core::store::OutboxStore::backlog`] result: types it
    /// lists get their values, types shown before and now absent drop to 0.
    pub fn set_backlog(&self, backlog: &[idem_core::store::Backlog]) {
        let mut seen = self
            .seen_aggregate_types
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for gone in seen
            .iter()
            .filter(|t| !backlog.iter().any(|b| &b.aggregate_type == *t))
        {
            self.pending.with_label_values(&[gone]).set(0);
            self.parked_rows.with_label_values(&[gone]).set(0);
            self.oldest_pending_age.with_label_values(&[gone]).set(0.0);
        }
        for b in backlog {
            let t = [b.aggregate_type.as_str()];
            self.pending.with_label_values(&t).set(b.pending);
            self.parked_rows.with_label_values(&t).set(b.parked);
            self.oldest_pending_age
                .with_label_values(&t)
                .set(b.oldest_pending_age_seconds.unwrap_or(0.0).max(0.0));
            seen.insert(b.aggregate_type.clone());
        }
    }

    /// Sum of `idem_outbox_republish_total` over all labels.
    pub fn republished_total(&self) -> u64 {
        sum(&self.republished)
    }

    /// Sum of `idem_outbox_published_total` over all labels.
    pub fn published_total(&self) -> u64 {
        sum(&self.published)
    }
}

impl std::fmt::Debug for RelayMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayMetrics")
            .field("published", &self.published_total())
            .field("republished", &self.republished_total())
            .field("lease_lost", &self.lease_lost.get())
            .field("abandoned", &self.abandoned.get())
            .field("pruned", &self.pruned.get())
            .field("errors", &self.errors.get())
            .finish_non_exhaustive()
    }
}

/// The `kind` label of `idem_outbox_publish_failures_total`.
fn kind_label(kind: FailureKind) -> &'static str {
    match kind {
        FailureKind::Transient => "transient",
        FailureKind::Permanent => "permanent",
        FailureKind::NotSent => "not_sent",
        FailureKind::Unwritable => "unwritable",
    }
}

fn sum(v: &IntCounterVec) -> u64 {
    use prometheus::core::Collector;
    v.collect()
        .iter()
        .flat_map(|mf| {
            mf.get_metric()
                .iter()
                .map(|m| whole(m.get_counter().get_value()))
                .collect::<Vec<_>>()
        })
        .sum()
}

/// An integer counter's value, which the exposition format carries as a whole, non-negative
/// `f64`.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "an IntCounter only holds whole non-negative values below 2^53"
)]
fn whole(value: f64) -> u64 {
    value as u64
}

fn reg_err(e: prometheus::Error) -> Error {
    Error::setup("registering relay metrics", e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registering_twice_is_a_setup_error_of_the_config_kind() {
        let registry = Registry::new();
        assert!(RelayMetrics::new(&registry).is_ok());
        let again = RelayMetrics::new(&registry).map(|_| ()).unwrap_err();
        assert!(matches!(again, Error::Setup { .. }), "{again:?}");
        assert_eq!(again.kind(), idem_core::ErrorKind::Config);
        assert!(
            again.to_string().starts_with("registering relay metrics: "),
            "{again}"
        );
    }
}
