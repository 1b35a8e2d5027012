//! The table-less outbox ("message mode"): an event written with
//! `pg_logical_emit_message(true, prefix, content)` inside the business transaction (rolled back
//! with it) and read by the CDC relay from the same slot.
//!
//! `content` is a versioned JSON envelope, one object with exactly these fields:
//!
//! ```json
//! {"v":1,"event_id":"0192…","aggregate_type":"order","aggregate_id":"o-1",
//!  "event_type":"order.paid","payload":{"amount_minor":1250},"headers":{"tenant":"acme"},
//!  "topic":null,"traceparent":"00-…-01","occurred_at":"2026-12-01T23:51:28.586123Z"}
//! ```
//!
//! [`encode`] is the writer's side; [`decode`] is the relay's. Any role allowed to execute
//! `pg_logical_emit_message` can write any content under any prefix, so the relay trusts
//! nothing: [`decode`] re-applies every writer rule of [`crate::event`] (the rules the
//! outbox table's trigger enforces in table mode) by building the event again with
//! [`crate::Event::builder`], and refuses an unknown version, an unknown or repeated field,
//! and content over [`MAX_CONTENT_BYTES`] before parsing it. Each refusal is a typed
//! [`EnvelopeError`]; the relay dead-letters that message with the reason. Only transactional
//! messages are events: the relay checks the message's transactional flag, which is not part
//! of the content.
//!
//! Without a row, the record's fields that a table gives come from the log position:
//!
//! - `id` is the message's LSN: unique, and the same every time the slot sends the message
//!   again.
//! - `aggregate_seq` is the position of the message's transaction's commit record (the
//!   `final_lsn` the stream's Begin carries, so that a transaction can be published before its
//!   Commit message arrives). It increases with commit order, so one aggregate's events are
//!   ordered by it, but it is **not dense** (it is a
//!   byte position) and two events of one aggregate written in one transaction share it (their
//!   stream order, which is their order in the Kafka partition, tells them apart). Consumers
//!   of message mode get no gap detection: [`crate::ordering::InOrder`] expects 1, 2, 3, …
//!   (table mode on PostgreSQL) and would hold these events forever. Deduplicate by `ce_id`
//!   (the inbox), never by "skip what is not above the last position": that drops the second
//!   event of a transaction.
//! - `created_at` is the transaction's commit time when the relay has it, else `occurred_at`.
//! - `attempt` is 1 and `permanent_failures` 0, as in table mode.
//!
//! **Invariant**: a content [`decode`] accepts is one an [`crate::Event`] could have
//! produced through [`encode`]; everything else is an error, never a panic, and parsing never
//! recurses deeper than `serde_json`'s limit (128 levels).

use std::collections::BTreeMap;

use crate::Event;
use crate::event::EventId;
use crate::outbox::OutboxRecord;
use chrono::{DateTime, Datelike, SecondsFormat, Utc};
use serde::Deserialize;
use serde_json::value::RawValue;
use uuid::Uuid;

/// The envelope version [`encode`] writes and [`decode`] reads.
pub const VERSION: u32 = 1;

/// The largest content [`decode`] parses: 1 MiB. Kafka refuses larger records with its default
/// limits (the broker's `message.max.bytes`, librdkafka's producer `message.max.bytes` of
/// 1 000 000 bytes), so a larger event could never be published; the bound also keeps a hostile
/// writer from making the relay parse megabytes.
pub const MAX_CONTENT_BYTES: usize = 1 << 20;

/// The deepest nesting of arrays and objects accepted in a payload: `serde_json`'s default
/// recursion limit, so that a consumer parsing the payload with it can read every payload the
/// relay publishes. Table mode has PostgreSQL's `jsonb` parser as its bound (it refuses 50 000
/// levels with "stack depth limit exceeded"); message mode has no `jsonb`, and `serde_json`
/// checks the envelope's own structure but skips over a raw payload without a depth limit.
pub const MAX_PAYLOAD_DEPTH: usize = 128;

/// Why a message's content is not an outbox event. The relay dead-letters the message with
/// this reason.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// The content is larger than [`MAX_CONTENT_BYTES`]; it was not parsed.
    #[error("the message is {len} bytes, the limit is {MAX_CONTENT_BYTES}")]
    TooLarge {
        /// The content's length.
        len: usize,
    },
    /// The envelope names a version this relay does not read.
    #[error("envelope version {0} is not supported (this relay reads version {VERSION})")]
    UnknownVersion(String),
    /// The content is not a version 1 envelope: not JSON, not UTF-8, nested too deeply, a
    /// missing, unknown or repeated field, or a field of the wrong type.
    #[error("the message is not an idem envelope: {0}")]
    Malformed(String),
    /// A field breaks a writer rule of [`crate::event`].
    #[error("the event is refused: {field} {reason}")]
    Refused {
        /// The field.
        field: &'static str,
        /// The rule it breaks.
        reason: String,
    },
    /// A log position does not fit the record's signed 64-bit fields.
    #[error("log position {0:#x} is beyond the range of a bigint")]
    PositionOutOfRange(u64),
}

/// The envelope of `event`, as the `content` of `pg_logical_emit_message(true, prefix, content)`.
///
/// The payload is embedded as the writer gave it (it is valid JSON, [`Event`] checked it), and
/// `occurred_at` is truncated to microseconds, the precision of a `timestamptz` (PostgreSQL
/// rounds instead: in table mode a nanosecond part can move the stored time by 1 µs).
pub fn encode(event: &Event) -> String {
    let mut out = String::with_capacity(256 + event.payload().len());
    out.push_str("{\"v\":");
    out.push_str(&VERSION.to_string());
    field(&mut out, "event_id", &event.id().to_string());
    field(&mut out, "aggregate_type", event.aggregate_type());
    field(&mut out, "aggregate_id", event.aggregate_id());
    field(&mut out, "event_type", event.event_type());
    out.push_str(",\"payload\":");
    out.push_str(event.payload());
    out.push_str(",\"headers\":{");
    for (i, (name, value)) in event.headers().iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        json_string(&mut out, name);
        out.push(':');
        json_string(&mut out, value);
    }
    out.push('}');
    optional(&mut out, "topic", event.topic());
    optional(&mut out, "traceparent", event.traceparent());
    let at = event
        .occurred_at()
        .to_rfc3339_opts(SecondsFormat::Micros, true);
    field(&mut out, "occurred_at", &at);
    out.push('}');
    out
}

/// [`encode`], refusing what the relay's [`decode`] would refuse for reasons [`Event`] does not
/// check: content over [`MAX_CONTENT_BYTES`] and a payload nested deeper than
/// [`MAX_PAYLOAD_DEPTH`]. A writer calls this, so that such an event is refused in the business
/// transaction instead of being dead-lettered by the relay after the commit.
pub fn encode_checked(event: &Event) -> Result<String, EnvelopeError> {
    if depth(event.payload()) > MAX_PAYLOAD_DEPTH {
        return Err(refused(
            "payload",
            format!("nests arrays and objects deeper than {MAX_PAYLOAD_DEPTH} levels"),
        ));
    }
    let content = encode(event);
    if content.len() > MAX_CONTENT_BYTES {
        return Err(EnvelopeError::TooLarge { len: content.len() });
    }
    Ok(content)
}

/// The statement that lets a role write message-mode events once migration 13 revoked
/// `pg_logical_emit_message` from `PUBLIC`.
pub const EMIT_GRANT: &str =
    "GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO <writing role>";

/// The default prefix of message mode's messages.
pub const DEFAULT_PREFIX: &str = "idem.outbox";

/// A validated message prefix: 1 to 64 of `[A-Za-z0-9._-]`. The writer emits under it and the
/// relay reads only messages with it; other prefixes (other tools' messages) are ignored.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Prefix(String);

impl Prefix {
    /// The longest prefix accepted.
    pub const MAX_LEN: usize = 64;

    /// `prefix`, when it is 1 to 64 of `[A-Za-z0-9._-]`.
    pub fn new(prefix: &str) -> crate::Result<Self> {
        let valid = (1..=Self::MAX_LEN).contains(&prefix.len())
            && prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !valid {
            return Err(crate::Error::Config(format!(
                "message prefix {prefix:?} must be 1 to {} of [A-Za-z0-9._-]",
                Self::MAX_LEN
            )));
        }
        Ok(Prefix(prefix.to_owned()))
    }

    /// The prefix.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Prefix {
    fn default() -> Self {
        Prefix(DEFAULT_PREFIX.to_owned())
    }
}

impl std::fmt::Display for Prefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn field(out: &mut String, name: &str, value: &str) {
    out.push_str(",\"");
    out.push_str(name);
    out.push_str("\":");
    json_string(out, value);
}

fn optional(out: &mut String, name: &str, value: Option<&str>) {
    if let Some(value) = value {
        field(out, name, value);
    }
}

/// Appends `s` as a JSON string (RFC 8259 escapes).
fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The envelope as read: every field typed, nothing else allowed.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire<'a> {
    v: u32,
    event_id: Uuid,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    #[serde(borrow)]
    payload: &'a RawValue,
    #[serde(default, deserialize_with = "unique_headers")]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    topic: Option<String>,
    #[serde(default)]
    traceparent: Option<String>,
    occurred_at: String,
}

/// A JSON object of string headers in which no name appears twice ([`encode`] never writes a
/// name twice; a plain map would keep the last copy silently).
fn unique_headers<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    struct Unique;
    impl<'de> serde::de::Visitor<'de> for Unique {
        type Value = BTreeMap<String, String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object of string headers")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some((name, value)) = map.next_entry::<String, String>()? {
                if out.contains_key(&name) {
                    return Err(serde::de::Error::custom(format!(
                        "header {name:?} appears twice"
                    )));
                }
                out.insert(name, value);
            }
            Ok(out)
        }
    }
    deserializer.deserialize_map(Unique)
}

/// Only the version, to tell "a newer envelope" from "not an envelope" when parsing failed.
#[derive(Deserialize)]
struct VersionOnly {
    v: Option<serde_json::Value>,
}

/// The record for the message at `lsn` (its `lsn` field), the `ordinal`-th event of the
/// transaction whose commit record is at `end_lsn` (the relay passes Begin's `final_lsn`);
/// `created_at` is `occurred_at`. See
/// [`decode_committed`] when the commit time is known.
pub fn decode(
    lsn: u64,
    end_lsn: u64,
    ordinal: u32,
    content: &[u8],
) -> Result<OutboxRecord, EnvelopeError> {
    decode_committed(lsn, end_lsn, ordinal, None, content)
}

/// [`decode`], with `created_at` the transaction's commit time `committed_at` when given.
/// `ordinal` (the event's position in its transaction) is not part of the record: the
/// message's `lsn` already orders a transaction's events.
pub fn decode_committed(
    lsn: u64,
    end_lsn: u64,
    _ordinal: u32,
    committed_at: Option<DateTime<Utc>>,
    content: &[u8],
) -> Result<OutboxRecord, EnvelopeError> {
    if content.len() > MAX_CONTENT_BYTES {
        return Err(EnvelopeError::TooLarge { len: content.len() });
    }
    let wire = parse(content)?;
    let event = rebuild(&wire)?;
    let position = |p: u64| i64::try_from(p).map_err(|_| EnvelopeError::PositionOutOfRange(p));
    Ok(OutboxRecord::of_event(
        &event,
        position(lsn)?,
        position(end_lsn)?,
        committed_at.unwrap_or_else(|| event.occurred_at()),
    ))
}

fn parse(content: &[u8]) -> Result<Wire<'_>, EnvelopeError> {
    match serde_json::from_slice::<Wire<'_>>(content) {
        Ok(wire) if wire.v == VERSION => Ok(wire),
        Ok(wire) => Err(EnvelopeError::UnknownVersion(wire.v.to_string())),
        Err(e) => match serde_json::from_slice::<VersionOnly>(content) {
            Ok(VersionOnly { v: Some(v) }) if v != serde_json::json!(VERSION) => {
                // A short excerpt: the version may be any JSON value, of any length.
                let shown: String = v.to_string().chars().take(32).collect();
                Err(EnvelopeError::UnknownVersion(shown))
            }
            _ => Err(EnvelopeError::Malformed(e.to_string())),
        },
    }
}

/// Builds the event again, so that every rule of [`crate::event`] applies, plus the
/// trigger's range for `occurred_at` (year 1 to 9999).
fn rebuild(wire: &Wire<'_>) -> Result<Event, EnvelopeError> {
    let occurred_at = DateTime::parse_from_rfc3339(&wire.occurred_at)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| refused("occurred_at", format!("is not an RFC 3339 time: {e}")))?;
    if !(1..=9999).contains(&occurred_at.year()) {
        return Err(refused("occurred_at", "must be from year 1 to year 9999"));
    }
    if depth(wire.payload.get()) > MAX_PAYLOAD_DEPTH {
        return Err(refused(
            "payload",
            format!("nests arrays and objects deeper than {MAX_PAYLOAD_DEPTH} levels"),
        ));
    }
    let mut builder = Event::builder(&wire.aggregate_type, &wire.aggregate_id, &wire.event_type)
        .id(EventId(wire.event_id))
        .payload_json(wire.payload.get())
        .occurred_at(occurred_at);
    for (name, value) in &wire.headers {
        builder = builder.header(name, value);
    }
    if let Some(topic) = &wire.topic {
        builder = builder.topic(topic);
    }
    builder = match &wire.traceparent {
        Some(tp) => builder.traceparent(tp),
        None => builder.without_traceparent(),
    };
    builder.build().map_err(|e| match e {
        crate::Error::InvalidEvent { field, reason } => refused(field, reason),
        other => refused("event", other.to_string()),
    })
}

/// The deepest nesting of arrays and objects in `json` (valid JSON text), counted without
/// recursion.
fn depth(json: &str) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for b in json.bytes() {
        match (in_string, escaped, b) {
            (true, true, _) => escaped = false,
            (true, false, b'\\') => escaped = true,
            (true, false, b'"') => in_string = false,
            (true, false, _) => {}
            (false, _, b'"') => in_string = true,
            (false, _, b'[' | b'{') => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            (false, _, b']' | b'}') => depth = depth.saturating_sub(1),
            (false, _, _) => {}
        }
    }
    deepest
}

fn refused(field: &'static str, reason: impl Into<String>) -> EnvelopeError {
    EnvelopeError::Refused {
        field,
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    /// xorshift64*: deterministic, no dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
        /// Uniform index into `len` items (0 when there are none).
        fn index(&mut self, len: usize) -> usize {
            let n = self.below(u64::try_from(len).unwrap_or(u64::MAX));
            usize::try_from(n).unwrap_or(0)
        }
    }

    const TP: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    fn event() -> Event {
        Event::builder("order", "o-1 \"quoted\" \\ é", "order.paid")
            .id(EventId(Uuid::from_u128(
                0x0192_d2a4_7c1e_7000_8000_0000_0000_0001,
            )))
            .payload_json(r#" {"b":1,"a":[1,2.50,"\u00e9\n"]} "#)
            .header("tenant", "acme \"x\" ü")
            .header("n", "1")
            .traceparent(TP)
            .topic("payments.v1")
            .occurred_at(Utc.timestamp_micros(1_796_169_088_586_123).unwrap())
            .build()
            .unwrap()
    }

    fn envelope(patch: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> Vec<u8> {
        let serde_json::Value::Object(mut map) = serde_json::from_str(&encode(&event())).unwrap()
        else {
            panic!("not an object")
        };
        patch(&mut map);
        serde_json::to_vec(&map).unwrap()
    }

    #[test]
    fn an_encoded_event_decodes_to_its_record() {
        let e = event();
        let content = encode(&e);
        let at = Utc.timestamp_opt(1_796_169_099, 0).unwrap();
        let r =
            decode_committed(0x0154_6670, 0x0158_a3e8, 0, Some(at), content.as_bytes()).unwrap();
        assert_eq!(r.id, 0x0154_6670);
        assert_eq!(r.aggregate_seq, 0x0158_a3e8);
        assert_eq!(r.event_id, e.id());
        assert_eq!(
            (r.aggregate_type.as_str(), r.aggregate_id.as_str()),
            ("order", e.aggregate_id())
        );
        assert_eq!(r.event_type, "order.paid");
        assert_eq!(
            r.payload, r#"{"b":1,"a":[1,2.50,"\u00e9\n"]}"#,
            "payload not verbatim"
        );
        assert_eq!(&r.headers, e.headers());
        assert_eq!(r.topic.as_deref(), Some("payments.v1"));
        assert_eq!(r.traceparent.as_deref(), Some(TP));
        assert_eq!(r.occurred_at, e.occurred_at());
        assert_eq!(r.created_at, at);
        assert_eq!((r.attempt, r.permanent_failures), (1, 0));
        let plain = decode(1, 2, 0, content.as_bytes()).unwrap();
        assert_eq!(plain.created_at, e.occurred_at());
    }

    #[test]
    fn optional_fields_may_be_absent_or_null() {
        let e = Event::builder("order", "o-1", "x")
            .payload_json("1")
            .without_traceparent();
        let content = encode(&e.build().unwrap());
        assert!(
            !content.contains("topic") && !content.contains("traceparent"),
            "{content}"
        );
        let r = decode(1, 2, 0, content.as_bytes()).unwrap();
        assert_eq!((r.topic, r.traceparent, r.headers.len()), (None, None, 0));
        let nulls = envelope(|m| {
            m.insert("topic".into(), serde_json::Value::Null);
            m.insert("traceparent".into(), serde_json::Value::Null);
            m.remove("headers");
        });
        let r = decode(1, 2, 0, &nulls).unwrap();
        assert_eq!((r.topic, r.traceparent, r.headers.len()), (None, None, 0));
    }

    #[test]
    fn json_strings_are_escaped_as_serde_json_reads_them() {
        let mut rng = Rng(42);
        let alphabet: Vec<char> = "ab\"\\/\n\r\t\u{1}\u{1f}\u{7f}é€😀 ".chars().collect();
        for _ in 0..2000 {
            let s: String = (0..rng.below(12))
                .map(|_| alphabet[rng.index(alphabet.len())])
                .collect();
            let mut out = String::new();
            json_string(&mut out, &s);
            assert_eq!(serde_json::from_str::<String>(&out).unwrap(), s, "{out}");
        }
    }

    fn refused_field(content: &[u8]) -> &'static str {
        match decode(1, 2, 0, content) {
            Err(EnvelopeError::Refused { field, .. }) => field,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_writer_rule_is_applied_again() {
        use serde_json::json;
        let cases: Vec<(&str, serde_json::Value, &str)> = vec![
            ("payload", json!("x"), "none"),
            ("aggregate_id", json!(""), "aggregate_id"),
            ("aggregate_id", json!("x".repeat(513)), "aggregate_id"),
            ("aggregate_id", json!("a\u{7}b"), "aggregate_id"),
            ("aggregate_type", json!("ord er"), "aggregate_type"),
            ("aggregate_type", json!("o".repeat(201)), "aggregate_type"),
            ("event_type", json!(".x"), "event_type"),
            ("headers", json!({"ce_id": "forged"}), "headers"),
            ("headers", json!({"TraceParent": "x"}), "headers"),
            ("headers", json!({"a b": "x"}), "headers"),
            ("headers", json!({"ok": "x".repeat(4097)}), "headers"),
            ("topic", json!(".."), "topic"),
            ("traceparent", json!("00-zz"), "traceparent"),
            ("occurred_at", json!("yesterday"), "occurred_at"),
            ("occurred_at", json!("10000-01-01T00:00:00Z"), "occurred_at"),
        ];
        for (key, value, field) in cases {
            let content = envelope(|m| {
                m.insert(key.into(), value.clone());
            });
            if field == "none" {
                // A string where the payload should be is still JSON: valid as a payload.
                assert!(decode(1, 2, 0, &content).is_ok());
                continue;
            }
            assert_eq!(refused_field(&content), field, "{key}={value}");
        }
        let nul = br#"{"v":1,"event_id":"0192d2a4-7c1e-7000-8000-000000000001","aggregate_type":"o","aggregate_id":"1","event_type":"t","payload":"\u0000","occurred_at":"2026-12-01T00:00:00Z"}"#;
        assert_eq!(refused_field(nul), "payload");
    }

    #[test]
    fn anything_else_than_a_version_1_envelope_is_refused() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"not json".to_vec(), "malformed"),
            (b"".to_vec(), "malformed"),
            (vec![0xff, 0xfe], "malformed"),
            (b"[]".to_vec(), "malformed"),
            (
                envelope(|m| {
                    m.insert("extra".into(), 1.into());
                }),
                "malformed",
            ),
            (
                envelope(|m| {
                    m.remove("event_id");
                }),
                "malformed",
            ),
            (
                envelope(|m| {
                    m.insert("event_id".into(), "not-a-uuid".into());
                }),
                "malformed",
            ),
            (
                envelope(|m| {
                    m.insert("headers".into(), serde_json::json!({"n": 1}));
                }),
                "malformed",
            ),
            (
                envelope(|m| {
                    m.insert("v".into(), 2.into());
                }),
                "version",
            ),
            (
                envelope(|m| {
                    m.insert("v".into(), 2.into());
                    m.insert("new".into(), 1.into());
                }),
                "version",
            ),
            (
                envelope(|m| {
                    m.insert("v".into(), "1".into());
                }),
                "version",
            ),
            (
                envelope(|m| {
                    m.insert("v".into(), "é".repeat(40).into());
                }),
                "version",
            ),
        ];
        for (content, want) in cases {
            let got = decode(1, 2, 0, &content);
            let ok = matches!(
                (want, &got),
                ("malformed", Err(EnvelopeError::Malformed(_)))
                    | ("version", Err(EnvelopeError::UnknownVersion(_)))
            );
            assert!(ok, "{}: {got:?}", String::from_utf8_lossy(&content));
        }
        let header_twice =
            encode(&event()).replacen("\"headers\":{", "\"headers\":{\"n\":\"0\",", 1);
        assert!(
            matches!(decode(1, 2, 0, header_twice.as_bytes()), Err(EnvelopeError::Malformed(m)) if m.contains("appears twice")),
            "{header_twice}"
        );
        let twice = encode(&event()).replacen("\"v\":1,", "\"v\":1,\"event_type\":\"a\",", 1);
        assert!(
            matches!(decode(1, 2, 0, twice.as_bytes()), Err(EnvelopeError::Malformed(m)) if m.contains("duplicate"))
        );
    }

    #[test]
    fn oversized_content_is_refused_before_parsing() {
        let big = vec![b'['; 10 * 1024 * 1024];
        assert_eq!(
            decode(1, 2, 0, &big),
            Err(EnvelopeError::TooLarge { len: big.len() })
        );
        let e = Event::builder("o", "1", "t")
            .payload_json(format!("\"{}\"", "x".repeat(MAX_CONTENT_BYTES)))
            .build()
            .unwrap();
        assert!(matches!(
            decode(1, 2, 0, encode(&e).as_bytes()),
            Err(EnvelopeError::TooLarge { .. })
        ));
    }

    #[test]
    fn deeply_nested_json_is_an_error_not_a_stack_overflow() {
        let deep = "[".repeat(50_000);
        assert!(matches!(
            decode(1, 2, 0, deep.as_bytes()),
            Err(EnvelopeError::Malformed(_))
        ));
        let in_payload = format!(
            r#"{{"v":1,"event_id":"0192d2a4-7c1e-7000-8000-000000000001","aggregate_type":"o","aggregate_id":"1","event_type":"t","occurred_at":"2026-12-01T00:00:00Z","payload":{}{}}}"#,
            "[".repeat(50_000),
            "]".repeat(50_000)
        );
        assert_eq!(refused_field(in_payload.as_bytes()), "payload");
        let nest = |n: usize| format!("{}\"[{{\\\"]\"{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(
            depth(&nest(MAX_PAYLOAD_DEPTH)),
            MAX_PAYLOAD_DEPTH,
            "brackets in strings counted"
        );
        assert_eq!(depth(r#"{"a":[1,{"b":[]}],"c":{}}"#), 4);
        let at_limit = Event::builder("o", "1", "t")
            .payload_json(nest(MAX_PAYLOAD_DEPTH))
            .build()
            .unwrap();
        assert!(decode(1, 2, 0, encode(&at_limit).as_bytes()).is_ok());
        let over = Event::builder("o", "1", "t")
            .payload_json(nest(MAX_PAYLOAD_DEPTH + 1))
            .build()
            .unwrap();
        assert_eq!(refused_field(encode(&over).as_bytes()), "payload");
        let in_header = encode(&event()).replacen(
            "\"headers\":{",
            &format!("\"headers\":{{\"x\":{}", "[".repeat(50_000)),
            1,
        );
        assert!(decode(1, 2, 0, in_header.as_bytes()).is_err());
    }

    #[test]
    fn prefixes_are_validated() {
        assert_eq!(Prefix::default().as_str(), "idem.outbox");
        for ok in ["a", "idem.outbox", "A-b_c.9", &"x".repeat(64)] {
            assert_eq!(Prefix::new(ok).unwrap().as_str(), ok);
        }
        for bad in ["", "a b", "é", "a;b", "a'b", &"x".repeat(65), "a\0"] {
            assert!(Prefix::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_checked_encoder_refuses_what_the_relay_would() {
        let e = event();
        assert_eq!(encode_checked(&e).unwrap(), encode(&e));
        let nest = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
        let over = Event::builder("o", "1", "t")
            .payload_json(nest(MAX_PAYLOAD_DEPTH + 1))
            .build()
            .unwrap();
        assert!(matches!(
            encode_checked(&over),
            Err(EnvelopeError::Refused {
                field: "payload",
                ..
            })
        ));
        let big = Event::builder("o", "1", "t")
            .payload_json(format!("\"{}\"", "x".repeat(MAX_CONTENT_BYTES)))
            .build()
            .unwrap();
        assert!(matches!(
            encode_checked(&big),
            Err(EnvelopeError::TooLarge { .. })
        ));
    }

    #[test]
    fn positions_beyond_a_bigint_are_refused() {
        let content = encode(&event());
        let big = u64::MAX;
        assert_eq!(
            decode(big, 2, 0, content.as_bytes()),
            Err(EnvelopeError::PositionOutOfRange(big))
        );
        assert_eq!(
            decode(1, big, 0, content.as_bytes()),
            Err(EnvelopeError::PositionOutOfRange(big))
        );
    }

    #[test]
    fn random_mutations_never_panic() {
        let mut rng = Rng(7);
        let valid = encode(&event()).into_bytes();
        for _ in 0..5000 {
            let mut m = valid.clone();
            for _ in 0..=rng.below(4) {
                let at = rng.index(m.len());
                if let Some(b) = m.get_mut(at) {
                    *b = rng.next().to_le_bytes()[5];
                }
            }
            let _ = decode(1, 2, 0, &m);
        }
    }
}
