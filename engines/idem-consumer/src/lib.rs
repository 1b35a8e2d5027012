#![doc = include_str!("../README.md")]

mod metrics;
pub mod replay;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::time::Duration;

use idem_core::crash::{
    self, CONSUMER_AFTER_DB_COMMIT_BEFORE_OFFSET_COMMIT, CONSUMER_AFTER_DEDUP_BEFORE_HANDLER,
};
use idem_core::{
    BoxError, DeadLetter, Dedup, Delivery, Error, EventId, InboundEvent, InboxEntry, InboxStore,
    Result, Source,
};
use sha2::{Digest, Sha256};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub use metrics::{ConsumerMetrics, MAX_LABEL_PAIRS, OTHER, total};

/// Why a handler did not apply an event.
#[derive(Debug)]
pub enum HandlerError {
    /// Might work later (database busy, a lock timeout, a dependency down): the batch is rolled
    /// back and retried with backoff (bounded, exponential) until it applies. A transient
    /// failure never dead-letters the event: while it lasts the batch, and with it this
    /// consumer's partitions, stand still (`idem_consumer_stalled_since_seconds`, alert
    /// `IdemConsumerStalled`). Return [`HandlerError::Permanent`] for what can never work.
    Transient(BoxError),
    /// Will never work (malformed payload, a business rule): the event is dead-lettered with
    /// this reason, and the rest of the batch is applied without it.
    Permanent(String),
}

impl HandlerError {
    /// A permanent failure with a person-readable reason.
    pub fn permanent(reason: impl Into<String>) -> Self {
        HandlerError::Permanent(reason.into())
    }

    /// A transient failure.
    pub fn transient(e: impl Into<BoxError>) -> Self {
        HandlerError::Transient(e.into())
    }
}

/// Applies events to the business tables, inside the consumer's transaction.
///
/// `C` is the store's connection type (`sqlx::PgConnection`, `sqlx::SqliteConnection`): the
/// handler writes through it, so its writes commit or roll back together with the inbox rows.
/// A handler must not commit, and must not call anything outside the transaction whose effect
/// cannot be rolled back (use the effect stage for external calls).
///
/// A handler must **return** the database errors it meets (as [`HandlerError::Transient`] or
/// [`HandlerError::Permanent`]), never swallow them: in PostgreSQL one failed statement aborts
/// the whole transaction. A statement that may fail by design ("insert, and a duplicate key
/// means done") belongs in a savepoint of the handler's own, or in `ON CONFLICT DO NOTHING`.
/// The runtime checks that the transaction is still usable before it commits
/// ([`InboxStore::check_usable`]); when a handler has swallowed an error, the batch is retried
/// one event at a time, the handler that left the transaction aborted is found, its event
/// retried as a transient failure, and nothing of the batch is acknowledged meanwhile.
pub trait Handler<C>: Send + Sync + 'static {
    /// Applies one new event.
    fn handle(
        &self,
        conn: &mut C,
        event: &InboundEvent,
    ) -> impl Future<Output = std::result::Result<(), HandlerError>> + Send;

    /// The business key whose rows `handle` locks. Events of a batch are applied sorted by it
    /// (stably, so one key keeps its delivery order), so concurrent batches take locks in the
    /// same order and do not deadlock. Default: the aggregate id.
    fn business_key(&self, event: &InboundEvent) -> String {
        event.aggregate_id.clone()
    }
}

/// Consumer settings.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// Consumer group: the inbox is keyed by (group, event id).
    pub group: String,
    /// Most records per transaction.
    pub batch_size: usize,
    /// How long to wait for more records after the first one of a batch.
    pub linger: Duration,
    /// Failures of a batch not caused by one event (the database unreachable, a failed commit)
    /// before [`Consumer::process`] gives up and returns the error; the offset is not committed,
    /// so nothing is lost, and a restarted consumer retries the batch. A transient failure of
    /// one event's handler is retried without limit: it never dead-letters the event.
    pub max_batch_retries: u32,
    /// First retry backoff; doubles per retry.
    pub retry_backoff: Duration,
    /// Longest retry backoff: a batch held up by a transient failure is retried at least this
    /// often for as long as the failure lasts.
    pub retry_backoff_max: Duration,
    /// How often `idem_consumer_lag` is measured (when the source can measure it).
    pub lag_interval: Duration,
}

impl ConsumerConfig {
    /// Defaults for `group`: batches of 200, 5 ms linger, retries from 100 ms doubling to at
    /// most 30 s (a transiently failing event is retried every 30 s until it applies; the
    /// database unreachable for 20 attempts, about eight minutes, ends the run).
    pub fn new(group: impl Into<String>) -> Self {
        ConsumerConfig {
            group: group.into(),
            batch_size: 200,
            linger: Duration::from_millis(5),
            max_batch_retries: 20,
            retry_backoff: Duration::from_millis(100),
            retry_backoff_max: Duration::from_secs(30),
            lag_interval: Duration::from_secs(5),
        }
    }
}

/// Decodes a record into an event, or says why it cannot be processed.
pub fn decode(d: &Delivery) -> std::result::Result<InboundEvent, String> {
    let id = d
        .header("ce_id")
        .ok_or("the record has no ce_id header (event id)")?;
    let event_id: EventId = id
        .parse()
        .map_err(|_| format!("ce_id {id:?} is not a UUID"))?;
    let event_type = d
        .header("ce_type")
        .ok_or("the record has no ce_type header (event type)")?;
    let bytes = d.payload.as_deref().ok_or("the record has no value")?;
    let payload: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| format!("the record value is not valid JSON: {e}"))?;
    // Text that reaches the inbox must be storable: PostgreSQL text cannot hold NUL.
    Ok(InboundEvent {
        event_id,
        event_type: clean(event_type),
        aggregate_type: clean(d.header("idem_aggregate_type").unwrap_or_default()),
        aggregate_id: clean(
            d.header("idem_aggregate_id")
                .or(d.key.as_deref())
                .unwrap_or_default(),
        ),
        payload,
        payload_hash: hex_sha256(bytes),
        traceparent: d.header("traceparent").map(str::to_owned),
        topic: d.topic.clone(),
        partition: d.partition,
        offset: d.offset,
    })
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// PostgreSQL `text` cannot hold NUL; dead letters keep everything else.
fn clean(s: &str) -> String {
    s.replace('\0', "\u{FFFD}")
}

fn dead_letter_of(d: &Delivery, event: Option<&InboundEvent>, reason: String) -> DeadLetter {
    DeadLetter {
        topic: d.topic.clone(),
        partition: d.partition,
        offset: d.offset,
        event_id: event
            .map(|e| e.event_id)
            .or_else(|| d.header("ce_id").and_then(|s| s.parse().ok())),
        event_type: event
            .map(|e| e.event_type.clone())
            .or_else(|| d.header("ce_type").map(clean)),
        reason: clean(&reason),
        key: d.key.as_deref().map(clean),
        payload: d
            .payload
            .as_deref()
            .map(|p| clean(&String::from_utf8_lossy(p))),
        headers: serde_json::Value::Object(
            d.headers
                .iter()
                .map(|(k, v)| (clean(k), serde_json::Value::String(clean(v))))
                .collect(),
        ),
    }
}

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

/// One distinct event of a batch with its copies.
struct Unique<'a> {
    event: &'a InboundEvent,
    delivery: &'a Delivery,
    copies: i32,
}

enum Attempt {
    Poison(EventId, String),
    Transient(Option<EventId>, Error),
    Fatal(Error),
    /// A handler reported success but left the transaction unable to commit
    /// ([`InboxStore::check_usable`]): retried at once with a savepoint per event, to find it.
    Unusable(Error),
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
        let mut report = BatchReport {
            records: records.len(),
            ..BatchReport::default()
        };
        if crash::broken(crash::BREAK_OFFSET_BEFORE_COMMIT) {
            // Negative control: the offsets move on before anything is applied.
            self.source.commit(&last_offsets(records)).await?;
        }
        let decoded: Vec<std::result::Result<InboundEvent, String>> =
            records.iter().map(decode).collect();
        let mut undecodable: Vec<DeadLetter> = vec![];
        let mut uniques: Vec<Unique<'_>> = vec![];
        let mut index: HashMap<EventId, usize> = HashMap::new();
        let mut in_batch_conflicts: Vec<(&InboundEvent, &Delivery)> = vec![];
        for (d, ev) in records.iter().zip(&decoded) {
            match ev {
                Err(reason) => undecodable.push(dead_letter_of(d, None, reason.clone())),
                Ok(ev) => match index.get(&ev.event_id) {
                    Some(&i) if uniques[i].event.payload_hash == ev.payload_hash => {
                        uniques[i].copies += 1
                    }
                    Some(_) => in_batch_conflicts.push((ev, d)),
                    None => {
                        index.insert(ev.event_id, uniques.len());
                        uniques.push(Unique {
                            event: ev,
                            delivery: d,
                            copies: 1,
                        });
                    }
                },
            }
        }

        let mut poison: HashMap<EventId, String> = HashMap::new();
        let mut batch_failures: u32 = 0;
        let mut event_failures: HashMap<EventId, u32> = HashMap::new();
        let mut backoff = self.config.retry_backoff;
        let topics: BTreeSet<&str> = records.iter().map(|r| r.topic.as_str()).collect();
        // After a first refused event (or a failed attempt) the batch is retried with a
        // savepoint per event, so any number of refused events costs one extra attempt, not one
        // per event, and each failure is charged to the event that caused it.
        let mut isolate = false;
        let outcome = loop {
            match self
                .attempt(
                    &uniques,
                    &poison,
                    &undecodable,
                    &in_batch_conflicts,
                    isolate,
                )
                .await
            {
                Ok((results, found)) => {
                    for (id, reason) in found {
                        tracing::warn!(event_id = %id, %reason, "dead-lettered an event the handler refused");
                        poison.insert(id, reason);
                    }
                    break results;
                }
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Unusable(e)) => {
                    tracing::warn!(error = %e, "a handler left the transaction aborted; retrying the batch one event at a time to find it");
                    report.retries += 1;
                    isolate = true;
                }
                Err(Attempt::Poison(id, reason)) => {
                    tracing::warn!(event_id = %id, %reason, "dead-lettering an event the handler refused");
                    poison.insert(id, reason);
                    isolate = true;
                }
                Err(Attempt::Transient(id, e)) => {
                    report.retries += 1;
                    // Retried with a savepoint per event, so that a failure is charged to the
                    // event that caused it.
                    isolate = true;
                    self.count_retry(records, &uniques, &topics, id);
                    // A transient failure never dead-letters: the batch is retried until it
                    // commits. Only failures no event is charged with (the database down) end
                    // the run after `max_batch_retries`, for a supervisor to restart it.
                    match id {
                        None => batch_failures += 1,
                        Some(id) => {
                            let n = event_failures.entry(id).or_default();
                            *n += 1;
                            if let Some(reason) = broken_transient_budget(*n, &e) {
                                // Negative control: the old policy, a transient failure
                                // dead-letters the event.
                                poison.insert(id, reason);
                                continue;
                            }
                        }
                    }
                    tracing::warn!(error = %e, event_id = ?id, retries = report.retries, "consumer transaction failed; retrying");
                    if batch_failures > self.config.max_batch_retries {
                        tracing::error!(error = %e, "giving up on the batch; its offset is not committed");
                        return Err(e);
                    }
                    if !self.back_off(&mut backoff, stop).await {
                        tracing::info!(
                            "stopping while the batch backs off; its offset is not committed"
                        );
                        return Ok(None);
                    }
                }
            }
        };
        self.metrics.clear_stalled(&self.config.group, &topics);

        let committed_at = std::time::SystemTime::now();
        // Counted only now: rolled-back attempts changed nothing.
        for (u, dedup) in uniques.iter().zip(&outcome) {
            let l = self.labels(u.event);
            let extra = u64::try_from(u.copies - 1).unwrap_or(0);
            let copies = u64::try_from(u.copies).unwrap_or(0);
            match dedup {
                Dedup::New if poison.contains_key(&u.event.event_id) => {
                    self.metrics.dead_lettered.with_label_values(&l).inc();
                    report.dead_lettered += 1;
                }
                Dedup::New => {
                    self.metrics.processed.with_label_values(&l).inc();
                    if let Some(published) = u.delivery.timestamp {
                        let waited = committed_at.duration_since(published).unwrap_or_default();
                        self.metrics
                            .publish_to_processed
                            .with_label_values(&l)
                            .observe(waited.as_secs_f64());
                    }
                    report.processed += 1;
                }
                Dedup::Duplicate => {}
                Dedup::Conflict => {
                    // Every copy is a conflicting delivery; one dead-letter row keeps the first.
                    self.metrics.conflicts.with_label_values(&l).inc_by(copies);
                    self.metrics.dead_lettered.with_label_values(&l).inc();
                    self.metrics
                        .duplicate_deliveries
                        .with_label_values(&l)
                        .inc_by(copies);
                    report.conflicts += copies;
                    report.dead_lettered += 1;
                    report.duplicate_deliveries += copies;
                }
            }
            let skipped = match dedup {
                Dedup::New => extra,
                Dedup::Duplicate => copies,
                Dedup::Conflict => 0,
            };
            if skipped > 0 {
                self.metrics
                    .duplicate_deliveries
                    .with_label_values(&l)
                    .inc_by(skipped);
                self.metrics
                    .duplicate_skips
                    .with_label_values(&l)
                    .inc_by(skipped);
                report.duplicate_deliveries += skipped;
                report.duplicate_skips += skipped;
            }
        }
        for (ev, _) in &in_batch_conflicts {
            let l = self.labels(ev);
            self.metrics.conflicts.with_label_values(&l).inc();
            self.metrics.dead_lettered.with_label_values(&l).inc();
            self.metrics
                .duplicate_deliveries
                .with_label_values(&l)
                .inc();
            report.conflicts += 1;
            report.dead_lettered += 1;
            report.duplicate_deliveries += 1;
        }
        for d in &undecodable {
            let l = self.metrics.labels(
                &d.topic,
                &self.config.group,
                d.event_type.as_deref().unwrap_or_default(),
                "",
            );
            self.metrics.dead_lettered.with_label_values(&l).inc();
            report.dead_lettered += 1;
        }

        crash::crash_point(CONSUMER_AFTER_DB_COMMIT_BEFORE_OFFSET_COMMIT)?;
        if crash::broken(crash::BREAK_SELECT_THEN_INSERT) {
            // Negative control: the inbox rows are written only now, after the business
            // commit, in a transaction of their own.
            let mut tx = self.inbox.begin().await?;
            let entries: Vec<InboxEntry<'_>> = uniques
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
            self.inbox.commit(tx).await?;
        }
        let done = last_offsets(records);
        if let Err(e) = self.source.commit(&done).await {
            // Not fatal: the batch is committed in the database; if it comes back, the inbox
            // skips it.
            self.metrics.offset_commit_failures.inc();
            tracing::warn!(error = %e, "committing offsets failed; the batch may be delivered again and skipped");
        }
        Ok(Some(report))
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
    fn count_retry(
        &self,
        records: &[Delivery],
        uniques: &[Unique<'_>],
        topics: &BTreeSet<&str>,
        id: Option<EventId>,
    ) {
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
            .set_stalled(&self.config.group, topics, now.max(1));
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

    async fn attempt(
        &self,
        uniques: &[Unique<'_>],
        poison: &HashMap<EventId, String>,
        undecodable: &[DeadLetter],
        in_batch_conflicts: &[(&InboundEvent, &Delivery)],
        isolate: bool,
    ) -> std::result::Result<(Vec<Dedup>, Vec<(EventId, String)>), Attempt> {
        let selected = if crash::broken(crash::BREAK_SELECT_THEN_INSERT) {
            // Negative control: "is it new?" asked in a transaction of its own, rolled back.
            let mut probe = self
                .inbox
                .begin()
                .await
                .map_err(|e| Attempt::Transient(None, e))?;
            let entries = inbox_entries(uniques, poison);
            let found = self
                .inbox
                .record(&mut probe, self.inbox_group(), &entries)
                .await
                .map_err(|e| Attempt::Transient(None, e))?;
            let _ = self.inbox.rollback(probe).await;
            Some(found)
        } else {
            None
        };
        let mut tx = self
            .inbox
            .begin()
            .await
            .map_err(|e| Attempt::Transient(None, e))?;
        match self
            .attempt_in(
                &mut tx,
                uniques,
                poison,
                undecodable,
                in_batch_conflicts,
                isolate,
                selected,
            )
            .await
        {
            Ok(results) => {
                self.inbox
                    .commit(tx)
                    .await
                    .map_err(|e| Attempt::Transient(None, e))?;
                Ok(results)
            }
            Err(e) => {
                if let Err(rb) = self.inbox.rollback(tx).await {
                    tracing::warn!(error = %rb, "rollback failed (the connection is discarded)");
                }
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn attempt_in(
        &self,
        tx: &mut I::Tx,
        uniques: &[Unique<'_>],
        poison: &HashMap<EventId, String>,
        undecodable: &[DeadLetter],
        in_batch_conflicts: &[(&InboundEvent, &Delivery)],
        isolate: bool,
        selected: Option<Vec<Dedup>>,
    ) -> std::result::Result<(Vec<Dedup>, Vec<(EventId, String)>), Attempt> {
        let entries = inbox_entries(uniques, poison);
        let results = match selected {
            Some(found) => found,
            None => self
                .inbox
                .record(&mut *tx, self.inbox_group(), &entries)
                .await
                .map_err(|e| Attempt::Transient(None, e))?,
        };
        crash::crash_point(CONSUMER_AFTER_DEDUP_BEFORE_HANDLER).map_err(Attempt::Fatal)?;

        let mut apply: Vec<(String, &Unique<'_>)> = uniques
            .iter()
            .zip(&results)
            .filter(|(u, r)| **r == Dedup::New && !poison.contains_key(&u.event.event_id))
            .map(|(u, _)| (self.handler.business_key(u.event), u))
            .collect();
        apply.sort_by(|a, b| a.0.cmp(&b.0)); // stable: one key keeps its delivery order
        let mut found: Vec<(EventId, String)> = vec![];
        for (_, u) in &apply {
            let span = handle_span(u.event);
            if isolate {
                self.inbox
                    .savepoint(&mut *tx)
                    .await
                    .map_err(|e| Attempt::Transient(None, e))?;
            }
            match self
                .handler
                .handle(&mut *tx, u.event)
                .instrument(span)
                .await
            {
                Ok(()) if isolate => {
                    // Reported success, but did it leave the transaction usable?
                    if let Err(e) = self.inbox.check_usable(&mut *tx).await {
                        self.inbox
                            .rollback_to_savepoint(&mut *tx)
                            .await
                            .map_err(|e| Attempt::Transient(None, e))?;
                        return Err(Attempt::Transient(Some(u.event.event_id), e));
                    }
                    self.inbox
                        .release_savepoint(&mut *tx)
                        .await
                        .map_err(|e| Attempt::Transient(None, e))?;
                }
                Ok(()) => {}
                Err(HandlerError::Permanent(reason)) if isolate => {
                    self.inbox
                        .rollback_to_savepoint(&mut *tx)
                        .await
                        .map_err(|e| Attempt::Transient(None, e))?;
                    found.push((u.event.event_id, reason));
                }
                Err(HandlerError::Permanent(reason)) => {
                    return Err(Attempt::Poison(u.event.event_id, reason));
                }
                // Without savepoints the failure may be an earlier handler's doing (one that
                // swallowed an error and left the transaction aborted): it is charged to the
                // event only when the events are isolated.
                Err(HandlerError::Transient(e)) => {
                    return Err(Attempt::Transient(
                        isolate.then_some(u.event.event_id),
                        Error::database("running the handler", e),
                    ));
                }
            }
        }

        if !isolate && let Err(e) = self.inbox.check_usable(&mut *tx).await {
            // A handler swallowed a database error; which one, isolating each tells.
            return Err(Attempt::Unusable(e));
        }
        if !found.is_empty() {
            let ids: Vec<EventId> = found.iter().map(|(id, _)| *id).collect();
            self.inbox
                .mark_dead_lettered(&mut *tx, self.inbox_group(), &ids)
                .await
                .map_err(|e| Attempt::Transient(None, e))?;
        }
        let found_reasons: HashMap<EventId, &String> =
            found.iter().map(|(id, r)| (*id, r)).collect();
        let mut letters: Vec<DeadLetter> = undecodable.to_vec();
        let mut seen: HashSet<(String, i32, i64)> = HashSet::new();
        for (u, r) in uniques.iter().zip(&results) {
            if let Some(reason) = poison
                .get(&u.event.event_id)
                .or(found_reasons.get(&u.event.event_id).copied())
                && *r == Dedup::New
            {
                letters.push(dead_letter_of(u.delivery, Some(u.event), reason.clone()));
            }
            if *r == Dedup::Conflict {
                letters.push(dead_letter_of(
                    u.delivery,
                    Some(u.event),
                    format!(
                        "idempotency conflict: event {} was received before with a different payload; not applied",
                        u.event.event_id
                    ),
                ));
            }
        }
        for (ev, d) in in_batch_conflicts {
            letters.push(dead_letter_of(
                d,
                Some(ev),
                format!("idempotency conflict: event {} appears twice in one batch with different payloads; not applied", ev.event_id),
            ));
        }
        letters.retain(|l| seen.insert((l.topic.clone(), l.partition, l.offset)));
        self.inbox
            .dead_letter(&mut *tx, &self.config.group, &letters)
            .await
            .map_err(|e| Attempt::Transient(None, e))?;
        Ok((results, found))
    }
}

/// Under the `transient-dead-letters` negative control, the reason to dead-letter an event after
/// its `n`th transient failure.
fn broken_transient_budget(n: u32, e: &Error) -> Option<String> {
    (n > crash::BROKEN_TRANSIENT_BUDGET && crash::broken(crash::BREAK_TRANSIENT_DEAD_LETTERS))
        .then(|| format!("gave up after {n} transient failures; last: {e}"))
}

/// The span the handler runs in for one event: `idem.handle`, a consumer span whose parent is
/// the remote context of the event's `traceparent` (captured at enqueue, carried in the Kafka
/// header), so an OpenTelemetry exporter links the handler to the trace that produced the
/// event. Without a `tracing-opentelemetry` layer the parent is simply not recorded.
fn handle_span(event: &InboundEvent) -> tracing::Span {
    let span = tracing::info_span!(
        "idem.handle",
        otel.kind = "consumer",
        event_id = %event.event_id,
        event_type = %event.event_type,
        messaging.destination.name = %event.topic,
    );
    if let Some(cx) = event
        .traceparent
        .as_deref()
        .and_then(idem_core::trace::remote_context)
    {
        // Fails only when no OpenTelemetry layer is installed: nothing to link then.
        let _ = span.set_parent(cx);
    }
    span
}

/// The `traceparent` an effect recorded by a handler should carry (see the effect stage): the
/// context of the consumer span the handler runs in, when an OpenTelemetry layer is installed,
/// so the outbound HTTP call is a child of it; otherwise the event's own `traceparent`. Either
/// way the trace id is the one captured at enqueue.
pub fn effect_traceparent(event: &InboundEvent) -> Option<String> {
    idem_core::trace::traceparent_of(&tracing::Span::current().context())
        .or_else(|| event.traceparent.clone())
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

fn inbox_entries<'a>(
    uniques: &[Unique<'a>],
    poison: &HashMap<EventId, String>,
) -> Vec<InboxEntry<'a>> {
    uniques
        .iter()
        .map(|u| InboxEntry {
            event: u.event,
            copies: u.copies,
            dead_lettered: poison.contains_key(&u.event.event_id),
        })
        .collect()
}

/// The offset of the last record of each partition in `records`.
fn last_offsets(records: &[Delivery]) -> Vec<(String, i32, i64)> {
    let mut last: BTreeMap<(String, i32), i64> = BTreeMap::new();
    for r in records {
        let e = last
            .entry((r.topic.clone(), r.partition))
            .or_insert(r.offset);
        *e = (*e).max(r.offset);
    }
    last.into_iter().map(|((t, p), o)| (t, p, o)).collect()
}
