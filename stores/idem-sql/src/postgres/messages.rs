//! The table-less outbox (message mode of the CDC relay): events written as transactional
//! logical decoding messages, `pg_logical_emit_message(true, prefix, content)`, PostgreSQL only.

use idem_core::envelope::{self, EMIT_GRANT, EnvelopeError, Prefix};
use idem_core::{Error, Event, Result};
use sqlx::PgConnection;

use super::sqlstate;

const EMIT_MESSAGES: &str = include_str!("../../sql/postgres/emit_messages.sql");

/// Enqueues events as transactional logical decoding messages in the caller's transaction, for
/// the CDC relay in message mode (`idem cdc relay --messages`). No table: nothing to migrate
/// for the events themselves, nothing to prune, and no status, parking or `idem outbox`
/// commands (see docs/operating/cdc-relay.md, "Message mode").
///
/// PostgreSQL only, by type: it takes a [`PgConnection`] (SQLite has no logical decoding).
/// Each event's content is [`idem_core::envelope::encode`], the encoding the relay decodes.
/// Cheap to clone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MessageOutbox {
    prefix: Prefix,
}

impl MessageOutbox {
    /// A writer emitting under `prefix` (the relay's `--prefix`; default `idem.outbox`).
    pub fn new(prefix: Prefix) -> Self {
        MessageOutbox { prefix }
    }

    /// The prefix the messages are emitted under.
    pub fn prefix(&self) -> &Prefix {
        &self.prefix
    }

    /// Emits one event as part of the transaction `conn` belongs to.
    ///
    /// The relay sees it once that transaction commits; a rollback removes it. Called outside
    /// a transaction, the statement is its own transaction and commits at once.
    pub async fn enqueue(&self, conn: &mut PgConnection, event: &Event) -> Result<()> {
        self.enqueue_all(conn, std::slice::from_ref(event)).await
    }

    /// Emits several events in one statement, in slice order (the order the relay publishes
    /// them in), as part of the transaction `conn` belongs to. An event the relay would refuse
    /// (content over [`envelope::MAX_CONTENT_BYTES`], a payload nested deeper than
    /// [`envelope::MAX_PAYLOAD_DEPTH`]) is refused here, before anything is emitted.
    pub async fn enqueue_all(&self, conn: &mut PgConnection, events: &[Event]) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let contents = contents(events)?;
        let emitted: i64 = sqlx::query_scalar(EMIT_MESSAGES)
            .bind(self.prefix.as_str())
            .bind(&contents)
            .fetch_one(conn)
            .await
            .map_err(emit_error)?;
        if usize::try_from(emitted).ok() != Some(contents.len()) {
            return Err(Error::database(
                "emitting outbox messages",
                format!("{emitted} of {} messages emitted", contents.len()),
            ));
        }
        Ok(())
    }
}

/// The envelopes of `events`, or the first refusal. An event id twice in one call is refused
/// (the outbox table's unique key refuses it in table mode); across calls nothing can check it,
/// and consumers keep the first event of an id (docs/operating/cdc-relay.md).
fn contents(events: &[Event]) -> Result<Vec<String>> {
    let mut seen = std::collections::HashSet::with_capacity(events.len());
    events
        .iter()
        .map(|e| {
            if !seen.insert(e.id()) {
                return Err(Error::InvalidEvent {
                    field: "event_id",
                    reason: format!("{} appears twice in one enqueue", e.id()),
                });
            }
            envelope::encode_checked(e).map_err(refusal)
        })
        .collect()
}

fn refusal(e: EnvelopeError) -> Error {
    match e {
        EnvelopeError::Refused { field, reason } => Error::InvalidEvent { field, reason },
        other => Error::InvalidEvent {
            field: "event",
            reason: other.to_string(),
        },
    }
}

/// A failed emit: permission denied names the grant to ask for.
fn emit_error(e: sqlx::Error) -> Error {
    if sqlstate(&e, "42501") {
        return Error::database(
            format!("emitting outbox messages (this role may not: {EMIT_GRANT})"),
            e,
        );
    }
    Error::database("emitting outbox messages", e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_the_relay_would_refuse_is_refused_before_emitting() {
        let ok = Event::builder("o", "1", "t")
            .payload_json("{}")
            .build()
            .unwrap();
        let deep = Event::builder("o", "2", "t")
            .payload_json(format!("{}{}", "[".repeat(200), "]".repeat(200)))
            .build()
            .unwrap();
        assert_eq!(contents(std::slice::from_ref(&ok)).unwrap().len(), 1);
        assert!(matches!(
            contents(&[ok.clone(), ok.clone()]),
            Err(Error::InvalidEvent {
                field: "event_id",
                ..
            })
        ));
        assert!(matches!(
            contents(&[ok, deep]),
            Err(Error::InvalidEvent {
                field: "payload",
                ..
            })
        ));
    }
}
