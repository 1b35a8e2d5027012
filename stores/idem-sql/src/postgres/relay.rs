//! The relay's statements on PostgreSQL: claims with `FOR UPDATE … SKIP LOCKED` and the
//! database's clock, marks as arrays.

use chrono::{DateTime, Utc};
use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::outbox::{
    Backlog, Claim, ClaimOutcome, ClaimRequest, Completed, OutboxRecord, OutboxStatus, PrunePolicy,
    headers_from_json, sort_records,
};
use idem_core::{EventId, Result};
use sqlx::Postgres;
use sqlx::Row;
use sqlx::postgres::PgRow;
use std::sync::atomic::Ordering;
use uuid::Uuid;

use crate::RelayStore;
use crate::dialect::sealed::RelayOps;
use crate::millis;
use crate::relay_store::fenced;

type PgStore = RelayStore<Postgres>;

fn decode_record(row: &PgRow) -> std::result::Result<OutboxRecord, sqlx::Error> {
    let headers_value: serde_json::Value = row.try_get("headers")?;
    Ok(OutboxRecord {
        id: row.try_get("id")?,
        event_id: EventId(row.try_get::<Uuid, _>("event_id")?),
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        aggregate_seq: row.try_get("aggregate_seq")?,
        event_type: row.try_get("event_type")?,
        payload: row.try_get("payload")?,
        headers: headers_from_json(headers_value),
        topic: row.try_get("topic")?,
        traceparent: row.try_get("traceparent")?,
        occurred_at: timestamp(row, "occurred_at")?,
        created_at: timestamp(row, "created_at")?,
        attempt: row.try_get("attempts")?,
        permanent_failures: row.try_get("permanent_failures")?,
    })
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01 UTC).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

/// A `timestamptz` column, decoded without sqlx's chrono decoder: that one panics on values
/// chrono cannot hold ('infinity', '-infinity', years beyond 262143), which a writer of the SQL
/// contract could store before version 6. Such a value is an error, and the row is parked.
fn timestamp(row: &PgRow, column: &str) -> std::result::Result<DateTime<Utc>, sqlx::Error> {
    use sqlx::ValueRef as _;
    use sqlx::postgres::PgValueFormat;
    let bad = |reason: String| sqlx::Error::ColumnDecode {
        index: column.to_owned(),
        source: reason.into(),
    };
    let raw = row.try_get_raw(column)?;
    if raw.is_null() {
        return Err(bad("NULL".to_owned()));
    }
    match raw.format() {
        PgValueFormat::Binary => {
            let bytes = raw.as_bytes().map_err(|e| bad(e.to_string()))?;
            let micros = i64::from_be_bytes(
                bytes
                    .try_into()
                    .map_err(|_| bad(format!("{} bytes, not 8", bytes.len())))?,
            );
            micros
                .checked_add(PG_EPOCH_MICROS)
                .and_then(DateTime::from_timestamp_micros)
                .ok_or_else(|| bad(out_of_range(micros)))
        }
        PgValueFormat::Text => {
            let text = raw.as_str().map_err(|e| bad(e.to_string()))?;
            DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
                .map(|d| d.with_timezone(&Utc))
                .map_err(|e| bad(format!("{text:?}: {e}")))
        }
    }
}

/// Why a `timestamptz` of `micros` (since 2000-01-01) cannot be used.
fn out_of_range(micros: i64) -> String {
    match micros {
        i64::MAX => "'infinity' is not a time an event can have occurred at".to_owned(),
        i64::MIN => "'-infinity' is not a time an event can have occurred at".to_owned(),
        _ => format!("{micros} µs from 2000-01-01 is out of the range a client can hold"),
    }
}

/// Sets the claim's timeout and planner settings for its transaction (claim_guard.sql).
const CLAIM_GUARD: &str = include_str!("../../sql/postgres/claim_guard.sql");
/// Refreshes the outbox's statistics (analyze_outbox.sql).
const ANALYZE_OUTBOX: &str = include_str!("../../sql/postgres/analyze_outbox.sql");

/// SQLSTATE 57014: the statement was cancelled (here: by the claim's `statement_timeout`).
fn cancelled(e: &sqlx::Error) -> bool {
    super::sqlstate(e, "57014")
}

impl PgStore {
    /// `sql` for this store's tables (statements only PostgreSQL has; rendering is a few string
    /// replacements, negligible beside the round trip).
    fn pg_sql(&self, sql: &str) -> String {
        use crate::dialect::sealed::Sealed as _;
        crate::queries::without_comments(&self.outbox.tables.render(sql, Postgres::bases()))
    }

    /// Refreshes the outbox's statistics, best effort: a failure (e.g. the relay's role does
    /// not own the table) is logged, never returned.
    pub(crate) async fn analyze_outbox(&self, why: &str) {
        if let Err(e) = sqlx::query(&self.pg_sql(ANALYZE_OUTBOX))
            .execute(&self.pool)
            .await
        {
            tracing::warn!(error = %e, why, "could not refresh the outbox's statistics (ANALYZE)");
        }
    }

    /// The claim statement in its guarded transaction, window after window (claim.sql), until
    /// the claim is full or the last window reached the end of the pending rows; the leased
    /// rows as returned. A claim that leased fewer rows than it chose (a chosen row was leased by
    /// a claim that committed meanwhile) is rolled back whole and taken again, at most
    /// [`CLAIM_ATTEMPTS`] times; after that it takes nothing, and the relay's next cycle claims.
    async fn claim_rows(&self, request: &ClaimRequest, claim_id: Uuid) -> sqlx::Result<Vec<PgRow>> {
        // A release asks the next claim to walk from the first row; `swap` first, so the
        // request is taken even when the throttle is due too.
        let released = self.walk_again.swap(false, Ordering::Relaxed);
        let from = if released || self.full_scan.due() {
            Walk::FIRST
        } else {
            self.walk_from.load(Ordering::Relaxed)
        };
        for attempt in 1..=CLAIM_ATTEMPTS {
            match self.claim_attempt(request, claim_id, from).await {
                Ok(Some((rows, walk))) => {
                    self.walk_from.store(walk.next_from(), Ordering::Relaxed);
                    return Ok(rows);
                }
                Ok(None) => tracing::debug!(
                    attempt,
                    "a chosen row changed after the claim read it; the claim is taken again"
                ),
                Err(e) => {
                    // The next claim still walks from the first row, as the release asked.
                    self.walk_again.fetch_or(released, Ordering::Relaxed);
                    return Err(e);
                }
            }
        }
        self.walk_again.fetch_or(released, Ordering::Relaxed);
        tracing::warn!(
            attempts = CLAIM_ATTEMPTS,
            "in each attempt a chosen row changed after the claim read it (another relay's \
             lease, mark or park); this claim takes nothing, the next one claims"
        );
        Ok(Vec::new())
    }

    /// One attempt of [`Self::claim_rows`]: the rows and the walk, or none when a window
    /// leased fewer rows than it chose (the transaction is rolled back).
    async fn claim_attempt(
        &self,
        request: &ClaimRequest,
        claim_id: Uuid,
        from: i64,
    ) -> sqlx::Result<Option<(Vec<PgRow>, Walk)>> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(CLAIM_GUARD)
            .bind(
                millis(self.claim_timeout)
                    .min(i64::from(i32::MAX))
                    .to_string(),
            )
            .execute(&mut *tx)
            .await?;
        let batch = i64::from(request.batch_size);
        let mut walk = Walk::start(batch, from);
        let mut rows = Vec::new();
        while let Some(window) = walk.next_window(rows.len()) {
            let got = sqlx::query(&self.q().claim)
                .bind(batch - i64::try_from(rows.len()).unwrap_or(batch))
                .bind(claim_id)
                .bind(&request.relay_id)
                .bind(millis(request.lease))
                .bind(window.after)
                .bind(window.size)
                .fetch_all(&mut *tx)
                .await?;
            let mut extent = Extent::default();
            let (mut chosen, mut leased) = (0_i64, 0_i64);
            for row in got {
                extent = Extent {
                    walked_to: row.try_get("walked_to")?,
                    walked: row.try_get("walked")?,
                    first_left: row.try_get("first_left")?,
                };
                chosen = row.try_get("chosen")?;
                if row.try_get::<Option<i64>, _>("id")?.is_some() {
                    leased += 1;
                    rows.push(row);
                }
            }
            if leased < chosen {
                tx.rollback().await?;
                return Ok(None);
            }
            walk.walked(extent);
        }
        tx.commit().await?;
        Ok(Some((rows, walk)))
    }
}

/// How many times a claim is taken at most when it leased fewer rows than it chose
/// ([`PgStore::claim_rows`]). Each attempt reads what got in the way of the last (another
/// claim's lease, a mark, a park), committed, so the second leaves those rows alone; a third is
/// a burst of such changes.
const CLAIM_ATTEMPTS: usize = 3;

/// The windows one claim walks through `pending_idx` (claim.sql): the first of the batch's
/// size from where the last claim left off, each next one after the last row the previous one
/// saw and twice as large (up to [`Walk::MAX_WINDOW`]), so rows of aggregates that cannot be
/// taken cost an index step each and never hide the others; the walk ends when the claim is
/// full or a window came back short (no pending row after it).
///
/// Where the next claim starts ([`Walk::next_from`]) spares it the index entries of rows
/// published since the last vacuum, which a walk from the first row steps over on every claim
/// (1 000 000 published rows: tens of milliseconds a claim). A row it starts after is one this
/// claim leased, or one that was not pending when it walked: a transaction committing late
/// with a lower id, a row released after a failed publish. The store walks from the first row
/// at least once a second ([`FullScanThrottle`](idem_core::outbox::FullScanThrottle)), after
/// any release, and whenever a claim reached the end of the pending rows, so such a row waits
/// a second at most, and never while the relay is caught up.
#[derive(Debug)]
struct Walk {
    batch: i64,
    next: Option<Window>,
    /// The first row of the walk this claim did not lease.
    first_left: Option<i64>,
    /// The last row the walk saw.
    walked_to: i64,
    /// A window came back short: no pending row after the walk.
    reached_end: bool,
}

/// One window: the `size` oldest pending rows with an id above `after`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Window {
    after: i64,
    size: i64,
}

/// What one window saw (claim.sql's `walk`).
#[derive(Clone, Copy, Debug, Default)]
struct Extent {
    walked_to: Option<i64>,
    walked: i64,
    first_left: Option<i64>,
}

impl Walk {
    /// The largest window, in rows: bounds one statement's work whatever the backlog holds.
    const MAX_WINDOW: i64 = 16_384;
    /// Where a walk from the first row starts: below every id, also the zero and negative ids
    /// a writer could choose before schema version 18.
    const FIRST: i64 = i64::MIN;

    fn start(batch: i64, from: i64) -> Self {
        Walk {
            batch,
            next: Some(Window {
                after: from,
                size: batch.max(1),
            }),
            first_left: None,
            walked_to: from,
            reached_end: false,
        }
    }

    /// The next window to claim from, or none: the claim holds `claimed` rows.
    fn next_window(&self, claimed: usize) -> Option<Window> {
        let claimed = i64::try_from(claimed).unwrap_or(i64::MAX);
        self.next.filter(|_| claimed < self.batch)
    }

    /// What the window just claimed from saw.
    fn walked(&mut self, seen: Extent) {
        self.first_left = self.first_left.or(seen.first_left);
        self.walked_to = seen.walked_to.unwrap_or(self.walked_to);
        self.next = match (self.next, seen.walked_to) {
            (Some(w), Some(last)) if seen.walked >= w.size => Some(Window {
                after: last,
                size: w.size.saturating_mul(2).min(Self::MAX_WINDOW).max(w.size),
            }),
            _ => {
                self.reached_end = true;
                None
            }
        };
    }

    /// Where the next claim starts its walk: before the first row this one did not lease, after
    /// the last it saw when it leased them all, or at the first row once it reached the end.
    fn next_from(&self) -> i64 {
        if self.reached_end {
            return Self::FIRST;
        }
        self.first_left
            .map_or(self.walked_to, |id| id.saturating_sub(1))
    }
}

/// The claimed rows decoded; a row that cannot be decoded is returned as corrupt (to be parked).
fn decode_claimed(claim_id: Uuid, rows: &[PgRow]) -> Result<Claim> {
    let mut records = Vec::with_capacity(rows.len());
    let mut corrupt = vec![];
    for row in rows {
        match decode_record(row) {
            Ok(r) => records.push(r),
            Err(e) => {
                let id: i64 = row
                    .try_get("id")
                    .map_err(|e| crate::dialect::db_error("decoding a claimed row id", e))?;
                corrupt.push((id, format!("the row cannot be decoded: {e}")));
            }
        }
    }
    sort_records(&mut records);
    Ok(Claim {
        claim_id,
        records,
        corrupt,
    })
}

impl RelayOps for Postgres {
    /// PostgreSQL's claim walks its own windows, each after the last (claim.sql, `Walk`), so
    /// the store's window is not used.
    const WINDOWED_CLAIM: bool = false;

    fn claim_within<'a>(
        this: &'a PgStore,
        request: &'a ClaimRequest,
        _window: Option<i64>,
    ) -> BoxFuture<'a, Result<Claim>> {
        async move {
            let claim_id = Uuid::now_v7();
            let rows = match this.claim_rows(request, claim_id).await {
                Ok(rows) => rows,
                Err(e) if cancelled(&e) => {
                    // A plan this slow is built on statistics that no longer describe the
                    // outbox: refresh them so that the next claim is planned anew.
                    this.analyze_outbox("a claim ran past its statement timeout").await;
                    return Err(crate::dialect::db_error(
                        format!(
                            "claiming outbox rows: the claim ran past its timeout of {} ms and was \
                             cancelled; the outbox's statistics were refreshed and the next claim \
                             is planned anew (raise the timeout with RelayStore::with_claim_timeout \
                             if claims are legitimately this slow)",
                            millis(this.claim_timeout)
                        ),
                        e,
                    ));
                }
                Err(e) => return Err(crate::dialect::db_error("claiming outbox rows", e)),
            };
            decode_claimed(claim_id, &rows)
        }
        .boxed()
    }

    fn complete<'a>(
        this: &'a PgStore,
        claim: &'a Claim,
        outcome: &'a ClaimOutcome,
    ) -> BoxFuture<'a, Result<Completed>> {
        async move {
            let f = &outcome.failed;
            // complete.sql: marks published and releases failed rows in one statement.
            let row = sqlx::query(&this.q().mark_published)
                .bind(&outcome.published)
                .bind(claim.claim_id)
                .bind(f.iter().map(|x| x.id).collect::<Vec<_>>())
                .bind(f.iter().map(|x| x.reason.as_str()).collect::<Vec<_>>())
                .bind(f.iter().map(|x| millis(x.backoff)).collect::<Vec<_>>())
                .bind(f.iter().map(|x| x.disposition.parks()).collect::<Vec<_>>())
                .bind(
                    f.iter()
                        .map(|x| x.disposition.attempted())
                        .collect::<Vec<_>>(),
                )
                .bind(
                    f.iter()
                        .map(|x| x.disposition.is_permanent())
                        .collect::<Vec<_>>(),
                )
                .fetch_one(&this.pool)
                .await
                .map_err(|e| crate::dialect::db_error("marking claimed rows", e))?;
            let count = |c: &str| {
                row.try_get::<i64, _>(c)
                    .map(|n| u64::try_from(n).unwrap_or(0))
                    .map_err(|e| crate::dialect::db_error("decoding the marked rows' counts", e))
            };
            let mut done = Completed {
                marked: count("marked")?,
                released: count("released")?,
                ..Completed::default()
            };
            done.fenced = fenced(outcome, done.marked, done.released);
            if done.released > 0 {
                // Released rows lie behind where the next claim would start: the next claim
                // walks from the first row (a claim running beside this mark may still store
                // where it stopped, so the request is a flag of its own).
                this.walk_again.store(true, Ordering::Relaxed);
            }
            Ok(done)
        }
        .boxed()
    }

    fn refresh_statistics(this: &PgStore) -> BoxFuture<'_, ()> {
        this.analyze_outbox("many parked rows were returned to pending")
            .boxed()
    }

    fn prune<'a>(this: &'a PgStore, policy: &'a PrunePolicy) -> BoxFuture<'a, Result<u64>> {
        async move {
            let sql = if policy.archive {
                &this.q().prune_archive
            } else {
                &this.q().prune_delete
            };
            let n = sqlx::query(sql)
                .bind(policy.retention.as_secs_f64())
                .bind(i64::from(policy.batch))
                .execute(&this.pool)
                .await
                .map_err(|e| crate::dialect::db_error("pruning published rows", e))?
                .rows_affected();
            Ok(n)
        }
        .boxed()
    }

    fn status(this: &PgStore) -> BoxFuture<'_, Result<OutboxStatus>> {
        async move {
            let row = sqlx::query(&this.q().status)
                .fetch_one(&this.pool)
                .await
                .map_err(|e| crate::dialect::db_error("counting outbox rows", e))?;
            let get = |c: &str| {
                row.try_get::<i64, _>(c)
                    .map_err(|e| crate::dialect::db_error("decoding status", e))
            };
            Ok(OutboxStatus {
                pending: get("pending")?,
                parked: get("parked")?,
                published: get("published")?,
                oldest_pending_age_seconds: row
                    .try_get("oldest_pending_age")
                    .map_err(|e| crate::dialect::db_error("decoding status", e))?,
            })
        }
        .boxed()
    }

    fn backlog(this: &PgStore) -> BoxFuture<'_, Result<Vec<Backlog>>> {
        async move {
            let rows = sqlx::query(&this.q().backlog)
                .fetch_all(&this.pool)
                .await
                .map_err(|e| crate::dialect::db_error("counting the outbox backlog", e))?;
            rows.iter()
                .map(|r| {
                    Ok(Backlog {
                        aggregate_type: r.try_get("aggregate_type")?,
                        pending: r.try_get("pending")?,
                        parked: r.try_get("parked")?,
                        oldest_pending_age_seconds: r.try_get("oldest_pending_age")?,
                    })
                })
                .collect::<std::result::Result<_, sqlx::Error>>()
                .map_err(|e| crate::dialect::db_error("decoding the outbox backlog", e))
        }
        .boxed()
    }

    fn prune_older<'a>(
        store: &'a PgStore,
        what: idem_core::retention::Prunable,
        window: &'a idem_core::retention::RetentionWindow,
        batch: u32,
    ) -> BoxFuture<'a, Result<u64>> {
        super::retention::prune_older(store, what, window, batch)
    }

    fn prune_counters(store: &PgStore, batch: u32) -> BoxFuture<'_, Result<u64>> {
        super::retention::prune_counters(store, batch).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::{Extent, Walk, Window};

    fn saw(walked_to: i64, walked: i64, first_left: Option<i64>) -> Extent {
        Extent {
            walked_to: Some(walked_to),
            walked,
            first_left,
        }
    }

    #[test]
    fn a_walk_starts_with_a_window_of_the_batch_where_the_last_claim_left_off() {
        let walk = Walk::start(500, 7_000);
        assert_eq!(
            walk.next_window(0),
            Some(Window {
                after: 7_000,
                size: 500
            })
        );
    }

    #[test]
    fn a_full_window_that_left_room_is_followed_by_a_larger_one_after_it() {
        let mut walk = Walk::start(500, 0);
        walk.walked(saw(1_234, 500, Some(3)));
        assert_eq!(
            walk.next_window(20),
            Some(Window {
                after: 1_234,
                size: 1_000
            })
        );
        for _ in 0..10 {
            walk.walked(saw(9_999, Walk::MAX_WINDOW, None));
        }
        assert_eq!(walk.next_window(20).map(|w| w.size), Some(Walk::MAX_WINDOW));
    }

    #[test]
    fn a_walk_ends_when_the_claim_is_full_or_a_window_came_back_short() {
        let mut full = Walk::start(500, 0);
        full.walked(saw(600, 500, None));
        assert_eq!(full.next_window(500), None);

        let mut short = Walk::start(500, 0);
        short.walked(saw(600, 499, Some(17)));
        assert_eq!(short.next_window(20), None);

        let mut empty = Walk::start(500, 0);
        empty.walked(Extent::default());
        assert_eq!(empty.next_window(0), None);
    }

    #[test]
    fn the_next_claim_starts_before_the_first_row_this_one_left() {
        let mut walk = Walk::start(500, 100);
        walk.walked(saw(700, 500, Some(420)));
        walk.walked(saw(1_900, 1_000, Some(800)));
        assert_eq!(walk.next_from(), 419);
    }

    #[test]
    fn the_next_claim_starts_after_a_walk_whose_every_row_was_leased() {
        let mut walk = Walk::start(500, 100);
        walk.walked(saw(700, 500, None));
        assert_eq!(walk.next_window(500), None);
        assert_eq!(walk.next_from(), 700);
    }

    #[test]
    fn the_next_claim_starts_at_the_first_row_once_a_claim_reached_the_end() {
        let mut walk = Walk::start(500, 100);
        walk.walked(saw(700, 500, Some(150)));
        walk.walked(saw(900, 300, Some(800)));
        assert_eq!(walk.next_from(), Walk::FIRST);
        let mut empty = Walk::start(500, 100);
        empty.walked(Extent::default());
        assert_eq!(empty.next_from(), Walk::FIRST);
    }
}
