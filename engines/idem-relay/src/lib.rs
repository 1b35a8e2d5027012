#![doc = include_str!("../README.md")]

mod metrics;

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::time::{Duration, Instant};

use idem_core::crash::{self, RELAY_AFTER_CLAIM_BEFORE_PUBLISH, RELAY_AFTER_PUBLISH_BEFORE_MARK};
use idem_core::event::validate_topic;
use idem_core::outbox::{ClaimRequest, Completed, Failure, OutboxRecord, Outcome, PrunePolicy};
use idem_core::publish::{FailureKind, Message, PublishError, Publisher};
use idem_core::{Error, OutboxStore, Result};

pub use metrics::RelayMetrics;

/// Default topic prefix, Debezium's outbox convention: `outbox.event.<aggregate_type>`.
pub const DEFAULT_TOPIC_PREFIX: &str = "outbox.event.";

/// How the relay names topics.
#[derive(Clone, Debug)]
pub struct TopicNaming {
    /// Prefix put before the aggregate type.
    pub prefix: String,
    /// Per aggregate type, a topic that replaces `<prefix><aggregate_type>`.
    pub overrides: BTreeMap<String, String>,
}

impl Default for TopicNaming {
    fn default() -> Self {
        TopicNaming {
            prefix: DEFAULT_TOPIC_PREFIX.to_owned(),
            overrides: BTreeMap::new(),
        }
    }
}

impl TopicNaming {
    /// The topic of `record`: its own override, else the aggregate type's override, else
    /// `<prefix><aggregate_type>`.
    pub fn topic_for(&self, record: &OutboxRecord) -> String {
        if let Some(t) = &record.topic {
            return t.clone();
        }
        if let Some(t) = self.overrides.get(&record.aggregate_type) {
            return t.clone();
        }
        format!("{}{}", self.prefix, record.aggregate_type)
    }
}

/// Relay settings. [`RelayConfig::default`] is what `idem relay` uses.
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// Shown in `claimed_by`; unique per process by default.
    pub relay_id: String,
    /// Rows per claim.
    pub batch_size: u32,
    /// How long a claim is exclusive. Longer than the producer's message timeout, so a live
    /// relay always finishes before its lease ends.
    pub lease: Duration,
    /// First idle poll interval; doubles while the outbox stays empty.
    pub idle_poll_min: Duration,
    /// Longest idle poll interval: the worst added latency when idle.
    pub idle_poll_max: Duration,
    /// Permanent failures (too large, invalid topic, …) before a row is parked. Transient
    /// failures never park a row.
    pub max_attempts: i32,
    /// Backoff after the first failed attempt; doubles per attempt.
    pub retry_backoff: Duration,
    /// Longest backoff.
    pub retry_backoff_max: Duration,
    /// Topic naming.
    pub topics: TopicNaming,
    /// `ce_source`; `None` means `/idem/<aggregate_type>`.
    pub source: Option<String>,
    /// Prune published rows every `.0` with policy `.1`; `None` disables pruning.
    pub prune: Option<(Duration, PrunePolicy)>,
    /// How often the pending/parked gauges are refreshed.
    pub status_interval: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            relay_id: default_relay_id(),
            batch_size: 500,
            lease: Duration::from_secs(60),
            idle_poll_min: Duration::from_millis(1),
            idle_poll_max: Duration::from_millis(20),
            max_attempts: 5,
            retry_backoff: Duration::from_millis(500),
            retry_backoff_max: Duration::from_secs(60),
            topics: TopicNaming::default(),
            source: None,
            prune: Some((Duration::from_secs(60), PrunePolicy::default())),
            status_interval: Duration::from_secs(10),
        }
    }
}

/// The last instant at which a batch claimed no earlier than `started` may still be produced:
/// the lease (which the database started after `started`) must outlast the longest publish.
/// A publisher that cannot bound a publish gets 90% of the lease for the claim.
fn produce_deadline(
    started: Instant,
    lease: Duration,
    longest_publish: Option<Duration>,
) -> Instant {
    match longest_publish {
        Some(publish) => started + lease.saturating_sub(publish),
        None => started + lease.mul_f64(0.9),
    }
}

/// `relay-<pid>-<random>`.
pub fn default_relay_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("relay-{}-{:08x}", std::process::id(), nanos)
}

/// What one claim–publish–mark cycle did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows acknowledged by the broker and marked published.
    pub published: u64,
    /// Of those, rows that had been attempted before (republishes).
    pub republished: u64,
    /// Rows released for a later attempt.
    pub retried: u64,
    /// Rows parked.
    pub parked: u64,
    /// Rows whose lease had been taken over by another relay: left untouched.
    pub fenced: u64,
}

/// The relay: claims outbox rows, publishes them, waits for every delivery report, marks them.
pub struct Relay<S, P> {
    store: S,
    publisher: P,
    config: RelayConfig,
    metrics: RelayMetrics,
    /// Highest id marked published (used only by the `id-watermark` negative control).
    watermark: std::sync::atomic::AtomicI64,
}

impl<S: OutboxStore, P: Publisher> Relay<S, P> {
    /// A relay over `store` and `publisher`.
    pub fn new(store: S, publisher: P, config: RelayConfig, metrics: RelayMetrics) -> Self {
        Relay {
            store,
            publisher,
            config,
            metrics,
            watermark: std::sync::atomic::AtomicI64::new(0),
        }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The metrics.
    pub fn metrics(&self) -> &RelayMetrics {
        &self.metrics
    }

    /// Runs one claim–publish–mark cycle.
    ///
    /// Duplicate windows, and what closes them:
    /// * crash after the claim, before producing: the lease expires, the rows are claimed
    ///   again with the next attempt number; nothing reached Kafka, nothing is duplicated.
    /// * crash after the broker acknowledged, before the mark commits: the rows are published
    ///   again after the lease expires. The copy in Kafka is a duplicate, counted by
    ///   `idem_outbox_republish_total` and absorbed by the consumer's inbox (same `ce_id`).
    /// * a relay paused past its lease: another relay takes the rows over; the paused relay's
    ///   mark is fenced by the claim id and changes nothing (`idem_outbox_lease_lost_total`).
    pub async fn run_once(&self) -> Result<BatchReport> {
        let started = Instant::now();
        let claim = self
            .store
            .claim(&ClaimRequest {
                relay_id: self.config.relay_id.clone(),
                batch_size: self.config.batch_size,
                lease: self.config.lease,
            })
            .await?;
        let mut report = BatchReport {
            claimed: claim.records.len() + claim.corrupt.len(),
            ..BatchReport::default()
        };
        if report.claimed == 0 {
            return Ok(report);
        }
        // Negative controls (chaos runs only): see `idem_core::crash::BREAKABLE`.
        let kept: Vec<OutboxRecord>;
        let records: &[OutboxRecord] = if crash::broken(crash::BREAK_ID_WATERMARK) {
            let mark = self.watermark.load(std::sync::atomic::Ordering::Relaxed);
            let (below, above): (Vec<_>, Vec<_>) =
                claim.records.iter().cloned().partition(|r| r.id < mark);
            let skipped = Outcome {
                published: below.iter().map(|r| r.id).collect(),
                failed: vec![],
            };
            self.store.complete(&claim, &skipped).await?;
            kept = above;
            &kept
        } else {
            &claim.records
        };
        if crash::broken(crash::BREAK_MARK_BEFORE_REPORT) {
            let early = Outcome {
                published: records.iter().map(|r| r.id).collect(),
                failed: vec![],
            };
            self.store.complete(&claim, &early).await?;
        }
        crash::crash_point(RELAY_AFTER_CLAIM_BEFORE_PUBLISH)?;

        let topics: Vec<String> = records
            .iter()
            .map(|r| self.config.topics.topic_for(r))
            .collect();
        // Rows with an unusable topic are never handed to the broker.
        let mut results: Vec<Option<std::result::Result<(), PublishError>>> =
            vec![None; records.len()];
        let mut messages = Vec::with_capacity(records.len());
        let mut sent_index = Vec::with_capacity(records.len());
        for (i, (r, topic)) in records.iter().zip(&topics).enumerate() {
            match validate_topic(topic) {
                Ok(()) => {
                    messages.push(self.message(r, topic));
                    sent_index.push(i);
                }
                Err(reason) => {
                    results[i] = Some(Err(PublishError {
                        kind: FailureKind::Permanent,
                        reason,
                    }))
                }
            }
        }
        if Instant::now()
            >= produce_deadline(started, self.config.lease, self.publisher.longest_publish())
        {
            // The lease could end while the batch is still being produced, and another relay
            // could then publish the same rows: produce nothing, let the lease expire.
            tracing::warn!(relay = %self.config.relay_id, "the claim left too little of the lease to publish the batch; abandoning it");
            self.metrics.abandoned.inc_by(records.len() as u64);
            return Ok(report);
        }
        let delivered = self.publisher.publish(&messages).await;
        let reported_at = chrono::Utc::now();
        for (i, res) in sent_index.into_iter().zip(delivered) {
            results[i] = Some(res);
        }
        crash::crash_point(RELAY_AFTER_PUBLISH_BEFORE_MARK)?;

        // Mark, per aggregate, only the prefix of rows before the first failure: a later row
        // must not be recorded as published while an earlier one of its aggregate is not.
        let mut outcome = Outcome::default();
        for (id, reason) in &claim.corrupt {
            tracing::error!(row = id, %reason, "parking an outbox row that cannot be decoded");
            outcome.failed.push(Failure {
                id: *id,
                reason: reason.clone(),
                backoff: Duration::ZERO,
                park: true,
                permanent: true,
                attempted: true,
            });
        }
        // Labels of rows to count as published once the mark has committed.
        let mut acked: Vec<([&str; 3], &OutboxRecord)> = Vec::with_capacity(records.len());
        let mut blocked: HashSet<(&str, &str)> = HashSet::new();
        for ((r, topic), res) in records.iter().zip(&topics).zip(results) {
            let key = (r.aggregate_type.as_str(), r.aggregate_id.as_str());
            let res = res.unwrap_or_else(|| {
                Err(PublishError {
                    kind: FailureKind::Transient,
                    reason: "the publisher returned no delivery report".to_owned(),
                })
            });
            let labels = [
                topic.as_str(),
                r.event_type.as_str(),
                r.aggregate_type.as_str(),
            ];
            match res {
                Ok(()) if !blocked.contains(&key) => {
                    outcome.published.push(r.id);
                    acked.push((labels, r));
                }
                Ok(()) => {
                    outcome.failed.push(Failure {
                        id: r.id,
                        reason: "delivered, but an earlier event of the aggregate failed; will be published again after it".to_owned(),
                        backoff: Duration::ZERO,
                        park: false,
                        permanent: false,
                        attempted: true,
                    });
                }
                Err(e) => {
                    blocked.insert(key);
                    let attempted = e.kind != FailureKind::NotSent;
                    let permanent = e.kind == FailureKind::Permanent;
                    // Only permanent failures count towards parking: a broker outage never parks.
                    let park = permanent
                        && r.permanent_failures + 1 >= self.config.max_attempts
                        && !crash::broken(crash::BREAK_NEVER_PARK);
                    let kind = match e.kind {
                        FailureKind::Transient => "transient",
                        FailureKind::Permanent => "permanent",
                        FailureKind::NotSent => "not_sent",
                    };
                    if attempted {
                        self.metrics
                            .failures
                            .with_label_values(&[labels[0], labels[1], labels[2], kind])
                            .inc();
                    }
                    if park {
                        self.metrics.parked.with_label_values(&labels).inc();
                        tracing::error!(event_id = %r.event_id, reason = %e.reason, attempts = r.attempt, "parking outbox row");
                    } else {
                        tracing::warn!(event_id = %r.event_id, reason = %e.reason, attempt = r.attempt, "publish failed; will retry");
                    }
                    outcome.failed.push(Failure {
                        id: r.id,
                        reason: e.reason,
                        backoff: if attempted {
                            self.backoff(r.attempt)
                        } else {
                            Duration::ZERO
                        },
                        park,
                        permanent,
                        attempted,
                    });
                }
            }
        }
        let Completed {
            marked,
            released,
            fenced,
        } = self.store.complete(&claim, &outcome).await?;
        report.published = marked;
        if let Some(max) = outcome.published.iter().max() {
            self.watermark
                .fetch_max(*max, std::sync::atomic::Ordering::Relaxed);
        }
        // Counted only for a mark that committed for the whole claim; fenced rows belong to
        // the relay that took the lease over, which counts them.
        if fenced == 0 {
            for (labels, r) in acked {
                self.metrics.published.with_label_values(&labels).inc();
                let waited = (reported_at - r.created_at)
                    .num_microseconds()
                    .unwrap_or(i64::MAX);
                self.metrics
                    .commit_to_publish
                    .with_label_values(&labels)
                    .observe((waited as f64 / 1e6).max(0.0));
                if r.attempt > 1 {
                    self.metrics.republished.with_label_values(&labels).inc();
                    report.republished += 1;
                }
            }
        }
        report.parked = outcome.failed.iter().filter(|f| f.park).count() as u64;
        report.retried = released.saturating_sub(report.parked);
        report.fenced = fenced;
        if fenced > 0 {
            self.metrics.lease_lost.inc_by(fenced);
            tracing::warn!(relay = %self.config.relay_id, fenced, "lease lost: another relay took these rows over");
        }
        self.metrics
            .batch_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(report)
    }

    fn backoff(&self, attempt: i32) -> Duration {
        let exp = u32::try_from(attempt.saturating_sub(1))
            .unwrap_or(0)
            .min(20);
        self.config
            .retry_backoff
            .saturating_mul(1u32 << exp)
            .min(self.config.retry_backoff_max)
    }

    fn message(&self, r: &OutboxRecord, topic: &str) -> Message {
        let mut headers: Vec<(String, String)> = Vec::with_capacity(12 + r.headers.len());
        let h = |k: &str, v: String| (k.to_owned(), v);
        headers.push(h("ce_specversion", "1.0".to_owned()));
        headers.push(h("ce_id", r.event_id.to_string()));
        headers.push(h("ce_type", r.event_type.clone()));
        headers.push(h(
            "ce_source",
            self.config
                .source
                .clone()
                .unwrap_or_else(|| format!("/idem/{}", r.aggregate_type)),
        ));
        headers.push(h(
            "ce_time",
            r.occurred_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        ));
        headers.push(h("ce_subject", r.aggregate_id.clone()));
        headers.push(h("content-type", "application/json".to_owned()));
        headers.push(h("idem_aggregate_type", r.aggregate_type.clone()));
        headers.push(h("idem_aggregate_id", r.aggregate_id.clone()));
        headers.push(h("idem_aggregate_seq", r.aggregate_seq.to_string()));
        headers.push(h("idem_attempt", r.attempt.to_string()));
        if let Some(tp) = &r.traceparent {
            headers.push(h("traceparent", tp.clone()));
        }
        // A writer using plain SQL could set names the relay owns (a second `ce_id` would let a
        // consumer read a forged dedup key): those are dropped.
        headers.extend(
            r.headers
                .iter()
                .filter(|(k, _)| !idem_core::event::is_reserved_header(k))
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        Message {
            topic: topic.to_owned(),
            key: r.aggregate_id.clone(),
            payload: r.payload.clone(),
            headers,
        }
    }

    /// Refreshes the pending, parked and oldest-pending-age gauges (per aggregate type) with
    /// one [`OutboxStore::backlog`] query, which reads only pending and parked rows.
    pub async fn refresh_status(&self) -> Result<()> {
        let backlog = self.store.backlog().await?;
        self.metrics.set_backlog(&backlog);
        Ok(())
    }

    /// Runs until `shutdown` resolves. An in-flight batch is always finished (published and
    /// marked, or released) before it returns, so nothing is left half-marked.
    ///
    /// Idle latency: when a claim finds nothing the relay sleeps `idle_poll_min`, doubling up
    /// to `idle_poll_max`; any claimed row resets the interval. No trigger or `NOTIFY` runs in
    /// the writers' transactions.
    ///
    /// The status gauges and pruning run beside the claim loop, not in it: the status query
    /// scans the outbox (about 65 ms for 300 000 rows here) and a prune deletes up to a batch of
    /// rows, and either would otherwise hold up every event waiting to be claimed.
    ///
    /// Database and broker errors are logged and retried with backoff; a crash point fired in
    /// error mode ends the loop with [`Error::CrashPoint`].
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        tokio::select! {
            r = self.claim_loop(shutdown) => r,
            never = self.housekeeping() => match never {},
        }
    }

    /// Refreshes the gauges every `status_interval` and prunes every prune interval, forever.
    async fn housekeeping(&self) -> std::convert::Infallible {
        let mut last_status: Option<Instant> = None;
        let mut last_prune = Instant::now();
        loop {
            if last_status.is_none_or(|t| t.elapsed() >= self.config.status_interval) {
                if let Err(e) = self.refresh_status().await {
                    tracing::warn!(error = %e, "could not refresh outbox status");
                }
                last_status = Some(Instant::now());
            }
            if let Some((every, policy)) = &self.config.prune
                && last_prune.elapsed() >= *every
            {
                match self.store.prune(policy).await {
                    Ok(n) => self.metrics.pruned.inc_by(n),
                    Err(e) => tracing::warn!(error = %e, "pruning failed"),
                }
                last_prune = Instant::now();
            }
            let next_prune = self
                .config
                .prune
                .as_ref()
                .map_or(self.config.status_interval, |(every, _)| {
                    every.saturating_sub(last_prune.elapsed())
                });
            let pause = self.config.status_interval.min(next_prune);
            tokio::time::sleep(pause.max(Duration::from_millis(1))).await;
        }
    }

    async fn claim_loop(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        tokio::pin!(shutdown);
        let mut idle = self.config.idle_poll_min;
        let mut error_backoff = Duration::from_millis(200);
        loop {
            let wait = match self.run_once().await {
                Ok(r) if r.claimed > 0 => {
                    idle = self.config.idle_poll_min;
                    error_backoff = Duration::from_millis(200);
                    if r.claimed as u32 >= self.config.batch_size {
                        Duration::ZERO
                    } else {
                        idle
                    }
                }
                Ok(_) => {
                    let w = idle;
                    idle = (idle * 2).min(self.config.idle_poll_max);
                    w
                }
                Err(Error::CrashPoint(name)) => return Err(Error::CrashPoint(name)),
                Err(e) => {
                    tracing::error!(error = %e, "relay cycle failed; retrying");
                    self.metrics.errors.inc();
                    let w = error_backoff;
                    error_backoff = (error_backoff * 2).min(Duration::from_secs(10));
                    w
                }
            };
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests;
