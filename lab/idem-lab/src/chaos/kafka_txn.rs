//! The `kafka-transactions` negative control (`idem-lab chaos --break kafka-transactions`): a
//! settlement consumer that trusts Kafka's exactly-once machinery instead of an inbox. It
//! reads with `isolation.level=read_committed`, applies each batch with the reference
//! settlement handler in one database transaction **without an inbox**, and after the database
//! commit sends the batch's offsets in a Kafka transaction (`send_offsets_to_transaction`,
//! KIP-447 group fencing).
//!
//! Kafka transactions make the *Kafka* side atomic — consumed offsets and produced records —
//! but the database commit is outside them. A crash between the database commit and the
//! Kafka commit (`consumer.after_db_commit_before_offset_commit`), a rebalance, or a record the
//! relay published twice makes the handler apply an event again: duplicate effects, which the
//! chaos run must report. It is the test behind the seed article's warning that "we turned on
//! Kafka exactly-once, so there are no duplicates" is false for database side effects
//! (docs/concepts/duplicate-windows.md). Never use this consumer for anything but that proof.

use std::time::Duration;

use anyhow::Context;
use clap::Args;
use idem_consumer::{Handler, HandlerContext};
use idem_core::crash;
use idem_core::store::InboxStore;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{BaseProducer, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// Options of the Kafka-transactions settlement consumer.
#[derive(Args, Debug)]
pub(crate) struct KafkaTxnArgs {
    #[command(flatten)]
    target: crate::lab_consumer::LabConsumerArgs,
    /// Record one points award intent per payment, as `idem-lab settlement --points-url` does.
    #[arg(long)]
    points_url: Option<String>,
}

const KAFKA_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) async fn run(all: KafkaTxnArgs) -> anyhow::Result<()> {
    if !crash::broken(crash::Mechanism::KafkaTransactions) {
        anyhow::bail!(
            "idem-lab kafka-txn-settlement is the chaos runner's negative control: it applies \
             effects twice on purpose, so it runs only under `idem-lab chaos --break \
             kafka-transactions` (IDEM_BREAK=kafka-transactions); use `idem-lab settlement` for \
             real work"
        );
    }
    let args = &all.target;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&args.db)
        .await
        .context("connecting to the settlement database")?;
    idem_reference::ensure_schema_postgres(&pool).await?;
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &args.brokers)
        .set("group.id", &args.group)
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest");
    for (k, v) in &args.consumer_config {
        cc.set(k, v);
    }
    let member = cc
        .get("group.instance.id")
        .map(str::to_owned)
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let consumer: StreamConsumer = cc.create().context("creating the consumer")?;
    consumer.subscribe(&[&args.topic])?;
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("transactional.id", format!("{}-{member}", args.group))
        .set("transaction.timeout.ms", "10000")
        .create()
        .context("creating the transactional producer")?;
    tokio::task::block_in_place(|| producer.init_transactions(KAFKA_TIMEOUT))?;
    let handler = match all.points_url.clone() {
        Some(url) => idem_reference::Settlement::with_points(url),
        None => idem_reference::Settlement::new(),
    };
    let inbox = idem_sql::postgres::PgInbox::new(pool.clone(), idem_core::TableNames::default());
    consume(args, &pool, &inbox, &consumer, &producer, &handler).await
}

async fn consume<H: Handler<sqlx::PgConnection>>(
    args: &crate::lab_consumer::LabConsumerArgs,
    pool: &sqlx::PgPool,
    inbox: &idem_sql::postgres::PgInbox,
    consumer: &StreamConsumer,
    producer: &BaseProducer,
    handler: &H,
) -> anyhow::Result<()> {
    eprintln!(
        "idem kafka-txn-settlement: group {} consuming {} (NEGATIVE CONTROL: no inbox)",
        args.group, args.topic
    );
    loop {
        let mut batch = vec![idem_kafka::source::to_delivery(&consumer.recv().await?)];
        while batch.len() < args.batch_size {
            match tokio::time::timeout(Duration::from_millis(20), consumer.recv()).await {
                Ok(m) => batch.push(idem_kafka::source::to_delivery(&m?)),
                Err(_) => break,
            }
        }
        let mut tx = pool.begin().await?;
        for d in &batch {
            let Ok(event) = idem_core::wire::decode(d) else {
                continue;
            };
            // Permanent failures (a foreign writer's hostile rows) are skipped, as the decode
            // failures are: there is no dead-letter table in this design. Crashing on them
            // would wedge the group, and the control would prove a wedge, not a duplicate.
            sqlx::query("SAVEPOINT event").execute(&mut *tx).await?;
            let mut posted = vec![];
            let handled = handler
                .handle(
                    &mut HandlerContext::new(&mut *tx, &event, &mut posted),
                    &event,
                )
                .await;
            match handled {
                Ok(()) => {
                    // The effects are recorded in the transaction, as the consumer does; this
                    // design's flaw is the missing inbox, not the effect stage.
                    inbox.record_effects(&mut *tx, &posted).await?;
                }
                Err(idem_consumer::HandlerError::Permanent(reason)) => {
                    eprintln!(
                        "idem kafka-txn-settlement: skipping {}: {reason}",
                        event.event_id
                    );
                    sqlx::query("ROLLBACK TO SAVEPOINT event")
                        .execute(&mut *tx)
                        .await?;
                }
                Err(e) => anyhow::bail!("the handler failed on {}: {e:?}", event.event_id),
            }
        }
        tx.commit().await?;
        crash::crash_point(crash::CrashPoint::ConsumerAfterDbCommitBeforeOffsetCommit)?;
        let mut next: std::collections::BTreeMap<(&str, i32), i64> = Default::default();
        for d in &batch {
            let o = next.entry((d.topic.as_str(), d.partition)).or_default();
            *o = (*o).max(d.offset + 1);
        }
        let mut offsets = TopicPartitionList::new();
        for ((topic, partition), offset) in next {
            offsets.add_partition_offset(topic, partition, Offset::Offset(offset))?;
        }
        let group = consumer
            .group_metadata()
            .context("the consumer has no group metadata")?;
        tokio::task::block_in_place(|| -> anyhow::Result<()> {
            producer.begin_transaction()?;
            producer.send_offsets_to_transaction(&offsets, &group, KAFKA_TIMEOUT)?;
            producer.commit_transaction(KAFKA_TIMEOUT)?;
            Ok(())
        })?;
    }
}
