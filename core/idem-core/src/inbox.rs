//! The consumer's side: records as they arrive from the broker, the decoded events, and the
//! [`InboxStore`] trait (the processed-events inbox) that each database crate implements.
//!
//! The inbox is keyed by (consumer group, event id). The engine inserts a batch's events into
//! it in the **same transaction** as the handler's business writes, so "processed" and "effect
//! applied" commit or roll back together.

use std::future::Future;
use std::ops::DerefMut;

use crate::error::Result;
use crate::event::EventId;
use crate::idempotency::EffectIntent;

/// One record as delivered by the broker, before decoding.
#[derive(Clone, Debug, PartialEq)]
pub struct Delivery {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Key, if any (lossy UTF-8).
    pub key: Option<String>,
    /// Value, if any.
    pub payload: Option<Vec<u8>>,
    /// Headers in order (values lossy UTF-8).
    pub headers: Vec<(String, String)>,
    /// The record's timestamp, if the broker gave one: the producer's create time (the relay's
    /// producer stamps each record when it hands it to librdkafka), or the broker's append time
    /// on topics with `message.timestamp.type=LogAppendTime`.
    pub timestamp: Option<std::time::SystemTime>,
}

impl Delivery {
    /// The first header named `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        crate::wire::first_header(&self.headers, name)
    }
}

/// A decoded event, handed to the handler.
#[derive(Clone, Debug, PartialEq)]
pub struct InboundEvent {
    /// `ce_id`.
    pub event_id: EventId,
    /// `ce_type`.
    pub event_type: String,
    /// `idem_aggregate_type` (empty if the producer did not send it).
    pub aggregate_type: String,
    /// `idem_aggregate_id`, else the record key.
    pub aggregate_id: String,
    /// The JSON payload.
    pub payload: serde_json::Value,
    /// SHA-256 of the payload bytes, hex: detects the same event id with a different body.
    pub payload_hash: String,
    /// `traceparent`, if sent.
    pub traceparent: Option<String>,
    /// Where it came from.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
}

/// What the inbox says about one event of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dedup {
    /// First delivery: apply it.
    New,
    /// Seen before with the same payload: skip it.
    Duplicate,
    /// Seen before with a **different** payload under the same event id: never applied.
    Conflict,
}

/// One entry to record in the inbox.
#[derive(Clone, Copy, Debug)]
pub struct InboxEntry<'a> {
    /// The event.
    pub event: &'a InboundEvent,
    /// How many copies of it this batch carried (in-batch duplicates count too).
    pub copies: i32,
    /// Record it as dead-lettered rather than processed.
    pub dead_lettered: bool,
}

/// A record that cannot be processed, kept with its reason.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetter {
    /// Topic of the record.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Event id, if one could be read.
    pub event_id: Option<EventId>,
    /// Event type, if known.
    pub event_type: Option<String>,
    /// Why it was dead-lettered.
    pub reason: String,
    /// Record key.
    pub key: Option<String>,
    /// Record value (lossy UTF-8).
    pub payload: Option<String>,
    /// Headers as a JSON object.
    pub headers: serde_json::Value,
}

/// A dead letter read back, for `idem dead-letters` and tests.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StoredDeadLetter {
    /// Its id in the dead-letter table (`idem dead-letters replay --id`).
    pub id: i64,
    /// Consumer group.
    pub consumer_group: String,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Event id, if known.
    pub event_id: Option<String>,
    /// Reason (of the last failure, for a replay that failed).
    pub reason: String,
    /// How its last replay ended ([`ReplayOutcome::as_str`]), if it was replayed.
    pub replay_outcome: Option<String>,
    /// When it was last replayed (the database's clock, as text).
    pub replayed_at: Option<String>,
    /// Who replayed it last.
    pub replayed_by: Option<String>,
    /// When a replay was requested and not served yet ([`InboxStore::request_replays`]), as
    /// text.
    pub replay_requested_at: Option<String>,
    /// Who requested it.
    pub replay_requested_by: Option<String>,
}

/// A dead letter that has not been replayed successfully yet, with what replaying it needs.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenDeadLetter {
    /// Its id in the dead-letter table.
    pub id: i64,
    /// The record as it was stored.
    pub letter: DeadLetter,
}

/// An open dead letter whose replay was requested, waiting for a consumer of its group.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestedReplay {
    /// The letter.
    pub open: OpenDeadLetter,
    /// Who requested the replay (recorded as the replay's author).
    pub by: String,
}

/// The columns of a dead-letter row as both stores read them (text where the dialects differ).
#[derive(Clone, Debug)]
pub struct DeadLetterRow {
    /// `id`.
    pub id: i64,
    /// `topic`.
    pub topic: String,
    /// `record_partition`.
    pub partition: i32,
    /// `record_offset`.
    pub offset: i64,
    /// `event_id` as text.
    pub event_id: Option<String>,
    /// `event_type`.
    pub event_type: Option<String>,
    /// `reason`.
    pub reason: String,
    /// `record_key`.
    pub key: Option<String>,
    /// `payload`.
    pub payload: Option<String>,
    /// `headers` as JSON text.
    pub headers: String,
}

impl From<DeadLetterRow> for OpenDeadLetter {
    /// A row written by a foreign hand may hold an event id that is not a UUID or headers that
    /// are not JSON: they are read as none, and the replay then reports the record undecodable.
    fn from(r: DeadLetterRow) -> Self {
        OpenDeadLetter {
            id: r.id,
            letter: DeadLetter {
                topic: r.topic,
                partition: r.partition,
                offset: r.offset,
                event_id: r.event_id.and_then(|s| s.parse().ok()),
                event_type: r.event_type,
                reason: r.reason,
                key: r.key,
                payload: r.payload,
                headers: serde_json::from_str(&r.headers).unwrap_or_default(),
            },
        }
    }
}

/// How a replay of a dead letter ended, as recorded on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayOutcome {
    /// The handler applied the event, in the transaction that made its inbox row `processed`.
    Applied,
    /// The inbox already said `processed` (another replay, a redelivery), or holds the event id
    /// under another payload (a conflict): not applied. Closes the letter.
    AlreadyApplied,
    /// The handler failed again: the letter stays open with the new reason.
    Failed,
}

impl ReplayOutcome {
    /// `applied`, `already_applied` or `failed` (the `replay_outcome` column).
    pub fn as_str(self) -> &'static str {
        match self {
            ReplayOutcome::Applied => "applied",
            ReplayOutcome::AlreadyApplied => "already_applied",
            ReplayOutcome::Failed => "failed",
        }
    }
}

/// The processed-events inbox and dead-letter table of one database.
pub trait InboxStore: Send + Sync + 'static {
    /// The connection type handlers write through (e.g. `sqlx::PgConnection`).
    type Conn: Send;
    /// An open transaction on it.
    type Tx: DerefMut<Target = Self::Conn> + Send;

    /// Begins a transaction.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx>> + Send;

    /// Commits it.
    fn commit(&self, tx: Self::Tx) -> impl Future<Output = Result<()>> + Send;

    /// Rolls it back now (not when the connection is next used), releasing its locks.
    fn rollback(&self, tx: Self::Tx) -> impl Future<Output = Result<()>> + Send;

    /// Inserts `entries` for `group` (`INSERT … ON CONFLICT`), raising the delivery count of
    /// the ones already there, and says for each whether it is new. Entries must have distinct
    /// event ids. Concurrent callers with the same event id serialize on the unique key: exactly
    /// one of them sees [`Dedup::New`].
    fn record(
        &self,
        conn: &mut Self::Conn,
        group: &str,
        entries: &[InboxEntry<'_>],
    ) -> impl Future<Output = Result<Vec<Dedup>>> + Send;

    /// Sets a savepoint in the open transaction (used to isolate one event's handler).
    fn savepoint(&self, conn: &mut Self::Conn) -> impl Future<Output = Result<()>> + Send;

    /// Undoes everything since the savepoint (the transaction stays usable).
    fn rollback_to_savepoint(
        &self,
        conn: &mut Self::Conn,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Drops the savepoint, keeping what was done since.
    fn release_savepoint(&self, conn: &mut Self::Conn) -> impl Future<Output = Result<()>> + Send;

    /// Fails when the open transaction can no longer commit anything. PostgreSQL aborts a
    /// transaction at the first failed statement and then answers `COMMIT` with `ROLLBACK` and
    /// no error: a handler that swallowed a database error (`let _ = insert…`, "duplicate key
    /// means done") would make the batch look committed, and its offsets would be committed
    /// over writes that never happened. The runtime asks before every commit and after each
    /// handler call it isolates. Stores whose transactions survive a failed statement (SQLite)
    /// answer `Ok`.
    fn check_usable(&self, conn: &mut Self::Conn) -> impl Future<Output = Result<()>> + Send;
    /// Fails when the store's tables are not ready for this build (not migrated, or migrated
    /// to an older schema: [`ErrorKind::NotMigrated`](crate::ErrorKind::NotMigrated)). The
    /// consumer asks once before it reads a record, so that a database nobody migrated stops
    /// it at start with the reason instead of failing every batch. The default answers `Ok`
    /// (a store without a schema).
    fn check_schema(&self) -> impl Future<Output = Result<()>> + Send {
        std::future::ready(Ok(()))
    }

    /// Records the effect intents the handler posted for the events it applied, in the
    /// transaction `conn` belongs to: they commit with the handler's writes and the inbox rows,
    /// or not at all. One result per intent, in order, false when its key exists already
    /// (recording is idempotent): [`IntentStore::record_all`](crate::idempotency::IntentStore::record_all)
    /// on the inbox's own database.
    fn record_effects(
        &self,
        conn: &mut Self::Conn,
        intents: &[EffectIntent],
    ) -> impl Future<Output = Result<Vec<bool>>> + Send;

    /// Marks events recorded by [`InboxStore::record`] in this transaction as dead-lettered.
    fn mark_dead_lettered(
        &self,
        conn: &mut Self::Conn,
        group: &str,
        ids: &[EventId],
    ) -> impl Future<Output = Result<()>> + Send;

    /// Stores dead letters (idempotent per group, topic, partition and offset).
    fn dead_letter(
        &self,
        conn: &mut Self::Conn,
        group: &str,
        letters: &[DeadLetter],
    ) -> impl Future<Output = Result<()>> + Send;

    /// Lists up to `limit` dead letters of `group`, oldest first.
    fn dead_letters(
        &self,
        group: &str,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<StoredDeadLetter>>> + Send;

    /// Up to `limit` dead letters of `group` with an id above `after` (only `only`, when
    /// given) that were never replayed or whose last replay failed, by id.
    fn open_dead_letters(
        &self,
        group: &str,
        after: i64,
        only: Option<i64>,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<OpenDeadLetter>>> + Send;

    /// Reads dead letter `id` of `group`, if there is one.
    fn find_dead_letter(
        &self,
        group: &str,
        id: i64,
    ) -> impl Future<Output = Result<Option<StoredDeadLetter>>> + Send;

    /// Requests a replay of the open dead letters of `group` (only letter `only`, and only
    /// those with `reason`, when given) on behalf of `by`, and says which letters it requested: a consumer of the group serves
    /// them through its handler ([`InboxStore::requested_replays`]). A letter requested already
    /// keeps its first request time.
    fn request_replays(
        &self,
        group: &str,
        only: Option<i64>,
        reason: Option<&str>,
        by: &str,
    ) -> impl Future<Output = Result<Vec<i64>>> + Send;

    /// Up to `limit` open dead letters of `group` with an id above `after` whose replay was
    /// requested, by id. [`InboxStore::finish_replay`] clears the request.
    fn requested_replays(
        &self,
        group: &str,
        after: i64,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<RequestedReplay>>> + Send;

    /// In a replay's transaction: makes `event`'s inbox row of `group` `processed` — inserting
    /// it, or turning a `dead_lettered` row with the same payload hash — and says whether it
    /// did. `false`: the row says `processed` already, or it holds another payload; the event
    /// must not be applied. The row stays locked until the transaction ends, so a concurrent
    /// replay or redelivery waits and then finds it `processed`.
    fn claim_replay(
        &self,
        conn: &mut Self::Conn,
        group: &str,
        event: &InboundEvent,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Records a replay of dead letter `id`: when (now), `by` whom, the outcome, and for a
    /// failure the new `reason`; a request for its replay is served (cleared). Refused
    /// (`false`) for a letter whose replay already succeeded.
    fn finish_replay(
        &self,
        conn: &mut Self::Conn,
        id: i64,
        by: &str,
        outcome: ReplayOutcome,
        reason: Option<&str>,
    ) -> impl Future<Output = Result<bool>> + Send;
}

/// Measures one group member's consumer lag: per topic, the records between its position and
/// the high watermark, summed over the partitions assigned to it. May block on the broker (call
/// it off the async runtime); callable from any thread while the source is consuming.
pub type LagProbe = std::sync::Arc<dyn Fn() -> Vec<(String, i64)> + Send + Sync>;

/// Where records come from (a Kafka consumer group, in production).
///
/// The consumer runtime fetches the next batch while it applies the current one, and applies
/// the records of different partitions concurrently, so every method takes `&self`: a fetch may
/// be in flight while [`Source::commit`] stores a finished partition's position.
pub trait Source: Send + Sync {
    /// The next batch: waits for a first record, then collects up to `max` records for at most
    /// `linger`. Records of a partition are in offset order. May return an empty batch (for
    /// example when a rebalance invalidated what was collected). The runtime never runs two of
    /// these at once.
    fn next_batch(
        &self,
        max: usize,
        linger: std::time::Duration,
    ) -> impl Future<Output = Result<Vec<Delivery>>> + Send;

    /// Marks every record up to and including these (topic, partition, offset) as done (stores
    /// the positions) and has them committed. Called only after the database commit of those
    /// records. A source may commit asynchronously: once this returns, the positions are
    /// stored, and are committed at the latest by [`Source::close`] or before their partition
    /// is revoked.
    fn commit(&self, done: &[(String, i32, i64)]) -> impl Future<Output = Result<()>> + Send;

    /// The revocation epoch the last batch returned by [`Source::next_batch`] is current at:
    /// pass it to [`Source::revoked_since`]. Default: 0 (a source without rebalances).
    fn epoch(&self) -> u64 {
        0
    }

    /// Whether `partition` of `topic` was revoked from this member after `epoch`
    /// ([`Source::epoch`]): its records fetched before must not be applied any more (their
    /// next owner starts from the committed position). Default: never.
    fn revoked_since(&self, topic: &str, partition: i32, epoch: u64) -> bool {
        let _ = (topic, partition, epoch);
        false
    }

    /// Commits what [`Source::commit`] stored and not yet committed, waiting for the answer;
    /// called once when the runtime stops. Default: nothing to do.
    fn close(&self) -> impl Future<Output = Result<()>> + Send {
        std::future::ready(Ok(()))
    }

    /// Fails when a topic the source reads does not exist (a typo, a topic nobody created on a
    /// cluster that creates none on its own): the consumer asks once before it reads, so that
    /// such a source stops it at start with the reason ([`ErrorKind::Config`](crate::ErrorKind::Config))
    /// instead of waiting for records that never come. A cluster that does not answer yet is
    /// not a refusal. Default: `Ok` (a source without topics).
    fn check_topics(&self) -> impl Future<Output = Result<()>> + Send {
        std::future::ready(Ok(()))
    }

    /// A probe of this member's consumer lag, if the source can measure it. Default: none.
    fn lag_probe(&self) -> Option<LagProbe> {
        None
    }

    /// The consumer group this source reads as (Kafka's `group.id`), if it has one: the
    /// consumer's builder takes its group from it and refuses a config naming another (the
    /// inbox rows and the offsets of one consumer belong to one group; `Consumer::new` takes
    /// any pair, for a deliberate split such as a new Kafka group over the same inbox).
    /// A source that wraps another forwards it. Default: none.
    fn group(&self) -> Option<&str> {
        None
    }
}
