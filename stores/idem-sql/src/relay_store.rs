//! The relay's view of the outbox ([`idem_core::OutboxStore`]): the struct, written once; the
//! claim and mark statements are per dialect (`postgres/relay.rs`, `sqlite/relay.rs`).

use idem_core::TableNames;
use idem_core::outbox::FullScanThrottle;
use sqlx::Pool;

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
}

impl<DB: Dialect> Clone for RelayStore<DB> {
    fn clone(&self) -> Self {
        RelayStore {
            pool: self.pool.clone(),
            outbox: self.outbox.clone(),
            full_scan: self.full_scan.clone(),
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
        }
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
        self.pool.acquire().await.map_err(|e| {
            idem_core::Error::database(format!("{context}: acquiring a connection"), e)
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_claim_looks_at_four_rows_per_row_of_batch_and_at_least_64() {
        assert_eq!(super::claim_window(1), 64);
        assert_eq!(super::claim_window(100), 400);
        assert_eq!(super::claim_window(u32::MAX), i64::from(u32::MAX));
    }
}
