//! The pure part of publishing: whole committed transactions grouped into one publish call,
//! and, from the delivery reports, what to send again and what to refuse for good.
//!
//! Invariants (tested below): a batch holds whole transactions, then at most a part of the
//! transaction still open (one larger than a batch, [`Batch::push_part`]), and the position
//! it confirms (`last_end_lsn`, the relay's tracker) is that of its last whole one, never
//! inside the open one; a message whose report is a transient failure
//! or "not sent" is sent again, and so is every later message of the same topic and key that
//! was acknowledged after it (the consumer then sees `2, 1, 2`, as with the polling relay,
//! never `2, 1` as the last word); a permanent failure is never resent but refused (parked in
//! table mode, dead-lettered in message mode) before the batch is confirmed.

use std::collections::HashMap;

use idem_core::event::validate_topic;
use idem_core::outbox::OutboxRecord;
use idem_core::publish::{FailureKind, Message, PublishError};
use idem_core::wire::{self, TopicNaming};

/// What one decoded change of a committed transaction becomes.
#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    /// An event to publish.
    Publish(OutboxRecord),
    /// Something that cannot be published, with why.
    Refuse(Refusal),
}

/// An event (or a row, or a message) that is not published: parked or dead-lettered.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    /// The outbox row (table mode, when its id decoded): it is parked.
    pub row_id: Option<i64>,
    /// The message's WAL position (message mode).
    pub lsn: Option<u64>,
    /// What was read, for the dead-letter record (message content or the row's values), or
    /// its first bytes when it was too large to keep.
    pub content: String,
    /// The length of what was read, in bytes (more than `content`'s when it is an excerpt).
    pub content_bytes: usize,
    /// Why.
    pub reason: String,
    /// The whole record, when it could be published but for its topic (one the cluster says
    /// is missing or refused): its dead letter keeps it whole, to be replayed once the topic
    /// takes records (`idem cdc replay-dead-letters`).
    pub record: Option<Message>,
}

impl Refusal {
    /// A refusal keeping all of `content`.
    pub fn new(row_id: Option<i64>, lsn: Option<u64>, content: String, reason: String) -> Self {
        Refusal {
            row_id,
            lsn,
            content_bytes: content.len(),
            content,
            reason,
            record: None,
        }
    }

    /// A refusal of `record`, whole, for its topic.
    pub fn of_topic(row_id: Option<i64>, record: Message, reason: String) -> Self {
        Refusal {
            record: Some(record.clone()),
            ..Refusal::new(row_id, None, record.payload, reason)
        }
    }
}

/// One committed transaction, decoded, in stream (= commit) order.
#[derive(Clone, Debug, PartialEq)]
pub struct Committed {
    /// The end of its commit record: the position to confirm once it is published.
    pub end_lsn: u64,
    /// Its changes, in transaction order.
    pub items: Vec<Item>,
}

/// Whole transactions, encoded for one publish call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    /// The messages, in commit order.
    pub messages: Vec<Message>,
    /// The outbox row id of each message (table mode; `None` in message mode).
    pub rows: Vec<Option<i64>>,
    /// What is refused without being sent (a topic Kafka rejects, an undecodable change).
    pub refused: Vec<Refusal>,
    /// The `end_lsn` of its last transaction (0 when empty).
    pub last_end_lsn: u64,
    /// How many transactions it holds.
    pub transactions: usize,
    /// The bytes of its messages' and refusals' strings, about.
    pub bytes: usize,
}

/// Bytes past which a batch is published whatever its count of messages (as a transaction's
/// part, [`crate::changes::PART_BYTES`]): rows with large payloads or headers do not pile up
/// until the count is reached.
pub const BATCH_BYTES: usize = crate::changes::PART_BYTES;

impl Batch {
    /// Adds a whole transaction.
    pub fn push(&mut self, txn: Committed, naming: &TopicNaming, source: Option<&str>) {
        self.push_items(txn.items, naming, source);
        self.last_end_lsn = self.last_end_lsn.max(txn.end_lsn);
        self.transactions += 1;
    }

    /// Adds the changes of a transaction still open (a part of one larger than a batch): its
    /// events follow the batch's whole transactions; the batch confirms none of it (the
    /// transaction is confirmed once its Commit arrived and all its parts are published).
    pub fn push_part(&mut self, items: Vec<Item>, naming: &TopicNaming, source: Option<&str>) {
        self.push_items(items, naming, source);
    }

    fn push_items(&mut self, items: Vec<Item>, naming: &TopicNaming, source: Option<&str>) {
        for item in items {
            match item {
                Item::Publish(record) => self.push_record(record, naming, source),
                Item::Refuse(r) => self.push_refusal(r),
            }
        }
    }

    fn push_record(&mut self, record: OutboxRecord, naming: &TopicNaming, source: Option<&str>) {
        let topic = naming.topic_for(&record);
        match validate_topic(&topic) {
            Ok(()) => {
                let message = wire::encode(&record, &topic, source);
                self.bytes += message_bytes(&message);
                self.messages.push(message);
                self.rows.push((record.id > 0).then_some(record.id));
            }
            Err(reason) => {
                let refused = Refusal::new(Some(record.id), None, record.payload, reason);
                self.push_refusal(refused);
            }
        }
    }

    fn push_refusal(&mut self, r: Refusal) {
        self.bytes += r.content.len() + r.reason.len();
        self.refused.push(r);
    }

    /// Whether nothing was added: no transaction, no part of one.
    pub fn is_empty(&self) -> bool {
        self.transactions == 0 && self.messages.is_empty() && self.refused.is_empty()
    }

    /// Whether it is to be published now whatever the linger: `messages` messages, or
    /// [`BATCH_BYTES`].
    pub fn is_full(&self, messages: usize) -> bool {
        self.messages.len() >= messages.max(1) || self.bytes >= BATCH_BYTES
    }
}

/// The bytes of a message's strings.
fn message_bytes(m: &Message) -> usize {
    let headers: usize = m.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    m.topic.len() + m.key.len() + m.payload.len() + headers
}

/// What the reports of one publish call leave to do.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reported {
    /// Indices (into the batch's messages) to send again, in order.
    pub again: Vec<usize>,
    /// Indices refused for good, with the broker's failure.
    pub refused: Vec<(usize, PublishError)>,
}

/// Sorts the reports of `sent` (indices into `messages`, in the order they were handed to the
/// publisher; `results` has one entry per sent message).
pub fn reported(
    messages: &[Message],
    sent: &[usize],
    results: &[Result<(), PublishError>],
) -> Reported {
    let mut out = Reported::default();
    // The first position (in `sent`) of a transient failure or not-sent message, per key.
    let mut first_retry: HashMap<(&str, &str), usize> = HashMap::new();
    for (pos, &i) in sent.iter().enumerate() {
        let Some(m) = messages.get(i) else { continue };
        let result = results.get(pos).cloned().unwrap_or_else(|| {
            Err(PublishError {
                kind: FailureKind::Transient,
                reason: "the publisher returned no delivery report".to_owned(),
            })
        });
        let key = (m.topic.as_str(), m.key.as_str());
        let retry_from = first_retry.get(&key).copied();
        match result {
            Err(e) if e.kind.is_permanent() => out.refused.push((i, e)),
            Err(_) => {
                first_retry.entry(key).or_insert(pos);
                out.again.push(i);
            }
            // Acknowledged after an earlier copy of its key failed: sent again after it.
            Ok(()) if retry_from.is_some_and(|p| p < pos) => out.again.push(i),
            Ok(()) => {}
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn msg(key: &str) -> Message {
        Message {
            topic: "t".into(),
            key: key.into(),
            payload: "{}".into(),
            headers: vec![],
        }
    }

    fn err(kind: FailureKind) -> Result<(), PublishError> {
        Err(PublishError {
            kind,
            reason: format!("{kind:?}"),
        })
    }

    #[test]
    fn a_transient_failure_resends_it_and_every_later_acknowledged_message_of_its_key() {
        let m = [msg("a"), msg("b"), msg("a"), msg("a"), msg("b")];
        let r = reported(
            &m,
            &[0, 1, 2, 3, 4],
            &[
                err(FailureKind::Transient),
                Ok(()),
                Ok(()),
                err(FailureKind::NotSent),
                Ok(()),
            ],
        );
        assert_eq!(r.again, vec![0, 2, 3], "key b is untouched");
        assert!(r.refused.is_empty());
    }

    #[test]
    fn an_acknowledged_message_before_the_failure_of_its_key_is_not_resent() {
        let m = [msg("a"), msg("a")];
        let r = reported(&m, &[0, 1], &[Ok(()), err(FailureKind::Transient)]);
        assert_eq!(r.again, vec![1]);
    }

    #[test]
    fn a_permanent_failure_is_refused_never_resent_and_a_missing_report_is_transient() {
        let m = [msg("a"), msg("a"), msg("b")];
        let r = reported(
            &m,
            &[0, 1, 2],
            &[err(FailureKind::Permanent), err(FailureKind::NotSent)],
        );
        assert_eq!(
            r.refused,
            vec![(0, err(FailureKind::Permanent).unwrap_err())]
        );
        assert_eq!(r.again, vec![1, 2], "no report for 2: sent again");
    }

    #[test]
    fn a_resend_reports_against_the_indices_it_sent() {
        let m = [msg("a"), msg("b"), msg("c")];
        let r = reported(&m, &[2, 0], &[Ok(()), err(FailureKind::Transient)]);
        assert_eq!(r.again, vec![0]);
    }

    #[test]
    fn a_batch_holds_whole_transactions_and_refuses_unusable_topics_without_sending() {
        let mut b = Batch::default();
        assert!(b.is_empty());
        let mut bad = crate::batch::tests::record(2);
        bad.topic = Some("no spaces allowed".into());
        b.push(
            Committed {
                end_lsn: 40,
                items: vec![Item::Publish(record(1)), Item::Publish(bad)],
            },
            &TopicNaming::default(),
            None,
        );
        b.push(
            Committed {
                end_lsn: 90,
                items: vec![],
            },
            &TopicNaming::default(),
            None,
        );
        assert_eq!((b.transactions, b.last_end_lsn), (2, 90));
        assert_eq!(b.messages.len(), 1);
        assert_eq!(b.rows, vec![Some(1)]);
        assert_eq!(b.refused.len(), 1);
        assert_eq!(b.refused[0].row_id, Some(2));
    }

    #[test]
    fn a_part_follows_the_whole_transactions_confirms_none_of_it_and_is_not_empty() {
        let naming = TopicNaming::default();
        let mut b = Batch::default();
        b.push_part(vec![Item::Publish(record(1))], &naming, None);
        assert!(!b.is_empty(), "a batch holding only a part is not empty");
        assert_eq!(
            (b.transactions, b.last_end_lsn),
            (0, 0),
            "nothing to confirm"
        );
        let mut b = Batch::default();
        let whole = Committed {
            end_lsn: 40,
            items: vec![Item::Publish(record(1))],
        };
        b.push(whole, &naming, None);
        b.push_part(vec![Item::Publish(record(2))], &naming, None);
        assert_eq!(
            b.rows,
            vec![Some(1), Some(2)],
            "the part after the whole one"
        );
        assert_eq!((b.transactions, b.last_end_lsn), (1, 40));
    }

    #[test]
    fn a_batch_is_full_at_its_count_or_at_its_bytes() {
        let naming = TopicNaming::default();
        let mut b = Batch::default();
        assert!(!b.is_full(2));
        b.push_part(vec![Item::Publish(record(1))], &naming, None);
        assert!(!b.is_full(2) && b.is_full(1));
        let mut big = record(2);
        big.headers.insert("h".into(), "v".repeat(BATCH_BYTES));
        b.push_part(vec![Item::Publish(big)], &naming, None);
        assert!(b.is_full(1000), "one message over the bytes: full");
    }

    pub(crate) fn record(id: i64) -> OutboxRecord {
        OutboxRecord {
            id,
            event_id: idem_core::EventId::new(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            aggregate_seq: id,
            event_type: "order.paid".into(),
            payload: "{}".into(),
            headers: Default::default(),
            topic: None,
            traceparent: None,
            occurred_at: chrono::Utc::now(),
            created_at: chrono::Utc::now(),
            attempt: 1,
            permanent_failures: 0,
        }
    }
}
