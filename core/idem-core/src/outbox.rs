//! The outbox as the relay sees it: claimed rows, outcomes, and the [`OutboxStore`] trait that
//! each database crate implements.
//!
//! # Row life cycle
//!
//! ```text
//!  INSERT (business tx) ──► pending ──claim──► pending + lease ──delivery ack──► published ──prune──► (deleted | archived)
//!                              ▲                    │
//!                              └──failure/backoff───┤
//!                                                   └──permanent failure × max attempts──► parked ──retry──► pending
//! ```
//!
//! A claim is a lease (`claim_id`, `claimed_until`). Marking is fenced by the `claim_id`: a
//! relay whose lease was taken over cannot mark rows it no longer owns.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::Result;
use crate::event::EventId;

/// One claimed outbox row, ready to publish.
#[derive(Clone, Debug, PartialEq)]
pub struct OutboxRecord {
    /// The row's `id` (insertion order; not commit order).
    pub id: i64,
    /// The event id.
    pub event_id: EventId,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id (Kafka key).
    pub aggregate_id: String,
    /// Position of this event in its aggregate's commit order.
    pub aggregate_seq: i64,
    /// Event type.
    pub event_type: String,
    /// JSON payload text.
    pub payload: String,
    /// User headers.
    pub headers: BTreeMap<String, String>,
    /// Topic override, if the writer set one.
    pub topic: Option<String>,
    /// W3C trace parent captured at enqueue.
    pub traceparent: Option<String>,
    /// When the business fact happened.
    pub occurred_at: DateTime<Utc>,
    /// When the row was inserted.
    pub created_at: DateTime<Utc>,
    /// This publish attempt's number (1 = first claim).
    pub attempt: i32,
    /// Permanent failures so far (the row is parked when they reach the relay's limit).
    pub permanent_failures: i32,
}

impl OutboxRecord {
    /// The record of `event` as first claimed (attempt 1, no failures), at row `id` and
    /// position `aggregate_seq`, inserted at `created_at`.
    pub fn of_event(
        event: &crate::Event,
        id: i64,
        aggregate_seq: i64,
        created_at: DateTime<Utc>,
    ) -> Self {
        OutboxRecord {
            id,
            event_id: event.id(),
            aggregate_type: event.aggregate_type().to_owned(),
            aggregate_id: event.aggregate_id().to_owned(),
            aggregate_seq,
            event_type: event.event_type().to_owned(),
            payload: event.payload().to_owned(),
            headers: event.headers().clone(),
            topic: event.topic().map(str::to_owned),
            traceparent: event.traceparent().map(str::to_owned),
            occurred_at: event.occurred_at(),
            created_at,
            attempt: 1,
            permanent_failures: 0,
        }
    }
}

/// Parameters of one claim.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    /// Who claims (shown in `claimed_by`).
    pub relay_id: String,
    /// At most this many rows.
    pub batch_size: u32,
    /// How long the claim is exclusive.
    pub lease: Duration,
}

/// A set of rows leased to one relay.
#[derive(Clone, Debug)]
pub struct Claim {
    /// Fencing token: only this claim may mark its rows.
    pub claim_id: Uuid,
    /// Rows ordered by aggregate, then by aggregate commit order.
    pub records: Vec<OutboxRecord>,
    /// Claimed rows that could not be decoded (row id, reason): the relay parks them.
    pub corrupt: Vec<(i64, String)>,
}

/// What happened to one claimed row that was not published.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    /// The row id.
    pub id: i64,
    /// A person-readable reason, stored in `last_error`.
    pub reason: String,
    /// Wait this long before the row may be claimed again.
    pub backoff: Duration,
    /// What the store does with the row.
    pub disposition: Disposition,
}

/// What the store does with a claimed row that was not published: one state instead of three
/// flags (parked rows are always permanent failures, permanent failures were always attempts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Disposition {
    /// Never handed to the broker (for example because an earlier event of its aggregate
    /// failed before it): released at once, its attempt not counted.
    NotSent,
    /// Failed for now, or held behind an earlier row of its aggregate: released after the
    /// backoff.
    Retry,
    /// Failed permanently: released after the backoff, and counted towards parking.
    Permanent,
    /// Parked: not claimed again until a person retries it (`idem outbox retry`).
    Park,
}

impl Disposition {
    /// The row is parked.
    pub fn parks(self) -> bool {
        self == Disposition::Park
    }

    /// The failure is permanent (it counts towards parking).
    pub fn is_permanent(self) -> bool {
        matches!(self, Disposition::Permanent | Disposition::Park)
    }

    /// The row was handed to the broker, so the attempt counts.
    pub fn attempted(self) -> bool {
        self != Disposition::NotSent
    }
}

/// The outcome of publishing one claim.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClaimOutcome {
    /// Rows whose delivery report was a success.
    pub published: Vec<i64>,
    /// Rows that were not published.
    pub failed: Vec<Failure>,
}

/// What [`OutboxStore::complete`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completed {
    /// Rows marked published.
    pub marked: u64,
    /// Rows released for a later attempt or parked.
    pub released: u64,
    /// Rows this claim no longer owned (lease expired and taken over): not changed.
    pub fenced: u64,
}

/// Counts over the whole outbox.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct OutboxStatus {
    /// Rows waiting to be published.
    pub pending: i64,
    /// Rows parked after repeated permanent failures.
    pub parked: i64,
    /// Published rows not yet pruned.
    pub published: i64,
    /// Age in seconds of the oldest pending row, if any.
    pub oldest_pending_age_seconds: Option<f64>,
}

/// Pending and parked rows of one aggregate type: what the relay's backlog gauges show.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Backlog {
    /// The aggregate type.
    pub aggregate_type: String,
    /// Rows waiting to be published.
    pub pending: i64,
    /// Rows parked after repeated permanent failures.
    pub parked: i64,
    /// Age in seconds of the oldest pending row (from its `created_at`), if any is pending.
    pub oldest_pending_age_seconds: Option<f64>,
}

/// A parked row, for `idem outbox parked`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ParkedRow {
    /// Row id.
    pub id: i64,
    /// Event id.
    pub event_id: EventId,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// Attempts made.
    pub attempts: i32,
    /// Why it was parked.
    pub last_error: Option<String>,
}

/// How published rows are cleaned up.
#[derive(Clone, Debug)]
pub struct PrunePolicy {
    /// Keep published rows at least this long.
    pub retention: Duration,
    /// Move them to the `<prefix>outbox_archive` table instead of deleting them.
    pub archive: bool,
    /// At most this many rows per statement.
    pub batch: u32,
}

impl Default for PrunePolicy {
    fn default() -> Self {
        PrunePolicy {
            retention: Duration::from_secs(3600),
            archive: false,
            batch: 10_000,
        }
    }
}

/// The relay's view of an outbox table. Implemented for PostgreSQL and SQLite.
///
/// Every method is one short transaction; none holds a lock while the relay talks to Kafka.
pub trait OutboxStore: Send + Sync + 'static {
    /// Leases up to `batch_size` publishable rows.
    ///
    /// A row is publishable when it is pending, past its backoff, not leased to anyone else, and
    /// no earlier (in aggregate commit order) row of its aggregate is pending. A claim takes,
    /// for each aggregate it picks, a prefix of that aggregate's pending rows, so two relays
    /// never hold rows of the same aggregate at once.
    fn claim(&self, request: &ClaimRequest) -> impl Future<Output = Result<Claim>> + Send;

    /// Marks published rows and releases (or parks) failed ones, fenced by the claim id.
    fn complete(
        &self,
        claim: &Claim,
        outcome: &ClaimOutcome,
    ) -> impl Future<Output = Result<Completed>> + Send;

    /// Deletes or archives published rows older than the retention; returns how many.
    fn prune(&self, policy: &PrunePolicy) -> impl Future<Output = Result<u64>> + Send;

    /// Counts rows by state.
    fn status(&self) -> impl Future<Output = Result<OutboxStatus>> + Send;

    /// Pending and parked rows per aggregate type (types with neither are absent), ordered by
    /// aggregate type. Reads only pending and parked rows, so it stays cheap however many
    /// published rows wait for pruning; the relay runs it every status interval.
    fn backlog(&self) -> impl Future<Output = Result<Vec<Backlog>>> + Send;

    /// Lists up to `limit` parked rows, oldest first.
    fn parked(&self, limit: u32) -> impl Future<Output = Result<Vec<ParkedRow>>> + Send;

    /// Returns parked rows to pending (all of them, or those with the given event ids).
    fn retry_parked(
        &self,
        event_ids: Option<&[EventId]>,
    ) -> impl Future<Output = Result<u64>> + Send;
}

/// Headers read back from the outbox `headers` column. Values that other writers stored as
/// non-strings are sent as their JSON text rather than failing the row; a non-object is empty.
pub fn headers_from_json(v: serde_json::Value) -> BTreeMap<String, String> {
    match v {
        serde_json::Value::Object(map) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        _ => BTreeMap::new(),
    }
}

/// Orders claimed rows by aggregate, then by commit order within the aggregate.
pub fn sort_records(records: &mut [OutboxRecord]) {
    records.sort_by(|a, b| {
        (&a.aggregate_type, &a.aggregate_id, a.aggregate_seq).cmp(&(
            &b.aggregate_type,
            &b.aggregate_id,
            b.aggregate_seq,
        ))
    });
}

/// Lets a claim that found nothing among the oldest pending rows look at every pending row at
/// most once per interval, so one aggregate's deep backlog never starves the others without
/// making every idle poll a full scan. Cheap to clone (shared).
#[derive(Clone, Debug, Default)]
pub struct FullScanThrottle {
    last: std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

impl FullScanThrottle {
    /// How often a full scan may run.
    pub const EVERY: Duration = Duration::from_secs(1);

    /// True at most once per [`Self::EVERY`].
    pub fn due(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_none_or(|t| t.elapsed() >= Self::EVERY) {
            *last = Some(std::time::Instant::now());
            true
        } else {
            false
        }
    }
}
