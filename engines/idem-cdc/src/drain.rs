//! Table mode: the rows the stream will never carry. A slot streams only what commits after it
//! was created, and an `UPDATE` never (the publication is insert-only), so at the start of
//! every session the rows pending in the table are published first, with the polling relay's
//! claim → publish → mark cycle:
//!
//! - rows committed before the slot existed (a first start on an outbox that already had rows,
//!   a switch from the polling relay): without this they would stay pending forever;
//! - rows `idem outbox retry` returned to pending (parked, then retried);
//! - rows published by an earlier session whose mark was lost, or not yet confirmed: published
//!   again, and streamed again if they were committed after the slot's position — copies with
//!   the same `ce_id`, absorbed by the consumer's inbox.
//!
//! Only the rows pending when the drain starts are waited for (up to the newest pending id
//! then), so live writers cannot keep it going; each aggregate's rows go out in commit order,
//! and the stream that follows sends nothing older than what the drain sent. A crash during
//! the drain leaves the rest pending, and the next session drains them.

use std::sync::Arc;
use std::time::Duration;

use idem_core::TableNames;
use idem_core::publish::Publisher;
use idem_relay::{Relay, RelayConfig, RelayMetrics};
use sqlx::{PgPool, Postgres};

use crate::error::CdcError;
use crate::relay::CdcConfig;

/// Publishes every row pending now; how many were published.
pub async fn drain<P: Publisher>(
    pool: &PgPool,
    tables: &TableNames,
    publisher: Arc<P>,
    config: &CdcConfig,
) -> Result<u64, CdcError> {
    let Some(newest) = pending_max(pool, tables).await? else {
        return Ok(0);
    };
    let lease = publisher
        .longest_publish()
        .map_or(Duration::from_secs(60), |p| {
            p.saturating_mul(2) + Duration::from_secs(10)
        });
    let relay_config = RelayConfig {
        relay_id: format!("cdc-drain-{}", idem_relay::default_relay_id()),
        lease,
        topics: config.naming.clone(),
        source: config.source.clone(),
        prune: None,
        ..RelayConfig::default()
    };
    let metrics = RelayMetrics::unregistered()?;
    let store = idem_sql::RelayStore::<Postgres>::new(pool.clone(), tables.clone());
    let relay = Relay::new(store, publisher, relay_config, metrics);
    let mut published = 0;
    while pending_up_to(pool, tables, newest).await? > 0 {
        let report = relay.run_once().await?;
        published += report.published;
        if report.claimed == 0 {
            // What is left backs off after a failure, or is leased to another relay.
            tokio::time::sleep(config.poll).await;
        }
    }
    Ok(published)
}

async fn pending_max(pool: &PgPool, tables: &TableNames) -> Result<Option<i64>, CdcError> {
    let sql = tables.render(include_str!("../sql/pending_max.sql"), &["outbox"]);
    sqlx::query_scalar(&sql)
        .fetch_one(pool)
        .await
        .map_err(|e| CdcError::db("reading the newest pending outbox row", e))
}

async fn pending_up_to(pool: &PgPool, tables: &TableNames, id: i64) -> Result<i64, CdcError> {
    let sql = tables.render(include_str!("../sql/pending_up_to.sql"), &["outbox"]);
    sqlx::query_scalar(&sql)
        .bind(id)
        .fetch_one(pool)
        .await
        .map_err(|e| CdcError::db("counting pending outbox rows", e))
}
