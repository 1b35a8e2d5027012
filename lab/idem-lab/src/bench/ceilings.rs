//! The hardware's ceilings: the leanest SQL the bench knows for the same work as each system
//! phase, on the same server, tables, constraints and backlog shape. The statements are the
//! bench's own (`sql/`), never idem's store methods, so a ceiling moves with the machine and
//! the schema, not with idem's code.
//!
//! * consumer: one transaction per batch, a set-based inbox insert and a set-based settlement
//!   insert (plus the application rows when the reference schema has the table), arrays bound
//!   from the client as sqlx binds them;
//! * relay: one autocommit statement that locks the batch's oldest pending rows (`FOR UPDATE
//!   SKIP LOCKED`) and marks them published, until the backlog is empty;
//! * CDC decode: a temporary pgoutput slot created before a backlog of the same shape, then
//!   everything it holds decoded by the server and returned in one statement;
//! * round trip: `SELECT 1` on one connection.
//!
//! Only the SQL is timed: building a batch's arrays is the bench's work.

use std::time::{Duration, Instant};

use anyhow::Context;
use idem_core::wire;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};

const CONSUMER_INBOX: &str = include_str!("sql/consumer_inbox.sql");
const CONSUMER_SETTLE: &str = include_str!("sql/consumer_settle.sql");
const CONSUMER_APPLICATIONS: &str = include_str!("sql/consumer_applications.sql");
const HAS_APPLICATIONS: &str = include_str!("sql/has_applications.sql");
const RELAY_CLAIM_MARK: &str = include_str!("sql/relay_claim_mark.sql");
const ROUND_TRIP: &str = include_str!("sql/round_trip.sql");
const DECODE_CREATE: &str = include_str!("sql/decode_create.sql");
const DECODE_READ: &str = include_str!("sql/decode_read.sql");
const TERMINATE_OTHERS: &str = include_str!("sql/terminate_others.sql");
const CHECKPOINT: &str = include_str!("sql/checkpoint.sql");
const TRUNCATE_CONSUMER: &str = include_str!("sql/truncate_consumer.sql");
const TRUNCATE_APPLICATIONS: &str = include_str!("sql/truncate_applications.sql");

/// The `application_name` of the bench's own sessions (the children's are never this).
pub(super) const APPLICATION: &str = "idem-bench";

/// The bench's connection options for `url`, read as idem reads it (`idem_sql::postgres::PgUrl`: the
/// same `sslmode`, root and client certificates as the system's pools), with its application
/// name and no statement logging.
pub(super) fn options(url: &str) -> anyhow::Result<PgConnectOptions> {
    Ok(idem_sql::postgres::PgUrl::parse(url)?
        .connect_options()
        .context("reading a bench database URL")?
        .application_name(APPLICATION)
        .disable_statement_logging())
}

/// One dedicated connection (no pool: no liveness ping before each transaction).
pub(super) async fn connect(url: &str) -> anyhow::Result<PgConnection> {
    Ok(PgConnection::connect_with(&options(url)?).await?)
}

/// Microseconds per `SELECT 1` on one connection, over `duration`.
pub(super) async fn round_trip_us(url: &str, duration: Duration) -> anyhow::Result<f64> {
    let mut conn = connect(url).await?;
    // The first statement prepares it: not a round trip of the steady state.
    sqlx::query(ROUND_TRIP).execute(&mut conn).await?;
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < duration {
        sqlx::query(ROUND_TRIP).execute(&mut conn).await?;
        n += 1;
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / crate::num::float(n.max(1));
    conn.close().await?;
    Ok(us)
}

/// One batch's columns, as a consumer would bind them.
#[derive(Debug, Default, PartialEq)]
pub(super) struct ConsumerBatch {
    event_ids: Vec<uuid::Uuid>,
    aggregate_ids: Vec<String>,
    hashes: Vec<String>,
    payment_ids: Vec<String>,
    amounts: Vec<i64>,
}

impl ConsumerBatch {
    /// Paid orders `<prefix>order-N` for N in `first..first + count`, each with a new event id
    /// and its payload's hash (the payload's exact bytes do not matter to the SQL, its hash's
    /// width does).
    pub(super) fn numbered(prefix: &str, first: u64, count: usize) -> Self {
        let mut b = ConsumerBatch::default();
        for n in first..first + count as u64 {
            let order = idem_reference::PaidOrder::numbered(prefix, n);
            b.event_ids.push(uuid::Uuid::now_v7());
            b.hashes
                .push(wire::payload_hash(order.payment_id.as_bytes()));
            b.aggregate_ids.push(order.order_id);
            b.payment_ids.push(order.payment_id);
            b.amounts.push(order.amount_minor);
        }
        b
    }

    fn len(&self) -> usize {
        self.event_ids.len()
    }
}

/// The consumer's work for one batch in one transaction on `conn`: inbox rows of `group`,
/// settlements and, `with_applications`, their application rows.
async fn consumer_tx(
    conn: &mut PgConnection,
    group: &str,
    b: &ConsumerBatch,
    with_applications: bool,
) -> anyhow::Result<()> {
    let n = b.len();
    let mut tx = conn.begin().await?;
    sqlx::query(CONSUMER_INBOX)
        .bind(group)
        .bind(&b.event_ids)
        .bind(vec![idem_reference::ORDER_PAID; n])
        .bind(vec![idem_reference::ORDER; n])
        .bind(&b.aggregate_ids)
        .bind(&b.hashes)
        .bind(vec![1i32; n])
        .fetch_all(&mut *tx)
        .await
        .context("ceiling: inbox insert")?;
    sqlx::query(CONSUMER_SETTLE)
        .bind(&b.payment_ids)
        .bind(&b.aggregate_ids)
        .bind(&b.amounts)
        .bind(vec!["EUR"; n])
        .bind(&b.event_ids)
        .fetch_all(&mut *tx)
        .await
        .context("ceiling: settlement insert")?;
    if with_applications {
        sqlx::query(CONSUMER_APPLICATIONS)
            .bind(&b.event_ids)
            .bind(&b.payment_ids)
            .execute(&mut *tx)
            .await
            .context("ceiling: application rows")?;
    }
    tx.commit().await?;
    Ok(())
}

/// Empties the tables the consumer's ceiling writes on the database of `url`.
pub(super) async fn reset_consumer_tables(url: &str) -> anyhow::Result<()> {
    let mut conn = connect(url).await?;
    sqlx::query(TRUNCATE_CONSUMER).execute(&mut conn).await?;
    let with_applications: bool = sqlx::query_scalar(HAS_APPLICATIONS)
        .fetch_one(&mut conn)
        .await?;
    if with_applications {
        sqlx::query(TRUNCATE_APPLICATIONS)
            .execute(&mut conn)
            .await?;
    }
    conn.close().await?;
    Ok(())
}

/// The consumer's ceiling: events per second of [`consumer_tx`] at `batch` events per
/// transaction on `connections` connections at once (each its own events), for `duration`.
/// Each connection's rate counts its SQL time only; the result is their sum.
pub(super) async fn consumer_rate(
    url: &str,
    connections: u32,
    batch: usize,
    duration: Duration,
    prefix: &str,
) -> anyhow::Result<f64> {
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..connections.max(1) {
        let (url, prefix) = (url.to_owned(), format!("{prefix}c{c}-"));
        tasks.spawn(async move { consumer_connection(&url, batch, duration, &prefix).await });
    }
    let mut total = 0.0;
    while let Some(r) = tasks.join_next().await {
        total += r??;
    }
    Ok(total)
}

async fn consumer_connection(
    url: &str,
    batch: usize,
    duration: Duration,
    prefix: &str,
) -> anyhow::Result<f64> {
    let mut conn = connect(url).await?;
    let with_applications: bool = sqlx::query_scalar(HAS_APPLICATIONS)
        .fetch_one(&mut conn)
        .await?;
    let group = format!("{prefix}group");
    let batch = batch.max(1);
    let start = Instant::now();
    let (mut sql_time, mut done) = (Duration::ZERO, 0u64);
    while start.elapsed() < duration {
        let b = ConsumerBatch::numbered(prefix, done + 1, batch);
        let t0 = Instant::now();
        consumer_tx(&mut conn, &group, &b, with_applications).await?;
        sql_time += t0.elapsed();
        done += batch as u64;
    }
    conn.close().await?;
    Ok(super::plan::rate(done, sql_time))
}

/// The relay's ceiling: rows per second of the lean claim-and-mark at `batch` rows per
/// statement on one connection, until no pending row is left. Returns the rows and the rate.
pub(super) async fn relay_rate(
    url: &str,
    batch: u32,
    mut progress: impl FnMut(u64),
) -> anyhow::Result<(u64, f64)> {
    let mut conn = connect(url).await?;
    let limit = i64::from(batch.max(1));
    let start = Instant::now();
    let mut rows = 0u64;
    loop {
        let got = sqlx::query(RELAY_CLAIM_MARK)
            .bind(limit)
            .fetch_all(&mut conn)
            .await
            .context("ceiling: claim-and-mark")?;
        if got.is_empty() {
            break;
        }
        rows += got.len() as u64;
        progress(rows);
    }
    let rate = super::plan::rate(rows, start.elapsed());
    conn.close().await?;
    Ok((rows, rate))
}

/// The CDC relay's decode ceiling: rows per second the server decodes with pgoutput. A
/// temporary slot on a connection of its own, then `fill` writes `rows` rows, then one
/// statement reads (and consumes) everything the slot holds; only that statement is timed.
pub(super) async fn decode_rate(
    url: &str,
    slot: &str,
    publication: &str,
    rows: u64,
    fill: impl AsyncFnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    let mut conn = connect(url).await?;
    let create =
        format!("CREATE PUBLICATION {publication} FOR TABLE idem_outbox WITH (publish = 'insert')");
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(publication)
            .fetch_one(&mut conn)
            .await?;
    if !exists {
        sqlx::query(&create).execute(&mut conn).await?;
    }
    sqlx::query(DECODE_CREATE)
        .bind(slot)
        .fetch_one(&mut conn)
        .await
        .context("ceiling: creating the decode slot")?;
    fill().await?;
    let start = Instant::now();
    let _: i64 = sqlx::query_scalar(DECODE_READ)
        .bind(slot)
        .bind(publication)
        .fetch_one(&mut conn)
        .await
        .context("ceiling: decoding the slot")?;
    let rate = super::plan::rate(rows, start.elapsed());
    // The temporary slot goes with the session.
    conn.close().await?;
    Ok(rate)
}

/// Ends every session on the database of `url` that is not the bench's own: what a stuck
/// child left behind after it was killed. Returns how many were ended.
pub(super) async fn terminate_others(url: &str) -> anyhow::Result<i64> {
    let mut conn = connect(url).await?;
    let n: i64 = sqlx::query_scalar(TERMINATE_OTHERS)
        .fetch_one(&mut conn)
        .await?;
    conn.close().await?;
    Ok(n)
}

/// Runs a checkpoint on the server of `url` (checkpoint.sql), best effort: a role without the
/// right gets a warning and the measurement goes on unlevelled.
pub(super) async fn level(url: &str) -> anyhow::Result<()> {
    let mut conn = connect(url).await?;
    if let Err(e) = sqlx::raw_sql(CHECKPOINT).execute(&mut conn).await {
        tracing::warn!(error = %e, "could not run CHECKPOINT before a measurement; its parts start unlevelled");
    }
    conn.close().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_batch_has_one_row_per_event_with_distinct_ids() {
        let b = ConsumerBatch::numbered("t-", 5, 3);
        assert_eq!(b.len(), 3);
        assert_eq!(b.payment_ids, ["t-pay-5", "t-pay-6", "t-pay-7"]);
        assert_eq!(b.aggregate_ids[0], "t-order-5");
        assert_eq!(b.amounts, [105, 106, 107]);
        assert!(b.hashes.iter().all(|h| h.len() == 64));
        assert_ne!(b.event_ids[0], b.event_ids[1]);
    }

    #[test]
    fn the_lean_statements_name_no_placeholder_tables() {
        for sql in [
            CONSUMER_INBOX,
            CONSUMER_SETTLE,
            CONSUMER_APPLICATIONS,
            RELAY_CLAIM_MARK,
        ] {
            assert!(!sql.contains('{'), "{sql}");
        }
        assert!(RELAY_CLAIM_MARK.contains("SKIP LOCKED"));
    }
}
