//! Reading a topic back, whole, for tests, `idem topic dump` and verification.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use idem_core::{Error, Result};
use rdkafka::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// A record's headers in order, values as lossy UTF-8 (a missing value is empty).
pub(crate) fn headers_of<M: Message>(m: &M) -> Vec<(String, String)> {
    m.headers()
        .map(|hs| {
            hs.iter()
                .map(|h| {
                    (
                        h.key.to_owned(),
                        h.value
                            .map(|v| String::from_utf8_lossy(v).into_owned())
                            .unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// End of partition is how [`read_all`] knows it is done, not an error worth logging.
struct QuietEof;

impl ClientContext for QuietEof {
    fn error(&self, error: KafkaError, reason: &str) {
        let eof = matches!(error, KafkaError::PartitionEOF(_))
            || error.rdkafka_error_code() == Some(rdkafka::error::RDKafkaErrorCode::PartitionEOF);
        if !eof {
            tracing::warn!(%error, reason, "kafka client error while reading a topic");
        }
    }
}

impl ConsumerContext for QuietEof {}

/// One record read back from a topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Partition.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Key as UTF-8 (lossy).
    pub key: Option<String>,
    /// Value as UTF-8 (lossy).
    pub payload: Option<String>,
    /// Headers in order, values as UTF-8 (lossy).
    pub headers: Vec<(String, String)>,
}

impl Record {
    /// The first header named `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        idem_core::wire::first_header(&self.headers, name)
    }
}

/// An inspection consumer on `conn`'s servers and security with `extra` settings.
fn inspector(conn: &ClientConfig, extra: &[(&str, &str)]) -> Result<BaseConsumer<QuietEof>> {
    let mut cfg = crate::admin::connection_of(conn);
    for (k, v) in extra {
        cfg.set(*k, *v);
    }
    cfg.create_with_context(QuietEof).map_err(|e| {
        Error::broker(
            "creating an inspection consumer",
            crate::security::client_error(&e),
        )
    })
}

/// Reads every record of `topic` up to the high watermarks taken when the call starts, in
/// partition then offset order. Fails if that takes longer than `timeout`.
pub fn read_all(brokers: &str, topic: &str, timeout: Duration) -> Result<Vec<Record>> {
    read_all_with(&crate::admin::connection(brokers), topic, timeout)
}

/// [`read_all`] through a connection (a [`crate::Connection::client_config`], or any client
/// configuration whose servers and security settings are used).
pub fn read_all_with(conn: &ClientConfig, topic: &str, timeout: Duration) -> Result<Vec<Record>> {
    let deadline = Instant::now() + timeout;
    let consumer = inspector(
        conn,
        &[
            ("group.id", "idem-inspect"),
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
            ("enable.partition.eof", "true"),
        ],
    )?;
    let metadata = consumer
        .fetch_metadata(Some(topic), remaining(deadline)?)
        .map_err(|e| Error::broker(format!("reading metadata of {topic}"), e))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic)
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    if partitions.is_empty() {
        return Err(Error::broker(
            format!("reading {topic}"),
            format!("topic {topic} has no partitions (does it exist?)"),
        ));
    }
    let mut high: HashMap<i32, i64> = HashMap::new();
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        let (lo, hi) = watermarks(&consumer, topic, *p, deadline)?;
        if hi > lo {
            high.insert(*p, hi);
            tpl.add_partition_offset(topic, *p, Offset::Offset(lo))
                .map_err(|e| Error::broker("assigning partitions", e))?;
        }
    }
    let mut out: BTreeMap<(i32, i64), Record> = BTreeMap::new();
    if high.is_empty() {
        return Ok(vec![]);
    }
    consumer
        .assign(&tpl)
        .map_err(|e| Error::broker("assigning partitions", e))?;
    // A partition is read when the consumer reports end-of-partition (computed from the fetch
    // responses) at or past the ListOffsets high watermark taken at the start. Both are needed:
    // some brokers (Tansu among them) answer ListOffsets with a watermark that leaves out the
    // last batch.
    let mut next: HashMap<i32, i64> = HashMap::new();
    let mut at_eof: HashMap<i32, bool> = HashMap::new();
    while high.iter().any(|(p, hi)| {
        !(at_eof.get(p).copied().unwrap_or(false) && next.get(p).copied().unwrap_or(0) >= *hi)
    }) {
        let Some(msg) = consumer.poll(remaining(deadline)?.min(Duration::from_millis(200))) else {
            continue;
        };
        let msg = match msg {
            Ok(m) => m,
            Err(KafkaError::PartitionEOF(p)) => {
                at_eof.insert(p, true);
                continue;
            }
            Err(e) => return Err(Error::broker(format!("reading {topic}"), e)),
        };
        let (p, o) = (msg.partition(), msg.offset());
        let headers = headers_of(&msg);
        out.insert(
            (p, o),
            Record {
                partition: p,
                offset: o,
                key: msg.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                payload: msg
                    .payload()
                    .map(|v| String::from_utf8_lossy(v).into_owned()),
                headers,
            },
        );
        next.insert(p, o + 1);
        at_eof.insert(p, false);
    }
    Ok(out.into_values().collect())
}

/// A partition's low and high watermarks, asked again until `deadline` while the cluster
/// answers with an error: right after a broker comes back, leadership moves and a request can
/// meet `NOT_LEADER_FOR_PARTITION` before the client's metadata catches up.
fn watermarks<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partition: i32,
    deadline: Instant,
) -> Result<(i64, i64)> {
    loop {
        match consumer.fetch_watermarks(topic, partition, remaining(deadline)?) {
            Ok(w) => return Ok(w),
            Err(e) if deadline.saturating_duration_since(Instant::now()) > RETRY_PAUSE => {
                tracing::debug!(error = %e, topic, partition, "reading watermarks; asking again");
                std::thread::sleep(RETRY_PAUSE);
            }
            Err(e) => {
                return Err(Error::broker(
                    format!("reading watermarks of {topic}/{partition}"),
                    e,
                ));
            }
        }
    }
}

/// How long [`watermarks`] waits before asking again.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

fn remaining(deadline: Instant) -> Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Error::broker(
            "reading a topic",
            "timed out before reaching the high watermark",
        ));
    }
    Ok(left)
}

/// The sum over `topic`'s partitions of the high watermarks the broker reports (a lower bound
/// on the records in the topic: some brokers leave the last batch out).
pub fn high_watermark_sum(brokers: &str, topic: &str, timeout: Duration) -> Result<i64> {
    let consumer = inspector(&crate::admin::connection(brokers), &[])?;
    let metadata = consumer
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| Error::broker(format!("reading metadata of {topic}"), e))?;
    let deadline = Instant::now() + timeout;
    let mut sum = 0;
    for t in metadata.topics().iter().filter(|t| t.name() == topic) {
        for p in t.partitions() {
            let (_, hi) = watermarks(&consumer, topic, p.id(), deadline)?;
            sum += hi;
        }
    }
    Ok(sum)
}

/// The offsets `group` has committed on `topic` (partition, next offset to read).
pub fn committed_offsets(
    brokers: &str,
    group: &str,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<(i32, i64)>> {
    committed_offsets_with(&crate::admin::connection(brokers), group, topic, timeout)
}

/// [`committed_offsets`] through a connection (servers and security of `conn`).
pub fn committed_offsets_with(
    conn: &ClientConfig,
    group: &str,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<(i32, i64)>> {
    let consumer = inspector(
        conn,
        &[("group.id", group), ("enable.auto.commit", "false")],
    )?;
    let committed = committed_of(&consumer, group, topic, timeout)?;
    Ok(committed
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) => Some((e.partition(), o)),
            _ => None,
        })
        .collect())
}

/// What `consumer`'s group committed on each partition of `topic` (each asked; a partition
/// without a commit answers an invalid offset).
fn committed_of<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    group: &str,
    topic: &str,
    timeout: Duration,
) -> Result<TopicPartitionList> {
    let metadata = consumer
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| Error::broker(format!("reading metadata of {topic}"), e))?;
    let mut tpl = TopicPartitionList::new();
    for t in metadata.topics().iter().filter(|t| t.name() == topic) {
        for p in t.partitions() {
            tpl.add_partition(topic, p.id());
        }
    }
    consumer
        .committed_offsets(tpl, timeout)
        .map_err(|e| Error::broker(format!("reading the offsets of group {group}"), e))
}

/// One partition of a group's topic: what the group committed and what the broker holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionLag {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The next offset the group reads, if it committed one.
    pub committed: Option<i64>,
    /// The partition's high watermark.
    pub high: i64,
}

impl PartitionLag {
    /// Records the group has still to read: the high watermark less its committed offset (all
    /// of them before a first commit).
    pub fn lag(&self) -> i64 {
        (self.high - self.committed.unwrap_or(0)).max(0)
    }
}

/// The topics of the cluster other than its internal ones (`__…`), by name, at most `max`.
pub fn topics_with(conn: &ClientConfig, max: usize, timeout: Duration) -> Result<Vec<String>> {
    let consumer = inspector(conn, &[])?;
    let metadata = consumer
        .fetch_metadata(None, timeout)
        .map_err(|e| Error::broker("listing the topics", e))?;
    let mut names: Vec<String> = metadata
        .topics()
        .iter()
        .map(|t| t.name().to_owned())
        .filter(|n| !n.starts_with("__"))
        .collect();
    names.sort();
    names.truncate(max);
    Ok(names)
}

/// `group`'s committed offset and the high watermark of each partition of `topics`, for the
/// topics where the group committed something (a group that never read a topic has no lag on
/// it). Fails if the cluster does not answer within `timeout`.
pub fn group_lag_with(
    conn: &ClientConfig,
    group: &str,
    topics: &[String],
    timeout: Duration,
) -> Result<Vec<PartitionLag>> {
    let deadline = Instant::now() + timeout;
    let consumer = inspector(
        conn,
        &[("group.id", group), ("enable.auto.commit", "false")],
    )?;
    let mut out = vec![];
    for topic in topics {
        let committed = committed_of(&consumer, group, topic, remaining(deadline)?)?;
        let offsets: Vec<(i32, Option<i64>)> = committed
            .elements()
            .iter()
            .map(|e| match e.offset() {
                Offset::Offset(o) => (e.partition(), Some(o)),
                _ => (e.partition(), None),
            })
            .collect();
        if offsets.iter().all(|(_, o)| o.is_none()) {
            continue;
        }
        for (partition, committed) in offsets {
            let (_, high) = watermarks(&consumer, topic, partition, deadline)?;
            out.push(PartitionLag {
                topic: topic.clone(),
                partition,
                committed,
                high,
            });
        }
    }
    Ok(out)
}
