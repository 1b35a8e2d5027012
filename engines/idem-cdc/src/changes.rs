//! From replication events to committed transactions of outbox events ([`Assembler`]), and
//! the few statements the relay writes back: parking a refused row, marking published rows.
//!
//! The assembler keeps one transaction open between `Begin` and `Commit`; every change of it
//! becomes an [`Item`] (an event, or a refusal with its reason), so a row or message that
//! cannot be published is set aside with the reason instead of stopping the stream or being
//! skipped. Anything that breaks the stream's own structure (a change outside a transaction, a
//! malformed pgoutput message) is an error: the relay stops without confirming it.

use std::collections::HashMap;
use std::sync::Arc;

use idem_core::TableNames;
use idem_core::outbox::OutboxRecord;
use idem_core::publish::Message;
use sqlx::PgPool;

use crate::batch::{Committed, Item, Refusal};
use crate::error::CdcError;
use crate::pgoutput::{Change, Decoder, Relation};
use crate::record::{OutboxColumns, OutboxTable, RowAction, ValueProblem};
use crate::relay::Mode;

/// Assembles committed transactions from the stream.
pub struct Assembler {
    mode: Mode,
    decoder: Decoder,
    outbox: Option<OutboxTable>,
    /// Resolved column positions per outbox relation (by oid).
    columns: HashMap<u32, Result<OutboxColumns, String>>,
    open: Option<Open>,
}

impl std::fmt::Debug for Assembler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Assembler")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

/// The transaction between its Begin and its Commit: what the server said of its commit in
/// Begin (every transaction the stream carries has committed), and its changes not yet taken.
struct Open {
    /// The position of its commit record (Begin's `final_lsn`): message mode's
    /// `aggregate_seq`.
    commit_lsn: u64,
    /// Its commit time.
    committed_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Its changes not yet taken ([`Assembler::take_part`], [`Assembler::commit`]).
    pending: Vec<Pending>,
    /// Messages of it seen so far (a message's ordinal in its transaction).
    seen: u32,
    /// Bytes of the records (every string of each) and message content in `pending`.
    bytes: usize,
}

/// Held changes of one open transaction past which the relay publishes what it holds of it
/// ([`Assembler::part_due`]), whatever the batch size: 16 MiB.
pub const PART_BYTES: usize = 16 * 1024 * 1024;

/// A change of the open transaction: decoded, or a message still to decode (as the relay
/// takes it).
enum Pending {
    Item(Item),
    Message { lsn: u64, content: Vec<u8> },
}

impl Assembler {
    /// An assembler for `mode`; `current_schema` is where an unqualified outbox table lives.
    pub fn new(mode: Mode, current_schema: &str) -> Self {
        let outbox = match &mode {
            Mode::Table(t) => Some(OutboxTable::new(t, current_schema)),
            Mode::Messages { .. } => None,
        };
        Assembler {
            mode,
            decoder: Decoder::new(),
            outbox,
            columns: HashMap::new(),
            open: None,
        }
    }

    /// Whether a transaction is open (begun, not committed).
    pub fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// A transaction begins; its commit record is at `commit_lsn`, written at `committed_at`
    /// (microseconds since 2000-01-01 as the server sends it).
    pub fn begin(&mut self, commit_lsn: u64, committed_at: i64) -> Result<(), CdcError> {
        let open = Open {
            commit_lsn,
            committed_at: pg_time(committed_at),
            pending: Vec::new(),
            seen: 0,
            bytes: 0,
        };
        if self.open.replace(open).is_some() {
            return Err(stream(None, "a transaction began inside another one"));
        }
        Ok(())
    }

    /// Whether the open transaction holds `batch` changes or [`PART_BYTES`] of records and
    /// message content, so that what the relay holds of it is to be published now
    /// ([`Assembler::take_part`]).
    pub fn part_due(&self, batch: usize) -> bool {
        self.open
            .as_ref()
            .is_some_and(|o| o.pending.len() >= batch.max(1) || o.bytes >= PART_BYTES)
    }

    /// The changes of the open transaction so far, taken out so that a transaction of any
    /// size needs no more memory than one part of it: the stream carries committed
    /// transactions only, so they may be published before their Commit arrives (confirmed,
    /// as ever, only after it). Empty when no transaction is open.
    pub fn take_part(&mut self) -> Vec<Item> {
        self.open.as_mut().map_or_else(Vec::new, Open::take)
    }

    /// A pgoutput message of the open transaction (or a Relation between transactions);
    /// `true` when it is a change the relay ignores (update, delete, truncate).
    pub fn data(&mut self, data: &[u8], lsn: u64) -> Result<bool, CdcError> {
        let change = self
            .decoder
            .decode(data)
            .map_err(|e| stream(Some(lsn), &e.to_string()))?;
        match change {
            Change::Relation(r) => {
                self.columns.remove(&r.oid);
                Ok(false)
            }
            Change::Insert { relation, values } => {
                let item = self.insert(&relation, &values, lsn)?;
                let open = self
                    .open
                    .as_mut()
                    .ok_or_else(|| stream(Some(lsn), "an insert outside a transaction"))?;
                if let Some(item) = item {
                    open.bytes += item_bytes(&item);
                    open.pending.push(Pending::Item(item));
                }
                Ok(false)
            }
            Change::Ignored { .. } => Ok(true),
            Change::Skipped(_) => Ok(false),
        }
    }

    /// An inserted row: an event when it is an outbox row that decodes, a refusal when it is
    /// one that does not (parked by id; dead-lettered when even its id does not decode), nothing
    /// for another table's row or a row not inserted as pending. A session that prints values in
    /// another form than the decoder reads is an error: every row would fail the same way.
    fn insert(
        &mut self,
        relation: &Arc<Relation>,
        values: &[Option<&str>],
        lsn: u64,
    ) -> Result<Option<Item>, CdcError> {
        let Some(outbox) = self.outbox.as_ref() else {
            return Ok(None);
        };
        if !outbox.matches(relation) {
            return Ok(None);
        }
        let columns = self
            .columns
            .entry(relation.oid)
            .or_insert_with(|| OutboxColumns::resolve(relation).map_err(|e| e.to_string()));
        let refuse = |row_id, reason| {
            Item::Refuse(Refusal::new(
                row_id,
                None,
                row_text(relation, values),
                reason,
            ))
        };
        let c = match columns {
            Ok(c) => c,
            Err(reason) => {
                let reason = format!("the outbox table's shape is not the contract's: {reason}");
                return Ok(Some(refuse(None, reason)));
            }
        };
        let e = match c.decode(values) {
            Ok(record) => return Ok(Some(Item::Publish(record))),
            Err(e) => e,
        };
        match (e.action(), &e.problem) {
            (RowAction::Park, _) => Ok(Some(refuse(e.id, e.to_string()))),
            (RowAction::Skip, _) => Ok(None),
            (RowAction::Stop, ValueProblem::NotIso(_)) => Err(stream(Some(lsn), &e.to_string())),
            (RowAction::Stop, _) => Ok(Some(refuse(None, e.to_string()))),
        }
    }

    /// A logical decoding message: an event in message mode when its prefix is the relay's.
    /// A non-transactional one with the relay's prefix is returned as a transaction of its
    /// own holding its refusal (it is written even when its transaction rolls back, so it is
    /// never an outbox event); it confirms nothing.
    pub fn message(
        &mut self,
        transactional: bool,
        lsn: u64,
        prefix: &str,
        content: &[u8],
    ) -> Option<Committed> {
        let Mode::Messages { prefix: ours } = &self.mode else {
            return None;
        };
        if prefix != ours {
            return None;
        }
        // Only an excerpt of a refused message is kept: a hostile one may be huge.
        let refuse = |reason: String| {
            let cut = &content[..content.len().min(DEAD_LETTER_EXCERPT_BYTES)];
            Item::Refuse(Refusal {
                row_id: None,
                lsn: Some(lsn),
                content: String::from_utf8_lossy(cut).into_owned(),
                content_bytes: content.len(),
                reason,
                record: None,
            })
        };
        let open = match self.open.as_mut() {
            Some(open) if transactional => open,
            _ => {
                let reason = "a non-transactional message with the outbox prefix: it is written \
                              even when its transaction rolls back (use \
                              pg_logical_emit_message(true, ...))";
                return Some(Committed {
                    end_lsn: 0,
                    items: vec![refuse(reason.to_owned())],
                });
            }
        };
        // Refused at once, not held until the commit: the relay keeps a transaction's
        // messages in memory until then, and one emitted message may be of any size.
        let limit = idem_core::envelope::MAX_CONTENT_BYTES;
        if content.len() > limit {
            let reason = format!(
                "the message is {} bytes, the limit is {limit}",
                content.len()
            );
            open.pending.push(Pending::Item(refuse(reason)));
            return None;
        }
        open.bytes += content.len();
        open.pending.push(Pending::Message {
            lsn,
            content: content.to_vec(),
        });
        None
    }

    /// The open transaction's Commit arrived: its changes not taken yet; `end_lsn` is the
    /// position to confirm once they (and the parts taken before) are published.
    pub fn commit(&mut self, end_lsn: u64) -> Result<Committed, CdcError> {
        let mut open = self
            .open
            .take()
            .ok_or_else(|| stream(Some(end_lsn), "a commit without a transaction"))?;
        Ok(Committed {
            end_lsn,
            items: open.take(),
        })
    }
}

impl Open {
    /// Its pending changes as items, messages decoded at the commit's position.
    fn take(&mut self) -> Vec<Item> {
        self.bytes = 0;
        let pending = std::mem::take(&mut self.pending);
        pending
            .into_iter()
            .map(|p| match p {
                Pending::Item(item) => item,
                Pending::Message { lsn, content } => {
                    let ordinal = self.seen;
                    self.seen = self.seen.saturating_add(1);
                    self.message(lsn, ordinal, &content)
                }
            })
            .collect()
    }

    fn message(&self, lsn: u64, ordinal: u32, content: &[u8]) -> Item {
        let (seq, at) = (self.commit_lsn, self.committed_at);
        match idem_core::envelope::decode_committed(lsn, seq, ordinal, at, content) {
            Ok(record) => Item::Publish(record),
            Err(e) => Item::Refuse(Refusal::new(
                None,
                Some(lsn),
                String::from_utf8_lossy(content).into_owned(),
                e.to_string(),
            )),
        }
    }
}

/// What an item holds in memory, about: every string of its record (a foreign writer's
/// headers may be as large as its payload), or what a refusal keeps.
fn item_bytes(item: &Item) -> usize {
    match item {
        Item::Publish(r) => record_bytes(r),
        Item::Refuse(r) => r.content.len() + r.reason.len(),
    }
}

/// The bytes of a record's strings.
fn record_bytes(r: &OutboxRecord) -> usize {
    let headers: usize = r.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    let optional = |s: &Option<String>| s.as_ref().map_or(0, String::len);
    r.payload.len()
        + headers
        + r.aggregate_type.len()
        + r.aggregate_id.len()
        + r.event_type.len()
        + optional(&r.topic)
        + optional(&r.traceparent)
}

/// Microseconds since 2000-01-01 UTC (PostgreSQL's epoch) as a time; `None` out of range.
fn pg_time(micros: i64) -> Option<chrono::DateTime<chrono::Utc>> {
    const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;
    micros
        .checked_add(PG_EPOCH_MICROS)
        .and_then(chrono::DateTime::from_timestamp_micros)
}

/// Parses `X/Y` as PostgreSQL prints an LSN.
pub fn parse_lsn(text: &str) -> Option<u64> {
    let (hi, lo) = text.split_once('/')?;
    let hi = u64::from_str_radix(hi, 16).ok()?;
    let lo = u64::from_str_radix(lo, 16).ok()?;
    (hi <= 0xFFFF_FFFF && lo <= 0xFFFF_FFFF).then_some((hi << 32) | lo)
}

/// A row's values as `column=value` text, for a dead-letter record.
fn row_text(relation: &Relation, values: &[Option<&str>]) -> String {
    let pairs: serde_json::Map<String, serde_json::Value> = relation
        .columns
        .iter()
        .zip(values)
        .map(|(c, v)| {
            (
                c.name.clone(),
                v.map_or(serde_json::Value::Null, |v| {
                    serde_json::Value::String(v.to_owned())
                }),
            )
        })
        .collect();
    serde_json::Value::Object(pairs).to_string()
}

/// `X/Y` as PostgreSQL prints an LSN.
pub fn show_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

fn stream(lsn: Option<u64>, reason: &str) -> CdcError {
    CdcError::Stream {
        lsn,
        reason: reason.to_owned(),
    }
}

/// Parks outbox row `id` with `reason` (table mode).
pub async fn park(
    pool: &PgPool,
    tables: &TableNames,
    id: i64,
    reason: &str,
) -> Result<(), CdcError> {
    let statements = idem_sql::postgres::CdcStatements::shared(tables);
    sqlx::query(&statements.park)
        .bind(id)
        .bind(reason)
        .execute(pool)
        .await
        .map_err(|e| CdcError::db(format!("parking outbox row {id}"), e))?;
    Ok(())
}

/// Marks outbox rows `ids` published (table mode), or deletes them (`delete`).
pub async fn mark_published(
    pool: &PgPool,
    tables: &TableNames,
    ids: &[i64],
    delete: bool,
) -> Result<(), CdcError> {
    if ids.is_empty() {
        return Ok(());
    }
    let statements = idem_sql::postgres::CdcStatements::shared(tables);
    let sql = match delete {
        false => &statements.mark_published,
        true => &statements.delete_published,
    };
    sqlx::query(sql)
        .bind(ids)
        .execute(pool)
        .await
        .map_err(|e| CdcError::db("marking published outbox rows", e))?;
    Ok(())
}

/// The most of a refusal's content a dead letter carries: 64 KiB, far below Kafka's default
/// record limit (1 MB), so that a huge hostile message or row can always be dead-lettered.
pub const DEAD_LETTER_EXCERPT_BYTES: usize = 64 * 1024;

/// The most of a refusal's reason a dead letter carries: a reason may quote the value it
/// refuses (a header name of a megabyte).
pub const DEAD_LETTER_REASON_BYTES: usize = 1024;

/// The header of a whole-record dead letter naming the topic the record was meant for.
pub const DEAD_LETTER_TOPIC: &str = "idem_dead_letter_topic";

/// The header of a dead letter holding why it was refused.
pub const DEAD_LETTER_REASON: &str = "idem_dead_letter_reason";

/// The dead-letter record of a refusal: the reason and where it came from in headers, what
/// was read as the value. A record refused for its topic alone is kept whole: its key, value
/// and headers, the topic it was meant for in [`DEAD_LETTER_TOPIC`].
pub fn dead_letter(topic: &str, r: &Refusal) -> Message {
    let reason = excerpt(&r.reason, DEAD_LETTER_REASON_BYTES).to_owned();
    if let Some(record) = &r.record {
        let mut headers = record.headers.clone();
        headers.push((DEAD_LETTER_REASON.to_owned(), reason));
        headers.push((DEAD_LETTER_TOPIC.to_owned(), record.topic.clone()));
        if let Some(lsn) = r.lsn {
            headers.push(("idem_lsn".to_owned(), show_lsn(lsn)));
        }
        return Message {
            topic: topic.to_owned(),
            key: record.key.clone(),
            payload: record.payload.clone(),
            headers,
        };
    }
    let mut headers = vec![(DEAD_LETTER_REASON.to_owned(), reason)];
    if let Some(id) = r.row_id {
        headers.push(("idem_outbox_id".to_owned(), id.to_string()));
    }
    if let Some(lsn) = r.lsn {
        headers.push(("idem_lsn".to_owned(), show_lsn(lsn)));
    }
    let payload = excerpt(&r.content, DEAD_LETTER_EXCERPT_BYTES);
    if payload.len() < r.content_bytes {
        headers.push((
            "idem_dead_letter_content_bytes".to_owned(),
            r.content_bytes.to_string(),
        ));
    }
    Message {
        topic: topic.to_owned(),
        key: r
            .row_id
            .map(|id| id.to_string())
            .or_else(|| r.lsn.map(show_lsn))
            .unwrap_or_default(),
        payload: payload.to_owned(),
        headers,
    }
}

/// The record a whole-record dead letter kept, as it was meant to be published: its topic
/// from [`DEAD_LETTER_TOPIC`], without the dead letter's own headers. `None` for a dead letter
/// that is an excerpt (nothing to publish again).
pub fn replayable(letter: &Message) -> Option<Message> {
    let topic = letter.header(DEAD_LETTER_TOPIC)?.to_owned();
    let ours = [DEAD_LETTER_TOPIC, DEAD_LETTER_REASON, "idem_lsn"];
    Some(Message {
        topic,
        key: letter.key.clone(),
        payload: letter.payload.clone(),
        headers: letter
            .headers
            .iter()
            .filter(|(name, _)| !ours.contains(&name.as_str()))
            .cloned()
            .collect(),
    })
}

/// The longest prefix of `s` of at most `max` bytes that ends at a character boundary.
fn excerpt(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_refused_for_its_topic_is_dead_lettered_whole_and_replayed_as_it_was() {
        let record = Message {
            topic: "orders.v2".to_owned(),
            key: "o-1".to_owned(),
            payload: r#"{"n":1}"#.to_owned(),
            headers: vec![("ce_id".to_owned(), "e-1".to_owned())],
        };
        let mut refusal = Refusal::of_topic(None, record.clone(), "missing".to_owned());
        refusal.lsn = Some(0x16_0000_0028);
        let letter = dead_letter("dl", &refusal);
        assert_eq!(letter.topic, "dl");
        assert_eq!(letter.key, "o-1");
        assert_eq!(letter.payload, record.payload);
        assert_eq!(letter.header("ce_id"), Some("e-1"));
        assert_eq!(letter.header(DEAD_LETTER_TOPIC), Some("orders.v2"));
        assert_eq!(letter.header(DEAD_LETTER_REASON), Some("missing"));
        assert_eq!(replayable(&letter), Some(record));
        let excerpt = dead_letter(
            "dl",
            &Refusal::new(None, Some(1), "abc".to_owned(), "r".to_owned()),
        );
        assert_eq!(
            replayable(&excerpt),
            None,
            "an excerpt is never published again"
        );
    }

    #[test]
    fn a_dead_letter_carries_a_bounded_excerpt_cut_at_a_character() {
        let refusal = |content: String| Refusal::new(None, Some(0x10), content, "r".to_owned());
        let small = dead_letter("dl", &refusal("abc".to_owned()));
        assert_eq!(small.payload, "abc");
        assert!(wire_header(&small, "idem_dead_letter_content_bytes").is_none());
        let big = "é".repeat(DEAD_LETTER_EXCERPT_BYTES);
        let letter = dead_letter("dl", &refusal(big.clone()));
        assert!(letter.payload.len() <= DEAD_LETTER_EXCERPT_BYTES);
        assert!(letter.payload.len() >= DEAD_LETTER_EXCERPT_BYTES - 1);
        assert!(big.starts_with(&letter.payload));
        assert_eq!(
            wire_header(&letter, "idem_dead_letter_content_bytes"),
            Some(big.len().to_string().as_str())
        );
        let quoting = Refusal {
            reason: "q".repeat(10 * DEAD_LETTER_REASON_BYTES),
            ..refusal(String::new())
        };
        let letter = dead_letter("dl", &quoting);
        assert_eq!(
            wire_header(&letter, "idem_dead_letter_reason").map(str::len),
            Some(DEAD_LETTER_REASON_BYTES)
        );
        assert_eq!(excerpt("aé", 2), "a");
        assert_eq!(excerpt("", 5), "");
    }

    fn wire_header<'m>(m: &'m Message, name: &str) -> Option<&'m str> {
        idem_core::wire::first_header(&m.headers, name)
    }

    #[test]
    fn an_oversized_message_is_refused_on_arrival_and_only_an_excerpt_is_kept() {
        let mut a = Assembler::new(
            Mode::Messages {
                prefix: "idem.outbox".into(),
            },
            "public",
        );
        a.begin(0x18, 0).unwrap_or_else(|e| panic!("{e}"));
        let huge = vec![b'x'; idem_core::envelope::MAX_CONTENT_BYTES + 1];
        assert!(a.message(true, 0x10, "idem.outbox", &huge).is_none());
        let txn = a.commit(0x20).unwrap_or_else(|e| panic!("{e}"));
        let [Item::Refuse(r)] = txn.items.as_slice() else {
            panic!("{:?}", txn.items.len())
        };
        assert_eq!(r.content.len(), DEAD_LETTER_EXCERPT_BYTES);
        assert_eq!(r.content_bytes, huge.len(), "the full length is kept");
        let letter = dead_letter("dl", r);
        assert_eq!(
            wire_header(&letter, "idem_dead_letter_content_bytes"),
            Some(huge.len().to_string().as_str())
        );
        assert!(r.reason.contains(&huge.len().to_string()), "{}", r.reason);
        assert_eq!(r.lsn, Some(0x10));
    }

    #[test]
    fn a_transaction_taken_in_parts_gives_every_event_its_commit_position() {
        let mut a = Assembler::new(
            Mode::Messages {
                prefix: "idem.outbox".into(),
            },
            "public",
        );
        assert!(!a.part_due(1), "no transaction open");
        assert!(a.take_part().is_empty());
        a.begin(0x500, 0).unwrap_or_else(|e| panic!("{e}"));
        let content = |n: u32| {
            let e = idem_core::Event::builder("order", "o-1", "order.paid")
                .payload_json(format!("{{\"n\":{n}}}"))
                .build()
                .unwrap_or_else(|e| panic!("{e}"));
            idem_core::envelope::encode(&e)
        };
        for (lsn, n) in [(0x100, 1), (0x200, 2)] {
            assert!(
                a.message(true, lsn, "idem.outbox", content(n).as_bytes())
                    .is_none()
            );
        }
        assert!(a.part_due(2) && !a.part_due(3));
        let part = a.take_part();
        assert!(!a.part_due(1), "taken");
        assert!(
            a.message(true, 0x300, "idem.outbox", content(3).as_bytes())
                .is_none()
        );
        let txn = a.commit(0x600).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(txn.end_lsn, 0x600);
        let records: Vec<(i64, i64)> = part
            .iter()
            .chain(&txn.items)
            .map(|i| match i {
                Item::Publish(r) => (r.id, r.aggregate_seq),
                Item::Refuse(r) => panic!("{}", r.reason),
            })
            .collect();
        assert_eq!(
            records,
            vec![(0x100, 0x500), (0x200, 0x500), (0x300, 0x500)]
        );
        // Past PART_BYTES of content a part is due whatever the count.
        a.begin(0x900, 0).unwrap_or_else(|e| panic!("{e}"));
        let big = vec![b'x'; idem_core::envelope::MAX_CONTENT_BYTES];
        let mut n = 0;
        while !a.part_due(usize::MAX) {
            assert!(a.message(true, 0x1000 + n, "idem.outbox", &big).is_none());
            n += 1;
        }
        assert_eq!(usize::try_from(n).unwrap(), PART_BYTES.div_ceil(big.len()));
    }

    #[test]
    fn a_record_counts_all_its_strings_toward_a_part_not_its_payload_only() {
        // A foreign writer's row with an empty payload and huge headers: counting the
        // payload alone, no part would ever be due and the transaction would sit in memory.
        let mut r = crate::batch::tests::record(1);
        r.headers.insert("h".repeat(10), "v".repeat(1 << 20));
        let bytes = item_bytes(&Item::Publish(r));
        assert!(bytes > (1 << 20) + 10, "{bytes}");
    }

    #[test]
    fn lsns_print_as_postgresql_prints_them() {
        assert_eq!(show_lsn(0x016B_6C50), "0/16B6C50");
        assert_eq!(show_lsn((0x16 << 32) | 0xB374_D848), "16/B374D848");
        assert_eq!(parse_lsn("16/B374D848"), Some((0x16 << 32) | 0xB374_D848));
        assert_eq!(parse_lsn("0/0"), Some(0));
        for bad in ["", "0", "x/1", "1/1/1", "100000000/0"] {
            assert_eq!(parse_lsn(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_dead_letter_carries_the_reason_and_the_origin() {
        let m = dead_letter(
            "dlq",
            &Refusal::new(None, Some(0x10), "x".into(), "bad".into()),
        );
        assert_eq!((m.topic.as_str(), m.key.as_str()), ("dlq", "0/10"));
        assert_eq!(m.header("idem_dead_letter_reason"), Some("bad"));
    }
}
