//! What an operator reads and records: the console's views of idem's tables and the audit of
//! every action ([`Ops`]). Every read goes through a partial index or a bounded scan (`cap`
//! rows at most), so a page costs the same over a thousand rows or a billion.

use std::sync::Arc;

use idem_core::{Result, TableNames};
use sqlx::Pool;

use crate::Dialect;
use crate::dialect::{Stmt, get};
use crate::queries::{for_scheme, without_comments};

/// Table bases the statements name.
const BASES: &[&str] = &["outbox", "inbox", "dead_letters", "effect_intents", "audit"];

/// The statements, rendered once per store.
#[derive(Debug)]
struct Statements {
    outbox_summary: String,
    outbox_types: String,
    parked_reasons: String,
    parked_rows: String,
    cdc_slots: Option<String>,
    consumer_groups: String,
    letter_groups: String,
    letter_rows: String,
    intent_counts: String,
    intent_rows: String,
    audit_insert: String,
    audit_rows: String,
}

impl Statements {
    fn new(scheme: crate::Scheme, tables: &TableNames) -> Self {
        let r = |sql: &str| without_comments(&for_scheme(&tables.render(sql, BASES), scheme));
        let pg = scheme == crate::Scheme::Postgres;
        let either = |postgres: &str, sqlite: &str| r(if pg { postgres } else { sqlite });
        Statements {
            outbox_summary: either(
                include_str!("../sql/ops/outbox_summary.postgres.sql"),
                include_str!("../sql/ops/outbox_summary.sqlite.sql"),
            ),
            outbox_types: r(include_str!("../sql/ops/outbox_types.sql")),
            parked_reasons: r(include_str!("../sql/ops/parked_reasons.sql")),
            parked_rows: r(include_str!("../sql/ops/parked_rows.sql")),
            cdc_slots: pg.then(|| r(include_str!("../sql/ops/cdc_slots.postgres.sql"))),
            consumer_groups: r(include_str!("../sql/ops/consumer_groups.sql")),
            letter_groups: r(include_str!("../sql/ops/letter_groups.sql")),
            letter_rows: r(include_str!("../sql/ops/letter_rows.sql")),
            intent_counts: r(include_str!("../sql/ops/intent_counts.sql")),
            intent_rows: r(include_str!("../sql/ops/intent_rows.sql")),
            audit_insert: r(include_str!("../sql/ops/audit_insert.sql")),
            audit_rows: r(include_str!("../sql/ops/audit_rows.sql")),
        }
    }
}

/// The outbox at a glance. Counts stop at the `cap` they were read with.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OutboxSummary {
    /// Pending rows (at most `cap`).
    pub pending: i64,
    /// Parked rows (at most `cap`).
    pub parked: i64,
    /// The newest row id: its growth is the writers' rate.
    pub last_id: i64,
    /// Age in seconds of the oldest pending row, if any.
    pub oldest_pending_age: Option<f64>,
}

/// Pending and parked rows of one aggregate type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeBacklog {
    /// The aggregate type.
    pub aggregate_type: String,
    /// Pending rows.
    pub pending: i64,
    /// Parked rows.
    pub parked: i64,
}

/// Rows that share a reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReasonCount {
    /// The reason (empty when none was recorded).
    pub reason: String,
    /// How many rows have it.
    pub rows: i64,
    /// The oldest row's id.
    pub first_id: i64,
}

/// A parked outbox row, as an operator sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParkedOutboxRow {
    /// Row id.
    pub id: i64,
    /// Event id.
    pub event_id: String,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// Publish attempts.
    pub attempts: i64,
    /// Why it is parked.
    pub reason: String,
    /// When it was written (the database's clock, as text).
    pub created_at: String,
    /// The first 300 characters of its payload.
    pub preview: String,
}

/// A logical replication slot (PostgreSQL).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdcSlot {
    /// Slot name.
    pub name: String,
    /// Output plugin.
    pub plugin: String,
    /// Whether a reader is attached.
    pub active: bool,
    /// The position the reader confirmed.
    pub confirmed: Option<String>,
    /// Bytes of WAL the slot keeps from being recycled.
    pub wal_held: Option<i64>,
}

/// Open dead letters of one group that share a reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LetterGroup {
    /// Consumer group.
    pub consumer_group: String,
    /// The reason.
    pub reason: String,
    /// Open letters.
    pub letters: i64,
    /// The oldest letter's id.
    pub first_id: i64,
    /// The newest letter's id.
    pub last_id: i64,
    /// Letters whose replay is requested and not served yet.
    pub requested: i64,
}

/// A dead letter, as an operator sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LetterRow {
    /// Letter id.
    pub id: i64,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i64,
    /// Offset.
    pub offset: i64,
    /// Event id, if the record had one.
    pub event_id: Option<String>,
    /// Event type (empty when unknown).
    pub event_type: String,
    /// Why it was dead-lettered, or why its last replay failed.
    pub reason: String,
    /// When it was stored.
    pub created_at: String,
    /// The first 300 characters of its value.
    pub preview: String,
    /// How its last replay ended (empty: never replayed).
    pub replay_outcome: String,
    /// When a replay was requested and not served yet.
    pub replay_requested_at: Option<String>,
}

/// Effect intents by status (each at most `cap`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IntentCounts {
    /// Waiting for the dispatcher.
    pub pending: i64,
    /// Refused by the remote for good, or out of attempts.
    pub parked: i64,
    /// Sent, outcome unknown.
    pub unknown: i64,
    /// The newest intent's id.
    pub last_id: i64,
}

/// A parked or unknown effect intent, as an operator sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IntentRow {
    /// Intent id.
    pub id: i64,
    /// The Idempotency-Key it is sent with.
    pub key: String,
    /// The effect's name.
    pub effect: String,
    /// The URL it is sent to.
    pub target: String,
    /// `parked` or `unknown`.
    pub status: String,
    /// Attempts so far.
    pub attempts: i64,
    /// The remote's last HTTP status, if it answered.
    pub response_status: Option<i64>,
    /// The first 300 characters of the remote's last answer.
    pub response: String,
    /// Why it is parked or unknown (the probe's verdict, when one ran).
    pub reason: String,
    /// When it last changed.
    pub updated_at: String,
}

/// An operator action to record.
#[derive(Clone, Copy, Debug)]
pub struct Action<'a> {
    /// Who acted.
    pub actor: &'a str,
    /// What they did (`outbox.retry`, `dead_letters.replay`, …).
    pub action: &'a str,
    /// On what (`outbox row 42`, `group settlement, reason …`).
    pub target: &'a str,
    /// Why, in their words.
    pub reason: &'a str,
    /// Rows changed.
    pub affected: i64,
    /// How it ended (`done`, or the refusal).
    pub outcome: &'a str,
}

/// A recorded operator action.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditEntry {
    /// Entry id.
    pub id: i64,
    /// When (the database's clock, as text).
    pub at: String,
    /// Who.
    pub actor: String,
    /// What.
    pub action: String,
    /// On what.
    pub target: String,
    /// Why.
    pub reason: String,
    /// Rows changed.
    pub affected: i64,
    /// How it ended.
    pub outcome: String,
}

/// The operator's reads and the audit of one store ([`Store::ops`](crate::Store::ops)).
pub struct Ops<DB: Dialect> {
    pool: Pool<DB>,
    sql: Arc<Statements>,
}

impl<DB: Dialect> Clone for Ops<DB> {
    fn clone(&self) -> Self {
        Ops {
            pool: self.pool.clone(),
            sql: self.sql.clone(),
        }
    }
}

impl<DB: Dialect> std::fmt::Debug for Ops<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ops").finish_non_exhaustive()
    }
}

/// Maps a driver error to idem's, with what was being read.
fn err(context: &'static str) -> impl Fn(sqlx::Error) -> idem_core::Error {
    move |e| crate::dialect::db_error(context, e)
}

impl<DB: Dialect> Ops<DB> {
    /// The operator's view of idem's `tables` in `pool`'s database.
    pub fn new(pool: Pool<DB>, tables: &TableNames) -> Self {
        Ops {
            pool,
            sql: Arc::new(Statements::new(DB::SCHEME, tables)),
        }
    }

    async fn rows(
        &self,
        sql: &str,
        binds: Binds<'_>,
        context: &'static str,
    ) -> Result<Vec<DB::Row>> {
        let mut c = self.pool.acquire().await.map_err(err(context))?;
        binds
            .apply(Stmt::<DB>::new(sql))
            .fetch_all(&mut c)
            .await
            .map_err(err(context))
    }

    /// The outbox's pending and parked rows (each counted up to `cap`), its newest id and the
    /// age of its oldest pending row.
    pub async fn outbox_summary(&self, cap: i64) -> Result<OutboxSummary> {
        let c = "reading the outbox summary";
        let rows = self
            .rows(&self.sql.outbox_summary, Binds::Ints(&[cap]), c)
            .await?;
        let Some(r) = rows.first() else {
            return Ok(OutboxSummary::default());
        };
        Ok(OutboxSummary {
            pending: get::<DB, _>(r, "pending").map_err(err(c))?,
            parked: get::<DB, _>(r, "parked").map_err(err(c))?,
            last_id: get::<DB, _>(r, "last_id").map_err(err(c))?,
            oldest_pending_age: get::<DB, _>(r, "oldest_pending_age").map_err(err(c))?,
        })
    }

    /// Pending and parked rows per aggregate type, among the oldest `cap` of them.
    pub async fn outbox_types(&self, cap: i64) -> Result<Vec<TypeBacklog>> {
        let c = "reading the outbox by aggregate type";
        let rows = self
            .rows(&self.sql.outbox_types, Binds::Ints(&[cap]), c)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(TypeBacklog {
                    aggregate_type: get::<DB, _>(r, "aggregate_type")?,
                    pending: get::<DB, _>(r, "pending")?,
                    parked: get::<DB, _>(r, "parked")?,
                })
            })
            .collect::<sqlx::Result<_>>()
            .map_err(err(c))
    }

    /// Parked rows grouped by reason, among the oldest `cap`.
    pub async fn parked_reasons(&self, cap: i64) -> Result<Vec<ReasonCount>> {
        let c = "reading the reasons of parked rows";
        let rows = self
            .rows(&self.sql.parked_reasons, Binds::Ints(&[cap]), c)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(ReasonCount {
                    reason: get::<DB, _>(r, "reason")?,
                    rows: get::<DB, _>(r, "rows_")?,
                    first_id: get::<DB, _>(r, "first_id")?,
                })
            })
            .collect::<sqlx::Result<_>>()
            .map_err(err(c))
    }

    /// Up to `limit` parked rows with an id above `after` (only those with `reason`, when
    /// given), by id.
    pub async fn parked_rows(
        &self,
        after: i64,
        reason: Option<&str>,
        limit: i64,
    ) -> Result<Vec<ParkedOutboxRow>> {
        let c = "reading parked rows";
        let binds = Binds::IdTextLimit(after, reason, limit);
        let rows = self.rows(&self.sql.parked_rows, binds, c).await?;
        rows.iter()
            .map(|r| {
                Ok(ParkedOutboxRow {
                    id: get::<DB, _>(r, "id")?,
                    event_id: get::<DB, _>(r, "event_id")?,
                    aggregate_type: get::<DB, _>(r, "aggregate_type")?,
                    aggregate_id: get::<DB, _>(r, "aggregate_id")?,
                    event_type: get::<DB, _>(r, "event_type")?,
                    attempts: get::<DB, _>(r, "attempts")?,
                    reason: get::<DB, _>(r, "reason")?,
                    created_at: get::<DB, _>(r, "created_at")?,
                    preview: get::<DB, Option<String>>(r, "preview")?.unwrap_or_default(),
                })
            })
            .collect::<sqlx::Result<_>>()
            .map_err(err(c))
    }

    /// The logical replication slots (none on SQLite).
    pub async fn cdc_slots(&self) -> Result<Vec<CdcSlot>> {
        let Some(sql) = &self.sql.cdc_slots else {
            return Ok(vec![]);
        };
        let c = "reading the replication slots";
        let rows = self.rows(sql, Binds::None, c).await?;
        rows.iter()
            .map(|r| {
                Ok(CdcSlot {
                    name: get::<DB, _>(r, "name")?,
                    plugin: get::<DB, _>(r, "plugin")?,
                    active: get::<DB, _>(r, "active")?,
                    confirmed: get::<DB, _>(r, "confirmed")?,
                    wal_held: get::<DB, _>(r, "wal_held")?,
                })
            })
            .collect::<sqlx::Result<_>>()
            .map_err(err(c))
    }

    /// The consumer groups with inbox rows (at most 100), by name.
    pub async fn consumer_groups(&self) -> Result<Vec<String>> {
        let c = "reading the consumer groups";
        let rows = self.rows(&self.sql.consumer_groups, Binds::None, c).await?;
        rows.iter()
            .map(|r| get::<DB, String>(r, "name"))
            .collect::<sqlx::Result<_>>()
            .map_err(err(c))
    }

    /// Open dead letters grouped by group and reason, among the newest `cap`.
    pub async fn letter_groups(&self, cap: i64) -> Result<Vec<LetterGroup>> {
        let c = "reading the dead letters by reason";
        let rows = self
            .rows(&self.sql.letter_groups, Binds::Ints(&[cap]), c)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(LetterGroup {
                    consumer_group: get::<DB, _>(r, "consumer_group")?,
                    reason: get::<DB, _>(r, "reason")?,
                    letters: get::<DB, _>(r, "letters")?,
                    first_id: get::<DB, _>(r, "first_id")?,
                    last_id: get::<DB, _>(r, "last_id")?,
                    requested: get::<DB, _>(r, "requested")?,
                })
            })
            .collect::<sqlx::Result<_>>()
            .map_err(err(c))
    }

    /// Up to `limit` dead letters of `group` with an id above `after` (only `reason`, when
    /// given; only open ones when `open`), by id.
    pub async fn letter_rows(
        &self,
        group: &str,
        after: i64,
        reason: Option<&str>,
        open: bool,
        limit: i64,
    ) -> Result<Vec<LetterRow>> {
        let c = "reading dead letters";
        let binds = Binds::Letters(group, after, reason, i64::from(open), limit);
        let rows = self.rows(&self.sql.letter_rows, binds, c).await?;
        rows.iter()
            .map(|r| {
                Ok(LetterRow {
                    id: get::<DB, _>(r, "id")?,
                    topic: get::<DB, _>(r, "topic")?,
                    partition: get::<DB, _>(r, "record_partition")?,
                    offset: get::<DB, _>(r, "record_offset")?,
                    event_id: get::<DB, _>(r, "event_id")?,
                    event_type: get::<DB, _>(r, "event_type")?,
                    reason: get::<DB, _>(r, "reason")?,
                    created_at: get::<DB, _>(r, "created_at")?,
                    preview: get::<DB, _>(r, "preview")?,
                    replay_outcome: get::<DB, _>(r, "replay_outcome")?,
                    replay_requested_at: get::<DB, _>(r, "replay_requested_at")?,
                })
            })
            .collect::<sqlx::Result<_>>()
            .map_err(err(c))
    }

    /// Effect intents pending, parked and unknown, each counted up to `cap`.
    pub async fn intent_counts(&self, cap: i64) -> Result<IntentCounts> {
        let c = "counting effect intents";
        let rows = self
            .rows(&self.sql.intent_counts, Binds::Ints(&[cap]), c)
            .await?;
        let Some(r) = rows.first() else {
            return Ok(IntentCounts::default());
        };
        Ok(IntentCounts {
            pending: get::<DB, _>(r, "pending").map_err(err(c))?,
            parked: get::<DB, _>(r, "parked").map_err(err(c))?,
            unknown: get::<DB, _>(r, "unknown").map_err(err(c))?,
            last_id: get::<DB, _>(r, "last_id").map_err(err(c))?,
        })
    }

    /// Up to `limit` parked and unknown intents with an id above `after` (only `status`, when
    /// given), by id.
    pub async fn intent_rows(
        &self,
        after: i64,
        status: Option<&str>,
        limit: i64,
    ) -> Result<Vec<IntentRow>> {
        let c = "reading parked and unknown effect intents";
        let binds = Binds::IdTextLimit(after, status, limit);
        let rows = self.rows(&self.sql.intent_rows, binds, c).await?;
        rows.iter()
            .map(|r| {
                Ok(IntentRow {
                    id: get::<DB, _>(r, "id")?,
                    key: get::<DB, _>(r, "idem_key")?,
                    effect: get::<DB, _>(r, "effect")?,
                    target: get::<DB, _>(r, "target")?,
                    status: get::<DB, _>(r, "status")?,
                    attempts: get::<DB, _>(r, "attempts")?,
                    response_status: get::<DB, _>(r, "response_status")?,
                    response: get::<DB, _>(r, "response")?,
                    reason: get::<DB, _>(r, "reason")?,
                    updated_at: get::<DB, _>(r, "updated_at")?,
                })
            })
            .collect::<sqlx::Result<_>>()
            .map_err(err(c))
    }

    /// Records an operator action in the audit table.
    pub async fn audit(&self, a: Action<'_>) -> Result<()> {
        let c = "recording an operator action";
        let mut conn = self.pool.acquire().await.map_err(err(c))?;
        Stmt::<DB>::new(&self.sql.audit_insert)
            .bind(a.actor)
            .bind(a.action)
            .bind(a.target)
            .bind(a.reason)
            .bind(a.affected)
            .bind(a.outcome)
            .execute(&mut conn)
            .await
            .map(|_| ())
            .map_err(err(c))
    }

    /// Up to `limit` audit entries with an id below `before`, newest first.
    pub async fn audit_rows(&self, before: i64, limit: i64) -> Result<Vec<AuditEntry>> {
        let c = "reading the audit";
        let rows = self
            .rows(&self.sql.audit_rows, Binds::Ints(&[before, limit]), c)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(AuditEntry {
                    id: get::<DB, _>(r, "id")?,
                    at: get::<DB, _>(r, "at")?,
                    actor: get::<DB, _>(r, "actor")?,
                    action: get::<DB, _>(r, "action")?,
                    target: get::<DB, _>(r, "target")?,
                    reason: get::<DB, _>(r, "reason")?,
                    affected: get::<DB, _>(r, "affected")?,
                    outcome: get::<DB, _>(r, "outcome")?,
                })
            })
            .collect::<sqlx::Result<_>>()
            .map_err(err(c))
    }
}

/// The parameters of one statement, in order.
enum Binds<'a> {
    None,
    Ints(&'a [i64]),
    /// An id to page after, an optional text filter, a limit.
    IdTextLimit(i64, Option<&'a str>, i64),
    /// Group, after, reason, open only (0 or 1), limit.
    Letters(&'a str, i64, Option<&'a str>, i64, i64),
}

impl<'a> Binds<'a> {
    fn apply<DB: Dialect>(self, s: Stmt<'a, DB>) -> Stmt<'a, DB> {
        match self {
            Binds::None => s,
            Binds::Ints(v) => v.iter().fold(s, |s, i| s.bind(*i)),
            Binds::IdTextLimit(after, text, limit) => s.bind(after).bind(text).bind(limit),
            Binds::Letters(group, after, reason, open, limit) => s
                .bind(group)
                .bind(after)
                .bind(reason)
                .bind(open)
                .bind(limit),
        }
    }
}
