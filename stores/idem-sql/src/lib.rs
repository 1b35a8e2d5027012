//! The SQL store of idem, written once over a [`Dialect`]: PostgreSQL (feature `postgres`) and
//! SQLite (feature `sqlite`, the embedded default).
//!
//! * [`Outbox`] enqueues events inside the caller's own transaction: pass `&mut *tx`.
//! * [`postgres`] and [`sqlite`] (features of the same names) hold the stores under their
//!   dialect's names (`postgres::PgStore`, `sqlite::Outbox`, …), `connect` and `migrate`;
//!   `postgres::MessageOutbox` writes events with no table, as transactional logical decoding
//!   messages read by the CDC relay's message mode.
//! * [`migrate()`] creates or upgrades idem's tables (the SQL lives in `migrations/<dialect>/`).
//! * [`RelayStore`] is the relay's view of the outbox ([`idem_core::store::OutboxStore`]), [`Inbox`]
//!   the consumer's ([`idem_core::store::InboxStore`]), [`KeyStore`] the server-side Idempotency-Key
//!   store and [`Intents`] the effect intents.
//! * [`AnyStore`] opens whichever database a URL names and hands all of them out.
//!
//! The statements live in `sql/<dialect>/`, one per file, and in `sql/common/` where both
//! dialects run the same text (sqlx-sqlite accepts `$N` placeholders; `{::text}`-style tokens
//! are the casts only PostgreSQL needs). Every statement over idem's tables is here, the CDC
//! relay's (`postgres::CdcStatements`) and `idem verify`'s ([`VerifyStatements`]) included. They are rendered once
//! per [`TableNames`](idem_core::TableNames) and shared by every store over those tables.
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::{Event, TableNames};
//! let store = idem_sql::AnyStore::connect("sqlite://orders.db", 4, TableNames::default()).await?;
//! store.migrate().await?;
//! let s = store.as_sqlite().ok_or("a sqlite:// URL opens SQLite")?;
//! let mut tx = s.pool().begin().await?;
//! let event = Event::builder("order", "10042", "order.paid")
//!     .payload(&serde_json::json!({"order_id": "10042", "amount_minor": 1250}))
//!     .build()?;
//! s.outbox().enqueue(&mut tx, &event).await?;
//! tx.commit().await?; // the event, with the caller's own rows, or nothing
//! # Ok(()) }
//! ```
//!
//! # Commit order
//!
//! On PostgreSQL a `BEFORE INSERT` trigger numbers each aggregate's events (`aggregate_seq`)
//! from a counter row in `<prefix>outbox_aggregates`. The counter's row lock is held until the
//! writing transaction commits or rolls back, so a second transaction writing the same aggregate
//! waits, and `aggregate_seq` order is commit order. The relay publishes each aggregate in that
//! order. A row that is not inserted because its `event_id` is already there (`ON CONFLICT
//! (event_id) DO NOTHING`) hands its number back, so each aggregate's numbers are 1, 2, 3, …
//! without gaps. Two transactions that enqueue events of the same aggregates in opposite orders
//! can deadlock; PostgreSQL aborts one of them, which the caller retries.
//! [`Outbox::enqueue_all`] sorts its events by aggregate to take the locks in one order.
//!
//! SQLite has one writer at a time, holding the database from its first write to its commit,
//! so `id` order is commit order: the relay uses `id` as each aggregate's sequence.

mod any;
mod array;
mod dialect;
mod inbox;
mod intents;
mod keys;
mod migrate;
pub mod ops;
mod queries;
mod relay_store;
mod verify;
mod writer;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite;

pub use any::{AnyPool, AnyStore, Scheme, Store};
pub use array::{Array, Element};
pub use dialect::{Decoded, Dialect, Param, SqlConnection, Statement, get, is_unique_violation};
pub use inbox::Inbox;
pub use intents::Intents;
pub use keys::KeyStore;
pub use migrate::{MigrationReport, check_schema, migrate};
pub use relay_store::{DEFAULT_CLAIM_TIMEOUT, RelayStore};
pub use verify::VerifyStatements;
pub use writer::Outbox;

/// `url` without its secrets, for messages: the password of its user part and the value of
/// every query parameter whose name, percent-decoded, holds `password` (`?password=…`,
/// `?sslpassword=…`, `?pass%77ord=…`). An
/// `@` further right than the user part (in a parameter) hides more, never less.
pub fn redact(url: &str) -> String {
    let (mut out, rest) = match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => match url[s + 3..at].split_once(':') {
            Some((user, _)) => (format!("{}{user}:***", &url[..s + 3]), &url[at..]),
            None => (String::new(), url),
        },
        _ => (String::new(), url),
    };
    match rest.split_once('?') {
        Some((path, query)) => {
            out.push_str(path);
            out.push('?');
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if names_a_password(k) => {
                        format!("{k}=***")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
        }
        None => out.push_str(rest),
    }
    out
}

/// Whether the query parameter name `key` holds `password`, read as URL readers read it:
/// percent-decoded (`pass%77ord`), case-insensitively.
fn names_a_password(key: &str) -> bool {
    let bytes = key.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(hi), Some(lo)) => {
                decoded.push(u8::try_from(hi * 16 + lo).unwrap_or(b'%'));
                i += 3;
            }
            (b, _, _) => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded)
        .to_ascii_lowercase()
        .contains("password")
}

/// `d` in whole milliseconds, saturating.
pub(crate) fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("sqlite:///tmp/a.db"), "sqlite:///tmp/a.db");
        assert_eq!(
            redact("postgres://u@h/db?sslmode=require&password=s3cret&PassWord=x&sslpassword=y"),
            "postgres://u@h/db?sslmode=require&password=***&PassWord=***&sslpassword=***"
        );
        assert_eq!(
            redact("postgres://u:a@b@h/db?x=1"),
            "postgres://u:***@h/db?x=1"
        );
        assert_eq!(redact("postgres://u:a?b/c@h/db"), "postgres://u:***@h/db");
    }

    /// A parameter's name is read percent-decoded (`pass%77ord` is `password` to the URL
    /// reader and to sqlx), so it is redacted decoded too.
    #[cfg(feature = "postgres")]
    #[test]
    fn a_password_parameter_with_an_encoded_name_is_read_and_hidden() {
        for url in [
            "postgres://u@h/db?pass%77ord=s3cret",
            "postgres://u@h/db?sslmode=prefer&%70assword=s3cret",
        ] {
            let u = crate::postgres::PgUrl::parse(url).unwrap();
            assert_eq!(u.password(), Some("s3cret"), "{url}");
            for shown in [u.redacted(), redact(url), format!("{u:?}")] {
                assert!(!shown.contains("s3cret"), "{url}: {shown}");
            }
        }
    }
}
