//! PostgreSQL store for idem: the PostgreSQL dialect of [`idem_sql`], under short aliases
//! (`PgStore` is `idem_sql::RelayStore<Postgres>`, and so on).
//!
//! * [`Outbox`] enqueues events inside the caller's own transaction: pass `&mut *tx`.
//! * [`MessageOutbox`] writes events with no table, as transactional logical decoding messages
//!   for the CDC relay's message mode (`idem cdc relay --messages`).
//! * [`migrate`] creates or upgrades idem's tables (the SQL lives in `idem-sql/migrations/postgres/`).
//! * [`PgStore`] is the relay's view of the outbox ([`idem_core::OutboxStore`]); its SQL lives in
//!   `idem-sql/sql/postgres/` and `idem-sql/sql/common/`, one statement per file.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::Event;
//! let outbox = idem_postgres::Outbox::default();
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO orders (id, amount_minor) VALUES ($1, $2)")
//!     .bind("10042").bind(1250_i64).execute(&mut *tx).await?;
//! let event = Event::builder("order", "10042", "order.paid")
//!     .payload(&serde_json::json!({"order_id": "10042", "amount_minor": 1250}))
//!     .build()?;
//! outbox.enqueue(&mut *tx, &event).await?;
//! tx.commit().await?; // both rows, or neither
//! # Ok(()) }
//! ```
//!
//! With the CDC relay in message mode there is no outbox table: [`MessageOutbox`] emits the
//! events as transactional logical decoding messages, in the same transaction.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool, event: idem_core::Event) -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = idem_postgres::MessageOutbox::default(); // prefix idem.outbox
//! let mut tx = pool.begin().await?;
//! outbox.enqueue(&mut tx, &event).await?;
//! tx.commit().await?; // published by `idem cdc relay --messages` once committed
//! # Ok(()) }
//! ```
//!
//! # Commit order
//!
//! A `BEFORE INSERT` trigger numbers each aggregate's events (`aggregate_seq`) from a counter
//! row in `<prefix>outbox_aggregates`. The counter's row lock is held until the writing
//! transaction commits or rolls back, so a second transaction writing the same aggregate waits,
//! and `aggregate_seq` order is commit order. The relay publishes each aggregate in that order.
//! A row that is not inserted because its `event_id` is already there (`ON CONFLICT (event_id)
//! DO NOTHING`) hands its number back, so each aggregate's numbers are 1, 2, 3, … without gaps.
//! Two transactions that enqueue events of the same aggregates in opposite orders can deadlock;
//! PostgreSQL aborts one of them, which the caller retries. [`Outbox::enqueue_all`] sorts its
//! events by aggregate to take the locks in one order.

use idem_core::{Result, TableNames};
use sqlx::{PgPool, Postgres};

pub use idem_sql::{MessageOutbox, MigrationReport, connect_postgres as connect, redact};

/// Enqueues events in the caller's transaction ([`idem_sql::Outbox`]). Cheap to clone.
pub type Outbox = idem_sql::Outbox<Postgres>;
/// The relay's PostgreSQL store ([`idem_sql::RelayStore`]).
pub type PgStore = idem_sql::RelayStore<Postgres>;
/// The consumer's inbox and dead letters in PostgreSQL ([`idem_sql::Inbox`]).
pub type PgInbox = idem_sql::Inbox<Postgres>;
/// The server-side Idempotency-Key store in PostgreSQL ([`idem_sql::KeyStore`]).
pub type PgKeyStore = idem_sql::KeyStore<Postgres>;
/// Effect intents in PostgreSQL ([`idem_sql::Intents`]).
pub type PgIntents = idem_sql::Intents<Postgres>;

/// Creates or upgrades idem's tables. Safe to run concurrently (an advisory lock serializes
/// migrators) and repeatedly (applied versions are recorded in `<prefix>schema_migrations`).
pub async fn migrate(pool: &PgPool, tables: &TableNames) -> Result<MigrationReport> {
    idem_sql::migrate(pool, tables).await
}
