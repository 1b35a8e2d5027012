//! SQLite (the embedded default): idem's stores under their SQLite names (`SqliteStore` is
//! [`RelayStore<Sqlite>`](crate::RelayStore), and so on), the connection, and the dialect.
//!
//! * [`Outbox`] enqueues events inside the caller's own transaction: pass `&mut *tx`.
//! * [`migrate`] creates or upgrades idem's tables (the SQL lives in
//!   `stores/idem-sql/migrations/sqlite/`).
//! * [`SqliteStore`] is the relay's view of the outbox, [`SqliteInbox`] the consumer's,
//!   [`SqliteKeyStore`] the server-side Idempotency-Key store and [`SqliteIntents`] the effect
//!   intents; their SQL lives in `stores/idem-sql/sql/sqlite/` and `sql/common/`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::{Event, TableNames};
//! let pool = idem_sql::sqlite::connect("sqlite://orders.db").await?;
//! idem_sql::sqlite::migrate(&pool, &TableNames::default()).await?;
//! let outbox = idem_sql::sqlite::Outbox::default();
//! let mut tx = pool.begin().await?;
//! let event = Event::builder("order", "10042", "order.paid")
//!     .payload(&serde_json::json!({"order_id": "10042", "amount_minor": 1250}))
//!     .build()?;
//! outbox.enqueue(&mut *tx, &event).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! SQLite has one writer at a time, holding the database from its first write to its commit,
//! so `id` order is commit order: the relay uses `id` as each aggregate's sequence.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::idempotency::FinishedAttempt;
use idem_core::store::{DeadLetter, InboxEntry};
use idem_core::{Error, Event, EventId, Result, TableNames};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{Connection, Row, Sqlite, Transaction};

use crate::dialect::sealed::{Batches, Sealed, SealedConn};
use crate::dialect::{Decoded, Dialect, Now, Param, Q, SqlConnection, WriteTx};
use crate::migrate::{Migrations, migrations};
use crate::queries::{SqlSet, sql_set};

mod relay;
mod retention;

/// Enqueues events in the caller's transaction ([`crate::Outbox`]). Cheap to clone.
pub type Outbox = crate::Outbox<Sqlite>;
/// The relay's SQLite store ([`crate::RelayStore`]).
pub type SqliteStore = crate::RelayStore<Sqlite>;
/// The consumer's inbox and dead letters in SQLite ([`crate::Inbox`]).
pub type SqliteInbox = crate::Inbox<Sqlite>;
/// The server-side Idempotency-Key store in SQLite ([`crate::KeyStore`]).
pub type SqliteKeyStore = crate::KeyStore<Sqlite>;
/// Effect intents in SQLite ([`crate::Intents`]).
pub type SqliteIntents = crate::Intents<Sqlite>;

/// Creates or upgrades idem's tables, in one `BEGIN IMMEDIATE` transaction.
pub async fn migrate(pool: &SqlitePool, tables: &TableNames) -> Result<crate::MigrationReport> {
    crate::migrate(pool, tables).await
}

const BASES: &[&str] = &[
    "outbox_archive",
    "outbox",
    "schema_migrations",
    "inbox",
    "dead_letters",
    "idempotency_keys",
    "effect_intents",
    "audit",
];

static SQL: SqlSet = sql_set!(
    "sqlite",
    "mark_published.sql",
    "release.sql",
    "retry_parked_one.sql",
    "intent_retry_one.sql"
);

static MIGRATIONS: Migrations = migrations!(
    "sqlite",
    "outbox sequence numbers for inserted rows only (PostgreSQL; none here)",
    "outbox leases as HOT updates (PostgreSQL; none here)",
    "outbox writer rules checked by the trigger (PostgreSQL; none here)",
    "pg_logical_emit_message revoked from PUBLIC (PostgreSQL; none here)",
    "outbox rows record their WAL insert position (PostgreSQL; none here)",
    "outbox rows keep their WAL insert position on update (PostgreSQL; none here)",
    "outbox trigger functions with their own search_path (PostgreSQL; none here)",
    "outbox text converts to UTF-8 (PostgreSQL; none here)",
    "outbox row ids generated always (PostgreSQL; none here)",
    "outbox events written once",
    "outbox parked rows corrected after their commit (PostgreSQL; none here)",
    "outbox rows unparked only when the rules accept them (PostgreSQL; none here)",
    "dead-letter replay requests",
    "operator console audit and indexes"
);

/// The text format of SQLite timestamps written by idem (same as the column defaults).
pub(crate) const TS_FORMAT: &str = "%Y-%m-%dT%H:%M:%S%.3fZ";

/// Opens (creating if missing) a SQLite database with the settings idem relies on: WAL
/// journal, `synchronous=FULL` (a commit survives power loss), a 5 s busy timeout; a pool of 4
/// connections, each checked when it is released: one left inside a transaction (a future
/// dropped half-way through sqlx's `BEGIN IMMEDIATE`) is closed, never reused with the write
/// lock held.
pub async fn connect(url: &str) -> Result<SqlitePool> {
    connect_with_pool_size(url, 4).await
}

/// Fails on a connection still inside a transaction (release_check.sql).
const RELEASE_CHECK: &str = include_str!("../../sql/sqlite/release_check.sql");

/// Whether a released connection may go back to the pool: not if it is still inside a
/// transaction (the pool then closes it, which rolls the transaction back).
fn still_usable(
    conn: &mut SqliteConnection,
    _: sqlx::pool::PoolConnectionMetadata,
) -> BoxFuture<'_, sqlx::Result<bool>> {
    let check = sqlx::Executor::execute(conn, RELEASE_CHECK);
    Box::pin(async move { Ok(check.await.is_ok()) })
}

/// [`connect`] with a pool of `max_connections` (at least 1). SQLite has one writer at a time:
/// writers of one process that share a pool of 1 queue in the pool, first come first served,
/// instead of polling the write lock in SQLite's busy handler (which sleeps 1, 2, 5, 10 … ms
/// between tries, so a waiter often wakes long after the lock was free); readers then queue
/// too. A consumer holds a connection per partition it applies at once: keep its
/// `partition_concurrency` at or below the pool's size.
pub async fn connect_with_pool_size(url: &str, max_connections: u32) -> Result<SqlitePool> {
    let opts = SqliteConnectOptions::from_str(url)
        .map_err(|e| Error::Config(format!("invalid SQLite URL {url:?}: {e}")))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(5));
    SqlitePoolOptions::new()
        .max_connections(max_connections.max(1))
        .after_release(still_usable)
        .connect_with(opts)
        .await
        .map_err(|e| crate::dialect::db_error(format!("opening SQLite database {url}"), e))
}

/// Parses the timestamps other writers may store: RFC 3339, or ISO 8601 without a zone (UTC),
/// with `T` or a space.
pub(crate) fn parse_ts(s: &str) -> std::result::Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s)
        .map(|d| d.with_timezone(&Utc))
        .or_else(|_| {
            chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S%.f").map(|n| n.and_utc())
        })
        .or_else(|_| {
            chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f").map(|n| n.and_utc())
        })
        .map_err(|e| format!("timestamp {s:?} is not RFC 3339 or ISO 8601 ({e})"))
}

impl Dialect for Sqlite {
    const SCHEME: crate::Scheme = crate::Scheme::Sqlite;

    /// SQLite reports a missing table as plain `SQLITE_ERROR` (code 1, no extended code), so
    /// the message is the only thing that tells it apart; it only adds a hint to an error.
    fn is_undefined_table(e: &sqlx::Error) -> bool {
        e.as_database_error().is_some_and(|d| {
            d.code().as_deref() == Some("1") && d.message().contains("no such table")
        })
    }
}

impl SealedConn for SqliteConnection {}
impl SqlConnection for SqliteConnection {
    type Dialect = Sqlite;
}

/// `BEGIN IMMEDIATE`: the write lock is taken up front, so the busy timeout applies instead of
/// a snapshot conflict. The transaction is sqlx's, so it is rolled back however it ends: a
/// failed `COMMIT`, or the future dropped half-way (a cancelled claim). A raw `BEGIN IMMEDIATE`
/// left the write lock held by a pooled connection, and every other writer then waited out its
/// busy timeout.
fn begin_immediate(
    c: &mut SqliteConnection,
) -> BoxFuture<'_, sqlx::Result<Transaction<'_, Sqlite>>> {
    c.begin_with("BEGIN IMMEDIATE").boxed()
}

/// Runs `f` inside [`begin_immediate`], committing on success and rolling back otherwise.
pub(crate) async fn immediate<T>(
    conn: &mut SqliteConnection,
    context: &str,
    f: impl AsyncFnOnce(&mut SqliteConnection) -> std::result::Result<T, sqlx::Error>,
) -> Result<T> {
    let mut tx = begin_immediate(conn).await.map_err(|e| {
        crate::dialect::db_error(format!("{context}: starting a write transaction"), e)
    })?;
    let result = f(&mut tx).await;
    WriteTx::Tx(tx).finish(result, context).await
}

/// Now, in Unix milliseconds.
pub(crate) fn now_ms() -> i64 {
    Now::read().0
}

impl Sealed for Sqlite {
    fn sql() -> &'static SqlSet {
        &SQL
    }
    fn bases() -> &'static [&'static str] {
        BASES
    }
    fn migrations() -> Migrations {
        MIGRATIONS
    }
    fn bind<'q, T: Param<'q>>(q: Q<'q, Self>, v: T) -> Q<'q, Self> {
        q.bind(v)
    }
    fn bind_event_id(q: Q<'_, Self>, id: EventId) -> Q<'_, Self> {
        q.bind(id.to_string())
    }
    /// SQLite stores Unix milliseconds: bind the deadline.
    fn bind_after(q: Q<'_, Self>, now: Now, d: Duration) -> Q<'_, Self> {
        q.bind(now.after(d))
    }
    fn bind_now(q: Q<'_, Self>, now: Now) -> Q<'_, Self> {
        q.bind(now.0)
    }
    fn get<'r, T: Decoded<'r>>(row: &'r SqliteRow, col: &str) -> sqlx::Result<T> {
        row.try_get(col)
    }
    fn get_event_id(row: &SqliteRow, col: &str) -> sqlx::Result<Result<EventId>> {
        Ok(EventId::from_str(&row.try_get::<String, _>(col)?))
    }
    fn get_json_text(row: &SqliteRow, col: &str) -> sqlx::Result<String> {
        row.try_get(col)
    }
    fn execute<'q: 'c, 'c>(
        q: Q<'q, Self>,
        c: &'c mut SqliteConnection,
    ) -> BoxFuture<'c, sqlx::Result<u64>> {
        async move { q.execute(c).await.map(|r| r.rows_affected()) }.boxed()
    }
    fn execute_raw<'c>(
        c: &'c mut SqliteConnection,
        sql: &'c str,
    ) -> BoxFuture<'c, sqlx::Result<()>> {
        sqlx::Executor::execute(c, sqlx::raw_sql(sql))
            .map(|r| r.map(|_| ()))
            .boxed()
    }
    fn fetch_all<'q: 'c, 'c>(
        q: Q<'q, Self>,
        c: &'c mut SqliteConnection,
    ) -> BoxFuture<'c, sqlx::Result<Vec<SqliteRow>>> {
        q.fetch_all(c).boxed()
    }
    fn fetch_optional<'q: 'c, 'c>(
        q: Q<'q, Self>,
        c: &'c mut SqliteConnection,
    ) -> BoxFuture<'c, sqlx::Result<Option<SqliteRow>>> {
        q.fetch_optional(c).boxed()
    }
    fn begin_write(c: &mut SqliteConnection) -> BoxFuture<'_, sqlx::Result<WriteTx<'_, Self>>> {
        async move { begin_immediate(c).await.map(WriteTx::Tx) }.boxed()
    }
    fn begin_pool(pool: &SqlitePool) -> BoxFuture<'_, sqlx::Result<Transaction<'static, Self>>> {
        pool.begin_with("BEGIN IMMEDIATE").boxed()
    }
    /// One writer at a time: `BEGIN IMMEDIATE` is the lock. SQLite has no schemas.
    fn begin_migration<'c>(
        c: &'c mut SqliteConnection,
        _tables: &'c TableNames,
    ) -> BoxFuture<'c, Result<Transaction<'c, Self>>> {
        async move {
            begin_immediate(c).await.map_err(|e| {
                crate::dialect::db_error("running migrations: starting a write transaction", e)
            })
        }
        .boxed()
    }
    fn migrations_table(mig: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {mig} (version INTEGER PRIMARY KEY, description TEXT NOT NULL, \
             applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')))"
        )
    }
    /// `all` for every row, or `some` once per id.
    fn for_ids<'c>(
        c: &'c mut SqliteConnection,
        all: &'c str,
        some: &'c str,
        ids: Option<&'c [i64]>,
    ) -> BoxFuture<'c, sqlx::Result<u64>> {
        each_id(c, all, some, ids, |id| *id)
    }
    fn for_event_ids<'c>(
        c: &'c mut SqliteConnection,
        all: &'c str,
        some: &'c str,
        ids: Option<&'c [EventId]>,
    ) -> BoxFuture<'c, sqlx::Result<u64>> {
        each_id(c, all, some, ids, EventId::to_string)
    }
}

/// Runs `all` when there are no `ids`, else `some` once per id (bound as `key` of it).
fn each_id<'c, T: Sync, V>(
    c: &'c mut SqliteConnection,
    all: &'c str,
    some: &'c str,
    ids: Option<&'c [T]>,
    key: fn(&T) -> V,
) -> BoxFuture<'c, sqlx::Result<u64>>
where
    V: 'c + Send + sqlx::Encode<'c, Sqlite> + sqlx::Type<Sqlite>,
{
    async move {
        let Some(ids) = ids else {
            return Sqlite::execute(sqlx::query(all), c).await;
        };
        let mut n = 0;
        for id in ids {
            n += sqlx::query(some)
                .bind(key(id))
                .execute(&mut *c)
                .await?
                .rows_affected();
        }
        Ok(n)
    }
    .boxed()
}

impl Batches for Sqlite {
    /// One statement per attempt, in the caller's `BEGIN IMMEDIATE`.
    fn intent_finish<'c>(
        c: &'c mut SqliteConnection,
        sql: &'c str,
        now: Now,
        finished: &'c [FinishedAttempt],
    ) -> BoxFuture<'c, sqlx::Result<Vec<i64>>> {
        async move {
            let mut recorded = Vec::with_capacity(finished.len());
            for f in finished {
                let col = crate::intents::columns(&f.outcome);
                let n = sqlx::query(sql)
                    .bind(f.id)
                    .bind(f.attempt)
                    .bind(col.status)
                    .bind(col.response_status.map(i32::from))
                    .bind(col.response_body)
                    .bind(col.error)
                    .bind(now.after(col.backoff))
                    .execute(&mut *c)
                    .await?
                    .rows_affected();
                if n == 1 {
                    recorded.push(f.id);
                }
            }
            Ok(recorded)
        }
        .boxed()
    }

    /// One statement per event, in slice order.
    fn enqueue<'c>(
        c: &'c mut SqliteConnection,
        sql: &'c str,
        events: &'c [Event],
    ) -> BoxFuture<'c, sqlx::Result<()>> {
        async move {
            for e in events {
                sqlx::query(sql)
                    .bind(e.id().to_string())
                    .bind(e.aggregate_type())
                    .bind(e.aggregate_id())
                    .bind(e.event_type())
                    .bind(e.payload())
                    .bind(e.headers_json())
                    .bind(e.topic())
                    .bind(e.traceparent())
                    .bind(e.occurred_at().format(TS_FORMAT).to_string())
                    .execute(&mut *c)
                    .await?;
            }
            Ok(())
        }
        .boxed()
    }

    fn inbox_record<'c, 'e: 'c>(
        c: &'c mut SqliteConnection,
        sql: &'c str,
        group: &'c str,
        entries: &'c [InboxEntry<'e>],
    ) -> BoxFuture<'c, Result<Vec<(i32, String)>>> {
        async move {
            let mut out = Vec::with_capacity(entries.len());
            for e in entries {
                let row = sqlx::query(sql)
                    .bind(group)
                    .bind(e.event.event_id.to_string())
                    .bind(&e.event.event_type)
                    .bind(&e.event.aggregate_type)
                    .bind(&e.event.aggregate_id)
                    .bind(&e.event.payload_hash)
                    .bind(e.copies)
                    .bind(crate::inbox::status(e))
                    .fetch_one(&mut *c)
                    .await
                    .map_err(|err| {
                        crate::dialect::db_error("recording events in the inbox", err)
                    })?;
                let dec = |err| crate::dialect::db_error("decoding inbox rows", err);
                out.push((
                    row.try_get("delivery_count").map_err(dec)?,
                    row.try_get("payload_hash").map_err(dec)?,
                ));
            }
            Ok(out)
        }
        .boxed()
    }

    fn inbox_dead_lettered<'c>(
        c: &'c mut SqliteConnection,
        sql: &'c str,
        group: &'c str,
        ids: &'c [EventId],
    ) -> BoxFuture<'c, sqlx::Result<()>> {
        async move {
            for id in ids {
                sqlx::query(sql)
                    .bind(group)
                    .bind(id.to_string())
                    .execute(&mut *c)
                    .await?;
            }
            Ok(())
        }
        .boxed()
    }

    fn dead_letter<'c>(
        c: &'c mut SqliteConnection,
        sql: &'c str,
        group: &'c str,
        letters: &'c [DeadLetter],
    ) -> BoxFuture<'c, sqlx::Result<()>> {
        async move {
            for d in letters {
                sqlx::query(sql)
                    .bind(group)
                    .bind(&d.topic)
                    .bind(d.partition)
                    .bind(d.offset)
                    .bind(d.event_id.map(|e| e.to_string()))
                    .bind(d.event_type.as_deref())
                    .bind(&d.reason)
                    .bind(d.key.as_deref())
                    .bind(d.payload.as_deref())
                    .bind(d.headers.to_string())
                    .execute(&mut *c)
                    .await?;
            }
            Ok(())
        }
        .boxed()
    }

    fn check_usable(_c: &mut SqliteConnection) -> BoxFuture<'_, Result<()>> {
        // A failed statement in SQLite undoes that statement only; the transaction goes on.
        async { Ok(()) }.boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialect::sealed::Sealed;

    /// A write transaction whose future is dropped half-way (a cancelled claim) leaves neither
    /// its writes nor the write lock behind.
    #[tokio::test]
    async fn a_cancelled_write_transaction_leaves_no_lock_and_no_writes() {
        let dir = std::env::temp_dir().join(format!("idem-sqlite-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let pool = connect(&format!("sqlite://{}", dir.join("t.db").display()))
            .await
            .unwrap();
        sqlx::query("CREATE TABLE t (x INTEGER)")
            .execute(&pool)
            .await
            .unwrap();
        {
            let mut conn = pool.acquire().await.unwrap();
            let cancelled = tokio::time::timeout(Duration::from_millis(200), async {
                let mut w = Sqlite::begin_write(&mut conn).await?;
                sqlx::query("INSERT INTO t VALUES (1)")
                    .execute(&mut *w.conn())
                    .await?;
                std::future::pending::<()>().await;
                w.finish(Ok(()), "a test write")
                    .await
                    .map_err(|_| sqlx::Error::PoolClosed)
            })
            .await;
            assert!(cancelled.is_err(), "the write was meant to hang");
        }
        // A lock left behind makes this write fail with SQLITE_BUSY once the 5 s busy timeout
        // is out (on another connection), or land inside the cancelled transaction (on the same
        // one, which the rows below catch). How soon the pool closes the connection depends on
        // the machine's load, so no tighter bound is asserted.
        let write = sqlx::query("INSERT INTO t VALUES (2)").execute(&pool).await;
        assert!(write.is_ok(), "{write:?}");
        let rows: Vec<i64> = sqlx::query_scalar("SELECT x FROM t")
            .fetch_all(&pool)
            .await
            .unwrap();
        assert_eq!(rows, vec![2], "the cancelled write was kept");
        pool.close().await;
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn timestamps_round_trip() {
        let now = Utc::now();
        let s = now.format(TS_FORMAT).to_string();
        assert_eq!(
            parse_ts(&s).unwrap().timestamp_millis(),
            now.timestamp_millis()
        );
    }
}
