//! Relay metrics. Names are stable; labels are bounded (topic, event type, aggregate type).

use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

use idem_core::{Error, Result};

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
    /// `idem_outbox_pruned_total`: published rows deleted or archived.
    pub pruned: IntCounter,
    /// `idem_outbox_relay_errors_total`: failed cycles (database or broker errors).
    pub errors: IntCounter,
    /// `idem_outbox_pending`: pending rows at the last status refresh.
    pub pending: IntGauge,
    /// `idem_outbox_parked`: parked rows at the last status refresh.
    pub parked_rows: IntGauge,
    /// `idem_outbox_oldest_pending_age_seconds`: age of the oldest pending row.
    pub oldest_pending_age: Gauge,
    /// `idem_outbox_batch_seconds`: claim → publish → mark cycle duration.
    pub batch_seconds: Histogram,
}

const LABELS: &[&str] = &["topic", "event_type", "aggregate_type"];

impl RelayMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &Registry) -> Result<Self> {
        let m = RelayMetrics {
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
            pruned: IntCounter::new("idem_outbox_pruned_total", "Published rows deleted or archived.").map_err(reg_err)?,
            errors: IntCounter::new("idem_outbox_relay_errors_total", "Relay cycles that failed and were retried.")
                .map_err(reg_err)?,
            pending: IntGauge::new("idem_outbox_pending", "Pending outbox rows.").map_err(reg_err)?,
            parked_rows: IntGauge::new("idem_outbox_parked", "Parked outbox rows.").map_err(reg_err)?,
            oldest_pending_age: Gauge::new(
                "idem_outbox_oldest_pending_age_seconds",
                "Age of the oldest pending outbox row.",
            )
            .map_err(reg_err)?,
            batch_seconds: Histogram::with_opts(
                HistogramOpts::new("idem_outbox_batch_seconds", "Duration of one claim, publish and mark cycle.")
                    .buckets(vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]),
            )
            .map_err(reg_err)?,
        };
        for c in [&m.published, &m.republished, &m.parked] {
            registry.register(Box::new(c.clone())).map_err(reg_err)?;
        }
        registry
            .register(Box::new(m.failures.clone()))
            .map_err(reg_err)?;
        for c in [&m.lease_lost, &m.pruned, &m.errors] {
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
        Ok(m)
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

fn sum(v: &IntCounterVec) -> u64 {
    use prometheus::core::Collector;
    v.collect()
        .iter()
        .flat_map(|mf| {
            mf.get_metric()
                .iter()
                .map(|m| m.get_counter().get_value() as u64)
                .collect::<Vec<_>>()
        })
        .sum()
}

fn reg_err(e: prometheus::Error) -> Error {
    Error::Config(format!("registering relay metrics: {e}"))
}
