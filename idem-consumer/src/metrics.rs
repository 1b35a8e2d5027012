//! Consumer metrics. Labels: topic, consumer_group, event_type, aggregate_type; never ids.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

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
    /// `idem_consumer_publish_to_processed_seconds{topic,consumer_group,event_type,aggregate_type}`:
    /// for each event applied, the time from the Kafka record's timestamp (set when the relay's
    /// producer sent it) to the commit of the transaction that applied it. Duplicates skipped
    /// and dead letters are not observed; neither are records without a timestamp.
    pub publish_to_processed: HistogramVec,
    /// `idem_consumer_lag{topic,consumer_group}`: records between this member's position and the
    /// high watermark, summed over its assigned partitions; refreshed every
    /// `ConsumerConfig::lag_interval` while the consumer runs (also while it waits or retries).
    /// Each member of a group exports its own share: sum over instances.
    pub lag: IntGaugeVec,
    /// Topics the lag gauge has shown, so a topic whose partitions were all revoked drops to 0.
    lag_topics: Arc<Mutex<BTreeSet<String>>>,
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
            publish_to_processed: HistogramVec::new(
                HistogramOpts::new(
                    "idem_consumer_publish_to_processed_seconds",
                    "Time from a Kafka record's timestamp to the commit that applied its event.",
                )
                .buckets(idem_core::metrics::LATENCY_BUCKETS.to_vec()),
                LABELS,
            )
            .map_err(reg_err)?,
            lag: IntGaugeVec::new(
                Opts::new(
                    "idem_consumer_lag",
                    "Records between this group member's position and the high watermark, over its assigned partitions.",
                ),
                &["topic", "consumer_group"],
            )
            .map_err(reg_err)?,
            lag_topics: Arc::default(),
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
        registry
            .register(Box::new(m.publish_to_processed.clone()))
            .map_err(reg_err)?;
        registry
            .register(Box::new(m.lag.clone()))
            .map_err(reg_err)?;
        Ok(m)
    }

    /// Sets `idem_consumer_lag` from a [`idem_core::LagProbe`] reading: the topics it lists get
    /// their lag, topics shown before and now absent (no partition assigned) drop to 0.
    pub fn set_lag(&self, group: &str, lags: &[(String, i64)]) {
        let mut topics = self.lag_topics.lock().unwrap_or_else(|p| p.into_inner());
        for gone in topics.iter().filter(|t| !lags.iter().any(|(l, _)| l == *t)) {
            self.lag.with_label_values(&[gone.as_str(), group]).set(0);
        }
        for (topic, lag) in lags {
            self.lag
                .with_label_values(&[topic.as_str(), group])
                .set(*lag);
            topics.insert(topic.clone());
        }
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
