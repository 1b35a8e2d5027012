//! Pruning of the inbox and of done effect intents, never inside the redelivery horizon
//! ([`idem_core::retention`]). The outbox's per-aggregate counters are never pruned.

use idem_core::retention::RetentionWindow;
use idem_core::{Error, Result};

use crate::{BASES, PgStore};

impl PgStore {
    /// Deletes up to `batch` processed inbox rows (every consumer group) processed and last
    /// delivered longer than `window` ago; returns how many. Dead-lettered rows stay.
    pub async fn prune_inbox(&self, window: &RetentionWindow, batch: u32) -> Result<u64> {
        self.prune_with(
            include_str!("../sql/inbox_prune.sql"),
            window,
            batch,
            "pruning the inbox",
        )
        .await
    }

    /// Deletes up to `batch` done effect intents finished longer than `window` ago; returns how
    /// many. Pending, parked and unknown intents stay.
    pub async fn prune_intents(&self, window: &RetentionWindow, batch: u32) -> Result<u64> {
        self.prune_with(
            include_str!("../sql/intent_prune.sql"),
            window,
            batch,
            "pruning done effect intents",
        )
        .await
    }

    async fn prune_with(
        &self,
        sql: &str,
        window: &RetentionWindow,
        batch: u32,
        context: &str,
    ) -> Result<u64> {
        let sql = self.outbox.tables.render(sql, BASES);
        let secs = window.older_than().as_secs_f64();
        Ok(sqlx::query(&sql)
            .bind(secs)
            .bind(i64::from(batch))
            .execute(&self.pool)
            .await
            .map_err(|e| Error::database(context, e))?
            .rows_affected())
    }
}
