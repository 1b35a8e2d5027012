//! The consumer side: a Kafka consumer group as an [`idem_core::store::Source`].
//!
//! # Delivery semantics
//!
//! At least once. [`consumer_config`] forces `enable.auto.commit=false` and
//! `enable.auto.offset.store=false`: an offset is stored only by [`Source::commit`], which the
//! consumer runtime calls after the database transaction of those records committed, and then
//! committed **asynchronously** (`commit_consumer_state(Async)`: the next batch does not wait
//! for the broker's answer). What was stored is committed synchronously before a partition is
//! revoked and when the runtime stops ([`Source::close`]); dropping the source leaves the group,
//! which revokes, so a crashed member's stored offsets are committed too. A crash before the
//! offsets are committed redelivers the batch, which the inbox absorbs. `auto.offset.reset`
//! defaults to `earliest`, so a new group starts from the beginning rather than skipping what
//! is there.
//!
//! On a rebalance, the records of *revoked* partitions collected before the rebalance are
//! dropped from the batch (nothing of them was processed or committed); the partitions' new
//! owners — possibly this consumer again — start from the committed offsets. Records received
//! after the rebalance are kept. The runtime asks [`Source::revoked_since`] before each attempt
//! of a partition's records, so a batch fetched ahead is not applied after its partition was
//! revoked; an attempt already running when the revocation arrives finishes (its offsets are
//! then refused, as the partition is no longer assigned, and the new owner's redelivery is
//! absorbed by the inbox).
//!
//! # Group membership
//!
//! A source made with [`KafkaSource::with_health`] reports its place in the group as the
//! [`GROUP`] dependency of a [`Health`]: not ready until the group's first assignment reaches
//! it, ready from then on — with any number of partitions, zero included (a group with more
//! members than partitions has members that hold none: they are members all the same, ready to
//! take over a partition in the next rebalance) — and not ready once librdkafka declares the
//! assignment lost (no heartbeat answered within `session.timeout.ms`, the member fenced) or a
//! rebalance fails, until the next assignment. An ordinary rebalance, which revokes and assigns
//! again, leaves the member ready.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_core::health::Health;
use idem_core::store::{Delivery, LagProbe, Source};
use idem_core::{Error, Result};

use crate::security::Connection;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};

/// Consumer settings the guarantee depends on; [`consumer_config`] refuses to change them.
pub const FORCED_CONSUMER_SETTINGS: &[(&str, &str)] = &[
    ("enable.auto.commit", "false"),
    ("enable.auto.offset.store", "false"),
];

/// Consumer defaults a user may override.
pub const DEFAULT_CONSUMER_SETTINGS: &[(&str, &str)] = &[
    ("auto.offset.reset", "earliest"),
    ("enable.partition.eof", "false"),
    ("session.timeout.ms", "10000"),
    ("heartbeat.interval.ms", "1000"),
    ("max.poll.interval.ms", "300000"),
    // Notice a subscribed topic created after start-up within seconds, not minutes.
    ("topic.metadata.refresh.interval.ms", "10000"),
    // How long a broker may hold a fetch that found nothing. Kafka answers as soon as a record
    // arrives, so this only paces an idle consumer (at most 20 fetches a second per broker);
    // brokers that hold an empty fetch for the whole wait (Tansu 0.6, librdkafka's mock
    // cluster) add up to this much latency to every event: librdkafka's 500 ms made the
    // commit → settlement p99 about 550 ms there (`idem-lab bench`, docs/operating/performance.md). 20 ms
    // was faster still, but Tansu 0.6 then lost the rebalance after a member died (the
    // settlement crash test failed 4 runs of 6; 50 ms passed 6 of 6).
    ("fetch.wait.max.ms", "50"),
    // Fetch and offset-commit requests are sent at once, not held back by Nagle's algorithm.
    ("socket.nagle.disable", "true"),
    // Records prefetched ahead of the runtime. librdkafka's 64 MiB (on top of 100 000 queued
    // records) put a consumer draining a backlog at 98 MiB resident; a batch is a few hundred
    // records, so 16 MiB still keeps the runtime fed.
    ("queued.max.messages.kbytes", "16384"),
    // The same prefetch counted in records (librdkafka: 100 000), a few seconds of a drain.
    ("queued.min.messages", "20000"),
    // One fetch response may overshoot the queue limit by this much (librdkafka: 50 MiB).
    ("fetch.max.bytes", "8388608"),
];

/// The defaults that bound a consumer's memory (the prefetch), checked by a test like the
/// forced settings.
pub const PREFETCH_LIMITS: &[&str] = &[
    "queued.max.messages.kbytes",
    "queued.min.messages",
    "fetch.max.bytes",
];

/// Settings of the classic group protocol only: with `group.protocol=consumer` (KIP-848) the
/// broker owns them, so idem's defaults for them are left out.
pub const CLASSIC_GROUP_SETTINGS: &[&str] = &["session.timeout.ms", "heartbeat.interval.ms"];

/// Builds a consumer configuration for `group` on a PLAINTEXT connection to `brokers`:
/// [`Connection::consumer_config`] of [`Connection::plaintext`].
pub fn consumer_config(
    brokers: &str,
    group: &str,
    overrides: &[(String, String)],
) -> Result<ClientConfig> {
    Connection::plaintext(brokers).consumer_config(group, overrides)
}

/// A consumer configuration for `group`: the connection's servers and security, `overrides`
/// on top of idem's defaults, the at-least-once settings forced; an override of a security
/// setting the connection sets differently is refused, and the resulting security validated.
pub(crate) fn consumer_config_for(
    conn: &Connection,
    group: &str,
    overrides: &[(String, String)],
) -> Result<ClientConfig> {
    let mut cfg = conn.client_config();
    cfg.set("group.id", group).set("client.id", "idem-consumer");
    // KIP-848 (`group.protocol=consumer`) moves session timeouts and heartbeats to the broker,
    // and librdkafka refuses a consumer that sets them itself.
    let kip848 = overrides
        .iter()
        .any(|(k, v)| k == "group.protocol" && v == "consumer");
    for (k, v) in DEFAULT_CONSUMER_SETTINGS {
        if kip848 && CLASSIC_GROUP_SETTINGS.contains(k) {
            continue;
        }
        cfg.set(*k, *v);
    }
    for (k, v) in overrides {
        if let Some((_, forced)) = FORCED_CONSUMER_SETTINGS.iter().find(|(fk, _)| fk == k)
            && v != forced
        {
            return Err(Error::Config(format!(
                "consumer setting {k}={v} is refused: offsets must be committed only after the database commit ({k}={forced})"
            )));
        }
        if k == "group.id" || k == "bootstrap.servers" {
            return Err(Error::Config(format!(
                "set {k} with its own option, not as a consumer setting"
            )));
        }
        conn.check_override("consumer", k, v)?;
        cfg.set(k.as_str(), v.as_str());
    }
    for (k, v) in FORCED_CONSUMER_SETTINGS {
        cfg.set(*k, *v);
    }
    crate::validate_security(&cfg)?;
    Ok(cfg)
}

/// How many revocations [`Revocations`] remembers; a batch older than that is treated as
/// revoked entirely (dropped, and fetched again by the partitions' owners).
const REMEMBERED_REVOCATIONS: usize = 4096;

/// The partitions revoked from this member, each with the epoch of its revocation (epochs
/// count revoked partitions from 1).
#[derive(Default)]
struct Revocations {
    /// The latest epoch.
    epoch: u64,
    /// The most recent revocations, oldest first.
    log: std::collections::VecDeque<(u64, String, i32)>,
}

impl Revocations {
    fn revoke(&mut self, topic: &str, partition: i32) {
        self.epoch += 1;
        self.log
            .push_back((self.epoch, topic.to_owned(), partition));
        if self.log.len() > REMEMBERED_REVOCATIONS {
            self.log.pop_front();
        }
    }

    /// Whether `partition` of `topic` was revoked after `epoch`. True also when the log no
    /// longer reaches back to `epoch`: dropping records is safe (they are delivered again),
    /// applying those of a revoked partition is not what the runtime promises.
    fn revoked_since(&self, topic: &str, partition: i32, epoch: u64) -> bool {
        if epoch >= self.epoch {
            return false;
        }
        let forgotten = self
            .log
            .front()
            .is_none_or(|(first, _, _)| *first > epoch + 1);
        forgotten
            || self
                .log
                .iter()
                .rev()
                .take_while(|(e, _, _)| *e > epoch)
                .any(|(_, t, p)| t == topic && *p == partition)
    }
}

/// The dependency name of a consumer's membership of its group ([`KafkaSource::with_health`]).
pub const GROUP: &str = "group";

/// What a rebalance event says about this member's place in the group.
#[derive(Debug, PartialEq, Eq)]
enum Membership {
    /// An assignment reached the member: it is in the group (with this many partitions, zero
    /// included).
    Holds(usize),
    /// The member is out of the group until the next assignment, for this reason.
    Out(String),
    /// Nothing changes (a revocation in an ordinary rebalance).
    Unchanged,
}

/// The membership after `rebalance`; `lost` is librdkafka's `assignment_lost()` at the time.
fn membership(rebalance: &Rebalance<'_>, lost: bool) -> Membership {
    match rebalance {
        Rebalance::Assign(tpl) => Membership::Holds(tpl.count()),
        Rebalance::Revoke(_) if lost => Membership::Out(
            "the group assignment was lost: no heartbeat was answered within session.timeout.ms, \
             or the member was fenced; waiting for the next assignment"
                .to_owned(),
        ),
        Rebalance::Revoke(_) => Membership::Unchanged,
        Rebalance::Error(e) => Membership::Out(format!("the rebalance failed: {e}")),
    }
}

/// Records revoked partitions, commits stored offsets synchronously before partitions are
/// revoked, logs failed asynchronous commits, and reports the group membership ([`GROUP`])
/// when made with a [`Health`].
#[derive(Default)]
pub struct RebalanceContext {
    revoked: std::sync::Mutex<Revocations>,
    /// Asynchronous offset commits the broker refused or never answered.
    commit_failures: AtomicU64,
    /// Where the membership is reported, if anywhere.
    health: Option<Health>,
}

impl std::fmt::Debug for RebalanceContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RebalanceContext")
            .field("commit_failures", &self.commit_failures)
            .finish_non_exhaustive()
    }
}

impl RebalanceContext {
    fn revocations(&self) -> std::sync::MutexGuard<'_, Revocations> {
        self.revoked.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn epoch(&self) -> u64 {
        self.revocations().epoch
    }

    /// Reports what `rebalance` says about the membership.
    fn report(&self, rebalance: &Rebalance<'_>, lost: bool) {
        let Some(health) = &self.health else {
            return;
        };
        match membership(rebalance, lost) {
            Membership::Holds(_) => health.ok(GROUP),
            Membership::Out(reason) => health.failed(GROUP, &reason),
            Membership::Unchanged => {}
        }
    }
}

impl ClientContext for RebalanceContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        crate::client_log::log_line(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        crate::client_log::global_error(&error, reason);
    }
}

/// Whether a commit error only says there was nothing stored to commit.
fn nothing_to_commit(e: &KafkaError) -> bool {
    matches!(
        e,
        KafkaError::ConsumerCommit(rdkafka::error::RDKafkaErrorCode::NoOffset)
    )
}

impl ConsumerContext for RebalanceContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        self.report(rebalance, consumer.assignment_lost());
        if let Rebalance::Revoke(tpl) = rebalance {
            {
                let mut revoked = self.revocations();
                for e in tpl.elements() {
                    revoked.revoke(e.topic(), e.partition());
                }
            }
            tracing::info!(partitions = tpl.count(), "partitions revoked");
            // Everything stored was committed in the database first.
            if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync)
                && !nothing_to_commit(&e)
            {
                tracing::warn!(error = %e, "committing stored offsets before a revocation");
            }
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            tracing::info!(partitions = tpl.count(), "partitions assigned");
        }
    }

    fn commit_callback(
        &self,
        result: rdkafka::error::KafkaResult<()>,
        _offsets: &TopicPartitionList,
    ) {
        if let Err(e) = result
            && !nothing_to_commit(&e)
        {
            self.commit_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "an offset commit failed; the next commit (or the revocation's) carries the stored offsets again");
        }
    }
}

/// A Kafka consumer group member feeding the consumer runtime.
pub struct KafkaSource {
    consumer: Arc<StreamConsumer<RebalanceContext>>,
    transient_errors: Arc<AtomicU64>,
    /// The revocation epoch the last batch is current at ([`Source::epoch`]).
    batch_epoch: AtomicU64,
    /// The `group.id` it joined.
    group: Option<String>,
    /// The topics it subscribed to.
    topics: Vec<String>,
    /// How to reach the cluster, for an admin request beside the consumer.
    connection: ClientConfig,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource")
            .field("group", &self.group)
            .field("transient_errors", &self.transient_errors)
            .finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// Joins the group in `config` and subscribes to `topics`.
    pub fn new(config: &ClientConfig, topics: &[String]) -> Result<Self> {
        Self::create(config, topics, RebalanceContext::default())
    }

    /// [`KafkaSource::new`], reporting the membership of the group into `health` as [`GROUP`]
    /// (expected from now on: not ready until the first assignment).
    pub fn with_health(config: &ClientConfig, topics: &[String], health: &Health) -> Result<Self> {
        health.expect(GROUP);
        let context = RebalanceContext {
            health: Some(health.clone()),
            ..RebalanceContext::default()
        };
        Self::create(config, topics, context)
    }

    fn create(config: &ClientConfig, topics: &[String], context: RebalanceContext) -> Result<Self> {
        let consumer: StreamConsumer<RebalanceContext> =
            config.create_with_context(context).map_err(|e| {
                Error::broker(
                    "creating the Kafka consumer",
                    crate::security::client_error(&e),
                )
            })?;
        let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&refs)
            .map_err(|e| Error::broker(format!("subscribing to {}", topics.join(", ")), e))?;
        Ok(KafkaSource {
            consumer: Arc::new(consumer),
            transient_errors: Arc::default(),
            batch_epoch: AtomicU64::new(0),
            group: config.get("group.id").map(str::to_owned),
            topics: topics.to_vec(),
            connection: crate::admin::connection_only(config),
        })
    }

    /// The offset this group has committed for a partition (the next one to read), if any.
    pub fn committed(&self, topic: &str, partition: i32, timeout: Duration) -> Result<Option<i64>> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(topic, partition);
        let c = self
            .consumer
            .committed_offsets(tpl, timeout)
            .map_err(|e| Error::broker("reading committed offsets", e))?;
        Ok(c.elements().first().and_then(|e| match e.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        }))
    }
}

/// A consumed record as the consumer runtime sees it.
pub fn to_delivery(m: &rdkafka::message::BorrowedMessage<'_>) -> Delivery {
    Delivery {
        topic: m.topic().to_owned(),
        partition: m.partition(),
        offset: m.offset(),
        key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
        payload: m.payload().map(<[u8]>::to_vec),
        headers: crate::inspect::headers_of(m),
        timestamp: m
            .timestamp()
            .to_millis()
            .and_then(|ms| u64::try_from(ms).ok())
            .map(|ms| std::time::UNIX_EPOCH + Duration::from_millis(ms)),
    }
}

/// How long the lag probe waits for one broker answer.
const LAG_TIMEOUT: Duration = Duration::from_secs(2);

/// This member's lag per topic: for each assigned partition, the high watermark minus the
/// position (the next offset the member will hand to the runtime), summed per topic. A partition
/// the member has read nothing from yet counts from the group's committed offset, or, with none,
/// from the low watermark (idem's `auto.offset.reset=earliest`). Partitions whose watermarks
/// cannot be read within [`LAG_TIMEOUT`] are left out. One watermark request per assigned
/// partition: call it every few seconds, not per batch.
fn lag<C: ConsumerContext>(consumer: &StreamConsumer<C>) -> Vec<(String, i64)> {
    let Ok(assignment) = consumer.assignment() else {
        return vec![];
    };
    let offset_of = |tpl: &TopicPartitionList, topic: &str, partition: i32| {
        tpl.find_partition(topic, partition)
            .and_then(|e| match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            })
    };
    let positions = consumer.position().unwrap_or_default();
    let mut committed: Option<TopicPartitionList> = None;
    let mut by_topic: std::collections::BTreeMap<String, i64> = Default::default();
    for e in assignment.elements() {
        let (topic, partition) = (e.topic(), e.partition());
        let total = by_topic.entry(topic.to_owned()).or_insert(0);
        let Ok((low, high)) = consumer.fetch_watermarks(topic, partition, LAG_TIMEOUT) else {
            continue;
        };
        let position = offset_of(&positions, topic, partition).or_else(|| {
            let c = committed.get_or_insert_with(|| {
                consumer
                    .committed_offsets(assignment.clone(), LAG_TIMEOUT)
                    .unwrap_or_default()
            });
            offset_of(c, topic, partition)
        });
        *total += (high - position.unwrap_or(low)).max(0);
    }
    by_topic.into_iter().collect()
}

impl KafkaSource {
    /// If partitions were revoked since `seen`, drops the records of those partitions from
    /// `batch`. Nothing of them was applied or committed, and librdkafka starts a partition's
    /// next owner — possibly this consumer again — from the committed offset, so they are
    /// delivered again rather than lost.
    fn drop_revoked(&self, batch: &mut Vec<Delivery>, seen: &mut u64) {
        let revoked = self.consumer.context().revocations();
        if revoked.epoch == *seen {
            return;
        }
        let before = batch.len();
        batch.retain(|d| !revoked.revoked_since(&d.topic, d.partition, *seen));
        *seen = revoked.epoch;
        drop(revoked);
        if before != batch.len() {
            tracing::info!(
                dropped = before - batch.len(),
                "records of revoked partitions dropped from the batch"
            );
        }
    }

    /// Asynchronous offset commits that failed since this source was created (each is carried
    /// again by the next commit, the revocation's or [`Source::close`]'s).
    pub fn commit_failures(&self) -> u64 {
        self.consumer
            .context()
            .commit_failures
            .load(Ordering::Relaxed)
    }

    /// The next record. librdkafka reports transient trouble (a broker down, a connection
    /// refused, the poll interval exceeded) as errors in the same queue as the records, one
    /// event per reconnect attempt, and recovers from it on its own: such errors are logged and
    /// the wait goes on. Handing each one to the runtime's retry backoff (up to 5 s) made a
    /// consumer spend minutes working through a burst of stale errors after a broker restart
    /// while its partitions sat idle (found by `idem-lab chaos`). A fatal error ends the wait:
    /// the client can never fetch again ([`Error::BrokerFatal`]).
    async fn next_record(&self) -> Result<BorrowedMessage<'_>> {
        loop {
            self.check_fatal()?;
            match self.consumer.recv().await {
                Ok(m) => return Ok(m),
                Err(e) if is_fatal(&e) || self.consumer.client().fatal_error().is_some() => {
                    return Err(Error::broker_fatal("receiving records", e));
                }
                Err(e) => {
                    self.transient_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, "broker trouble while receiving records; librdkafka recovers on its own, waiting on");
                }
            }
        }
    }

    /// [`Error::BrokerFatal`] once the client has had a fatal error (it never fetches again).
    fn check_fatal(&self) -> Result<()> {
        match self.consumer.client().fatal_error() {
            Some((code, reason)) => Err(Error::broker_fatal(
                "receiving records",
                format!("{code:?}: {reason}"),
            )),
            None => Ok(()),
        }
    }

    /// A counter of the transient client errors waited out while receiving records, since this
    /// source was created (it stays readable while the source is in use).
    pub fn transient_errors(&self) -> Arc<AtomicU64> {
        self.transient_errors.clone()
    }
}

/// How long a consumer looks at start for a subscribed topic the cluster does not know (one
/// being created as the consumer starts), before it refuses to run.
const TOPIC_WAIT: Duration = Duration::from_secs(10);

/// The subscribed topics the cluster does not have after [`TOPIC_WAIT`] (patterns, `^…`, left
/// out) and a broker that answered, or `None` when the cluster did not answer: a broker that
/// is down is waited for by the run, not refused.
fn missing_topics(
    consumer: &StreamConsumer<RebalanceContext>,
    topics: &[String],
) -> Option<(Vec<String>, Option<i32>)> {
    let deadline = std::time::Instant::now() + TOPIC_WAIT;
    loop {
        let mut missing = vec![];
        let mut broker = None;
        for topic in topics.iter().filter(|t| !t.starts_with('^')) {
            let metadata = consumer.fetch_metadata(Some(topic), TOPIC_WAIT).ok()?;
            broker = broker.or_else(|| metadata.brokers().first().map(|b| b.id()));
            let unknown = metadata.topics().iter().all(|m| {
                m.name() != topic
                    || m.error()
                        == Some(
                            rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART,
                        )
            });
            if unknown {
                missing.push(topic.clone());
            }
        }
        if missing.is_empty() || std::time::Instant::now() >= deadline {
            return Some((missing, broker));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// What a consumer does about subscribed topics the cluster does not have, given whether the
/// cluster creates topics on their first record (`creates`, `None`: unknown): refuse to start
/// when it creates none (nothing will ever arrive); otherwise start, saying that it waits.
fn missing_topic_verdict(missing: &[String], creates: Option<bool>) -> Result<()> {
    let topics = missing.join(", ");
    match creates {
        Some(false) => Err(Error::InvalidArgument {
            argument: "topics",
            reason: format!(
                "the cluster has no topic {topics} (looked for {} s) and creates none on its own \
                 (auto.create.topics.enable=false): create it (`idem topic create --topic …`) or \
                 correct the consumer's topics",
                TOPIC_WAIT.as_secs()
            ),
        }),
        Some(true) => {
            tracing::warn!(
                topics,
                "no such topic yet; the cluster creates it with its first record, which the consumer then reads"
            );
            Ok(())
        }
        None => {
            tracing::warn!(
                topics,
                "no such topic, and whether the cluster creates topics could not be read; the consumer waits for it"
            );
            Ok(())
        }
    }
}

/// Whether librdkafka marked this consumer error fatal: the client cannot consume again.
fn is_fatal(e: &KafkaError) -> bool {
    matches!(e, KafkaError::MessageConsumptionFatal(_))
}

impl Source for KafkaSource {
    fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }

    async fn check_topics(&self) -> Result<()> {
        let (consumer, topics) = (Arc::clone(&self.consumer), self.topics.clone());
        let missing = tokio::task::spawn_blocking(move || missing_topics(&consumer, &topics))
            .await
            .map_err(|e| Error::broker("looking up the subscribed topics", e))?;
        match missing {
            Some((missing, broker)) if !missing.is_empty() => {
                let creates = match broker {
                    Some(id) => {
                        crate::admin::broker_auto_creates_topics(&self.connection, id, TOPIC_WAIT)
                            .await
                    }
                    None => None,
                };
                missing_topic_verdict(&missing, creates)
            }
            Some(_) => Ok(()),
            None => {
                tracing::warn!(
                    "the cluster did not answer a metadata request at start; the subscribed topics are not checked"
                );
                Ok(())
            }
        }
    }

    async fn next_batch(&self, max: usize, linger: Duration) -> Result<Vec<Delivery>> {
        let mut seen = self.consumer.context().epoch();
        let first = self.next_record().await?;
        let mut batch: Vec<Delivery> = Vec::with_capacity(max.min(4096));
        self.drop_revoked(&mut batch, &mut seen);
        batch.push(to_delivery(&first));
        drop(first);
        let deadline = tokio::time::Instant::now() + linger;
        while batch.len() < max {
            match tokio::time::timeout_at(deadline, self.consumer.recv()).await {
                Ok(Ok(m)) => {
                    // A rebalance is served inside recv(): records collected before it from a
                    // revoked partition are dropped; the one just received is current.
                    self.drop_revoked(&mut batch, &mut seen);
                    batch.push(to_delivery(&m));
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "receiving records");
                    break;
                }
                Err(_) => break,
            }
        }
        self.drop_revoked(&mut batch, &mut seen);
        self.batch_epoch.store(seen, Ordering::SeqCst);
        Ok(batch)
    }

    /// Stores the offsets, then commits them asynchronously: the runtime goes on without
    /// waiting for the broker. A failed commit is logged ([`KafkaSource::commit_failures`]);
    /// the stored offsets go with the next commit.
    async fn commit(&self, done: &[(String, i32, i64)]) -> Result<()> {
        let mut tpl = TopicPartitionList::new();
        for (topic, partition, offset) in done {
            tpl.add_partition_offset(topic, *partition, Offset::Offset(offset + 1))
                .map_err(|e| Error::broker("building the offset list", e))?;
        }
        self.consumer
            .store_offsets(&tpl)
            .map_err(|e| Error::broker("storing offsets", e))?;
        match self.consumer.commit_consumer_state(CommitMode::Async) {
            Err(e) if !nothing_to_commit(&e) => Err(Error::broker("committing offsets", e)),
            _ => Ok(()),
        }
    }

    fn epoch(&self) -> u64 {
        self.batch_epoch.load(Ordering::SeqCst)
    }

    fn revoked_since(&self, topic: &str, partition: i32, epoch: u64) -> bool {
        self.consumer
            .context()
            .revocations()
            .revoked_since(topic, partition, epoch)
    }

    /// Commits the stored offsets synchronously (nothing stored is not an error).
    async fn close(&self) -> Result<()> {
        let consumer = self.consumer.clone();
        tokio::task::spawn_blocking(move || consumer.commit_consumer_state(CommitMode::Sync))
            .await
            .map_err(|e| Error::broker("committing offsets at shutdown", e))?
            .or_else(|e| {
                if nothing_to_commit(&e) {
                    Ok(())
                } else {
                    Err(Error::broker("committing offsets at shutdown", e))
                }
            })
    }

    fn lag_probe(&self) -> Option<LagProbe> {
        let consumer = self.consumer.clone();
        Some(Arc::new(move || lag(&consumer)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_topic_is_refused_only_on_a_cluster_that_creates_none() {
        let missing = ["orders.typo".to_owned()];
        let e = missing_topic_verdict(&missing, Some(false)).unwrap_err();
        assert_eq!(e.kind(), idem_core::ErrorKind::Config);
        let text = e.to_string();
        assert!(
            text.contains("orders.typo") && text.contains("idem topic create"),
            "{text}"
        );
        // The first record creates it, or whether it will cannot be read: the consumer waits.
        assert!(missing_topic_verdict(&missing, Some(true)).is_ok());
        assert!(missing_topic_verdict(&missing, None).is_ok());
    }

    #[test]
    fn an_admin_client_beside_a_consumer_keeps_the_connection_settings_only() {
        let mut consumer = ClientConfig::new();
        for (k, v) in [
            ("bootstrap.servers", "b:9093"),
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("ssl.ca.location", "/ca.pem"),
            ("group.id", "ledger"),
            ("enable.auto.commit", "false"),
        ] {
            consumer.set(k, v);
        }
        let admin = crate::admin::connection_only(&consumer);
        let keys: Vec<&str> = admin.config_map().into_keys().collect();
        assert_eq!(
            keys,
            [
                "bootstrap.servers",
                "sasl.mechanism",
                "security.protocol",
                "ssl.ca.location"
            ]
        );
    }

    #[test]
    fn offsets_are_never_auto_committed_or_auto_stored() {
        let cfg = consumer_config("b:1", "settlement", &[]).unwrap();
        assert_eq!(cfg.get("enable.auto.commit"), Some("false"));
        assert_eq!(cfg.get("enable.auto.offset.store"), Some("false"));
        assert_eq!(cfg.get("auto.offset.reset"), Some("earliest"));
        assert_eq!(cfg.get("group.id"), Some("settlement"));
        assert_eq!(cfg.get("fetch.wait.max.ms"), Some("50"));
        assert_eq!(cfg.get("queued.max.messages.kbytes"), Some("16384"));
        for (k, v) in [
            ("enable.auto.commit", "true"),
            ("enable.auto.offset.store", "true"),
            ("group.id", "x"),
        ] {
            assert!(
                consumer_config("b:1", "g", &[(k.into(), v.into())]).is_err(),
                "{k}={v} accepted"
            );
        }
        let cfg =
            consumer_config("b:1", "g", &[("auto.offset.reset".into(), "latest".into())]).unwrap();
        assert_eq!(cfg.get("auto.offset.reset"), Some("latest"));
    }

    /// Peak memory of a draining consumer is mostly librdkafka's prefetch: each of its limits
    /// is set, well below librdkafka's defaults (64 MiB, 100 000 records, 50 MiB per fetch).
    #[test]
    fn the_prefetch_is_bounded() {
        let cfg = consumer_config("b:1", "g", &[]).unwrap();
        let value = |k: &str| -> u64 { cfg.get(k).unwrap_or_default().parse().unwrap_or(u64::MAX) };
        for k in PREFETCH_LIMITS {
            assert!(cfg.get(k).is_some(), "{k} is not set");
        }
        assert!(value("queued.max.messages.kbytes") <= 16 * 1024);
        assert!(value("queued.min.messages") <= 20_000);
        assert!(value("fetch.max.bytes") <= 8 * 1024 * 1024);
        // librdkafka accepts the combination (fetch.max.bytes ≥ message.max.bytes, and so on).
        let created: std::result::Result<rdkafka::consumer::BaseConsumer, _> = cfg.create();
        assert!(created.is_ok(), "{:?}", created.err());
    }

    #[test]
    fn a_revocation_is_seen_by_the_batches_fetched_before_it_only() {
        let mut r = Revocations::default();
        assert!(!r.revoked_since("t", 0, 0));
        r.revoke("t", 0);
        assert!(r.revoked_since("t", 0, 0), "fetched before the revocation");
        assert!(!r.revoked_since("t", 0, 1), "fetched after it");
        assert!(!r.revoked_since("t", 1, 0), "another partition");
        assert!(!r.revoked_since("u", 0, 0), "another topic");
        r.revoke("t", 1);
        assert!(r.revoked_since("t", 0, 0));
        assert!(!r.revoked_since("t", 0, 1));
        assert!(r.revoked_since("t", 1, 1));
        // Past what it remembers, every partition counts as revoked: the records are dropped
        // and fetched again, never applied after a revocation the log forgot.
        for _ in 0..REMEMBERED_REVOCATIONS {
            r.revoke("x", 9);
        }
        assert!(r.revoked_since("t", 0, 1));
        assert!(!r.revoked_since("t", 0, r.epoch));
    }

    #[test]
    fn a_member_is_in_the_group_from_any_assignment_until_it_is_lost() {
        let none = TopicPartitionList::new();
        let mut two = TopicPartitionList::new();
        two.add_partition("t", 0);
        two.add_partition("t", 1);
        assert_eq!(
            membership(&Rebalance::Assign(&two), false),
            Membership::Holds(2)
        );
        assert_eq!(
            membership(&Rebalance::Assign(&none), false),
            Membership::Holds(0),
            "more members than partitions: a member with none is in the group"
        );
        assert_eq!(
            membership(&Rebalance::Revoke(&two), false),
            Membership::Unchanged,
            "an ordinary rebalance"
        );
        assert!(matches!(
            membership(&Rebalance::Revoke(&two), true),
            Membership::Out(r) if r.contains("session.timeout.ms")
        ));
        let failed = KafkaError::Subscription("boom".to_owned());
        assert!(matches!(
            membership(&Rebalance::Error(failed), false),
            Membership::Out(r) if r.contains("boom")
        ));
    }

    #[test]
    fn the_membership_is_reported_as_the_group_dependency() {
        let health = Health::new();
        health.expect(GROUP);
        let context = RebalanceContext {
            health: Some(health.clone()),
            ..RebalanceContext::default()
        };
        assert!(!health.report().ready, "not ready before an assignment");
        let none = TopicPartitionList::new();
        context.report(&Rebalance::Assign(&none), false);
        assert!(health.report().ready);
        context.report(&Rebalance::Revoke(&none), false);
        assert!(health.report().ready, "an ordinary rebalance");
        context.report(&Rebalance::Revoke(&none), true);
        let report = health.report();
        assert!(!report.ready);
        assert_eq!(report.checks[0].name, GROUP);
        context.report(&Rebalance::Assign(&none), false);
        assert!(health.report().ready);
    }

    #[test]
    fn the_consumer_group_protocol_leaves_session_settings_to_the_broker() {
        let classic = consumer_config("b:1", "g", &[]).unwrap();
        assert_eq!(classic.get("session.timeout.ms"), Some("10000"));
        let kip848 =
            consumer_config("b:1", "g", &[("group.protocol".into(), "consumer".into())]).unwrap();
        assert_eq!(kip848.get("group.protocol"), Some("consumer"));
        for k in CLASSIC_GROUP_SETTINGS {
            assert_eq!(kip848.get(k), None, "{k} set with group.protocol=consumer");
        }
        // librdkafka itself accepts what is left.
        let created: std::result::Result<rdkafka::consumer::BaseConsumer, _> = kip848.create();
        assert!(created.is_ok(), "{:?}", created.err());
        assert_eq!(kip848.get("enable.auto.commit"), Some("false"));
    }
}
