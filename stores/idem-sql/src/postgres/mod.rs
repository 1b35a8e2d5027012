//! PostgreSQL (production): idem's stores under their PostgreSQL names (`PgStore` is
//! [`RelayStore<Postgres>`](crate::RelayStore), and so on), the connection, and the dialect.
//!
//! * [`Outbox`] enqueues events inside the caller's own transaction: pass `&mut *tx`.
//! * [`MessageOutbox`] writes events with no table, as transactional logical decoding messages
//!   for the CDC relay's message mode (`idem cdc relay --messages`).
//! * [`migrate`] creates or upgrades idem's tables (the SQL lives in
//!   `stores/idem-sql/migrations/postgres/`).
//! * [`PgStore`] is the relay's view of the outbox, [`PgInbox`] the consumer's, [`PgKeyStore`]
//!   the server-side Idempotency-Key store and [`PgIntents`] the effect intents; their SQL lives
//!   in `stores/idem-sql/sql/postgres/` and `sql/common/`, one statement per file.
//! * [`connect`] opens a pool from a `postgres://` URL ([`PgUrl`]: `sslmode`, certificates).
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::Event;
//! let outbox = idem_sql::postgres::Outbox::default();
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
//! let outbox = idem_sql::postgres::MessageOutbox::default(); // prefix idem.outbox
//! let mut tx = pool.begin().await?;
//! outbox.enqueue(&mut tx, &event).await?;
//! tx.commit().await?; // published by `idem cdc relay --messages` once committed
//! # Ok(()) }
//! ```
//!
//! Commit order: see [the crate's page](crate#commit-order).

use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::idempotency::FinishedAttempt;
use idem_core::store::{DeadLetter, InboxEntry};
use idem_core::{Error, Event, EventId, Result, TableNames};
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions, PgRow};
use sqlx::{Connection, Postgres, Row, Transaction};
use uuid::Uuid;

use crate::dialect::sealed::{Batches, Sealed, SealedConn};
use crate::dialect::{Decoded, Dialect, Now, Param, Q, SqlConnection, WriteTx};
use crate::migrate::{Migrations, migrations};
use crate::queries::{SqlSet, sql_set};

mod cdc;
pub(crate) mod messages;
mod refusal;
mod relay;
mod retention;
pub(crate) mod url;

pub use cdc::CdcStatements;
pub use messages::MessageOutbox;
pub use url::{PgTls, PgUrl, SslMode};

/// Enqueues events in the caller's transaction ([`crate::Outbox`]). Cheap to clone.
pub type Outbox = crate::Outbox<Postgres>;
/// The relay's PostgreSQL store ([`crate::RelayStore`]).
pub type PgStore = crate::RelayStore<Postgres>;
/// The consumer's inbox and dead letters in PostgreSQL ([`crate::Inbox`]).
pub type PgInbox = crate::Inbox<Postgres>;
/// The server-side Idempotency-Key store in PostgreSQL ([`crate::KeyStore`]).
pub type PgKeyStore = crate::KeyStore<Postgres>;
/// Effect intents in PostgreSQL ([`crate::Intents`]).
pub type PgIntents = crate::Intents<Postgres>;

/// Creates or upgrades idem's tables. Safe to run concurrently (an advisory lock serializes
/// migrators) and repeatedly (applied versions are recorded in `<prefix>schema_migrations`).
pub async fn migrate(pool: &PgPool, tables: &TableNames) -> Result<crate::MigrationReport> {
    crate::migrate(pool, tables).await
}

/// Table bases used in the SQL files.
const BASES: &[&str] = &[
    "outbox_aggregates",
    "outbox_assign_seq",
    "outbox_check_row",
    "outbox_stamp_lsn",
    "outbox_not_utf8",
    "outbox_keep_event",
    "outbox_keep_seq",
    "outbox_archive",
    "outbox",
    "schema_migrations",
    "inbox",
    "dead_letters",
    "idempotency_keys",
    "effect_intents",
    "audit",
];

/// `mark_published` and `release` are the same statement, complete.sql: one statement marks and
/// releases.
static SQL: SqlSet = sql_set!(
    "postgres",
    "complete.sql",
    "complete.sql",
    "retry_parked.sql",
    "intent_retry.sql"
);

static MIGRATIONS: Migrations = migrations!(
    "postgres",
    "outbox sequence numbers for inserted rows only",
    "outbox leases as HOT updates",
    "outbox writer rules checked by the trigger",
    "pg_logical_emit_message revoked from PUBLIC",
    "outbox rows record their WAL insert position",
    "outbox rows keep their WAL insert position on update",
    "outbox trigger functions with their own search_path",
    "outbox text converts to UTF-8",
    "outbox row ids generated always",
    "outbox events written once",
    "outbox parked rows corrected after their commit",
    "outbox rows unparked only when the rules accept them",
    "dead-letter replay requests",
    "operator console audit and indexes"
);

/// Connects a pool suited to the relay and the CLI.
///
/// The URL is read as libpq reads it ([`url::PgUrl`]): `sslmode` (default `prefer`, TLS when the
/// server offers it), `sslrootcert`, `sslcert`, `sslkey`; an unknown parameter is refused. A
/// refused connection (an untrusted certificate, a role allowed only over TLS, a wrong
/// password) fails with what to change.
///
/// Connections are not pinged before each use (`test_before_acquire(false)`): the ping is one
/// more round trip per transaction, and a connection the server closed fails its next statement
/// instead, an error every caller already handles (the relay logs and retries it; sqlx then drops
/// the connection).
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool> {
    let target = url::PgUrl::parse(url)?;
    connect_to(
        &target,
        PgPoolOptions::new().max_connections(max_connections),
    )
    .await
}

/// How long the first connection may take before the start fails with its cause.
const FIRST_CONNECT: Duration = Duration::from_secs(10);

/// Connects `options`' pool to `target`, explaining a refusal.
///
/// One connection is opened first, alone, so that a server that is down, refuses or cannot be
/// reached fails the start within 10 s with its cause (a pool retries until its
/// acquire timeout and then reports only that it timed out).
pub async fn connect_to(target: &url::PgUrl, options: PgPoolOptions) -> Result<PgPool> {
    let opts = target.connect_options()?;
    match tokio::time::timeout(FIRST_CONNECT, PgConnection::connect_with(&opts)).await {
        Ok(Ok(first)) => {
            let _ = first.close().await;
        }
        Ok(Err(e)) => return Err(connect_error(target, e)),
        Err(_) => {
            return Err(connect_error(
                target,
                sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {FIRST_CONNECT:?}"),
                )),
            ));
        }
    }
    options
        .test_before_acquire(false)
        .connect_with(opts)
        .await
        .map_err(|e| connect_error(target, e))
}

/// The error of a failed connection to `target`: the driver's, with advice when idem
/// recognises the refusal.
pub fn connect_error(target: &url::PgUrl, e: sqlx::Error) -> Error {
    let context = format!("connecting to PostgreSQL at {}", target.redacted());
    match refusal::advice(&e, target) {
        Some(advice) => {
            let kind = crate::dialect::error_kind(&e);
            Error::database_as(kind, context, Refused { advice, source: e })
        }
        None => crate::dialect::db_error(context, e),
    }
}

/// A refusal idem recognises: what to do, then the driver's own words.
#[derive(Debug, thiserror::Error)]
#[error("{advice} (driver: {source})")]
pub struct Refused {
    advice: String,
    source: sqlx::Error,
}

impl Dialect for Postgres {
    const SCHEME: crate::Scheme = crate::Scheme::Postgres;

    fn is_undefined_table(e: &sqlx::Error) -> bool {
        sqlstate(e, "42P01")
    }
}

impl SealedConn for PgConnection {}
impl SqlConnection for PgConnection {
    type Dialect = Postgres;
}

/// Whether `e` carries SQLSTATE `code`.
fn sqlstate(e: &sqlx::Error, code: &str) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == code)
}

impl Sealed for Postgres {
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
        q.bind(id.as_uuid())
    }
    /// PostgreSQL adds `d` to its own clock in the statement: bind the milliseconds.
    fn bind_after(q: Q<'_, Self>, _now: Now, d: Duration) -> Q<'_, Self> {
        q.bind(crate::millis(d))
    }
    fn bind_now(q: Q<'_, Self>, _now: Now) -> Q<'_, Self> {
        q
    }
    fn get<'r, T: Decoded<'r>>(row: &'r PgRow, col: &str) -> sqlx::Result<T> {
        row.try_get(col)
    }
    fn get_event_id(row: &PgRow, col: &str) -> sqlx::Result<Result<EventId>> {
        Ok(Ok(EventId(row.try_get::<Uuid, _>(col)?)))
    }
    fn get_json_text(row: &PgRow, col: &str) -> sqlx::Result<String> {
        Ok(row.try_get::<serde_json::Value, _>(col)?.to_string())
    }
    fn execute<'q: 'c, 'c>(
        q: Q<'q, Self>,
        c: &'c mut PgConnection,
    ) -> BoxFuture<'c, sqlx::Result<u64>> {
        async move { q.execute(c).await.map(|r| r.rows_affected()) }.boxed()
    }
    fn execute_raw<'c>(c: &'c mut PgConnection, sql: &'c str) -> BoxFuture<'c, sqlx::Result<()>> {
        sqlx::Executor::execute(c, sqlx::raw_sql(sql))
            .map(|r| r.map(|_| ()))
            .boxed()
    }
    fn fetch_all<'q: 'c, 'c>(
        q: Q<'q, Self>,
        c: &'c mut PgConnection,
    ) -> BoxFuture<'c, sqlx::Result<Vec<PgRow>>> {
        q.fetch_all(c).boxed()
    }
    fn fetch_optional<'q: 'c, 'c>(
        q: Q<'q, Self>,
        c: &'c mut PgConnection,
    ) -> BoxFuture<'c, sqlx::Result<Option<PgRow>>> {
        q.fetch_optional(c).boxed()
    }
    /// Each statement is atomic on its own; row locks (`FOR UPDATE SKIP LOCKED`) do the rest.
    fn begin_write(c: &mut PgConnection) -> BoxFuture<'_, sqlx::Result<WriteTx<'_, Self>>> {
        async move { Ok(WriteTx::Direct(c)) }.boxed()
    }
    fn begin_pool(pool: &PgPool) -> BoxFuture<'_, sqlx::Result<Transaction<'static, Self>>> {
        pool.begin().boxed()
    }
    /// An advisory lock per schema and prefix serializes migrators.
    fn begin_migration<'c>(
        c: &'c mut PgConnection,
        tables: &'c TableNames,
    ) -> BoxFuture<'c, Result<Transaction<'c, Self>>> {
        async move {
            let mut tx = c
                .begin()
                .await
                .map_err(|e| crate::dialect::db_error("starting the migration", e))?;
            let lock_key = format!(
                "idem_migrate:{}:{}",
                tables.schema().unwrap_or(""),
                tables.prefix()
            );
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
                .bind(&lock_key)
                .execute(&mut *tx)
                .await
                .map_err(|e| crate::dialect::db_error("taking the migration lock", e))?;
            if let Some(schema) = tables.schema() {
                // `schema` is a validated identifier (TableNames).
                sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| crate::dialect::db_error("creating the schema", e))?;
            }
            Ok(tx)
        }
        .boxed()
    }
    fn migrations_table(mig: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {mig} (version bigint PRIMARY KEY, description text NOT NULL, \
             applied_at timestamptz NOT NULL DEFAULT now())"
        )
    }
    /// One statement, the ids as one array (NULL: every row).
    fn for_ids<'c>(
        c: &'c mut PgConnection,
        all: &'c str,
        _some: &'c str,
        ids: Option<&'c [i64]>,
    ) -> BoxFuture<'c, sqlx::Result<u64>> {
        let ids = ids.map(<[i64]>::to_vec);
        Self::execute(sqlx::query(all).bind(ids), c)
    }
    fn for_event_ids<'c>(
        c: &'c mut PgConnection,
        all: &'c str,
        _some: &'c str,
        ids: Option<&'c [EventId]>,
    ) -> BoxFuture<'c, sqlx::Result<u64>> {
        let ids: Option<Vec<Uuid>> = ids.map(|ids| ids.iter().map(EventId::as_uuid).collect());
        Self::execute(sqlx::query(all).bind(ids), c)
    }
}

impl Batches for Postgres {
    /// One `UPDATE … FROM unnest(…)` for the whole batch.
    fn intent_finish<'c>(
        c: &'c mut PgConnection,
        sql: &'c str,
        _now: Now,
        finished: &'c [FinishedAttempt],
    ) -> BoxFuture<'c, sqlx::Result<Vec<i64>>> {
        let cols: Vec<_> = finished
            .iter()
            .map(|f| crate::intents::columns(&f.outcome))
            .collect();
        let q = sqlx::query_scalar::<_, i64>(sql)
            .bind(finished.iter().map(|f| f.id).collect::<Vec<_>>())
            .bind(finished.iter().map(|f| f.attempt).collect::<Vec<_>>())
            .bind(cols.iter().map(|c| c.status).collect::<Vec<_>>())
            .bind(
                cols.iter()
                    .map(|c| c.response_status.map(i32::from))
                    .collect::<Vec<_>>(),
            )
            .bind(cols.iter().map(|c| c.response_body).collect::<Vec<_>>())
            .bind(cols.iter().map(|c| c.error).collect::<Vec<_>>())
            .bind(
                cols.iter()
                    .map(|c| crate::millis(c.backoff))
                    .collect::<Vec<_>>(),
            );
        q.fetch_all(c).boxed()
    }

    /// One statement of arrays, sorted by aggregate so that the per-aggregate counter locks are
    /// always taken in one order.
    fn enqueue<'c>(
        c: &'c mut PgConnection,
        sql: &'c str,
        events: &'c [Event],
    ) -> BoxFuture<'c, sqlx::Result<()>> {
        let mut sorted: Vec<&Event> = events.iter().collect();
        sorted.sort_by(|a, b| {
            (a.aggregate_type(), a.aggregate_id()).cmp(&(b.aggregate_type(), b.aggregate_id()))
        });
        let col = |f: fn(&Event) -> &str| sorted.iter().map(|e| f(e)).collect::<Vec<_>>();
        let q = sqlx::query(sql)
            .bind(sorted.iter().map(|e| e.id().as_uuid()).collect::<Vec<_>>())
            .bind(col(Event::aggregate_type))
            .bind(col(Event::aggregate_id))
            .bind(col(Event::event_type))
            .bind(col(Event::payload))
            .bind(sorted.iter().map(|e| e.headers_json()).collect::<Vec<_>>())
            .bind(sorted.iter().map(|e| e.topic()).collect::<Vec<_>>())
            .bind(sorted.iter().map(|e| e.traceparent()).collect::<Vec<_>>())
            .bind(sorted.iter().map(|e| e.occurred_at()).collect::<Vec<_>>());
        async move { q.execute(c).await.map(|_| ()) }.boxed()
    }

    fn inbox_record<'c, 'e: 'c>(
        c: &'c mut PgConnection,
        sql: &'c str,
        group: &'c str,
        entries: &'c [InboxEntry<'e>],
    ) -> BoxFuture<'c, Result<Vec<(i32, String)>>> {
        let col = |f: fn(&'c InboxEntry<'e>) -> &'c str| entries.iter().map(f).collect::<Vec<_>>();
        let q = sqlx::query(sql)
            .bind(group)
            .bind(
                entries
                    .iter()
                    .map(|e| e.event.event_id.as_uuid())
                    .collect::<Vec<_>>(),
            )
            .bind(col(|e| &e.event.event_type))
            .bind(col(|e| &e.event.aggregate_type))
            .bind(col(|e| &e.event.aggregate_id))
            .bind(col(|e| &e.event.payload_hash))
            .bind(entries.iter().map(|e| e.copies).collect::<Vec<_>>())
            .bind(entries.iter().map(crate::inbox::status).collect::<Vec<_>>());
        async move {
            let rows = q
                .fetch_all(c)
                .await
                .map_err(|e| crate::dialect::db_error("recording events in the inbox", e))?;
            let mut by_id = std::collections::HashMap::with_capacity(rows.len());
            for row in &rows {
                let dec = |e| crate::dialect::db_error("decoding inbox rows", e);
                let id: Uuid = row.try_get("event_id").map_err(dec)?;
                let count: i32 = row.try_get("delivery_count").map_err(dec)?;
                let hash: String = row.try_get("payload_hash").map_err(dec)?;
                by_id.insert(id, (count, hash));
            }
            entries
                .iter()
                .map(|e| {
                    by_id
                        .get(&e.event.event_id.as_uuid())
                        .cloned()
                        .ok_or_else(|| {
                            Error::database(
                                "recording events in the inbox",
                                format!("no inbox row returned for {}", e.event.event_id),
                            )
                        })
                })
                .collect()
        }
        .boxed()
    }

    fn inbox_dead_lettered<'c>(
        c: &'c mut PgConnection,
        sql: &'c str,
        group: &'c str,
        ids: &'c [EventId],
    ) -> BoxFuture<'c, sqlx::Result<()>> {
        let q = sqlx::query(sql)
            .bind(group)
            .bind(ids.iter().map(EventId::as_uuid).collect::<Vec<_>>());
        async move { q.execute(c).await.map(|_| ()) }.boxed()
    }

    fn dead_letter<'c>(
        c: &'c mut PgConnection,
        sql: &'c str,
        group: &'c str,
        letters: &'c [DeadLetter],
    ) -> BoxFuture<'c, sqlx::Result<()>> {
        let opt =
            |f: fn(&'c DeadLetter) -> Option<&'c str>| letters.iter().map(f).collect::<Vec<_>>();
        let q = sqlx::query(sql)
            .bind(group)
            .bind(letters.iter().map(|d| d.topic.as_str()).collect::<Vec<_>>())
            .bind(letters.iter().map(|d| d.partition).collect::<Vec<_>>())
            .bind(letters.iter().map(|d| d.offset).collect::<Vec<_>>())
            .bind(
                letters
                    .iter()
                    .map(|d| d.event_id.map(|e| e.as_uuid()))
                    .collect::<Vec<_>>(),
            )
            .bind(opt(|d| d.event_type.as_deref()))
            .bind(
                letters
                    .iter()
                    .map(|d| d.reason.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(opt(|d| d.key.as_deref()))
            .bind(
                letters
                    .iter()
                    .map(|d| d.payload.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(
                letters
                    .iter()
                    .map(|d| d.headers.to_string())
                    .collect::<Vec<_>>(),
            );
        async move { q.execute(c).await.map(|_| ()) }.boxed()
    }

    fn check_usable(c: &mut PgConnection) -> BoxFuture<'_, Result<()>> {
        async move {
            // Any statement fails in an aborted transaction (SQLSTATE 25P02).
            match sqlx::Executor::execute(&mut *c, "SELECT 1").await {
                Ok(_) => Ok(()),
                Err(e) if sqlstate(&e, "25P02") => Err(crate::dialect::db_error(
                    "checking the transaction before commit: a statement of the handler failed and \
                     the handler did not report it (it swallowed a database error), so PostgreSQL \
                     aborted the transaction and would roll it back on COMMIT; nothing of the batch \
                     is committed. Handlers must return database errors, or run statements that may \
                     fail inside a savepoint of their own",
                    e,
                )),
                // Anything else (a lost connection) is no handler's fault: the statements that
                // follow, or the commit, fail with it and the batch is retried as a whole.
                Err(_) => Ok(()),
            }
        }
        .boxed()
    }
}
