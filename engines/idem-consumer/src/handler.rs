//! What a user writes: a [`Handler`], and the [`HandlerError`] it returns, with the rule that
//! classifies database errors as transient or permanent.

use std::future::Future;

use idem_core::{BoxError, InboundEvent};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Why a handler did not apply an event.
///
/// `?` converts the errors a handler meets: a [`sqlx::Error`] by the rule of
/// [`HandlerError::from`] (below), an [`idem_core::Error`] (from enqueueing an event or recording
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
}

/// The rule of [`HandlerError::from`] for a [`sqlx::Error`].
///
/// * PostgreSQL (a five-character SQLSTATE): class `22` (data exception) and `23` (integrity
///   constraint violation) are permanent; `08` (connection), `40` (serialization failure,
///   deadlock), `53` (insufficient resources), `57` (operator intervention, statement timeout)
///   and `55P03` (lock not available, `lock_timeout`) are transient.
/// * SQLite (a numeric result code): `SQLITE_CONSTRAINT` (19, with its extended codes) is
///   permanent; `SQLITE_BUSY` (5) and `SQLITE_LOCKED` (6), with theirs, are transient.
/// * Any other database error the driver classifies as a unique, foreign-key, not-null or
///   check violation is permanent.
/// * Everything else is transient: pool and I/O errors, a closed pool, TLS, protocol errors,
///   and codes the rule does not name. A transient failure never dead-letters: an unknown error
///   stalls the batch visibly instead of losing the event.
pub(crate) fn classify(e: &sqlx::Error) -> Retry {
    let Some(db) = e.as_database_error() else {
        return Retry::Transient;
    };
    let by_code = db.code().and_then(|code| classify_code(&code));
    by_code.unwrap_or(match db.kind() {
        sqlx::error::ErrorKind::Other => Retry::Transient,
        _ => Retry::Permanent,
    })
}

/// The class of a SQLSTATE (five characters) or an SQLite result code (a number); `None` for a
/// code the rule does not name.
fn classify_code(code: &str) -> Option<Retry> {
    if code.len() == 5 {
        if code == "55P03" {
            return Some(Retry::Transient);
        }
        return match &code[..2] {
            "22" | "23" => Some(Retry::Permanent),
            "08" | "40" | "53" | "57" => Some(Retry::Transient),
            _ => None,
        };
    }
    let primary = code.parse::<u32>().ok()? & 0xff;
    match primary {
        19 => Some(Retry::Permanent),
        5 | 6 => Some(Retry::Transient),
        _ => None,
    }
}

impl From<sqlx::Error> for HandlerError {
    /// Transient or permanent by the database's error code (see the rule on [`HandlerError`]'s
    /// conversions: SQLSTATE classes `22`/`23` and SQLite constraints are permanent, connection,
    /// lock, serialization and resource errors transient, and anything unknown transient).
    fn from(e: sqlx::Error) -> Self {
        match classify(&e) {
            Retry::Transient => HandlerError::Transient(Box::new(e)),
            Retry::Permanent => HandlerError::Permanent(e.to_string()),
        }
    }
}

impl From<idem_core::Error> for HandlerError {
    /// [`idem_core::Error::InvalidEvent`] (an event the handler tried to enqueue is invalid, or
    /// its id is taken) is permanent; every other error is transient.
    fn from(e: idem_core::Error) -> Self {
        match e {
            idem_core::Error::InvalidEvent { .. } => HandlerError::Permanent(e.to_string()),
            e => HandlerError::Transient(Box::new(e)),
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
/// handler writes through it, so its writes commit or roll back together with the inbox rows.
/// A handler must not commit, and must not call anything outside the transaction whose effect
/// cannot be rolled back (use the effect stage for external calls).
///
/// A handler must **return** the database errors it meets (as [`HandlerError::Transient`] or
/// [`HandlerError::Permanent`], or with `?`), never swallow them: in PostgreSQL one failed
/// statement aborts the whole transaction. A statement that may fail by design ("insert, and a
/// duplicate key means done") belongs in a savepoint of the handler's own, or in
/// `ON CONFLICT DO NOTHING`. The runtime checks that the transaction is still usable before it
/// commits ([`idem_core::InboxStore::check_usable`]); when a handler has swallowed an error, the
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
        conn: &mut C,
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
    /// (in a savepoint each) after a [`BatchError`].
    ///
    /// Default: [`Handler::handle`] for each event in turn, in the event's span
    /// ([`event_span`]); a failure stops the batch as [`BatchError::Event`].
    fn handle_batch(
        &self,
        conn: &mut C,
        events: &[&InboundEvent],
    ) -> impl Future<Output = std::result::Result<Vec<Outcome>, BatchError>> + Send
    where
        C: Send,
    {
        async move {
            let mut outcomes = Vec::with_capacity(events.len());
            for event in events {
                self.handle(&mut *conn, event)
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
/// The default [`Handler::handle_batch`] runs each [`Handler::handle`] in it. A handler that
/// overrides `handle_batch` enters it around what it does for one event in particular, such
/// as computing [`effect_traceparent`] for an effect it records.
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

/// The `traceparent` an effect recorded by a handler should carry (see the effect stage): the
/// context of the consumer span the handler runs in ([`event_span`]), when an OpenTelemetry
/// layer is installed,
/// so the outbound HTTP call is a child of it; otherwise the event's own `traceparent`. Either
/// way the trace id is the one captured at enqueue.
pub fn effect_traceparent(event: &InboundEvent) -> Option<String> {
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

    #[test]
    fn postgres_errors_are_classified_by_sqlstate_class() {
        for code in ["08006", "40001", "40P01", "53300", "57014", "55P03"] {
            assert_eq!(classify(&db(code)), Retry::Transient, "{code}");
        }
        for code in ["23505", "23503", "22P02", "22003"] {
            assert_eq!(classify(&db(code)), Retry::Permanent, "{code}");
        }
        assert_eq!(
            classify(&db("42P01")),
            Retry::Transient,
            "unknown: transient"
        );
        assert_eq!(classify(&db("55000")), Retry::Transient);
    }

    #[test]
    fn sqlite_busy_and_locked_are_transient_and_constraints_permanent() {
        for code in ["5", "6", "261", "517", "262"] {
            assert_eq!(classify(&db(code)), Retry::Transient, "{code}");
        }
        for code in ["19", "2067", "1555", "787", "275"] {
            assert_eq!(classify(&db(code)), Retry::Permanent, "{code}");
        }
        assert_eq!(classify(&db("1")), Retry::Transient);
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
        let e = HandlerError::transient("the orders table is locked");
        assert_eq!(
            e.to_string(),
            "transient failure, retried: the orders table is locked"
        );
    }
}
