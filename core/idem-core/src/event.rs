//! The event envelope written to the outbox.
//!
//! An [`Event`] is validated when it is built, so a malformed event is refused with a clear
//! [`Error::InvalidEvent`] before anything touches the database. The same rules are enforced
//! again by `CHECK` constraints in the outbox table, for writers in other languages
//! (see `docs/integrating/outbox-contract.md`).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::trace;

/// Longest accepted `event_type`.
pub const MAX_EVENT_TYPE_LEN: usize = 255;
/// Longest accepted `aggregate_type` (it becomes part of a Kafka topic name, at most 249 bytes).
pub const MAX_AGGREGATE_TYPE_LEN: usize = 200;
/// Longest accepted `aggregate_id` in bytes (it is the Kafka record key).
pub const MAX_AGGREGATE_ID_LEN: usize = 512;
/// Longest accepted header name.
pub const MAX_HEADER_NAME_LEN: usize = 64;
/// Longest accepted header value in bytes.
pub const MAX_HEADER_VALUE_LEN: usize = 4096;

/// Header names the relay writes itself; user headers may not use them.
pub const RESERVED_HEADER_PREFIXES: &[&str] = &["ce_", "idem_"];
/// Exact header names the relay writes itself.
pub const RESERVED_HEADERS: &[&str] = &["traceparent", "tracestate", "content-type"];

/// The identity of one event, stable across every delivery of it.
///
/// UUIDv7 by default: time-ordered, so inbox and outbox indexes stay compact.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct EventId(pub Uuid);

impl EventId {
    /// A new time-ordered (v7) event id.
    pub fn new() -> Self {
        EventId(Uuid::now_v7())
    }

    /// The underlying UUID.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl Default for EventId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl FromStr for EventId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Uuid::parse_str(s)
            .map(EventId)
            .map_err(|e| Error::invalid("event_id", format!("is not a UUID ({e}): {s:?}")))
    }
}

impl From<Uuid> for EventId {
    fn from(u: Uuid) -> Self {
        EventId(u)
    }
}

/// One business event, ready to be enqueued in the outbox.
///
/// Build it with [`Event::builder`]; every field is validated by [`EventBuilder::build`].
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    id: EventId,
    event_type: String,
    aggregate_type: String,
    aggregate_id: String,
    payload: String,
    headers: BTreeMap<String, String>,
    occurred_at: DateTime<Utc>,
    traceparent: Option<String>,
    topic: Option<String>,
}

impl Event {
    /// Starts an event for `aggregate_type`/`aggregate_id` of type `event_type`.
    ///
    /// ```
    /// use idem_core::Event;
    /// let event = Event::builder("order", "order-10042", "order.paid")
    ///     .payload(&serde_json::json!({"order_id": "10042", "amount_minor": 1250}))
    ///     .header("tenant", "acme")
    ///     .build()?;
    /// assert_eq!(event.aggregate_id(), "order-10042");
    /// # Ok::<(), idem_core::Error>(())
    /// ```
    pub fn builder(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
    ) -> EventBuilder {
        EventBuilder {
            id: None,
            event_type: event_type.into(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            payload: Ok(None),
            headers: BTreeMap::new(),
            occurred_at: None,
            traceparent: TraceparentChoice::Capture,
            topic: None,
        }
    }

    /// The event id (`ce_id`).
    pub fn id(&self) -> EventId {
        self.id
    }
    /// The event type (`ce_type`).
    pub fn event_type(&self) -> &str {
        &self.event_type
    }
    /// The aggregate type; it names the default topic `outbox.event.<aggregate_type>`.
    pub fn aggregate_type(&self) -> &str {
        &self.aggregate_type
    }
    /// The aggregate id; it is the Kafka record key, so one aggregate stays in one partition.
    pub fn aggregate_id(&self) -> &str {
        &self.aggregate_id
    }
    /// The payload as JSON text (validated).
    pub fn payload(&self) -> &str {
        &self.payload
    }
    /// User headers (string to string), sent as Kafka headers.
    pub fn headers(&self) -> &BTreeMap<String, String> {
        &self.headers
    }
    /// When the business fact happened (`ce_time`).
    pub fn occurred_at(&self) -> DateTime<Utc> {
        self.occurred_at
    }
    /// The W3C `traceparent` current when the event was built, if any.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent.as_deref()
    }
    /// A topic that overrides the relay's topic naming for this event.
    pub fn topic(&self) -> Option<&str> {
        self.topic.as_deref()
    }
    /// The headers as a JSON object text, as stored in the outbox `headers` column.
    pub fn headers_json(&self) -> String {
        // A map of strings always serializes.
        serde_json::to_string(&self.headers).unwrap_or_else(|_| "{}".to_owned())
    }
}

#[derive(Debug)]
enum TraceparentChoice {
    Capture,
    None,
    Explicit(String),
}

/// Builder for [`Event`]; see [`Event::builder`].
#[must_use = "call .build() to validate the event"]
#[derive(Debug)]
pub struct EventBuilder {
    id: Option<EventId>,
    event_type: String,
    aggregate_type: String,
    aggregate_id: String,
    payload: std::result::Result<Option<String>, Error>,
    headers: BTreeMap<String, String>,
    occurred_at: Option<DateTime<Utc>>,
    traceparent: TraceparentChoice,
    topic: Option<String>,
}

impl EventBuilder {
    /// Sets an explicit event id (default: a new UUIDv7).
    ///
    /// Use a deterministic id when the same business fact may be enqueued twice: the outbox's
    /// unique `event_id` then refuses the second copy.
    pub fn id(mut self, id: impl Into<EventId>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Serializes `payload` as the JSON body.
    pub fn payload<T: Serialize + ?Sized>(mut self, payload: &T) -> Self {
        self.payload = serde_json::to_string(payload).map(Some).map_err(|e| {
            Error::invalid("payload", format!("could not be serialized to JSON: {e}"))
        });
        self
    }

    /// Uses `json` as the body; it must be valid JSON text.
    pub fn payload_json(mut self, json: impl Into<String>) -> Self {
        self.payload = Ok(Some(json.into()));
        self
    }

    /// Adds a string header (names: ASCII letters, digits, `-` and `_`; not `ce_*`, `idem_*`,
    /// `traceparent`, `tracestate` or `content-type`).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Sets when the business fact happened (default: now).
    pub fn occurred_at(mut self, at: DateTime<Utc>) -> Self {
        self.occurred_at = Some(at);
        self
    }

    /// Sets the W3C `traceparent` explicitly instead of capturing the current one.
    pub fn traceparent(mut self, traceparent: impl Into<String>) -> Self {
        self.traceparent = TraceparentChoice::Explicit(traceparent.into());
        self
    }

    /// Records no `traceparent`, even if a trace context is current.
    pub fn without_traceparent(mut self) -> Self {
        self.traceparent = TraceparentChoice::None;
        self
    }

    /// Publishes this event to `topic` instead of the relay's default topic.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }

    /// Validates every field and returns the event.
    pub fn build(self) -> Result<Event> {
        validate_event_type(&self.event_type)?;
        validate_aggregate_type(&self.aggregate_type)?;
        validate_aggregate_id(&self.aggregate_id)?;
        let payload = self.payload?.ok_or_else(|| {
            Error::invalid("payload", "is missing: call .payload() or .payload_json()")
        })?;
        validate_payload(&payload)?;
        for (name, value) in &self.headers {
            validate_header(name, value)?;
        }
        if let Some(topic) = &self.topic {
            validate_topic(topic).map_err(|reason| Error::invalid("topic", reason))?;
        }
        let traceparent = match self.traceparent {
            TraceparentChoice::Capture => trace::current_traceparent(),
            TraceparentChoice::None => None,
            TraceparentChoice::Explicit(tp) => {
                trace::validate_traceparent(&tp)?;
                Some(tp)
            }
        };
        Ok(Event {
            id: self.id.unwrap_or_default(),
            event_type: self.event_type,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            payload,
            headers: self.headers,
            occurred_at: self.occurred_at.unwrap_or_else(Utc::now),
            traceparent,
            topic: self.topic,
        })
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

/// Checks an event type: 1 to 255 of ASCII letters, digits, `.`, `_`, `-`, starting with a
/// letter or digit.
pub fn validate_event_type(s: &str) -> Result<()> {
    validate_name("event_type", s, MAX_EVENT_TYPE_LEN)
}

/// Checks an aggregate type: 1 to 200 of ASCII letters, digits, `.`, `_`, `-`, starting with a
/// letter or digit (it becomes part of a topic name).
pub fn validate_aggregate_type(s: &str) -> Result<()> {
    validate_name("aggregate_type", s, MAX_AGGREGATE_TYPE_LEN)
}

fn validate_name(field: &'static str, s: &str, max: usize) -> Result<()> {
    if s.is_empty() {
        return Err(Error::invalid(field, "is empty"));
    }
    if s.len() > max {
        return Err(Error::invalid(
            field,
            format!("is {} bytes long, the limit is {max}", s.len()),
        ));
    }
    if let Some(bad) = s.chars().find(|c| !is_name_char(*c)) {
        return Err(Error::invalid(
            field,
            format!("{s:?} contains {bad:?}; allowed are ASCII letters, digits, '.', '_' and '-'"),
        ));
    }
    if !s.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(Error::invalid(
            field,
            format!("{s:?} must start with a letter or digit"),
        ));
    }
    Ok(())
}

/// Checks an aggregate id: not empty, at most 512 bytes, no control characters.
pub fn validate_aggregate_id(s: &str) -> Result<()> {
    if s.is_empty() {
        return Err(Error::invalid(
            "aggregate_id",
            "is empty; it is the Kafka key that keeps one aggregate's events in order",
        ));
    }
    if s.len() > MAX_AGGREGATE_ID_LEN {
        return Err(Error::invalid(
            "aggregate_id",
            format!(
                "is {} bytes long, the limit is {MAX_AGGREGATE_ID_LEN}",
                s.len()
            ),
        ));
    }
    if s.chars().any(char::is_control) {
        return Err(Error::invalid(
            "aggregate_id",
            format!("{s:?} contains a control character"),
        ));
    }
    Ok(())
}

/// Checks that `json` is one valid JSON value that PostgreSQL's `jsonb` can store.
pub fn validate_payload(json: &str) -> Result<()> {
    serde_json::from_str::<serde::de::IgnoredAny>(json)
        .map_err(|e| Error::invalid("payload", format!("is not valid JSON: {e}")))?;
    if json.contains("\\u0000") {
        return Err(Error::invalid(
            "payload",
            "contains the escape \\u0000, which PostgreSQL jsonb cannot store",
        ));
    }
    Ok(())
}

/// Whether `name` is a header the relay writes itself (`ce_*`, `idem_*`, `traceparent`,
/// `tracestate`, `content-type`, any case). The relay drops such names from a row's own headers.
pub fn is_reserved_header(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    RESERVED_HEADERS.contains(&lower.as_str())
        || RESERVED_HEADER_PREFIXES
            .iter()
            .any(|p| lower.starts_with(p))
}

fn validate_header(name: &str, value: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_HEADER_NAME_LEN {
        return Err(Error::invalid(
            "headers",
            format!("header name {name:?} must be 1 to {MAX_HEADER_NAME_LEN} bytes"),
        ));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_')))
    {
        return Err(Error::invalid(
            "headers",
            format!(
                "header name {name:?} contains {bad:?}; allowed are ASCII letters, digits, '-' and '_'"
            ),
        ));
    }
    let lower = name.to_ascii_lowercase();
    if RESERVED_HEADERS.contains(&lower.as_str())
        || RESERVED_HEADER_PREFIXES
            .iter()
            .any(|p| lower.starts_with(p))
    {
        return Err(Error::invalid(
            "headers",
            format!(
                "header name {name:?} is reserved for the relay (ce_*, idem_*, traceparent, tracestate, content-type)"
            ),
        ));
    }
    if value.len() > MAX_HEADER_VALUE_LEN {
        return Err(Error::invalid(
            "headers",
            format!(
                "header {name:?} value is {} bytes, the limit is {MAX_HEADER_VALUE_LEN}",
                value.len()
            ),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(Error::invalid(
            "headers",
            format!("header {name:?} value contains a control character"),
        ));
    }
    Ok(())
}

/// Checks a Kafka topic name: 1 to 249 of ASCII letters, digits, `.`, `_`, `-`; not `.` or `..`.
///
/// Returns the reason as text so callers can wrap it in their own error.
pub fn validate_topic(topic: &str) -> std::result::Result<(), String> {
    if topic.is_empty() || topic.len() > 249 {
        return Err(format!("topic {topic:?} must be 1 to 249 bytes"));
    }
    if topic == "." || topic == ".." {
        return Err(format!("topic {topic:?} is not allowed by Kafka"));
    }
    if let Some(bad) = topic.chars().find(|c| !is_name_char(*c)) {
        return Err(format!(
            "topic {topic:?} contains {bad:?}; Kafka allows ASCII letters, digits, '.', '_' and '-'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> EventBuilder {
        Event::builder("order", "o-1", "order.paid").payload_json(r#"{"a":1}"#)
    }

    #[test]
    fn valid_event_builds_with_v7_id() {
        let e = base().header("tenant", "acme").build().unwrap();
        assert_eq!(e.id().as_uuid().get_version_num(), 7);
        assert_eq!(e.headers_json(), r#"{"tenant":"acme"}"#);
    }

    #[test]
    fn malformed_json_is_refused() {
        let err = base().payload_json("{not json").build().unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidEvent {
                    field: "payload",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn missing_payload_is_refused() {
        let err = Event::builder("order", "o-1", "order.paid")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("payload is missing"), "{err}");
    }

    #[test]
    fn nul_escape_is_refused() {
        let err = base()
            .payload_json(r#"{"a":"\u0000"}"#)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("u0000"), "{err}");
    }

    #[test]
    fn empty_aggregate_id_is_refused() {
        let err = Event::builder("order", "", "x")
            .payload_json("1")
            .build()
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidEvent {
                    field: "aggregate_id",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn odd_event_type_is_refused() {
        for bad in [
            "order paid",
            "order\npaid",
            "ördér",
            "'; drop table x; --",
            "",
            ".x",
        ] {
            let err = Event::builder("order", "o", bad)
                .payload_json("1")
                .build()
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidEvent {
                        field: "event_type",
                        ..
                    }
                ),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn reserved_and_bad_headers_are_refused() {
        for (k, v) in [
            ("ce_id", "x"),
            ("traceparent", "x"),
            ("IDEM_attempt", "1"),
            ("a b", "x"),
            ("ok", "a\u{7}"),
        ] {
            assert!(base().header(k, v).build().is_err(), "{k:?}={v:?} accepted");
        }
    }

    #[test]
    fn topic_override_is_validated() {
        assert!(base().topic("payments.v1").build().is_ok());
        assert!(base().topic("bad topic").build().is_err());
        assert!(base().topic("..").build().is_err());
    }
}
