//! Pruning of the inbox and of done effect intents, never inside the redelivery horizon
//! ([`idem_core::retention`]). The outbox's per-aggregate counters are never pruned.

use idem_core::retention::{Prunable, RetentionStore, RetentionWindow};
use idem_core::{Error, Result};

use crate::RelayStore;

impl RetentionStore for RelayStore<sqlx::Postgres> {
    async fn prune_older(
        &self,
        what: Prunable,
        window: &RetentionWindow,
        batch: u32,
    ) -> Result<u64> {
        let sql = match what {
            Prunable::Inbox => &self.q().inbox_prune,
            Prunable::DoneIntents => &self.q().intent_prune,
        };
        Ok(sqlx::query(sql)
            .bind(window.older_than().as_secs_f64())
            .bind(i64::from(batch))
            .execute(&self.pool)
            .await
            .map_err(|e| Error::database(format!("pruning {}", what.describe()), e))?
            .rows_affected())
    }
}
