//! The raw rdkafka produce and consume baselines, and how many partitions a topic needs on the
//! broker under test.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::broker::Broker;
use rdkafka::Message as _;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// Partitions for a topic that must hold `records` records of about `bytes` bytes each:
/// `wanted`, or more on the mock cluster, which keeps only the last 5 MiB of a partition
/// (librdkafka's `rdkafka_mock.c`, not configurable) and would silently drop the start of
/// the backlog before the consumer reads it.
pub fn partitions_for(broker: &Broker, wanted: i32, records: u64, bytes: usize) -> i32 {
    match broker {
        Broker::Embedded(_) => {
            let per_partition = 4 * 1024 * 1024;
            let total = records.saturating_mul(bytes as u64);
            let needed = i32::try_from(total.div_ceil(per_partition)).unwrap_or(i32::MAX);
            wanted.max(needed)
        }
        _ => wanted,
    }
}

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A new directory under the system's temporary directory.
    pub fn new(what: &str) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "idem-bench-{what}-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(TempDir(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The headers the relay puts on an `order.paid` record (same names, same sizes).
pub fn relay_like_headers(n: u64) -> Vec<(String, String)> {
    let id = uuid::Uuid::now_v7().to_string();
    vec![
        ("ce_specversion".into(), "1.0".into()),
        ("ce_id".into(), id),
        ("ce_type".into(), "order.paid".into()),
        ("ce_source".into(), "/idem/order".into()),
        ("ce_time".into(), "2026-01-01T00:00:00.000000Z".into()),
        ("ce_subject".into(), format!("b-order-{n}")),
        ("content-type".into(), "application/json".into()),
        ("idem_aggregate_type".into(), "order".into()),
        ("idem_aggregate_id".into(), format!("b-order-{n}")),
        ("idem_aggregate_seq".into(), "1".into()),
        ("idem_attempt".into(), "1".into()),
    ]
}

/// Produces `count` records of `payload` with relay-like keys and headers to `topic` through
/// one producer with idem's producer settings, as fast as librdkafka takes them, and waits for
/// every delivery report. Returns records per second.
pub async fn produce_rate(
    brokers: &str,
    topic: &str,
    count: u64,
    payload: &[u8],
    mut progress: impl FnMut(u64),
) -> anyhow::Result<f64> {
    let config = idem_kafka::producer_config(brokers, &[])?;
    let producer: FutureProducer = config.create()?;
    // Connection, metadata and producer id first: the rate is the steady one.
    let warm_up = FutureRecord::to(topic).key("warm-up").payload(payload);
    producer
        .send(warm_up, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| anyhow::anyhow!("warming the producer up: {e}"))?;
    let start = Instant::now();
    let mut pending = futures::stream::FuturesUnordered::new();
    let mut done = 0u64;
    for n in 1..=count {
        let key = format!("b-order-{n}");
        let header_values = relay_like_headers(n);
        let mut headers = OwnedHeaders::new_with_capacity(header_values.len());
        for (k, v) in &header_values {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut record = FutureRecord::to(topic)
            .key(key.as_bytes())
            .payload(payload)
            .headers(headers);
        loop {
            match producer.send_result(record) {
                Ok(f) => {
                    pending.push(f);
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    done += drain_some(&mut pending).await?;
                    progress(done);
                }
                Err((e, _)) => return Err(e.into()),
            }
        }
    }
    use futures::StreamExt;
    while let Some(r) = pending.next().await {
        check_report(r)?;
        done += 1;
    }
    progress(done);
    Ok(count as f64 / start.elapsed().as_secs_f64().max(1e-9))
}

type Report = <rdkafka::producer::DeliveryFuture as std::future::Future>::Output;

fn check_report(r: Report) -> anyhow::Result<()> {
    match r {
        Ok(Ok(_)) => Ok(()),
        Ok(Err((e, _))) => Err(anyhow::anyhow!("a raw produce failed: {e}")),
        Err(_) => Err(anyhow::anyhow!("a raw produce report was lost")),
    }
}

async fn drain_some(
    pending: &mut futures::stream::FuturesUnordered<rdkafka::producer::DeliveryFuture>,
) -> anyhow::Result<u64> {
    use futures::StreamExt;
    let mut n = 0;
    // Wait for at least one report, then take whatever else is ready.
    if let Some(r) = pending.next().await {
        check_report(r)?;
        n += 1;
    }
    while let Some(Some(r)) = futures::FutureExt::now_or_never(pending.next()) {
        check_report(r)?;
        n += 1;
    }
    Ok(n)
}

/// Consumes `count` records of `topic` with a new group (idem's consumer settings), copying each
/// out as the consumer runtime does. Returns records per second from the first record to the
/// last (group join not counted).
pub async fn consume_rate(
    brokers: &str,
    topic: &str,
    count: u64,
    timeout: Duration,
    mut progress: impl FnMut(u64),
) -> anyhow::Result<f64> {
    let group = format!("bench-raw-{}", uuid::Uuid::new_v4().simple());
    let config = idem_kafka::consumer_config(brokers, &group, &[])?;
    let consumer: StreamConsumer = config.create()?;
    consumer.subscribe(&[topic])?;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut first: Option<Instant> = None;
    let mut seen = 0u64;
    let mut bytes = 0usize;
    while seen < count {
        let m = tokio::time::timeout_at(deadline, consumer.recv())
            .await
            .with_context(|| {
                format!("raw consume: {seen} of {count} records within {timeout:?}")
            })??;
        first.get_or_insert_with(Instant::now);
        let copy = (
            m.topic().to_owned(),
            m.key().map(<[u8]>::to_vec),
            m.payload().map(<[u8]>::to_vec),
        );
        bytes += copy.2.as_ref().map_or(0, Vec::len);
        seen += 1;
        if seen.is_multiple_of(1_000) {
            progress(seen);
        }
    }
    progress(seen);
    let elapsed = first.map_or(Duration::ZERO, |f| f.elapsed());
    tracing::debug!(bytes, "raw consume done");
    Ok(seen.saturating_sub(1).max(1) as f64 / elapsed.as_secs_f64().max(1e-9))
}
