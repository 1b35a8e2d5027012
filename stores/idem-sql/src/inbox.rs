//! The consumer's inbox and dead letters ([`InboxStore`]), written once.

use idem_core::idempotency::{EffectIntent, IntentStore};
use idem_core::store::{
    DeadLetter, DeadLetterRow, Dedup, InboxEntry, InboxStore, OpenDeadLetter, ReplayOutcome,
    RequestedReplay, StoredDeadLetter,
};
use idem_core::{EventId, InboundEvent, Result, TableNames};
use sqlx::{Pool, Transaction};

use crate::Dialect;
use crate::dialect::{Stmt, get};
use crate::queries::Handle;

/// The consumer's inbox and dead letters ([`InboxStore`]) in database `DB`.
///
/// Handlers receive `&mut DB::Connection` (`&mut PgConnection`, `&mut SqliteConnection`) inside
/// the batch transaction: write with `sqlx::query(..).execute(&mut *conn)`.
#[derive(Debug)]
pub struct Inbox<DB: Dialect>(Handle<DB>);

impl<DB: Dialect> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Inbox(self.0.clone())
    }
}

impl<DB: Dialect> Inbox<DB> {
    /// An inbox over `pool` with the given tables (created by [`migrate`](crate::migrate())).
    pub fn new(pool: Pool<DB>, tables: TableNames) -> Self {
        Inbox(Handle::new(pool, &tables))
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.0.pool
    }
}

/// What the inbox row of `entry` says: new if this delivery set its count, a duplicate if the
/// payload is the one stored, a conflict otherwise.
pub(crate) fn dedup(entry: &InboxEntry<'_>, count: i32, hash: &str) -> Dedup {
    if count == entry.copies {
        Dedup::New
    } else if hash == entry.event.payload_hash {
        Dedup::Duplicate
    } else {
        Dedup::Conflict
    }
}

/// The status an inbox row is recorded with.
pub(crate) fn status(entry: &InboxEntry<'_>) -> &'static str {
    if entry.dead_lettered {
        "dead_lettered"
    } else {
        "processed"
    }
}

fn stored_letter<DB: Dialect>(r: &DB::Row) -> sqlx::Result<StoredDeadLetter> {
    Ok(StoredDeadLetter {
        id: get::<DB, _>(r, "id")?,
        consumer_group: get::<DB, _>(r, "consumer_group")?,
        topic: get::<DB, _>(r, "topic")?,
        partition: get::<DB, _>(r, "record_partition")?,
        offset: get::<DB, _>(r, "record_offset")?,
        event_id: get::<DB, _>(r, "event_id")?,
        reason: get::<DB, _>(r, "reason")?,
        replay_outcome: get::<DB, _>(r, "replay_outcome")?,
        replayed_at: get::<DB, _>(r, "replayed_at")?,
        replayed_by: get::<DB, _>(r, "replayed_by")?,
        replay_requested_at: get::<DB, _>(r, "replay_requested_at")?,
        replay_requested_by: get::<DB, _>(r, "replay_requested_by")?,
    })
}

/// A dead letter row read for a replay ([`DeadLetterRow`] decides what it means).
fn open_letter<DB: Dialect>(r: &DB::Row) -> sqlx::Result<OpenDeadLetter> {
    Ok(DeadLetterRow {
        id: get::<DB, _>(r, "id")?,
        topic: get::<DB, _>(r, "topic")?,
        partition: get::<DB, _>(r, "record_partition")?,
        offset: get::<DB, _>(r, "record_offset")?,
        event_id: get::<DB, _>(r, "event_id")?,
        event_type: get::<DB, _>(r, "event_type")?,
        reason: get::<DB, _>(r, "reason")?,
        key: get::<DB, _>(r, "record_key")?,
        payload: get::<DB, _>(r, "payload")?,
        headers: get::<DB, _>(r, "headers")?,
    }
    .into())
}

async fn exec_raw<DB: Dialect>(c: &mut DB::Connection, sql: &str, context: &str) -> Result<()> {
    Stmt::<DB>::new(sql)
        .execute(c)
        .await
        .map(|_| ())
        .map_err(|e| crate::dialect::db_error(context.to_owned(), e))
}

impl<DB: Dialect> InboxStore for Inbox<DB> {
    type Conn = DB::Connection;
    type Tx = Transaction<'static, DB>;

    async fn begin(&self) -> Result<Self::Tx> {
        // SQLite: IMMEDIATE, the write lock up front, so the busy timeout applies instead of a
        // snapshot conflict when another writer committed first.
        DB::begin_pool(&self.0.pool)
            .await
            .map_err(|e| crate::dialect::db_error("beginning a consumer transaction", e))
    }

    async fn check_schema(&self) -> Result<()> {
        crate::migrate::check_schema_with(&self.0.pool, &self.0.queries).await
    }

    async fn commit(&self, tx: Self::Tx) -> Result<()> {
        tx.commit()
            .await
            .map_err(|e| crate::dialect::db_error("committing a consumer transaction", e))
    }

    async fn rollback(&self, tx: Self::Tx) -> Result<()> {
        tx.rollback()
            .await
            .map_err(|e| crate::dialect::db_error("rolling back a consumer transaction", e))
    }

    async fn record(
        &self,
        conn: &mut DB::Connection,
        group: &str,
        entries: &[InboxEntry<'_>],
    ) -> Result<Vec<Dedup>> {
        if entries.is_empty() {
            return Ok(vec![]);
        }
        let rows = DB::inbox_record(conn, &self.0.queries.inbox_record, group, entries).await?;
        Ok(entries
            .iter()
            .zip(rows)
            .map(|(e, (count, hash))| dedup(e, count, &hash))
            .collect())
    }

    async fn record_effects(
        &self,
        conn: &mut DB::Connection,
        intents: &[EffectIntent],
    ) -> Result<Vec<bool>> {
        crate::Intents::from_handle(self.0.clone())
            .record_all(conn, intents)
            .await
    }

    async fn savepoint(&self, conn: &mut DB::Connection) -> Result<()> {
        exec_raw::<DB>(conn, "SAVEPOINT idem_event", "setting a savepoint").await
    }

    async fn rollback_to_savepoint(&self, conn: &mut DB::Connection) -> Result<()> {
        exec_raw::<DB>(
            conn,
            "ROLLBACK TO SAVEPOINT idem_event",
            "rolling back to a savepoint",
        )
        .await
    }

    async fn release_savepoint(&self, conn: &mut DB::Connection) -> Result<()> {
        exec_raw::<DB>(
            conn,
            "RELEASE SAVEPOINT idem_event",
            "releasing a savepoint",
        )
        .await
    }

    async fn check_usable(&self, conn: &mut DB::Connection) -> Result<()> {
        DB::check_usable(conn).await
    }

    async fn mark_dead_lettered(
        &self,
        conn: &mut DB::Connection,
        group: &str,
        ids: &[EventId],
    ) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        DB::inbox_dead_lettered(conn, &self.0.queries.inbox_dead_lettered, group, ids)
            .await
            .map_err(|e| crate::dialect::db_error("marking inbox rows dead-lettered", e))
    }

    async fn dead_letter(
        &self,
        conn: &mut DB::Connection,
        group: &str,
        letters: &[DeadLetter],
    ) -> Result<()> {
        if letters.is_empty() {
            return Ok(());
        }
        DB::dead_letter(conn, &self.0.queries.dead_letter, group, letters)
            .await
            .map_err(|e| crate::dialect::db_error("storing dead letters", e))
    }

    async fn dead_letters(&self, group: &str, limit: u32) -> Result<Vec<StoredDeadLetter>> {
        let context = "listing dead letters";
        let mut c = self.0.conn(context).await?;
        let rows = Stmt::<DB>::new(&self.0.queries.dead_letters)
            .bind(group)
            .bind(i64::from(limit))
            .fetch_all(&mut c)
            .await
            .map_err(|e| crate::dialect::db_error(context, e))?;
        rows.iter()
            .map(stored_letter::<DB>)
            .collect::<sqlx::Result<Vec<_>>>()
            .map_err(|e| crate::dialect::db_error("decoding dead letters", e))
    }

    async fn open_dead_letters(
        &self,
        group: &str,
        after: i64,
        only: Option<i64>,
        limit: u32,
    ) -> Result<Vec<OpenDeadLetter>> {
        let context = "listing dead letters to replay";
        let mut c = self.0.conn(context).await?;
        let rows = Stmt::<DB>::new(&self.0.queries.dead_letters_open)
            .bind(group)
            .bind(after)
            .bind(only)
            .bind(i64::from(limit))
            .fetch_all(&mut c)
            .await
            .map_err(|e| crate::dialect::db_error(context, e))?;
        rows.iter()
            .map(open_letter::<DB>)
            .collect::<sqlx::Result<Vec<_>>>()
            .map_err(|e| crate::dialect::db_error("decoding dead letters to replay", e))
    }

    async fn find_dead_letter(&self, group: &str, id: i64) -> Result<Option<StoredDeadLetter>> {
        let context = "reading a dead letter";
        let mut c = self.0.conn(context).await?;
        let row = Stmt::<DB>::new(&self.0.queries.dead_letter_find)
            .bind(group)
            .bind(id)
            .fetch_optional(&mut c)
            .await
            .map_err(|e| crate::dialect::db_error(context, e))?;
        row.as_ref()
            .map(stored_letter::<DB>)
            .transpose()
            .map_err(|e| crate::dialect::db_error("decoding a dead letter", e))
    }

    async fn request_replays(
        &self,
        group: &str,
        only: Option<i64>,
        reason: Option<&str>,
        by: &str,
    ) -> Result<Vec<i64>> {
        let context = "requesting replays of dead letters";
        let mut c = self.0.conn(context).await?;
        let rows = Stmt::<DB>::new(&self.0.queries.dead_letters_request)
            .bind(group)
            .bind(only)
            .bind(by)
            .bind(reason)
            .fetch_all(&mut c)
            .await
            .map_err(|e| crate::dialect::db_error(context, e))?;
        let mut ids = rows
            .iter()
            .map(|r| get::<DB, i64>(r, "id"))
            .collect::<sqlx::Result<Vec<_>>>()
            .map_err(|e| crate::dialect::db_error(context, e))?;
        ids.sort_unstable();
        Ok(ids)
    }

    async fn requested_replays(
        &self,
        group: &str,
        after: i64,
        limit: u32,
    ) -> Result<Vec<RequestedReplay>> {
        let context = "reading the requested replays";
        let mut c = self.0.conn(context).await?;
        let rows = Stmt::<DB>::new(&self.0.queries.dead_letters_requested)
            .bind(group)
            .bind(after)
            .bind(i64::from(limit))
            .fetch_all(&mut c)
            .await
            .map_err(|e| crate::dialect::db_error(context, e))?;
        rows.iter()
            .map(|r| {
                Ok(RequestedReplay {
                    open: open_letter::<DB>(r)?,
                    by: get::<DB, Option<String>>(r, "replay_requested_by")?.unwrap_or_default(),
                })
            })
            .collect::<sqlx::Result<Vec<_>>>()
            .map_err(|e| crate::dialect::db_error("decoding the requested replays", e))
    }

    async fn claim_replay(
        &self,
        conn: &mut DB::Connection,
        group: &str,
        event: &InboundEvent,
    ) -> Result<bool> {
        Stmt::<DB>::new(&self.0.queries.inbox_replay)
            .bind(group)
            .event_id(event.event_id)
            .bind(event.event_type.as_str())
            .bind(event.aggregate_type.as_str())
            .bind(event.aggregate_id.as_str())
            .bind(event.payload_hash.as_str())
            .fetch_optional(conn)
            .await
            .map(|row| row.is_some())
            .map_err(|e| crate::dialect::db_error("claiming the inbox row of a replayed event", e))
    }

    async fn finish_replay(
        &self,
        conn: &mut DB::Connection,
        id: i64,
        by: &str,
        outcome: ReplayOutcome,
        reason: Option<&str>,
    ) -> Result<bool> {
        Stmt::<DB>::new(&self.0.queries.dead_letter_replayed)
            .bind(id)
            .bind(by)
            .bind(outcome.as_str())
            .bind(reason)
            .execute(conn)
            .await
            .map(|n| n > 0)
            .map_err(|e| crate::dialect::db_error("recording the replay of a dead letter", e))
    }
}
