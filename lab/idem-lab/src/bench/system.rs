//! The system under load: the relay and the settlement consumer as child processes draining a
//! backlog (new events, then the same events again as duplicates), then together under
//! closed-loop and open-loop load.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use sqlx::PgPool;

use super::child::Child;
use super::kafka::TempDir;
use super::pg::{self, OrderWrite};
use super::plan::{self, Phase, drain_timeout};
use super::{Ctx, Names, Progress, Ticker, latency};

/// The system's databases: URL and pool of each.
pub struct SystemDbs {
    pub orders_url: String,
    pub orders: PgPool,
    pub settle_url: String,
    pub settle: PgPool,
    pub noinbox_url: String,
    pub noinbox: PgPool,
}

/// Outbox rows published, as the relay drains count them.
const PUBLISHED: &str = "idem_outbox WHERE status = 'published'";

/// What a drain waits for: `SELECT count(*) FROM <what>` on `pool`, shown as `label`.
struct Watch<'a> {
    pool: &'a PgPool,
    what: &'a str,
    label: &'a str,
}

/// The system phases, in [`PHASES`](plan::PHASES) order.
pub async fn run(
    c: &mut Ctx<'_>,
    dbs: &SystemDbs,
    names: &Names,
    logs: &TempDir,
) -> anyhow::Result<()> {
    c.phase(Phase::Backlog);
    pg::fill_backlog(&dbs.orders, "b-", c.args.backlog, c.pad).await?;
    let (mut relay, mut settlement) = drains(c, dbs, names, logs).await?;
    c.phase(Phase::Sustained);
    let (sustained, writers) = sustained(c, dbs).await?;
    c.report.figure("e2e_writers_per_s", writers);
    c.report.figure("e2e_sustained_per_s", sustained);
    let expected = pg::count(&dbs.orders, "orders").await?;
    let left = Watch {
        pool: &dbs.settle,
        what: "settlements",
        label: "settled (draining what the writers left)",
    };
    let timeout = drain_timeout(c.args);
    wait_for(
        c.progress,
        &left,
        expected,
        &mut [&mut settlement, &mut relay],
        timeout,
    )
    .await?;
    latency(c, dbs, &mut relay, &mut settlement, sustained).await?;
    settlement.stop().await?;
    relay.stop().await?;
    Ok(())
}

/// The drains: the relay, the consumer, the consumer without its inbox, the republished
/// backlog and its duplicates. Returns the relay and the consumer, still running.
async fn drains(
    c: &mut Ctx<'_>,
    dbs: &SystemDbs,
    names: &Names,
    logs: &TempDir,
) -> anyhow::Result<(Child, Child)> {
    c.phase(Phase::RelayDrain);
    let relay_args = plan::relay_args(c.args, &dbs.orders_url, &c.brokers, &names.topic_prefix);
    let published = Watch {
        pool: &dbs.orders,
        what: PUBLISHED,
        label: "rows published",
    };
    let (relay, elapsed) = drain(c, logs, "relay", &relay_args, &published, &mut []).await?;
    c.report.peak("relay_peak_rss_mib", relay.peak_rss());
    relay.stop().await?;
    let v = pg::stamped_rate(
        &dbs.orders,
        "idem_outbox",
        "published_at",
        "status = 'published'",
        elapsed,
    )
    .await?;
    c.report.figure("relay_drain_per_s", v);

    c.phase(Phase::ConsumerDrain);
    let settlement_args = plan::consumer_args(
        c.args,
        &["settlement"],
        &dbs.settle_url,
        &c.brokers,
        &names.topic,
        &names.group,
    );
    let (settlement, elapsed) =
        settle_drain(c, logs, "settlement", &settlement_args, &dbs.settle).await?;
    c.report
        .peak("consumer_peak_rss_mib", settlement.peak_rss());
    settlement.stop().await?;
    let v = pg::stamped_rate(&dbs.settle, "settlements", "settled_at", "true", elapsed).await?;
    c.report.figure("consumer_drain_per_s", v);

    no_inbox_drain(c, dbs, names, logs).await?;
    duplicates(c, dbs, names, logs, &relay_args, &settlement_args).await
}

/// The same consumer with the inbox insert left out: what the inbox costs.
async fn no_inbox_drain(
    c: &mut Ctx<'_>,
    dbs: &SystemDbs,
    names: &Names,
    logs: &TempDir,
) -> anyhow::Result<()> {
    c.phase(Phase::NoInboxDrain);
    let bare_args = plan::consumer_args(
        c.args,
        &["bench", "no-inbox-consumer"],
        &dbs.noinbox_url,
        &c.brokers,
        &names.topic,
        &names.group_no_inbox,
    );
    let (bare, elapsed) =
        settle_drain(c, logs, "no-inbox-consumer", &bare_args, &dbs.noinbox).await?;
    bare.stop().await?;
    let v = pg::stamped_rate(&dbs.noinbox, "settlements", "settled_at", "true", elapsed).await?;
    c.report.figure("consumer_no_inbox_drain_per_s", v);
    dbs.noinbox.close().await;
    Ok(())
}

/// Every event published a second time, and the consumer's drain of the duplicates; the relay
/// and the consumer keep running.
async fn duplicates(
    c: &mut Ctx<'_>,
    dbs: &SystemDbs,
    names: &Names,
    logs: &TempDir,
    relay_args: &[String],
    settlement_args: &[String],
) -> anyhow::Result<(Child, Child)> {
    c.phase(Phase::Republish);
    sqlx::query("UPDATE idem_outbox SET status = 'pending', published_at = NULL")
        .execute(&dbs.orders)
        .await?;
    let republished = Watch {
        pool: &dbs.orders,
        what: PUBLISHED,
        label: "rows republished",
    };
    let (mut relay, _) = drain(c, logs, "relay-2", relay_args, &republished, &mut []).await?;

    c.phase(Phase::Duplicates);
    // The group is ours (a UUID), never input.
    let dups = format!("consumer_group = '{}' AND delivery_count >= 2", names.group);
    let what = format!("idem_inbox WHERE {dups}");
    let skipped = Watch {
        pool: &dbs.settle,
        what: &what,
        label: "duplicates skipped",
    };
    let (settlement, elapsed) = drain(
        c,
        logs,
        "settlement-2",
        settlement_args,
        &skipped,
        &mut [&mut relay],
    )
    .await?;
    let v = pg::stamped_rate(
        &dbs.settle,
        "idem_inbox",
        "last_delivered_at",
        &dups,
        elapsed,
    )
    .await?;
    c.report.figure("duplicates_drain_per_s", v);
    Ok((relay, settlement))
}

/// Starts consumer `name` (`idem ARGS`) and waits until `pool` holds a settlement per event
/// of the backlog.
async fn settle_drain(
    c: &Ctx<'_>,
    logs: &TempDir,
    name: &str,
    args: &[String],
    pool: &PgPool,
) -> anyhow::Result<(Child, Duration)> {
    let settled = Watch {
        pool,
        what: "settlements",
        label: "events settled",
    };
    drain(c, logs, name, args, &settled, &mut []).await
}

/// Starts child `name` (`idem ARGS`) and waits until `watch` reaches the backlog; returns the
/// still-running child and the time it took.
async fn drain(
    c: &Ctx<'_>,
    logs: &TempDir,
    name: &str,
    args: &[String],
    watch: &Watch<'_>,
    others: &mut [&mut Child],
) -> anyhow::Result<(Child, Duration)> {
    let started = Instant::now();
    let mut child = Child::spawn(name, args, &logs.0)?;
    let mut watched: Vec<&mut Child> = vec![&mut child];
    watched.extend(others.iter_mut().map(|c| &mut **c));
    let timeout = drain_timeout(c.args);
    wait_for(c.progress, watch, c.args.backlog, &mut watched, timeout).await?;
    Ok((child, started.elapsed()))
}

/// Polls `watch` until it reaches `target`, failing if a child exits or the time runs out.
async fn wait_for(
    progress: &Progress,
    watch: &Watch<'_>,
    target: u64,
    children: &mut [&mut Child],
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut tick = Ticker::new();
    let label = watch.label;
    loop {
        let n = pg::count(watch.pool, watch.what).await?;
        if n >= target {
            return Ok(());
        }
        for c in children.iter_mut() {
            c.check_alive()?;
        }
        if Instant::now() > deadline {
            let logs: Vec<String> = children.iter().map(|c| c.log_tail()).collect();
            bail!(
                "{label}: {n} of {target} after {timeout:?}; logs:\n{}",
                logs.join("\n---\n")
            );
        }
        tick.every_second(|| progress.note(&format!("{n}/{target} {label}")));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Writers as fast as they can for `--seconds` while the relay and consumer run: settlements
/// per second over the run after a warm-up fifth, and orders written per second.
async fn sustained(c: &Ctx<'_>, dbs: &SystemDbs) -> anyhow::Result<(f64, f64)> {
    let (secs, pad, progress) = (c.secs, c.pad, &*c.progress);
    let (pool, how) = (dbs.orders.clone(), OrderWrite::Outbox(c.outbox.clone()));
    let written = Arc::new(AtomicU64::new(0));
    let w = written.clone();
    let writers = tokio::spawn(pg::closed_loop(c.args.connections, secs, move |i| {
        let (pool, how, w) = (pool.clone(), how.clone(), w.clone());
        async move {
            pg::place_order(&pool, &how, "e-", i, pad).await?;
            w.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }));
    let start = Instant::now();
    tokio::time::sleep(secs / 5).await;
    let (c0, t0) = (pg::count(&dbs.settle, "settlements").await?, Instant::now());
    let mut tick = Ticker::new();
    while !writers.is_finished() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        tick.every_second(|| {
            progress.note(&format!(
                "{} orders written, {:.0} s",
                written.load(Ordering::Relaxed),
                start.elapsed().as_secs_f64()
            ))
        });
    }
    let (c1, t1) = (pg::count(&dbs.settle, "settlements").await?, Instant::now());
    let writer_rate = writers.await??;
    Ok((plan::rate(c1 - c0, t1.duration_since(t0)), writer_rate))
}

/// Commit → settlement latency under open-loop arrivals at each load of the sustained rate.
async fn latency(
    c: &mut Ctx<'_>,
    dbs: &SystemDbs,
    relay: &mut Child,
    settlement: &mut Child,
    sustained: f64,
) -> anyhow::Result<()> {
    c.phase(Phase::Latency);
    for (pct, rate) in plan::open_loop_rates(sustained) {
        c.progress.note(&format!(
            "{pct} %: {rate:.0} orders/s for {:.0} s",
            c.args.seconds
        ));
        relay.check_alive()?;
        settlement.check_alive()?;
        let prefix = format!("l{pct}-");
        let run = latency::open_loop(
            &dbs.orders,
            &dbs.settle,
            c.outbox,
            &prefix,
            c.pad,
            rate,
            c.secs,
            c.n,
        )
        .await?;
        c.progress.note(&format!(
            "{pct} %: p50 {:.1} ms, p99 {:.1} ms, p99.9 {:.1} ms ({} samples); relay stage p50 {:.1} p99 {:.1} ms, consumer stage p50 {:.1} p99 {:.1} ms",
            run.p50_ms, run.p99_ms, run.p999_ms, run.samples,
            run.relay_stage_ms.0, run.relay_stage_ms.1, run.consumer_stage_ms.0, run.consumer_stage_ms.1
        ));
        c.report.latency(pct, &run);
    }
    Ok(())
}
