//! Pruning of the inbox and of done effect intents, never inside the redelivery horizon
//! ([`idem_core::retention`]), and of the outbox's per-aggregate counters when asked.

use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::Result;
use idem_core::retention::{Prunable, RetentionWindow};

use crate::RelayStore;

pub(super) fn prune_older<'a>(
    store: &'a RelayStore<sqlx::Postgres>,
    what: Prunable,
    window: &'a RetentionWindow,
    batch: u32,
) -> BoxFuture<'a, Result<u64>> {
    async move {
        let sql = match what {
            Prunable::Inbox => &store.q().inbox_prune,
            Prunable::DoneIntents => &store.q().intent_prune,
        };
        Ok(sqlx::query(sql)
            .bind(window.older_than().as_secs_f64())
            .bind(i64::from(batch))
            .execute(&store.pool)
            .await
            .map_err(|e| crate::dialect::db_error(format!("pruning {}", what.describe()), e))?
            .rows_affected())
    }
    .boxed()
}

/// Locks counter candidates (`FOR UPDATE SKIP LOCKED`).
const COUNTERS_LOCK: &str = include_str!("../../sql/postgres/counters_lock.sql");
/// Deletes the locked candidates that still have no pending or parked row.
const COUNTERS_PRUNE: &str = include_str!("../../sql/postgres/counters_prune.sql");
/// Each statement of the transaction sees what committed before it.
const READ_COMMITTED: &str = include_str!("../../sql/postgres/read_committed.sql");

/// The two counter statements for `tables`.
fn counter_statements(tables: &idem_core::TableNames) -> (String, String) {
    (
        tables.render(COUNTERS_LOCK, super::BASES),
        tables.render(COUNTERS_PRUNE, super::BASES),
    )
}

/// Deletes up to `batch` counters of aggregates without pending or parked rows. Two statements
/// in one READ COMMITTED transaction: the first locks candidates, skipping counters a writer
/// holds; the second deletes those that still qualify in a snapshot taken after the locks. One
/// statement would not do: its `NOT EXISTS` would use the snapshot from before the lock, so a
/// writer that committed a pending row in between (and released the counter) would lose its
/// counter, and the aggregate's next event would be numbered below that pending row.
pub(super) async fn prune_counters(store: &RelayStore<sqlx::Postgres>, batch: u32) -> Result<u64> {
    let context = "pruning the outbox's per-aggregate counters";
    let err = |e| crate::dialect::db_error(context, e);
    let (lock, prune) = counter_statements(store.outbox.tables());
    let mut tx = store.pool.begin().await.map_err(err)?;
    sqlx::query(READ_COMMITTED)
        .execute(&mut *tx)
        .await
        .map_err(err)?;
    let locked: Vec<(String, String)> = sqlx::query_as(&lock)
        .bind(i64::from(batch))
        .fetch_all(&mut *tx)
        .await
        .map_err(err)?;
    if locked.is_empty() {
        tx.rollback().await.map_err(err)?;
        return Ok(0);
    }
    let (types, ids): (Vec<String>, Vec<String>) = locked.into_iter().unzip();
    let deleted = sqlx::query(&prune)
        .bind(types)
        .bind(ids)
        .execute(&mut *tx)
        .await
        .map_err(err)?
        .rows_affected();
    tx.commit().await.map_err(err)?;
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_counter_statements_are_rendered_for_the_tables() {
        let t = idem_core::TableNames::new(Some("app"), "x_").unwrap();
        let (lock, prune) = super::counter_statements(&t);
        for sql in [&lock, &prune] {
            assert!(sql.contains(r#""app"."x_outbox_aggregates""#), "{sql}");
            assert!(sql.contains(r#""app"."x_outbox" o"#), "{sql}");
            assert!(!sql.contains('{'), "{sql}");
        }
    }
}
