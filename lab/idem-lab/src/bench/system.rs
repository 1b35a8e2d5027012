//! The system under load: the relay and the settlement consumer as child processes draining a
//! backlog (new events, then the same events again as duplicates), then together under
//! closed-loop and open-loop load; each drain and the sustained run bracketed by their
//! ceilings ([`baselines`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use sqlx::PgPool;

use super::child::Child;
use super::figures::Figure;
use super::kafka::TempDir;
use super::pg::{self, OrderWrite};
use super::plan::{self, Phase, drain_timeout};
use super::spread::Stall;
use super::{Ctx, Names, Progress, Ticker, baselines, ceilings, cpu, latency};

/// The system's databases (URL and pool of each), the run's topics and groups, and where its
/// children log.
pub(super) struct SystemDbs<'a> {
    pub orders_url: String,
    pub orders: PgPool,
    /// The CDC relay's orders database (its slot is the run's).
    pub cdc_url: String,
    pub cdc: PgPool,
    pub settle_url: String,
    pub settle: PgPool,
    pub noinbox_url: String,
    pub noinbox: PgPool,
    /// The sustained and latency runs' pair, created empty at the start.
    pub live: Pipeline,
    pub names: &'a Names,
    pub logs: &'a TempDir,
    /// The prefix of the run's database names ([`pg::tls_census`]).
    pub db_prefix: &'a str,
}

/// An orders database and its settlement database.
pub(super) struct Pipeline {
    pub orders_url: String,
    pub orders: PgPool,
    pub settle_url: String,
    pub settle: PgPool,
}

/// Outbox rows published, as the relay drains count them.
const PUBLISHED: &str = "idem_outbox WHERE status = 'published'";

/// What a drain waits for: `SELECT count(*) FROM <what>` on `pool`, shown as `label`.
struct Watch<'a> {
    pool: &'a PgPool,
    what: &'a str,
    label: &'a str,
}

/// The relay and the consumer left running for the sustained and latency phases.
#[derive(Default)]
struct Running {
    relay: Option<Child>,
    settlement: Option<Child>,
}

impl Running {
    /// Stops whichever runs.
    async fn stop(self) -> anyhow::Result<()> {
        if let Some(s) = self.settlement {
            s.stop().await?;
        }
        if let Some(r) = self.relay {
            r.stop().await?;
        }
        Ok(())
    }
}

/// The system phases and the ceilings that bracket them, in [`PHASES`](plan::PHASES) order. A
/// phase that fails or passes its deadline is reported; the ones that need it are skipped, the
/// others run.
pub(super) async fn run(c: &mut Ctx<'_>, dbs: &SystemDbs<'_>) -> anyhow::Result<()> {
    let (backlog, pad) = (c.args.backlog, c.pad);
    c.guarded(Phase::Backlog, async |_| {
        pg::fill_backlog(&dbs.orders, "b-", backlog, pad).await
    })
    .await;
    drains(c, dbs).await?;
    let mut drained = Running::default();
    duplicates(c, dbs, &mut drained).await?;
    // Stopped cleanly (offsets committed, the group left): the live pair's consumer joins the
    // same group and starts where this one ended.
    drained.stop().await?;
    let mut running = Running::default();
    let run = async |c: &mut Ctx<'_>| sustained(c, dbs, &mut running).await;
    let url = &dbs.live.orders_url;
    let rate = bracketed(c, plan::WRITERS, baselines::writers, run, url).await?;
    // Without a sustained rate the latency phase is skipped (it needs the sustained run).
    let sustained = rate.unwrap_or(f64::NAN);
    c.guarded(Phase::Latency, async |c| {
        latency(c, dbs, &mut running, sustained).await
    })
    .await;
    running.stop().await
}

/// The relay's and the consumer's drains of the backlog, each bracketed by its ceilings, and
/// the consumer without its inbox.
async fn drains(c: &mut Ctx<'_>, dbs: &SystemDbs<'_>) -> anyhow::Result<()> {
    let drain = async |c: &mut Ctx<'_>| relay_drain(c, dbs).await;
    bracketed(c, plan::RELAY, baselines::relay, drain, &dbs.orders_url).await?;
    let drain = async |c: &mut Ctx<'_>| cdc_drain(c, dbs).await;
    bracketed(c, plan::CDC, baselines::cdc, drain, &dbs.cdc_url).await?;
    pg::drop_slot(&mut *dbs.cdc.acquire().await?, &dbs.names.cdc_slot).await?;
    c.guarded(Phase::Consume, async |c| baselines::raw_consume(c).await)
        .await;
    let drain = async |c: &mut Ctx<'_>| consumer_drain(c, dbs).await;
    bracketed(
        c,
        plan::CONSUMER,
        baselines::consumer,
        drain,
        &dbs.settle_url,
    )
    .await?;
    let drained = c
        .guarded(Phase::NoInboxDrain, async |c| no_inbox_drain(c, dbs).await)
        .await;
    clean_up_after(drained.is_none(), &dbs.noinbox_url).await
}

/// Runs the system phase `phase` (`drain`) between two runs of its `ceiling` (`before`,
/// `after`), each of the three after a checkpoint (`ceilings::level`), and cleans up the
/// database of `url` after the phase if it did not end well.
async fn bracketed<'a, T>(
    c: &mut Ctx<'a>,
    [before, phase, after]: [Phase; 3],
    ceiling: impl AsyncFn(&mut Ctx<'a>, &str) -> anyhow::Result<()>,
    drain: impl AsyncFnOnce(&mut Ctx<'a>) -> anyhow::Result<T>,
    url: &str,
) -> anyhow::Result<Option<T>> {
    ceilings::level(url).await?;
    c.guarded(before, async |c| ceiling(c, "b").await).await;
    ceilings::level(url).await?;
    let value = c.guarded(phase, drain).await;
    clean_up_after(value.is_none(), url).await?;
    ceilings::level(url).await?;
    c.guarded(after, async |c| ceiling(c, "a").await).await;
    Ok(value)
}

/// After a phase that did not end well (`failed`): ends the sessions its killed children left
/// on database `url` (a backend runs its statement to the end after its client is gone).
async fn clean_up_after(failed: bool, url: &str) -> anyhow::Result<()> {
    if failed {
        let n = ceilings::terminate_others(url).await?;
        if n > 0 {
            tracing::warn!(
                sessions = n,
                "ended the sessions a stopped child left behind"
            );
        }
    }
    Ok(())
}

/// The relay drains the backlog: its rate from the rows' publication stamps, its peak RSS.
async fn relay_drain(c: &mut Ctx<'_>, dbs: &SystemDbs<'_>) -> anyhow::Result<()> {
    let relay_args = plan::relay_args(
        c.args,
        &dbs.orders_url,
        c.kafka.brokers(),
        &dbs.names.topic_prefix,
    );
    let published = Watch {
        pool: &dbs.orders,
        what: PUBLISHED,
        label: "rows published",
    };
    let (relay, elapsed) = drain(c, dbs.logs, "relay", &relay_args, &published, &mut []).await?;
    let keys = (Figure::RelayPeakRss, Figure::RelayDrain);
    drained(c, relay, &dbs.orders, elapsed, keys).await
}

/// A relay that drained the backlog of `pool` in `elapsed`: its peak RSS and its rate from the
/// rows' publication stamps as the two figures (RSS, rate); then it is stopped.
async fn drained(
    c: &mut Ctx<'_>,
    relay: Child,
    pool: &PgPool,
    elapsed: Duration,
    (rss, rate): (Figure, Figure),
) -> anyhow::Result<()> {
    c.report.peak(rss, relay.peak_rss());
    relay.stop().await?;
    let published = "status = 'published'";
    let v = pg::stamped_rate(pool, "idem_outbox", "published_at", published, elapsed).await?;
    c.report.figure(rate, v);
    Ok(())
}

/// The CDC relay drains a backlog from its slot: started once to create the slot (and stopped,
/// so the slot's position is where the backlog starts), the backlog written in transactions of
/// `--relay-batch-size` rows, then started again. Written after the slot's position, the rows
/// are streamed, not drained from the table (docs/operating/cdc-relay.md). Its rate from the
/// rows' publication stamps (the relay marks what it published), its peak RSS.
async fn cdc_drain(c: &mut Ctx<'_>, dbs: &SystemDbs<'_>) -> anyhow::Result<()> {
    let wal: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(&dbs.cdc)
        .await?;
    if wal != "logical" {
        bail!("wal_level is {wal}: the CDC relay needs wal_level = logical (and a restart)");
    }
    let names = dbs.names;
    let args = plan::cdc_relay_args(
        c.args,
        &dbs.cdc_url,
        c.kafka.brokers(),
        &names.cdc_topic_prefix,
        &names.cdc_slot,
    );
    let mut first = Child::spawn("cdc-relay", &args, &c.child_env, &dbs.logs.0)?;
    slot_held(c, &dbs.cdc, &names.cdc_slot, &mut first).await?;
    first.stop().await?;
    let (backlog, per_tx) = (c.args.backlog, u64::from(c.args.relay_batch_size));
    pg::fill_backlog_in_transactions(&dbs.cdc, "c-", backlog, per_tx, c.pad).await?;
    let published = Watch {
        pool: &dbs.cdc,
        what: PUBLISHED,
        label: "rows streamed and marked",
    };
    let machine = cpu::MachineCpu::now();
    let (relay, elapsed) = drain(c, dbs.logs, "cdc-relay-2", &args, &published, &mut []).await?;
    cdc_cpu(c, &dbs.cdc, &names.cdc_slot, &relay, machine).await?;
    let census = pg::tls_census(&dbs.cdc, dbs.db_prefix).await?;
    c.report.environment("postgres_tls_cdc_drain", &census);
    let keys = (Figure::CdcPeakRss, Figure::CdcDrain);
    drained(c, relay, &dbs.cdc, elapsed, keys).await
}

/// The CPU time per row of a CDC drain that just ended (`relay` still running, so its
/// walsender too): the machine's since `machine` (every core: the relay, the walsender, the
/// broker, the marks, the bench's own polling), the relay's and the walsender's since they
/// started; and the rate the machine's cores could reach at that cost, all busy.
async fn cdc_cpu(
    c: &mut Ctx<'_>,
    pool: &PgPool,
    slot: &str,
    relay: &Child,
    machine: Option<cpu::MachineCpu>,
) -> anyhow::Result<()> {
    let rows = c.args.backlog;
    let walsender: Option<i32> =
        sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
            .bind(slot)
            .fetch_optional(pool)
            .await?
            .flatten();
    let walsender = walsender.and_then(|p| u32::try_from(p).ok());
    let per_row = |d: Option<Duration>| d.map_or(f64::NAN, |d| cpu::us_per_row(d, rows));
    let all = per_row(machine.and_then(|m| m.busy_since()));
    c.report.figure(Figure::CdcDrainCpu, all);
    c.report.figure(
        Figure::CdcDrainCpuBound,
        cpu::bound_per_s(cpu::cores(), all),
    );
    let relay_cpu = per_row(relay.pid().and_then(cpu::process_cpu));
    c.report.figure(Figure::CdcRelayCpu, relay_cpu);
    let walsender_cpu = per_row(walsender.and_then(cpu::process_cpu));
    c.report.figure(Figure::CdcWalsenderCpu, walsender_cpu);
    Ok(())
}

/// Waits until a session of `relay` reads `slot` (the relay created it).
async fn slot_held(
    c: &Ctx<'_>,
    pool: &PgPool,
    slot: &str,
    relay: &mut Child,
) -> anyhow::Result<()> {
    // The slot is ours (a UUID), never input.
    let what = format!("pg_replication_slots WHERE slot_name = '{slot}' AND active");
    let held = Watch {
        pool,
        what: &what,
        label: "CDC relay sessions on the slot",
    };
    let (timeout, stall) = (drain_timeout(c.args), plan::stall_limit(c.args));
    wait_for(c.progress, &held, 1, &mut [relay], timeout, stall).await
}

/// The settlement consumer drains the topic: its rate from the settlements' stamps, its peak
/// RSS.
async fn consumer_drain(c: &mut Ctx<'_>, dbs: &SystemDbs<'_>) -> anyhow::Result<()> {
    let (settlement, elapsed) = settle_drain(
        c,
        dbs.logs,
        "settlement",
        &settlement_args(c, dbs),
        &dbs.settle,
    )
    .await?;
    c.report
        .peak(Figure::ConsumerPeakRss, settlement.peak_rss());
    settlement.stop().await?;
    let v = pg::stamped_rate(&dbs.settle, "settlements", "settled_at", "true", elapsed).await?;
    c.report.figure(Figure::ConsumerDrain, v);
    Ok(())
}

/// `idem-lab settlement` on the settlement database, in the run's group.
fn settlement_args(c: &Ctx<'_>, dbs: &SystemDbs<'_>) -> Vec<String> {
    plan::consumer_args(
        c.args,
        &["settlement"],
        &dbs.settle_url,
        c.kafka.brokers(),
        &dbs.names.topic,
        &dbs.names.group,
    )
}

/// The same consumer with the inbox insert left out: what the inbox costs.
async fn no_inbox_drain(c: &mut Ctx<'_>, dbs: &SystemDbs<'_>) -> anyhow::Result<()> {
    let bare_args = plan::consumer_args(
        c.args,
        &["bench", "no-inbox-consumer"],
        &dbs.noinbox_url,
        c.kafka.brokers(),
        &dbs.names.topic,
        &dbs.names.group_no_inbox,
    );
    let (bare, elapsed) =
        settle_drain(c, dbs.logs, "no-inbox-consumer", &bare_args, &dbs.noinbox).await?;
    bare.stop().await?;
    let v = pg::stamped_rate(&dbs.noinbox, "settlements", "settled_at", "true", elapsed).await?;
    c.report.figure(Figure::ConsumerNoInboxDrain, v);
    Ok(())
}

/// Every event published a second time, and the consumer's drain of the duplicates; the relay
/// and the consumer are left in `running`.
async fn duplicates(
    c: &mut Ctx<'_>,
    dbs: &SystemDbs<'_>,
    running: &mut Running,
) -> anyhow::Result<()> {
    running.relay = c
        .guarded(Phase::Republish, async |c| republish(c, dbs).await)
        .await;
    if running.relay.is_none() {
        clean_up_after(true, &dbs.orders_url).await?;
        // What the stuck relay did not republish was published once already: put it back, so
        // the sustained run's relay does not spend its time on a backlog of old rows first.
        sqlx::query("UPDATE idem_outbox SET status = 'published', published_at = now() WHERE status = 'pending'")
            .execute(&dbs.orders)
            .await?;
    }
    let relay = &mut running.relay;
    running.settlement = c
        .guarded(Phase::Duplicates, async |c| {
            duplicates_drain(c, dbs, relay).await
        })
        .await;
    clean_up_after(running.settlement.is_none(), &dbs.settle_url).await
}

/// Every outbox row made pending again and a new relay draining it; returns the relay, still
/// running.
async fn republish(c: &mut Ctx<'_>, dbs: &SystemDbs<'_>) -> anyhow::Result<Child> {
    sqlx::query("UPDATE idem_outbox SET status = 'pending', published_at = NULL")
        .execute(&dbs.orders)
        .await?;
    let republished = Watch {
        pool: &dbs.orders,
        what: PUBLISHED,
        label: "rows republished",
    };
    // A hostile session (the suite's): every row locked until this phase ends.
    let mut hostile = None;
    if c.args.lock_outbox_during_republish {
        let mut tx = dbs.orders.begin().await?;
        sqlx::query("SELECT id FROM idem_outbox FOR UPDATE")
            .execute(&mut *tx)
            .await?;
        hostile = Some(tx);
    }
    let relay_args = plan::relay_args(
        c.args,
        &dbs.orders_url,
        c.kafka.brokers(),
        &dbs.names.topic_prefix,
    );
    let (relay, _) = drain(c, dbs.logs, "relay-2", &relay_args, &republished, &mut []).await?;
    drop(hostile);
    Ok(relay)
}

/// The consumer's drain of the republished duplicates; returns it, still running.
async fn duplicates_drain(
    c: &mut Ctx<'_>,
    dbs: &SystemDbs<'_>,
    relay: &mut Option<Child>,
) -> anyhow::Result<Child> {
    // The group is ours (a UUID), never input.
    let dups = format!(
        "consumer_group = '{}' AND delivery_count >= 2",
        dbs.names.group
    );
    let what = format!("idem_inbox WHERE {dups}");
    let skipped = Watch {
        pool: &dbs.settle,
        what: &what,
        label: "duplicates skipped",
    };
    let mut others: Vec<&mut Child> = relay.iter_mut().collect();
    let args = settlement_args(c, dbs);
    let (settlement, elapsed) =
        drain(c, dbs.logs, "settlement-2", &args, &skipped, &mut others).await?;
    let v = pg::stamped_rate(
        &dbs.settle,
        "idem_inbox",
        "last_delivered_at",
        &dups,
        elapsed,
    )
    .await?;
    c.report.figure(Figure::DuplicatesDrain, v);
    Ok(settlement)
}

/// Starts a relay and a settlement consumer on the live pair where `running` has none.
fn ensure_running(c: &Ctx<'_>, dbs: &SystemDbs<'_>, running: &mut Running) -> anyhow::Result<()> {
    if running.relay.is_none() {
        let args = plan::relay_args(
            c.args,
            &dbs.live.orders_url,
            c.kafka.brokers(),
            &dbs.names.topic_prefix,
        );
        running.relay = Some(Child::spawn("relay-3", &args, &c.child_env, &dbs.logs.0)?);
    }
    if running.settlement.is_none() {
        let args = plan::consumer_args(
            c.args,
            &["settlement"],
            &dbs.live.settle_url,
            c.kafka.brokers(),
            &dbs.names.topic,
            &dbs.names.group,
        );
        running.settlement = Some(Child::spawn(
            "settlement-3",
            &args,
            &c.child_env,
            &dbs.logs.0,
        )?);
    }
    Ok(())
}

/// The sustained run, then the wait for what its writers left: returns the sustained rate.
async fn sustained(
    c: &mut Ctx<'_>,
    dbs: &SystemDbs<'_>,
    running: &mut Running,
) -> anyhow::Result<f64> {
    ensure_running(c, dbs, running)?;
    warm_up(c, dbs, running).await?;
    let census = pg::tls_census(&dbs.live.orders, dbs.db_prefix).await?;
    c.report.environment("postgres_tls_sustained", &census);
    let (sustained, writers) = sustained_rates(c, dbs).await?;
    if sustained <= 0.0 {
        // No latency run can be paced by a rate of zero.
        bail!("no order was settled during the sustained run ({writers:.0} written per second)");
    }
    c.report.figure(Figure::E2eWriters, writers);
    c.report.figure(Figure::E2eSustained, sustained);
    let expected = pg::count(&dbs.live.orders, "orders").await?;
    let label = "settled (draining what the writers left)";
    settled_on_live(c, dbs, running, expected, label).await?;
    Ok(sustained)
}

/// Waits until the live pair holds `target` settlements while its relay and consumer run.
async fn settled_on_live(
    c: &Ctx<'_>,
    dbs: &SystemDbs<'_>,
    running: &mut Running,
    target: u64,
    label: &str,
) -> anyhow::Result<()> {
    let settled = Watch {
        pool: &dbs.live.settle,
        what: "settlements",
        label,
    };
    let mut children: Vec<&mut Child> = running
        .relay
        .iter_mut()
        .chain(running.settlement.iter_mut())
        .collect();
    let (timeout, stall) = (drain_timeout(c.args), plan::stall_limit(c.args));
    wait_for(c.progress, &settled, target, &mut children, timeout, stall).await
}

/// One order through the live pipeline, waited for: the relay publishes and the consumer has
/// joined its group and settles before the sustained run's clock starts.
async fn warm_up(c: &Ctx<'_>, dbs: &SystemDbs<'_>, running: &mut Running) -> anyhow::Result<()> {
    let how = OrderWrite::Outbox(c.outbox.clone());
    pg::place_order(&dbs.live.orders, &how, "warm-", 1, c.pad).await?;
    settled_on_live(c, dbs, running, 1, "warm-up order settled").await
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
    let mut child = Child::spawn(name, args, &c.child_env, &logs.0)?;
    let mut watched: Vec<&mut Child> = vec![&mut child];
    watched.extend(others.iter_mut().map(|c| &mut **c));
    let (timeout, stall) = (drain_timeout(c.args), plan::stall_limit(c.args));
    wait_for(
        c.progress,
        watch,
        c.args.backlog,
        &mut watched,
        timeout,
        stall,
    )
    .await?;
    Ok((child, started.elapsed()))
}

/// Polls `watch` until it reaches `target`, failing if a child exits, the count stands still
/// for `stall` or the time runs out.
async fn wait_for(
    progress: &Progress,
    watch: &Watch<'_>,
    target: u64,
    children: &mut [&mut Child],
    timeout: Duration,
    stall: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut still = Stall::new(stall, Instant::now());
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
        let stuck = still.observe(n, Instant::now());
        if stuck.is_some() || Instant::now() > deadline {
            let logs: Vec<String> = children.iter().map(|c| c.log_tail()).collect();
            let why = stuck.map_or_else(
                || format!("{timeout:?} passed"),
                |s| format!("no progress for {:.0} s", s.as_secs_f64()),
            );
            bail!(
                "{label}: {n} of {target}, {why}; logs:\n{}",
                logs.join("\n---\n")
            );
        }
        tick.every_second(|| progress.note(&format!("{n}/{target} {label}")));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Writers as fast as they can for `--phase` while the relay and consumer run: settlements
/// per second over the run after a warm-up fifth, and orders written per second.
async fn sustained_rates(c: &Ctx<'_>, dbs: &SystemDbs<'_>) -> anyhow::Result<(f64, f64)> {
    let (secs, pad, progress) = (c.secs, c.pad, &*c.progress);
    let (pool, how) = (
        dbs.live.orders.clone(),
        OrderWrite::Outbox(c.outbox.clone()),
    );
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
    let (c0, t0) = (
        pg::count(&dbs.live.settle, "settlements").await?,
        Instant::now(),
    );
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
    let (c1, t1) = (
        pg::count(&dbs.live.settle, "settlements").await?,
        Instant::now(),
    );
    let writer_rate = writers.await??;
    Ok((plan::rate(c1 - c0, t1.duration_since(t0)), writer_rate))
}

/// Commit → settlement latency under open-loop arrivals at each load of the sustained rate.
async fn latency(
    c: &mut Ctx<'_>,
    dbs: &SystemDbs<'_>,
    running: &mut Running,
    sustained: f64,
) -> anyhow::Result<()> {
    for (pct, rate) in plan::open_loop_rates(sustained) {
        c.progress.note(&format!(
            "{pct} %: {rate:.0} orders/s for {:.0} s",
            c.args.seconds
        ));
        for child in running
            .relay
            .iter_mut()
            .chain(running.settlement.iter_mut())
        {
            child.check_alive()?;
        }
        let prefix = format!("l{pct}-");
        let run = latency::open_loop(
            &dbs.live.orders,
            &dbs.live.settle,
            c.outbox,
            &prefix,
            c.pad,
            rate,
            c.secs,
            c.n,
        )
        .await?;
        c.progress.note(&format!(
            "{pct} %: p50 {:.1} ms, p99 {:.1} ms, p99.9 {:.1} ms ({} samples); order tx p50 {:.1} p99 {:.1} ms, relay stage p50 {:.1} p99 {:.1} ms, consumer stage p50 {:.1} p99 {:.1} ms",
            run.p50_ms, run.p99_ms, run.p999_ms, run.samples, run.order_tx_ms.0, run.order_tx_ms.1,
            run.relay_stage_ms.0, run.relay_stage_ms.1, run.consumer_stage_ms.0, run.consumer_stage_ms.1
        ));
        c.report.latency(pct, &run);
    }
    Ok(())
}
