//! The relay's statements on SQLite: claims and marks inside `BEGIN IMMEDIATE`, the clock bound
//! from Rust, one statement per row.

use std::str::FromStr;

use chrono::Utc;
use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::outbox::{
    Backlog, Claim, ClaimOutcome, ClaimRequest, Completed, OutboxRecord, OutboxStatus, PrunePolicy,
    headers_from_json, sort_records,
};
use idem_core::{Error, EventId, Result};
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, Sqlite};
use uuid::Uuid;

use super::{TS_FORMAT, immediate, now_ms, parse_ts};
use crate::RelayStore;
use crate::dialect::sealed::RelayOps;
use crate::millis;
use crate::relay_store::fenced;
use idem_core::ErrorKind;

type SqliteStore = RelayStore<Sqlite>;

fn decode_record(row: &SqliteRow) -> Result<OutboxRecord> {
    let id: i64 = row
        .try_get("id")
        .map_err(|e| crate::dialect::db_error("decoding a claimed row", e))?;
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

impl RelayOps for Sqlite {
    const WINDOWED_CLAIM: bool = true;

    fn refresh_statistics(_store: &SqliteStore) -> BoxFuture<'_, ()> {
        // SQLite's claim runs in `BEGIN IMMEDIATE` over the same indexes; its planner does not
        // depend on statistics gathered by ANALYZE unless sqlite_stat1 exists.
        futures::future::ready(()).boxed()
    }

    fn claim_within<'a>(
        this: &'a SqliteStore,
        request: &'a ClaimRequest,
        window: Option<i64>,
    ) -> BoxFuture<'a, Result<Claim>> {
        async move {
            // -1: no window, every pending row.
            let window = window.unwrap_or(-1);
            let claim_id = Uuid::now_v7();
            let now = now_ms();
            let mut conn = this.conn("claiming outbox rows").await?;
            let q = &this.q().claim;
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
        .boxed()
    }
    fn complete<'a>(
        this: &'a SqliteStore,
        claim: &'a Claim,
        outcome: &'a ClaimOutcome,
    ) -> BoxFuture<'a, Result<Completed>> {
        async move {
            let claim_id = claim.claim_id.to_string();
            let mut conn = this.conn("marking rows").await?;
            let q = this.q();
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
                        .bind(f.disposition.parks())
                        .bind(f.disposition.attempted())
                        .bind(&claim_id)
                        .bind(f.disposition.is_permanent())
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
        .boxed()
    }

    fn prune<'a>(this: &'a SqliteStore, policy: &'a PrunePolicy) -> BoxFuture<'a, Result<u64>> {
        async move {
            let cutoff = (Utc::now()
                - chrono::Duration::from_std(policy.retention).unwrap_or(chrono::Duration::MAX))
            .format(TS_FORMAT)
            .to_string();
            let mut conn = this.conn("pruning published rows").await?;
            let q = this.q();
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
        .boxed()
    }

    fn status(this: &SqliteStore) -> BoxFuture<'_, Result<OutboxStatus>> {
        async move {
            let row = sqlx::query(&this.q().status)
                .fetch_one(&this.pool)
                .await
                .map_err(|e| crate::dialect::db_error("counting outbox rows", e))?;
            let get = |c: &str| {
                row.try_get::<i64, _>(c)
                    .map_err(|e| crate::dialect::db_error("decoding status", e))
            };
            let oldest: Option<String> = row
                .try_get("oldest_pending")
                .map_err(|e| crate::dialect::db_error("decoding status", e))?;
            let age = match oldest {
                Some(ts) => {
                    let at = parse_ts(&ts).map_err(oldest_pending)?;
                    Some((Utc::now() - at).as_seconds_f64())
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
        .boxed()
    }

    fn backlog(this: &SqliteStore) -> BoxFuture<'_, Result<Vec<Backlog>>> {
        async move {
            let rows = sqlx::query(&this.q().backlog)
                .fetch_all(&this.pool)
                .await
                .map_err(|e| crate::dialect::db_error("counting the outbox backlog", e))?;
            let now = Utc::now();
            rows.iter()
                .map(|r| {
                    let dec = |e| crate::dialect::db_error("decoding the outbox backlog", e);
                    let oldest: Option<String> = r.try_get("oldest_pending").map_err(dec)?;
                    let oldest_pending_age_seconds = match oldest {
                        Some(ts) => {
                            let at = parse_ts(&ts).map_err(oldest_pending)?;
                            Some((now - at).as_seconds_f64())
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
        .boxed()
    }

    fn prune_older<'a>(
        store: &'a SqliteStore,
        what: idem_core::retention::Prunable,
        window: &'a idem_core::retention::RetentionWindow,
        batch: u32,
    ) -> BoxFuture<'a, Result<u64>> {
        super::retention::prune_older(store, what, window, batch)
    }

    /// SQLite keeps no per-aggregate counters: nothing to prune.
    fn prune_counters(_store: &SqliteStore, _batch: u32) -> BoxFuture<'_, Result<u64>> {
        async { Ok(0) }.boxed()
    }
}

/// A stored `created_at` that is not a timestamp: the row is unreadable, not the setting.
fn oldest_pending(reason: String) -> Error {
    Error::database_as(
        ErrorKind::Invalid,
        "decoding the oldest pending row's created_at",
        reason,
    )
}
