//! Pruning of the inbox and of done effect intents, never inside the redelivery horizon
//! ([`idem_core::retention`]).

use chrono::Utc;
use idem_core::Result;
use idem_core::retention::RetentionWindow;

use crate::{BASES, SqliteStore, TS_FORMAT, immediate};

impl SqliteStore {
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
        let cutoff = cutoff(window);
        let mut conn = self.conn(context).await?;
        immediate(&mut conn, context, async |c| {
            Ok(sqlx::query(&sql)
                .bind(&cutoff)
                .bind(i64::from(batch))
                .execute(&mut *c)
                .await?
                .rows_affected())
        })
        .await
    }
}

/// The timestamp `window` ago, in the columns' text format; a window beyond chrono's range is
/// the earliest time, so nothing is pruned.
fn cutoff(window: &RetentionWindow) -> String {
    let earliest = chrono::DateTime::<Utc>::MIN_UTC;
    chrono::Duration::from_std(window.older_than())
        .ok()
        .and_then(|d| Utc::now().checked_sub_signed(d))
        .unwrap_or(earliest)
        .format(TS_FORMAT)
        .to_string()
}
