//! The relay's statements on PostgreSQL: claims with `FOR UPDATE … SKIP LOCKED` and the
//! database's clock, marks as arrays.

use chrono::{DateTime, Utc};
use idem_core::outbox::{
    Backlog, Claim, ClaimRequest, Completed, OutboxRecord, OutboxStatus, Outcome, ParkedRow,
    PrunePolicy, headers_from_json, sort_records,
};
use idem_core::{Error, EventId, OutboxStore, Result};
use sqlx::Postgres;
use sqlx::Row;
use sqlx::postgres::PgRow;
use uuid::Uuid;

use crate::RelayStore;
use crate::millis;
use crate::relay_store::{claim_window, fenced};

type PgStore = RelayStore<Postgres>;

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
        let claim = self
            .claim_within(request, Some(claim_window(request.batch_size)))
            .await?;
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
        done.fenced = fenced(outcome, done.marked, done.released);
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
        self.parked_rows(limit).await
    }

    async fn retry_parked(&self, event_ids: Option<&[EventId]>) -> Result<u64> {
        self.retry_parked_rows(event_ids).await
    }
}
