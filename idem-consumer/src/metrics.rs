//! Consumer metrics. Labels: topic, consumer_group, event_type, aggregate_type; never ids.

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

use idem_core::{Error, Result};

/// Prometheus metrics of one consumer.
#[derive(Clone)]
pub struct ConsumerMetrics {
    /// `idem_consumer_processed_total`: events applied by the handler (committed).
    pub processed: IntCounterVec,
    /// `idem_duplicate_delivery_total`: copies of an event id that had been delivered before.
    pub duplicate_deliveries: IntCounterVec,
    /// `idem_duplicate_skip_total`: copies skipped by the inbox because the event was applied.
    pub duplicate_skips: IntCounterVec,
    /// `idem_idempotency_conflict_total`: copies with a known event id and a different payload.
    pub conflicts: IntCounterVec,
    /// `idem_consumer_retry_total`: transactions rolled back and retried.
    pub retries: IntCounterVec,
    /// `idem_consumer_dead_lettered_total`: records moved to the dead-letter table.
    pub dead_lettered: IntCounterVec,
    /// `idem_consumer_offset_commit_failures_total`.
    pub offset_commit_failures: IntCounter,
}

const LABELS: &[&str] = &["topic", "consumer_group", "event_type", "aggregate_type"];

fn vec(name: &str, help: &str) -> Result<IntCounterVec> {
    IntCounterVec::new(Opts::new(name, help), LABELS).map_err(reg_err)
}

impl ConsumerMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &Registry) -> Result<Self> {
        let m = ConsumerMetrics {
            processed: vec("idem_consumer_processed_total", "Events applied by the handler and committed.")?,
            duplicate_deliveries: vec(
                "idem_duplicate_delivery_total",
                "Deliveries of an event id that had been delivered before.",
            )?,
            duplicate_skips: vec(
                "idem_duplicate_skip_total",
                "Deliveries skipped by the inbox because the event had been applied.",
            )?,
            conflicts: vec(
                "idem_idempotency_conflict_total",
                "Deliveries of a known event id with a different payload (not applied).",
            )?,
            retries: vec("idem_consumer_retry_total", "Consumer transactions rolled back and retried.")?,
            dead_lettered: vec("idem_consumer_dead_lettered_total", "Records moved to the dead-letter table.")?,
            offset_commit_failures: IntCounter::new(
                "idem_consumer_offset_commit_failures_total",
                "Offset commits that failed after the database commit (the batch may come back and be skipped).",
            )
            .map_err(reg_err)?,
        };
        for c in [
            &m.processed,
            &m.duplicate_deliveries,
            &m.duplicate_skips,
            &m.conflicts,
            &m.retries,
            &m.dead_lettered,
        ] {
            registry.register(Box::new(c.clone())).map_err(reg_err)?;
        }
        registry
            .register(Box::new(m.offset_commit_failures.clone()))
            .map_err(reg_err)?;
        Ok(m)
    }
}

/// Sum of a counter vector over all labels.
pub fn total(v: &IntCounterVec) -> u64 {
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
    Error::Config(format!("registering consumer metrics: {e}"))
}
