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
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
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
    /// Reason.
    pub reason: String,
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
}

/// Measures one group member's consumer lag: per topic, the records between its position and
/// the high watermark, summed over the partitions assigned to it. May block on the broker (call
/// it off the async runtime); callable from any thread while the source is consuming.
pub type LagProbe = std::sync::Arc<dyn Fn() -> Vec<(String, i64)> + Send + Sync>;

/// Where records come from (a Kafka consumer group, in production).
pub trait Source: Send {
    /// The next batch: waits for a first record, then collects up to `max` records for at most
    /// `linger`. Records of a partition are in offset order. May return an empty batch (for
    /// example when a rebalance invalidated what was collected).
    fn next_batch(
        &mut self,
        max: usize,
        linger: std::time::Duration,
    ) -> impl Future<Output = Result<Vec<Delivery>>> + Send;

    /// Marks every record up to and including these (topic, partition, offset) as done and
    /// commits that position. Called only after the database commit.
    fn commit(&mut self, done: &[(String, i32, i64)]) -> impl Future<Output = Result<()>> + Send;

    /// A probe of this member's consumer lag, if the source can measure it. Default: none.
    fn lag_probe(&self) -> Option<LagProbe> {
        None
    }
}
