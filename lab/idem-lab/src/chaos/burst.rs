//! A burst of events written just before the relays start, in one transaction and with no
//! ANALYZE after it: the outbox's statistics still say it is small (or empty) when the first
//! claims run. A claim whose plan depends on fresh statistics crawls through such a burst
//! (7.6 s per 500-row claim over 20 000 unanalysed rows, 75 to 100 rows/s, in the review that
//! found it); the run measures how fast the burst drains and fails below
//! [`MIN_ROWS_PER_SECOND`].
//!
//! The events are written with plain SQL, as a foreign writer of the outbox contract would,
//! each of an aggregate of its own and of one aggregate type (`burst` in the reference
//! runner; a pipeline file's `[burst]` names it): the relays publish them to that type's
//! topic, which no consumer reads, so the burst loads the relays and nothing downstream.

use std::time::{Duration, Instant};

use idem_sql::AnyPool;
use serde::Serialize;

/// A drain slower than this is a crawl: the claim's cost depends on statistics the burst made
/// stale (normal rates on this kind of machine are several times higher, under faults
/// included; the crawl it guards against ran at 75 to 100 rows/s).
pub(super) const MIN_ROWS_PER_SECOND: f64 = 200.0;

/// A drain timed shorter than this is timed as this long: a burst of at least
/// [`MIN_ROWS`] then passes however its marks fell.
const SHORTEST_DRAIN: Duration = Duration::from_secs(1);

/// The smallest burst worth timing: one whose drain under [`SHORTEST_DRAIN`] still clears
/// [`MIN_ROWS_PER_SECOND`] several times over.
pub(super) const MIN_ROWS: u32 = 1_000;

/// The burst's size for a run of `seconds`: 250 events per second of the run, at least
/// [`MIN_ROWS`] and at most 20 000 (the size at which the crawl was found).
pub(super) fn rows_for(seconds: u64) -> i64 {
    let rows = seconds
        .saturating_mul(250)
        .clamp(u64::from(MIN_ROWS), 20_000);
    i64::try_from(rows).unwrap_or(20_000)
}

/// What the report says of the burst.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub(crate) struct Burst {
    /// Events written before the relays started.
    pub rows: i64,
    /// Seconds from the first of them published to the last (`None`: not all by the end of the
    /// injection).
    pub drained_seconds: Option<f64>,
}

impl Burst {
    /// Rows per second, once drained.
    pub(crate) fn rate(&self) -> Option<f64> {
        let rows = f64::from(u32::try_from(self.rows).unwrap_or(u32::MAX));
        self.drained_seconds
            .map(|s| rows / s.max(SHORTEST_DRAIN.as_secs_f64()))
    }

    /// Why the burst fails the run, if it does.
    pub(crate) fn shortfall(&self) -> Option<String> {
        if self.rows == 0 {
            return None;
        }
        match self.rate() {
            None => Some(format!(
                "the burst of {} events written before the relays started was not published by \
                 the end of the injection",
                self.rows
            )),
            Some(rate) if rate < MIN_ROWS_PER_SECOND => Some(format!(
                "the burst of {} events drained at {rate:.0} rows/s (below {MIN_ROWS_PER_SECOND}): \
                 the claim crawls on a table written after its last ANALYZE",
                self.rows
            )),
            Some(_) => None,
        }
    }
}

const WRITE: &str = "
INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
SELECT gen_random_uuid(), $3, $1 || n, $3 || '.written', jsonb_build_object('n', n)
FROM generate_series(1, $2::bigint) AS n";

/// Writes `rows` events of aggregate type `aggregate_type` and aggregates `<prefix>N` in one
/// transaction.
pub(super) async fn write(
    outbox: &AnyPool,
    aggregate_type: &str,
    prefix: &str,
    rows: i64,
) -> anyhow::Result<()> {
    let AnyPool::Postgres(pool) = outbox else {
        anyhow::bail!("the burst is written with PostgreSQL's SQL");
    };
    sqlx::query(WRITE)
        .bind(prefix)
        .bind(rows)
        .bind(aggregate_type)
        .execute(pool)
        .await?;
    Ok(())
}

/// Where a burst stands: its rows not published yet (pending or parked), and the seconds
/// from the first of its rows marked published to the last (none while none is).
async fn progress(outbox: &AnyPool, watch: &Watch) -> anyhow::Result<(i64, Option<f64>)> {
    let AnyPool::Postgres(pool) = outbox else {
        anyhow::bail!("the burst is read with PostgreSQL's SQL");
    };
    Ok(sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status <> 'published'), \
                extract(epoch FROM max(published_at) - min(published_at))::float8 \
         FROM idem_outbox WHERE aggregate_type = $1 AND starts_with(aggregate_id, $2)",
    )
    .bind(&watch.aggregate_type)
    .bind(&watch.prefix)
    .fetch_one(pool)
    .await?)
}

/// How often the injection loop looks at the burst.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Watches a burst drain until every one of its rows is published. The time it took is the
/// outbox's own: from the first of its rows marked published to the last (`published_at`),
/// whenever the runner looks; a row parked, or still pending, is not drained.
#[derive(Debug)]
pub(super) struct Watch {
    aggregate_type: String,
    /// The prefix of its aggregate ids (it, and no other writer's rows).
    prefix: String,
    /// When it was written.
    written: Instant,
    /// When it was last looked at; `None` once drained.
    checked: Option<Instant>,
    /// What the report says of it.
    pub burst: Burst,
}

impl Watch {
    /// A burst of `rows` events of `aggregate_type` and aggregates `<prefix>N`, written at
    /// `written`.
    pub(super) fn new(aggregate_type: &str, prefix: &str, rows: i64, written: Instant) -> Self {
        Self {
            aggregate_type: aggregate_type.to_owned(),
            prefix: prefix.to_owned(),
            written,
            checked: Some(written),
            burst: Burst {
                rows,
                drained_seconds: None,
            },
        }
    }

    /// Looks at the outbox when a look is due (every [`CHECK_EVERY`]).
    pub(super) async fn tick(&mut self, outbox: &AnyPool, now: Instant) {
        if self
            .checked
            .is_some_and(|checked| now >= checked + CHECK_EVERY)
        {
            self.look(outbox, now).await;
        }
    }

    /// Looks at the outbox once more, due or not, unless the burst drained already: the
    /// faults are over, and a drain the last ticks missed still counts.
    pub(super) async fn finish(&mut self, outbox: &AnyPool) {
        if self.checked.is_some() {
            self.look(outbox, Instant::now()).await;
        }
    }

    /// Whether every row is published, and from the first to the last when they are. A failed
    /// look (the server restarting, say) is skipped: the next one counts.
    async fn look(&mut self, outbox: &AnyPool, now: Instant) {
        self.checked = Some(now);
        let Ok((left, span)) = progress(outbox, self).await else {
            return;
        };
        if left == 0 {
            // No published row left to time (a relay that deletes what it published): the
            // time since the write, an upper bound.
            let since = now.duration_since(self.written).as_secs_f64();
            self.burst.drained_seconds = Some(span.unwrap_or(since));
            self.checked = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_fails_the_run_when_it_crawls_or_never_drains() {
        let burst = |rows, s| Burst {
            rows,
            drained_seconds: s,
        };
        assert_eq!(burst(10_000, Some(10.0)).shortfall(), None);
        let crawl = burst(10_000, Some(100.0)).shortfall().unwrap();
        assert!(crawl.contains("100 rows/s"), "{crawl}");
        assert!(
            burst(1000, None)
                .shortfall()
                .unwrap()
                .contains("not published")
        );
        assert_eq!(burst(0, None).shortfall(), None);
        assert_eq!(
            burst(300, Some(0.2)).rate(),
            Some(300.0),
            "a second at least"
        );
        assert_eq!(rows_for(40), 10_000);
        assert_eq!(rows_for(600), 20_000);
        assert_eq!(rows_for(1), i64::from(MIN_ROWS));
    }

    /// The faults are over and the ticks missed the drain (a quiet period waited through
    /// them): the last look sees it.
    #[tokio::test]
    async fn a_drain_the_ticks_missed_is_seen_by_the_last_look() {
        let db = idem_conformance::pg::TestDb::create().await;
        let store = idem_sql::AnyStore::connect(db.url(), 2, idem_core::TableNames::default())
            .await
            .unwrap();
        store.migrate().await.unwrap();
        let outbox = AnyPool::Postgres(db.pool().clone());
        write(&outbox, "burst", "b-", 1_000).await.unwrap();
        let written = Instant::now();
        let mut watch = Watch::new("burst", "b-", 1_000, written);
        sqlx::query(
            "UPDATE idem_outbox SET status = 'published', published_at = now() \
             WHERE aggregate_type = 'burst'",
        )
        .execute(db.pool())
        .await
        .unwrap();
        watch.tick(&outbox, written).await;
        assert_eq!(watch.burst.drained_seconds, None, "no look was due yet");
        watch.finish(&outbox).await;
        assert!(watch.burst.drained_seconds.is_some(), "{:?}", watch.burst);
        assert_eq!(watch.burst.shortfall(), None);
    }
}
