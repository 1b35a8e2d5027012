//! Consumer metrics. Labels: topic, consumer_group, event_type, aggregate_type; never ids.
//!
//! `event_type` and `aggregate_type` are read from record headers, which any producer on the
//! topic writes: they are bounded ([`ConsumerMetrics::labels`]), so a foreign producer cannot
//! make one series per value it sends.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

use std::time::Duration;

use idem_core::{Error, Result};

use crate::batch::Counts;

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
    /// `idem_consumer_stalled_since_seconds{topic,consumer_group}`: the Unix time at which the
    /// batch being retried first failed transiently, 0 while batches commit. A transient failure
    /// never dead-letters: the batch backs off and is retried until it commits, and this gauge
    /// says for how long the topic's events have stood still.
    pub stalled_since: IntGaugeVec,
    /// `idem_consumer_replays_total{consumer_group,outcome}`: requested dead-letter replays this
    /// consumer served (`applied`, `already_applied`, `failed`, `undecodable`).
    pub replays: IntCounterVec,
    /// Topics the lag gauge has shown, so a topic whose partitions were all revoked drops to 0.
    lag_topics: Arc<Mutex<BTreeSet<String>>>,
    /// The (event_type, aggregate_type) pairs given a series of their own so far.
    label_pairs: Arc<Mutex<HashSet<(String, String)>>>,
}

/// Most distinct (event_type, aggregate_type) label pairs one consumer exports; the events of
/// any further pair, and those whose header values are not valid names, are counted under
/// [`OTHER`].
pub const MAX_LABEL_PAIRS: usize = 100;

/// The `event_type` and `aggregate_type` label value of events past [`MAX_LABEL_PAIRS`] or
/// with a header value that is not a valid name (the outbox's name rules).
pub const OTHER: &str = "other";

const LABELS: &[&str] = &["topic", "consumer_group", "event_type", "aggregate_type"];

fn vec(name: &str, help: &str) -> Result<IntCounterVec> {
    IntCounterVec::new(Opts::new(name, help), LABELS).map_err(reg_err)
}

impl ConsumerMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &Registry) -> Result<Self> {
        let m = Self::unregistered()?;
        m.register(registry)?;
        Ok(m)
    }

    /// Creates the metrics without registering them anywhere: a consumer built without a
    /// registry counts into these, and nothing exports them.
    pub fn unregistered() -> Result<Self> {
        Ok(ConsumerMetrics {
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
            stalled_since: IntGaugeVec::new(
                Opts::new(
                    "idem_consumer_stalled_since_seconds",
                    "Unix time at which the batch being retried first failed transiently; 0 while batches commit.",
                ),
                &["topic", "consumer_group"],
            )
            .map_err(reg_err)?,
            replays: IntCounterVec::new(
                Opts::new(
                    "idem_consumer_replays_total",
                    "Requested dead-letter replays served through the handler, by outcome.",
                ),
                &["consumer_group", "outcome"],
            )
            .map_err(reg_err)?,
            lag_topics: Arc::default(),
            label_pairs: Arc::default(),
        })
    }

    /// Registers every metric in `registry`; fails when one of the names is registered there
    /// already (by another consumer, for instance).
    pub fn register(&self, registry: &Registry) -> Result<()> {
        let m = self;
        for c in [
            &m.processed,
            &m.duplicate_deliveries,
            &m.duplicate_skips,
            &m.conflicts,
            &m.retries,
            &m.dead_lettered,
            &m.replays,
        ] {
            registry.register(Box::new(c.clone())).map_err(reg_err)?;
        }
        registry
            .register(Box::new(m.offset_commit_failures.clone()))
            .map_err(reg_err)?;
        registry
            .register(Box::new(m.publish_to_processed.clone()))
            .map_err(reg_err)?;
        for g in [&m.lag, &m.stalled_since] {
            registry.register(Box::new(g.clone())).map_err(reg_err)?;
        }
        Ok(())
    }

    /// Adds what the events (or records) of a committed batch under `labels` count as, once
    /// per series; `waited`: from each applied event's record timestamp to the commit. Only
    /// series with something to add are touched.
    pub(crate) fn count(&self, labels: &[String; 4], c: Counts, waited: &[Duration]) {
        for (v, n) in [
            (&self.processed, c.processed),
            (&self.dead_lettered, c.dead_lettered),
            (&self.conflicts, c.conflicts),
            (&self.duplicate_deliveries, c.duplicate_deliveries),
            (&self.duplicate_skips, c.duplicate_skips),
        ] {
            if n > 0 {
                v.with_label_values(labels).inc_by(n);
            }
        }
        if !waited.is_empty() {
            let h = self.publish_to_processed.with_label_values(labels);
            for w in waited {
                h.observe(w.as_secs_f64());
            }
        }
    }

    /// The label values (topic, consumer_group, event_type, aggregate_type) for an event whose
    /// headers said `event_type` and `aggregate_type`. Header values are a foreign producer's
    /// input: a value that is not a valid name (ASCII letters, digits, `.`, `_`, `-`, as the
    /// outbox requires) becomes [`OTHER`], and so do the pairs beyond the first
    /// [`MAX_LABEL_PAIRS`] this consumer has seen. An absent value stays empty.
    pub fn labels(
        &self,
        topic: &str,
        group: &str,
        event_type: &str,
        aggregate_type: &str,
    ) -> [String; 4] {
        let (event_type, aggregate_type) = self.bounded_pair(event_type, aggregate_type);
        [
            topic.to_owned(),
            group.to_owned(),
            event_type,
            aggregate_type,
        ]
    }

    fn bounded_pair(&self, event_type: &str, aggregate_type: &str) -> (String, String) {
        let named = |s: &str, ok: bool| if ok { s.to_owned() } else { OTHER.to_owned() };
        let pair = (
            named(
                event_type,
                event_type.is_empty() || idem_core::event::validate_event_type(event_type).is_ok(),
            ),
            named(
                aggregate_type,
                aggregate_type.is_empty()
                    || idem_core::event::validate_aggregate_type(aggregate_type).is_ok(),
            ),
        );
        let mut seen = self.label_pairs.lock().unwrap_or_else(|p| p.into_inner());
        if seen.contains(&pair) || seen.len() < MAX_LABEL_PAIRS {
            seen.insert(pair.clone());
            pair
        } else {
            (OTHER.to_owned(), OTHER.to_owned())
        }
    }

    /// Marks the batch's topics as stalled since `since` (Unix seconds), unless they already
    /// are.
    pub(crate) fn set_stalled(&self, group: &str, topics: &BTreeSet<&str>, since: i64) {
        for topic in topics {
            let g = self.stalled_since.with_label_values(&[*topic, group]);
            if g.get() == 0 {
                g.set(since);
            }
        }
    }

    /// Marks the batch's topics as flowing again.
    pub(crate) fn clear_stalled(&self, group: &str, topics: &BTreeSet<&str>) {
        for topic in topics {
            self.stalled_since
                .with_label_values(&[*topic, group])
                .set(0);
        }
    }

    /// Sets `idem_consumer_lag` from a [`idem_core::store::LagProbe`] reading: the topics it lists get
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

impl std::fmt::Debug for ConsumerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerMetrics")
            .field("processed", &total(&self.processed))
            .field("duplicate_deliveries", &total(&self.duplicate_deliveries))
            .field("duplicate_skips", &total(&self.duplicate_skips))
            .field("conflicts", &total(&self.conflicts))
            .field("retries", &total(&self.retries))
            .field("dead_lettered", &total(&self.dead_lettered))
            .field("offset_commit_failures", &self.offset_commit_failures.get())
            .finish_non_exhaustive()
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
    Error::setup("registering consumer metrics", e)
}
