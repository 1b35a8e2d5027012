//! The measurements of the hardware, on the scratch database and the raw topic: durable
//! single-row inserts and business transactions (alone, with the outbox, with a plain second
//! row, with a logical decoding message) first, then the ceilings that bracket each system phase ([`relay`], [`consumer`],
//! [`writers`]), each bracket with the round trip of one statement.

use std::time::Duration;

use super::ceilings;
use super::cpu;
use super::figures::Figure;
use super::kafka;
use super::pg::{self, OrderWrite};
use super::plan::{self, Phase, drain_timeout};
use super::{Ctx, Ticker};

/// The first phases: durable inserts and business transactions. A phase that fails is
/// reported and the run goes on.
pub(super) async fn run(c: &mut Ctx<'_>) {
    c.guarded(Phase::Inserts1, async |c| {
        inserts(c, 1, Figure::PgInsert1).await
    })
    .await;
    let n = c.n;
    c.guarded(Phase::InsertsN, async |c| {
        inserts(c, n, Figure::PgInsertN).await
    })
    .await;
    c.guarded(Phase::Business1, async |c| business(c, 1, BUSINESS_1).await)
        .await;
    c.guarded(Phase::BusinessN, async |c| business(c, n, BUSINESS_N).await)
        .await;
}

async fn inserts(c: &mut Ctx<'_>, conns: u32, figure: Figure) -> anyhow::Result<()> {
    let v = pg::insert_rate(c.scratch, conns, c.secs, c.args.message_size).await?;
    c.report.figure(figure, v);
    Ok(())
}

/// The figures of [`business`] on one connection, in the order of its writes.
const BUSINESS_1: [Figure; 5] = [
    Figure::BusinessTx1,
    Figure::BusinessTxOutbox1,
    Figure::BusinessTxPlain1,
    Figure::BusinessTxMessage1,
    Figure::BusinessTxMessageSeparate1,
];
/// The same on `--connections`.
const BUSINESS_N: [Figure; 5] = [
    Figure::BusinessTxN,
    Figure::BusinessTxOutboxN,
    Figure::BusinessTxPlainN,
    Figure::BusinessTxMessageN,
    Figure::BusinessTxMessageSeparateN,
];

/// Business transactions alone, with the outbox, with a plain second row and with a logical
/// decoding message (the CDC relay's message mode; in the order's statement, and in one of its
/// own) on `conns` connections, alternating for `--ceiling-runs` rounds (each kind `--phase`
/// in all), so a swing of the flush cost hits the five alike.
async fn business(c: &mut Ctx<'_>, conns: u32, figures: [Figure; 5]) -> anyhow::Result<()> {
    sqlx::query(pg::PLAIN_TABLE).execute(c.scratch).await?;
    let rounds = plan::ceiling_runs(c.args);
    let secs = c.secs / rounds;
    for round in 0..rounds {
        let message = idem_sql::postgres::MessageOutbox::default;
        let writes = [
            OrderWrite::Alone,
            OrderWrite::Outbox(c.outbox.clone()),
            OrderWrite::PlainRow,
            OrderWrite::Message(message()),
            OrderWrite::MessageSeparate(message()),
        ];
        for (how, figure) in writes.into_iter().zip(figures) {
            let prefix = format!("{}-{round}-", figure.key());
            let v = business_rate(c, c.scratch, how, conns, secs, &prefix).await?;
            c.report.sample(figure, v);
        }
    }
    Ok(())
}

/// Business transactions per second on `conns` connections for `secs`, writing their event as
/// `how` says, on the scratch database.
async fn business_rate(
    c: &Ctx<'_>,
    db: &sqlx::PgPool,
    how: OrderWrite,
    conns: u32,
    secs: Duration,
    prefix: &str,
) -> anyhow::Result<f64> {
    let (pool, prefix, pad) = (db.clone(), prefix.to_owned(), c.pad);
    pg::closed_loop(conns, secs, move |i| {
        let (pool, how, prefix) = (pool.clone(), how.clone(), prefix.clone());
        async move { pg::place_order(&pool, &how, &prefix, i, pad).await }
    })
    .await
}

/// One sample of the round trip of `SELECT 1` (at most a second of them).
async fn round_trip(c: &mut Ctx<'_>) -> anyhow::Result<()> {
    let secs = c.secs.min(Duration::from_secs(1));
    let us = ceilings::round_trip_us(c.scratch_url, secs).await?;
    c.report.sample(Figure::RoundTrip, us);
    Ok(())
}

/// The relay's ceilings, `tag` naming the side: for each run a fresh backlog of the same shape
/// on the scratch database drained by the lean claim-and-mark, and a raw produce of as many
/// relay-like records.
pub(super) async fn relay(c: &mut Ctx<'_>, tag: &str) -> anyhow::Result<()> {
    round_trip(c).await?;
    for run in 0..plan::ceiling_runs(c.args) {
        sqlx::query("TRUNCATE idem_outbox")
            .execute(c.scratch)
            .await?;
        let prefix = format!("r{tag}{run}-");
        pg::fill_backlog(c.scratch, &prefix, c.args.backlog, c.pad).await?;
        let mut tick = Ticker::new();
        let progress = &*c.progress;
        let (_, v) = ceilings::relay_rate(c.scratch_url, c.args.relay_batch_size, |rows| {
            tick.every_second(|| progress.note(&format!("claimed and marked {rows} rows")));
        })
        .await?;
        c.report.sample(Figure::CeilingRelay, v);
        raw_produce(c, Figure::KafkaProduce, None).await?;
    }
    Ok(())
}

/// The CDC relay's ceilings, `tag` naming the side, `--ceiling-runs` times: the server's
/// pgoutput decoding of a fresh backlog of the same shape (written in transactions of
/// `--relay-batch-size` rows after a slot was created), and a raw produce of as many relay-like
/// records.
pub(super) async fn cdc(c: &mut Ctx<'_>, tag: &str) -> anyhow::Result<()> {
    round_trip(c).await?;
    for run in 0..plan::ceiling_runs(c.args) {
        sqlx::query("TRUNCATE idem_outbox")
            .execute(c.scratch)
            .await?;
        let prefix = format!("d{tag}{run}-");
        let (pool, backlog, pad) = (c.scratch, c.args.backlog, c.pad);
        let per_tx = u64::from(c.args.relay_batch_size);
        let slot = format!("idem_bench_decode_{}", std::process::id());
        let fill =
            async || pg::fill_backlog_in_transactions(pool, &prefix, backlog, per_tx, pad).await;
        let v =
            ceilings::decode_rate(c.scratch_url, &slot, "idem_bench_decode", backlog, fill).await?;
        c.report.sample(Figure::CeilingCdcDecode, v);
        let cpu = Some(Figure::CeilingCdcProduceCpu);
        raw_produce(c, Figure::CeilingCdcProduce, cpu).await?;
    }
    Ok(())
}

/// One sample of `figure`: a raw produce of `--backlog` relay-like records; with `cpu`, one
/// of the machine's CPU time per record too (every core: the client and the broker).
async fn raw_produce(c: &mut Ctx<'_>, figure: Figure, cpu: Option<Figure>) -> anyhow::Result<()> {
    let payload = pg::order_event("b-", 1, c.pad)?
        .1
        .payload()
        .as_bytes()
        .to_vec();
    let mut tick = Ticker::new();
    let (progress, backlog) = (&*c.progress, c.args.backlog);
    let machine = cpu::MachineCpu::now();
    let v = kafka::produce_rate(&c.kafka, c.raw_topic, backlog, &payload, |done| {
        tick.every_second(|| progress.note(&format!("{done} records acknowledged")));
    })
    .await?;
    c.report.sample(figure, v);
    if let Some((cpu_figure, busy)) = cpu.zip(machine.and_then(|m| m.busy_since())) {
        c.report.sample(cpu_figure, cpu::us_per_row(busy, backlog));
    }
    Ok(())
}

/// Raw consume of `--backlog` of the raw topic's records by a new group.
pub(super) async fn raw_consume(c: &mut Ctx<'_>) -> anyhow::Result<()> {
    let mut tick = Ticker::new();
    let (progress, timeout) = (&*c.progress, drain_timeout(c.args));
    let v = kafka::consume_rate(&c.kafka, c.raw_topic, c.args.backlog, timeout, |done| {
        tick.every_second(|| progress.note(&format!("{done} records consumed")));
    })
    .await?;
    c.report.figure(Figure::KafkaConsume, v);
    Ok(())
}

/// The consumer's ceilings, `tag` naming the side: the set-based batch on one connection and
/// on one connection per partition, `--ceiling-runs` times each, alternating.
pub(super) async fn consumer(c: &mut Ctx<'_>, tag: &str) -> anyhow::Result<()> {
    round_trip(c).await?;
    let parts = plan::partitions(c.args);
    for run in 0..plan::ceiling_runs(c.args) {
        for (conns, figure) in [
            (1, Figure::CeilingConsumer1),
            (parts, Figure::CeilingConsumerPartitions),
        ] {
            let prefix = format!("k{tag}{run}x{conns}-");
            ceilings::reset_consumer_tables(c.scratch_url).await?;
            let v =
                ceilings::consumer_rate(c.scratch_url, conns, c.args.batch_size, c.secs, &prefix)
                    .await?;
            c.report.sample(figure, v);
        }
    }
    Ok(())
}

/// Writers alone, `tag` naming the side: the sustained run's writers (business transaction
/// with the outbox, `--connections`) on a database of their own, created empty like the
/// sustained run's, where no relay or consumer reads, `--ceiling-runs` times.
pub(super) async fn writers(c: &mut Ctx<'_>, tag: &str) -> anyhow::Result<()> {
    round_trip(c).await?;
    for run in 0..plan::ceiling_runs(c.args) {
        let prefix = format!("w{tag}{run}-");
        let how = OrderWrite::Outbox(c.outbox.clone());
        let v = business_rate(c, c.writers, how, c.n, c.secs, &prefix).await?;
        c.report.sample(Figure::CeilingWriters, v);
    }
    Ok(())
}
