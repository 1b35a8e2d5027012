//! The baselines, measured first on the same server and broker: durable single-row inserts,
//! business transactions (alone, with the outbox, with a plain second row), the consumer's and
//! the relay's own SQL called directly, and bare rdkafka produce and consume.

use sqlx::PgPool;

use super::kafka;
use super::pg::{self, OrderWrite};
use super::plan::{Phase, drain_timeout};
use super::{Ctx, Ticker};

/// Every baseline, in [`PHASES`](super::plan::PHASES) order, on the `scratch` database and
/// the `raw_topic`.
pub async fn run(c: &mut Ctx<'_>, scratch: &PgPool, raw_topic: &str) -> anyhow::Result<()> {
    inserts(c, scratch).await?;
    business(c, scratch).await?;
    consumer_sql(c, scratch).await?;
    relay_sql(c, scratch).await?;
    raw_kafka(c, raw_topic).await
}

async fn inserts(c: &mut Ctx<'_>, scratch: &PgPool) -> anyhow::Result<()> {
    c.phase(Phase::Inserts1);
    let v = pg::insert_rate(scratch, 1, c.secs, c.args.message_size).await?;
    c.report.figure("pg_insert_1conn_per_s", v);
    c.phase(Phase::InsertsN);
    let v = pg::insert_rate(scratch, c.n, c.secs, c.args.message_size).await?;
    c.report.figure("pg_insert_nconn_per_s", v);
    Ok(())
}

async fn business(c: &mut Ctx<'_>, scratch: &PgPool) -> anyhow::Result<()> {
    sqlx::query(pg::PLAIN_TABLE).execute(scratch).await?;
    for (phase, conns, suffix) in [
        (Phase::Business1, 1, "1conn"),
        (Phase::BusinessN, c.n, "nconn"),
    ] {
        c.phase(phase);
        for (how, key) in [
            (OrderWrite::Alone, format!("business_tx_{suffix}_per_s")),
            (
                OrderWrite::Outbox(c.outbox.clone()),
                format!("business_tx_outbox_{suffix}_per_s"),
            ),
            (
                OrderWrite::PlainRow,
                format!("business_tx_plain_{suffix}_per_s"),
            ),
        ] {
            let prefix = format!("{key}-");
            let v = business_rate(scratch, how, conns, c, &prefix).await?;
            c.report.figure(&key, v);
        }
    }
    Ok(())
}

/// Business transactions per second on `conns` connections, writing their event as `how` says.
async fn business_rate(
    pool: &PgPool,
    how: OrderWrite,
    conns: u32,
    c: &Ctx<'_>,
    prefix: &str,
) -> anyhow::Result<f64> {
    let (pool, prefix, pad) = (pool.clone(), prefix.to_owned(), c.pad);
    pg::closed_loop(conns, c.secs, move |i| {
        let (pool, how, prefix) = (pool.clone(), how.clone(), prefix.clone());
        async move { pg::place_order(&pool, &how, &prefix, i, pad).await }
    })
    .await
}

async fn consumer_sql(c: &mut Ctx<'_>, scratch: &PgPool) -> anyhow::Result<()> {
    c.phase(Phase::ConsumerSql);
    let (batch, secs, pad) = (c.args.batch_size, c.secs, c.pad);
    let v = pg::consumer_sql_rate(scratch, batch, secs, pad, true, "s1-").await?;
    c.report.figure("consumer_sql_per_s", v);
    let v = pg::consumer_sql_rate(scratch, batch, secs, pad, false, "s2-").await?;
    c.report.figure("consumer_sql_no_inbox_per_s", v);
    Ok(())
}

async fn relay_sql(c: &mut Ctx<'_>, scratch: &PgPool) -> anyhow::Result<()> {
    c.phase(Phase::RelaySql);
    sqlx::query("TRUNCATE idem_outbox, idem_outbox_aggregates")
        .execute(scratch)
        .await?;
    pg::fill_backlog(scratch, "r-", c.args.backlog, c.pad).await?;
    let mut tick = Ticker::new();
    let progress = &*c.progress;
    let v = pg::relay_sql_rate(scratch, c.args.relay_batch_size, |rows| {
        tick.every_second(|| progress.note(&format!("claimed and marked {rows} rows")));
    })
    .await?;
    c.report.figure("relay_sql_per_s", v);
    Ok(())
}

async fn raw_kafka(c: &mut Ctx<'_>, raw_topic: &str) -> anyhow::Result<()> {
    c.phase(Phase::Produce);
    let payload = pg::order_event("b-", 1, c.pad)?
        .1
        .payload()
        .as_bytes()
        .to_vec();
    let mut tick = Ticker::new();
    let (progress, backlog) = (&*c.progress, c.args.backlog);
    let v = kafka::produce_rate(&c.brokers, raw_topic, backlog, &payload, |done| {
        tick.every_second(|| progress.note(&format!("{done} records acknowledged")));
    })
    .await?;
    c.report.figure("kafka_produce_per_s", v);

    c.phase(Phase::Consume);
    let mut tick = Ticker::new();
    let (progress, timeout) = (&*c.progress, drain_timeout(c.args));
    let v = kafka::consume_rate(&c.brokers, raw_topic, backlog, timeout, |done| {
        tick.every_second(|| progress.note(&format!("{done} records consumed")));
    })
    .await?;
    c.report.figure("kafka_consume_per_s", v);
    Ok(())
}
