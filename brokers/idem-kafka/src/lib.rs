//! Kafka adapter for idem. This is the only crate that links librdkafka.
//!
//! # Delivery semantics
//!
//! [`KafkaPublisher`] is **at least once**, never "exactly once":
//!
//! * librdkafka's defaults are not at-least-once safe for an outbox relay, so
//!   [`producer_config`] forces `enable.idempotence=true` (no duplicates or reordering from the
//!   producer's own retries), `acks=all` (an acknowledged record survives a broker loss), at
//!   most 5 requests in flight (the idempotent producer's order guarantee) and a bounded local
//!   queue (`queue.buffering.max.kbytes`, so a relay never buffers a gigabyte). Overriding any
//!   of these is refused.
//! * [`Publisher::publish`] enqueues a whole batch and then waits for **every** delivery report.
//!   A row is reported delivered only on a successful report; an error, a
//!   `message.timeout.ms` expiry or a dropped report counts as not delivered, so the relay
//!   publishes the row again. The idempotent producer deduplicates its own retries, but not a
//!   second publish of the same row: that duplicate reaches the topic with the same `ce_id`,
//!   and the consumer's inbox absorbs it.
//! * Records are keyed by aggregate id and use the `murmur2_random` partitioner (the Java
//!   client's), so one aggregate stays in one partition, in order.
//! * Kafka transactions are not used: they would not make the database mark atomic with the
//!   publish, and the design does not need them.
//!
//! [`EmbeddedCluster`] starts librdkafka's in-process mock cluster (`--brokers embedded`).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::join_all;
use idem_core::publish::{FailureKind, Message, PublishError, Publisher, TopicState};
use idem_core::{Error, Result};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::future_producer::OwnedDeliveryResult;
use rdkafka::producer::{
    DefaultProducerContext, DeliveryFuture, FutureProducer, FutureRecord, Producer,
};

pub mod admin;
pub mod client_log;
pub mod inspect;
pub mod security;
pub mod source;

/// librdkafka's client configuration, as [`Connection`] and the config builders return it.
pub use rdkafka::ClientConfig;
pub use security::{
    ConnectError, Connection, KafkaSecurity, OAuthBearer, SaslMechanism, Secret, SecurityError,
    SecurityProtocol,
};
pub use source::{GROUP, KafkaSource, consumer_config};

/// Producer settings the at-least-once guarantee depends on. [`producer_config`] sets them and
/// refuses overrides of these keys.
pub const FORCED_PRODUCER_SETTINGS: &[(&str, &str)] =
    &[("enable.idempotence", "true"), ("acks", "all")];

/// Settings idem chooses but a user may override.
pub const DEFAULT_PRODUCER_SETTINGS: &[(&str, &str)] = &[
    ("message.timeout.ms", "20000"),
    // The relay enqueues a whole batch at once and then waits for every report: lingering only
    // delays the batch's last request, and every millisecond of it is commit → Kafka latency.
    ("linger.ms", "1"),
    // Small produce requests on an idle relay are not held back by Nagle's algorithm.
    ("socket.nagle.disable", "true"),
    ("queue.buffering.max.kbytes", "65536"),
    ("queue.buffering.max.messages", "100000"),
    ("partitioner", "murmur2_random"),
    ("max.in.flight.requests.per.connection", "5"),
    ("socket.keepalive.enable", "true"),
];

/// The `bootstrap.servers` value that starts the in-process mock cluster.
pub const EMBEDDED: &str = "embedded";

/// Builds the relay's producer configuration for a PLAINTEXT connection to `brokers`:
/// [`Connection::producer_config`] of [`Connection::plaintext`].
pub fn producer_config(brokers: &str, overrides: &[(String, String)]) -> Result<ClientConfig> {
    Connection::plaintext(brokers).producer_config(overrides)
}

/// The relay's producer configuration: the connection's servers and security, `overrides`
/// (from `--producer-config k=v`) on top of idem's defaults, the safety settings forced. An
/// override of a security setting the connection sets differently is refused, and the
/// resulting security is validated like the `--kafka-*` flags.
pub(crate) fn producer_config_for(
    conn: &Connection,
    overrides: &[(String, String)],
) -> Result<ClientConfig> {
    let mut cfg = conn.client_config();
    cfg.set("client.id", "idem-relay");
    for (k, v) in DEFAULT_PRODUCER_SETTINGS {
        cfg.set(*k, *v);
    }
    for (k, v) in overrides {
        if let Some((_, forced)) = FORCED_PRODUCER_SETTINGS.iter().find(|(fk, _)| fk == k)
            && v != forced
        {
            return Err(Error::Config(format!(
                "producer setting {k}={v} is refused: the at-least-once guarantee needs {k}={forced}"
            )));
        }
        if k == "max.in.flight.requests.per.connection" && !matches!(v.parse::<u32>(), Ok(1..=5)) {
            return Err(Error::Config(format!(
                "producer setting {k}={v} is refused: the idempotent producer keeps order only with 1 to 5 requests in flight"
            )));
        }
        if k == "transactional.id" {
            return Err(Error::Config(
                "producer setting transactional.id is refused: the relay does not use Kafka transactions".to_owned(),
            ));
        }
        check_message_timeout(k, v)?;
        if k == "bootstrap.servers" {
            return Err(Error::Config(
                "pass the brokers as the `brokers` argument, not as bootstrap.servers".to_owned(),
            ));
        }
        conn.check_override("producer", k, v)?;
        cfg.set(k.as_str(), v.as_str());
    }
    for (k, v) in FORCED_PRODUCER_SETTINGS {
        cfg.set(*k, *v);
    }
    validate_security(&cfg)?;
    Ok(cfg)
}

/// Validates the security settings of a finished client configuration (the flags' and the
/// overrides' together), as [`KafkaSecurity::validate`] does.
pub(crate) fn validate_security(cfg: &ClientConfig) -> Result<()> {
    KafkaSecurity::from_client_config(cfg)
        .and_then(|s| s.validate())
        .map_err(|e| Error::Config(e.to_string()))
}

/// The relay bounds every batch by `message.timeout.ms` (and its lease by twice that): it must
/// be a finite number of milliseconds. librdkafka reads 0 as "wait forever" (the relay would then
/// report every message not sent, forever), and its alias `delivery.timeout.ms` would set the
/// timeout behind the lease check's back.
fn check_message_timeout(k: &str, v: &str) -> Result<()> {
    if k == "delivery.timeout.ms" {
        return Err(Error::Config(format!(
            "producer setting delivery.timeout.ms={v} is refused: set message.timeout.ms instead (librdkafka's name for the same timeout, which the relay's lease check reads)"
        )));
    }
    if k == "message.timeout.ms" && !matches!(v.parse::<u32>(), Ok(1..=2_147_483_647)) {
        return Err(Error::Config(format!(
            "producer setting message.timeout.ms={v} is refused: it must be 1 to 2147483647 ms (0 means \"wait forever\" to librdkafka, and the relay bounds every batch by this timeout)"
        )));
    }
    Ok(())
}

/// Parses `key=value` pairs, as given to `--producer-config`.
pub fn parse_setting(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.trim().to_owned())),
        _ => Err(format!("expected key=value, got {s:?}")),
    }
}

/// A [`Publisher`] over librdkafka's idempotent producer.
pub struct KafkaPublisher {
    config: ClientConfig,
    /// `message.timeout.ms`: also bounds how long a batch waits for room in the local queue.
    message_timeout: Duration,
    producer: Mutex<Arc<FutureProducer<client_log::Reported>>>,
    /// How many times the producer was replaced (see [`KafkaPublisher::replacements`]).
    replacements: std::sync::atomic::AtomicU64,
    /// Partitions and replicas of topics created on first use (`None` replicas: min(3, brokers)).
    create_topics: Option<(i32, Option<i32>)>,
    known_topics: Mutex<HashSet<String>>,
    /// Read each topic's durability on first use (see [`KafkaPublisher::with_durability_check`]).
    durability_check: bool,
    /// Per topic, what the durability reads found; shared with the reads running beside the
    /// batches.
    durability: Arc<Mutex<std::collections::BTreeMap<String, DurabilityRead>>>,
}

impl std::fmt::Debug for KafkaPublisher {
    /// No client settings: they may hold credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("message_timeout", &self.message_timeout)
            .field("replacements", &self.replacements)
            .finish_non_exhaustive()
    }
}

/// What the durability reads of one topic found so far.
#[derive(Clone, Copy, Debug)]
struct DurabilityRead {
    /// At risk (true) or safe (false), once a read succeeded.
    at_risk: Option<bool>,
    /// When the last read started.
    started: std::time::Instant,
    /// Whether a read is running.
    running: bool,
    /// Reads that failed in a row.
    failures: u32,
}

/// How long a failed durability read waits before the next try.
const DURABILITY_RETRY: Duration = Duration::from_secs(10);
/// How often a topic's durability is read again once known (its configuration may change).
const DURABILITY_RECHECK: Duration = Duration::from_secs(600);

impl DurabilityRead {
    /// Whether a new read is due at `now`.
    fn due(&self, now: std::time::Instant) -> bool {
        let wait = if self.at_risk.is_some() {
            DURABILITY_RECHECK
        } else {
            DURABILITY_RETRY
        };
        !self.running && now.duration_since(self.started) >= wait
    }
}

impl KafkaPublisher {
    /// Creates the producer from a [`producer_config`].
    pub fn new(config: ClientConfig) -> Result<Self> {
        let producer = Arc::new(create_producer(&config)?);
        let message_timeout = Duration::from_millis(
            config
                .get("message.timeout.ms")
                .and_then(|v| v.parse().ok())
                .unwrap_or(300_000),
        );
        Ok(KafkaPublisher {
            config,
            message_timeout,
            producer: Mutex::new(producer),
            replacements: std::sync::atomic::AtomicU64::new(0),
            create_topics: None,
            known_topics: Mutex::new(HashSet::new()),
            durability_check: false,
            durability: Arc::default(),
        })
    }

    /// Creates each topic (with `partitions` partitions and `replication` replicas) through the
    /// admin API the first time a batch needs it. For clusters that do not create topics on
    /// first produce and for demos; production topics are better provisioned ahead.
    /// `replication: None` takes min(3, the brokers the cluster reports); while that count
    /// cannot be read, nothing is created (a topic created with fewer replicas than meant
    /// would stay under-replicated for good) and the batch fails as a retryable error.
    pub fn with_topic_creation(mut self, partitions: i32, replication: Option<i32>) -> Self {
        self.create_topics = Some((partitions, replication));
        self
    }

    /// Reads each topic's replica count, `min.insync.replicas` and unclean leader election
    /// the first time a batch goes to it (and every ten minutes after), on a task of its own
    /// beside the batches, never in their way; logs a warning when a record acknowledged with
    /// `acks=all` would not survive the loss of one broker ([`admin::Durability::warning`]);
    /// [`KafkaPublisher::durability`] reports the result (the relay exports it as
    /// `idem_relay_topic_durability_at_risk`). The reads use the producer's connection and
    /// security settings ([`admin::connection_of`]).
    pub fn with_durability_check(mut self) -> Self {
        self.durability_check = true;
        self
    }

    /// The topics whose durability was read, each with whether it is at risk.
    pub fn durability(&self) -> Vec<(String, bool)> {
        self.durability
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(|(t, r)| r.at_risk.map(|risk| (t.clone(), risk)))
            .collect()
    }

    /// Starts a durability read, beside the batch, for each topic of `messages` that is due.
    fn check_durability(&self, messages: &[Message]) {
        if !self.durability_check {
            return;
        }
        let now = std::time::Instant::now();
        let mut reads = self.durability.lock().unwrap_or_else(|p| p.into_inner());
        for m in messages {
            let read = reads.entry(m.topic.clone()).or_insert(DurabilityRead {
                at_risk: None,
                started: now,
                running: false,
                failures: 0,
            });
            let never_read = read.at_risk.is_none() && read.failures == 0;
            if read.running || !(never_read || read.due(now)) {
                continue;
            }
            read.running = true;
            read.started = now;
            let (conn, topic, state) = (
                admin::connection_of(&self.config),
                m.topic.clone(),
                self.durability.clone(),
            );
            tokio::spawn(read_durability(conn, topic, state));
        }
    }

    /// Creates the topics of `messages` not created yet. An error (the batch then fails as a
    /// retryable error) when the replica count to use cannot be read or the creation fails.
    async fn create_missing_topics(&self, messages: &[Message]) -> Result<()> {
        let Some((partitions, replication)) = self.create_topics else {
            return Ok(());
        };
        let missing: Vec<String> = {
            let known = self.known_topics.lock().unwrap_or_else(|p| p.into_inner());
            let mut m: Vec<String> = messages
                .iter()
                .map(|m| m.topic.clone())
                .filter(|t| !known.contains(t))
                .collect();
            m.sort();
            m.dedup();
            m
        };
        if missing.is_empty() {
            return Ok(());
        }
        let conn = admin::connection_of(&self.config);
        let replication = match replication {
            Some(r) => r,
            None => {
                let c = conn.clone();
                let counting =
                    "counting the cluster's brokers for the replication factor of new topics";
                let ids = tokio::task::spawn_blocking(move || {
                    admin::broker_ids(&c, Duration::from_secs(5))
                })
                .await
                .map_err(|e| Error::broker(counting, e))?
                .map_err(|e| Error::broker(counting, e))?;
                i32::try_from(ids.len().min(3)).unwrap_or(3)
            }
        };
        ensure_topics_with(&conn, &missing, partitions, replication).await?;
        self.known_topics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(missing);
        Ok(())
    }

    /// The effective client configuration.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    fn current(&self) -> Arc<FutureProducer<client_log::Reported>> {
        self.producer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many times this publisher replaced its producer after a fatal error or a timed-out
    /// batch.
    pub fn replacements(&self) -> u64 {
        self.replacements.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Replaces the producer with a new one (a new producer id, sequences from zero) when
    ///
    /// * it hit a **fatal error** (for example an out-of-order sequence after a broker lost
    ///   acknowledged data): an idempotent producer cannot produce again after one; or
    /// * a message of the batch **timed out**. librdkafka then drains the partitions and bumps
    ///   the producer's epoch on its own, which the broker must accept for the producer to go
    ///   on. Some brokers do not: Tansu 0.6 with its SQLite storage fails every later request
    ///   of that producer. A new producer asks the broker for a new id instead, which every
    ///   broker supports.
    ///
    /// Safe for the guarantee: it runs after every report of the batch has arrived, so no
    /// message is left in the old producer; the rows that failed are published again by the
    /// relay, and their duplicates (if the broker had them after all) are absorbed downstream.
    fn replace_if_broken(&self, producer: &FutureProducer<client_log::Reported>, timed_out: bool) {
        let reason = match producer.client().fatal_error() {
            Some((code, reason)) => format!("fatal error {code:?}: {reason}"),
            None if timed_out => "a message timed out".to_owned(),
            None => return,
        };
        tracing::warn!(%reason, "creating a new producer");
        match create_producer(&self.config) {
            Ok(p) => {
                *self.producer.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(p);
                self.replacements
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => tracing::error!(error = %e, "could not create a new producer"),
        }
    }

    /// Waits up to `timeout` for queued messages to be delivered.
    pub fn flush(&self, timeout: Duration) -> Result<()> {
        self.current()
            .flush(timeout)
            .map_err(|e| Error::broker("flushing the producer", e))
    }
}

fn create_producer(config: &ClientConfig) -> Result<FutureProducer<client_log::Reported>> {
    config
        .create_with_context(client_log::Reported)
        .map_err(|e| Error::broker("creating the Kafka producer", security::client_error(&e)))
}

/// Classifies a librdkafka error for the relay's retry policy. Permanent (parked after
/// `--max-attempts`) only when the message itself can never be published: too large, an
/// invalid record, a topic name Kafka refuses. An unknown topic or partition, or a missing
/// authorization, is the cluster's state — a topic being (re)created, metadata propagating, an
/// ACL rollout — so it is transient: retried forever with backoff, the head keeping its place
/// (parking it would let later events of its aggregate overtake it). A head stuck that way
/// raises `IdemOutboxOldestPendingAgeHigh`.
pub fn classify(e: &KafkaError) -> FailureKind {
    use RDKafkaErrorCode as C;
    match e.rdkafka_error_code() {
        Some(
            C::MessageSizeTooLarge
            | C::MessageBatchTooLarge
            | C::InvalidTopic
            | C::InvalidRecord
            | C::InvalidMessage
            | C::PolicyViolation,
        ) => FailureKind::Permanent,
        _ => FailureKind::Transient,
    }
}

fn failure(e: &KafkaError) -> PublishError {
    PublishError {
        kind: classify(e),
        reason: e.to_string(),
    }
}

/// How long [`KafkaPublisher`]'s question about one topic waits for the cluster.
const TOPIC_STATE_TIMEOUT: Duration = Duration::from_secs(5);

impl Publisher for KafkaPublisher {
    /// Twice `message.timeout.ms`: one to enqueue, one for the last delivery report.
    fn longest_publish(&self) -> Option<Duration> {
        Some(self.message_timeout.saturating_mul(2))
    }

    /// A metadata request for `topic` on the producer's connection (a cluster that creates
    /// topics on first use may create it now, and answers that it exists).
    async fn topic_state(&self, topic: &str) -> TopicState {
        let producer = self.current();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let metadata = producer
                .client()
                .fetch_metadata(Some(&topic), TOPIC_STATE_TIMEOUT);
            match metadata {
                Ok(m) => topic_state_of(m.topics().iter().find(|t| t.name() == topic)),
                Err(_) => TopicState::Unknown,
            }
        })
        .await
        .unwrap_or(TopicState::Unknown)
    }

    /// A batch takes at most about twice `message.timeout.ms`: enqueueing (waiting for room in
    /// the bounded queue, creating topics) gives up after one timeout — the rest is reported
    /// [`FailureKind::NotSent`] — and every enqueued message has a report within another.
    async fn publish(&self, messages: &[Message]) -> Vec<std::result::Result<(), PublishError>> {
        let enqueue_deadline = std::time::Instant::now() + self.message_timeout;
        if let Err(e) = self.create_missing_topics(messages).await {
            tracing::warn!(error = %e, "could not create the batch's topics; the batch is retried");
            let failed = not_sent(format!("not sent: {e}"));
            return messages.iter().map(|_| Err(failed.clone())).collect();
        }
        self.check_durability(messages);
        let producer = self.current();
        let mut results: Vec<Option<std::result::Result<(), PublishError>>> =
            vec![None; messages.len()];
        let mut pending = Vec::with_capacity(messages.len());
        // (topic, key) pairs with a message that failed before reaching the queue: later
        // messages of the same key are held back to keep their order.
        let mut broken: HashSet<(&str, &str)> = HashSet::new();
        for (i, m) in messages.iter().enumerate() {
            let sent = if std::time::Instant::now() >= enqueue_deadline {
                Err(not_sent(
                    "not sent: the batch could not be enqueued within message.timeout.ms",
                ))
            } else if broken.contains(&(m.topic.as_str(), m.key.as_str())) {
                Err(not_sent(
                    "held back: an earlier message of the same key failed in this batch",
                ))
            } else {
                let sent = enqueue(&producer, m, enqueue_deadline).await;
                if sent.is_err() {
                    broken.insert((m.topic.as_str(), m.key.as_str()));
                }
                sent
            };
            match sent {
                Ok(fut) => pending.push((i, fut)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        let (idx, futs): (Vec<usize>, Vec<_>) = pending.into_iter().unzip();
        let mut timed_out = false;
        for (i, report) in idx.into_iter().zip(join_all(futs).await) {
            let (result, timeout) = delivery_result(report);
            timed_out |= timeout;
            results[i] = Some(result);
        }
        self.replace_if_broken(&producer, timed_out);
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(PublishError {
                        kind: FailureKind::Transient,
                        reason: "no delivery report".to_owned(),
                    })
                })
            })
            .collect()
    }
}

/// What a metadata response says of one topic (`None`: the response left it out).
fn topic_state_of(topic: Option<&rdkafka::metadata::MetadataTopic>) -> TopicState {
    let Some(topic) = topic else {
        return TopicState::Unknown;
    };
    match topic.error().map(RDKafkaErrorCode::from) {
        // No error and no partition says nothing sure (a topic being created).
        None if topic.partitions().is_empty() => TopicState::Unknown,
        None => TopicState::Writable,
        Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => {
            TopicState::Missing
        }
        Some(RDKafkaErrorCode::TopicAuthorizationFailed) => TopicState::NotAuthorized,
        Some(_) => TopicState::Unknown,
    }
}

/// A message that never reached the producer's queue.
fn not_sent(reason: impl Into<String>) -> PublishError {
    PublishError {
        kind: FailureKind::NotSent,
        reason: reason.into(),
    }
}

/// Puts one message in the producer's bounded queue, waiting for room until `deadline`.
async fn enqueue(
    producer: &FutureProducer<client_log::Reported>,
    m: &Message,
    deadline: std::time::Instant,
) -> std::result::Result<DeliveryFuture, PublishError> {
    let mut headers = OwnedHeaders::new_with_capacity(m.headers.len());
    for (k, v) in &m.headers {
        headers = headers.insert(Header {
            key: k.as_str(),
            value: Some(v.as_bytes()),
        });
    }
    let mut record = FutureRecord::to(&m.topic)
        .key(m.key.as_bytes())
        .payload(m.payload.as_bytes())
        .headers(headers);
    loop {
        match producer.send_result(record) {
            Ok(fut) => return Ok(fut),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _))
                if std::time::Instant::now() >= deadline =>
            {
                return Err(not_sent(
                    "not sent: the producer queue stayed full for message.timeout.ms",
                ));
            }
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                // The bounded local queue is full: wait for deliveries, then retry.
                record = back;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Err((e, _)) => return Err(failure(&e)),
        }
    }
}

/// A delivery report as a publish result, and whether it was a message timeout (the producer
/// may then be wedged: see `replace_if_broken`).
fn delivery_result(
    report: std::result::Result<OwnedDeliveryResult, futures::channel::oneshot::Canceled>,
) -> (std::result::Result<(), PublishError>, bool) {
    match report {
        Ok(Ok(_delivery)) => (Ok(()), false),
        Ok(Err((e, _msg))) => {
            let timeout = matches!(
                e,
                KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut)
            );
            (Err(failure(&e)), timeout)
        }
        Err(_canceled) => (
            Err(PublishError {
                kind: FailureKind::Transient,
                reason: "the delivery report was lost (producer shut down)".to_owned(),
            }),
            false,
        ),
    }
}

/// librdkafka's in-process mock cluster, listening on a loopback port for as long as it lives.
///
/// For tests and the embedded demo only: it keeps everything in memory.
pub struct EmbeddedCluster {
    cluster: MockCluster<'static, DefaultProducerContext>,
}

impl std::fmt::Debug for EmbeddedCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedCluster")
            .field("bootstrap_servers", &self.bootstrap_servers())
            .finish()
    }
}

impl EmbeddedCluster {
    /// Starts a mock cluster with `brokers` brokers.
    pub fn start(brokers: i32) -> Result<Self> {
        let cluster = MockCluster::new(brokers)
            .map_err(|e| Error::broker("starting the embedded mock cluster", e))?;
        Ok(EmbeddedCluster { cluster })
    }

    /// The bootstrap servers of the mock cluster (`127.0.0.1:PORT,...`).
    pub fn bootstrap_servers(&self) -> String {
        self.cluster.bootstrap_servers()
    }

    /// Takes broker `id` (1-based) down: its connections are closed and refused.
    pub fn broker_down(&self, id: i32) -> Result<()> {
        self.cluster
            .broker_down(id)
            .map_err(|e| Error::broker(format!("taking mock broker {id} down"), e))
    }

    /// Brings broker `id` back up.
    pub fn broker_up(&self, id: i32) -> Result<()> {
        self.cluster
            .broker_up(id)
            .map_err(|e| Error::broker(format!("bringing mock broker {id} up"), e))
    }

    /// Creates a topic in the mock cluster.
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Result<()> {
        self.cluster
            .create_topic(topic, partitions, 1)
            .map_err(|e| Error::broker(format!("creating topic {topic} in the mock cluster"), e))
    }
}

/// One durability read of `topic` (see [`KafkaPublisher::with_durability_check`]): warns when
/// the topic is at risk, and when the read fails the first time in a row.
async fn read_durability(
    conn: ClientConfig,
    topic: String,
    state: Arc<Mutex<std::collections::BTreeMap<String, DurabilityRead>>>,
) {
    let result = admin::topic_durability(&conn, &topic, Duration::from_secs(5)).await;
    let mut reads = state.lock().unwrap_or_else(|p| p.into_inner());
    let Some(read) = reads.get_mut(&topic) else {
        return;
    };
    read.running = false;
    match result {
        Ok(d) => {
            let warning = d.warning();
            if let Some(w) = &warning {
                tracing::warn!(topic = %topic, replication = d.replication, min_insync = ?d.min_insync, "{w}");
            }
            read.at_risk = Some(warning.is_some());
            read.failures = 0;
        }
        Err(e) => {
            if read.failures == 0 {
                tracing::warn!(error = %e, topic = %topic, "could not read the topic's durability; trying again every 10 s");
            } else {
                tracing::debug!(error = %e, topic = %topic, "could not read the topic's durability");
            }
            read.failures = read.failures.saturating_add(1);
        }
    }
}

/// Creates `topics` with `partitions` partitions each through the admin API; topics that
/// already exist are left as they are.
pub async fn ensure_topics(
    brokers: &str,
    topics: &[String],
    partitions: i32,
    replication: i32,
) -> Result<()> {
    ensure_topics_with(&admin::connection(brokers), topics, partitions, replication).await
}

/// [`ensure_topics`] through a connection ([`admin::connection_of`] a client's configuration).
pub async fn ensure_topics_with(
    conn: &ClientConfig,
    topics: &[String],
    partitions: i32,
    replication: i32,
) -> Result<()> {
    if replication < 1 || partitions < 1 {
        return Err(Error::Config(format!(
            "topics need at least 1 partition and 1 replica (asked: {partitions} partitions, {replication} replicas)"
        )));
    }
    let admin: AdminClient<client_log::Reported> = conn
        .create_with_context(client_log::Reported)
        .map_err(|e| {
        Error::broker(
            "creating the Kafka admin client",
            security::client_error(&e),
        )
    })?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(replication)))
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = admin
        .create_topics(new.iter(), &opts)
        .await
        .map_err(|e| Error::broker("creating topics", e))?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(Error::broker(
                    format!("creating topic {topic}"),
                    KafkaError::AdminOp(code),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safety_settings_are_forced() {
        let cfg = producer_config("127.0.0.1:9092", &[]).unwrap();
        assert_eq!(cfg.get("enable.idempotence"), Some("true"));
        assert_eq!(cfg.get("acks"), Some("all"));
        assert_eq!(cfg.get("max.in.flight.requests.per.connection"), Some("5"));
        // The local queue is bounded (librdkafka's default holds up to a gigabyte).
        assert_eq!(cfg.get("queue.buffering.max.kbytes"), Some("65536"));
        assert_eq!(cfg.get("queue.buffering.max.messages"), Some("100000"));
        assert_eq!(cfg.get("linger.ms"), Some("1"));
        assert_eq!(cfg.get("partitioner"), Some("murmur2_random"));
        assert_eq!(cfg.get("transactional.id"), None);
    }

    #[test]
    fn unsafe_overrides_are_refused() {
        for (k, v) in [
            ("enable.idempotence", "false"),
            ("acks", "1"),
            ("acks", "0"),
            ("transactional.id", "x"),
            ("message.timeout.ms", "0"),
            ("message.timeout.ms", "-1"),
            ("message.timeout.ms", "soon"),
            ("delivery.timeout.ms", "300000"),
        ] {
            let err = producer_config("b:1", &[(k.into(), v.into())]).unwrap_err();
            assert!(err.to_string().contains(k), "{k}={v}: {err}");
        }
        let cfg = producer_config(
            "b:1",
            &[
                ("linger.ms".into(), "20".into()),
                ("acks".into(), "all".into()),
                ("message.timeout.ms".into(), "2000".into()),
            ],
        )
        .unwrap();
        assert_eq!(cfg.get("linger.ms"), Some("20"));
        assert_eq!(cfg.get("message.timeout.ms"), Some("2000"));
    }

    #[test]
    fn only_unpublishable_messages_are_permanent() {
        let e = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        assert_eq!(classify(&e), FailureKind::Permanent);
        let e = KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut);
        assert_eq!(classify(&e), FailureKind::Transient);
        // The cluster's state, not the message's: retried in place, never parked.
        for code in [
            RDKafkaErrorCode::UnknownTopic,
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::UnknownPartition,
            RDKafkaErrorCode::TopicAuthorizationFailed,
        ] {
            let e = KafkaError::MessageProduction(code);
            assert_eq!(classify(&e), FailureKind::Transient, "{code:?}");
        }
    }
}
