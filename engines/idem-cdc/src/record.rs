//! An inserted outbox row, as the CDC relay reads it from pgoutput, to the
//! [`OutboxRecord`] the polling relay would have claimed for the same row.
//!
//! Both relays share one wire contract ([`idem_core::wire::encode`]), so a consumer cannot tell
//! which relay published an event. **Invariant**: for every row the polling relay decodes, this
//! module gives the same record, field for field, except the two fields that describe the
//! polling relay's own attempts:
//!
//! - `attempt` is 1: the first publish of that row by this relay. The CDC relay keeps no
//!   attempt count (it writes nothing back), so a resend after a restart is also 1; consumers
//!   tell copies apart by `ce_id`, never by `idem_attempt`.
//! - `permanent_failures` is 0.
//!
//! Values arrive as PostgreSQL prints them with `DateStyle=ISO` and `TimeZone=UTC` (the relay
//! pins both in the replication session's startup options): `timestamptz` like
//! `2026-12-01 23:51:28.586123+00`, `jsonb` in its canonical text (what the polling relay's
//! `payload::text` gives), `uuid`, `bigint`. Columns are found by name, so a table with extra or
//! reordered columns decodes; a missing column, or one of another type than the migrations
//! create, is a [`ShapeError`] naming it. A row the relay cannot decode is a [`RowError`]
//! carrying the row's `id` and `event_id` when they decoded, so the relay can park that row
//! with the reason ([`RowError::action`]). A row inserted with a `status` other than `pending`
//! (writers never set it) is not published, as the polling relay would never claim it.

use chrono::{DateTime, NaiveDate, NaiveDateTime, NaiveTime, TimeDelta, Utc};
use idem_core::TableNames;
use idem_core::event::EventId;
use idem_core::outbox::{OutboxRecord, headers_from_json};
use uuid::Uuid;

use crate::pgoutput::Relation;

/// Type oids of the built-in types the outbox columns use (`pg_type.oid`).
mod oid {
    pub(super) const NAME: u32 = 19;
    pub(super) const INT8: u32 = 20;
    pub(super) const TEXT: u32 = 25;
    pub(super) const JSON: u32 = 114;
    pub(super) const BPCHAR: u32 = 1042;
    pub(super) const VARCHAR: u32 = 1043;
    pub(super) const TIMESTAMPTZ: u32 = 1184;
    pub(super) const UUID: u32 = 2950;
    pub(super) const JSONB: u32 = 3802;
}

/// String types the polling relay's decoder accepts for a text column.
const STRING: &[u32] = &[oid::TEXT, oid::VARCHAR, oid::BPCHAR, oid::NAME];
/// JSON types.
const JSON: &[u32] = &[oid::JSONB, oid::JSON];

/// The configured outbox table, to tell its Relation messages from any other table's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxTable {
    namespace: String,
    name: String,
}

impl OutboxTable {
    /// The outbox of `tables`. `current_schema` is the schema an unqualified name resolves to
    /// (`SELECT current_schema()` on the relay's control connection), used when `tables` names
    /// no schema. The names are compared, never spliced into SQL.
    pub fn new(tables: &TableNames, current_schema: &str) -> Self {
        OutboxTable {
            namespace: tables.schema().unwrap_or(current_schema).to_owned(),
            name: tables.bare("outbox"),
        }
    }

    /// Whether `relation` is this outbox table (same schema and name, byte for byte).
    pub fn matches(&self, relation: &Relation) -> bool {
        relation.namespace == self.namespace && relation.name == self.name
    }
}

/// Why a relation cannot be read as the outbox table: every row of it would fail, so the relay
/// stops and says which column to fix.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShapeError {
    /// A column the record needs is not published.
    #[error(
        "relation {relation} has no column {column:?}, which the outbox contract requires (is the publication's column list or the table altered?)"
    )]
    MissingColumn {
        /// `namespace.name`.
        relation: String,
        /// The missing column.
        column: &'static str,
    },
    /// A column has another type than the migrations create.
    #[error("column {column:?} of relation {relation} has type oid {found}, expected {expected}")]
    WrongType {
        /// `namespace.name`.
        relation: String,
        /// The column.
        column: &'static str,
        /// Its type oid.
        found: u32,
        /// The types accepted, by name.
        expected: &'static str,
    },
}

/// What is wrong with one column of one row.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ValueProblem {
    /// SQL `NULL` in a column that needs a value.
    #[error("is NULL")]
    Null,
    /// The value does not parse as its type, or is one no client can hold.
    #[error("{0}")]
    Invalid(String),
    /// The value is not in the form the session should print: the replication session's
    /// `DateStyle` is not `ISO`. Every row would fail the same way, so this is not the row's
    /// fault: the relay stops instead of parking it.
    #[error("{0} (is the replication session's DateStyle not ISO?)")]
    NotIso(String),
    /// The row was inserted with a `status` other than `pending` (writers never set it): the
    /// polling relay would not publish it either.
    #[error("is {0:?}, not 'pending'")]
    NotPending(String),
}

/// What the relay does with a row that gave a [`RowError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowAction {
    /// Park the row by its id with the error as the reason: the row itself is at fault.
    Park,
    /// Publish nothing and leave the row as it is (see [`ValueProblem::NotPending`]).
    Skip,
    /// Stop the relay: every row would fail the same way (the session prints values in
    /// another form), or the row's id did not decode so it cannot be parked.
    Stop,
}

/// A row the relay cannot publish; [`RowError::action`] says what to do with it.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("outbox row {} (event {}): column {column} {problem}", show(.id), show(.event_id))]
pub struct RowError {
    /// The row's id, if it decoded.
    pub id: Option<i64>,
    /// The row's event id, if it decoded.
    pub event_id: Option<EventId>,
    /// The column that failed.
    pub column: &'static str,
    /// What is wrong with it.
    pub problem: ValueProblem,
}

impl RowError {
    /// What the relay does with this row.
    pub fn action(&self) -> RowAction {
        match (&self.problem, self.id) {
            (ValueProblem::NotIso(_), _) | (_, None) => RowAction::Stop,
            (ValueProblem::NotPending(_), Some(_)) => RowAction::Skip,
            (ValueProblem::Null | ValueProblem::Invalid(_), Some(_)) => RowAction::Park,
        }
    }
}

/// Why an inserted row did not give a record.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InsertError {
    /// The relation is not shaped like the outbox: every row fails, the relay stops.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// This row failed; see [`RowError::action`].
    #[error(transparent)]
    Row(#[from] RowError),
}

/// The record for one row inserted into `relation`, the outbox table: [`OutboxColumns`]
/// resolved for this relation each time, so that a relation the server sent again with a new
/// shape can never be read with the old one's positions.
pub fn decode_insert(
    relation: &Relation,
    values: &[Option<&str>],
) -> Result<OutboxRecord, InsertError> {
    Ok(OutboxColumns::resolve(relation)?.decode(values)?)
}

fn show<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref()
        .map_or_else(|| "unknown".to_owned(), T::to_string)
}

/// Where each column the record needs sits in the relation's tuples. Resolve it once per
/// Relation message and decode that relation's inserts with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxColumns {
    id: usize,
    event_id: usize,
    aggregate_type: usize,
    aggregate_id: usize,
    aggregate_seq: usize,
    event_type: usize,
    payload: usize,
    headers: usize,
    topic: usize,
    traceparent: usize,
    occurred_at: usize,
    created_at: usize,
    /// Optional: a publication's column list may leave it out.
    status: Option<usize>,
}

impl OutboxColumns {
    /// Finds the outbox columns in `relation` by name and checks their types.
    pub fn resolve(relation: &Relation) -> Result<Self, ShapeError> {
        let find = |column: &'static str, types: &[u32], expected: &'static str| {
            let qualified = || format!("{}.{}", relation.namespace, relation.name);
            let index = relation
                .column_index(column)
                .ok_or_else(|| ShapeError::MissingColumn {
                    relation: qualified(),
                    column,
                })?;
            let found = relation.columns.get(index).map_or(0, |c| c.type_oid);
            if types.contains(&found) {
                Ok(index)
            } else {
                Err(ShapeError::WrongType {
                    relation: qualified(),
                    column,
                    found,
                    expected,
                })
            }
        };
        Ok(OutboxColumns {
            id: find("id", &[oid::INT8], "bigint")?,
            event_id: find("event_id", &[oid::UUID], "uuid")?,
            aggregate_type: find("aggregate_type", STRING, "text")?,
            aggregate_id: find("aggregate_id", STRING, "text")?,
            aggregate_seq: find("aggregate_seq", &[oid::INT8], "bigint")?,
            event_type: find("event_type", STRING, "text")?,
            payload: find("payload", JSON, "jsonb")?,
            headers: find("headers", JSON, "jsonb")?,
            topic: find("topic", STRING, "text")?,
            traceparent: find("traceparent", STRING, "text")?,
            occurred_at: find("occurred_at", &[oid::TIMESTAMPTZ], "timestamptz")?,
            created_at: find("created_at", &[oid::TIMESTAMPTZ], "timestamptz")?,
            status: match relation.column_index("status") {
                Some(_) => Some(find("status", STRING, "text")?),
                None => None,
            },
        })
    }

    /// The record for one inserted row (`values` in the relation's column order).
    pub fn decode(&self, values: &[Option<&str>]) -> Result<OutboxRecord, RowError> {
        let mut row = Row {
            values,
            id: None,
            event_id: None,
        };
        let id = row.parse(self.id, "id", parse_i64)?;
        row.id = Some(id);
        let event_id = row.parse(self.event_id, "event_id", parse_uuid)?;
        row.event_id = Some(event_id);
        if let Some(status) = self.status.and_then(|i| row.nullable(i))
            && status != "pending"
        {
            return Err(row.fail("status", ValueProblem::NotPending(status)));
        }
        let headers = row.parse(self.headers, "headers", parse_json)?;
        Ok(OutboxRecord {
            id,
            event_id,
            aggregate_type: row.text(self.aggregate_type, "aggregate_type")?,
            aggregate_id: row.text(self.aggregate_id, "aggregate_id")?,
            aggregate_seq: row.parse(self.aggregate_seq, "aggregate_seq", parse_i64)?,
            event_type: row.text(self.event_type, "event_type")?,
            payload: row.text(self.payload, "payload")?,
            headers: headers_from_json(headers),
            topic: row.nullable(self.topic),
            traceparent: row.nullable(self.traceparent),
            occurred_at: row.parse(self.occurred_at, "occurred_at", parse_timestamptz)?,
            created_at: row.parse(self.created_at, "created_at", parse_timestamptz)?,
            attempt: 1,
            permanent_failures: 0,
        })
    }
}

/// One row's values, and what of its identity decoded so far (for the errors).
struct Row<'a> {
    values: &'a [Option<&'a str>],
    id: Option<i64>,
    event_id: Option<EventId>,
}

impl Row<'_> {
    fn fail(&self, column: &'static str, problem: ValueProblem) -> RowError {
        RowError {
            id: self.id,
            event_id: self.event_id,
            column,
            problem,
        }
    }

    fn raw(&self, index: usize, column: &'static str) -> Result<&str, RowError> {
        self.values
            .get(index)
            .and_then(Option::as_deref)
            .ok_or_else(|| self.fail(column, ValueProblem::Null))
    }

    fn text(&self, index: usize, column: &'static str) -> Result<String, RowError> {
        self.raw(index, column).map(str::to_owned)
    }

    fn nullable(&self, index: usize) -> Option<String> {
        self.values.get(index).copied().flatten().map(str::to_owned)
    }

    fn parse<T>(
        &self,
        index: usize,
        column: &'static str,
        parse: fn(&str) -> Result<T, ValueProblem>,
    ) -> Result<T, RowError> {
        let text = self.raw(index, column)?;
        parse(text).map_err(|problem| self.fail(column, problem))
    }
}

/// A short, quoted excerpt of `text` for an error message (a payload may be megabytes).
fn excerpt(text: &str) -> String {
    let cut: String = text.chars().take(64).collect();
    if cut.len() < text.len() {
        format!("{cut:?}…")
    } else {
        format!("{cut:?}")
    }
}

fn parse_i64(text: &str) -> Result<i64, ValueProblem> {
    text.parse()
        .map_err(|e| ValueProblem::Invalid(format!("{} is not a bigint: {e}", excerpt(text))))
}

fn parse_uuid(text: &str) -> Result<EventId, ValueProblem> {
    Uuid::parse_str(text)
        .map(EventId)
        .map_err(|e| ValueProblem::Invalid(format!("{} is not a UUID: {e}", excerpt(text))))
}

fn parse_json(text: &str) -> Result<serde_json::Value, ValueProblem> {
    serde_json::from_str(text)
        .map_err(|e| ValueProblem::Invalid(format!("is not JSON the relay can read: {e}")))
}

/// A `timestamptz` in PostgreSQL's ISO output: `YYYY-MM-DD HH:MM:SS[.ffffff]±HH[:MM[:SS]]`,
/// the year four digits or more, ` BC` after years before 1. Every instant chrono can hold
/// decodes to the same value the polling relay's binary decoder gives. `infinity`,
/// `-infinity` (with the polling relay's words) and instants chrono cannot hold are
/// [`ValueProblem::Invalid`]; any other form is [`ValueProblem::NotIso`].
pub fn parse_timestamptz(text: &str) -> Result<DateTime<Utc>, ValueProblem> {
    let invalid = |why: &str| Err(ValueProblem::Invalid(why.to_owned()));
    match text {
        "infinity" => return invalid("'infinity' is not a time an event can have occurred at"),
        "-infinity" => return invalid("'-infinity' is not a time an event can have occurred at"),
        _ => {}
    }
    let bad = |why: &str| {
        ValueProblem::NotIso(format!(
            "{} is not an ISO timestamptz: {why}",
            excerpt(text)
        ))
    };
    let (text_ad, bc) = match text.strip_suffix(" BC") {
        Some(rest) => (rest, true),
        None => (text, false),
    };
    let (date, time_zone) = text_ad.split_once(' ').ok_or_else(|| bad("no time"))?;
    let split = time_zone
        .rfind(['+', '-'])
        .ok_or_else(|| bad("no UTC offset"))?;
    let (time, zone) = time_zone
        .split_at_checked(split)
        .ok_or_else(|| bad("offset"))?;
    let time = parse_time(time).ok_or_else(|| bad("bad time"))?;
    let offset = parse_offset(zone).ok_or_else(|| bad("bad UTC offset"))?;
    let out_of_range = || {
        ValueProblem::Invalid(format!(
            "{} is out of the range a client can hold",
            excerpt(text)
        ))
    };
    let date = parse_date(date, bc)
        .ok_or_else(|| bad("bad date"))?
        .ok_or_else(out_of_range)?;
    NaiveDateTime::new(date, time)
        .checked_sub_signed(offset)
        .map(|local| local.and_utc())
        .ok_or_else(out_of_range)
}

fn digits(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `None`: not an ISO date; `Some(None)`: an ISO date chrono cannot hold.
fn parse_date(date: &str, bc: bool) -> Option<Option<NaiveDate>> {
    let mut parts = date.split('-');
    let (y, m, d) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || y.len() < 4 || m.len() != 2 || d.len() != 2 {
        return None;
    }
    let (month, day) = (digits(m)?, digits(d)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    let Ok(year) = i32::try_from(digits(y)?) else {
        return Some(None);
    };
    // 1 BC is year 0, 2 BC is year -1 (proleptic Gregorian, as chrono counts).
    let year = if bc {
        1i32.checked_sub(year)
    } else {
        Some(year)
    };
    Some(year.and_then(|y| NaiveDate::from_ymd_opt(y, month, day)))
}

fn parse_time(time: &str) -> Option<NaiveTime> {
    let (hms, fraction) = match time.split_once('.') {
        Some((hms, f)) => (hms, Some(f)),
        None => (time, None),
    };
    let mut parts = hms.split(':');
    let (h, m, s) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || h.len() != 2 || m.len() != 2 || s.len() != 2 {
        return None;
    }
    let micros = match fraction {
        None => 0,
        Some(f) if (1..=6).contains(&f.len()) => {
            digits(f)? * 10u32.pow(6 - u32::try_from(f.len()).ok()?)
        }
        Some(_) => return None,
    };
    NaiveTime::from_hms_micro_opt(digits(h)?, digits(m)?, digits(s)?, micros)
}

fn parse_offset(zone: &str) -> Option<TimeDelta> {
    let (sign, rest) = zone.split_at_checked(1)?;
    let sign = if sign == "-" { -1 } else { 1 };
    let mut seconds = 0i64;
    let mut unit = 3600;
    for part in rest.split(':') {
        if part.len() != 2 || unit == 0 {
            return None;
        }
        seconds += i64::from(digits(part)?) * unit;
        unit /= 60;
    }
    TimeDelta::try_seconds(sign * seconds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pgoutput::tests::{insert_msg, relation_msg};
    use crate::pgoutput::{Change, Decoder};
    use chrono::TimeZone;
    use std::collections::BTreeMap;

    /// The outbox columns as the migrations create them, in the table's order.
    const OUTBOX: &[(&str, u32)] = &[
        ("id", 20),
        ("event_id", 2950),
        ("aggregate_type", 25),
        ("aggregate_id", 25),
        ("event_type", 25),
        ("payload", 3802),
        ("headers", 3802),
        ("topic", 25),
        ("traceparent", 25),
        ("occurred_at", 1184),
        ("created_at", 1184),
        ("aggregate_seq", 20),
        ("status", 25),
        ("attempts", 23),
        ("permanent_failures", 23),
        ("next_attempt_at", 1184),
        ("claim_id", 2950),
        ("claimed_by", 25),
        ("claimed_until", 1184),
        ("last_error", 25),
        ("published_at", 1184),
    ];

    const EVENT: &str = "0192d2a4-7c1e-7000-8000-000000000001";
    const TP: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    /// A row as pgoutput sends it, by column name.
    fn row() -> BTreeMap<&'static str, Option<&'static str>> {
        BTreeMap::from([
            ("id", Some("42")),
            ("event_id", Some(EVENT)),
            ("aggregate_type", Some("order")),
            ("aggregate_id", Some("o-1")),
            ("event_type", Some("order.paid")),
            ("payload", Some(r#"{"a": [1, 2.50, {"x": null}], "b": 1}"#)),
            ("headers", Some(r#"{"n": 2.50, "tenant": "acme"}"#)),
            ("topic", None),
            ("traceparent", Some(TP)),
            ("occurred_at", Some("2026-12-01 23:51:28.586123+00")),
            ("created_at", Some("2026-12-01 23:51:28+00")),
            ("aggregate_seq", Some("3")),
            ("status", Some("pending")),
            ("attempts", Some("0")),
            ("permanent_failures", Some("0")),
            ("next_attempt_at", Some("-infinity")),
        ])
    }

    fn decode_with(
        shape: &[(&str, u32)],
        row: &BTreeMap<&str, Option<&str>>,
    ) -> Result<OutboxRecord, RowError> {
        let mut d = Decoder::new();
        d.decode(&relation_msg(7, "public", "idem_outbox", shape))
            .unwrap();
        let values: Vec<Option<&str>> = shape
            .iter()
            .map(|(c, _)| row.get(c).copied().flatten())
            .collect();
        let msg = insert_msg(7, &values);
        let Change::Insert { relation, values } = d.decode(&msg).unwrap() else {
            panic!("not an insert")
        };
        OutboxColumns::resolve(&relation).unwrap().decode(&values)
    }

    fn expected() -> OutboxRecord {
        OutboxRecord {
            id: 42,
            event_id: EVENT.parse().unwrap(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            aggregate_seq: 3,
            event_type: "order.paid".into(),
            payload: r#"{"a": [1, 2.50, {"x": null}], "b": 1}"#.into(),
            // What headers_from_json makes of the same jsonb in the polling relay.
            headers: BTreeMap::from([("n".into(), "2.5".into()), ("tenant".into(), "acme".into())]),
            topic: None,
            traceparent: Some(TP.into()),
            occurred_at: Utc.timestamp_micros(1_796_169_088_586_123).unwrap(),
            created_at: Utc.timestamp_opt(1_796_169_088, 0).unwrap(),
            attempt: 1,
            permanent_failures: 0,
        }
    }

    #[test]
    fn a_row_decodes_to_the_polling_relays_record() {
        assert_eq!(decode_with(OUTBOX, &row()).unwrap(), expected());
    }

    fn unhex(hex: &str) -> Vec<u8> {
        (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect()
    }

    /// Bytes PostgreSQL 15.20 sent for two inserts into the migrated outbox
    /// (testdata/pg15_outbox_inserts.hex), against what SQL said the rows hold:
    /// `payload::text`, `headers::text` and `extract(epoch from …) * 1e6` of the timestamps.
    #[test]
    fn real_postgresql_bytes_decode_to_the_rows_values() {
        let fixture = include_str!("../testdata/pg15_outbox_inserts.hex");
        let mut d = Decoder::new();
        let outbox = OutboxTable::new(&TableNames::default(), "public");
        let mut records = Vec::new();
        for line in fixture.lines().filter(|l| !l.starts_with('#')) {
            match d.decode(&unhex(line)).unwrap() {
                Change::Relation(r) => assert!(outbox.matches(&r), "{r:?}"),
                Change::Insert { relation, values } => {
                    records.push(decode_insert(&relation, &values).unwrap());
                }
                other => panic!("{other:?}"),
            }
        }
        let [first, second] = records.as_slice() else {
            panic!("{records:?}")
        };
        assert_eq!((first.id, first.aggregate_seq), (1, 1));
        assert_eq!(first.event_id.to_string(), EVENT);
        assert_eq!(first.aggregate_id, "o-1 \"é\"");
        assert_eq!(
            first.payload,
            r#"{"a": [1, 2.50, {"x": null}], "b": 1, "aa": "éé"}"#
        );
        let headers = headers_from_json(
            serde_json::from_str(r#"{"n": 2.50, "flag": true, "tenant": "acme"}"#).unwrap(),
        );
        assert_eq!(first.headers, headers);
        assert_eq!(first.topic.as_deref(), Some("payments.v1"));
        assert_eq!(first.traceparent.as_deref(), Some(TP));
        assert_eq!(
            first.occurred_at,
            Utc.timestamp_micros(1_796_169_088_586_123).unwrap()
        );
        assert_eq!(
            first.created_at,
            Utc.timestamp_micros(1_796_174_446_818_023).unwrap()
        );
        assert_eq!(
            (second.id, second.aggregate_seq, second.event_type.as_str()),
            (2, 2, "order.shipped")
        );
        assert_eq!(
            (
                second.payload.as_str(),
                second.headers.len(),
                second.topic.as_deref()
            ),
            ("[]", 0, None)
        );
        assert_eq!(
            second.occurred_at,
            Utc.timestamp_micros(1_796_174_446_818_023).unwrap()
        );
    }

    #[test]
    fn reordered_and_extra_columns_still_decode() {
        let mut shape: Vec<(&str, u32)> = OUTBOX.iter().rev().copied().collect();
        shape.insert(3, ("tenant_id", 25));
        assert_eq!(decode_with(&shape, &row()).unwrap(), expected());
    }

    #[test]
    fn decode_insert_reads_a_relation_sent_again_with_its_new_shape() {
        let mut d = Decoder::new();
        d.decode(&relation_msg(7, "public", "idem_outbox", OUTBOX))
            .unwrap();
        let reordered: Vec<(&str, u32)> = OUTBOX.iter().rev().copied().collect();
        d.decode(&relation_msg(7, "public", "idem_outbox", &reordered))
            .unwrap();
        let r = row();
        let values: Vec<Option<&str>> = reordered
            .iter()
            .map(|(c, _)| r.get(c).copied().flatten())
            .collect();
        let msg = insert_msg(7, &values);
        let Change::Insert {
            relation: sent,
            values,
        } = d.decode(&msg).unwrap()
        else {
            panic!("not an insert")
        };
        assert_eq!(decode_insert(&sent, &values), Ok(expected()));
        let narrow: Vec<(&str, u32)> = OUTBOX.iter().skip(1).copied().collect();
        let err = decode_insert(&relation(&narrow), &[]).unwrap_err();
        assert!(
            matches!(
                err,
                InsertError::Shape(ShapeError::MissingColumn { column: "id", .. })
            ),
            "{err}"
        );
    }

    #[test]
    fn a_missing_or_retyped_column_is_named() {
        for gone in ["id", "payload", "created_at", "topic"] {
            let shape: Vec<(&str, u32)> =
                OUTBOX.iter().filter(|(c, _)| *c != gone).copied().collect();
            let rel = relation(&shape);
            let err = OutboxColumns::resolve(&rel).unwrap_err();
            assert!(
                matches!(&err, ShapeError::MissingColumn { column, .. } if *column == gone),
                "{err}"
            );
        }
        let shape: Vec<(&str, u32)> = OUTBOX
            .iter()
            .map(|&(c, t)| if c == "payload" { (c, 25) } else { (c, t) })
            .collect();
        let err = OutboxColumns::resolve(&relation(&shape)).unwrap_err();
        assert!(
            matches!(
                err,
                ShapeError::WrongType {
                    column: "payload",
                    found: 25,
                    ..
                }
            ),
            "{err}"
        );
    }

    fn relation(shape: &[(&str, u32)]) -> Relation {
        let mut d = Decoder::new();
        match d
            .decode(&relation_msg(7, "public", "idem_outbox", shape))
            .unwrap()
        {
            Change::Relation(r) => (*r).clone(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_bad_value_names_the_row_and_the_column() {
        let mut r = row();
        r.insert("occurred_at", Some("infinity"));
        let err = decode_with(OUTBOX, &r).unwrap_err();
        assert_eq!(err.id, Some(42));
        assert_eq!(err.event_id, Some(EVENT.parse().unwrap()));
        assert_eq!(err.column, "occurred_at");
        assert!(
            err.to_string().contains("'infinity' is not a time"),
            "{err}"
        );
        assert_eq!(err.action(), RowAction::Park);
        let mut r = row();
        r.insert("created_at", Some("Tue Dec 01 23:51:28.586123 2026 UTC"));
        let err = decode_with(OUTBOX, &r).unwrap_err();
        assert!(matches!(err.problem, ValueProblem::NotIso(_)), "{err}");
        assert_eq!(
            err.action(),
            RowAction::Stop,
            "a session setting would park every row"
        );
        let mut r = row();
        r.insert("status", Some("published"));
        let err = decode_with(OUTBOX, &r).unwrap_err();
        assert_eq!(
            (err.column, err.action()),
            ("status", RowAction::Skip),
            "{err}"
        );
        let mut r = row();
        r.insert("id", Some("x"));
        assert_eq!(
            decode_with(OUTBOX, &r).unwrap_err().action(),
            RowAction::Stop
        );
        let shape: Vec<(&str, u32)> = OUTBOX
            .iter()
            .filter(|(c, _)| *c != "status")
            .copied()
            .collect();
        assert!(decode_with(&shape, &row()).is_ok(), "status is optional");
        let mut r = row();
        r.insert("event_id", Some("not-a-uuid"));
        let err = decode_with(OUTBOX, &r).unwrap_err();
        assert_eq!(
            (err.id, err.event_id, err.column),
            (Some(42), None, "event_id")
        );
        let mut r = row();
        r.insert("aggregate_id", None);
        let err = decode_with(OUTBOX, &r).unwrap_err();
        assert_eq!(
            (err.column, err.problem),
            ("aggregate_id", ValueProblem::Null)
        );
        let mut r = row();
        r.insert("id", Some("x"));
        let err = decode_with(OUTBOX, &r).unwrap_err();
        assert_eq!((err.id, err.column), (None, "id"));
    }

    #[test]
    fn headers_that_are_not_an_object_decode_as_the_polling_relay_does() {
        let mut r = row();
        r.insert("headers", Some("[1, 2]"));
        assert!(decode_with(OUTBOX, &r).unwrap().headers.is_empty());
    }

    #[test]
    fn the_outbox_table_is_recognised_by_schema_and_name() {
        let default = OutboxTable::new(&TableNames::default(), "public");
        assert!(default.matches(&relation(OUTBOX)));
        let billing = OutboxTable::new(
            &TableNames::new(Some("billing"), "idem_").unwrap(),
            "public",
        );
        assert!(!billing.matches(&relation(OUTBOX)));
        let other = OutboxTable::new(&TableNames::new(None, "x_").unwrap(), "public");
        assert!(!other.matches(&relation(OUTBOX)));
        assert!(!OutboxTable::new(&TableNames::default(), "app").matches(&relation(OUTBOX)));
    }

    /// Output of PostgreSQL 15 with `DateStyle=ISO` (in the zone shown) and the instant
    /// `extract(epoch from x) * 1e6` gives for it, both from psql on the development machine.
    #[test]
    fn timestamps_parse_as_postgresql_prints_them() {
        let micros = |m: i64| Utc.timestamp_micros(m).unwrap();
        let cases = [
            (
                "2026-12-01 23:51:28.586123+00",
                micros(1_796_169_088_586_123),
            ),
            ("2026-12-01 23:51:28+00", micros(1_796_169_088_000_000)),
            ("2000-01-01 00:00:00.1+00", micros(946_684_800_100_000)),
            ("0001-01-01 00:00:00+00", micros(-62_135_596_800_000_000)),
            (
                "10000-01-01 00:00:00.000001+00",
                micros(253_402_300_800_000_001),
            ),
            (
                "2026-12-02 05:21:28.586123+05:30",
                micros(1_796_169_088_586_123),
            ),
            (
                "1800-01-01 00:19:32+00:19:32",
                micros(-5_364_662_400_000_000),
            ),
            (
                "0044-03-15 12:00:00.5+00 BC",
                micros(-63_517_780_799_500_000),
            ),
        ];
        for (text, want) in cases {
            assert_eq!(parse_timestamptz(text), Ok(want), "{text}");
        }
        for out_of_range in [
            "infinity",
            "-infinity",
            "294277-01-01 00:00:00+00",
            "300000-01-01 00:00:00+00 BC",
        ] {
            assert!(
                matches!(
                    parse_timestamptz(out_of_range),
                    Err(ValueProblem::Invalid(_))
                ),
                "{out_of_range:?}"
            );
        }
        for bad in [
            "",
            "2026-12-01",
            "Tue Dec 01 23:51:28.586123 2026 UTC",
            "12/01/2026 23:51:28.586123 UTC",
            "2026-12-01 23:51:28",
            "26-12-01 23:51:28+00",
            "2026-13-01 00:00:00+00",
            "2026-12-01 23:51:28.1234567+00",
            "2026-12-01 23:51:28+0",
            "2026-12-01 24:00:00+00",
            "2026-12-01 23:51:28+00:00:00:00",
            "2026-12-01 23:51:28.+00",
            "2026-12-01 +1:51:28+00",
        ] {
            assert!(
                matches!(parse_timestamptz(bad), Err(ValueProblem::NotIso(_))),
                "{bad:?}"
            );
        }
    }
}
