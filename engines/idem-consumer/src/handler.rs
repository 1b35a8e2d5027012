//! What a user writes: a [`Handler`], and the [`HandlerError`] it returns, with the rule that
//! classifies database errors as transient or permanent.

use std::future::Future;

use idem_core::{BoxError, InboundEvent};

use crate::context::{BatchContext, HandlerContext};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Why a handler did not apply an event.
///
/// `?` converts the errors a handler meets: a [`sqlx::Error`] by the rule of
/// [`HandlerError::from`] (below: permanent, transient or unclassified by its SQLSTATE class),
/// an [`idem_core::Error`] (from enqueueing an event or recording
/// an effect in the handler's transaction) as permanent when the event was invalid and as
/// transient otherwise.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Might work later (database busy, a lock timeout, a dependency down): the batch is rolled
    /// back and retried with backoff (bounded, exponential) until it applies. A transient
    /// failure never dead-letters the event: while it lasts the batch, and with it this
    /// consumer's partitions, stand still (`idem_consumer_stalled_since_seconds`, alert
    /// `IdemConsumerStalled`). Return [`HandlerError::Permanent`] for what can never work.
    #[error("transient failure, retried: {0}")]
    Transient(#[source] BoxError),
    /// Will never work (malformed payload, a business rule): the event is dead-lettered with
    /// this reason, and the rest of the batch is applied without it.
    #[error("permanent failure, dead-lettered: {0}")]
    Permanent(String),
    /// A database error whose code the rule of [`HandlerError::from`] does not name (`?` makes
    /// one; a custom `ERRCODE` of a trigger, a SQLSTATE class the rule does not list): retried
    /// as transient, each failure logged with its code, at most
    /// [`ConsumerConfig::max_unclassified_failures`](crate::ConsumerConfig::max_unclassified_failures)
    /// times for one event; then the event is dead-lettered with the code and the message, and
    /// the partition flows on. To have it retried without limit, or dead-lettered at once,
    /// say so: [`HandlerError::transient`] or [`HandlerError::permanent`].
    #[error("database error of no known class, retried a bounded number of times: {0}")]
    Unclassified(#[source] sqlx::Error),
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

/// Whether a failure can go away by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Retrying may succeed.
    Transient,
    /// Every retry fails the same way.
    Permanent,
    /// A database error whose code the rule does not name ([`HandlerError::Unclassified`]).
    Unclassified,
}

/// The rule of [`HandlerError::from`] for a [`sqlx::Error`].
///
/// A code is **permanent** when it depends on the event (the same statement succeeds for other
/// events, and fails for this one every time), **transient** when it depends on the database's
/// state or on the deployment (every event fails alike until the lock is released, the server
/// is back, the migration is run: dead-lettering would refuse every event of the meantime).
///
/// * PostgreSQL, by SQLSTATE class ([`classify_sqlstate`]): permanent are `22` (data
///   exception), `23` (integrity constraint), `P0` (PL/pgSQL: `RAISE EXCEPTION`, `P0001`, is
///   how a trigger or function refuses by a business rule), `54` (program limit exceeded: an
///   index row too large, too many columns), `21` (cardinality), `20` (case not found), `09`
///   (triggered action), `27` (triggered data change), `2F` (SQL routine) and `44` (check
///   option); transient are `08` (connection), `40` (serialization failure, deadlock), `53`
///   (insufficient resources), `55` (object not in prerequisite state; `55P03`, lock not
///   available, is `lock_timeout`), `57` (operator intervention: `57014`, query canceled, is
///   `statement_timeout`; a shutdown), `58` (system error), `XX` (internal error), `25`
///   (transaction state: a read-only standby after a failover, an aborted transaction), `72`
///   (snapshot too old), `F0` (configuration file), and the deployment's: `42` (syntax,
///   undefined table or column, privilege), `0A` (feature not supported), `26`, `28`
///   (authorization), `3D`, `3F` (database, schema).
/// * SQLite, by primary result code ([`classify_sqlite`]): `CONSTRAINT` (19, with its extended
///   codes: `RAISE(ABORT, …)` in a trigger is `SQLITE_CONSTRAINT_TRIGGER`), `TOOBIG` (18) and
///   `MISMATCH` (20) are permanent; `BUSY` (5), `LOCKED` (6), `NOMEM` (7), `READONLY` (8),
///   `INTERRUPT` (9), `IOERR` (10), `CORRUPT` (11), `FULL` (13), `CANTOPEN` (14), `PROTOCOL`
///   (15), `SCHEMA` (17), `PERM` (3), `AUTH` (23), `NOTADB` (26) and `ERROR` (1: a syntax
///   error, no such table) are transient.
/// * Any other database error the driver classifies as a unique, foreign-key, not-null or
///   check violation is permanent.
/// * Any other database error (a code of another class, such as a custom `ERRCODE` of a
///   trigger, or none) is unclassified: [`HandlerError::Unclassified`].
/// * Every error that is not the database's answer is transient: pool and I/O errors, a closed
///   pool, TLS, protocol errors.
pub(crate) fn classify(e: &sqlx::Error) -> Retry {
    let Some(db) = e.as_database_error() else {
        return Retry::Transient;
    };
    let by_code = db.code().and_then(|code| classify_code(&code));
    by_code.unwrap_or(match db.kind() {
        sqlx::error::ErrorKind::Other => Retry::Unclassified,
        _ => Retry::Permanent,
    })
}

/// What a database error is, for its dead letter and log lines: `SQLSTATE XY123`.
pub(crate) fn code_of(e: &sqlx::Error) -> String {
    match e.as_database_error().and_then(|db| db.code()) {
        Some(code) => code_name(&code),
        None => "a database error without a code".to_owned(),
    }
}

/// `SQLSTATE 23505` (PostgreSQL, five characters) or `SQLite code 2067`.
fn code_name(code: &str) -> String {
    if code.len() == 5 {
        format!("SQLSTATE {code}")
    } else {
        format!("SQLite code {code}")
    }
}

/// The class of a SQLSTATE (five characters) or an SQLite result code (a number); `None` for a
/// code the rule does not name.
fn classify_code(code: &str) -> Option<Retry> {
    if code.len() == 5 && code.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return classify_sqlstate(code);
    }
    classify_sqlite(code.parse::<u32>().ok()?)
}

/// The rule for a PostgreSQL SQLSTATE, by its class (the first two characters; PostgreSQL's
/// Appendix A): see [`classify`].
fn classify_sqlstate(code: &str) -> Option<Retry> {
    match code.get(..2)? {
        "22" | "23" | "P0" | "54" | "21" | "20" | "09" | "27" | "2F" | "44" => {
            Some(Retry::Permanent)
        }
        "08" | "40" | "53" | "55" | "57" | "58" | "XX" | "25" | "72" | "F0" => {
            Some(Retry::Transient)
        }
        "42" | "0A" | "26" | "28" | "3D" | "3F" => Some(Retry::Transient),
        _ => None,
    }
}

/// The rule for an SQLite result code (extended codes by their primary code, the low byte):
/// see [`classify`].
fn classify_sqlite(code: u32) -> Option<Retry> {
    match code & 0xff {
        18..=20 => Some(Retry::Permanent),
        1 | 3 | 5..=11 | 13..=15 | 17 | 23 | 26 => Some(Retry::Transient),
        _ => None,
    }
}

impl From<sqlx::Error> for HandlerError {
    /// Transient, permanent or unclassified by the database's error code (the rule of
    /// `classify`: SQLSTATE classes of the event's data, integrity, `RAISE` and program limits
    /// permanent; of connection, locks, serialization, resources, cancellation and the
    /// deployment transient; any other code [`HandlerError::Unclassified`]). A permanent
    /// reason is the database's message and code (`the database refused: payment pay-2 is
    /// frozen (SQLSTATE P0001)`).
    fn from(e: sqlx::Error) -> Self {
        match classify(&e) {
            Retry::Transient => HandlerError::Transient(Box::new(e)),
            Retry::Permanent => HandlerError::Permanent(permanent_reason(&e)),
            Retry::Unclassified => HandlerError::Unclassified(e),
        }
    }
}

/// The reason of a permanent database error: its message and its code.
fn permanent_reason(e: &sqlx::Error) -> String {
    match e.as_database_error() {
        Some(db) => format!("the database refused: {} ({})", db.message(), code_of(e)),
        None => e.to_string(),
    }
}

impl From<idem_core::Error> for HandlerError {
    /// By [`idem_core::Error::kind`]: an invalid input or a conflict (an event the handler tried
    /// to enqueue is invalid, or its id is taken) is permanent; every other kind is transient,
    /// a database that needs `idem migrate` included (the batch waits for the operator instead
    /// of dead-lettering the event).
    fn from(e: idem_core::Error) -> Self {
        match e.kind() {
            idem_core::ErrorKind::Invalid | idem_core::ErrorKind::Conflict => {
                HandlerError::Permanent(e.to_string())
            }
            _ => HandlerError::Transient(Box::new(e)),
        }
    }
}

/// What a handler did with one event of a batch ([`Handler::handle_batch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Applied: the handler's writes for it commit with the batch.
    Applied,
    /// Refused for good, **with nothing written for it** (decided before writing, as a payload
    /// check or a business rule read from the database): the event is dead-lettered with this
    /// reason in the batch's transaction, and the rest of the batch commits without a retry.
    Refused(String),
}

/// Why [`Handler::handle_batch`] applied nothing: the batch's transaction is rolled back.
///
/// `?` converts a [`HandlerError`], a [`sqlx::Error`] and an [`idem_core::Error`] (by the
/// rules of [`HandlerError`]'s conversions) into [`BatchError::Batch`].
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// Handling this one event failed. Permanent: the event is dead-lettered and the batch
    /// retried without it, each event in a savepoint of its own (the transaction may have been
    /// left aborted). Transient: the batch backs off and is retried one event at a time, so
    /// the failure is charged to the event that causes it.
    #[error("event {event}: {error}")]
    Event {
        /// The event.
        event: idem_core::EventId,
        /// What went wrong.
        #[source]
        error: HandlerError,
    },
    /// The batch as a whole failed: a set-based statement the database refused (permanent),
    /// or a transient failure. Permanent: the batch is retried at once one event at a time,
    /// each in a savepoint, so exactly the events the database refuses are dead-lettered and
    /// the rest applied. Transient: the batch backs off and is retried one event at a time.
    #[error(transparent)]
    Batch(#[from] HandlerError),
}

impl From<sqlx::Error> for BatchError {
    fn from(e: sqlx::Error) -> Self {
        BatchError::Batch(e.into())
    }
}

impl From<idem_core::Error> for BatchError {
    fn from(e: idem_core::Error) -> Self {
        BatchError::Batch(e.into())
    }
}

/// Applies events to the business tables, inside the consumer's transaction.
///
/// `C` is the store's connection type (`sqlx::PgConnection`, `sqlx::SqliteConnection`): the
/// handler writes through [`HandlerContext::conn`], so its writes commit or roll back together
/// with the inbox rows. An external call (an HTTP request to another service) is posted as an
/// effect ([`HandlerContext::effects`]): it is recorded in the same transaction and delivered
/// after the commit by a dispatcher, with one `Idempotency-Key` on every attempt. A handler
/// must not commit, and must not call anything outside the transaction whose effect cannot be
/// rolled back.
///
/// ```
/// use idem_consumer::{Handler, HandlerContext, HandlerError};
/// use idem_core::InboundEvent;
///
/// struct Award;
///
/// impl Handler<sqlx::SqliteConnection> for Award {
///     async fn handle(
///         &self,
///         cx: &mut HandlerContext<'_, sqlx::SqliteConnection>,
///         event: &InboundEvent,
///     ) -> Result<(), HandlerError> {
///         sqlx::query("INSERT INTO awards (order_id) VALUES (?1)")
///             .bind(&event.aggregate_id)
///             .execute(cx.conn())
///             .await?;
///         // Key `event-<event id>-points.award`, recorded with the insert above.
///         cx.effects().post("points.award", "https://points.example/awards", serde_json::json!({"points": 12}))?;
///         Ok(())
///     }
/// }
/// ```
///
/// A handler must **return** the database errors it meets (as [`HandlerError::Transient`] or
/// [`HandlerError::Permanent`], or with `?`), never swallow them: in PostgreSQL one failed
/// statement aborts the whole transaction. A statement that may fail by design ("insert, and a
/// duplicate key means done") belongs in a savepoint of the handler's own, or in
/// `ON CONFLICT DO NOTHING`. The runtime checks that the transaction is still usable before it
/// commits ([`idem_core::store::InboxStore::check_usable`]); when a handler has swallowed an error, the
/// batch is retried one event at a time, the handler that left the transaction aborted is
/// found, its event retried as a transient failure, and nothing of the batch is acknowledged
/// meanwhile.
///
/// **Per event or per batch.** Implement [`Handler::handle`]; the runtime calls
/// [`Handler::handle_batch`] once per batch with the new events, and its default calls
/// `handle` for each. Override `handle_batch` to apply a batch with a few set-based
/// statements instead of a few per event (see the reference settlement handler).
/// [`Handler::validate`] refuses malformed events before any SQL runs.
pub trait Handler<C>: Send + Sync + 'static {
    /// Applies one new event.
    fn handle(
        &self,
        cx: &mut HandlerContext<'_, C>,
        event: &InboundEvent,
    ) -> impl Future<Output = std::result::Result<(), HandlerError>> + Send;

    /// The business key whose rows `handle` locks. Events of a batch are applied sorted by it
    /// (stably, so one key keeps its delivery order), so concurrent batches take locks in the
    /// same order and do not deadlock. Default: the aggregate id.
    fn business_key(&self, event: &InboundEvent) -> String {
        event.aggregate_id.clone()
    }

    /// Checks one new event before the handler writes anything: `Err(reason)` refuses it for
    /// good (a malformed payload, an event type this handler does not apply), and it is
    /// dead-lettered with the reason in the batch's transaction while the rest of the batch is
    /// applied, with no rollback and no retry. Pure: no I/O. Default: every event is accepted.
    fn validate(&self, event: &InboundEvent) -> std::result::Result<(), String> {
        let _ = event;
        Ok(())
    }

    /// Applies the new events of one batch, in this order (sorted by [`Handler::business_key`];
    /// each one passed [`Handler::validate`]), in the consumer's transaction: one [`Outcome`]
    /// per event, in the same order. A batch of one event is how the runtime isolates events
    /// (in a savepoint each) after a [`BatchError`]. The effects of an event refused with
    /// [`Outcome::Refused`] are not recorded.
    ///
    /// Default: [`Handler::handle`] for each event in turn, with
    /// [`BatchContext::for_event`], in the event's span ([`event_span`]); a failure stops the
    /// batch as [`BatchError::Event`].
    fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, C>,
        events: &[&InboundEvent],
    ) -> impl Future<Output = std::result::Result<Vec<Outcome>, BatchError>> + Send
    where
        C: Send,
    {
        async move {
            let mut outcomes = Vec::with_capacity(events.len());
            for event in events {
                self.handle(&mut cx.for_event(event), event)
                    .instrument(event_span(event))
                    .await
                    .map_err(|error| BatchError::Event {
                        event: event.event_id,
                        error,
                    })?;
                outcomes.push(Outcome::Applied);
            }
            Ok(outcomes)
        }
    }
}

/// The span the handler runs in for one event: `idem.handle`, a consumer span whose parent is
/// the remote context of the event's `traceparent` (captured at enqueue, carried in the Kafka
/// header), so an OpenTelemetry exporter links the handler to the trace that produced the
/// event. Without a `tracing-opentelemetry` layer the parent is simply not recorded; the
/// span's `trace_id` field holds the trace id either way.
///
/// The default [`Handler::handle_batch`] runs each [`Handler::handle`] in it; an effect posted
/// through [`BatchContext::effects`] carries its context. A handler that overrides
/// `handle_batch` may enter it around what it logs for one event in particular.
pub fn event_span(event: &InboundEvent) -> tracing::Span {
    let span = tracing::info_span!(
        "idem.handle",
        otel.kind = "consumer",
        event_id = %event.event_id,
        event_type = %event.event_type,
        messaging.destination.name = %event.topic,
        trace_id = tracing::field::Empty,
    );
    // The trace id in every log line of the event's handling (`--log-format json`), with or
    // without an OpenTelemetry layer: the second field of `00-<trace id>-<span id>-<flags>`.
    if let Some(trace_id) = event
        .traceparent
        .as_deref()
        .and_then(|tp| tp.split('-').nth(1))
        .filter(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
    {
        span.record("trace_id", trace_id);
    }
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

/// The `traceparent` an effect posted by a handler carries: the context of the consumer span
/// the handler runs in ([`event_span`]), when an OpenTelemetry layer is installed, so the
/// outbound HTTP call is a child of it; otherwise the event's own `traceparent`. Either way the
/// trace id is the one captured at enqueue.
pub(crate) fn effect_traceparent(event: &InboundEvent) -> Option<String> {
    idem_core::trace::traceparent_of(&tracing::Span::current().context())
        .or_else(|| event.traceparent.clone())
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;

    /// A database error with a given code and kind, as a driver would return it.
    #[derive(Debug)]
    struct Db {
        code: &'static str,
        kind: fn() -> sqlx::error::ErrorKind,
    }

    impl std::fmt::Display for Db {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "code {}", self.code)
        }
    }

    impl std::error::Error for Db {}

    impl sqlx::error::DatabaseError for Db {
        fn message(&self) -> &str {
            self.code
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            (!self.code.is_empty()).then_some(Cow::Borrowed(self.code))
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            (self.kind)()
        }
    }

    fn db(code: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Db {
            code,
            kind: || sqlx::error::ErrorKind::Other,
        }))
    }

    /// The rule, code by code: (code, what it is, its class).
    const SQLSTATES: &[(&str, &str, Option<Retry>)] = &[
        // The event's data: every retry fails the same way, other events pass.
        (
            "22P02",
            "invalid text representation",
            Some(Retry::Permanent),
        ),
        (
            "22003",
            "numeric value out of range",
            Some(Retry::Permanent),
        ),
        (
            "22021",
            "character not in repertoire",
            Some(Retry::Permanent),
        ),
        ("23505", "unique violation", Some(Retry::Permanent)),
        ("23503", "foreign key violation", Some(Retry::Permanent)),
        ("23514", "check violation", Some(Retry::Permanent)),
        (
            "P0001",
            "raise exception: a business rule refuses",
            Some(Retry::Permanent),
        ),
        ("P0002", "no data found", Some(Retry::Permanent)),
        ("P0003", "too many rows", Some(Retry::Permanent)),
        ("P0004", "assert failure", Some(Retry::Permanent)),
        (
            "54000",
            "program limit exceeded: an index row too large",
            Some(Retry::Permanent),
        ),
        ("54001", "statement too complex", Some(Retry::Permanent)),
        ("54011", "too many columns", Some(Retry::Permanent)),
        ("21000", "cardinality violation", Some(Retry::Permanent)),
        ("20000", "case not found", Some(Retry::Permanent)),
        (
            "09000",
            "triggered action exception",
            Some(Retry::Permanent),
        ),
        (
            "27000",
            "triggered data change violation",
            Some(Retry::Permanent),
        ),
        (
            "2F005",
            "function executed no return statement",
            Some(Retry::Permanent),
        ),
        (
            "44000",
            "with check option violation",
            Some(Retry::Permanent),
        ),
        // The database's state: retrying can succeed.
        ("08006", "connection failure", Some(Retry::Transient)),
        ("08P01", "protocol violation", Some(Retry::Transient)),
        ("40001", "serialization failure", Some(Retry::Transient)),
        ("40P01", "deadlock detected", Some(Retry::Transient)),
        ("53300", "too many connections", Some(Retry::Transient)),
        ("53100", "disk full", Some(Retry::Transient)),
        (
            "55P03",
            "lock not available: lock_timeout",
            Some(Retry::Transient),
        ),
        (
            "55000",
            "object not in prerequisite state",
            Some(Retry::Transient),
        ),
        ("55006", "object in use", Some(Retry::Transient)),
        (
            "57014",
            "query canceled: statement_timeout",
            Some(Retry::Transient),
        ),
        ("57P01", "admin shutdown", Some(Retry::Transient)),
        ("57P03", "cannot connect now", Some(Retry::Transient)),
        ("58030", "I/O error", Some(Retry::Transient)),
        ("XX000", "internal error", Some(Retry::Transient)),
        (
            "25006",
            "read-only transaction: a standby after a failover",
            Some(Retry::Transient),
        ),
        (
            "25P02",
            "in failed transaction: a swallowed error",
            Some(Retry::Transient),
        ),
        ("72000", "snapshot too old", Some(Retry::Transient)),
        ("F0000", "configuration file error", Some(Retry::Transient)),
        // The deployment's: every event fails alike until the schema or the grants are fixed.
        (
            "42P01",
            "undefined table: a migration not run yet",
            Some(Retry::Transient),
        ),
        ("42703", "undefined column", Some(Retry::Transient)),
        ("42501", "insufficient privilege", Some(Retry::Transient)),
        ("42601", "syntax error", Some(Retry::Transient)),
        ("0A000", "feature not supported", Some(Retry::Transient)),
        (
            "26000",
            "invalid SQL statement name",
            Some(Retry::Transient),
        ),
        (
            "28000",
            "invalid authorization specification",
            Some(Retry::Transient),
        ),
        ("3D000", "invalid catalog name", Some(Retry::Transient)),
        ("3F000", "invalid schema name", Some(Retry::Transient)),
        // Not named: bounded retries, then a dead letter.
        ("ZZ001", "a custom ERRCODE", None),
        ("38001", "containing SQL not permitted", None),
        ("HV000", "foreign data wrapper error", None),
        ("0B000", "invalid transaction initiation", None),
        ("3B001", "invalid savepoint specification", None),
    ];

    #[test]
    fn postgres_errors_are_classified_by_sqlstate_class() {
        for &(code, what, class) in SQLSTATES {
            assert_eq!(classify_sqlstate(code), class, "{code} ({what})");
            assert_eq!(classify_code(code), class, "{code} ({what})");
            let expected = class.unwrap_or(Retry::Unclassified);
            assert_eq!(classify(&db(code)), expected, "{code} ({what})");
        }
    }

    /// SQLite result codes (extended ones by their low byte): (code, what it is, its class).
    const SQLITE: &[(&str, &str, Option<Retry>)] = &[
        ("19", "SQLITE_CONSTRAINT", Some(Retry::Permanent)),
        ("2067", "SQLITE_CONSTRAINT_UNIQUE", Some(Retry::Permanent)),
        (
            "1555",
            "SQLITE_CONSTRAINT_PRIMARYKEY",
            Some(Retry::Permanent),
        ),
        (
            "787",
            "SQLITE_CONSTRAINT_FOREIGNKEY",
            Some(Retry::Permanent),
        ),
        ("275", "SQLITE_CONSTRAINT_CHECK", Some(Retry::Permanent)),
        (
            "1811",
            "SQLITE_CONSTRAINT_TRIGGER: RAISE(ABORT, ...)",
            Some(Retry::Permanent),
        ),
        ("18", "SQLITE_TOOBIG", Some(Retry::Permanent)),
        ("20", "SQLITE_MISMATCH", Some(Retry::Permanent)),
        ("5", "SQLITE_BUSY", Some(Retry::Transient)),
        ("261", "SQLITE_BUSY_RECOVERY", Some(Retry::Transient)),
        ("517", "SQLITE_BUSY_SNAPSHOT", Some(Retry::Transient)),
        ("6", "SQLITE_LOCKED", Some(Retry::Transient)),
        ("262", "SQLITE_LOCKED_SHAREDCACHE", Some(Retry::Transient)),
        ("7", "SQLITE_NOMEM", Some(Retry::Transient)),
        ("8", "SQLITE_READONLY", Some(Retry::Transient)),
        ("9", "SQLITE_INTERRUPT", Some(Retry::Transient)),
        ("10", "SQLITE_IOERR", Some(Retry::Transient)),
        ("3338", "SQLITE_IOERR_FSYNC", Some(Retry::Transient)),
        ("11", "SQLITE_CORRUPT", Some(Retry::Transient)),
        ("13", "SQLITE_FULL", Some(Retry::Transient)),
        ("14", "SQLITE_CANTOPEN", Some(Retry::Transient)),
        ("15", "SQLITE_PROTOCOL", Some(Retry::Transient)),
        ("17", "SQLITE_SCHEMA", Some(Retry::Transient)),
        (
            "1",
            "SQLITE_ERROR: no such table, a syntax error",
            Some(Retry::Transient),
        ),
        ("3", "SQLITE_PERM", Some(Retry::Transient)),
        ("23", "SQLITE_AUTH", Some(Retry::Transient)),
        ("26", "SQLITE_NOTADB", Some(Retry::Transient)),
        ("2", "SQLITE_INTERNAL", None),
        ("4", "SQLITE_ABORT", None),
        ("21", "SQLITE_MISUSE", None),
        ("25", "SQLITE_RANGE", None),
    ];

    #[test]
    fn sqlite_errors_are_classified_by_primary_result_code() {
        for &(code, what, class) in SQLITE {
            assert_eq!(classify_code(code), class, "{code} ({what})");
            let expected = class.unwrap_or(Retry::Unclassified);
            assert_eq!(classify(&db(code)), expected, "{code} ({what})");
        }
    }

    #[test]
    fn an_unclassified_code_converts_to_unclassified_named_by_its_code() {
        fn run(e: sqlx::Error) -> Result<(), HandlerError> {
            Err(e)?
        }
        match run(db("ZZ001")) {
            Err(HandlerError::Unclassified(e)) => assert_eq!(code_of(&e), "SQLSTATE ZZ001"),
            other => panic!("{other:?}"),
        }
        match run(db("P0001")) {
            Err(HandlerError::Permanent(reason)) => {
                assert_eq!(reason, "the database refused: P0001 (SQLSTATE P0001)");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(code_of(&db("2")), "SQLite code 2");
        let no_code = sqlx::Error::Database(Box::new(Db {
            code: "",
            kind: || sqlx::error::ErrorKind::Other,
        }));
        assert_eq!(classify(&no_code), Retry::Unclassified);
    }

    #[test]
    fn a_driver_constraint_kind_without_a_known_code_is_permanent() {
        let e = sqlx::Error::Database(Box::new(Db {
            code: "",
            kind: || sqlx::error::ErrorKind::UniqueViolation,
        }));
        assert_eq!(classify(&e), Retry::Permanent);
    }

    #[test]
    fn pool_and_io_errors_are_transient() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        for e in [
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
            sqlx::Error::Io(io),
        ] {
            assert_eq!(classify(&e), Retry::Transient, "{e}");
        }
    }

    #[test]
    fn question_mark_converts_a_database_error_by_its_class() {
        fn run(e: sqlx::Error) -> Result<(), HandlerError> {
            Err(e)?
        }
        match run(db("23505")) {
            Err(HandlerError::Permanent(reason)) => assert!(reason.contains("23505"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(run(db("40001")), Err(HandlerError::Transient(_))));
        let invalid = idem_core::Error::InvalidEvent {
            field: "payload",
            reason: "must be an object".into(),
        };
        assert!(matches!(
            HandlerError::from(invalid),
            HandlerError::Permanent(_)
        ));
        let taken = idem_core::Error::Conflict {
            what: "event_id",
            reason: "is already in the outbox".into(),
        };
        assert!(matches!(
            HandlerError::from(taken),
            HandlerError::Permanent(_)
        ));
        let not_migrated = idem_core::Error::database_as(
            idem_core::ErrorKind::NotMigrated,
            "enqueueing events",
            std::io::Error::other("relation \"idem_outbox\" does not exist"),
        );
        assert!(matches!(
            HandlerError::from(not_migrated),
            HandlerError::Transient(_)
        ));
        let e = HandlerError::transient("the orders table is locked");
        assert_eq!(
            e.to_string(),
            "transient failure, retried: the orders table is locked"
        );
    }
}
