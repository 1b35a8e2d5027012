//! The raw rdkafka produce and consume baselines, and how many partitions a topic needs on the
//! broker under test.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use idem_core::outbox::OutboxRecord;
use idem_core::{EventId, wire};

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
pub(super) fn partitions_for(broker: &Broker, wanted: i32, records: u64, bytes: usize) -> i32 {
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
pub(super) struct TempDir(pub PathBuf);

impl TempDir {
    /// A new directory under the system's temporary directory.
    pub(super) fn new(what: &str) -> anyhow::Result<Self> {
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

/// When every relay-like record's event happened: 2026-01-01T00:00:00Z.
const OCCURRED_AT: i64 = 1_767_225_600;

/// The key and headers the relay puts on `order.paid` record `n` (same names, same sizes:
/// [`wire::encode`] of a first attempt, the value left out).
pub(super) fn relay_like(n: u64, occurred_at: DateTime<Utc>) -> (String, Vec<(String, String)>) {
    let order = format!("b-order-{n}");
    let record = OutboxRecord {
        id: i64::try_from(n).unwrap_or(i64::MAX),
        event_id: EventId::new(),
        aggregate_type: idem_reference::ORDER.to_owned(),
        aggregate_id: order,
        aggregate_seq: 1,
        event_type: idem_reference::ORDER_PAID.to_owned(),
        payload: String::new(),
        headers: BTreeMap::new(),
        topic: None,
        traceparent: None,
        occurred_at,
        created_at: occurred_at,
        attempt: 1,
        permanent_failures: 0,
    };
    let w = wire::encode(&record, "", None);
    (w.key, w.headers)
}

/// Produces `count` records of `payload` with relay-like keys and headers to `topic` through
/// one producer with idem's producer settings and the run's connection security, as fast as librdkafka takes them, and waits for
/// every delivery report. Returns records per second.
pub(super) async fn produce_rate(
    kafka: &idem_kafka::Connection,
    topic: &str,
    count: u64,
    payload: &[u8],
    mut progress: impl FnMut(u64),
) -> anyhow::Result<f64> {
    let config = kafka.producer_config(&[])?;
    let producer: FutureProducer = config.create()?;
    // Connection, metadata and producer id first: the rate is the steady one.
    let warm_up = FutureRecord::to(topic).key("warm-up").payload(payload);
    producer
        .send(warm_up, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| anyhow::anyhow!("warming the producer up: {e}"))?;
    let occurred_at = DateTime::from_timestamp(OCCURRED_AT, 0).context("a fixed time")?;
    let start = Instant::now();
    let mut pending = futures::stream::FuturesUnordered::new();
    let mut done = 0u64;
    for n in 1..=count {
        let (key, header_values) = relay_like(n, occurred_at);
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
    Ok(crate::num::per_second(count, start.elapsed()))
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

/// Consumes `count` records of `topic` with a new group (idem's consumer settings, the run's
/// connection security), copying each out as the consumer runtime does. Returns records per
/// second from the first record to the last (group join not counted).
pub(super) async fn consume_rate(
    kafka: &idem_kafka::Connection,
    topic: &str,
    count: u64,
    timeout: Duration,
    mut progress: impl FnMut(u64),
) -> anyhow::Result<f64> {
    let group = format!("bench-raw-{}", uuid::Uuid::new_v4().simple());
    let config = kafka.consumer_config(&group, &[])?;
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
    Ok(crate::num::per_second(
        seen.saturating_sub(1).max(1),
        elapsed,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_like_records_carry_the_relays_headers_in_its_order() {
        let at = DateTime::from_timestamp(OCCURRED_AT, 0).unwrap();
        let (key, headers) = relay_like(7, at);
        assert_eq!(key, "b-order-7");
        let names: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                wire::CE_SPECVERSION,
                wire::CE_ID,
                wire::CE_TYPE,
                wire::CE_SOURCE,
                wire::CE_TIME,
                wire::CE_SUBJECT,
                wire::CONTENT_TYPE,
                wire::IDEM_AGGREGATE_TYPE,
                wire::IDEM_AGGREGATE_ID,
                wire::IDEM_AGGREGATE_SEQ,
                wire::IDEM_ATTEMPT,
            ]
        );
        let h = |name| wire::first_header(&headers, name);
        assert_eq!(h(wire::CE_TIME), Some("2026-01-01T00:00:00.000000Z"));
        assert_eq!(h(wire::CE_SOURCE), Some("/idem/order"));
        assert_eq!(h(wire::CE_TYPE), Some("order.paid"));
        assert_eq!(h(wire::IDEM_AGGREGATE_ID), Some("b-order-7"));
        assert_eq!(h(wire::CE_ID).map(str::len), Some(36));
    }
}
