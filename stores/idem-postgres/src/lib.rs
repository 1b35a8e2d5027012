//! PostgreSQL store for idem.
//!
//! * [`Outbox`] enqueues events inside the caller's own transaction: pass `&mut *tx`.
//! * [`migrate`] creates or upgrades idem's tables (the SQL lives in `migrations/`).
//! * [`PgStore`] is the relay's view of the outbox ([`idem_core::OutboxStore`]); its SQL lives in
//!   `sql/`, one statement per file.
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

use std::sync::Arc;

use chrono::{DateTime, Utc};
use idem_core::outbox::{
    Backlog, Claim, ClaimRequest, Completed, OutboxRecord, OutboxStatus, Outcome, ParkedRow,
    PrunePolicy, headers_from_json, sort_records,
};
use idem_core::{Error, Event, EventId, OutboxStore, Result, TableNames};
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions, PgRow};
use sqlx::{Connection, Row};
use uuid::Uuid;

mod retention;

/// Table bases used in the SQL files.
const BASES: &[&str] = &[
    "outbox_aggregates",
    "outbox_assign_seq",
    "outbox_archive",
    "outbox",
    "schema_migrations",
    "inbox",
    "dead_letters",
    "idempotency_keys",
    "effect_intents",
];

/// Migrations shipped with this build: (version, description, SQL).
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
        "outbox sequence numbers for inserted rows only",
        include_str!("../migrations/0010_outbox_seq_inserted_only.sql"),
    ),
];

/// How many of the oldest pending rows a claim looks at, per row of batch size.
const CLAIM_WINDOW_FACTOR: u32 = 4;

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
    /// An outbox in the given (validated) tables.
    pub fn new(tables: TableNames) -> Self {
        let queries = Arc::new(Queries::render(&tables));
        Outbox { tables, queries }
    }

    /// The table names in use.
    pub fn tables(&self) -> &TableNames {
        &self.tables
    }

    /// Inserts one event as part of the transaction `conn` belongs to.
    ///
    /// Nothing is visible to the relay until that transaction commits; a rollback removes it.
    pub async fn enqueue(&self, conn: &mut PgConnection, event: &Event) -> Result<()> {
        self.enqueue_all(conn, std::slice::from_ref(event)).await
    }

    /// Inserts several events in one statement as part of the transaction `conn` belongs to.
    ///
    /// Events of one aggregate keep their slice order; events are grouped by aggregate so that
    /// the per-aggregate counter locks are always taken in the same order.
    pub async fn enqueue_all(&self, conn: &mut PgConnection, events: &[Event]) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        let mut sorted: Vec<&Event> = events.iter().collect();
        sorted.sort_by(|a, b| {
            (a.aggregate_type(), a.aggregate_id()).cmp(&(b.aggregate_type(), b.aggregate_id()))
        });
        let n = sorted.len();
        let (mut ids, mut agg_types, mut agg_ids, mut types) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut payloads, mut headers, mut topics, mut tps, mut times) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for e in sorted {
            ids.push(e.id().as_uuid());
            agg_types.push(e.aggregate_type());
            agg_ids.push(e.aggregate_id());
            types.push(e.event_type());
            payloads.push(e.payload());
            headers.push(e.headers_json());
            topics.push(e.topic());
            tps.push(e.traceparent());
            times.push(e.occurred_at());
        }
        sqlx::query(&self.queries.enqueue)
            .bind(ids)
            .bind(agg_types)
            .bind(agg_ids)
            .bind(types)
            .bind(payloads)
            .bind(headers)
            .bind(topics)
            .bind(tps)
            .bind(times)
            .execute(conn)
            .await
            .map_err(|e| enqueue_error(e, &self.tables))?;
        Ok(())
    }
}

fn enqueue_error(e: sqlx::Error, tables: &TableNames) -> Error {
    if let Some(db) = e.as_database_error() {
        if db.constraint() == Some(&format!("{}_event_id_key", tables.bare("outbox"))) {
            return Error::InvalidEvent {
                field: "event_id",
                reason: format!("is already in the outbox ({})", db.message()),
            };
        }
        if db.code().as_deref() == Some("42P01") {
            return Error::database("enqueueing events (run `idem migrate` first?)", e);
        }
    }
    Error::database("enqueueing events", e)
}

/// What [`migrate`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MigrationReport {
    /// Versions applied by this call.
    pub applied: Vec<i64>,
    /// Highest version now in the database.
    pub current: i64,
}

/// Creates or upgrades idem's tables. Safe to run concurrently (an advisory lock serializes
/// migrators) and repeatedly (applied versions are recorded in `<prefix>schema_migrations`).
pub async fn migrate(pool: &PgPool, tables: &TableNames) -> Result<MigrationReport> {
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| Error::database("connecting to migrate", e))?;
    let mut tx = conn
        .begin()
        .await
        .map_err(|e| Error::database("starting the migration", e))?;
    let lock_key = format!(
        "idem_migrate:{}:{}",
        tables.schema().unwrap_or(""),
        tables.prefix()
    );
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(&lock_key)
        .execute(&mut *tx)
        .await
        .map_err(|e| Error::database("taking the migration lock", e))?;
    if let Some(schema) = tables.schema() {
        sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))
            .execute(&mut *tx)
            .await
            .map_err(|e| Error::database("creating the schema", e))?;
    }
    let mig_table = tables.qualified("schema_migrations");
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {mig_table} (version bigint PRIMARY KEY, description text NOT NULL, \
         applied_at timestamptz NOT NULL DEFAULT now())"
    ))
    .execute(&mut *tx)
    .await
    .map_err(|e| Error::database("creating the migrations table", e))?;
    let current: Option<i64> = sqlx::query_scalar(&format!("SELECT max(version) FROM {mig_table}"))
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| Error::database("reading the schema version", e))?;
    let current = current.unwrap_or(0);
    let supported = MIGRATIONS.last().map_or(0, |m| m.0);
    if current > supported {
        return Err(Error::SchemaTooNew {
            found: current,
            supported,
        });
    }
    let mut report = MigrationReport {
        applied: vec![],
        current,
    };
    for (version, description, sql) in MIGRATIONS.iter().filter(|m| m.0 > current) {
        sqlx::raw_sql(&tables.render(sql, BASES))
            .execute(&mut *tx)
            .await
            .map_err(|e| {
                Error::database(format!("running migration {version} ({description})"), e)
            })?;
        sqlx::query(&format!(
            "INSERT INTO {mig_table} (version, description) VALUES ($1, $2)"
        ))
        .bind(version)
        .bind(description)
        .execute(&mut *tx)
        .await
        .map_err(|e| Error::database("recording the migration", e))?;
        report.applied.push(*version);
        report.current = *version;
    }
    tx.commit()
        .await
        .map_err(|e| Error::database("committing the migration", e))?;
    Ok(report)
}

/// Connects a pool suited to the relay and the CLI.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .connect(url)
        .await
        .map_err(|e| Error::database(format!("connecting to PostgreSQL at {}", redact(url)), e))
}

/// `url` without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// The relay's PostgreSQL store.
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    outbox: Outbox,
    full_scan: idem_core::outbox::FullScanThrottle,
}

impl PgStore {
    /// A store over `pool` with the given tables.
    pub fn new(pool: PgPool, tables: TableNames) -> Self {
        PgStore {
            pool,
            outbox: Outbox::new(tables),
            full_scan: idem_core::outbox::FullScanThrottle::default(),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The enqueue handle for the same tables.
    pub fn outbox(&self) -> &Outbox {
        &self.outbox
    }

    fn q(&self) -> &Queries {
        &self.outbox.queries
    }
}

fn decode_record(row: &PgRow) -> std::result::Result<OutboxRecord, sqlx::Error> {
    let headers_value: serde_json::Value = row.try_get("headers")?;
    Ok(OutboxRecord {
        id: row.try_get("id")?,
        event_id: EventId(row.try_get::<Uuid, _>("event_id")?),
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        aggregate_seq: row.try_get("aggregate_seq")?,
        event_type: row.try_get("event_type")?,
        payload: row.try_get("payload")?,
        headers: headers_from_json(headers_value),
        topic: row.try_get("topic")?,
        traceparent: row.try_get("traceparent")?,
        occurred_at: timestamp(row, "occurred_at")?,
        created_at: timestamp(row, "created_at")?,
        attempt: row.try_get("attempts")?,
        permanent_failures: row.try_get("permanent_failures")?,
    })
}

/// Whether `e` is PostgreSQL's "current transaction is aborted" (SQLSTATE 25P02).
fn is_aborted(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "25P02")
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01 UTC).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

/// A `timestamptz` column, decoded without sqlx's chrono decoder: that one panics on values
/// chrono cannot hold ('infinity', '-infinity', years beyond 262143), which a writer of the SQL
/// contract could store before version 6. Such a value is an error, and the row is parked.
fn timestamp(row: &PgRow, column: &str) -> std::result::Result<DateTime<Utc>, sqlx::Error> {
    use sqlx::ValueRef as _;
    use sqlx::postgres::PgValueFormat;
    let bad = |reason: String| sqlx::Error::ColumnDecode {
        index: column.to_owned(),
        source: reason.into(),
    };
    let raw = row.try_get_raw(column)?;
    if raw.is_null() {
        return Err(bad("NULL".to_owned()));
    }
    match raw.format() {
        PgValueFormat::Binary => {
            let bytes = raw.as_bytes().map_err(|e| bad(e.to_string()))?;
            let micros = i64::from_be_bytes(
                bytes
                    .try_into()
                    .map_err(|_| bad(format!("{} bytes, not 8", bytes.len())))?,
            );
            micros
                .checked_add(PG_EPOCH_MICROS)
                .and_then(DateTime::from_timestamp_micros)
                .ok_or_else(|| bad(out_of_range(micros)))
        }
        PgValueFormat::Text => {
            let text = raw.as_str().map_err(|e| bad(e.to_string()))?;
            DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
                .map(|d| d.with_timezone(&Utc))
                .map_err(|e| bad(format!("{text:?}: {e}")))
        }
    }
}

/// Why a `timestamptz` of `micros` (since 2000-01-01) cannot be used.
fn out_of_range(micros: i64) -> String {
    match micros {
        i64::MAX => "'infinity' is not a time an event can have occurred at".to_owned(),
        i64::MIN => "'-infinity' is not a time an event can have occurred at".to_owned(),
        _ => format!("{micros} µs from 2000-01-01 is out of the range a client can hold"),
    }
}

fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl PgStore {
    async fn claim_within(&self, request: &ClaimRequest, window: Option<i64>) -> Result<Claim> {
        let claim_id = Uuid::now_v7();
        let rows = sqlx::query(&self.q().claim)
            .bind(i64::from(request.batch_size))
            .bind(claim_id)
            .bind(&request.relay_id)
            .bind(millis(request.lease))
            .bind(window)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::database("claiming outbox rows", e))?;
        let mut records = Vec::with_capacity(rows.len());
        let mut corrupt = vec![];
        for row in &rows {
            match decode_record(row) {
                Ok(r) => records.push(r),
                Err(e) => {
                    let id: i64 = row
                        .try_get("id")
                        .map_err(|e| Error::database("decoding a claimed row id", e))?;
                    corrupt.push((id, format!("the row cannot be decoded: {e}")));
                }
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

impl OutboxStore for PgStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim> {
        let window = i64::from(
            request
                .batch_size
                .saturating_mul(CLAIM_WINDOW_FACTOR)
                .max(64),
        );
        let claim = self.claim_within(request, Some(window)).await?;
        // The oldest rows may all sit behind leased or backing-off heads (one aggregate with a
        // deep backlog): then look at every pending row, so other aggregates never starve.
        if claim.records.is_empty() && claim.corrupt.is_empty() && self.full_scan.due() {
            return self.claim_within(request, None).await;
        }
        Ok(claim)
    }

    async fn complete(&self, claim: &Claim, outcome: &Outcome) -> Result<Completed> {
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(|e| Error::database("starting to mark rows", e))?;
        let mut done = Completed::default();
        if !outcome.published.is_empty() {
            done.marked = sqlx::query(&self.q().mark_published)
                .bind(&outcome.published)
                .bind(claim.claim_id)
                .execute(&mut *tx)
                .await
                .map_err(|e| Error::database("marking rows published", e))?
                .rows_affected();
        }
        if !outcome.failed.is_empty() {
            let f = &outcome.failed;
            done.released = sqlx::query(&self.q().release)
                .bind(f.iter().map(|x| x.id).collect::<Vec<_>>())
                .bind(f.iter().map(|x| x.reason.as_str()).collect::<Vec<_>>())
                .bind(f.iter().map(|x| millis(x.backoff)).collect::<Vec<_>>())
                .bind(f.iter().map(|x| x.park).collect::<Vec<_>>())
                .bind(f.iter().map(|x| x.attempted).collect::<Vec<_>>())
                .bind(claim.claim_id)
                .bind(f.iter().map(|x| x.permanent).collect::<Vec<_>>())
                .execute(&mut *tx)
                .await
                .map_err(|e| Error::database("releasing failed rows", e))?
                .rows_affected();
        }
        tx.commit()
            .await
            .map_err(|e| Error::database("committing marks", e))?;
        let expected = (outcome.published.len() + outcome.failed.len()) as u64;
        done.fenced = expected.saturating_sub(done.marked + done.released);
        Ok(done)
    }

    async fn prune(&self, policy: &PrunePolicy) -> Result<u64> {
        let sql = if policy.archive {
            &self.q().prune_archive
        } else {
            &self.q().prune_delete
        };
        let n = sqlx::query(sql)
            .bind(policy.retention.as_secs_f64())
            .bind(i64::from(policy.batch))
            .execute(&self.pool)
            .await
            .map_err(|e| Error::database("pruning published rows", e))?
            .rows_affected();
        Ok(n)
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
        Ok(OutboxStatus {
            pending: get("pending")?,
            parked: get("parked")?,
            published: get("published")?,
            oldest_pending_age_seconds: row
                .try_get("oldest_pending_age")
                .map_err(|e| Error::database("decoding status", e))?,
        })
    }

    async fn backlog(&self) -> Result<Vec<Backlog>> {
        let rows = sqlx::query(&self.q().backlog)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::database("counting the outbox backlog", e))?;
        rows.iter()
            .map(|r| {
                Ok(Backlog {
                    aggregate_type: r.try_get("aggregate_type")?,
                    pending: r.try_get("pending")?,
                    parked: r.try_get("parked")?,
                    oldest_pending_age_seconds: r.try_get("oldest_pending_age")?,
                })
            })
            .collect::<std::result::Result<_, sqlx::Error>>()
            .map_err(|e| Error::database("decoding the outbox backlog", e))
    }

    async fn parked(&self, limit: u32) -> Result<Vec<ParkedRow>> {
        let rows = sqlx::query(&self.q().parked)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::database("listing parked rows", e))?;
        rows.iter()
            .map(|r| {
                Ok(ParkedRow {
                    id: r.try_get("id")?,
                    event_id: EventId(r.try_get("event_id")?),
                    aggregate_type: r.try_get("aggregate_type")?,
                    aggregate_id: r.try_get("aggregate_id")?,
                    event_type: r.try_get("event_type")?,
                    attempts: r.try_get("attempts")?,
                    last_error: r.try_get("last_error")?,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(|e| Error::database("decoding parked rows", e))
    }

    async fn retry_parked(&self, event_ids: Option<&[EventId]>) -> Result<u64> {
        let ids: Option<Vec<Uuid>> =
            event_ids.map(|ids| ids.iter().map(EventId::as_uuid).collect());
        let n = sqlx::query(&self.q().retry_parked)
            .bind(ids)
            .execute(&self.pool)
            .await
            .map_err(|e| Error::database("retrying parked rows", e))?
            .rows_affected();
        Ok(n)
    }
}

/// The consumer's inbox and dead letters in PostgreSQL ([`idem_core::InboxStore`]).
///
/// Handlers receive `&mut PgConnection` inside the batch transaction: write with
/// `sqlx::query(..).execute(&mut *conn)`.
#[derive(Clone, Debug)]
pub struct PgInbox {
    pool: PgPool,
    queries: Arc<Queries>,
}

impl PgInbox {
    /// An inbox over `pool` with the given tables (created by [`migrate`]).
    pub fn new(pool: PgPool, tables: TableNames) -> Self {
        PgInbox {
            pool,
            queries: Arc::new(Queries::render(&tables)),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

impl idem_core::InboxStore for PgInbox {
    type Conn = PgConnection;
    type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

    async fn begin(&self) -> Result<Self::Tx> {
        self.pool
            .begin()
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
        conn: &mut PgConnection,
        group: &str,
        entries: &[idem_core::InboxEntry<'_>],
    ) -> Result<Vec<idem_core::Dedup>> {
        if entries.is_empty() {
            return Ok(vec![]);
        }
        let rows = sqlx::query(&self.queries.inbox_record)
            .bind(group)
            .bind(
                entries
                    .iter()
                    .map(|e| e.event.event_id.as_uuid())
                    .collect::<Vec<_>>(),
            )
            .bind(
                entries
                    .iter()
                    .map(|e| e.event.event_type.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                entries
                    .iter()
                    .map(|e| e.event.aggregate_type.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                entries
                    .iter()
                    .map(|e| e.event.aggregate_id.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                entries
                    .iter()
                    .map(|e| e.event.payload_hash.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(entries.iter().map(|e| e.copies).collect::<Vec<_>>())
            .bind(
                entries
                    .iter()
                    .map(|e| {
                        if e.dead_lettered {
                            "dead_lettered"
                        } else {
                            "processed"
                        }
                    })
                    .collect::<Vec<_>>(),
            )
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| Error::database("recording events in the inbox", e))?;
        let mut by_id = std::collections::HashMap::with_capacity(rows.len());
        for row in &rows {
            let id: Uuid = row
                .try_get("event_id")
                .map_err(|e| Error::database("decoding inbox rows", e))?;
            let count: i32 = row
                .try_get("delivery_count")
                .map_err(|e| Error::database("decoding inbox rows", e))?;
            let hash: String = row
                .try_get("payload_hash")
                .map_err(|e| Error::database("decoding inbox rows", e))?;
            by_id.insert(id, (count, hash));
        }
        entries
            .iter()
            .map(|e| {
                let (count, hash) = by_id.get(&e.event.event_id.as_uuid()).ok_or_else(|| {
                    Error::database(
                        "recording events in the inbox",
                        format!("no inbox row returned for {}", e.event.event_id),
                    )
                })?;
                Ok(if *count == e.copies {
                    idem_core::Dedup::New
                } else if *hash == e.event.payload_hash {
                    idem_core::Dedup::Duplicate
                } else {
                    idem_core::Dedup::Conflict
                })
            })
            .collect()
    }

    async fn savepoint(&self, conn: &mut PgConnection) -> Result<()> {
        sqlx::Executor::execute(&mut *conn, "SAVEPOINT idem_event")
            .await
            .map(|_| ())
            .map_err(|e| Error::database("setting a savepoint", e))
    }

    async fn rollback_to_savepoint(&self, conn: &mut PgConnection) -> Result<()> {
        sqlx::Executor::execute(&mut *conn, "ROLLBACK TO SAVEPOINT idem_event")
            .await
            .map(|_| ())
            .map_err(|e| Error::database("rolling back to a savepoint", e))
    }

    async fn release_savepoint(&self, conn: &mut PgConnection) -> Result<()> {
        sqlx::Executor::execute(&mut *conn, "RELEASE SAVEPOINT idem_event")
            .await
            .map(|_| ())
            .map_err(|e| Error::database("releasing a savepoint", e))
    }

    async fn check_usable(&self, conn: &mut PgConnection) -> Result<()> {
        // Any statement fails in an aborted transaction (SQLSTATE 25P02).
        match sqlx::Executor::execute(&mut *conn, "SELECT 1").await {
            Ok(_) => Ok(()),
            Err(e) if is_aborted(&e) => Err(Error::database(
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

    async fn mark_dead_lettered(
        &self,
        conn: &mut PgConnection,
        group: &str,
        ids: &[EventId],
    ) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(&self.queries.inbox_dead_lettered)
            .bind(group)
            .bind(ids.iter().map(EventId::as_uuid).collect::<Vec<_>>())
            .execute(&mut *conn)
            .await
            .map(|_| ())
            .map_err(|e| Error::database("marking inbox rows dead-lettered", e))
    }

    async fn dead_letter(
        &self,
        conn: &mut PgConnection,
        group: &str,
        letters: &[idem_core::DeadLetter],
    ) -> Result<()> {
        if letters.is_empty() {
            return Ok(());
        }
        sqlx::query(&self.queries.dead_letter)
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
            .bind(
                letters
                    .iter()
                    .map(|d| d.event_type.as_deref())
                    .collect::<Vec<_>>(),
            )
            .bind(
                letters
                    .iter()
                    .map(|d| d.reason.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(letters.iter().map(|d| d.key.as_deref()).collect::<Vec<_>>())
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
            )
            .execute(&mut *conn)
            .await
            .map_err(|e| Error::database("storing dead letters", e))?;
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
        conn: &mut PgConnection,
        group: &str,
        event: &idem_core::InboundEvent,
    ) -> Result<bool> {
        sqlx::query(&self.queries.inbox_replay)
            .bind(group)
            .bind(event.event_id.as_uuid())
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
        conn: &mut PgConnection,
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
fn open_letter(r: &PgRow) -> std::result::Result<idem_core::OpenDeadLetter, sqlx::Error> {
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

/// The server-side Idempotency-Key store in PostgreSQL ([`idem_core::idempotency::IdempotencyStore`]).
#[derive(Clone, Debug)]
pub struct PgKeyStore {
    pool: PgPool,
    queries: Arc<Queries>,
}

impl PgKeyStore {
    /// A key store over `pool` with the given tables (created by [`migrate`]).
    pub fn new(pool: PgPool, tables: TableNames) -> Self {
        PgKeyStore {
            pool,
            queries: Arc::new(Queries::render(&tables)),
        }
    }
}

impl idem_core::idempotency::IdempotencyStore for PgKeyStore {
    async fn claim(
        &self,
        scope: &str,
        key: &idem_core::idempotency::IdempotencyKey,
        fingerprint: &str,
        lock: std::time::Duration,
        retention: std::time::Duration,
    ) -> Result<idem_core::idempotency::KeyClaim> {
        use idem_core::idempotency::{KeyClaim, StoredResponse};
        let token = idem_core::idempotency::ClaimToken::random();
        let claimed = sqlx::query(&self.queries.key_claim)
            .bind(scope)
            .bind(key.as_str())
            .bind(fingerprint)
            .bind(millis(lock))
            .bind(millis(retention))
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
            // Released or swept between the two statements: the caller may simply retry.
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
        let code: i32 = row.try_get("response_status").map_err(dec)?;
        let headers: serde_json::Value = row.try_get("response_headers").map_err(dec)?;
        let body: Vec<u8> = row.try_get("response_body").map_err(dec)?;
        Ok(KeyClaim::Completed(StoredResponse {
            status: u16::try_from(code).unwrap_or(500),
            headers: serde_json::from_value(headers).unwrap_or_default(),
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
            .bind(millis(lock))
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
            .bind(i32::from(response.status))
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
            .execute(&self.pool)
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| Error::database("sweeping expired idempotency keys", e))
    }
}

fn decode_intent(r: &PgRow) -> Result<idem_core::idempotency::ClaimedIntent> {
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
            event_id: EventId(r.try_get("event_id").map_err(dec)?),
            effect: r.try_get("effect").map_err(dec)?,
            target: r.try_get("target").map_err(dec)?,
            body: serde_json::from_str(&body).map_err(|e| corrupt(e.to_string()))?,
            traceparent: r.try_get("traceparent").map_err(dec)?,
        },
        attempt: r.try_get("attempts").map_err(dec)?,
        unrecorded_send: r.try_get("sending_attempt").map_err(dec)?,
    })
}

/// Effect intents in PostgreSQL ([`idem_core::idempotency::IntentStore`]).
#[derive(Clone, Debug)]
pub struct PgIntents {
    pool: PgPool,
    queries: Arc<Queries>,
}

impl PgIntents {
    /// Intents over `pool` with the given tables (created by [`migrate`]).
    pub fn new(pool: PgPool, tables: TableNames) -> Self {
        PgIntents {
            pool,
            queries: Arc::new(Queries::render(&tables)),
        }
    }
}

use idem_core::idempotency::ClaimedRow;

impl idem_core::idempotency::IntentStore for PgIntents {
    type Conn = PgConnection;

    async fn record(
        &self,
        conn: &mut PgConnection,
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
            .bind(intent.event_id.as_uuid())
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
        lease: std::time::Duration,
    ) -> Result<Vec<idem_core::idempotency::ClaimedIntent>> {
        let rows = sqlx::query(&self.queries.intent_claim)
            .bind(i64::from(batch))
            .bind(millis(lease))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::database("claiming effect intents", e))?;
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

    async fn mark_sending(
        &self,
        id: i64,
        attempt: i32,
        lease_left: std::time::Duration,
    ) -> Result<bool> {
        let n = sqlx::query(&self.queries.intent_mark_sending)
            .bind(id)
            .bind(attempt)
            .bind(millis(lease_left))
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
            .bind(c.response_status.map(i32::from))
            .bind(c.response_body)
            .bind(c.error)
            .bind(millis(c.backoff))
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
        sqlx::query(&self.queries.intent_retry)
            .bind(ids.map(<[i64]>::to_vec))
            .execute(&self.pool)
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| Error::database("retrying effect intents", e))
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

    #[test]
    fn redacts_passwords() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
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
}
