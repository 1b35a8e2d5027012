//! The relay's view of the outbox ([`idem_core::store::OutboxStore`]), written once; the claim, mark,
//! prune and status statements whose flow differs are the dialect's (`postgres/relay.rs`,
//! `sqlite/relay.rs`).

use idem_core::outbox::{
    Backlog, Claim, ClaimOutcome, ClaimRequest, Completed, FullScanThrottle, OutboxStatus,
    ParkedRow, PrunePolicy,
};
use idem_core::retention::{Prunable, RetentionStore, RetentionWindow};
use idem_core::store::OutboxStore;
use idem_core::{Error, EventId, Result, TableNames};
use sqlx::Pool;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64};
use std::time::Duration;

use crate::dialect::{Stmt, get};
use crate::{Dialect, Outbox};

/// How many of the oldest pending rows a claim looks at, per row of batch size.
pub(crate) const CLAIM_WINDOW_FACTOR: u32 = 4;

/// The window of a claim of `batch_size` rows: the oldest pending rows it looks at first.
pub(crate) fn claim_window(batch_size: u32) -> i64 {
    i64::from(batch_size.saturating_mul(CLAIM_WINDOW_FACTOR).max(64))
}

/// The relay's store: claims, marks, prunes and reports on the outbox in database `DB`.
#[derive(Debug)]
pub struct RelayStore<DB: Dialect> {
    pub(crate) pool: Pool<DB>,
    pub(crate) outbox: Outbox<DB>,
    pub(crate) full_scan: FullScanThrottle,
    /// Where PostgreSQL's next claim starts its walk of the pending rows (`postgres/relay.rs`,
    /// `Walk`); shared by the store's clones.
    pub(crate) walk_from: Arc<AtomicI64>,
    /// Set by a mark that released rows: the next claim walks from the first row.
    pub(crate) walk_again: Arc<AtomicBool>,
    pub(crate) claim_timeout: Duration,
}

/// How long a claim may run before the database cancels it ([`RelayStore::with_claim_timeout`]).
pub const DEFAULT_CLAIM_TIMEOUT: Duration = Duration::from_secs(10);

/// How many parked rows returned to pending at once make the store refresh the outbox's
/// statistics (a plan built while they were parked could walk them all once per claim).
const MASS_RETRY: u64 = 1_000;

impl<DB: Dialect> Clone for RelayStore<DB> {
    fn clone(&self) -> Self {
        RelayStore {
            pool: self.pool.clone(),
            outbox: self.outbox.clone(),
            full_scan: self.full_scan.clone(),
            walk_from: self.walk_from.clone(),
            walk_again: self.walk_again.clone(),
            claim_timeout: self.claim_timeout,
        }
    }
}

impl<DB: Dialect> RelayStore<DB> {
    /// A store over `pool` with the given tables.
    pub fn new(pool: Pool<DB>, tables: TableNames) -> Self {
        RelayStore {
            pool,
            outbox: Outbox::new(tables),
            full_scan: FullScanThrottle::default(),
            walk_from: Arc::new(AtomicI64::new(i64::MIN)),
            walk_again: Arc::new(AtomicBool::new(false)),
            claim_timeout: DEFAULT_CLAIM_TIMEOUT,
        }
    }

    /// Bounds each statement of a claim to `timeout` (PostgreSQL's `statement_timeout`, set for
    /// the claim's transaction only; default [`DEFAULT_CLAIM_TIMEOUT`], zero: unbounded). A claim cancelled
    /// this way is an error the relay logs and retries, and the store refreshes the outbox's
    /// statistics first, so a plan built on stale statistics cannot stall the relay silently.
    /// SQLite's claim is not bounded.
    #[must_use]
    pub fn with_claim_timeout(mut self, timeout: Duration) -> Self {
        self.claim_timeout = timeout;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The enqueue handle for the same tables.
    pub fn outbox(&self) -> &Outbox<DB> {
        &self.outbox
    }

    pub(crate) fn q(&self) -> &crate::queries::Queries {
        &self.outbox.queries
    }

    pub(crate) async fn conn(
        &self,
        context: &str,
    ) -> idem_core::Result<sqlx::pool::PoolConnection<DB>> {
        self.pool
            .acquire()
            .await
            .map_err(|e| crate::dialect::db_error(format!("{context}: acquiring a connection"), e))
    }
}

impl<DB: Dialect> RelayStore<DB> {
    /// [`idem_core::store::OutboxStore::parked`], for both dialects: a row whose columns cannot be
    /// read is reported as corrupt.
    async fn parked_rows(&self, limit: u32) -> Result<Vec<ParkedRow>> {
        let context = "listing parked rows";
        let mut c = self
            .pool
            .acquire()
            .await
            .map_err(|e| crate::dialect::db_error(context, e))?;
        let rows = Stmt::<DB>::new(&self.q().parked)
            .bind(i64::from(limit))
            .fetch_all(&mut c)
            .await
            .map_err(|e| crate::dialect::db_error(context, e))?;
        rows.iter().map(parked_row::<DB>).collect()
    }

    /// [`idem_core::store::OutboxStore::retry_parked`], for both dialects.
    async fn retry_parked_rows(&self, event_ids: Option<&[EventId]>) -> Result<u64> {
        let context = "retrying parked rows";
        let mut conn = self.conn(context).await?;
        let mut w = DB::begin_write(&mut conn).await.map_err(|e| {
            crate::dialect::db_error(format!("{context}: starting a write transaction"), e)
        })?;
        let q = self.q();
        let n = DB::for_event_ids(w.conn(), &q.retry_parked, &q.retry_parked_one, event_ids).await;
        let n = w.finish(n, context).await?;
        drop(conn);
        if n >= MASS_RETRY {
            DB::refresh_statistics(self).await;
        }
        Ok(n)
    }
}

fn parked_row<DB: Dialect>(r: &DB::Row) -> Result<ParkedRow> {
    let id: i64 =
        get::<DB, _>(r, "id").map_err(|e| crate::dialect::db_error("decoding parked rows", e))?;
    let dec = |e: sqlx::Error| Error::CorruptRow {
        id,
        reason: e.to_string(),
    };
    Ok(ParkedRow {
        id,
        event_id: DB::get_event_id(r, "event_id").map_err(dec)??,
        aggregate_type: get::<DB, _>(r, "aggregate_type").map_err(dec)?,
        aggregate_id: get::<DB, _>(r, "aggregate_id").map_err(dec)?,
        event_type: get::<DB, _>(r, "event_type").map_err(dec)?,
        attempts: get::<DB, _>(r, "attempts").map_err(dec)?,
        last_error: get::<DB, _>(r, "last_error").map_err(dec)?,
    })
}

impl<DB: Dialect> OutboxStore for RelayStore<DB> {
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim> {
        let window = claim_window(request.batch_size);
        let claim = DB::claim_within(self, request, Some(window)).await?;
        // The oldest rows may all sit behind leased or backing-off heads (one aggregate with a
        // deep backlog): then look at every pending row, so other aggregates never starve.
        if DB::WINDOWED_CLAIM
            && claim.records.is_empty()
            && claim.corrupt.is_empty()
            && self.full_scan.due()
        {
            return DB::claim_within(self, request, None).await;
        }
        Ok(claim)
    }

    async fn complete(&self, claim: &Claim, outcome: &ClaimOutcome) -> Result<Completed> {
        DB::complete(self, claim, outcome).await
    }

    async fn prune(&self, policy: &PrunePolicy) -> Result<u64> {
        DB::prune(self, policy).await
    }

    async fn status(&self) -> Result<OutboxStatus> {
        DB::status(self).await
    }

    async fn backlog(&self) -> Result<Vec<Backlog>> {
        DB::backlog(self).await
    }

    async fn parked(&self, limit: u32) -> Result<Vec<ParkedRow>> {
        self.parked_rows(limit).await
    }

    async fn retry_parked(&self, event_ids: Option<&[EventId]>) -> Result<u64> {
        self.retry_parked_rows(event_ids).await
    }
}

/// Pruning of the inbox and of done effect intents, never inside the redelivery horizon
/// ([`idem_core::retention`]), and, when asked, of the outbox's per-aggregate counters.
impl<DB: Dialect> RetentionStore for RelayStore<DB> {
    async fn prune_older(
        &self,
        what: Prunable,
        window: &RetentionWindow,
        batch: u32,
    ) -> Result<u64> {
        DB::prune_older(self, what, window, batch).await
    }

    async fn prune_aggregate_counters(&self, batch: u32) -> Result<u64> {
        DB::prune_counters(self, batch).await
    }
}

/// How many marks a stale claim lost: rows neither marked nor released.
pub(crate) fn fenced(outcome: &idem_core::outbox::ClaimOutcome, marked: u64, released: u64) -> u64 {
    let expected =
        u64::try_from(outcome.published.len() + outcome.failed.len()).unwrap_or(u64::MAX);
    expected.saturating_sub(marked + released)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_claim_looks_at_four_rows_per_row_of_batch_and_at_least_64() {
        assert_eq!(super::claim_window(1), 64);
        assert_eq!(super::claim_window(100), 400);
        assert_eq!(super::claim_window(u32::MAX), i64::from(u32::MAX));
    }

    #[test]
    fn rows_neither_marked_nor_released_were_fenced() {
        let outcome = idem_core::outbox::ClaimOutcome {
            published: vec![1, 2, 3],
            failed: vec![],
        };
        assert_eq!(super::fenced(&outcome, 2, 0), 1);
        assert_eq!(super::fenced(&outcome, 3, 0), 0);
        assert_eq!(super::fenced(&outcome, 4, 0), 0);
    }
}
