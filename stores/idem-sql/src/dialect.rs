//! What differs between the databases, and nothing else.
//!
//! [`Dialect`] extends [`sqlx::Database`] and is sealed: it is implemented for
//! [`sqlx::Postgres`] (feature `postgres`) and [`sqlx::Sqlite`] (feature `sqlite`). The store
//! code is written once over it; a dialect answers only the real differences:
//!
//! * how an event id (a UUID) is bound and read (`uuid` vs text), and how a timestamp is read;
//! * where "now" comes from: PostgreSQL's clock inside the statement, or the Rust clock bound as
//!   the statement's last parameter (SQLite stores Unix milliseconds);
//! * how a write begins: PostgreSQL statements run as they are, SQLite ones inside
//!   `BEGIN IMMEDIATE` (the write lock up front, so the busy timeout applies);
//! * the migration lock (`pg_advisory_xact_lock` vs `BEGIN IMMEDIATE`);
//! * a set of ids bound as one array, or one statement per id;
//! * unique violations and missing tables, recognised by [`sqlx::error::ErrorKind`] and SQLSTATE
//!   codes, never by message text ([`is_unique_violation`], [`Dialect::is_undefined_table`]).

use std::time::Duration;

use futures::future::BoxFuture;
use idem_core::{Error, ErrorKind, EventId, Result, TableNames};
use sqlx::{Database, Transaction};

use crate::queries::SqlSet;

/// A database idem's store runs on. Sealed: PostgreSQL and SQLite.
pub trait Dialect: Database<Connection: SqlConnection<Dialect = Self>> + sealed::Sealed {
    /// Whether `url` names this database (a scheme of [`Database::URL_SCHEMES`]).
    fn accepts(url: &str) -> bool {
        <Self as Database>::URL_SCHEMES.iter().any(|s| {
            url.strip_prefix(s)
                .is_some_and(|rest| rest.starts_with(':'))
        })
    }

    /// Which database this is (for the rare statement only one of them has, such as
    /// PostgreSQL's `lock_timeout`).
    const SCHEME: crate::Scheme;

    /// Whether `e` says a table is missing (idem's tables were not migrated yet).
    fn is_undefined_table(e: &sqlx::Error) -> bool;
}

/// Whether `e` is a unique violation, by [`sqlx::error::ErrorKind`] (both dialects).
pub fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| matches!(d.kind(), sqlx::error::ErrorKind::UniqueViolation))
}

/// What kind of failure a driver error is ([`idem_core::ErrorKind`]), by its code: a missing
/// table, column, function or schema is [`ErrorKind::NotMigrated`]; a unique violation a
/// [`ErrorKind::Conflict`]; the data, integrity, `RAISE` and program-limit classes (PostgreSQL
/// 22, 23, P0, 54; SQLite's constraint and size codes) [`ErrorKind::Invalid`]; a refused login
/// or a missing database [`ErrorKind::Config`]; everything else, and every error that is not
/// the database's answer (I/O, the pool, TLS), [`ErrorKind::Transient`].
pub(crate) fn error_kind(e: &sqlx::Error) -> ErrorKind {
    let Some(db) = e.as_database_error() else {
        return ErrorKind::Transient;
    };
    if is_unique_violation(e) {
        return ErrorKind::Conflict;
    }
    let code = db.code().unwrap_or_default();
    if code.len() == 5 {
        return match (code.as_ref(), code.get(..2)) {
            ("42P01" | "42703" | "42883" | "3F000", _) => ErrorKind::NotMigrated,
            (_, Some("22" | "23" | "P0" | "54")) => ErrorKind::Invalid,
            (_, Some("28" | "3D")) => ErrorKind::Config,
            _ => ErrorKind::Transient,
        };
    }
    let missing = ["no such table", "no such column", "no such function"];
    match code.parse::<u32>().map(|c| c & 0xff) {
        Ok(1) if missing.iter().any(|m| db.message().contains(m)) => ErrorKind::NotMigrated,
        Ok(18..=20) => ErrorKind::Invalid,
        _ => ErrorKind::Transient,
    }
}

/// A driver error with what idem was doing, of the kind its code says ([`error_kind`]).
pub(crate) fn db_error(context: impl Into<String>, e: sqlx::Error) -> Error {
    Error::database_as(error_kind(&e), context, e)
}

/// The connection of a dialect, for code written once for both (a handler's
/// `impl<C: SqlConnection> Handler<C>`): `C::Dialect` names the database.
pub trait SqlConnection: sqlx::Connection + sealed::SealedConn {
    /// The database of this connection.
    type Dialect: Dialect<Connection = Self>;
}

/// A statement being built: `sqlx::query`, with binds a dialect understands.
pub(crate) type Q<'q, DB> = sqlx::query::Query<'q, DB, <DB as Database>::Arguments<'q>>;

/// The moment a statement runs at, as Rust sees it (used by dialects without a usable clock).
/// PostgreSQL reads its own clock: only SQLite reads the time.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub struct Now(pub(crate) i64);

impl Now {
    pub(crate) fn read() -> Now {
        Now(chrono::Utc::now().timestamp_millis())
    }

    /// `d` from now, in Unix milliseconds.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn after(self, d: Duration) -> i64 {
        self.0.saturating_add(crate::millis(d))
    }
}

/// A value both dialects bind: the `sqlx::Encode` and `sqlx::Type` bounds of every compiled-in
/// dialect, as supertraits so that code written once can rely on them.
pub trait Param<'q>: Send + 'q + sealed::PgParam<'q> + sealed::LiteParam<'q> {}
impl<'q, T: Send + 'q + sealed::PgParam<'q> + sealed::LiteParam<'q>> Param<'q> for T {}

/// A value both dialects decode (see [`Param`]).
pub trait Decoded<'r>: Sized + sealed::PgDecoded<'r> + sealed::LiteDecoded<'r> {}
impl<'r, T: sealed::PgDecoded<'r> + sealed::LiteDecoded<'r>> Decoded<'r> for T {}

/// A write in progress: a plain connection, or a transaction where the dialect wants one.
pub enum WriteTx<'c, DB: Database> {
    /// The statements run on the connection as they are (each one atomic).
    Direct(&'c mut DB::Connection),
    /// The statements run in this transaction (rolled back if dropped before [`WriteTx::finish`]).
    Tx(Transaction<'c, DB>),
}

impl<DB: Database> std::fmt::Debug for WriteTx<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WriteTx::Direct(_) => "WriteTx::Direct",
            WriteTx::Tx(_) => "WriteTx::Tx",
        })
    }
}

impl<DB: Database> WriteTx<'_, DB> {
    pub(crate) fn conn(&mut self) -> &mut DB::Connection {
        match self {
            WriteTx::Direct(c) => c,
            WriteTx::Tx(t) => t,
        }
    }

    /// Commits on success and rolls back otherwise, naming `context` in the error.
    pub(crate) async fn finish<T>(
        self,
        result: std::result::Result<T, sqlx::Error>,
        context: &str,
    ) -> Result<T> {
        match (self, result) {
            (WriteTx::Direct(_), r) => {
                r.map_err(|e| crate::dialect::db_error(context.to_owned(), e))
            }
            (WriteTx::Tx(tx), Ok(v)) => {
                tx.commit()
                    .await
                    .map_err(|e| crate::dialect::db_error(format!("{context}: committing"), e))?;
                Ok(v)
            }
            (WriteTx::Tx(tx), Err(e)) => {
                let _ = tx.rollback().await;
                Err(crate::dialect::db_error(context.to_owned(), e))
            }
        }
    }
}

/// A statement written once for every dialect: `sqlx::query` with binds and runners that
/// need no per-database bounds (write its SQL with `$N` placeholders, which both accept).
///
/// ```no_run
/// # async fn demo<C: idem_sql::SqlConnection>(conn: &mut C, e: &idem_core::InboundEvent) -> sqlx::Result<u64> {
/// idem_sql::Statement::<C::Dialect>::new("INSERT INTO audit_log (event_id) VALUES ($1)")
///     .event_id(e.event_id)
///     .execute(conn)
///     .await
/// # }
/// ```
pub struct Statement<'q, DB: Dialect>(Q<'q, DB>);

pub(crate) type Stmt<'q, DB> = Statement<'q, DB>;

impl<DB: Dialect> std::fmt::Debug for Statement<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Statement")
    }
}

impl<'q, DB: Dialect> Statement<'q, DB> {
    /// The statement `sql`.
    pub fn new(sql: &'q str) -> Self {
        Statement(sqlx::query(sql))
    }

    /// Binds the next parameter.
    pub fn bind<T: Param<'q>>(self, v: T) -> Self {
        Statement(DB::bind(self.0, v))
    }

    /// Binds an event id as the database stores it (`uuid`, or text on SQLite).
    pub fn event_id(self, id: EventId) -> Self {
        Statement(DB::bind_event_id(self.0, id))
    }

    /// `d` from now: milliseconds for a dialect with a clock, a Unix-ms deadline otherwise.
    pub(crate) fn after(self, now: Now, d: Duration) -> Self {
        Statement(DB::bind_after(self.0, now, d))
    }

    /// The clock, as the statement's last parameter, where the dialect has none of its own.
    pub(crate) fn now(self, now: Now) -> Self {
        Statement(DB::bind_now(self.0, now))
    }

    /// Runs the statement on `c`; the rows it changed.
    pub fn execute<'c>(self, c: &'c mut DB::Connection) -> BoxFuture<'c, sqlx::Result<u64>>
    where
        'q: 'c,
    {
        DB::execute(self.0, c)
    }

    /// Runs the query on `c`; every row.
    pub fn fetch_all<'c>(
        self,
        c: &'c mut DB::Connection,
    ) -> BoxFuture<'c, sqlx::Result<Vec<DB::Row>>>
    where
        'q: 'c,
    {
        DB::fetch_all(self.0, c)
    }

    /// Runs the query on `c`; the first row, if any.
    pub fn fetch_optional<'c>(
        self,
        c: &'c mut DB::Connection,
    ) -> BoxFuture<'c, sqlx::Result<Option<DB::Row>>>
    where
        'q: 'c,
    {
        DB::fetch_optional(self.0, c)
    }
}

/// Reads column `col` of `row`, for code written once for every dialect.
pub fn get<'r, DB: Dialect, T: Decoded<'r>>(row: &'r DB::Row, col: &str) -> sqlx::Result<T> {
    DB::get(row, col)
}

pub(crate) mod sealed {
    use super::*;

    /// The dialect primitives. Public in a private module: callable in this crate only.
    pub trait Sealed: Database + Sized + Batches + RelayOps {
        /// The statements of this dialect.
        fn sql() -> &'static SqlSet;
        /// The table bases its statements name.
        fn bases() -> &'static [&'static str];
        /// The migrations shipped for this dialect.
        fn migrations() -> crate::migrate::Migrations;
        fn bind<'q, T: Param<'q>>(q: Q<'q, Self>, v: T) -> Q<'q, Self>;
        fn bind_event_id(q: Q<'_, Self>, id: EventId) -> Q<'_, Self>;
        fn bind_after(q: Q<'_, Self>, now: Now, d: Duration) -> Q<'_, Self>;
        fn bind_now(q: Q<'_, Self>, now: Now) -> Q<'_, Self>;
        fn get<'r, T: Decoded<'r>>(row: &'r Self::Row, col: &str) -> sqlx::Result<T>;
        /// An event id column: the driver's error outside, a malformed id inside.
        fn get_event_id(row: &Self::Row, col: &str) -> sqlx::Result<Result<EventId>>;
        /// A JSON column as text.
        fn get_json_text(row: &Self::Row, col: &str) -> sqlx::Result<String>;
        fn execute<'q: 'c, 'c>(
            q: Q<'q, Self>,
            c: &'c mut Self::Connection,
        ) -> BoxFuture<'c, sqlx::Result<u64>>;
        /// Runs `sql`, one or more statements without parameters (a migration).
        fn execute_raw<'c>(
            c: &'c mut Self::Connection,
            sql: &'c str,
        ) -> BoxFuture<'c, sqlx::Result<()>>;
        fn fetch_all<'q: 'c, 'c>(
            q: Q<'q, Self>,
            c: &'c mut Self::Connection,
        ) -> BoxFuture<'c, sqlx::Result<Vec<Self::Row>>>;
        fn fetch_optional<'q: 'c, 'c>(
            q: Q<'q, Self>,
            c: &'c mut Self::Connection,
        ) -> BoxFuture<'c, sqlx::Result<Option<Self::Row>>>;
        /// Starts a write of one or more statements.
        fn begin_write(c: &mut Self::Connection) -> BoxFuture<'_, sqlx::Result<WriteTx<'_, Self>>>;
        /// Begins a consumer transaction on the pool.
        fn begin_pool(
            pool: &sqlx::Pool<Self>,
        ) -> BoxFuture<'_, sqlx::Result<Transaction<'static, Self>>>;
        /// Begins the migration transaction, holding the migration lock, with the schema created.
        fn begin_migration<'c>(
            c: &'c mut Self::Connection,
            tables: &'c TableNames,
        ) -> BoxFuture<'c, Result<Transaction<'c, Self>>>;
        /// `CREATE TABLE IF NOT EXISTS` of the migrations table `mig`.
        fn migrations_table(mig: &str) -> String;
        /// Runs `all` (every row) or, for `ids`, `one_by_one`'s per-id loop or an array bind.
        fn for_ids<'c>(
            c: &'c mut Self::Connection,
            all: &'c str,
            some: &'c str,
            ids: Option<&'c [i64]>,
        ) -> BoxFuture<'c, sqlx::Result<u64>>;
        /// As [`Sealed::for_ids`], for event ids.
        fn for_event_ids<'c>(
            c: &'c mut Self::Connection,
            all: &'c str,
            some: &'c str,
            ids: Option<&'c [EventId]>,
        ) -> BoxFuture<'c, sqlx::Result<u64>>;
    }

    /// The array-or-loop statements: one statement per set where the dialect binds arrays
    /// (PostgreSQL), one per element otherwise (SQLite).
    pub trait Batches: Database + Sized {
        /// Inserts `events` (not empty) into the outbox.
        fn enqueue<'c>(
            c: &'c mut Self::Connection,
            sql: &'c str,
            events: &'c [idem_core::Event],
        ) -> BoxFuture<'c, sqlx::Result<()>>;
        /// Records `entries` (not empty) in the inbox: (delivery count, payload hash) per entry,
        /// in entry order.
        fn inbox_record<'c, 'e: 'c>(
            c: &'c mut Self::Connection,
            sql: &'c str,
            group: &'c str,
            entries: &'c [idem_core::store::InboxEntry<'e>],
        ) -> BoxFuture<'c, Result<Vec<(i32, String)>>>;
        /// Marks the inbox rows of `ids` dead-lettered.
        fn inbox_dead_lettered<'c>(
            c: &'c mut Self::Connection,
            sql: &'c str,
            group: &'c str,
            ids: &'c [EventId],
        ) -> BoxFuture<'c, sqlx::Result<()>>;
        /// Stores `letters` (not empty).
        fn dead_letter<'c>(
            c: &'c mut Self::Connection,
            sql: &'c str,
            group: &'c str,
            letters: &'c [idem_core::store::DeadLetter],
        ) -> BoxFuture<'c, sqlx::Result<()>>;
        /// Fails when the handler's transaction can no longer commit.
        fn check_usable(c: &mut Self::Connection) -> BoxFuture<'_, Result<()>>;
        /// Records the outcomes of `finished` (not empty) with `sql` (`intent_finish`): one
        /// statement of arrays, or one statement per attempt inside the caller's transaction.
        /// The ids recorded; the others were fenced.
        fn intent_finish<'c>(
            c: &'c mut Self::Connection,
            sql: &'c str,
            now: Now,
            finished: &'c [idem_core::idempotency::FinishedAttempt],
        ) -> BoxFuture<'c, sqlx::Result<Vec<i64>>>;
    }

    /// The relay's statements whose flow is the dialect's own (claim and mark in
    /// `FOR UPDATE SKIP LOCKED` with arrays, or in `BEGIN IMMEDIATE` one row at a time; ages
    /// from the database's clock, or parsed from text).
    pub trait RelayOps: Database + Sized {
        /// Whether [`RelayOps::claim_within`] looks at a bounded window of heads (then an empty
        /// claim is retried over every pending row, at most once a second).
        const WINDOWED_CLAIM: bool;
        /// Refreshes the planner's statistics of the outbox after a mass change (best effort).
        fn refresh_statistics(store: &crate::RelayStore<Self>) -> BoxFuture<'_, ()>
        where
            Self: super::Dialect;
        /// One claim over the oldest `window` pending rows (None: every pending row).
        fn claim_within<'a>(
            store: &'a crate::RelayStore<Self>,
            request: &'a idem_core::outbox::ClaimRequest,
            window: Option<i64>,
        ) -> BoxFuture<'a, Result<idem_core::outbox::Claim>>
        where
            Self: super::Dialect;
        /// [`idem_core::store::OutboxStore::complete`].
        fn complete<'a>(
            store: &'a crate::RelayStore<Self>,
            claim: &'a idem_core::outbox::Claim,
            outcome: &'a idem_core::outbox::ClaimOutcome,
        ) -> BoxFuture<'a, Result<idem_core::outbox::Completed>>
        where
            Self: super::Dialect;
        /// [`idem_core::store::OutboxStore::prune`].
        fn prune<'a>(
            store: &'a crate::RelayStore<Self>,
            policy: &'a idem_core::outbox::PrunePolicy,
        ) -> BoxFuture<'a, Result<u64>>
        where
            Self: super::Dialect;
        /// [`idem_core::store::OutboxStore::status`].
        fn status(
            store: &crate::RelayStore<Self>,
        ) -> BoxFuture<'_, Result<idem_core::outbox::OutboxStatus>>
        where
            Self: super::Dialect;
        /// [`idem_core::store::OutboxStore::backlog`].
        fn backlog(
            store: &crate::RelayStore<Self>,
        ) -> BoxFuture<'_, Result<Vec<idem_core::outbox::Backlog>>>
        where
            Self: super::Dialect;
        /// [`idem_core::retention::RetentionStore::prune_older`].
        fn prune_older<'a>(
            store: &'a crate::RelayStore<Self>,
            what: idem_core::retention::Prunable,
            window: &'a idem_core::retention::RetentionWindow,
            batch: u32,
        ) -> BoxFuture<'a, Result<u64>>
        where
            Self: super::Dialect;
        /// [`idem_core::retention::RetentionStore::prune_aggregate_counters`].
        fn prune_counters(
            store: &crate::RelayStore<Self>,
            batch: u32,
        ) -> BoxFuture<'_, Result<u64>>
        where
            Self: super::Dialect;
    }

    /// Seals [`SqlConnection`](super::SqlConnection).
    pub trait SealedConn {}

    #[cfg(feature = "postgres")]
    pub trait PgParam<'q>: sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> {}
    #[cfg(feature = "postgres")]
    impl<'q, T: sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>> PgParam<'q> for T {}
    #[cfg(not(feature = "postgres"))]
    pub trait PgParam<'q> {}
    #[cfg(not(feature = "postgres"))]
    impl<T> PgParam<'_> for T {}

    #[cfg(feature = "sqlite")]
    pub trait LiteParam<'q>: sqlx::Encode<'q, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite> {}
    #[cfg(feature = "sqlite")]
    impl<'q, T: sqlx::Encode<'q, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite>> LiteParam<'q> for T {}
    #[cfg(not(feature = "sqlite"))]
    pub trait LiteParam<'q> {}
    #[cfg(not(feature = "sqlite"))]
    impl<T> LiteParam<'_> for T {}

    #[cfg(feature = "postgres")]
    pub trait PgDecoded<'r>: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> {}
    #[cfg(feature = "postgres")]
    impl<'r, T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>> PgDecoded<'r> for T {}
    #[cfg(not(feature = "postgres"))]
    pub trait PgDecoded<'r> {}
    #[cfg(not(feature = "postgres"))]
    impl<T> PgDecoded<'_> for T {}

    #[cfg(feature = "sqlite")]
    pub trait LiteDecoded<'r>: sqlx::Decode<'r, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite> {}
    #[cfg(feature = "sqlite")]
    impl<'r, T: sqlx::Decode<'r, sqlx::Sqlite> + sqlx::Type<sqlx::Sqlite>> LiteDecoded<'r> for T {}
    #[cfg(not(feature = "sqlite"))]
    pub trait LiteDecoded<'r> {}
    #[cfg(not(feature = "sqlite"))]
    impl<T> LiteDecoded<'_> for T {}
}
