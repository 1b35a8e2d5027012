//! One [`Backend`] per database: what the scenarios need and nothing else.

use std::future::Future;

use idem_core::idempotency::{EffectIntent, IntentStore, TransactionalKeyStore};
use idem_core::store::{InboxStore, OutboxStore};
use idem_core::{Event, TableNames};
use idem_sql::postgres::{PgInbox, PgIntents, PgKeyStore, PgStore};
use idem_sql::sqlite::{SqliteInbox, SqliteIntents, SqliteKeyStore, SqliteStore};
use sqlx::{Executor, PgPool, Postgres, Sqlite, SqlitePool, Transaction};

use crate::pg::TestDb;

/// A database under test.
pub trait Backend: Send + Sync + Sized {
    type Store: OutboxStore + Clone;
    type Tx: OpenTx;
    type Inbox: InboxStore + Clone;
    type Keys: TransactionalKeyStore;
    type Intents: IntentStore;
    /// Can two write transactions be open at once? (PostgreSQL yes, SQLite no.)
    const CONCURRENT_WRITERS: bool;
    fn store(&self) -> &Self::Store;
    /// The consumer inbox in the same database.
    fn inbox(&self) -> Self::Inbox;
    /// The server-side Idempotency-Key store in the same database.
    fn keys(&self) -> Self::Keys;
    /// The client-side effect intents in the same database.
    fn intents(&self) -> Self::Intents;
    fn tables(&self) -> &TableNames;
    /// The same database with other table names (not migrated).
    fn with_tables(&self, tables: TableNames) -> Self;
    fn migrate(&self) -> impl Future<Output = idem_core::Result<Vec<i64>>>;
    fn begin(&self) -> impl Future<Output = Self::Tx> + Send;
    /// Runs one statement outside any transaction.
    fn exec(&self, sql: &str) -> impl Future<Output = Result<u64, String>> + Send;
    /// Runs a query returning one integer.
    fn scalar(&self, sql: &str) -> impl Future<Output = i64> + Send;
    /// Makes every lease and backoff look expired (time passing, without waiting).
    fn expire_leases(&self) -> impl Future<Output = ()> + Send;
    /// Makes every effect intent's lease and backoff look expired.
    fn expire_intent_leases(&self) -> impl Future<Output = ()> + Send;
    /// Ends the pending intents' leases, their next attempt times left as they are.
    fn end_intent_leases(&self) -> impl Future<Output = ()> + Send;
    /// Number of connections waiting on a lock (always 0 where writers cannot overlap).
    fn lock_waiters(&self) -> impl Future<Output = i64> + Send;
}

/// An open business transaction.
pub trait OpenTx: Send + 'static {
    fn enqueue(&mut self, events: &[Event]) -> impl Future<Output = idem_core::Result<()>> + Send;
    fn exec(&mut self, sql: &str) -> impl Future<Output = Result<u64, String>> + Send;
    fn record_intent(
        &mut self,
        intent: &EffectIntent,
    ) -> impl Future<Output = idem_core::Result<bool>> + Send;
    fn record_intents(
        &mut self,
        intents: &[EffectIntent],
    ) -> impl Future<Output = idem_core::Result<Vec<bool>>> + Send;
    fn commit(self) -> impl Future<Output = ()> + Send;
    fn rollback(self) -> impl Future<Output = ()> + Send;
}

/// PostgreSQL, in a fresh database dropped at the end.
pub struct Pg {
    db: std::sync::Arc<TestDb>,
    store: PgStore,
    tables: TableNames,
}

impl Pg {
    pub async fn new() -> Self {
        let db = std::sync::Arc::new(TestDb::create().await);
        let tables = TableNames::default();
        let pg = Pg {
            store: PgStore::new(db.pool().clone(), tables.clone()),
            db,
            tables,
        };
        pg.migrate().await.unwrap();
        pg.exec("CREATE TABLE test_orders (id text PRIMARY KEY, amount_minor bigint NOT NULL)")
            .await
            .unwrap();
        pg
    }

    pub fn pool(&self) -> &PgPool {
        self.db.pool()
    }

    pub fn url(&self) -> &str {
        self.db.url()
    }
}

pub struct PgTx {
    tx: Transaction<'static, Postgres>,
    outbox: idem_sql::postgres::Outbox,
    intents: PgIntents,
}

impl OpenTx for PgTx {
    async fn enqueue(&mut self, events: &[Event]) -> idem_core::Result<()> {
        self.outbox.enqueue_all(&mut self.tx, events).await
    }
    async fn exec(&mut self, sql: &str) -> Result<u64, String> {
        (&mut *self.tx)
            .execute(sql)
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| e.to_string())
    }
    async fn record_intent(&mut self, intent: &EffectIntent) -> idem_core::Result<bool> {
        self.intents.record(&mut self.tx, intent).await
    }
    async fn record_intents(&mut self, intents: &[EffectIntent]) -> idem_core::Result<Vec<bool>> {
        self.intents.record_all(&mut self.tx, intents).await
    }
    async fn commit(self) {
        self.tx.commit().await.unwrap();
    }
    async fn rollback(self) {
        self.tx.rollback().await.unwrap();
    }
}

impl Backend for Pg {
    type Store = PgStore;
    type Tx = PgTx;
    type Inbox = PgInbox;
    type Keys = PgKeyStore;
    type Intents = PgIntents;
    const CONCURRENT_WRITERS: bool = true;

    fn store(&self) -> &PgStore {
        &self.store
    }
    fn inbox(&self) -> PgInbox {
        PgInbox::new(self.pool().clone(), self.tables.clone())
    }
    fn keys(&self) -> PgKeyStore {
        PgKeyStore::new(self.pool().clone(), self.tables.clone())
    }
    fn intents(&self) -> PgIntents {
        PgIntents::new(self.pool().clone(), self.tables.clone())
    }
    fn tables(&self) -> &TableNames {
        &self.tables
    }
    fn with_tables(&self, tables: TableNames) -> Self {
        Pg {
            db: self.db.clone(),
            store: PgStore::new(self.db.pool().clone(), tables.clone()),
            tables,
        }
    }
    async fn migrate(&self) -> idem_core::Result<Vec<i64>> {
        idem_sql::postgres::migrate(self.pool(), &self.tables)
            .await
            .map(|r| r.applied)
    }
    async fn begin(&self) -> PgTx {
        PgTx {
            tx: self.pool().begin().await.unwrap(),
            outbox: self.store.outbox().clone(),
            intents: self.intents(),
        }
    }
    async fn exec(&self, sql: &str) -> Result<u64, String> {
        self.pool()
            .execute(sql)
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| e.to_string())
    }
    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(self.pool())
            .await
            .unwrap()
    }
    async fn expire_leases(&self) {
        let t = self.tables.qualified("outbox");
        self.exec(&format!(
            "UPDATE {t} SET claimed_until = now() - interval '1 hour', next_attempt_at = '-infinity' WHERE status = 'pending'"
        ))
        .await
        .unwrap();
    }
    async fn expire_intent_leases(&self) {
        let t = self.tables.qualified("effect_intents");
        self.exec(&format!(
            "UPDATE {t} SET claimed_until = now() - interval '1 hour', next_attempt_at = '-infinity' WHERE status = 'pending'"
        ))
        .await
        .unwrap();
    }
    async fn end_intent_leases(&self) {
        let t = self.tables.qualified("effect_intents");
        self.exec(&format!(
            "UPDATE {t} SET claimed_until = now() - interval '1 hour' WHERE status = 'pending'"
        ))
        .await
        .unwrap();
    }
    async fn lock_waiters(&self) -> i64 {
        self.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await
    }
}

/// SQLite, in a file in a temporary directory.
pub struct Lite {
    dir: std::sync::Arc<tempfile::TempDir>,
    pool: SqlitePool,
    store: SqliteStore,
    tables: TableNames,
}

impl Lite {
    pub async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("idem.db").display());
        let pool = idem_sql::sqlite::connect(&url).await.unwrap();
        let tables = TableNames::default();
        let lite = Lite {
            dir: std::sync::Arc::new(dir),
            store: SqliteStore::new(pool.clone(), tables.clone()),
            pool,
            tables,
        };
        lite.migrate().await.unwrap();
        lite.exec("CREATE TABLE test_orders (id text PRIMARY KEY, amount_minor bigint NOT NULL)")
            .await
            .unwrap();
        lite
    }

    pub fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("idem.db")
    }
}

pub struct LiteTx {
    tx: Transaction<'static, Sqlite>,
    outbox: idem_sql::sqlite::Outbox,
    intents: SqliteIntents,
}

impl OpenTx for LiteTx {
    async fn enqueue(&mut self, events: &[Event]) -> idem_core::Result<()> {
        self.outbox.enqueue_all(&mut self.tx, events).await
    }
    async fn exec(&mut self, sql: &str) -> Result<u64, String> {
        (&mut *self.tx)
            .execute(sql)
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| e.to_string())
    }
    async fn record_intent(&mut self, intent: &EffectIntent) -> idem_core::Result<bool> {
        self.intents.record(&mut self.tx, intent).await
    }
    async fn record_intents(&mut self, intents: &[EffectIntent]) -> idem_core::Result<Vec<bool>> {
        self.intents.record_all(&mut self.tx, intents).await
    }
    async fn commit(self) {
        self.tx.commit().await.unwrap();
    }
    async fn rollback(self) {
        self.tx.rollback().await.unwrap();
    }
}

impl Backend for Lite {
    type Store = SqliteStore;
    type Tx = LiteTx;
    type Inbox = SqliteInbox;
    type Keys = SqliteKeyStore;
    type Intents = SqliteIntents;
    const CONCURRENT_WRITERS: bool = false;

    fn store(&self) -> &SqliteStore {
        &self.store
    }
    fn inbox(&self) -> SqliteInbox {
        SqliteInbox::new(self.pool.clone(), self.tables.clone())
    }
    fn keys(&self) -> SqliteKeyStore {
        SqliteKeyStore::new(self.pool.clone(), self.tables.clone())
    }
    fn intents(&self) -> SqliteIntents {
        SqliteIntents::new(self.pool.clone(), self.tables.clone())
    }
    fn tables(&self) -> &TableNames {
        &self.tables
    }
    fn with_tables(&self, tables: TableNames) -> Self {
        Lite {
            dir: self.dir.clone(),
            pool: self.pool.clone(),
            store: SqliteStore::new(self.pool.clone(), tables.clone()),
            tables,
        }
    }
    async fn migrate(&self) -> idem_core::Result<Vec<i64>> {
        idem_sql::sqlite::migrate(&self.pool, &self.tables)
            .await
            .map(|r| r.applied)
    }
    async fn begin(&self) -> LiteTx {
        LiteTx {
            tx: self.pool.begin().await.unwrap(),
            outbox: self.store.outbox().clone(),
            intents: self.intents(),
        }
    }
    async fn exec(&self, sql: &str) -> Result<u64, String> {
        self.pool
            .execute(sql)
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| e.to_string())
    }
    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
    async fn expire_leases(&self) {
        let t = self.tables.qualified("outbox");
        self.exec(&format!(
            "UPDATE {t} SET claimed_until = 0, next_attempt_at = 0 WHERE status = 'pending'"
        ))
        .await
        .unwrap();
    }
    async fn expire_intent_leases(&self) {
        let t = self.tables.qualified("effect_intents");
        self.exec(&format!(
            "UPDATE {t} SET claimed_until = 0, next_attempt_at = 0 WHERE status = 'pending'"
        ))
        .await
        .unwrap();
    }
    async fn end_intent_leases(&self) {
        let t = self.tables.qualified("effect_intents");
        self.exec(&format!(
            "UPDATE {t} SET claimed_until = 0 WHERE status = 'pending'"
        ))
        .await
        .unwrap();
    }
    async fn lock_waiters(&self) -> i64 {
        0
    }
}
