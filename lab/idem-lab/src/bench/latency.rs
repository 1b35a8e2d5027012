//! Commit → settlement latency under open-loop arrivals.
//!
//! Orders arrive on a fixed schedule (`start + i / rate`), whatever the system does: a writer
//! that falls behind starts late, but the latency of each order is measured from its *intended*
//! arrival, so a stall is charged to every order it delayed (no coordinated omission). A poller
//! looks for the outstanding payments in `settlements` every millisecond; an order's latency ends
//! when its settlement row is first seen (the start of the poll that saw it).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use sqlx::PgPool;
use tokio::sync::Semaphore;

/// Latency percentiles of one arrival rate.
#[derive(Clone, Debug)]
pub(super) struct LatencyRun {
    /// Intended arrivals per second.
    pub target_rate: f64,
    /// Orders written per second, as achieved.
    pub achieved_rate: f64,
    /// Orders measured.
    pub samples: u64,
    /// Orders not settled within the wait after the run (their latency counts as the wait).
    pub unsettled: u64,
    /// Percentiles in milliseconds.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Largest.
    pub max_ms: f64,
    /// Where the time went, from the databases' own clocks: order transaction start → relay's
    /// mark (the event was acknowledged by the broker), p50 and p99.
    pub relay_stage_ms: (f64, f64),
    /// Relay's mark → settlement transaction start, p50 and p99 (can be below zero: the
    /// consumer may see the record before the relay's mark begins).
    pub consumer_stage_ms: (f64, f64),
    /// The order transaction alone (its start → its commit acknowledged, as the writer saw
    /// it), p50 and p99: the part of the latency that is the business write itself, one durable
    /// commit at this load, which no relay or consumer design can remove.
    pub order_tx_ms: (f64, f64),
}

type Outstanding = Arc<Mutex<HashMap<String, Instant>>>;

/// Writes orders `<prefix>order-N` with their events at `rate` per second for `duration` on at
/// most `writers` connections, and measures each one's intended-arrival → settlement-visible
/// latency on `settle`.
#[allow(clippy::too_many_arguments)]
pub(super) async fn open_loop(
    orders: &PgPool,
    settle: &PgPool,
    outbox: &idem_sql::postgres::Outbox,
    prefix: &str,
    pad: usize,
    rate: f64,
    duration: Duration,
    writers: u32,
) -> anyhow::Result<LatencyRun> {
    let rate = rate.max(1.0);
    let outstanding: Outstanding = Arc::new(Mutex::new(HashMap::new()));
    let histogram = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1,
        3_600_000_000,
        3,
    )?));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poller = tokio::spawn(poll(
        settle.clone(),
        outstanding.clone(),
        histogram.clone(),
        stop.clone(),
    ));

    let order_tx: Arc<Mutex<Vec<f64>>> = Arc::default();
    let slots = Arc::new(Semaphore::new(writers.max(1) as usize));
    let start = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / rate);
    let mut writes = tokio::task::JoinSet::new();
    let mut i: u32 = 0;
    loop {
        let intended = start + interval * i;
        if intended >= start + duration {
            break;
        }
        tokio::time::sleep_until(intended.into()).await;
        let permit = slots.clone().acquire_owned().await?;
        let n = u64::from(i) + 1;
        let payment = format!("{prefix}pay-{n}");
        lock(&outstanding).insert(payment, intended);
        let (pool, prefix) = (orders.clone(), prefix.to_owned());
        let how = super::pg::OrderWrite::Outbox(outbox.clone());
        let order_tx = order_tx.clone();
        writes.spawn(async move {
            let began = Instant::now();
            let r = super::pg::place_order(&pool, &how, &prefix, n, pad).await;
            lock(&order_tx).push(began.elapsed().as_secs_f64() * 1000.0);
            drop(permit);
            r
        });
        while let Some(done) = writes.try_join_next() {
            done??;
        }
        i += 1;
    }
    while let Some(done) = writes.join_next().await {
        done??;
    }
    let achieved_rate = f64::from(i) / start.elapsed().as_secs_f64();

    // Wait for the stragglers, then charge whatever is left with its latency so far.
    let wait_until = Instant::now() + Duration::from_secs(30);
    while !lock(&outstanding).is_empty() && Instant::now() < wait_until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    poller.await??;
    let now = Instant::now();
    let left: Vec<Instant> = lock(&outstanding).drain().map(|(_, t)| t).collect();
    let mut h = lock(&histogram).clone();
    for t in &left {
        h.saturating_record(micros(now.duration_since(*t)));
    }
    let ms = |q: f64| crate::num::float(h.value_at_quantile(q)) / 1000.0;
    let (relay_stage_ms, consumer_stage_ms) = stages(orders, settle, prefix).await?;
    let order_tx_ms = percentiles(&mut lock(&order_tx));
    Ok(LatencyRun {
        order_tx_ms,
        relay_stage_ms,
        consumer_stage_ms,
        target_rate: rate,
        achieved_rate,
        samples: h.len(),
        unsettled: u64::try_from(left.len()).unwrap_or(u64::MAX),
        p50_ms: ms(0.5),
        p99_ms: ms(0.99),
        p999_ms: ms(0.999),
        max_ms: crate::num::float(h.max()) / 1000.0,
    })
}

/// p50 and p99 of each stage of the orders with `prefix`, from the databases' timestamps.
async fn stages(
    orders: &PgPool,
    settle: &PgPool,
    prefix: &str,
) -> anyhow::Result<((f64, f64), (f64, f64))> {
    let like = format!("{prefix}order-%");
    let published: Vec<(String, f64, f64)> = sqlx::query_as(
        "SELECT aggregate_id, extract(epoch FROM published_at - created_at)::float8 * 1000, \
                extract(epoch FROM published_at)::float8 \
         FROM idem_outbox WHERE aggregate_id LIKE $1 AND status = 'published'",
    )
    .bind(&like)
    .fetch_all(orders)
    .await?;
    let settled: HashMap<String, f64> = sqlx::query_as::<_, (String, f64)>(
        "SELECT order_id, extract(epoch FROM settled_at)::float8 FROM settlements WHERE order_id LIKE $1",
    )
    .bind(&like)
    .fetch_all(settle)
    .await?
    .into_iter()
    .collect();
    let mut relay: Vec<f64> = published.iter().map(|p| p.1).collect();
    let mut consumer: Vec<f64> = published
        .iter()
        .filter_map(|(id, _, at)| settled.get(id).map(|s| (s - at) * 1000.0))
        .collect();
    Ok((percentiles(&mut relay), percentiles(&mut consumer)))
}

fn percentiles(v: &mut [f64]) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[crate::num::rank(v.len(), q)];
    (at(0.5), at(0.99))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

async fn poll(
    settle: PgPool,
    outstanding: Outstanding,
    histogram: Arc<Mutex<Histogram<u64>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> anyhow::Result<()> {
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let keys: Vec<String> = lock(&outstanding).keys().cloned().collect();
        if !keys.is_empty() {
            let seen_at = Instant::now();
            let found: Vec<String> =
                sqlx::query_scalar("SELECT payment_id FROM settlements WHERE payment_id = ANY($1)")
                    .bind(&keys)
                    .fetch_all(&settle)
                    .await?;
            let mut out = lock(&outstanding);
            let mut h = lock(&histogram);
            for k in found {
                if let Some(intended) = out.remove(&k) {
                    h.saturating_record(micros(seen_at.saturating_duration_since(intended)));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}
