//! SQLite store for idem, the embedded default.
//!
//! * [`Outbox`] enqueues events inside the caller's own transaction: pass `&mut *tx`.
//! * [`migrate`] creates or upgrades idem's tables (the SQL lives in `migrations/`).
//! * [`SqliteStore`] is the relay's view of the outbox ([`idem_core::OutboxStore`]); its SQL
//!   lives in `sql/`.
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

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use idem_core::outbox::{
    Backlog, Claim, ClaimRequest, Completed, OutboxRecord, OutboxStatus, Outcome, ParkedRow,
    PrunePolicy, headers_from_json, sort_records,
};
use idem_core::{Error, Event, EventId, OutboxStore, Result, TableNames};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::{Connection, Executor, Row};
use uuid::Uuid;

mod retention;

const BASES: &[&str] = &[
    "outbox_archive",
    "outbox",
    "schema_migrations",
    "inbox",
    "dead_letters",
    "idempotency_keys",
    "effect_intents",
];

const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "outbox", include_str!("../migrations/0001_outbox.sql")),
    (2, "inbox", include_str!("../migrations/0002_inbox.sql")),
    (
        3,
        "idempotency keys",
        include_str!("../migrations/0003_idempotency_keys.sql"),
    ),
    (
        4,
        "effect intents",
        include_str!("../migrations/0004_effect_intents.sql"),
    ),
    (
        5,
        "outbox name checks",
        include_str!("../migrations/0005_outbox_name_checks.sql"),
    ),
    (
        6,
        "outbox timestamp checks",
        include_str!("../migrations/0006_outbox_timestamp_checks.sql"),
    ),
    (
        7,
        "idempotency claim tokens",
        include_str!("../migrations/0007_idempotency_claim_tokens.sql"),
    ),
    (
        8,
        "effect intent sending mark",
        include_str!("../migrations/0008_intent_sending_mark.sql"),
    ),
    (
        9,
        "dead-letter replay",
        include_str!("../migrations/0009_dead_letter_replay.sql"),
    ),
    (
        10,
        "outbox sequence numbers for inserted rows only (PostgreSQL; none here)",
        include_str!("../migrations/0010_outbox_seq_inserted_only.sql"),
    ),
];

const CLAIM_WINDOW_FACTOR: u32 = 4;

/// The text format of SQLite timestamps written by idem (same as the column defaults).
const TS_FORMAT: &str = "%Y-%m-%dT%H:%M:%S%.3fZ";

#[derive(Debug)]
struct Queries {
    enqueue: String,
    claim: String,
    mark_published: String,
    release: String,
    prune_delete: String,
    prune_archive: String,
    status: String,
    backlog: String,
    parked: String,
    retry_parked: String,
    retry_parked_one: String,
    inbox_record: String,
    dead_letter: String,
    dead_letters: String,
    inbox_dead_lettered: String,
    inbox_replay: String,
    dead_letters_open: String,
    dead_letter_replayed: String,
    key_claim: String,
    key_get: String,
    key_renew: String,
    key_complete: String,
    key_release: String,
    key_sweep: String,
    intent_record: String,
    intent_claim: String,
    intent_finish: String,
    intent_stuck: String,
    intent_retry: String,
    intent_get: String,
    intent_resolve: String,
    intent_mark_sending: String,
    intent_retry_one: String,
}

impl Queries {
    fn render(t: &TableNames) -> Self {
        let r = |sql: &str| t.render(sql, BASES);
        Queries {
            enqueue: r(include_str!("../sql/enqueue.sql")),
            claim: r(include_str!("../sql/claim.sql")),
            mark_published: r(include_str!("../sql/mark_published.sql")),
            release: r(include_str!("../sql/release.sql")),
            prune_delete: r(include_str!("../sql/prune_delete.sql")),
            prune_archive: r(include_str!("../sql/prune_archive.sql")),
            status: r(include_str!("../sql/status.sql")),
            backlog: r(include_str!("../sql/backlog.sql")),
            parked: r(include_str!("../sql/parked.sql")),
            retry_parked: r(include_str!("../sql/retry_parked.sql")),
            retry_parked_one: r(include_str!("../sql/retry_parked_one.sql")),
            inbox_record: r(include_str!("../sql/inbox_record.sql")),
            dead_letter: r(include_str!("../sql/dead_letter.sql")),
            dead_letters: r(include_str!("../sql/dead_letters.sql")),
            inbox_dead_lettered: r(include_str!("../sql/inbox_dead_lettered.sql")),
            inbox_replay: r(include_str!("../sql/inbox_replay.sql")),
            dead_letters_open: r(include_str!("../sql/dead_letters_open.sql")),
            dead_letter_replayed: r(include_str!("../sql/dead_letter_replayed.sql")),
            key_claim: r(include_str!("../sql/key_claim.sql")),
            key_get: r(include_str!("../sql/key_get.sql")),
            key_renew: r(include_str!("../sql/key_renew.sql")),
            key_complete: r(include_str!("../sql/key_complete.sql")),
            key_release: r(include_str!("../sql/key_release.sql")),
            key_sweep: r(include_str!("../sql/key_sweep.sql")),
            intent_record: r(include_str!("../sql/intent_record.sql")),
            intent_claim: r(include_str!("../sql/intent_claim.sql")),
            intent_finish: r(include_str!("../sql/intent_finish.sql")),
            intent_stuck: r(include_str!("../sql/intent_stuck.sql")),
            intent_retry: r(include_str!("../sql/intent_retry.sql")),
            intent_get: r(include_str!("../sql/intent_get.sql")),
            intent_resolve: r(include_str!("../sql/intent_resolve.sql")),
            intent_mark_sending: r(include_str!("../sql/intent_mark_sending.sql")),
            intent_retry_one: r(include_str!("../sql/intent_retry_one.sql")),
        }
    }
}

/// Enqueues events in the caller's transaction. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Outbox {
    tables: TableNames,
    queries: Arc<Queries>,
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox::new(TableNames::default())
    }
}

impl Outbox {
    /// An outbox in the given (validated) tables. SQLite has no schemas: a schema in `tables`
    /// names an attached database.
    pub fn new(tables: TableNames) -> Self {
        let queries = Arc::new(Queries::render(&tables));
        Outbox { tables, queries }
    }

    /// The table names in use.
    pub fn tables(&self) -> &TableNames {
        &self.tables
    }

    /// Inserts one event as part of the transaction `conn` belongs to.
    pub async fn enqueue(&self, conn: &mut SqliteConnection, event: &Event) -> Result<()> {
        self.enqueue_all(conn, std::slice::from_ref(event)).await
    }

    /// Inserts several events, in slice order, as part of the transaction `conn` belongs to.
    pub async fn enqueue_all(&self, conn: &mut SqliteConnection, events: &[Event]) -> Result<()> {
        for e in events {
            sqlx::query(&self.queries.enqueue)
                .bind(e.id().to_string())
                .bind(e.aggregate_type())
                .bind(e.aggregate_id())
                .bind(e.event_type())
                .bind(e.payload())
                .bind(e.headers_json())
                .bind(e.topic())
                .bind(e.traceparent())
                .bind(e.occurred_at().format(TS_FORMAT).to_string())
                .execute(&mut *conn)
                .await
                .map_err(|err| enqueue_error(err, &self.tables))?;
        }
        Ok(())
    }
}

fn enqueue_error(e: sqlx::Error, tables: &TableNames) -> Error {
    if let Some(db) = e.as_database_error() {
        let unique_event = format!("{}.event_id", tables.bare("outbox"));
        if db.message().contains("UNIQUE") && db.message().contains(&unique_event) {
            return Error::InvalidEvent {
                field: "event_id",
                reason: format!("is already in the outbox ({})", db.message()),
            };
        }
        if db.message().contains("no such table") {
            return Error::database("enqueueing events (run `idem migrate` first?)", e);
        }
    }
    Error::database("enqueueing events", e)
}

/// Opens (creating if missing) a SQLite database with the settings idem relies on: WAL
/// journal, `synchronous=FULL` (a commit survives power loss), a 5 s busy timeout.
pub async fn connect(url: &str) -> Result<SqlitePool> {
    let opts = SqliteConnectOptions::from_str(url)
        .map_err(|e| Error::Config(format!("invalid SQLite URL {url:?}: {e}")))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(5));
    SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(opts)
        .await
        .map_err(|e| Error::database(format!("opening SQLite database {url}"), e))
}

/// What [`migrate`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MigrationReport {
    /// Versions applied by this call.
    pub applied: Vec<i64>,
    /// Highest version now in the database.
    pub current: i64,
}

/// Creates or upgrades idem's tables, in one `BEGIN IMMEDIATE` transaction.
pub async fn migrate(pool: &SqlitePool, tables: &TableNames) -> Result<MigrationReport> {
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| Error::database("connecting to migrate", e))?;
    immediate(&mut conn, "running migrations", async |conn| {
        let mig = tables.qualified("schema_migrations");
        conn.execute(
            format!(
                "CREATE TABLE IF NOT EXISTS {mig} (version INTEGER PRIMARY KEY, description TEXT NOT NULL, \
                 applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')))"
            )
            .as_str(),
        )
        .await?;
        let current: Option<i64> = sqlx::query_scalar(&format!("SELECT max(version) FROM {mig}")).fetch_one(&mut *conn).await?;
        let current = current.unwrap_or(0);
        let supported = MIGRATIONS.last().map_or(0, |m| m.0);
        if current > supported {
            return Ok(Err(Error::SchemaTooNew { found: current, supported }));
        }
        let mut report = MigrationReport { applied: vec![], current };
        for (version, description, sql) in MIGRATIONS.iter().filter(|m| m.0 > current) {
            sqlx::raw_sql(&tables.render(sql, BASES)).execute(&mut *conn).await?;
            sqlx::query(&format!("INSERT INTO {mig} (version, description) VALUES (?1, ?2)"))
                .bind(version)
                .bind(description)
                .execute(&mut *conn)
                .await?;
            report.applied.push(*version);
            report.current = *version;
        }
        Ok(Ok(report))
    })
    .await?
}

/// Runs `f` inside `BEGIN IMMEDIATE` (the write lock is taken up front, so the busy timeout
/// applies instead of a snapshot conflict), committing on success and rolling back otherwise.
/// The transaction is sqlx's, so it is rolled back however it ends: a failed `COMMIT`, or the
/// future dropped half-way (a cancelled claim). A raw `BEGIN IMMEDIATE` left the write lock held
/// by a pooled connection, and every other writer then waited out its busy timeout.
async fn immediate<T>(
    conn: &mut SqliteConnection,
    context: &str,
    f: impl AsyncFnOnce(&mut SqliteConnection) -> std::result::Result<T, sqlx::Error>,
) -> Result<T> {
    let mut tx = conn
        .begin_with("BEGIN IMMEDIATE")
        .await
        .map_err(|e| Error::database(format!("{context}: starting a write transaction"), e))?;
    match f(&mut tx).await {
        Ok(v) => {
            tx.commit()
                .await
                .map_err(|e| Error::database(format!("{context}: committing"), e))?;
            Ok(v)
        }
        Err(e) => {
            let _ = tx.rollback().await;
            Err(Error::database(context.to_owned(), e))
        }
    }
}

/// The relay's SQLite store.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
    outbox: Outbox,
    full_scan: idem_core::outbox::FullScanThrottle,
}

impl SqliteStore {
    /// A store over `pool` with the given tables.
    pub fn new(pool: SqlitePool, tables: TableNames) -> Self {
        SqliteStore {
            pool,
            outbox: Outbox::new(tables),
            full_scan: idem_core::outbox::FullScanThrottle::default(),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The enqueue handle for the same tables.
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    fn q(&self) -> &Queries {
        &self.outbox.queries
    }

    async fn conn(&self, context: &str) -> Result<sqlx::pool::PoolConnection<sqlx::Sqlite>> {
        self.pool
            .acquire()
            .await
            .map_err(|e| Error::database(format!("{context}: acquiring a connection"), e))
    }
}

fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Parses the timestamps other writers may store: RFC 3339, or ISO 8601 without a zone (UTC),
/// with `T` or a space.
fn parse_ts(s: &str) -> std::result::Result<DateTime<Utc>, String> {
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

fn decode_record(row: &SqliteRow) -> Result<OutboxRecord> {
    let id: i64 = row
        .try_get("id")
        .map_err(|e| Error::database("decoding a claimed row", e))?;
    let corrupt = |reason: String| Error::CorruptRow { id, reason };
    let get_s = |c: &str| {
        row.try_get::<String, _>(c)
            .map_err(|e| corrupt(format!("{c}: {e}")))
    };
    let get_os = |c: &str| {
        row.try_get::<Option<String>, _>(c)
            .map_err(|e| corrupt(format!("{c}: {e}")))
    };
    let event_id = EventId::from_str(&get_s("event_id")?).map_err(|e| corrupt(e.to_string()))?;
    let headers: serde_json::Value =
        serde_json::from_str(&get_s("headers")?).map_err(|e| corrupt(format!("headers: {e}")))?;
    Ok(OutboxRecord {
        id,
        event_id,
        aggregate_type: get_s("aggregate_type")?,
        aggregate_id: get_s("aggregate_id")?,
        aggregate_seq: row
            .try_get("aggregate_seq")
            .map_err(|e| corrupt(format!("aggregate_seq: {e}")))?,
        event_type: get_s("event_type")?,
        payload: get_s("payload")?,
        headers: headers_from_json(headers),
        topic: get_os("topic")?,
        traceparent: get_os("traceparent")?,
        occurred_at: parse_ts(&get_s("occurred_at")?).map_err(corrupt)?,
        created_at: parse_ts(&get_s("created_at")?).map_err(corrupt)?,
        permanent_failures: row
            .try_get("permanent_failures")
            .map_err(|e| corrupt(format!("permanent_failures: {e}")))?,
        attempt: row
            .try_get("attempts")
            .map_err(|e| corrupt(format!("attempts: {e}")))?,
    })
}

impl SqliteStore {
    async fn claim_within(&self, request: &ClaimRequest, window: i64) -> Result<Claim> {
        let claim_id = Uuid::now_v7();
        let now = now_ms();
        let mut conn = self.conn("claiming outbox rows").await?;
        let q = &self.q().claim;
        let rows = immediate(&mut conn, "claiming outbox rows", async |c| {
            sqlx::query(q)
                .bind(i64::from(request.batch_size))
                .bind(claim_id.to_string())
                .bind(&request.relay_id)
                .bind(now.saturating_add(millis(request.lease)))
                .bind(now)
                .bind(window)
                .fetch_all(&mut *c)
                .await
        })
        .await?;
        let mut records = Vec::with_capacity(rows.len());
        let mut corrupt = vec![];
        for row in &rows {
            match decode_record(row) {
                Ok(r) => records.push(r),
                Err(Error::CorruptRow { id, reason }) => {
                    corrupt.push((id, format!("the row cannot be decoded: {reason}")))
                }
                Err(e) => return Err(e),
            }
        }
        sort_records(&mut records);
        Ok(Claim {
            claim_id,
            records,
            corrupt,
        })
    }
}

impl OutboxStore for SqliteStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim> {
        let window = i64::from(
            request
                .batch_size
                .saturating_mul(CLAIM_WINDOW_FACTOR)
                .max(64),
        );
        let claim = self.claim_within(request, window).await?;
        // See the PostgreSQL store: never let one deep aggregate starve the others.
        if claim.records.is_empty() && claim.corrupt.is_empty() && self.full_scan.due() {
            return self.claim_within(request, -1).await;
        }
        Ok(claim)
    }

    async fn complete(&self, claim: &Claim, outcome: &Outcome) -> Result<Completed> {
        let claim_id = claim.claim_id.to_string();
        let mut conn = self.conn("marking rows").await?;
        let q = self.q();
        let now = now_ms();
        let done = immediate(&mut conn, "marking rows", async |c| {
            let mut done = Completed::default();
            for id in &outcome.published {
                done.marked += sqlx::query(&q.mark_published)
                    .bind(id)
                    .bind(&claim_id)
                    .execute(&mut *c)
                    .await?
                    .rows_affected();
            }
            for f in &outcome.failed {
                done.released += sqlx::query(&q.release)
                    .bind(f.id)
                    .bind(&f.reason)
                    .bind(now.saturating_add(millis(f.backoff)))
                    .bind(f.park)
                    .bind(f.attempted)
                    .bind(&claim_id)
                    .bind(f.permanent)
                    .execute(&mut *c)
                    .await?
                    .rows_affected();
            }
            Ok(done)
        })
        .await?;
        let expected = (outcome.published.len() + outcome.failed.len()) as u64;
        Ok(Completed {
            fenced: expected.saturating_sub(done.marked + done.released),
            ..done
        })
    }

    async fn prune(&self, policy: &PrunePolicy) -> Result<u64> {
        let cutoff = (Utc::now()
            - chrono::Duration::from_std(policy.retention).unwrap_or(chrono::Duration::MAX))
        .format(TS_FORMAT)
        .to_string();
        let mut conn = self.conn("pruning published rows").await?;
        let q = self.q();
        immediate(&mut conn, "pruning published rows", async |c| {
            if policy.archive {
                sqlx::query(&q.prune_archive)
                    .bind(&cutoff)
                    .bind(i64::from(policy.batch))
                    .execute(&mut *c)
                    .await?;
            }
            Ok(sqlx::query(&q.prune_delete)
                .bind(&cutoff)
                .bind(i64::from(policy.batch))
                .execute(&mut *c)
                .await?
                .rows_affected())
        })
        .await
    }

    async fn status(&self) -> Result<OutboxStatus> {
        let row = sqlx::query(&self.q().status)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| Error::database("counting outbox rows", e))?;
        let get = |c: &str| {
            row.try_get::<i64, _>(c)
                .map_err(|e| Error::database("decoding status", e))
        };
        let oldest: Option<String> = row
            .try_get("oldest_pending")
            .map_err(|e| Error::database("decoding status", e))?;
        let age = match oldest {
            Some(ts) => {
                let at = parse_ts(&ts).map_err(Error::Config)?;
                Some((Utc::now() - at).num_milliseconds() as f64 / 1000.0)
            }
            None => None,
        };
        Ok(OutboxStatus {
            pending: get("pending")?,
            parked: get("parked")?,
            published: get("published")?,
            oldest_pending_age_seconds: age,
        })
    }

    async fn backlog(&self) -> Result<Vec<Backlog>> {
        let rows = sqlx::query(&self.q().backlog)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::database("counting the outbox backlog", e))?;
        let now = Utc::now();
        rows.iter()
            .map(|r| {
                let dec = |e| Error::database("decoding the outbox backlog", e);
                let oldest: Option<String> = r.try_get("oldest_pending").map_err(dec)?;
                let oldest_pending_age_seconds = match oldest {
                    Some(ts) => {
                        let at = parse_ts(&ts).map_err(Error::Config)?;
                        Some((now - at).num_milliseconds() as f64 / 1000.0)
                    }
                    None => None,
                };
                Ok(Backlog {
                    aggregate_type: r.try_get("aggregate_type").map_err(dec)?,
                    pending: r.try_get("pending").map_err(dec)?,
                    parked: r.try_get("parked").map_err(dec)?,
                    oldest_pending_age_seconds,
                })
            })
            .collect()
    }

    async fn parked(&self, limit: u32) -> Result<Vec<ParkedRow>> {
        let rows = sqlx::query(&self.q().parked)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::database("listing parked rows", e))?;
        rows.iter()
            .map(|r| {
                let id: i64 = r
                    .try_get("id")
                    .map_err(|e| Error::database("decoding parked rows", e))?;
                let dec = |e: sqlx::Error| Error::CorruptRow {
                    id,
                    reason: e.to_string(),
                };
                Ok(ParkedRow {
                    id,
                    event_id: EventId::from_str(&r.try_get::<String, _>("event_id").map_err(dec)?)?,
                    aggregate_type: r.try_get("aggregate_type").map_err(dec)?,
                    aggregate_id: r.try_get("aggregate_id").map_err(dec)?,
                    event_type: r.try_get("event_type").map_err(dec)?,
                    attempts: r.try_get("attempts").map_err(dec)?,
                    last_error: r.try_get("last_error").map_err(dec)?,
                })
            })
            .collect()
    }

    async fn retry_parked(&self, event_ids: Option<&[EventId]>) -> Result<u64> {
        let mut conn = self.conn("retrying parked rows").await?;
        let q = self.q();
        immediate(
            &mut conn,
            "retrying parked rows",
            async |c| match event_ids {
                None => Ok(sqlx::query(&q.retry_parked)
                    .execute(&mut *c)
                    .await?
                    .rows_affected()),
                Some(ids) => {
                    let mut n = 0;
                    for id in ids {
                        n += sqlx::query(&q.retry_parked_one)
                            .bind(id.to_string())
                            .execute(&mut *c)
                            .await?
                            .rows_affected();
                    }
                    Ok(n)
                }
            },
        )
        .await
    }
}

/// The consumer's inbox and dead letters in SQLite ([`idem_core::InboxStore`]).
///
/// Handlers receive `&mut SqliteConnection` inside the batch transaction.
#[derive(Clone, Debug)]
pub struct SqliteInbox {
    pool: SqlitePool,
    queries: Arc<Queries>,
}

impl SqliteInbox {
    /// An inbox over `pool` with the given tables (created by [`migrate`]).
    pub fn new(pool: SqlitePool, tables: TableNames) -> Self {
        SqliteInbox {
            pool,
            queries: Arc::new(Queries::render(&tables)),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

impl idem_core::InboxStore for SqliteInbox {
    type Conn = SqliteConnection;
    type Tx = sqlx::Transaction<'static, sqlx::Sqlite>;

    async fn begin(&self) -> Result<Self::Tx> {
        // IMMEDIATE: take the write lock up front, so the busy timeout applies instead of a
        // snapshot conflict when another writer committed first.
        self.pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| Error::database("beginning a consumer transaction", e))
    }

    async fn commit(&self, tx: Self::Tx) -> Result<()> {
        tx.commit()
            .await
            .map_err(|e| Error::database("committing a consumer transaction", e))
    }

    async fn rollback(&self, tx: Self::Tx) -> Result<()> {
        tx.rollback()
            .await
            .map_err(|e| Error::database("rolling back a consumer transaction", e))
    }

    async fn record(
        &self,
        conn: &mut SqliteConnection,
        group: &str,
        entries: &[idem_core::InboxEntry<'_>],
    ) -> Result<Vec<idem_core::Dedup>> {
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let row = sqlx::query(&self.queries.inbox_record)
                .bind(group)
                .bind(e.event.event_id.to_string())
                .bind(&e.event.event_type)
                .bind(&e.event.aggregate_type)
                .bind(&e.event.aggregate_id)
                .bind(&e.event.payload_hash)
                .bind(e.copies)
                .bind(if e.dead_lettered {
                    "dead_lettered"
                } else {
                    "processed"
                })
                .fetch_one(&mut *conn)
                .await
                .map_err(|err| Error::database("recording events in the inbox", err))?;
            let count: i32 = row
                .try_get("delivery_count")
                .map_err(|err| Error::database("decoding inbox rows", err))?;
            let hash: String = row
                .try_get("payload_hash")
                .map_err(|err| Error::database("decoding inbox rows", err))?;
            out.push(if count == e.copies {
                idem_core::Dedup::New
            } else if hash == e.event.payload_hash {
                idem_core::Dedup::Duplicate
            } else {
                idem_core::Dedup::Conflict
            });
        }
        Ok(out)
    }

    async fn savepoint(&self, conn: &mut SqliteConnection) -> Result<()> {
        sqlx::Executor::execute(&mut *conn, "SAVEPOINT idem_event")
            .await
            .map(|_| ())
            .map_err(|e| Error::database("setting a savepoint", e))
    }

    async fn rollback_to_savepoint(&self, conn: &mut SqliteConnection) -> Result<()> {
        sqlx::Executor::execute(&mut *conn, "ROLLBACK TO SAVEPOINT idem_event")
            .await
            .map(|_| ())
            .map_err(|e| Error::database("rolling back to a savepoint", e))
    }

    async fn release_savepoint(&self, conn: &mut SqliteConnection) -> Result<()> {
        sqlx::Executor::execute(&mut *conn, "RELEASE SAVEPOINT idem_event")
            .await
            .map(|_| ())
            .map_err(|e| Error::database("releasing a savepoint", e))
    }

    async fn check_usable(&self, _conn: &mut SqliteConnection) -> Result<()> {
        // A failed statement in SQLite undoes that statement only; the transaction goes on.
        Ok(())
    }

    async fn mark_dead_lettered(
        &self,
        conn: &mut SqliteConnection,
        group: &str,
        ids: &[EventId],
    ) -> Result<()> {
        for id in ids {
            sqlx::query(&self.queries.inbox_dead_lettered)
                .bind(group)
                .bind(id.to_string())
                .execute(&mut *conn)
                .await
                .map_err(|e| Error::database("marking inbox rows dead-lettered", e))?;
        }
        Ok(())
    }

    async fn dead_letter(
        &self,
        conn: &mut SqliteConnection,
        group: &str,
        letters: &[idem_core::DeadLetter],
    ) -> Result<()> {
        for d in letters {
            sqlx::query(&self.queries.dead_letter)
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
                .execute(&mut *conn)
                .await
                .map_err(|e| Error::database("storing dead letters", e))?;
        }
        Ok(())
    }

    async fn dead_letters(
        &self,
        group: &str,
        limit: u32,
    ) -> Result<Vec<idem_core::StoredDeadLetter>> {
        let rows = sqlx::query(&self.queries.dead_letters)
            .bind(group)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::database("listing dead letters", e))?;
        rows.iter()
            .map(|r| {
                Ok(idem_core::StoredDeadLetter {
                    id: r.try_get("id")?,
                    consumer_group: r.try_get("consumer_group")?,
                    topic: r.try_get("topic")?,
                    partition: r.try_get("record_partition")?,
                    offset: r.try_get("record_offset")?,
                    event_id: r.try_get("event_id")?,
                    reason: r.try_get("reason")?,
                    replay_outcome: r.try_get("replay_outcome")?,
                    replayed_at: r.try_get("replayed_at")?,
                    replayed_by: r.try_get("replayed_by")?,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(|e| Error::database("decoding dead letters", e))
    }

    async fn open_dead_letters(
        &self,
        group: &str,
        after: i64,
        only: Option<i64>,
        limit: u32,
    ) -> Result<Vec<idem_core::OpenDeadLetter>> {
        let rows = sqlx::query(&self.queries.dead_letters_open)
            .bind(group)
            .bind(after)
            .bind(only)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::database("listing dead letters to replay", e))?;
        rows.iter()
            .map(open_letter)
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(|e| Error::database("decoding dead letters to replay", e))
    }

    async fn claim_replay(
        &self,
        conn: &mut SqliteConnection,
        group: &str,
        event: &idem_core::InboundEvent,
    ) -> Result<bool> {
        sqlx::query(&self.queries.inbox_replay)
            .bind(group)
            .bind(event.event_id.to_string())
            .bind(&event.event_type)
            .bind(&event.aggregate_type)
            .bind(&event.aggregate_id)
            .bind(&event.payload_hash)
            .fetch_optional(&mut *conn)
            .await
            .map(|row| row.is_some())
            .map_err(|e| Error::database("claiming the inbox row of a replayed event", e))
    }

    async fn finish_replay(
        &self,
        conn: &mut SqliteConnection,
        id: i64,
        by: &str,
        outcome: idem_core::ReplayOutcome,
        reason: Option<&str>,
    ) -> Result<bool> {
        sqlx::query(&self.queries.dead_letter_replayed)
            .bind(id)
            .bind(by)
            .bind(outcome.as_str())
            .bind(reason)
            .execute(&mut *conn)
            .await
            .map(|r| r.rows_affected() > 0)
            .map_err(|e| Error::database("recording the replay of a dead letter", e))
    }
}

/// A dead letter row read for a replay ([`idem_core::DeadLetterRow`] decides what it means).
fn open_letter(r: &SqliteRow) -> std::result::Result<idem_core::OpenDeadLetter, sqlx::Error> {
    Ok(idem_core::DeadLetterRow {
        id: r.try_get("id")?,
        topic: r.try_get("topic")?,
        partition: r.try_get("record_partition")?,
        offset: r.try_get("record_offset")?,
        event_id: r.try_get("event_id")?,
        event_type: r.try_get("event_type")?,
        reason: r.try_get("reason")?,
        key: r.try_get("record_key")?,
        payload: r.try_get("payload")?,
        headers: r.try_get("headers")?,
    }
    .into())
}

/// The server-side Idempotency-Key store in SQLite ([`idem_core::idempotency::IdempotencyStore`]).
#[derive(Clone, Debug)]
pub struct SqliteKeyStore {
    pool: SqlitePool,
    queries: Arc<Queries>,
}

impl SqliteKeyStore {
    /// A key store over `pool` with the given tables (created by [`migrate`]).
    pub fn new(pool: SqlitePool, tables: TableNames) -> Self {
        SqliteKeyStore {
            pool,
            queries: Arc::new(Queries::render(&tables)),
        }
    }
}

impl idem_core::idempotency::IdempotencyStore for SqliteKeyStore {
    async fn claim(
        &self,
        scope: &str,
        key: &idem_core::idempotency::IdempotencyKey,
        fingerprint: &str,
        lock: Duration,
        retention: Duration,
    ) -> Result<idem_core::idempotency::KeyClaim> {
        use idem_core::idempotency::{KeyClaim, StoredResponse};
        let now = now_ms();
        let token = idem_core::idempotency::ClaimToken::random();
        let claimed = sqlx::query(&self.queries.key_claim)
            .bind(scope)
            .bind(key.as_str())
            .bind(fingerprint)
            .bind(now.saturating_add(millis(lock)))
            .bind(now.saturating_add(millis(retention)))
            .bind(now)
            .bind(token.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| Error::database("claiming an idempotency key", e))?;
        if claimed.is_some() {
            return Ok(KeyClaim::New(token));
        }
        let row = sqlx::query(&self.queries.key_get)
            .bind(scope)
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| Error::database("reading an idempotency key", e))?;
        let Some(row) = row else {
            return Ok(KeyClaim::InFlight);
        };
        let dec = |e| Error::database("decoding an idempotency key", e);
        let stored: String = row.try_get("fingerprint").map_err(dec)?;
        if stored != fingerprint {
            return Ok(KeyClaim::Mismatch);
        }
        let status: String = row.try_get("status").map_err(dec)?;
        if status != "completed" {
            return Ok(KeyClaim::InFlight);
        }
        let code: i64 = row.try_get("response_status").map_err(dec)?;
        let headers: String = row.try_get("response_headers").map_err(dec)?;
        let body: Vec<u8> = row.try_get("response_body").map_err(dec)?;
        Ok(KeyClaim::Completed(StoredResponse {
            status: u16::try_from(code).unwrap_or(500),
            headers: serde_json::from_str(&headers).unwrap_or_default(),
            body,
        }))
    }

    async fn renew(
        &self,
        scope: &str,
        key: &idem_core::idempotency::IdempotencyKey,
        token: &idem_core::idempotency::ClaimToken,
        lock: std::time::Duration,
    ) -> Result<bool> {
        sqlx::query(&self.queries.key_renew)
            .bind(scope)
            .bind(key.as_str())
            .bind(token.as_str())
            .bind(now_ms().saturating_add(millis(lock)))
            .execute(&self.pool)
            .await
            .map(|r| r.rows_affected() == 1)
            .map_err(|e| Error::database("renewing the lock of an idempotency key", e))
    }

    async fn complete(
        &self,
        scope: &str,
        key: &idem_core::idempotency::IdempotencyKey,
        token: &idem_core::idempotency::ClaimToken,
        response: &idem_core::idempotency::StoredResponse,
    ) -> Result<bool> {
        let headers = serde_json::to_string(&response.headers).unwrap_or_else(|_| "[]".to_owned());
        sqlx::query(&self.queries.key_complete)
            .bind(scope)
            .bind(key.as_str())
            .bind(i64::from(response.status))
            .bind(headers)
            .bind(&response.body)
            .bind(token.as_str())
            .execute(&self.pool)
            .await
            .map(|r| r.rows_affected() == 1)
            .map_err(|e| Error::database("storing an idempotent response", e))
    }

    async fn release(
        &self,
        scope: &str,
        key: &idem_core::idempotency::IdempotencyKey,
        token: &idem_core::idempotency::ClaimToken,
    ) -> Result<bool> {
        sqlx::query(&self.queries.key_release)
            .bind(scope)
            .bind(key.as_str())
            .bind(token.as_str())
            .execute(&self.pool)
            .await
            .map(|r| r.rows_affected() == 1)
            .map_err(|e| Error::database("releasing an idempotency key", e))
    }

    async fn sweep(&self) -> Result<u64> {
        sqlx::query(&self.queries.key_sweep)
            .bind(now_ms())
            .execute(&self.pool)
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| Error::database("sweeping expired idempotency keys", e))
    }
}

fn decode_intent(r: &SqliteRow) -> Result<idem_core::idempotency::ClaimedIntent> {
    let dec = |e| Error::database("decoding an effect intent", e);
    let id: i64 = r.try_get("id").map_err(dec)?;
    let corrupt = |reason: String| Error::CorruptRow { id, reason };
    let body: String = r.try_get("body").map_err(dec)?;
    Ok(idem_core::idempotency::ClaimedIntent {
        id,
        key: idem_core::idempotency::IdempotencyKey::new(
            r.try_get::<String, _>("idem_key").map_err(dec)?,
        )
        .map_err(|e| corrupt(e.to_string()))?,
        intent: idem_core::idempotency::EffectIntent {
            event_id: EventId::from_str(&r.try_get::<String, _>("event_id").map_err(dec)?)?,
            effect: r.try_get("effect").map_err(dec)?,
            target: r.try_get("target").map_err(dec)?,
            body: serde_json::from_str(&body).map_err(|e| corrupt(e.to_string()))?,
            traceparent: r.try_get("traceparent").map_err(dec)?,
        },
        attempt: r.try_get("attempts").map_err(dec)?,
        unrecorded_send: r.try_get("sending_attempt").map_err(dec)?,
    })
}

/// Effect intents in SQLite ([`idem_core::idempotency::IntentStore`]).
#[derive(Clone, Debug)]
pub struct SqliteIntents {
    pool: SqlitePool,
    queries: Arc<Queries>,
}

impl SqliteIntents {
    /// Intents over `pool` with the given tables (created by [`migrate`]).
    pub fn new(pool: SqlitePool, tables: TableNames) -> Self {
        SqliteIntents {
            pool,
            queries: Arc::new(Queries::render(&tables)),
        }
    }
}

use idem_core::idempotency::ClaimedRow;

impl idem_core::idempotency::IntentStore for SqliteIntents {
    type Conn = SqliteConnection;

    async fn record(
        &self,
        conn: &mut SqliteConnection,
        intent: &idem_core::idempotency::EffectIntent,
    ) -> Result<bool> {
        let key = intent.key().map_err(|e| Error::InvalidEvent {
            field: "effect",
            reason: e.to_string(),
        })?;
        let n = sqlx::query(&self.queries.intent_record)
            .bind(key.as_str())
            .bind(&intent.effect)
            .bind(&intent.target)
            .bind(intent.event_id.to_string())
            .bind(intent.body.to_string())
            .bind(intent.traceparent.as_deref())
            .execute(&mut *conn)
            .await
            .map_err(|e| Error::database("recording an effect intent", e))?
            .rows_affected();
        Ok(n == 1)
    }

    async fn claim(
        &self,
        batch: u32,
        lease: Duration,
    ) -> Result<Vec<idem_core::idempotency::ClaimedIntent>> {
        let now = now_ms();
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| Error::database("claiming effect intents", e))?;
        let q = &self.queries.intent_claim;
        let rows = immediate(&mut conn, "claiming effect intents", async |c| {
            sqlx::query(q)
                .bind(i64::from(batch))
                .bind(now.saturating_add(millis(lease)))
                .bind(now)
                .fetch_all(&mut *c)
                .await
        })
        .await?;
        // Only a row's id and attempt number must decode; anything else parks the row.
        let rows = rows
            .iter()
            .map(|r| {
                Ok(ClaimedRow::of(
                    decode_intent(r),
                    r.try_get("id")?,
                    r.try_get("attempts")?,
                ))
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(|e| Error::database("decoding claimed effect intents", e))?;
        idem_core::idempotency::park_undecodable(self, rows).await
    }

    async fn mark_sending(&self, id: i64, attempt: i32, lease_left: Duration) -> Result<bool> {
        let n = sqlx::query(&self.queries.intent_mark_sending)
            .bind(id)
            .bind(attempt)
            .bind(now_ms().saturating_add(millis(lease_left)))
            .execute(&self.pool)
            .await
            .map_err(|e| Error::database("marking an effect intent as sending", e))?
            .rows_affected();
        Ok(n == 1)
    }

    async fn finish(
        &self,
        id: i64,
        attempt: i32,
        outcome: &idem_core::idempotency::IntentOutcome,
    ) -> Result<bool> {
        let c = outcome.columns();
        let n = sqlx::query(&self.queries.intent_finish)
            .bind(id)
            .bind(attempt)
            .bind(c.status)
            .bind(c.response_status.map(i64::from))
            .bind(c.response_body)
            .bind(c.error)
            .bind(now_ms().saturating_add(millis(c.backoff)))
            .execute(&self.pool)
            .await
            .map_err(|e| Error::database("recording an effect outcome", e))?
            .rows_affected();
        Ok(n == 1)
    }

    async fn stuck(&self, limit: u32) -> Result<Vec<idem_core::idempotency::StuckIntent>> {
        let rows = sqlx::query(&self.queries.intent_stuck)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::database("listing stuck effect intents", e))?;
        rows.iter()
            .map(|r| {
                Ok(idem_core::idempotency::StuckIntent {
                    id: r.try_get("id")?,
                    key: r.try_get("idem_key")?,
                    effect: r.try_get("effect")?,
                    status: r.try_get("status")?,
                    attempts: r.try_get("attempts")?,
                    reason: r.try_get("last_error")?,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(|e| Error::database("decoding stuck effect intents", e))
    }

    async fn retry_stuck(&self, ids: Option<&[i64]>) -> Result<u64> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| Error::database("retrying effect intents", e))?;
        let q = &self.queries;
        immediate(&mut conn, "retrying effect intents", async |c| match ids {
            None => Ok(sqlx::query(&q.intent_retry)
                .execute(&mut *c)
                .await?
                .rows_affected()),
            Some(ids) => {
                let mut n = 0;
                for id in ids {
                    n += sqlx::query(&q.intent_retry_one)
                        .bind(id)
                        .execute(&mut *c)
                        .await?
                        .rows_affected();
                }
                Ok(n)
            }
        })
        .await
    }

    async fn get(
        &self,
        id: i64,
    ) -> Result<Option<(idem_core::idempotency::ClaimedIntent, String)>> {
        let row = sqlx::query(&self.queries.intent_get)
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| Error::database("reading an effect intent", e))?;
        match row {
            None => Ok(None),
            Some(r) => {
                let status: String = r
                    .try_get("status")
                    .map_err(|e| Error::database("decoding an effect intent", e))?;
                Ok(Some((decode_intent(&r)?, status)))
            }
        }
    }

    async fn resolve(
        &self,
        id: i64,
        resolution: idem_core::idempotency::Resolution,
        note: &str,
    ) -> Result<bool> {
        let n = sqlx::query(&self.queries.intent_resolve)
            .bind(id)
            .bind(resolution.status())
            .bind(note)
            .execute(&self.pool)
            .await
            .map_err(|e| Error::database("resolving an effect intent", e))?
            .rows_affected();
        Ok(n == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write transaction whose future is dropped half-way (a cancelled claim) leaves neither
    /// its writes nor the write lock behind (review §15).
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
            let cancelled = tokio::time::timeout(
                Duration::from_millis(200),
                immediate(&mut conn, "a test write", async |c| {
                    sqlx::query("INSERT INTO t VALUES (1)")
                        .execute(&mut *c)
                        .await?;
                    std::future::pending::<()>().await;
                    Ok(())
                }),
            )
            .await;
            assert!(cancelled.is_err(), "the write was meant to hang");
        }
        // The busy timeout is 5 s: a lock left behind would make this write wait it out.
        let write = tokio::time::timeout(
            Duration::from_secs(2),
            sqlx::query("INSERT INTO t VALUES (2)").execute(&pool),
        )
        .await;
        assert!(matches!(write, Ok(Ok(_))), "{write:?}");
        let rows: Vec<i64> = sqlx::query_scalar("SELECT x FROM t")
            .fetch_all(&pool)
            .await
            .unwrap();
        assert_eq!(rows, vec![2], "the cancelled write was kept");
        pool.close().await;
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_placeholder_is_rendered() {
        let t = TableNames::default();
        let q = Queries::render(&t);
        let queries = [
            &q.enqueue,
            &q.claim,
            &q.mark_published,
            &q.release,
            &q.prune_delete,
            &q.prune_archive,
            &q.status,
            &q.backlog,
            &q.parked,
            &q.retry_parked,
            &q.inbox_record,
            &q.dead_letter,
            &q.dead_letters,
            &q.inbox_dead_lettered,
            &q.inbox_replay,
            &q.dead_letters_open,
            &q.dead_letter_replayed,
            &q.key_claim,
            &q.key_get,
            &q.key_renew,
            &q.key_complete,
            &q.key_release,
            &q.key_sweep,
            &q.intent_record,
            &q.intent_claim,
            &q.intent_finish,
            &q.intent_stuck,
            &q.intent_retry,
            &q.intent_get,
            &q.intent_resolve,
            &q.intent_mark_sending,
            &q.intent_retry_one,
        ];
        let migrations: Vec<String> = MIGRATIONS.iter().map(|m| t.render(m.2, BASES)).collect();
        for sql in queries.into_iter().chain(migrations.iter()) {
            for base in BASES {
                assert!(
                    !sql.contains(&format!("{{{base}}}"))
                        && !sql.contains(&format!("{{bare:{base}}}")),
                    "unrendered {base} in {sql}"
                );
            }
        }
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
