//! Effect intents ([`IntentStore`]), written once.

use std::collections::HashSet;
use std::time::Duration;

use idem_core::idempotency::{
    ClaimedIntent, ClaimedRow, EffectIntent, FinishedAttempt, IdempotencyKey, IntentOutcome,
    IntentStatus, IntentStore, Resolution, StuckIntent, UnknownStatus, park_undecodable,
};
use idem_core::{Error, Result, TableNames};
use sqlx::Pool;

use crate::dialect::{Now, Stmt, get};
use crate::queries::Handle;
use crate::{Array, Dialect};

/// Effect intents ([`IntentStore`]) in database `DB`.
#[derive(Debug)]
pub struct Intents<DB: Dialect>(Handle<DB>);

impl<DB: Dialect> Clone for Intents<DB> {
    fn clone(&self) -> Self {
        Intents(self.0.clone())
    }
}

impl<DB: Dialect> Intents<DB> {
    /// Intents over `pool` with the given tables (created by [`migrate`](crate::migrate())).
    pub fn new(pool: Pool<DB>, tables: TableNames) -> Self {
        Intents(Handle::new(pool, &tables))
    }

    /// The intents of the database and tables `handle` names (the inbox's own, for the effects
    /// a handler posts in the consumer's transaction).
    pub(crate) fn from_handle(handle: Handle<DB>) -> Self {
        Intents(handle)
    }

    /// Runs one statement on the pool and counts the rows it changed.
    async fn changed(&self, context: &str, stmt: Stmt<'_, DB>) -> Result<u64> {
        let mut c = self.0.conn(context).await?;
        stmt.execute(&mut c)
            .await
            .map_err(|e| crate::dialect::db_error(context.to_owned(), e))
    }
}

/// One intent row; a malformed key, event id or body is a corrupt row.
fn decode_intent<DB: Dialect>(r: &DB::Row) -> Result<ClaimedIntent> {
    let dec = |e| crate::dialect::db_error("decoding an effect intent", e);
    let id: i64 = get::<DB, _>(r, "id").map_err(dec)?;
    let corrupt = |reason: String| Error::CorruptRow { id, reason };
    let body: String = get::<DB, _>(r, "body").map_err(dec)?;
    Ok(ClaimedIntent {
        id,
        key: IdempotencyKey::new(get::<DB, String>(r, "idem_key").map_err(dec)?)
            .map_err(|e| corrupt(e.to_string()))?,
        intent: EffectIntent {
            event_id: DB::get_event_id(r, "event_id").map_err(dec)??,
            effect: get::<DB, _>(r, "effect").map_err(dec)?,
            target: get::<DB, _>(r, "target").map_err(dec)?,
            body: serde_json::from_str(&body).map_err(|e| corrupt(e.to_string()))?,
            traceparent: get::<DB, _>(r, "traceparent").map_err(dec)?,
        },
        attempt: get::<DB, _>(r, "attempts").map_err(dec)?,
        unrecorded_send: get::<DB, _>(r, "sending_attempt").map_err(dec)?,
    })
}

/// The columns of a batch of intents, one [`Array`] each; a key that cannot be derived makes
/// the batch invalid.
struct IntentColumns {
    keys: Vec<String>,
    effects: Array<String>,
    targets: Array<String>,
    event_ids: Array<uuid::Uuid>,
    bodies: Array<String>,
    traceparents: Array<Option<String>>,
}

impl IntentColumns {
    fn of(intents: &[EffectIntent]) -> Result<Self> {
        let keys = intents
            .iter()
            .map(|i| i.key().map(|k| k.as_str().to_owned()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::InvalidEvent {
                field: "effect",
                reason: e.to_string(),
            })?;
        let ids: Vec<idem_core::EventId> = intents.iter().map(|i| i.event_id).collect();
        Ok(IntentColumns {
            keys,
            effects: intents.iter().map(|i| i.effect.clone()).collect(),
            targets: intents.iter().map(|i| i.target.clone()).collect(),
            event_ids: Array::event_ids(&ids),
            bodies: intents.iter().map(|i| i.body.to_string()).collect(),
            traceparents: intents.iter().map(|i| i.traceparent.clone()).collect(),
        })
    }
}

/// For each key in order, whether this position inserted it: the first occurrence of a key the
/// statement returned.
fn first_inserted(keys: &[String], inserted: &HashSet<String>) -> Vec<bool> {
    let mut seen: HashSet<&str> = HashSet::with_capacity(keys.len());
    keys.iter()
        .map(|k| seen.insert(k.as_str()) && inserted.contains(k))
        .collect()
}

/// A stored status text as an [`IntentStatus`]; another text is a decode error of its row.
fn stored_status(text: String) -> sqlx::Result<IntentStatus> {
    text.parse()
        .map_err(|e: UnknownStatus| sqlx::Error::Decode(Box::new(e)))
}

fn decode_stuck<DB: Dialect>(r: &DB::Row) -> sqlx::Result<StuckIntent> {
    Ok(StuckIntent {
        id: get::<DB, _>(r, "id")?,
        key: get::<DB, _>(r, "idem_key")?,
        effect: get::<DB, _>(r, "effect")?,
        status: stored_status(get::<DB, String>(r, "status")?)?,
        attempts: get::<DB, _>(r, "attempts")?,
        reason: get::<DB, _>(r, "last_error")?,
    })
}

impl<DB: Dialect> IntentStore for Intents<DB> {
    type Conn = DB::Connection;

    async fn record(&self, conn: &mut DB::Connection, intent: &EffectIntent) -> Result<bool> {
        let key = intent.key().map_err(|e| Error::InvalidEvent {
            field: "effect",
            reason: e.to_string(),
        })?;
        let n = Stmt::<DB>::new(&self.0.queries.intent_record)
            .bind(key.as_str())
            .bind(intent.effect.as_str())
            .bind(intent.target.as_str())
            .event_id(intent.event_id)
            .bind(intent.body.to_string())
            .bind(intent.traceparent.as_deref())
            .execute(conn)
            .await
            .map_err(|e| crate::dialect::db_error("recording an effect intent", e))?;
        Ok(n == 1)
    }

    async fn record_all(
        &self,
        conn: &mut DB::Connection,
        intents: &[EffectIntent],
    ) -> Result<Vec<bool>> {
        if intents.is_empty() {
            return Ok(vec![]);
        }
        let cols = IntentColumns::of(intents)?;
        let rows = Stmt::<DB>::new(&self.0.queries.intent_record_all)
            .bind(Array::new(cols.keys.clone()))
            .bind(cols.effects)
            .bind(cols.targets)
            .bind(cols.event_ids)
            .bind(cols.bodies)
            .bind(cols.traceparents)
            .fetch_all(conn)
            .await
            .map_err(|e| crate::dialect::db_error("recording effect intents", e))?;
        let inserted = rows
            .iter()
            .map(|r| get::<DB, String>(r, "idem_key"))
            .collect::<sqlx::Result<HashSet<String>>>()
            .map_err(|e| crate::dialect::db_error("decoding recorded effect intents", e))?;
        Ok(first_inserted(&cols.keys, &inserted))
    }

    async fn claim(&self, batch: u32, lease: Duration) -> Result<Vec<ClaimedIntent>> {
        let context = "claiming effect intents";
        let now = Now::read();
        let mut conn = self.0.conn(context).await?;
        let mut w = DB::begin_write(&mut conn).await.map_err(|e| {
            crate::dialect::db_error(format!("{context}: starting a write transaction"), e)
        })?;
        let rows = Stmt::<DB>::new(&self.0.queries.intent_claim)
            .bind(i64::from(batch))
            .after(now, lease)
            .now(now)
            .fetch_all(w.conn())
            .await;
        let rows = w.finish(rows, context).await?;
        drop(conn);
        // Only a row's id and attempt number must decode; anything else parks the row.
        let rows = rows
            .iter()
            .map(|r| {
                Ok(ClaimedRow::of(
                    decode_intent::<DB>(r),
                    get::<DB, _>(r, "id")?,
                    get::<DB, _>(r, "attempts")?,
                ))
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(|e| crate::dialect::db_error("decoding claimed effect intents", e))?;
        park_undecodable(self, rows).await
    }

    async fn mark_sending(
        &self,
        id: i64,
        attempt: i32,
        lease_left: Duration,
        settle: Duration,
    ) -> Result<bool> {
        let now = Now::read();
        let stmt = Stmt::<DB>::new(&self.0.queries.intent_mark_sending)
            .bind(id)
            .bind(attempt)
            .after(now, lease_left)
            .after(now, settle);
        Ok(self
            .changed("marking an effect intent as sending", stmt)
            .await?
            == 1)
    }

    async fn finish_all(&self, finished: &[FinishedAttempt]) -> Result<Vec<i64>> {
        if finished.is_empty() {
            return Ok(Vec::new());
        }
        let context = "recording effect outcomes";
        let mut conn = self.0.conn(context).await?;
        let mut w = DB::begin_write(&mut conn).await.map_err(|e| {
            crate::dialect::db_error(format!("{context}: starting a write transaction"), e)
        })?;
        let sql = &self.0.queries.intent_finish;
        let recorded = DB::intent_finish(w.conn(), sql, Now::read(), finished).await;
        w.finish(recorded, context).await
    }

    async fn stuck(&self, limit: u32) -> Result<Vec<StuckIntent>> {
        let context = "listing stuck effect intents";
        let mut c = self.0.conn(context).await?;
        let rows = Stmt::<DB>::new(&self.0.queries.intent_stuck)
            .bind(i64::from(limit))
            .fetch_all(&mut c)
            .await
            .map_err(|e| crate::dialect::db_error(context, e))?;
        rows.iter()
            .map(decode_stuck::<DB>)
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            .map_err(|e| crate::dialect::db_error("decoding stuck effect intents", e))
    }

    async fn retry_stuck(&self, ids: Option<&[i64]>) -> Result<u64> {
        let context = "retrying effect intents";
        let mut conn = self.0.conn(context).await?;
        let mut w = DB::begin_write(&mut conn).await.map_err(|e| {
            crate::dialect::db_error(format!("{context}: starting a write transaction"), e)
        })?;
        let q = &self.0.queries;
        let n = DB::for_ids(w.conn(), &q.intent_retry, &q.intent_retry_one, ids).await;
        w.finish(n, context).await
    }

    async fn get(&self, id: i64) -> Result<Option<(ClaimedIntent, IntentStatus)>> {
        let context = "reading an effect intent";
        let mut c = self.0.conn(context).await?;
        let row = Stmt::<DB>::new(&self.0.queries.intent_get)
            .bind(id)
            .fetch_optional(&mut c)
            .await
            .map_err(|e| crate::dialect::db_error(context, e))?;
        match row {
            None => Ok(None),
            Some(r) => {
                let status = get::<DB, String>(&r, "status")
                    .and_then(stored_status)
                    .map_err(|e| crate::dialect::db_error("decoding an effect intent", e))?;
                Ok(Some((decode_intent::<DB>(&r)?, status)))
            }
        }
    }

    async fn resolve(&self, id: i64, resolution: Resolution, note: &str) -> Result<bool> {
        let stmt = Stmt::<DB>::new(&self.0.queries.intent_resolve)
            .bind(id)
            .bind(resolution.status().as_str())
            .bind(note);
        Ok(self.changed("resolving an effect intent", stmt).await? == 1)
    }
}

/// How an [`IntentOutcome`] is stored: the columns every intent store writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OutcomeColumns<'a> {
    /// New status.
    pub(crate) status: &'static str,
    /// Response status, when done.
    pub(crate) response_status: Option<u16>,
    /// Response body, when done.
    pub(crate) response_body: Option<&'a str>,
    /// Why it did not succeed.
    pub(crate) error: Option<&'a str>,
    /// Wait this long before the next attempt.
    pub(crate) backoff: std::time::Duration,
}

/// The stored form of `outcome`.
pub(crate) fn columns(outcome: &IntentOutcome) -> OutcomeColumns<'_> {
    fn stop<'a>(
        status: &'static str,
        reason: &'a str,
        backoff: std::time::Duration,
    ) -> OutcomeColumns<'a> {
        OutcomeColumns {
            status,
            response_status: None,
            response_body: None,
            error: Some(reason),
            backoff,
        }
    }
    match outcome {
        IntentOutcome::Done { status, body } => OutcomeColumns {
            status: IntentStatus::Done.as_str(),
            response_status: Some(*status),
            response_body: Some(body.as_str()),
            error: None,
            backoff: std::time::Duration::ZERO,
        },
        IntentOutcome::Retry { after, reason } => {
            stop(IntentStatus::Pending.as_str(), reason, *after)
        }
        IntentOutcome::Park { reason } => stop(
            IntentStatus::Parked.as_str(),
            reason,
            std::time::Duration::ZERO,
        ),
        IntentOutcome::Unknown { reason } => stop(
            IntentStatus::Unknown.as_str(),
            reason,
            std::time::Duration::ZERO,
        ),
    }
}
