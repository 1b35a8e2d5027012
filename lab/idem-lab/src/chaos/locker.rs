//! A lock held on the outbox's pending rows while the relays mark them, then the sessions
//! waiting on it terminated, as an operator ending blocked sessions does: the marks in flight
//! fail (the polling relay's lease runs out and the rows are published again; the CDC relay
//! marks again or ends its session), and the inboxes absorb the copies.

use std::time::Duration;

use idem_sql::AnyPool;

/// What one lock did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Locked {
    /// Pending rows locked.
    pub rows: i64,
    /// Sessions that waited on the lock and were terminated.
    pub terminated: i64,
}

/// Locks the pending rows for `hold`, then terminates every session waiting on the lock and
/// releases it.
pub(super) async fn lock_pending(orders: &AnyPool, hold: Duration) -> anyhow::Result<Locked> {
    let AnyPool::Postgres(pool) = orders else {
        anyhow::bail!("the outbox is locked with PostgreSQL's SQL");
    };
    let mut tx = pool.begin().await?;
    let rows: i64 = sqlx::query_scalar(
        "WITH l AS (SELECT id FROM idem_outbox WHERE status = 'pending' FOR UPDATE) \
         SELECT count(*) FROM l",
    )
    .fetch_one(&mut *tx)
    .await?;
    tokio::time::sleep(hold).await;
    let terminated: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE pg_backend_pid() = ANY (pg_blocking_pids(pid))",
    )
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Locked { rows, terminated })
}
