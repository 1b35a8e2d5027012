//! The table-less outbox (message mode of the CDC relay): events written as transactional
//! logical decoding messages, `pg_logical_emit_message(true, prefix, content)`, PostgreSQL only.

use idem_core::envelope::{self, EMIT_GRANT, EnvelopeError, Prefix};
use idem_core::{Error, Event, Result};
use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{Arguments, Execute, PgConnection, Postgres};

use super::sqlstate;

const EMIT_MESSAGES: &str = include_str!("../../sql/postgres/emit_messages.sql");
const EMIT_MESSAGE: &str = include_str!("../../sql/postgres/emit_message.sql");
const EMIT_MESSAGES_WITH: &str = include_str!("../../sql/postgres/emit_messages_with.sql");

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
        let n = contents.len();
        let mut args = PgArguments::default();
        self.bind(&mut args, contents)?;
        let emitted: i64 = sqlx::query_scalar_with(emit_statement(n), args)
            .fetch_one(conn)
            .await
            .map_err(emit_error)?;
        all_emitted(emitted, n)
    }

    /// Runs `write`, the caller's own business statement (an `INSERT`, `UPDATE` or `DELETE`
    /// with its values bound, e.g. `sqlx::query("INSERT INTO orders … VALUES ($1, $2)")
    /// .bind(…)`), and emits `events` **in the same statement**: one round trip for both, where
    /// [`enqueue_all`](Self::enqueue_all) after the write is a second one. The events are
    /// emitted in slice order, checked as `enqueue_all` checks them, as part of the transaction
    /// `conn` belongs to.
    ///
    /// The write runs as a data-modifying `WITH` query, so it may not be a `SELECT` and may not
    /// end with `;`; PostgreSQL runs it to completion. If it fails (a unique violation, say),
    /// the whole statement fails and nothing is emitted: the error is the write's, with its
    /// SQLSTATE. The events are emitted whatever the write changed, also when it changed no
    /// row (`ON CONFLICT DO NOTHING`): when that matters, write first and call
    /// [`enqueue_all`](Self::enqueue_all) after checking.
    ///
    /// `write`'s SQL is the caller's code, never input: it is placed into idem's statement as it
    /// is. Its placeholders must be exactly the values it binds (`$1` to `$n`, n ≥ 1); a
    /// statement that names a placeholder it does not bind is refused before anything is sent,
    /// since the messages' own values follow as `$n+1` and `$n+2`.
    pub async fn enqueue_with(
        &self,
        conn: &mut PgConnection,
        mut write: Query<'_, Postgres, PgArguments>,
        events: &[Event],
    ) -> Result<()> {
        let business = write.sql();
        let mut args = write
            .take_arguments()
            .map_err(|e| Error::database("binding the business write's values", e))?
            .unwrap_or_default();
        let contents = contents(events)?;
        let n = contents.len();
        let sql = joined_statement(business, args.len(), n)?;
        self.bind(&mut args, contents)?;
        let emitted: i64 = sqlx::query_scalar_with(&sql, args)
            .fetch_one(conn)
            .await
            .map_err(emit_error)?;
        all_emitted(emitted, n)
    }

    /// Binds the prefix and the envelopes after what `args` holds: the one envelope as text,
    /// several as an array ([`emit_statement`]).
    fn bind(&self, args: &mut PgArguments, mut contents: Vec<String>) -> Result<()> {
        let bound = args.add(self.prefix.as_str().to_owned()).and_then(|()| {
            match (contents.len(), contents.pop()) {
                (1, Some(one)) => args.add(one),
                (_, last) => {
                    contents.extend(last);
                    args.add(contents)
                }
            }
        });
        bound.map_err(|e| Error::database("binding the outbox messages", e))
    }
}

/// The statement emitting `n` envelopes (prefix `$1`, the envelopes `$2`).
fn emit_statement(n: usize) -> &'static str {
    match n {
        1 => EMIT_MESSAGE,
        _ => EMIT_MESSAGES,
    }
}

/// idem's statement around the business write `business`, which binds `bound` values, for
/// `events` envelopes.
fn joined_statement(business: &str, bound: usize, events: usize) -> Result<String> {
    let refuse = |reason: String| {
        Err(Error::InvalidArgument {
            argument: "business statement of enqueue_with",
            reason,
        })
    };
    let trimmed = business.trim_end();
    if trimmed.ends_with(';') {
        return refuse("the business write must be one statement without a final ';'".into());
    }
    if bound == 0 {
        return refuse("the business write binds no value (use enqueue_all after it)".into());
    }
    match highest_placeholder(trimmed) {
        Some(p) if p <= bound => {}
        Some(p) => {
            return refuse(format!(
                "the business write names ${p} but binds {bound} value(s): bind every \
                 placeholder it names"
            ));
        }
        None => {
            return refuse("the business write names no placeholder ($1…)".into());
        }
    }
    // Its own SQL has `$1` and `$2` only: named first, then numbered, so that no number
    // written is replaced again.
    let emit = sql_body(emit_statement(events))
        .replace("$1", "{prefix}")
        .replace("$2", "{contents}")
        .replace("{prefix}", &format!("${}", bound + 1))
        .replace("{contents}", &format!("${}", bound + 2));
    Ok(sql_body(EMIT_MESSAGES_WITH)
        .replace("{business}", trimmed)
        .replace("{emit}", &emit))
}

/// A statement of an `.sql` file without its `--` comment lines (the emit statement is placed
/// inside another: its comment would quote `$1` and `$2`).
fn sql_body(sql: &str) -> String {
    let lines: Vec<&str> = sql
        .lines()
        .filter(|l| !l.trim_start().starts_with("--"))
        .collect();
    lines.join("\n")
}

/// The highest `$N` in `sql` that is not part of an identifier (`a$1` is one), wherever it
/// stands (a `$N` inside a string literal counts too: refusing is the safe side).
fn highest_placeholder(sql: &str) -> Option<usize> {
    let bytes = sql.as_bytes();
    let mut highest = None;
    let mut i = 0;
    while i < bytes.len() {
        let after_identifier = i > 0
            && bytes
                .get(i - 1)
                .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'$');
        if bytes[i] == b'$' && !after_identifier {
            let digits = bytes[i + 1..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            if digits > 0 {
                let n = sql[i + 1..i + 1 + digits]
                    .parse::<usize>()
                    .unwrap_or(usize::MAX);
                highest = highest.max(Some(n));
            }
            i += 1 + digits;
            continue;
        }
        i += 1;
    }
    highest
}

/// `emitted` is every one of `wanted`.
fn all_emitted(emitted: i64, wanted: usize) -> Result<()> {
    if usize::try_from(emitted).ok() != Some(wanted) {
        return Err(Error::database(
            "emitting outbox messages",
            format!("{emitted} of {wanted} messages emitted"),
        ));
    }
    Ok(())
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
        return crate::dialect::db_error(
            format!("emitting outbox messages (this role may not: {EMIT_GRANT})"),
            e,
        );
    }
    crate::dialect::db_error("emitting outbox messages", e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_joined_statement_numbers_the_messages_after_the_write() {
        let sql = joined_statement("INSERT INTO t (a, b) VALUES ($1, $2)\n", 2, 3).unwrap();
        assert!(
            sql.contains("WITH idem_business AS (INSERT INTO t (a, b) VALUES ($1, $2))"),
            "{sql}"
        );
        assert!(
            sql.contains("$3::text") && sql.contains("unnest($4::text[])"),
            "{sql}"
        );
        assert_eq!(highest_placeholder(&sql), Some(4), "{sql}");
        let one = joined_statement("INSERT INTO t (a) VALUES ($1)", 1, 1).unwrap();
        assert!(one.contains("$2::text, $3::text)"), "{one}");
        let eleven = joined_statement("INSERT INTO t VALUES ($1, $11)", 11, 1).unwrap();
        assert!(eleven.contains("$12::text, $13::text)"), "{eleven}");
        assert!(!one.contains("unnest"), "{one}");
        let refused = |sql: &str, bound: usize| match joined_statement(sql, bound, 1) {
            Err(Error::InvalidArgument { reason, .. }) => reason,
            other => panic!("{sql:?}: {other:?}"),
        };
        assert!(refused("INSERT INTO t VALUES ($1, $2)", 1).contains("names $2 but binds 1"));
        assert!(refused("INSERT INTO t VALUES ($1);", 1).contains("';'"));
        assert!(refused("INSERT INTO t VALUES (1)", 0).contains("binds no value"));
        assert!(refused("INSERT INTO t VALUES (1)", 1).contains("no placeholder"));
        assert!(refused("UPDATE t SET a = '$9' WHERE id = $1", 1).contains("$9"));
    }

    #[test]
    fn placeholders_are_told_from_identifiers_and_dollar_quotes() {
        assert_eq!(highest_placeholder("SELECT $1, $12, $3"), Some(12));
        assert_eq!(highest_placeholder("SELECT a$1, $$x$$, $tag$y$tag$"), None);
        assert_eq!(highest_placeholder("VALUES ($2)"), Some(2));
        assert_eq!(highest_placeholder("$"), None);
        assert_eq!(
            highest_placeholder("$99999999999999999999999"),
            Some(usize::MAX)
        );
    }

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
