//! Pruning of the inbox and of done effect intents, never inside the redelivery horizon
//! ([`idem_core::retention`]).

use chrono::Utc;
use idem_core::Result;
use idem_core::retention::{Prunable, RetentionStore, RetentionWindow};

use super::{TS_FORMAT, immediate};
use crate::RelayStore;

impl RetentionStore for RelayStore<sqlx::Sqlite> {
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
        let cutoff = cutoff(window);
        let context = format!("pruning {}", what.describe());
        let mut conn = self.conn(&context).await?;
        immediate(&mut conn, &context, async |c| {
            Ok(sqlx::query(sql)
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
