//! Pruning of the inbox and of done effect intents, never inside the redelivery horizon
//! ([`idem_core::retention`]). The outbox's per-aggregate counters are never pruned.

use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::retention::{Prunable, RetentionWindow};
use idem_core::{Error, Result};

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
            .map_err(|e| Error::database(format!("pruning {}", what.describe()), e))?
            .rows_affected())
    }
    .boxed()
}
