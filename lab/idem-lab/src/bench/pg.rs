//! The bench's own PostgreSQL databases, the backlog, the business transactions and the
//! closed-loop driver.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use idem_core::TableNames;
use sqlx::PgConnection;
use sqlx::postgres::{PgPool, PgPoolOptions};

/// `url` with its database replaced by `name` (query string kept).
pub(super) fn with_database(url: &str, name: &str) -> anyhow::Result<String> {
    let scheme_end = url
        .find("://")
        .map(|i| i + 3)
        .context("--db must be a postgres:// URL")?;
    let (base, query) = match url.find('?') {
        Some(q) => (&url[..q], &url[q..]),
        None => (url, ""),
    };
    let host_end = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    Ok(format!("{}/{name}{query}", &base[..host_end]))
}

/// Databases created by this run, dropped by [`Databases::drop_all`].
pub(super) struct Databases {
    server: String,
    prefix: String,
    created: Vec<String>,
}

impl Databases {
    /// Databases named `idem_bench_<pid>_*` on the server of `url`.
    pub(super) fn new(url: &str) -> Self {
        Databases {
            server: url.to_owned(),
            prefix: format!("idem_bench_{}", std::process::id()),
            created: vec![],
        }
    }

    /// Runs `measure` over the databases of `url`, ending it on Ctrl-C or SIGTERM, and drops
    /// every database it created either way.
    pub(super) async fn scoped<T>(
        url: &str,
        measure: impl AsyncFnOnce(&mut Databases) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let mut dbs = Databases::new(url);
        let interrupted = idem_cli::util::shutdown_signal()?;
        let result = tokio::select! {
            r = measure(&mut dbs) => r,
            () = interrupted => Err(anyhow::anyhow!("interrupted; the bench database is dropped")),
        };
        if let Err(e) = dbs.drop_all().await {
            tracing::warn!(error = %e, "could not drop the bench database");
        }
        result
    }

    /// The prefix of every database name of this run.
    pub(super) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Creates database `<prefix>_<suffix>` with idem's and the reference tables; returns its
    /// URL and a pool of `connections`.
    pub(super) async fn create(
        &mut self,
        suffix: &str,
        connections: u32,
    ) -> anyhow::Result<(String, PgPool)> {
        let name = format!("{}_{suffix}", self.prefix);
        let mut admin = super::ceilings::connect(&self.server)
            .await
            .with_context(|| format!("connecting to {}", idem_sql::redact(&self.server)))?;
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(&mut admin)
            .await?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .with_context(|| format!("creating database {name}"))?;
        self.created.push(name.clone());
        let url = with_database(&self.server, &name)?;
        // Filling a backlog is slow on purpose: no slow-statement warnings in the progress. The
        // bench's application name spares its sessions when a stuck child's are ended.
        let options = super::ceilings::options(&url)?;
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .connect_with(options)
            .await?;
        idem_sql::postgres::migrate(&pool, &TableNames::default()).await?;
        idem_reference::ensure_schema_postgres(&pool).await?;
        Ok((url, pool))
    }

    /// Drops every database this run created.
    pub(super) async fn drop_all(&mut self) -> anyhow::Result<()> {
        let mut admin = super::ceilings::connect(&self.server).await?;
        for name in self.created.drain(..) {
            // A database with a logical slot cannot be dropped (a CDC phase that was cut short).
            let slots: Vec<String> = sqlx::query_scalar(
                "SELECT slot_name::text FROM pg_replication_slots WHERE database = $1",
            )
            .bind(&name)
            .fetch_all(&mut admin)
            .await?;
            for slot in slots {
                drop_slot(&mut admin, &slot).await?;
            }
            sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .execute(&mut admin)
                .await?;
        }
        Ok(())
    }
}

/// The TLS of `pool`'s session as the server sees it (`pg_stat_ssl`): the protocol and the
/// cipher, or `off`.
pub(super) async fn session_tls(pool: &PgPool) -> anyhow::Result<String> {
    Ok(sqlx::query_scalar(
        "SELECT CASE WHEN ssl THEN version || ' ' || cipher ELSE 'off' END \
         FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .fetch_one(pool)
    .await?)
}

/// How the server sees the TLS of the sessions on the databases named `prefix_*` that are
/// not the bench's own (the children's pools, the CDC relay's walsender): "E of N encrypted".
pub(super) async fn tls_census(pool: &PgPool, prefix: &str) -> anyhow::Result<String> {
    let (encrypted, all): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE s.ssl), count(*) \
         FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE starts_with(a.datname, $1) AND a.application_name <> $2 \
           AND a.backend_type IN ('client backend', 'walsender')",
    )
    .bind(format!("{prefix}_"))
    .bind(super::ceilings::APPLICATION)
    .fetch_one(pool)
    .await?;
    Ok(format!("{encrypted} of {all} encrypted"))
}

/// The `order.paid` payload of backlog order `n` as SQL (same fields as the reference
/// service's, plus a `note` padding it to the message size).
const PAYLOAD_SQL: &str = "jsonb_build_object('order_id', $p || 'order-' || n, 'payment_id', $p || 'pay-' || n, \
     'amount', ((100 + n % 9900) / 100)::text || '.' || lpad(((100 + n % 9900) % 100)::text, 2, '0'), \
     'currency', 'EUR', 'note', repeat('x', $pad))";

/// Padding that brings the payload to about `size` bytes.
pub(super) fn padding(size: usize) -> usize {
    // The JSON of order 1 with an empty note, as the relay sends it (jsonb text).
    let base = r#"{"note": "", "amount": "1.01", "currency": "EUR", "order_id": "b-order-1", "payment_id": "b-pay-1"}"#;
    size.saturating_sub(base.len() + 4)
}

/// Writes `count` paid orders (`<prefix>order-N`) and their pending `order.paid` outbox rows in
/// two set-based statements: the backlog the relay and the consumer drain.
pub(super) async fn fill_backlog(
    pool: &PgPool,
    prefix: &str,
    count: u64,
    pad: usize,
) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    fill_range(&mut tx, prefix, 1, count, pad).await?;
    tx.commit().await?;
    sqlx::query("ANALYZE").execute(pool).await?;
    Ok(())
}

/// The same backlog in transactions of `per_tx` orders each, as many writers leave it: a CDC
/// slot streams it transaction by transaction.
pub(super) async fn fill_backlog_in_transactions(
    pool: &PgPool,
    prefix: &str,
    count: u64,
    per_tx: u64,
    pad: usize,
) -> anyhow::Result<()> {
    let per_tx = per_tx.max(1);
    let mut first = 1;
    while first <= count {
        let last = (first + per_tx - 1).min(count);
        let mut tx = pool.begin().await?;
        fill_range(&mut tx, prefix, first, last, pad).await?;
        tx.commit().await?;
        first = last + 1;
    }
    sqlx::query("ANALYZE").execute(pool).await?;
    Ok(())
}

/// Orders `first..=last` and their outbox rows, in the caller's transaction.
async fn fill_range(
    tx: &mut PgConnection,
    prefix: &str,
    first: u64,
    last: u64,
    pad: usize,
) -> anyhow::Result<()> {
    let (first, last) = (i64::try_from(first)?, i64::try_from(last)?);
    let pad = i32::try_from(pad)?;
    sqlx::query(
        "INSERT INTO orders (order_id, payment_id, amount_minor, currency) \
         SELECT $1 || 'order-' || n, $1 || 'pay-' || n, 100 + n % 9900, 'EUR' FROM generate_series($2::bigint, $3::bigint) n",
    )
    .bind(prefix)
    .bind(first)
    .bind(last)
    .execute(&mut *tx)
    .await
    .context("writing the backlog's orders")?;
    let sql = format!(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', $1 || 'order-' || n, 'order.paid', {} \
         FROM generate_series($2::bigint, $3::bigint) n ORDER BY n",
        PAYLOAD_SQL.replace("$pad", "$4").replace("$p", "$1")
    );
    sqlx::query(&sql)
        .bind(prefix)
        .bind(first)
        .bind(last)
        .bind(pad)
        .execute(&mut *tx)
        .await
        .context("writing the backlog's outbox rows")?;
    Ok(())
}

/// The paid order `n` with its padded `order.paid` event, as the order service writes it.
pub(super) fn order_event(
    prefix: &str,
    n: u64,
    pad: usize,
) -> anyhow::Result<(idem_reference::PaidOrder, idem_core::Event)> {
    let order = idem_reference::PaidOrder::numbered(prefix, n);
    let event = idem_core::Event::builder(
        idem_reference::ORDER,
        &order.order_id,
        idem_reference::ORDER_PAID,
    )
    .payload(&serde_json::json!({
        "order_id": order.order_id,
        "payment_id": order.payment_id,
        "amount": idem_reference::money::format_minor(order.amount_minor),
        "currency": order.currency,
        "note": "x".repeat(pad),
    }))
    .build()?;
    Ok((order, event))
}

/// How a business transaction writes its event.
#[derive(Clone, Debug)]
pub(super) enum OrderWrite {
    /// The order row alone: no event.
    Alone,
    /// The order row and its event through idem's outbox (the reference service).
    Outbox(idem_sql::postgres::Outbox),
    /// The order row and its event as a logical decoding message (the CDC relay's message
    /// mode), written in one statement with `MessageOutbox::enqueue_with`: no outbox row, no
    /// second round trip.
    Message(idem_sql::postgres::MessageOutbox),
    /// The same with the message in a statement of its own after the order's
    /// (`MessageOutbox::enqueue`): what the second round trip costs.
    MessageSeparate(idem_sql::postgres::MessageOutbox),
    /// The order row and the same event JSON as a plain row of `bench_plain` (one index, no
    /// trigger, no constraint): what any second row costs, the outbox's physical floor.
    PlainRow,
}

/// The plain table of [`OrderWrite::PlainRow`].
pub(super) const PLAIN_TABLE: &str = "CREATE TABLE IF NOT EXISTS bench_plain (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, \
     event_id uuid NOT NULL, aggregate_id text NOT NULL, payload jsonb NOT NULL)";

/// One business transaction: the order row and its event, written as `how` says, in one
/// transaction (the reference order service's code, with the padded event).
pub(super) async fn place_order(
    pool: &PgPool,
    how: &OrderWrite,
    prefix: &str,
    n: u64,
    pad: usize,
) -> anyhow::Result<()> {
    let (order, event) = order_event(prefix, n, pad)?;
    match how {
        OrderWrite::Alone => {
            idem_reference::write_order_postgres(pool, None, &order, &event).await?;
        }
        OrderWrite::Outbox(outbox) => {
            idem_reference::write_order_postgres(pool, Some(outbox), &order, &event).await?;
        }
        OrderWrite::Message(outbox) => {
            let mut tx = pool.begin().await?;
            let write = sqlx::query(INSERT_ORDER)
                .bind(&order.order_id)
                .bind(&order.payment_id)
                .bind(order.amount_minor)
                .bind(&order.currency);
            outbox
                .enqueue_with(&mut tx, write, std::slice::from_ref(&event))
                .await?;
            tx.commit().await?;
        }
        OrderWrite::MessageSeparate(outbox) => {
            let mut tx = pool.begin().await?;
            insert_order(&mut tx, &order).await?;
            outbox.enqueue(&mut tx, &event).await?;
            tx.commit().await?;
        }
        OrderWrite::PlainRow => {
            let mut tx = pool.begin().await?;
            insert_order(&mut tx, &order).await?;
            sqlx::query("INSERT INTO bench_plain (event_id, aggregate_id, payload) VALUES ($1, $2, $3::jsonb)")
                .bind(event.id().as_uuid())
                .bind(event.aggregate_id())
                .bind(event.payload())
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        }
    }
    Ok(())
}

/// The reference order service's order row.
const INSERT_ORDER: &str =
    "INSERT INTO orders (order_id, payment_id, amount_minor, currency) VALUES ($1, $2, $3, $4)";

/// The order row, as the reference order service writes it, in the caller's transaction.
async fn insert_order(
    tx: &mut PgConnection,
    order: &idem_reference::PaidOrder,
) -> anyhow::Result<()> {
    sqlx::query(INSERT_ORDER)
        .bind(&order.order_id)
        .bind(&order.payment_id)
        .bind(order.amount_minor)
        .bind(&order.currency)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Runs `op(worker, n)` on `workers` tasks for `duration`, `n` counting up across them; returns
/// operations per second.
pub(super) async fn closed_loop<F, Fut>(
    workers: u32,
    duration: Duration,
    op: F,
) -> anyhow::Result<f64>
where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let counter = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + duration;
    let mut tasks = vec![];
    for _ in 0..workers.max(1) {
        let (op, counter, done) = (op.clone(), counter.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
                op(n).await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(crate::num::per_second(
        done.load(Ordering::Relaxed),
        start.elapsed(),
    ))
}

/// Durable single-row inserts (autocommit, `synchronous_commit` as the server has it) on
/// `workers` connections.
pub(super) async fn insert_rate(
    pool: &PgPool,
    workers: u32,
    duration: Duration,
    size: usize,
) -> anyhow::Result<f64> {
    sqlx::query("CREATE TABLE IF NOT EXISTS bench_insert (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, payload text NOT NULL)")
        .execute(pool)
        .await?;
    let payload = Arc::new("x".repeat(size));
    let pool = pool.clone();
    closed_loop(workers, duration, move |_| {
        let (pool, payload) = (pool.clone(), payload.clone());
        async move {
            sqlx::query("INSERT INTO bench_insert (payload) VALUES ($1)")
                .bind(payload.as_str())
                .execute(&pool)
                .await?;
            Ok(())
        }
    })
    .await
}

/// Steady-state rate of rows stamped in `column` of `table` (`now()` of each writing
/// transaction): rows after the first stamp over the time from the first stamp to the last.
/// Falls back to `rows / fallback` when every row has one stamp (a single batch).
pub(super) async fn stamped_rate(
    pool: &PgPool,
    table: &str,
    column: &str,
    filter: &str,
    fallback: Duration,
) -> anyhow::Result<f64> {
    let (count, first_count, span): (i64, i64, Option<f64>) = sqlx::query_as(&format!(
        "WITH r AS (SELECT {column} AS t FROM {table} WHERE {filter}) \
         SELECT (SELECT count(*) FROM r), \
                (SELECT count(*) FROM r WHERE t = (SELECT min(t) FROM r)), \
                (SELECT extract(epoch FROM max(t) - min(t))::float8 FROM r)"
    ))
    .fetch_one(pool)
    .await?;
    match span {
        Some(s) if s > 0.001 && count > first_count => {
            Ok(crate::num::float(count - first_count) / s)
        }
        _ => Ok(crate::num::per_second(count, fallback)),
    }
}

/// Drops logical slot `slot` if it exists, once no session reads it (a stopped relay's
/// walsender may take a moment to end): a forgotten slot pins WAL, and a database with one
/// cannot be dropped.
pub(super) async fn drop_slot(conn: &mut PgConnection, slot: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let active: Option<bool> =
            sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
                .bind(slot)
                .fetch_optional(&mut *conn)
                .await?;
        match active {
            None => return Ok(()),
            Some(false) => {
                sqlx::query("SELECT pg_drop_replication_slot($1)")
                    .bind(slot)
                    .execute(&mut *conn)
                    .await
                    .with_context(|| format!("dropping replication slot {slot}"))?;
                return Ok(());
            }
            Some(true) if Instant::now() > deadline => {
                anyhow::bail!("replication slot {slot} is still read after 30 s; drop it by hand")
            }
            Some(true) => {
                sqlx::query("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1")
                    .bind(slot)
                    .execute(&mut *conn)
                    .await?;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// `SELECT count(*) FROM …`.
pub(super) async fn count(pool: &PgPool, from_where: &str) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {from_where}"))
        .fetch_one(pool)
        .await?;
    Ok(u64::try_from(n)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/postgres", "x").unwrap(),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            with_database("postgres://u:p@h/db?sslmode=disable", "x").unwrap(),
            "postgres://u:p@h/x?sslmode=disable"
        );
        assert_eq!(
            with_database("postgres://h:1", "x").unwrap(),
            "postgres://h:1/x"
        );
        assert!(with_database("nope", "x").is_err());
    }

    #[test]
    fn padded_payload_has_about_the_message_size() {
        let (_, e) = order_event("b-", 1, padding(256)).unwrap();
        let len = e.payload().len();
        assert!((240..=272).contains(&len), "{len}");
    }
}
