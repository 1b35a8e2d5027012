//! One store chosen at run time by URL scheme: the single home of "PostgreSQL or SQLite?".

use idem_core::{Error, Result, TableNames};
use sqlx::Pool;

use crate::{Dialect, Inbox, Intents, KeyStore, MigrationReport, Outbox, RelayStore};

/// The databases a URL can name, whether or not this build includes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// `postgres://` or `postgresql://` (feature `postgres`).
    Postgres,
    /// `sqlite:` (feature `sqlite`).
    Sqlite,
}

impl Scheme {
    /// The database `url` names, or why none.
    pub fn of(url: &str) -> Result<Scheme> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Scheme::Postgres)
        } else if url.starts_with("sqlite:") {
            Ok(Scheme::Sqlite)
        } else {
            Err(Error::Config(format!(
                "unsupported database URL {:?}: use postgres://… or sqlite://path",
                crate::redact(url)
            )))
        }
    }

    /// The feature that compiles this database in.
    pub fn feature(self) -> &'static str {
        match self {
            Scheme::Postgres => "postgres",
            Scheme::Sqlite => "sqlite",
        }
    }

    /// The error for a database this build leaves out.
    #[allow(dead_code)] // unused when every feature is on
    fn not_compiled(self) -> Error {
        Error::Config(format!(
            "this build of idem has no {self:?} support: enable the `{}` feature of idem-sql",
            self.feature()
        ))
    }
}

/// A pool of either database.
#[derive(Clone, Debug)]
pub enum AnyPool {
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(sqlx::PgPool),
    /// SQLite.
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool),
}

/// Runs `$body` with `$p` bound to the pool of whichever database `$pool` ([`AnyPool`]) is,
/// so that `$body` is written once, generic over [`Dialect`].
#[cfg(all(feature = "postgres", feature = "sqlite"))]
#[macro_export]
macro_rules! with_pool {
    ($pool:expr, $p:ident => $body:expr) => {
        match $pool {
            $crate::AnyPool::Postgres($p) => $body,
            $crate::AnyPool::Sqlite($p) => $body,
        }
    };
}

/// Runs `$body` with `$p` bound to the pool of `$pool` ([`AnyPool`]).
#[cfg(all(feature = "postgres", not(feature = "sqlite")))]
#[macro_export]
macro_rules! with_pool {
    ($pool:expr, $p:ident => $body:expr) => {
        match $pool {
            $crate::AnyPool::Postgres($p) => $body,
        }
    };
}

/// Runs `$body` with `$p` bound to the pool of `$pool` ([`AnyPool`]).
#[cfg(all(feature = "sqlite", not(feature = "postgres")))]
#[macro_export]
macro_rules! with_pool {
    ($pool:expr, $p:ident => $body:expr) => {
        match $pool {
            $crate::AnyPool::Sqlite($p) => $body,
        }
    };
}

/// Runs `$body` with `$s` bound to the [`Store`] of whichever database `$store`
/// ([`AnyStore`]) is, so that `$body` is written once, generic over [`Dialect`].
#[cfg(all(feature = "postgres", feature = "sqlite"))]
#[macro_export]
macro_rules! with_store {
    ($store:expr, $s:ident => $body:expr) => {
        match $store {
            $crate::AnyStore::Postgres($s) => $body,
            $crate::AnyStore::Sqlite($s) => $body,
        }
    };
}

/// Runs `$body` with `$s` bound to the [`Store`] of `$store` ([`AnyStore`]).
#[cfg(all(feature = "postgres", not(feature = "sqlite")))]
#[macro_export]
macro_rules! with_store {
    ($store:expr, $s:ident => $body:expr) => {
        match $store {
            $crate::AnyStore::Postgres($s) => $body,
        }
    };
}

/// Runs `$body` with `$s` bound to the [`Store`] of `$store` ([`AnyStore`]).
#[cfg(all(feature = "sqlite", not(feature = "postgres")))]
#[macro_export]
macro_rules! with_store {
    ($store:expr, $s:ident => $body:expr) => {
        match $store {
            $crate::AnyStore::Sqlite($s) => $body,
        }
    };
}

impl AnyPool {
    /// Connects to the database `url` names: PostgreSQL with up to `max_connections`
    /// connections ([`postgres::connect`](crate::postgres::connect)), or SQLite with idem's settings
    /// ([`sqlite::connect`](crate::sqlite::connect)).
    pub async fn connect(url: &str, max_connections: u32) -> Result<AnyPool> {
        match Scheme::of(url)? {
            #[cfg(feature = "postgres")]
            Scheme::Postgres => Ok(AnyPool::Postgres(
                crate::postgres::connect(url, max_connections).await?,
            )),
            #[cfg(feature = "sqlite")]
            Scheme::Sqlite => {
                let _ = max_connections;
                Ok(AnyPool::Sqlite(crate::sqlite::connect(url).await?))
            }
            #[allow(unreachable_patterns)]
            other => Err(other.not_compiled()),
        }
    }

    /// Which database this is.
    pub fn scheme(&self) -> Scheme {
        match self {
            #[cfg(feature = "postgres")]
            AnyPool::Postgres(_) => Scheme::Postgres,
            #[cfg(feature = "sqlite")]
            AnyPool::Sqlite(_) => Scheme::Sqlite,
        }
    }

    /// Runs one statement with no parameters outside any transaction; the rows it changed.
    pub async fn exec(&self, sql: &str) -> std::result::Result<u64, sqlx::Error> {
        with_pool!(self, p => sqlx::query(sql).execute(p).await.map(|r| r.rows_affected()))
    }

    /// Runs a query with no parameters returning one integer.
    pub async fn scalar(&self, sql: &str) -> std::result::Result<i64, sqlx::Error> {
        with_pool!(self, p => sqlx::query_scalar::<_, i64>(sql).fetch_one(p).await)
    }

    /// Closes the pool.
    pub async fn close(&self) {
        with_pool!(self, p => p.close().await)
    }
}

/// Everything idem keeps in one database, over one set of tables: hands out each store.
#[derive(Debug)]
pub struct Store<DB: Dialect> {
    pool: Pool<DB>,
    tables: TableNames,
}

impl<DB: Dialect> Clone for Store<DB> {
    fn clone(&self) -> Self {
        Store {
            pool: self.pool.clone(),
            tables: self.tables.clone(),
        }
    }
}

impl<DB: Dialect> Store<DB> {
    /// idem's tables `tables` in the database of `pool`.
    pub fn new(pool: Pool<DB>, tables: TableNames) -> Self {
        Store { pool, tables }
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The table names.
    pub fn tables(&self) -> &TableNames {
        &self.tables
    }

    /// Creates or upgrades the tables ([`migrate`](crate::migrate())).
    pub async fn migrate(&self) -> Result<MigrationReport> {
        crate::migrate(&self.pool, &self.tables).await
    }

    /// The enqueue handle (the outbox's write side).
    pub fn outbox(&self) -> Outbox<DB> {
        Outbox::new(self.tables.clone())
    }

    /// The relay's store.
    pub fn relay(&self) -> RelayStore<DB> {
        RelayStore::new(self.pool.clone(), self.tables.clone())
    }

    /// The consumer's inbox and dead letters.
    pub fn inbox(&self) -> Inbox<DB> {
        Inbox::new(self.pool.clone(), self.tables.clone())
    }

    /// The server-side Idempotency-Key store.
    pub fn keys(&self) -> KeyStore<DB> {
        KeyStore::new(self.pool.clone(), self.tables.clone())
    }

    /// The effect intents.
    pub fn intents(&self) -> Intents<DB> {
        Intents::new(self.pool.clone(), self.tables.clone())
    }

    /// The operator's reads and the audit of their actions (the console's).
    pub fn ops(&self) -> crate::ops::Ops<DB> {
        crate::ops::Ops::new(self.pool.clone(), &self.tables)
    }
}

/// The store of whichever database a URL names: the one place that chooses (tansu's
/// `StorageContainer`). Match on it once and run code generic over [`Dialect`] in each arm:
///
/// ```no_run
/// # async fn demo(url: &str) -> idem_core::Result<()> {
/// use idem_sql::{AnyStore, Dialect, Store};
/// async fn pending<DB: Dialect>(s: Store<DB>) -> idem_core::Result<i64> {
///     use idem_core::store::OutboxStore;
///     Ok(s.relay().status().await?.pending)
/// }
/// let store = AnyStore::connect(url, 4, idem_core::TableNames::default()).await?;
/// let n = idem_sql::with_store!(store, s => pending(s).await?);
/// # let _ = n; Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub enum AnyStore {
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(Store<sqlx::Postgres>),
    /// SQLite.
    #[cfg(feature = "sqlite")]
    Sqlite(Store<sqlx::Sqlite>),
}

impl AnyStore {
    /// Connects to the database `url` names ([`AnyPool::connect`]), for idem's tables `tables`.
    /// SQLite has no schemas: a schema in `tables` is refused there.
    pub async fn connect(url: &str, max_connections: u32, tables: TableNames) -> Result<AnyStore> {
        if Scheme::of(url)? == Scheme::Sqlite && tables.schema().is_some() {
            return Err(Error::Config(
                "a schema is for PostgreSQL; SQLite has no schemas".to_owned(),
            ));
        }
        Ok(AnyStore::open(
            AnyPool::connect(url, max_connections).await?,
            tables,
        ))
    }

    /// The store over an open pool.
    pub fn open(pool: AnyPool, tables: TableNames) -> AnyStore {
        match pool {
            #[cfg(feature = "postgres")]
            AnyPool::Postgres(p) => AnyStore::Postgres(Store::new(p, tables)),
            #[cfg(feature = "sqlite")]
            AnyPool::Sqlite(p) => AnyStore::Sqlite(Store::new(p, tables)),
        }
    }

    /// The pool.
    pub fn pool(&self) -> AnyPool {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(s) => AnyPool::Postgres(s.pool().clone()),
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(s) => AnyPool::Sqlite(s.pool().clone()),
        }
    }

    /// The table names.
    pub fn tables(&self) -> &TableNames {
        with_store!(self, s => s.tables())
    }

    /// Which database it is.
    pub fn scheme(&self) -> Scheme {
        match self {
            #[cfg(feature = "postgres")]
            AnyStore::Postgres(_) => Scheme::Postgres,
            #[cfg(feature = "sqlite")]
            AnyStore::Sqlite(_) => Scheme::Sqlite,
        }
    }

    /// The PostgreSQL store, when the URL named PostgreSQL.
    #[cfg(feature = "postgres")]
    pub fn as_postgres(&self) -> Option<&Store<sqlx::Postgres>> {
        match self {
            AnyStore::Postgres(s) => Some(s),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The SQLite store, when the URL named SQLite.
    #[cfg(feature = "sqlite")]
    pub fn as_sqlite(&self) -> Option<&Store<sqlx::Sqlite>> {
        match self {
            AnyStore::Sqlite(s) => Some(s),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// Creates or upgrades the tables.
    pub async fn migrate(&self) -> Result<MigrationReport> {
        with_store!(self, s => s.migrate().await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheme_names_the_database() {
        assert_eq!(Scheme::of("postgres://u@h/db").unwrap(), Scheme::Postgres);
        assert_eq!(Scheme::of("postgresql://h/db").unwrap(), Scheme::Postgres);
        assert_eq!(Scheme::of("sqlite://a.db").unwrap(), Scheme::Sqlite);
        assert_eq!(Scheme::of("sqlite::memory:").unwrap(), Scheme::Sqlite);
        let e = Scheme::of("mysql://u:pw@h/db").unwrap_err().to_string();
        assert!(
            e.contains("unsupported database URL") && !e.contains("pw"),
            "{e}"
        );
        let missing = Scheme::Postgres.not_compiled().to_string();
        assert!(missing.contains("`postgres` feature"), "{missing}");
    }

    #[cfg(all(feature = "sqlite", feature = "postgres"))]
    #[tokio::test]
    async fn the_store_of_a_url_is_reached_without_a_match_that_can_panic() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("a.db").display());
        let store = AnyStore::connect(&url, 1, TableNames::default())
            .await
            .unwrap();
        assert_eq!(store.scheme(), Scheme::Sqlite);
        assert!(store.as_sqlite().is_some());
        assert!(store.as_postgres().is_none());
    }
}
