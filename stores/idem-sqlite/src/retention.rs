//! Pruning of the inbox and of done effect intents, never inside the redelivery horizon
//! ([`idem_core::retention`]).

use chrono::Utc;
use idem_core::Result;
use idem_core::retention::{Prunable, RetentionStore, RetentionWindow};

use crate::{BASES, SqliteStore, TS_FORMAT, immediate};

impl RetentionStore for SqliteStore {
    async fn prune_older(
        &self,
        what: Prunable,
        window: &RetentionWindow,
        batch: u32,
    ) -> Result<u64> {
        let sql = match what {
            Prunable::Inbox => include_str!("../sql/inbox_prune.sql"),
            Prunable::DoneIntents => include_str!("../sql/intent_prune.sql"),
        };
        let sql = self.outbox.tables.render(sql, BASES);
        let cutoff = cutoff(window);
        let context = format!("pruning {}", what.describe());
        let mut conn = self.conn(&context).await?;
        immediate(&mut conn, &context, async |c| {
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
