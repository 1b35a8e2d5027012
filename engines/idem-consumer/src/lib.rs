#![doc = include_str!("../README.md")]

mod attempt;
mod batch;
mod config;
mod context;
mod dead_letter;
mod handler;
mod lanes;
mod metrics;
mod readiness;
pub mod replay;
mod retry;

use std::future::Future;
use std::time::Duration;

use idem_core::backoff::Backoff;
use idem_core::crash::{self, CrashPoint};
use idem_core::health::Health;
use idem_core::store::{Delivery, InboxEntry, InboxStore, Source};
use idem_core::{Error, EventId, InboundEvent, Result};

use crate::attempt::AttemptCx;
use crate::batch::{Batch, Unique, last_offsets};
use crate::retry::{Retries, Step};

pub use config::ConsumerConfig;
pub use context::{BatchContext, Effects, HandlerContext};
pub use handler::{BatchError, Handler, HandlerError, Outcome, event_span};
pub use idem_core::wire::{DecodeError, decode};
pub use metrics::{ConsumerMetrics, MAX_LABEL_PAIRS, OTHER, total};
pub use readiness::DATABASE;

/// The wait after a failed fetch: 100 ms, doubling while fetches fail, at most 5 s.
const FETCH_BACKOFF: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

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
    /// Where the database's state is reported, if anywhere, and when a transaction last
    /// committed.
    health: Option<(Health, std::sync::Mutex<Option<std::time::Instant>>)>,
}

impl<I, H, S> std::fmt::Debug for Consumer<I, H, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("inbox", &std::any::type_name::<I>())
            .field("handler", &std::any::type_name::<H>())
            .field("source", &std::any::type_name::<S>())
            .field("config", &self.config)
            .field("metrics", &self.metrics)
            .field("health", &self.health.as_ref().map(|(h, _)| h))
            .finish()
    }
}

/// Builds a [`Consumer`]: metrics registered only when a registry is given
/// ([`ConsumerBuilder::registry`]).
pub struct ConsumerBuilder<I, H, S> {
    inbox: I,
    handler: H,
    source: S,
    config: Option<ConsumerConfig>,
    registry: Option<prometheus::Registry>,
    metrics: Option<ConsumerMetrics>,
    health: Option<Health>,
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
    /// Settings other than the defaults of [`ConsumerConfig::new`] for the source's group.
    /// Its group must be the source's, when the source names one ([`Source::group`]).
    pub fn config(mut self, config: ConsumerConfig) -> Self {
        self.config = Some(config);
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

    /// Reports the database's state into `health` ([`Consumer::with_health`]).
    pub fn health(mut self, health: Health) -> Self {
        self.health = Some(health);
        self
    }

    /// The consumer. Without a registry or metrics it counts into metrics nothing exports.
    /// Fails when the registry holds the consumer's metric names already.
    ///
    /// Fails as well when the source names no group and no config was given, or when the
    /// config's group is not the source's: the inbox rows and the offsets of one consumer
    /// belong to one group.
    pub fn build(self) -> Result<Consumer<I, H, S>> {
        let config = group_config(self.config, self.source.group())?;
        let metrics = match (self.metrics, &self.registry) {
            (Some(m), _) => m,
            (None, Some(registry)) => ConsumerMetrics::new(registry)?,
            (None, None) => ConsumerMetrics::unregistered()?,
        };
        let consumer = Consumer::new(self.inbox, self.handler, self.source, config, metrics);
        Ok(match self.health {
            Some(h) => consumer.with_health(h),
            None => consumer,
        })
    }
}

/// The settings of a consumer whose source reads as `group`: `config` (whose group must be
/// the source's), or the defaults for the source's group.
fn group_config(config: Option<ConsumerConfig>, group: Option<&str>) -> Result<ConsumerConfig> {
    match (config, group) {
        (Some(c), Some(g)) if c.group != g => Err(Error::Config(format!(
            "the consumer's config names group {:?} and its source reads as group {g:?}: its \
             inbox rows and its offsets must belong to one group",
            c.group
        ))),
        (Some(c), _) => Ok(c),
        (None, Some(g)) => Ok(ConsumerConfig::new(g)),
        (None, None) => Err(Error::Config(
            "the source names no consumer group: give the consumer a config with its group \
             (ConsumerBuilder::config)"
                .to_owned(),
        )),
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
            health: None,
        }
    }

    /// Reports the database into `health` as [`DATABASE`] while [`Consumer::run`] runs: not
    /// ready until it answers, then as the last transaction's commit or, while none commits
    /// for 5 s (an idle consumer), as a probe every 5 s (a transaction opened and rolled back,
    /// within 5 s). The group and the broker are the source's and the command's to report.
    pub fn with_health(mut self, health: Health) -> Self {
        health.expect(DATABASE);
        self.health = Some((health, std::sync::Mutex::new(None)));
        self
    }

    /// A builder of a consumer in the consumer group of `source` ([`Source::group`], Kafka's
    /// `group.id`) with the defaults of [`ConsumerConfig::new`], metrics optional.
    pub fn builder(inbox: I, handler: H, source: S) -> ConsumerBuilder<I, H, S> {
        ConsumerBuilder {
            inbox,
            handler,
            source,
            config: None,
            registry: None,
            metrics: None,
            health: None,
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
    /// stored) first; a batch backing off after a transient failure is abandoned, uncommitted
    /// (a new consumer gets it again from the committed offset). The next batch is fetched
    /// while the current one is applied, and the partitions of a batch are applied
    /// concurrently ([`ConsumerConfig::partition_concurrency`]), each partition's records in
    /// offset order. Returns early with an error for a crash point fired in error mode, when a
    /// batch cannot be committed after `max_batch_retries`, or when the source reports a fatal
    /// error ([`Error::is_fatal`]: its client can never fetch again); the consumer is consumed,
    /// so it cannot skip that batch by running on: a new consumer resumes from the committed
    /// offset. However the run ends, the offsets stored for committed batches are committed
    /// ([`Source::close`]) before it returns.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<()> {
        tokio::pin!(shutdown);
        tokio::select! {
            biased;
            () = &mut shutdown => return Ok(()),
            checked = self.check_start() => checked?,
        }
        let _lag = self.spawn_lag_gauge();
        let result = tokio::select! {
            biased;
            r = self.drive(shutdown) => r,
            never = self.watch_database() => match never {},
            never = self.serve_replays() => match never {},
        };
        if let Err(e) = self.source.close().await {
            tracing::warn!(error = %e, "committing the stored offsets at the end of the run failed; the last batches may be delivered again and skipped");
        }
        result
    }

    /// Refuses to start on a database whose tables are not migrated for this build
    /// ([`InboxStore::check_schema`]) or on topics the cluster does not have
    /// ([`Source::check_topics`]), before any record is read. A database or a cluster that
    /// does not answer yet is left to the run, which waits for it as for any transient failure;
    /// a shutdown meanwhile ends the run at once.
    async fn check_start(&self) -> Result<()> {
        let (schema, topics) = tokio::join!(self.inbox.check_schema(), self.source.check_topics());
        for checked in [schema, topics] {
            match checked {
                Err(e) if e.kind() != idem_core::ErrorKind::Transient => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "a check at start could not be made; starting, and retrying as the database and the cluster allow");
                }
                Ok(()) => {}
            }
        }
        Ok(())
    }

    /// The fetch/apply loop of [`Consumer::run`]: one fetch is always in flight beside the
    /// batch being applied, and its result waits until that batch is done.
    async fn drive<F: Future<Output = ()>>(&self, shutdown: std::pin::Pin<&mut F>) -> Result<()> {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let mut stop = Latch {
            fut: shutdown,
            tx,
            fired: false,
        };
        let max = lanes::fetch_size(self.config.batch_size, self.config.partition_concurrency);
        let fetch = || self.source.next_batch(max, self.config.linger);
        let mut fetching = Box::pin(fetch());
        let mut ready: Option<(Result<Vec<Delivery>>, u64)> = None;
        let mut backoff = FETCH_BACKOFF.first;
        loop {
            let (fetched, epoch) = match ready.take() {
                Some(f) => f,
                None => tokio::select! {
                    biased;
                    () = &mut stop => return Ok(()),
                    f = &mut fetching => (f, self.source.epoch()),
                },
            };
            fetching.set(fetch());
            match fetched {
                Ok(records) if records.is_empty() => {}
                Ok(mut records) => {
                    lanes::sort_by_partition(&mut records);
                    let work = self.process_set(&records, epoch, &mut stop, &rx);
                    tokio::pin!(work);
                    let outcome = loop {
                        tokio::select! {
                            r = &mut work => break r,
                            f = &mut fetching, if ready.is_none() => {
                                ready = Some((f, self.source.epoch()));
                            }
                        }
                    };
                    if outcome?.is_none() {
                        return Ok(()); // stopped while a failing batch backed off
                    }
                    backoff = FETCH_BACKOFF.first;
                }
                // A client that cannot recover would be retried forever while its partitions
                // sit idle (librdkafka#3437: a static member can fence itself after a session
                // timeout): stop, so that a supervisor starts a new one. Nothing is lost: the
                // new client resumes from the committed offsets.
                Err(e) if e.is_fatal() => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "fetching records failed; retrying");
                    tokio::select! {
                        biased;
                        () = &mut stop => return Ok(()),
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = FETCH_BACKOFF.next(backoff);
                }
            }
        }
    }

    /// Reports the database's state every [`readiness::PROBE_EVERY`], probing it unless a
    /// transaction committed since the last time; never returns (pending for good without a
    /// health to report to).
    async fn watch_database(&self) -> std::convert::Infallible {
        let Some((health, committed)) = &self.health else {
            return std::future::pending().await;
        };
        loop {
            let last = *committed.lock().unwrap_or_else(|p| p.into_inner());
            if readiness::probe_due(last, std::time::Instant::now(), readiness::PROBE_EVERY) {
                let probe = async {
                    let tx = self.inbox.begin().await?;
                    self.inbox.rollback(tx).await
                };
                match tokio::time::timeout(readiness::PROBE_TIMEOUT, probe).await {
                    Ok(Ok(())) => health.ok(DATABASE),
                    Ok(Err(e)) => health.failed(DATABASE, &e),
                    Err(_) => {
                        health.failed(DATABASE, &readiness::timed_out(readiness::PROBE_TIMEOUT));
                    }
                }
            }
            tokio::time::sleep(readiness::PROBE_EVERY).await;
        }
    }

    /// Serves the dead-letter replays requested for the group every
    /// [`ConsumerConfig::replay_poll`] ([`replay::serve_requested`]): each through the handler,
    /// in one transaction with the event's inbox row, so a replay served by two members of the
    /// group (or racing a redelivery) applies once. A failed round is retried at the next
    /// poll; never returns.
    async fn serve_replays(&self) -> std::convert::Infallible {
        let group = self.inbox_group();
        loop {
            tokio::time::sleep(self.config.replay_poll).await;
            match replay::serve_requested(&self.inbox, &self.handler, group).await {
                Ok(served) => {
                    for r in &served {
                        tracing::info!(group, letter = r.id, event_id = ?r.event_id, outcome = r.result.label(), "served a requested dead-letter replay");
                        self.metrics
                            .replays
                            .with_label_values(&[group, r.result.label()])
                            .inc();
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "serving the requested dead-letter replays failed; retrying at the next poll");
                }
            }
        }
    }

    /// Notes a committed transaction: the database answered.
    fn committed(&self) {
        if let Some((health, committed)) = &self.health {
            *committed.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now());
            health.ok(DATABASE);
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
        if crash::broken(crash::Mechanism::InboxIgnoresGroup) {
            "*"
        } else {
            &self.config.group
        }
    }

    /// Applies one batch and commits its offsets. Public for tests and embedding.
    ///
    /// The records of each partition are applied in their own transactions (at most
    /// `batch_size` records each, in offset order), the partitions concurrently, up to
    /// [`ConsumerConfig::partition_concurrency`] at a time, and each partition's offsets are
    /// committed after its transaction. The report adds up all of them.
    ///
    /// After an error, drop this consumer: its source has read past the batch, whose offset was
    /// not committed, and only a new source resumes from the committed offset.
    ///
    /// A transient failure is retried, with backoff, until the batch commits: this call returns
    /// only then, or with the error of a database that stayed unreachable for
    /// `max_batch_retries` attempts. [`Consumer::run`] can stop it while it backs off.
    pub async fn process(&mut self, records: &[Delivery]) -> Result<BatchReport> {
        let mut records = records.to_vec();
        lanes::sort_by_partition(&mut records);
        let (_tx, rx) = tokio::sync::watch::channel(false);
        let mut never = std::future::pending::<()>();
        let epoch = self.source.epoch();
        Ok(self
            .process_set(&records, epoch, &mut never, &rx)
            .await?
            .unwrap_or_default())
    }

    /// Applies a fetched set (sorted by partition), lane by lane ([`lanes::lanes`]); `None`
    /// when `stop` resolved while a lane backed off after a transient failure (nothing of that
    /// lane's transaction committed, its offsets neither). `stop` tells the lanes through
    /// `stopped` (the [`Latch`] of [`Consumer::run`] sends on it). Every lane started runs to
    /// its end; after an error or a stop no further lane starts, and the first error is
    /// returned.
    async fn process_set<St>(
        &self,
        records: &[Delivery],
        epoch: u64,
        stop: &mut St,
        stopped: &tokio::sync::watch::Receiver<bool>,
    ) -> Result<Option<BatchReport>>
    where
        St: Future<Output = ()> + Unpin,
    {
        use futures::StreamExt;
        if records.is_empty() {
            return Ok(Some(BatchReport::default()));
        }
        let halt = std::sync::atomic::AtomicBool::new(false);
        // The lanes' futures are made up front (they do nothing until polled), so that no
        // closure is part of the state held across awaits.
        let lanes: Vec<_> = lanes::lanes(records, self.config.batch_size)
            .into_iter()
            .map(|lane| self.lane(lane, epoch, stopped.clone(), &halt))
            .collect();
        let work = futures::stream::iter(lanes)
            .buffer_unordered(self.config.partition_concurrency.max(1))
            .collect::<Vec<_>>();
        tokio::pin!(work);
        let ends = tokio::select! {
            ends = &mut work => ends,
            () = stop => work.await,
        };
        let mut report = BatchReport::default();
        let mut halted = false;
        for end in ends {
            match end? {
                LaneEnd::Done(r) => report.merge(r),
                LaneEnd::Halted(r) => {
                    report.merge(r);
                    halted = true;
                }
            }
        }
        if halted {
            return Ok(None);
        }
        let topics: std::collections::BTreeSet<&str> =
            records.iter().map(|r| r.topic.as_str()).collect();
        self.metrics.clear_stalled(&self.config.group, &topics);
        Ok(Some(report))
    }

    /// Applies one lane's transactions in order, committing each one's offsets after its
    /// database commit. Stops before a transaction when the run stops or another lane failed
    /// (`halt`), and when the lane's partition was revoked after `epoch`.
    async fn lane(
        &self,
        lane: lanes::Lane<'_>,
        epoch: u64,
        mut stopped: tokio::sync::watch::Receiver<bool>,
        halt: &std::sync::atomic::AtomicBool,
    ) -> Result<LaneEnd> {
        use std::sync::atomic::Ordering;
        let mut report = BatchReport::default();
        for records in lane.chunks {
            if halt.load(Ordering::SeqCst) || *stopped.borrow() {
                return Ok(LaneEnd::Halted(report));
            }
            match self.transaction(records, epoch, &mut stopped).await {
                Ok(Applied::Committed(r)) => report.merge(r),
                Ok(Applied::Revoked) => return Ok(LaneEnd::Done(report)),
                Ok(Applied::Stopped) => {
                    halt.store(true, Ordering::SeqCst);
                    return Ok(LaneEnd::Halted(report));
                }
                Err(e) => {
                    halt.store(true, Ordering::SeqCst);
                    return Err(e);
                }
            }
        }
        Ok(LaneEnd::Done(report))
    }

    /// One transaction of one partition's `records`, then their offsets.
    async fn transaction(
        &self,
        records: &[Delivery],
        epoch: u64,
        stopped: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<Applied> {
        if crash::broken(crash::Mechanism::OffsetBeforeCommit) {
            // Negative control: the offsets move on before anything is applied.
            self.source.commit(&last_offsets(records)).await?;
        }
        let decoded: Vec<_> = records.iter().map(decode).collect();
        let batch = Batch::new(records, &decoded);
        let (results, retries) = match self.apply(records, &batch, epoch, stopped).await? {
            Applying::Committed(results, retries) => (results, retries),
            Applying::Stopped => return Ok(Applied::Stopped),
            Applying::Revoked => return Ok(Applied::Revoked),
        };
        self.committed();
        let mut report = self.account(&batch, &results, &retries);
        report.records = records.len();

        crash::crash_point(CrashPoint::ConsumerAfterDbCommitBeforeOffsetCommit)?;
        if crash::broken(crash::Mechanism::SelectThenInsert) {
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
        Ok(Applied::Committed(report))
    }

    /// Attempts the batch until an attempt commits: the inbox's verdicts and the retry state
    /// (refused events, retries); or stopped, when `stopped` said so while it backed off; or
    /// revoked, when its partition was revoked after `epoch` (checked before every attempt:
    /// the partition's next owner applies these records).
    async fn apply<'b>(
        &self,
        records: &[Delivery],
        batch: &Batch<'b>,
        epoch: u64,
        stopped: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<Applying> {
        let mut retries = Retries::new(
            self.config.max_batch_retries,
            self.config.max_unclassified_failures,
            broken_transient_budget,
        );
        let mut backoff = self.config.retry_backoff;
        loop {
            if records
                .first()
                .is_some_and(|r| self.source.revoked_since(&r.topic, r.partition, epoch))
            {
                tracing::info!(
                    records = records.len(),
                    "the partition was revoked; its records are left to its next owner"
                );
                return Ok(Applying::Revoked);
            }
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
                    return Ok(Applying::Committed(done.results, retries));
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
                attempt::Attempt::Unclassified(id, what, e) => {
                    self.count_retry(records, batch, Some(*id));
                    tracing::warn!(
                        event_id = %id,
                        code = %what,
                        error = %e,
                        failures = retries.unclassified_failures(*id) + 1,
                        max_unclassified_failures = self.config.max_unclassified_failures,
                        "a database error of no known class; retried as transient until max_unclassified_failures, then dead-lettered"
                    );
                }
                attempt::Attempt::Fatal(_) => {}
            }
            match retries.after(failure) {
                Step::Again => {}
                Step::SetApart { event, reason } => {
                    tracing::error!(event_id = %event, %reason, "dead-lettering an event that failed with an unclassified database error too often");
                }
                Step::Fatal(e) => return Err(e),
                Step::GiveUp { error, event } => {
                    tracing::warn!(error = %error, event_id = ?event, retries = retries.retries, "consumer transaction failed; retrying");
                    tracing::error!(error = %error, "giving up on the batch; its offset is not committed");
                    return Err(error);
                }
                Step::BackOff { error, event } => {
                    tracing::warn!(error = %error, event_id = ?event, retries = retries.retries, "consumer transaction failed; retrying");
                    if !self.back_off(&mut backoff, stopped).await {
                        tracing::info!(
                            "stopping while the batch backs off; its offset is not committed"
                        );
                        return Ok(Applying::Stopped);
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
        results: &[idem_core::store::Dedup],
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

    /// Sleeps `backoff` and doubles it (up to `retry_backoff_max`); false when the run was told
    /// to stop (`stopped`) first.
    async fn back_off(
        &self,
        backoff: &mut Duration,
        stopped: &mut tokio::sync::watch::Receiver<bool>,
    ) -> bool {
        let wait = *backoff;
        *backoff =
            Backoff::new(self.config.retry_backoff, self.config.retry_backoff_max).next(*backoff);
        tokio::select! {
            biased;
            _ = stopped.wait_for(|s| *s) => false,
            () = tokio::time::sleep(wait) => true,
        }
    }
}

/// How one transaction of a lane ended.
enum Applied {
    /// Committed, offsets stored: what it did.
    Committed(BatchReport),
    /// Its partition was revoked before it committed: nothing applied.
    Revoked,
    /// The run stopped while it backed off: nothing applied.
    Stopped,
}

/// How the attempts of one transaction ended ([`Consumer::apply`]).
enum Applying {
    /// An attempt committed: the inbox's verdicts and the retry state.
    Committed(Vec<idem_core::store::Dedup>, Retries),
    /// The partition was revoked: not applied.
    Revoked,
    /// Stopped while backing off: not applied.
    Stopped,
}

/// How a lane ended: all its transactions done (or left to the partition's next owner), or
/// halted by a stop (its later transactions not applied), with what it committed.
enum LaneEnd {
    Done(BatchReport),
    Halted(BatchReport),
}

/// The run's shutdown future, polled only until it resolves (a resolved future must not be
/// polled again) and then ready for good; on resolving it tells the lanes (`tx`).
struct Latch<'f, F> {
    fut: std::pin::Pin<&'f mut F>,
    tx: tokio::sync::watch::Sender<bool>,
    fired: bool,
}

impl<F: Future<Output = ()>> Future for Latch<'_, F> {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.fired {
            return std::task::Poll::Ready(());
        }
        match self.fut.as_mut().poll(cx) {
            std::task::Poll::Ready(()) => {
                self.fired = true;
                let _ = self.tx.send(true);
                std::task::Poll::Ready(())
            }
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

impl BatchReport {
    /// Adds `other` (another transaction of the same fetched set).
    fn merge(&mut self, other: BatchReport) {
        self.records += other.records;
        self.processed += other.processed;
        self.duplicate_deliveries += other.duplicate_deliveries;
        self.duplicate_skips += other.duplicate_skips;
        self.conflicts += other.conflicts;
        self.dead_lettered += other.dead_lettered;
        self.retries += other.retries;
    }
}

/// Under the `transient-dead-letters` negative control, the reason to dead-letter an event after
/// its `n`th transient failure.
fn broken_transient_budget(n: u32, e: &Error) -> Option<String> {
    (n > crash::BROKEN_TRANSIENT_BUDGET && crash::broken(crash::Mechanism::TransientDeadLetters))
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
