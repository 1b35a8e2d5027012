//! Pruning of the inbox and of done effect intents, never inside the redelivery horizon
//! ([`idem_core::retention`]).

use chrono::Utc;
use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::Result;
use idem_core::retention::{Prunable, RetentionWindow};

use super::{TS_FORMAT, immediate};
use crate::RelayStore;

pub(super) fn prune_older<'a>(
    store: &'a RelayStore<sqlx::Sqlite>,
    what: Prunable,
    window: &'a RetentionWindow,
    batch: u32,
) -> BoxFuture<'a, Result<u64>> {
    async move {
        let sql = match what {
            Prunable::Inbox => &store.q().inbox_prune,
            Prunable::DoneIntents => &store.q().intent_prune,
        };
        let cutoff = cutoff(window);
        let context = format!("pruning {}", what.describe());
        let mut conn = store.conn(&context).await?;
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
    .boxed()
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
