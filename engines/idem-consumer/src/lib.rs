#![doc = include_str!("../README.md")]

mod attempt;
mod batch;
mod config;
mod dead_letter;
mod handler;
mod metrics;
pub mod replay;
mod retry;

use std::future::Future;
use std::time::Duration;

use idem_core::crash::{self, CONSUMER_AFTER_DB_COMMIT_BEFORE_OFFSET_COMMIT};
use idem_core::{Delivery, Error, EventId, InboundEvent, InboxEntry, InboxStore, Result, Source};

use crate::attempt::AttemptCx;
use crate::batch::{Batch, Unique, last_offsets};
use crate::retry::{Retries, Step};

pub use config::ConsumerConfig;
pub use handler::{BatchError, Handler, HandlerError, Outcome, effect_traceparent, event_span};
pub use idem_core::wire::{DecodeError, decode};
pub use metrics::{ConsumerMetrics, MAX_LABEL_PAIRS, OTHER, total};

/// What one batch did, after its commit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Records in the batch.
    pub records: usize,
    /// Events applied by the handler.
    pub processed: u64,
    /// Copies of events seen before (in the inbox or earlier in the batch).
    pub duplicate_deliveries: u64,
    /// Copies skipped because the event was already applied.
    pub duplicate_skips: u64,
    /// Copies with a known event id but a different payload: never applied.
    pub conflicts: u64,
    /// Records dead-lettered.
    pub dead_lettered: u64,
    /// Transaction attempts that were rolled back and retried.
    pub retries: u64,
}

/// The consumer runtime.
///
/// For each batch it opens one transaction, records the batch's events in the inbox
/// (`INSERT … ON CONFLICT`), calls the handler **in that transaction** for the new ones,
/// commits, and only then commits the Kafka offsets. Duplicate windows and what closes them:
///
/// * crash after the inbox insert, before the handler (`consumer.after_dedup_before_handler`):
///   the transaction dies with the process, nothing was committed, the offset was not either; the
///   batch is delivered again and applied once.
/// * crash after the commit, before the offset commit
///   (`consumer.after_db_commit_before_offset_commit`): the batch is delivered again; the inbox
///   finds every event and the handler is not called (`idem_duplicate_skip_total`).
/// * a rebalance hands a partition to another process while this one still works on it: both
///   may apply the same event concurrently; the inbox's primary key makes the second insert
///   wait for the first transaction and then see a duplicate.
/// * the producer or relay published an event twice: same `ce_id`, skipped.
pub struct Consumer<I, H, S> {
    inbox: I,
    handler: H,
    source: S,
    config: ConsumerConfig,
    metrics: ConsumerMetrics,
}

impl<I, H, S> std::fmt::Debug for Consumer<I, H, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("inbox", &std::any::type_name::<I>())
            .field("handler", &std::any::type_name::<H>())
            .field("source", &std::any::type_name::<S>())
            .field("config", &self.config)
            .field("metrics", &self.metrics)
            .finish()
    }
}

/// Builds a [`Consumer`]: metrics registered only when a registry is given
/// ([`ConsumerBuilder::registry`]).
pub struct ConsumerBuilder<I, H, S> {
    inbox: I,
    handler: H,
    source: S,
    config: ConsumerConfig,
    registry: Option<prometheus::Registry>,
    metrics: Option<ConsumerMetrics>,
}

impl<I, H, S> std::fmt::Debug for ConsumerBuilder<I, H, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("config", &self.config)
            .field("registry", &self.registry.is_some())
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

impl<I, H, S> ConsumerBuilder<I, H, S>
where
    I: InboxStore,
    H: Handler<I::Conn>,
    S: Source,
{
    /// Settings other than the defaults of [`ConsumerConfig::new`] for the group.
    pub fn config(mut self, config: ConsumerConfig) -> Self {
        self.config = config;
        self
    }

    /// Creates the consumer's metrics and registers them in `registry` (at
    /// [`ConsumerBuilder::build`]).
    pub fn registry(mut self, registry: &prometheus::Registry) -> Self {
        self.registry = Some(registry.clone());
        self
    }

    /// Counts into `metrics`, created (and registered) by the caller; wins over
    /// [`ConsumerBuilder::registry`].
    pub fn metrics(mut self, metrics: ConsumerMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The consumer. Without a registry or metrics it counts into metrics nothing exports.
    /// Fails when the registry holds the consumer's metric names already.
    pub fn build(self) -> Result<Consumer<I, H, S>> {
        let metrics = match (self.metrics, &self.registry) {
            (Some(m), _) => m,
            (None, Some(registry)) => ConsumerMetrics::new(registry)?,
            (None, None) => ConsumerMetrics::unregistered()?,
        };
        Ok(Consumer::new(
            self.inbox,
            self.handler,
            self.source,
            self.config,
            metrics,
        ))
    }
}

impl<I, H, S> Consumer<I, H, S>
where
    I: InboxStore,
    H: Handler<I::Conn>,
    S: Source,
{
    /// A consumer of `source` applying events with `handler`, deduplicated by `inbox`.
    pub fn new(
        inbox: I,
        handler: H,
        source: S,
        config: ConsumerConfig,
        metrics: ConsumerMetrics,
    ) -> Self {
        Consumer {
            inbox,
            handler,
            source,
            config,
            metrics,
        }
    }

    /// A builder of a consumer in consumer group `group` ([`ConsumerConfig::new`]), metrics
    /// optional.
    pub fn builder(
        inbox: I,
        handler: H,
        source: S,
        group: impl Into<String>,
    ) -> ConsumerBuilder<I, H, S> {
        ConsumerBuilder {
            inbox,
            handler,
            source,
            config: ConsumerConfig::new(group),
            registry: None,
            metrics: None,
        }
    }

    /// The metrics.
    pub fn metrics(&self) -> &ConsumerMetrics {
        &self.metrics
    }

    /// The inbox.
    pub fn inbox(&self) -> &I {
        &self.inbox
    }

    /// Runs until `shutdown` resolves. A batch being applied is finished (committed, offsets
    /// committed) first; a batch backing off after a transient failure is abandoned, uncommitted
    /// (a new consumer gets it again from the committed offset). Returns early with an error for a crash point fired in error mode,
    /// when a batch cannot be committed after `max_batch_retries`, or when the source reports a
    /// fatal error ([`Error::is_fatal`]: its client can never fetch again); the consumer is
    /// consumed, so it cannot skip that batch by running on: a new consumer resumes from the
    /// committed offset.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> Result<()> {
        tokio::pin!(shutdown);
        let _lag = self.spawn_lag_gauge();
        let mut backoff = Duration::from_millis(100);
        loop {
            let batch = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                b = self.source.next_batch(self.config.batch_size, self.config.linger) => b,
            };
            match batch {
                Ok(records) if records.is_empty() => {}
                Ok(records) => {
                    if self.process_until(&records, &mut shutdown).await?.is_none() {
                        return Ok(()); // stopped while a failing batch backed off
                    }
                    backoff = Duration::from_millis(100);
                }
                // A client that cannot recover would be retried forever while its partitions
                // sit idle (librdkafka#3437: a static member can fence itself after a session
                // timeout): stop, so that a supervisor starts a new one. Nothing is lost: the
                // new client resumes from the committed offsets.
                Err(e) if e.is_fatal() => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "fetching records failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Measures the source's lag every `lag_interval` into `idem_consumer_lag`, on a task of its
    /// own so the gauge moves while a batch is retried or the source waits; stopped when the
    /// returned guard is dropped.
    fn spawn_lag_gauge(&self) -> Option<AbortOnDrop> {
        let probe = self.source.lag_probe()?;
        let (metrics, group, every) = (
            self.metrics.clone(),
            self.config.group.clone(),
            self.config.lag_interval,
        );
        Some(AbortOnDrop(tokio::spawn(async move {
            loop {
                let p = probe.clone();
                match tokio::task::spawn_blocking(move || p()).await {
                    Ok(lags) => metrics.set_lag(&group, &lags),
                    Err(e) => tracing::warn!(error = %e, "measuring the consumer lag failed"),
                }
                tokio::time::sleep(every).await;
            }
        })))
    }

    /// The group the inbox is keyed by (a fixed one under the `inbox-ignores-group` negative
    /// control).
    fn inbox_group(&self) -> &str {
        if crash::broken(crash::BREAK_INBOX_IGNORES_GROUP) {
            "*"
        } else {
            &self.config.group
        }
    }

    /// Applies one batch and commits its offsets. Public for tests and embedding.
    ///
    /// After an error, drop this consumer: its source has read past the batch, whose offset was
    /// not committed, and only a new source resumes from the committed offset.
    ///
    /// A transient failure is retried, with backoff, until the batch commits: this call returns
    /// only then, or with the error of a database that stayed unreachable for
    /// `max_batch_retries` attempts. [`Consumer::run`] can stop it while it backs off.
    pub async fn process(&mut self, records: &[Delivery]) -> Result<BatchReport> {
        let mut never = std::future::pending::<()>();
        Ok(self
            .process_until(records, &mut never)
            .await?
            .unwrap_or_default())
    }

    /// [`Consumer::process`], but `None` when `stop` resolves while the batch backs off after a
    /// transient failure (nothing of it committed, its offsets neither).
    async fn process_until<St>(
        &mut self,
        records: &[Delivery],
        stop: &mut St,
    ) -> Result<Option<BatchReport>>
    where
        St: Future<Output = ()> + Unpin,
    {
        if records.is_empty() {
            return Ok(Some(BatchReport::default()));
        }
        if crash::broken(crash::BREAK_OFFSET_BEFORE_COMMIT) {
            // Negative control: the offsets move on before anything is applied.
            self.source.commit(&last_offsets(records)).await?;
        }
        let decoded: Vec<_> = records.iter().map(decode).collect();
        let batch = Batch::new(records, &decoded);
        let Some((results, retries)) = self.apply(records, &batch, stop).await? else {
            return Ok(None);
        };
        self.metrics
            .clear_stalled(&self.config.group, &batch.topics);
        let mut report = self.account(&batch, &results, &retries);
        report.records = records.len();

        crash::crash_point(CONSUMER_AFTER_DB_COMMIT_BEFORE_OFFSET_COMMIT)?;
        if crash::broken(crash::BREAK_SELECT_THEN_INSERT) {
            // Negative control: the inbox rows are written only now, after the business
            // commit, in a transaction of their own.
            self.record_late(&batch).await?;
        }
        if let Err(e) = self.source.commit(&last_offsets(records)).await {
            // Not fatal: the batch is committed in the database; if it comes back, the inbox
            // skips it.
            self.metrics.offset_commit_failures.inc();
            tracing::warn!(error = %e, "committing offsets failed; the batch may be delivered again and skipped");
        }
        Ok(Some(report))
    }

    /// Attempts the batch until an attempt commits: the inbox's verdicts and the retry state
    /// (refused events, retries), or `None` when `stop` resolved while it backed off.
    async fn apply<St>(
        &self,
        records: &[Delivery],
        batch: &Batch<'_>,
        stop: &mut St,
    ) -> Result<Option<(Vec<idem_core::Dedup>, Retries)>>
    where
        St: Future<Output = ()> + Unpin,
    {
        let mut retries = Retries::new(self.config.max_batch_retries, broken_transient_budget);
        let mut backoff = self.config.retry_backoff;
        loop {
            let cx = AttemptCx {
                batch,
                poison: &retries.poison,
                isolate: retries.isolate,
            };
            let failure = match self.attempt(cx).await {
                Ok(done) => {
                    for (id, reason) in &done.refused {
                        tracing::warn!(event_id = %id, %reason, "dead-lettered an event the handler refused");
                    }
                    retries.refused(done.refused);
                    return Ok(Some((done.results, retries)));
                }
                Err(failure) => failure,
            };
            match &failure {
                attempt::Attempt::Unusable(e) => {
                    tracing::warn!(error = %e, "a handler left the transaction aborted; retrying the batch one event at a time to find it");
                }
                attempt::Attempt::Refused(reason) => {
                    tracing::warn!(%reason, "the database refused the batch; retrying it one event at a time");
                }
                attempt::Attempt::Poison(id, reason) => {
                    tracing::warn!(event_id = %id, %reason, "dead-lettering an event the handler refused");
                }
                attempt::Attempt::Transient(id, _) => self.count_retry(records, batch, *id),
                attempt::Attempt::Fatal(_) => {}
            }
            match retries.after(failure) {
                Step::Again => {}
                Step::Fatal(e) => return Err(e),
                Step::GiveUp { error, event } => {
                    tracing::warn!(error = %error, event_id = ?event, retries = retries.retries, "consumer transaction failed; retrying");
                    tracing::error!(error = %error, "giving up on the batch; its offset is not committed");
                    return Err(error);
                }
                Step::BackOff { error, event } => {
                    tracing::warn!(error = %error, event_id = ?event, retries = retries.retries, "consumer transaction failed; retrying");
                    if !self.back_off(&mut backoff, stop).await {
                        tracing::info!(
                            "stopping while the batch backs off; its offset is not committed"
                        );
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Counts the committed batch, now that rolled-back attempts changed nothing: each metric
    /// once per label group of the batch.
    fn account(
        &self,
        batch: &Batch<'_>,
        results: &[idem_core::Dedup],
        retries: &Retries,
    ) -> BatchReport {
        let tally = batch.tally(results, &retries.poison, std::time::SystemTime::now());
        for g in &tally.groups {
            let labels =
                self.metrics
                    .labels(g.topic, &self.config.group, g.event_type, g.aggregate_type);
            self.metrics.count(&labels, g.counts, &g.waited);
        }
        let c = tally.total;
        BatchReport {
            records: 0,
            processed: c.processed,
            duplicate_deliveries: c.duplicate_deliveries,
            duplicate_skips: c.duplicate_skips,
            conflicts: c.conflicts,
            dead_lettered: c.dead_lettered,
            retries: retries.retries,
        }
    }

    /// Under the `select-then-insert` negative control: the inbox rows, written after the
    /// business commit in a transaction of their own.
    async fn record_late(&self, batch: &Batch<'_>) -> Result<()> {
        let mut tx = self.inbox.begin().await?;
        let entries: Vec<InboxEntry<'_>> = batch
            .uniques
            .iter()
            .map(|u| InboxEntry {
                event: u.event,
                copies: u.copies,
                dead_lettered: false,
            })
            .collect();
        self.inbox
            .record(&mut tx, self.inbox_group(), &entries)
            .await?;
        self.inbox.commit(tx).await
    }

    /// The bounded label values of `event` ([`ConsumerMetrics::labels`]).
    fn labels(&self, event: &InboundEvent) -> [String; 4] {
        self.metrics.labels(
            &event.topic,
            &self.config.group,
            &event.event_type,
            &event.aggregate_type,
        )
    }

    /// Counts a rolled-back attempt (under the failing event's labels, else the batch's first)
    /// and marks the batch's topics stalled.
    fn count_retry(&self, records: &[Delivery], batch: &Batch<'_>, id: Option<EventId>) {
        let uniques: &[Unique<'_>] = &batch.uniques;
        let labels = uniques
            .iter()
            .find(|u| Some(u.event.event_id) == id)
            .or(uniques.first())
            .map(|u| self.labels(u.event))
            .unwrap_or_else(|| {
                let topic = records.first().map_or("", |r| r.topic.as_str());
                self.metrics.labels(topic, &self.config.group, "", "")
            });
        self.metrics.retries.with_label_values(&labels).inc();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        self.metrics
            .set_stalled(&self.config.group, &batch.topics, now.max(1));
    }

    /// Sleeps `backoff` and doubles it (up to `retry_backoff_max`); false when `stop` resolved
    /// first.
    async fn back_off<St>(&self, backoff: &mut Duration, stop: &mut St) -> bool
    where
        St: Future<Output = ()> + Unpin,
    {
        let wait = *backoff;
        *backoff = (*backoff * 2).min(self.config.retry_backoff_max);
        tokio::select! {
            biased;
            () = stop => false,
            () = tokio::time::sleep(wait) => true,
        }
    }
}

/// Under the `transient-dead-letters` negative control, the reason to dead-letter an event after
/// its `n`th transient failure.
fn broken_transient_budget(n: u32, e: &Error) -> Option<String> {
    (n > crash::BROKEN_TRANSIENT_BUDGET && crash::broken(crash::BREAK_TRANSIENT_DEAD_LETTERS))
        .then(|| format!("gave up after {n} transient failures; last: {e}"))
}

/// Aborts a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests;
