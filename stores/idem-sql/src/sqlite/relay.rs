//! The relay's statements on SQLite: claims and marks inside `BEGIN IMMEDIATE`, the clock bound
//! from Rust, one statement per row.

use std::str::FromStr;

use chrono::Utc;
use idem_core::outbox::{
    Backlog, Claim, ClaimRequest, Completed, OutboxRecord, OutboxStatus, Outcome, ParkedRow,
    PrunePolicy, headers_from_json, sort_records,
};
use idem_core::{Error, EventId, OutboxStore, Result};
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, Sqlite};
use uuid::Uuid;

use super::{TS_FORMAT, immediate, now_ms, parse_ts};
use crate::RelayStore;
use crate::millis;
use crate::relay_store::{claim_window, fenced};

type SqliteStore = RelayStore<Sqlite>;

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
        let claim = self
            .claim_within(request, claim_window(request.batch_size))
            .await?;
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
        Ok(Completed {
            fenced: fenced(outcome, done.marked, done.released),
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
        self.parked_rows(limit).await
    }

    async fn retry_parked(&self, event_ids: Option<&[EventId]>) -> Result<u64> {
        self.retry_parked_rows(event_ids).await
    }
}
