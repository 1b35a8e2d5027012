//! SQLite store for idem, the embedded default: the SQLite dialect of [`idem_sql`], under the
//! short aliases (`SqliteStore` is `idem_sql::RelayStore<Sqlite>`, and so on).
//!
//! * [`Outbox`] enqueues events inside the caller's own transaction: pass `&mut *tx`.
//! * [`migrate`] creates or upgrades idem's tables (the SQL lives in `idem-sql/migrations/sqlite/`).
//! * [`SqliteStore`] is the relay's view of the outbox ([`idem_core::OutboxStore`]); its SQL
//!   lives in `idem-sql/sql/sqlite/` and `idem-sql/sql/common/`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::{Event, TableNames};
//! let pool = idem_sqlite::connect("sqlite://orders.db").await?;
//! idem_sqlite::migrate(&pool, &TableNames::default()).await?;
//! let outbox = idem_sqlite::Outbox::default();
//! let mut tx = pool.begin().await?;
//! let event = Event::builder("order", "10042", "order.paid")
//!     .payload(&serde_json::json!({"order_id": "10042", "amount_minor": 1250}))
//!     .build()?;
//! outbox.enqueue(&mut *tx, &event).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! # Commit order
//!
//! SQLite has one writer at a time, holding the database from its first write to its commit,
//! so `id` order is commit order: the relay uses `id` as each aggregate's sequence.

use idem_core::{Result, TableNames};
use sqlx::{Sqlite, SqlitePool};

pub use idem_sql::{
    MigrationReport, connect_sqlite as connect,
    connect_sqlite_with_pool_size as connect_with_pool_size,
};

/// Enqueues events in the caller's transaction ([`idem_sql::Outbox`]). Cheap to clone.
pub type Outbox = idem_sql::Outbox<Sqlite>;
/// The relay's SQLite store ([`idem_sql::RelayStore`]).
pub type SqliteStore = idem_sql::RelayStore<Sqlite>;
/// The consumer's inbox and dead letters in SQLite ([`idem_sql::Inbox`]).
pub type SqliteInbox = idem_sql::Inbox<Sqlite>;
/// The server-side Idempotency-Key store in SQLite ([`idem_sql::KeyStore`]).
pub type SqliteKeyStore = idem_sql::KeyStore<Sqlite>;
/// Effect intents in SQLite ([`idem_sql::Intents`]).
pub type SqliteIntents = idem_sql::Intents<Sqlite>;

/// Creates or upgrades idem's tables, in one `BEGIN IMMEDIATE` transaction.
pub async fn migrate(pool: &SqlitePool, tables: &TableNames) -> Result<MigrationReport> {
    idem_sql::migrate(pool, tables).await
}
