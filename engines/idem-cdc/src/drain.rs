//! Table mode: the rows the stream will never carry. A slot streams only what commits after its
//! confirmed position, and an `UPDATE` never (the publication is insert-only), so at the start
//! of every session the pending rows written before that position are published first, with
//! the polling relay's claim → publish → mark cycle:
//!
//! - rows committed before the slot existed (a first start on an outbox that already had rows,
//!   a switch from the polling relay): without this they would stay pending forever;
//! - rows `idem outbox retry` returned to pending (parked, then retried);
//! - rows published by an earlier session whose mark was lost: published again, copies with
//!   the same `ce_id`, absorbed by the consumer's inbox.
//!
//! Which rows: pending, and `written_lsn` (the WAL insert position a trigger stamps on every
//! insert, schema 14) before the slot's confirmed position `C`, or NULL (older rows). A row
//! written at or after `C` commits after `C` (its commit record follows its insert), so the slot
//! streams it: draining it too would publish it twice, and a relay restarted after an outage
//! would publish its whole backlog with the claim cycle instead of streaming it. A row written
//! before `C` and committed after it is both drained and streamed (a copy). Without a known `C`
//! every pending row is drained.
//!
//! Only the rows pending when the drain starts are waited for (up to the newest such id then),
//! so live writers cannot keep it going. Each aggregate's rows go out in commit order, and the
//! stream that follows sends nothing of an aggregate older than what the drain sent: writers of
//! one aggregate hold its counter's row lock from their insert to their commit (the
//! `aggregate_seq` trigger), so a row written after `C` commits after every drained row of its
//! aggregate. A crash during the drain leaves the rest pending, and the next session drains
//! them. A drain whose mark fails ends its session with its rows leased; the relay's next
//! session ends those leases first (its drains run one after another under one id), so it
//! publishes them again at once instead of after the lease. With `--delete-published` the rows
//! the drain published are deleted after their mark, as the stream's are.

use std::sync::Arc;
use std::time::Duration;

use idem_core::outbox::{
    Backlog, Claim, ClaimOutcome, ClaimRequest, Completed, OutboxStatus, OutboxStore, ParkedRow,
    PrunePolicy,
};
use idem_core::publish::Publisher;
use idem_core::{EventId, TableNames};
use idem_relay::{Relay, RelayConfig, RelayMetrics};
use sqlx::{PgPool, Postgres};

use crate::error::CdcError;
use crate::relay::CdcConfig;

/// Publishes every row pending now and written before `confirmed` (the slot's confirmed
/// position as PostgreSQL prints it; `None`: every pending row) as relay `id` (the same for
/// every session of one relay); how many were published.
pub async fn drain<P: Publisher>(
    pool: &PgPool,
    tables: &TableNames,
    publisher: Arc<P>,
    config: &CdcConfig,
    id: &str,
    confirmed: Option<&str>,
) -> Result<u64, CdcError> {
    let Some(newest) = pending_max(pool, tables, confirmed).await? else {
        return Ok(0);
    };
    release_own_leases(pool, tables, id).await?;
    let lease = publisher
        .longest_publish()
        .map_or(Duration::from_secs(60), |p| {
            p.saturating_mul(2) + Duration::from_secs(10)
        });
    let relay_config = RelayConfig {
        relay_id: id.to_owned(),
        lease,
        topics: config.topics.clone(),
        source: config.source.clone(),
        prune: None,
        // The CDC relay's publisher sets unwritable topics aside already, on its own clock.
        unwritable_topic_grace: None,
        ..RelayConfig::default()
    };
    let metrics = RelayMetrics::unregistered()?;
    let store = DrainStore {
        inner: idem_sql::RelayStore::<Postgres>::new(pool.clone(), tables.clone()),
        delete: config.delete_published.then(|| {
            idem_sql::postgres::CdcStatements::shared(tables)
                .delete_drained
                .clone()
        }),
    };
    let relay = Relay::new(store, publisher, relay_config, metrics);
    let mut published = 0;
    while pending_up_to(pool, tables, newest, confirmed).await? > 0 {
        let report = relay.run_once().await?;
        published += report.published;
        if report.claimed == 0 {
            // What is left backs off after a failure, or is leased to another relay.
            tokio::time::sleep(config.poll).await;
        }
    }
    Ok(published)
}

/// The polling relay's store, which deletes what it marked published when `delete` holds the
/// statement (`--delete-published`).
struct DrainStore {
    inner: idem_sql::RelayStore<Postgres>,
    delete: Option<String>,
}

impl OutboxStore for DrainStore {
    async fn claim(&self, request: &ClaimRequest) -> idem_core::Result<Claim> {
        self.inner.claim(request).await
    }

    async fn complete(
        &self,
        claim: &Claim,
        outcome: &ClaimOutcome,
    ) -> idem_core::Result<Completed> {
        let done = self.inner.complete(claim, outcome).await?;
        if let Some(sql) = &self.delete
            && !outcome.published.is_empty()
        {
            // The rows are marked: a failed delete leaves them published (`idem prune` removes
            // them), never pending, so it is reported and the drain goes on.
            if let Err(e) = sqlx::query(sql)
                .bind(&outcome.published)
                .execute(self.inner.pool())
                .await
            {
                tracing::warn!(
                    error = %e,
                    rows = outcome.published.len(),
                    "could not delete the drained rows (`delete_published`); they stay published"
                );
            }
        }
        Ok(done)
    }

    async fn prune(&self, policy: &PrunePolicy) -> idem_core::Result<u64> {
        self.inner.prune(policy).await
    }

    async fn status(&self) -> idem_core::Result<OutboxStatus> {
        self.inner.status().await
    }

    async fn backlog(&self) -> idem_core::Result<Vec<Backlog>> {
        self.inner.backlog().await
    }

    async fn parked(&self, limit: u32) -> idem_core::Result<Vec<ParkedRow>> {
        self.inner.parked(limit).await
    }

    async fn retry_parked(&self, event_ids: Option<&[EventId]>) -> idem_core::Result<u64> {
        self.inner.retry_parked(event_ids).await
    }
}

async fn release_own_leases(pool: &PgPool, tables: &TableNames, id: &str) -> Result<(), CdcError> {
    let statements = idem_sql::postgres::CdcStatements::shared(tables);
    let released = sqlx::query(&statements.release_drain_leases)
        .bind(id)
        .execute(pool)
        .await
        .map_err(|e| drain_error("ending the leases of the previous session's drain", e))?
        .rows_affected();
    if released > 0 {
        tracing::info!(
            rows = released,
            "publishing again the rows the previous session's drain published but did not mark"
        );
    }
    Ok(())
}

async fn pending_max(
    pool: &PgPool,
    tables: &TableNames,
    confirmed: Option<&str>,
) -> Result<Option<i64>, CdcError> {
    let statements = idem_sql::postgres::CdcStatements::shared(tables);
    sqlx::query_scalar(&statements.pending_max)
        .bind(confirmed)
        .fetch_one(pool)
        .await
        .map_err(|e| drain_error("reading the newest pending outbox row", e))
}

async fn pending_up_to(
    pool: &PgPool,
    tables: &TableNames,
    id: i64,
    confirmed: Option<&str>,
) -> Result<i64, CdcError> {
    let statements = idem_sql::postgres::CdcStatements::shared(tables);
    sqlx::query_scalar(&statements.pending_up_to)
        .bind(id)
        .bind(confirmed)
        .fetch_one(pool)
        .await
        .map_err(|e| drain_error("counting pending outbox rows", e))
}

/// A failed drain statement; an outbox without `written_lsn` needs its migration.
fn drain_error(context: &str, e: sqlx::Error) -> CdcError {
    let undefined_column = e
        .as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "42703");
    if undefined_column {
        return CdcError::NotMigrated {
            context: context.to_owned(),
            missing: "written_lsn",
            source: e,
        };
    }
    CdcError::db(context, e)
}
