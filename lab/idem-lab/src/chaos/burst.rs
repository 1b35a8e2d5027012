//! A burst of orders written just before the relays start, in one transaction and with no
//! ANALYZE after it: the outbox's statistics still say it is small (or empty) when the first
//! claims run. A claim whose plan depends on fresh statistics crawls through such a burst;
//! the run measures how fast the burst drains and fails below [`MIN_ROWS_PER_SECOND`].
//!
//! The orders are written with plain SQL, as a foreign writer of the outbox contract would:
//! `orders` rows and their `order.paid` events in one statement, the same shape as
//! `idem_reference::PaidOrder` (so every check of the run covers them).

use std::time::Duration;

use idem_sql::AnyPool;
use serde::Serialize;

/// A drain slower than this is a crawl: the claim's cost depends on statistics the burst made
/// stale (normal rates on this kind of machine are ten times higher, under faults included).
pub const MIN_ROWS_PER_SECOND: f64 = 100.0;

/// The burst's size for a run of `seconds`: as many orders as the writers place in that time
/// at 25 per second, at most 3 000.
pub fn rows_for(seconds: u64) -> i64 {
    i64::try_from(seconds.saturating_mul(25).min(3_000)).unwrap_or(3_000)
}

/// What the report says of the burst.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Burst {
    /// Orders written before the relays started.
    pub rows: i64,
    /// How long after the relays started every one of them was published (`None`: not by the
    /// end of the injection).
    pub drained_seconds: Option<f64>,
}

impl Burst {
    /// Rows per second, once drained.
    pub fn rate(&self) -> Option<f64> {
        self.drained_seconds
            .map(|s| f64::from(u32::try_from(self.rows).unwrap_or(u32::MAX)) / s.max(0.001))
    }

    /// Why the burst fails the run, if it does.
    pub fn shortfall(&self) -> Option<String> {
        if self.rows == 0 {
            return None;
        }
        match self.rate() {
            None => Some(format!(
                "the burst of {} orders written before the relays started was not published by \
                 the end of the injection",
                self.rows
            )),
            Some(rate) if rate < MIN_ROWS_PER_SECOND => Some(format!(
                "the burst of {} orders drained at {rate:.0} rows/s (below {MIN_ROWS_PER_SECOND}): \
                 the claim crawls on a table written after its last ANALYZE",
                self.rows
            )),
            Some(_) => None,
        }
    }
}

const WRITE: &str = "
WITH o AS (
    INSERT INTO orders (order_id, payment_id, amount_minor, currency)
    SELECT $1 || 'order-' || n, $1 || 'pay-' || n, 100 + n % 9900, 'EUR'
    FROM generate_series(1, $2::bigint) AS n
    RETURNING order_id, payment_id, amount_minor, currency
)
INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
SELECT gen_random_uuid(), 'order', order_id, 'order.paid',
       jsonb_build_object('order_id', order_id, 'payment_id', payment_id,
           'amount', (amount_minor / 100) || '.' || lpad((amount_minor % 100)::text, 2, '0'),
           'currency', currency)
FROM o";

/// Writes `rows` orders named `<prefix>order-N` and their events in one transaction.
pub async fn write(orders: &AnyPool, prefix: &str, rows: i64) -> anyhow::Result<()> {
    let AnyPool::Postgres(pool) = orders else {
        anyhow::bail!("the burst is written with PostgreSQL's SQL");
    };
    sqlx::query(WRITE)
        .bind(prefix)
        .bind(rows)
        .execute(pool)
        .await?;
    Ok(())
}

/// Whether every order of the burst has been published.
pub async fn drained(orders: &AnyPool, prefix: &str) -> anyhow::Result<bool> {
    let AnyPool::Postgres(pool) = orders else {
        anyhow::bail!("the burst is read with PostgreSQL's SQL");
    };
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idem_outbox WHERE status = 'pending' AND aggregate_id LIKE $1",
    )
    .bind(format!("{prefix}order-%"))
    .fetch_one(pool)
    .await?;
    Ok(left == 0)
}

/// How often the injection loop looks at the burst.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_fails_the_run_when_it_crawls_or_never_drains() {
        let burst = |rows, s| Burst {
            rows,
            drained_seconds: s,
        };
        assert_eq!(burst(1000, Some(2.0)).shortfall(), None);
        let crawl = burst(1000, Some(20.0)).shortfall().unwrap();
        assert!(crawl.contains("50 rows/s"), "{crawl}");
        assert!(
            burst(1000, None)
                .shortfall()
                .unwrap()
                .contains("not published")
        );
        assert_eq!(burst(0, None).shortfall(), None);
        assert_eq!(rows_for(40), 1000);
        assert_eq!(rows_for(600), 3000);
    }
}
