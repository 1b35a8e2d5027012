//! The `redelivered_records` fault: records already in the pipeline's topics produced again,
//! key, value and headers as they were, into their partition. At-least-once delivery permits
//! it at any time — a producer retrying a batch whose acknowledgement was lost, a relay
//! republishing a row whose mark was lost, a mirror copying twice — so every consumer must
//! absorb each copy; one without an inbox applies its effect again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};

/// The runner's own clients log nothing: a copy that cannot be made while a broker is down is
/// a line of the timeline, not errors on the run's output. Counts the copies delivered.
#[derive(Default)]
struct Quiet {
    delivered: AtomicUsize,
}

impl ClientContext for Quiet {
    fn log(&self, _: rdkafka::config::RDKafkaLogLevel, _: &str, _: &str) {}
    fn error(&self, _: KafkaError, _: &str) {}
}

impl ConsumerContext for Quiet {}

impl ProducerContext for Quiet {
    type DeliveryOpaque = ();
    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if result.is_ok() {
            self.delivered.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Records read back from the end of each partition, among which the copies are chosen.
const RECENT: i64 = 50;

/// How long reading them back and producing the copies may take.
const WITHIN: Duration = Duration::from_secs(10);

/// Copies `n` records of the last [`RECENT`] of each partition of `topic`, chosen by `pick`
/// (an index below its argument): the partition and offset of each original. Blocking.
pub(super) fn copy_recent(
    conn: &ClientConfig,
    topic: &str,
    n: usize,
    pick: &mut dyn FnMut(usize) -> usize,
) -> anyhow::Result<Vec<(i32, i64)>> {
    let recent = read_recent(conn, topic)?;
    if recent.is_empty() {
        return Ok(vec![]);
    }
    let producer: BaseProducer<Quiet> = producer_config(conn)
        .create_with_context(Quiet::default())
        .context("creating the producer of copies")?;
    let mut copied = vec![];
    for _ in 0..n {
        let m = &recent[pick(recent.len())];
        let mut record = BaseRecord::<[u8], [u8]>::to(topic).partition(m.partition());
        if let Some(k) = m.key() {
            record = record.key(k);
        }
        if let Some(v) = m.payload() {
            record = record.payload(v);
        }
        if let Some(h) = m.headers() {
            record = record.headers(copy_headers(h));
        }
        producer
            .send(record)
            .map_err(|(e, _)| e)
            .context("producing a copy")?;
        copied.push((m.partition(), m.offset()));
    }
    producer.flush(WITHIN).context("delivering the copies")?;
    let delivered = producer.context().delivered.load(Ordering::Relaxed);
    if delivered < copied.len() {
        bail!(
            "{delivered} of {} copies delivered (of {copied:?}): the broker refused or timed out",
            copied.len()
        );
    }
    Ok(copied)
}

fn copy_headers<H: Headers>(h: &H) -> OwnedHeaders {
    h.iter().fold(OwnedHeaders::new(), |out, header| {
        out.insert(Header {
            key: header.key,
            value: header.value,
        })
    })
}

fn producer_config(conn: &ClientConfig) -> ClientConfig {
    let mut cfg = conn.clone();
    cfg.set("acks", "all")
        .set("enable.idempotence", "false")
        .set("message.timeout.ms", "8000");
    cfg
}

/// The last [`RECENT`] records of each partition of `topic`.
fn read_recent(conn: &ClientConfig, topic: &str) -> anyhow::Result<Vec<OwnedMessage>> {
    let deadline = Instant::now() + WITHIN;
    let mut cfg = conn.clone();
    cfg.set("group.id", "idem-lab-redeliver")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false");
    let consumer: BaseConsumer<Quiet> = cfg
        .create_with_context(Quiet::default())
        .context("creating the reader of copies")?;
    let metadata = consumer
        .fetch_metadata(Some(topic), WITHIN)
        .with_context(|| format!("reading the metadata of {topic}"))?;
    let mut tpl = TopicPartitionList::new();
    let mut ends = vec![];
    for p in metadata.topics().iter().flat_map(|t| t.partitions()) {
        let (lo, hi) = consumer
            .fetch_watermarks(topic, p.id(), WITHIN)
            .with_context(|| format!("reading the watermarks of {topic}/{}", p.id()))?;
        if hi > lo {
            tpl.add_partition_offset(topic, p.id(), Offset::Offset(lo.max(hi - RECENT)))?;
            ends.push((p.id(), hi));
        }
    }
    if ends.is_empty() {
        return Ok(vec![]);
    }
    consumer.assign(&tpl)?;
    let mut out = vec![];
    let mut left: std::collections::HashMap<i32, i64> = ends.into_iter().collect();
    while !left.is_empty() && Instant::now() < deadline {
        let Some(msg) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let msg = msg.with_context(|| format!("reading {topic}"))?;
        if left
            .get(&msg.partition())
            .is_some_and(|hi| msg.offset() + 1 >= *hi)
        {
            left.remove(&msg.partition());
        }
        out.push(msg.detach());
    }
    Ok(out)
}
