#![doc = include_str!("../../../docs/integrating/wire-contract.md")]

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::event::{EventId, is_reserved_header};
use crate::inbox::{Delivery, InboundEvent};
use crate::outbox::OutboxRecord;

/// `ce_specversion`: the CloudEvents version, always [`SPECVERSION`].
pub const CE_SPECVERSION: &str = "ce_specversion";
/// `ce_id`: the event id (a UUID), the consumers' dedup key.
pub const CE_ID: &str = "ce_id";
/// `ce_type`: the event type.
pub const CE_TYPE: &str = "ce_type";
/// `ce_source`: the relay's `--source`, by default `/idem/<aggregate_type>`.
pub const CE_SOURCE: &str = "ce_source";
/// `ce_time`: when the business fact happened (`occurred_at`), RFC 3339 with microseconds.
pub const CE_TIME: &str = "ce_time";
/// `ce_subject`: the aggregate id.
pub const CE_SUBJECT: &str = "ce_subject";
/// `content-type`: always [`CONTENT_TYPE_JSON`].
pub const CONTENT_TYPE: &str = "content-type";
/// `idem_aggregate_type`: the aggregate type.
pub const IDEM_AGGREGATE_TYPE: &str = "idem_aggregate_type";
/// `idem_aggregate_id`: the aggregate id (the consumer falls back to the record key).
pub const IDEM_AGGREGATE_ID: &str = "idem_aggregate_id";
/// `idem_aggregate_seq`: the event's position in its aggregate's commit order (1, 2, …).
pub const IDEM_AGGREGATE_SEQ: &str = "idem_aggregate_seq";
/// `idem_attempt`: this publish attempt of the row, 1 for the first.
pub const IDEM_ATTEMPT: &str = "idem_attempt";
/// `traceparent`: the W3C trace context captured at enqueue, when there was one.
pub const TRACEPARENT: &str = "traceparent";

/// The value of [`CE_SPECVERSION`].
pub const SPECVERSION: &str = "1.0";
/// The value of [`CONTENT_TYPE`].
pub const CONTENT_TYPE_JSON: &str = "application/json";

/// Default topic prefix, Debezium's outbox convention: `outbox.event.<aggregate_type>`.
pub const DEFAULT_TOPIC_PREFIX: &str = "outbox.event.";

/// One Kafka record as the relay produces it: topic, key, value and headers in order.
#[derive(Clone, Debug, PartialEq)]
pub struct WireRecord {
    /// Destination topic.
    pub topic: String,
    /// Record key (the aggregate id).
    pub key: String,
    /// Record value: the JSON payload, sent as its UTF-8 bytes.
    pub payload: String,
    /// Record headers, in order.
    pub headers: Vec<(String, String)>,
}

impl WireRecord {
    /// The first header named `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        first_header(&self.headers, name)
    }
}

/// The value of the first header named `name` in `headers`: a record's reader takes the first
/// of a name.
pub fn first_header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// How the relay names topics.
#[derive(Clone, Debug)]
pub struct TopicNaming {
    /// Prefix put before the aggregate type.
    pub prefix: String,
    /// Per aggregate type, a topic that replaces `<prefix><aggregate_type>`.
    pub overrides: BTreeMap<String, String>,
}

impl Default for TopicNaming {
    fn default() -> Self {
        TopicNaming {
            prefix: DEFAULT_TOPIC_PREFIX.to_owned(),
            overrides: BTreeMap::new(),
        }
    }
}

impl TopicNaming {
    /// Checks the naming before a relay starts: every override is a topic Kafka accepts, and so
    /// is the prefix before an aggregate type (aggregate types are names Kafka accepts). A
    /// mapping that cannot be a topic would otherwise park every event of its aggregate type.
    pub fn validate(&self) -> std::result::Result<(), String> {
        crate::event::validate_topic(&format!("{}x", self.prefix))
            .map_err(|e| format!("topic prefix {:?}: {e}", self.prefix))?;
        for (aggregate_type, topic) in &self.overrides {
            crate::event::validate_topic(topic)
                .map_err(|e| format!("topic of aggregate type {aggregate_type:?}: {e}"))?;
        }
        Ok(())
    }

    /// The topic of `record`: its own override, else the aggregate type's override, else
    /// `<prefix><aggregate_type>`.
    pub fn topic_for(&self, record: &OutboxRecord) -> String {
        if let Some(t) = &record.topic {
            return t.clone();
        }
        if let Some(t) = self.overrides.get(&record.aggregate_type) {
            return t.clone();
        }
        format!("{}{}", self.prefix, record.aggregate_type)
    }
}

/// The record for `r` on `topic`. `source` is the `ce_source` to send; `None` means
/// `/idem/<aggregate_type>`.
///
/// The row's own headers follow the relay's, except names the relay owns
/// ([`is_reserved_header`]): a writer using plain SQL could otherwise set them (a second `ce_id`
/// would let a consumer read a forged dedup key).
pub fn encode(r: &OutboxRecord, topic: &str, source: Option<&str>) -> WireRecord {
    let mut headers: Vec<(String, String)> = Vec::with_capacity(12 + r.headers.len());
    let mut h = |k: &str, v: String| headers.push((k.to_owned(), v));
    h(CE_SPECVERSION, SPECVERSION.to_owned());
    h(CE_ID, r.event_id.to_string());
    h(CE_TYPE, r.event_type.clone());
    h(
        CE_SOURCE,
        source.map_or_else(|| format!("/idem/{}", r.aggregate_type), str::to_owned),
    );
    h(
        CE_TIME,
        r.occurred_at
            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
    );
    h(CE_SUBJECT, r.aggregate_id.clone());
    h(CONTENT_TYPE, CONTENT_TYPE_JSON.to_owned());
    h(IDEM_AGGREGATE_TYPE, r.aggregate_type.clone());
    h(IDEM_AGGREGATE_ID, r.aggregate_id.clone());
    h(IDEM_AGGREGATE_SEQ, r.aggregate_seq.to_string());
    h(IDEM_ATTEMPT, r.attempt.to_string());
    if let Some(tp) = &r.traceparent {
        h(TRACEPARENT, tp.clone());
    }
    headers.extend(
        r.headers
            .iter()
            .filter(|(k, _)| !is_reserved_header(k))
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    WireRecord {
        topic: topic.to_owned(),
        key: r.aggregate_id.clone(),
        payload: r.payload.clone(),
        headers,
    }
}

/// Why a record cannot be decoded into an event. The consumer dead-letters the record with
/// this message as the reason, and its offset moves on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// No `ce_id` header.
    #[error("the record has no ce_id header (event id)")]
    MissingEventId,
    /// A `ce_id` that is not a UUID.
    #[error("ce_id {0:?} is not a UUID")]
    InvalidEventId(String),
    /// No `ce_type` header.
    #[error("the record has no ce_type header (event type)")]
    MissingEventType,
    /// A record without a value (a tombstone).
    #[error("the record has no value")]
    MissingValue,
    /// A value that is not JSON.
    #[error("the record value is not valid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
}

/// Decodes a delivered record into an event, or says why it cannot be processed.
///
/// Text that reaches the inbox must be storable: NUL is replaced ([`storable`]).
pub fn decode(d: &Delivery) -> Result<InboundEvent, DecodeError> {
    let id = d.header(CE_ID).ok_or(DecodeError::MissingEventId)?;
    let event_id: EventId = id
        .parse()
        .map_err(|_| DecodeError::InvalidEventId(id.to_owned()))?;
    let event_type = d.header(CE_TYPE).ok_or(DecodeError::MissingEventType)?;
    let bytes = d.payload.as_deref().ok_or(DecodeError::MissingValue)?;
    let payload: serde_json::Value =
        serde_json::from_slice(bytes).map_err(DecodeError::InvalidJson)?;
    Ok(InboundEvent {
        event_id,
        event_type: storable(event_type),
        aggregate_type: storable(d.header(IDEM_AGGREGATE_TYPE).unwrap_or_default()),
        aggregate_id: storable(
            d.header(IDEM_AGGREGATE_ID)
                .or(d.key.as_deref())
                .unwrap_or_default(),
        ),
        payload,
        payload_hash: payload_hash(bytes),
        traceparent: d.header(TRACEPARENT).map(str::to_owned),
        topic: d.topic.clone(),
        partition: d.partition,
        offset: d.offset,
    })
}

/// SHA-256 of a record value, lowercase hex: the same event id with another hash is an
/// idempotency conflict.
pub fn payload_hash(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lowercase hex of `bytes`, through a lookup table: one allocation, not one `format!` per byte
/// (the consumer hashes every record it decodes).
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

/// `s` with NUL replaced by U+FFFD: PostgreSQL `text` cannot hold NUL, and text read from a
/// record (type, aggregate, key, dead-letter reasons) must be storable.
pub fn storable(s: &str) -> String {
    s.replace('\0', "\u{FFFD}")
}

#[cfg(test)]
mod tests {
    use chrono::{TimeZone, Utc};

    use super::*;

    #[test]
    fn a_topic_naming_kafka_cannot_take_is_refused_before_the_relay_starts() {
        let mut naming = TopicNaming::default();
        naming.validate().unwrap_or_else(|e| panic!("{e}"));
        naming.overrides.insert("order".into(), "my topic".into());
        let e = naming.validate().unwrap_err();
        assert!(e.contains("\"order\"") && e.contains("' '"), "{e}");
        let naming = TopicNaming {
            prefix: "events/".into(),
            overrides: BTreeMap::new(),
        };
        assert!(naming.validate().unwrap_err().contains("topic prefix"));
    }

    #[test]
    fn the_payload_hash_is_the_lowercase_hex_sha256() {
        assert_eq!(
            payload_hash(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(hex(&[0x00, 0x0f, 0xf0, 0xff]), "000ff0ff");
    }

    fn record() -> OutboxRecord {
        OutboxRecord {
            id: 7,
            event_id: EventId::new(),
            aggregate_type: "order".into(),
            aggregate_id: "o-7".into(),
            aggregate_seq: 3,
            event_type: "order.paid".into(),
            payload: r#"{"amount":12}"#.into(),
            headers: BTreeMap::from([
                ("tenant".to_owned(), "acme".to_owned()),
                ("ce_id".to_owned(), "forged".to_owned()),
                ("TraceParent".to_owned(), "forged".to_owned()),
            ]),
            topic: None,
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            occurred_at: Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).unwrap(),
            created_at: Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 6).unwrap(),
            attempt: 2,
            permanent_failures: 0,
        }
    }

    /// What a broker hands back for `w`, at `offset` of partition 1.
    fn delivered(w: &WireRecord, offset: i64) -> Delivery {
        Delivery {
            topic: w.topic.clone(),
            partition: 1,
            offset,
            key: Some(w.key.clone()),
            payload: Some(w.payload.as_bytes().to_vec()),
            headers: w.headers.clone(),
            timestamp: None,
        }
    }

    #[test]
    fn an_encoded_record_decodes_to_the_same_event() {
        let r = record();
        let w = encode(&r, "outbox.event.order", None);
        let e = decode(&delivered(&w, 42)).unwrap();
        assert_eq!(e.event_id, r.event_id);
        assert_eq!(e.event_type, r.event_type);
        assert_eq!(e.aggregate_type, r.aggregate_type);
        assert_eq!(e.aggregate_id, r.aggregate_id);
        assert_eq!(e.payload, serde_json::json!({ "amount": 12 }));
        assert_eq!(e.payload_hash, payload_hash(r.payload.as_bytes()));
        assert_eq!(e.traceparent, r.traceparent);
        assert_eq!(
            (e.topic.as_str(), e.partition, e.offset),
            ("outbox.event.order", 1, 42)
        );
    }

    #[test]
    fn the_relay_headers_come_first_in_order_and_reserved_row_headers_are_dropped() {
        let r = record();
        let w = encode(&r, "t", Some("/billing"));
        let names: Vec<&str> = w.headers.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "ce_specversion",
                "ce_id",
                "ce_type",
                "ce_source",
                "ce_time",
                "ce_subject",
                "content-type",
                "idem_aggregate_type",
                "idem_aggregate_id",
                "idem_aggregate_seq",
                "idem_attempt",
                "traceparent",
                "tenant",
            ]
        );
        assert_eq!(w.header(CE_ID), Some(r.event_id.to_string().as_str()));
        assert_eq!(w.header(CE_SOURCE), Some("/billing"));
        assert_eq!(w.header(CE_TIME), Some("2026-01-02T03:04:05.000000Z"));
        assert_eq!(w.header(IDEM_AGGREGATE_SEQ), Some("3"));
        assert_eq!(w.header(IDEM_ATTEMPT), Some("2"));
        assert_eq!(w.key, "o-7");
        assert_eq!(encode(&r, "t", None).header(CE_SOURCE), Some("/idem/order"));
    }

    #[test]
    fn topics_follow_the_row_then_the_type_override_then_the_prefix() {
        let mut naming = TopicNaming::default();
        let mut r = record();
        assert_eq!(naming.topic_for(&r), "outbox.event.order");
        naming.overrides.insert("order".into(), "orders".into());
        assert_eq!(naming.topic_for(&r), "orders");
        r.topic = Some("mine".into());
        assert_eq!(naming.topic_for(&r), "mine");
    }

    fn refusal(edit: impl FnOnce(&mut Delivery)) -> String {
        let mut d = delivered(&encode(&record(), "t", None), 0);
        edit(&mut d);
        decode(&d).unwrap_err().to_string()
    }

    #[test]
    fn each_refusal_says_what_is_wrong_with_the_record() {
        assert_eq!(
            refusal(|d| d.headers.retain(|(k, _)| k != CE_ID)),
            "the record has no ce_id header (event id)"
        );
        assert_eq!(
            refusal(|d| d.headers[1].1 = "not-a-uuid".into()),
            r#"ce_id "not-a-uuid" is not a UUID"#
        );
        assert_eq!(
            refusal(|d| d.headers.retain(|(k, _)| k != CE_TYPE)),
            "the record has no ce_type header (event type)"
        );
        assert_eq!(refusal(|d| d.payload = None), "the record has no value");
        assert_eq!(
            refusal(|d| d.payload = Some(b"{oops".to_vec())),
            "the record value is not valid JSON: key must be a string at line 1 column 2"
        );
    }

    #[test]
    fn the_key_stands_in_for_a_missing_aggregate_id_and_nul_is_made_storable() {
        let mut d = delivered(&encode(&record(), "t", None), 0);
        d.headers.retain(|(k, _)| k != IDEM_AGGREGATE_ID);
        d.headers[2].1 = "order\0paid".into();
        let e = decode(&d).unwrap();
        assert_eq!(e.aggregate_id, "o-7");
        assert_eq!(e.event_type, "order\u{FFFD}paid");
    }
}
