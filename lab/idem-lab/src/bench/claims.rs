//! `idem-lab bench claims`: the polling relay's claim and mark over backlogs of several shapes
//! and depths, each drain bracketed by the lean claim-and-mark over a fresh backlog of the same
//! shape and depth. No broker: this prices the relay's SQL, which is what depends on the
//! backlog (the produce does not).

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use idem_core::outbox::{ClaimOutcome, ClaimRequest};
use idem_core::store::OutboxStore;
use sqlx::PgPool;

use super::pg::Databases;

/// Options of `idem-lab bench claims`.
#[derive(Args, Debug)]
pub(super) struct ClaimsBenchArgs {
    /// PostgreSQL server URL (any database on it); the bench creates and drops its own.
    #[arg(long, env = "IDEM_BENCH_DB", default_value = super::DEFAULT_DB)]
    db: String,
    /// Backlog shapes, in this order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "single,round-robin,grouped,deep"
    )]
    shapes: Vec<Shape>,
    /// Pending rows of each backlog, in this order.
    #[arg(long, value_delimiter = ',', default_value = "100000,1000000")]
    depths: Vec<u64>,
    /// Rows per claim (the relay's `--batch-size`).
    #[arg(long, default_value_t = 500)]
    batch_size: u32,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// How a backlog's rows fall into aggregates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Shape {
    /// One row per aggregate.
    Single,
    /// 1 000 aggregates, their rows written in turn (as 1 000 busy aggregates leave them).
    RoundRobin,
    /// 1 000 aggregates, each one's rows written one after another.
    Grouped,
    /// One aggregate holding every tenth row, among single-row aggregates.
    Deep,
}

impl Shape {
    /// The SQL expression naming row `n`'s aggregate in a backlog of `depth` rows.
    fn aggregate_sql(self, depth: u64) -> String {
        let per = (depth / 1_000).max(1);
        match self {
            Shape::Single => "'a-' || n".to_owned(),
            Shape::RoundRobin => "'a-' || (n % 1000)".to_owned(),
            Shape::Grouped => format!("'a-' || ((n - 1) / {per})"),
            Shape::Deep => "CASE WHEN n % 10 = 0 THEN 'deep' ELSE 'a-' || n END".to_owned(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Shape::Single => "single",
            Shape::RoundRobin => "round-robin",
            Shape::Grouped => "grouped",
            Shape::Deep => "deep",
        }
    }
}

/// One shape and depth: the relay's store drain between two lean drains.
#[derive(Debug, serde::Serialize)]
struct Measured {
    shape: &'static str,
    depth: u64,
    lean_before_per_s: f64,
    store_per_s: f64,
    lean_after_per_s: f64,
    /// The share of the store's drain spent in claims (the rest in marks).
    store_claim_share: f64,
    /// The store's rate ÷ the mean of the two lean rates.
    ratio: f64,
}

pub(super) async fn run(args: ClaimsBenchArgs) -> anyhow::Result<()> {
    let measured = Databases::scoped(&args.db, async |dbs| measure(&args, dbs).await).await?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "batch_size": args.batch_size, "drains": measured })
        );
        return Ok(());
    }
    println!(
        "{:<12} {:>9} {:>12} {:>12} {:>12} {:>6} {:>7}",
        "shape", "pending", "lean before", "relay store", "lean after", "ratio", "claims"
    );
    for m in &measured {
        println!(
            "{:<12} {:>9} {:>12.0} {:>12.0} {:>12.0} {:>6.2} {:>6.0}%",
            m.shape,
            m.depth,
            m.lean_before_per_s,
            m.store_per_s,
            m.lean_after_per_s,
            m.ratio,
            m.store_claim_share * 100.0
        );
    }
    Ok(())
}

async fn measure(args: &ClaimsBenchArgs, dbs: &mut Databases) -> anyhow::Result<Vec<Measured>> {
    let (url, pool) = dbs.create("claims", 2).await?;
    let mut out = vec![];
    for &depth in &args.depths {
        for &shape in &args.shapes {
            let lean_before = lean(&url, &pool, shape, depth, args.batch_size).await?;
            let drain = store(&pool, shape, depth, args.batch_size).await?;
            let store = drain.rate;
            let lean_after = lean(&url, &pool, shape, depth, args.batch_size).await?;
            let bound = f64::midpoint(lean_before, lean_after);
            let m = Measured {
                shape: shape.name(),
                depth,
                lean_before_per_s: lean_before,
                store_per_s: store,
                lean_after_per_s: lean_after,
                store_claim_share: drain.claim_share,
                ratio: if bound > 0.0 { store / bound } else { 0.0 },
            };
            eprintln!(
                "idem bench claims: {} × {depth}: lean {lean_before:.0} / store {store:.0} / lean {lean_after:.0} rows/s",
                m.shape
            );
            out.push(m);
        }
    }
    pool.close().await;
    Ok(out)
}

/// Rows written per transaction: each row's commit-order trigger updates its aggregate's
/// counter row, and one transaction's versions of a row cannot be pruned before it ends, so an
/// aggregate's 100 000 rows in one transaction would each walk the versions before them.
const FILL_ROWS_PER_TX: u64 = 10_000;

/// Empties the outbox and writes `depth` pending rows of `shape`, in transactions of
/// [`FILL_ROWS_PER_TX`] rows, vacuumed and analysed as autovacuum leaves a table between bursts.
async fn fill(pool: &PgPool, shape: Shape, depth: u64) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE idem_outbox, idem_outbox_aggregates")
        .execute(pool)
        .await?;
    let pad = i32::try_from(super::pg::padding(256))?;
    let sql = format!(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', {}, 'order.paid', \
                jsonb_build_object('n', n, 'note', repeat('x', $3)) \
         FROM generate_series($1::bigint, $2::bigint) n ORDER BY n",
        shape.aggregate_sql(depth)
    );
    let mut first = 1;
    while first <= depth {
        let last = (first + FILL_ROWS_PER_TX - 1).min(depth);
        sqlx::query(&sql)
            .bind(i64::try_from(first)?)
            .bind(i64::try_from(last)?)
            .bind(pad)
            .execute(pool)
            .await
            .with_context(|| format!("writing a {} backlog of {depth} rows", shape.name()))?;
        first = last + 1;
    }
    sqlx::query("VACUUM ANALYZE idem_outbox")
        .execute(pool)
        .await?;
    Ok(())
}

/// The lean claim-and-mark's rate over a fresh backlog.
async fn lean(
    url: &str,
    pool: &PgPool,
    shape: Shape,
    depth: u64,
    batch: u32,
) -> anyhow::Result<f64> {
    fill(pool, shape, depth).await?;
    let (rows, rate) = super::ceilings::relay_rate(url, batch, |_| {}).await?;
    anyhow::ensure!(
        rows == depth,
        "the lean drain published {rows} of {depth} rows"
    );
    Ok(rate)
}

/// The store's drain: its rate, and the share of its time spent claiming (the rest marks).
struct StoreDrain {
    rate: f64,
    claim_share: f64,
}

/// The relay's store over a fresh backlog: claim, then mark every claimed row published, as
/// `idem relay` does after the broker acknowledged them, until a claim comes back empty.
async fn store(pool: &PgPool, shape: Shape, depth: u64, batch: u32) -> anyhow::Result<StoreDrain> {
    fill(pool, shape, depth).await?;
    let store = idem_sql::postgres::PgStore::new(pool.clone(), idem_core::TableNames::default());
    let request = ClaimRequest {
        relay_id: "bench-claims".to_owned(),
        batch_size: batch,
        lease: Duration::from_secs(60),
    };
    let start = Instant::now();
    let mut rows = 0u64;
    let mut claiming = Duration::ZERO;
    loop {
        let t = Instant::now();
        let claim = store.claim(&request).await?;
        claiming += t.elapsed();
        if claim.records.is_empty() {
            break;
        }
        let outcome = ClaimOutcome {
            published: claim.records.iter().map(|r| r.id).collect(),
            failed: vec![],
        };
        rows += store.complete(&claim, &outcome).await?.marked;
    }
    let elapsed = start.elapsed();
    let rate = super::plan::rate(rows, elapsed);
    anyhow::ensure!(rows == depth, "the store published {rows} of {depth} rows");
    Ok(StoreDrain {
        rate,
        claim_share: claiming.as_secs_f64() / elapsed.as_secs_f64().max(f64::MIN_POSITIVE),
    })
}

#[cfg(test)]
mod tests {
    use super::Shape;

    #[test]
    fn grouped_aggregates_hold_a_thousandth_of_the_backlog_each() {
        assert_eq!(
            Shape::Grouped.aggregate_sql(100_000),
            "'a-' || ((n - 1) / 100)"
        );
        assert_eq!(Shape::Grouped.aggregate_sql(10), "'a-' || ((n - 1) / 1)");
    }
}
