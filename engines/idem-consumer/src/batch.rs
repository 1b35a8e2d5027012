//! One batch of records, planned before any I/O: the distinct events with their copies, the
//! records that do not decode, in-batch conflicts, the order handlers run in, and what each
//! event counts as once the batch committed. Pure.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use idem_core::store::{DeadLetter, Dedup, Delivery, InboxEntry};
use idem_core::wire::DecodeError;
use idem_core::{EventId, InboundEvent};

use crate::dead_letter::dead_letter_of;

/// One distinct event of a batch with its copies.
#[derive(Debug)]
pub(crate) struct Unique<'a> {
    /// The event (its first copy).
    pub(crate) event: &'a InboundEvent,
    /// The record of its first copy.
    pub(crate) delivery: &'a Delivery,
    /// Copies of it in the batch, the first included.
    pub(crate) copies: i32,
}

/// A batch, sorted out.
#[derive(Debug)]
pub(crate) struct Batch<'a> {
    /// The distinct events, in delivery order of their first copy.
    pub(crate) uniques: Vec<Unique<'a>>,
    /// Dead letters of the records that do not decode.
    pub(crate) undecodable: Vec<DeadLetter>,
    /// Later copies of an event id with a different payload than its first: never applied.
    pub(crate) in_batch_conflicts: Vec<(&'a InboundEvent, &'a Delivery)>,
    /// The topics the batch came from.
    pub(crate) topics: BTreeSet<&'a str>,
}

impl<'a> Batch<'a> {
    /// Sorts out `records`, decoded as `decoded` (one result per record, in order).
    pub(crate) fn new(
        records: &'a [Delivery],
        decoded: &'a [Result<InboundEvent, DecodeError>],
    ) -> Self {
        let mut batch = Batch {
            uniques: vec![],
            undecodable: vec![],
            in_batch_conflicts: vec![],
            topics: records.iter().map(|r| r.topic.as_str()).collect(),
        };
        let mut index: HashMap<EventId, usize> = HashMap::new();
        for (d, ev) in records.iter().zip(decoded) {
            let ev = match ev {
                Err(reason) => {
                    let letter = dead_letter_of(d, None, reason.to_string());
                    batch.undecodable.push(letter);
                    continue;
                }
                Ok(ev) => ev,
            };
            match index.get(&ev.event_id) {
                Some(&i) if batch.uniques[i].event.payload_hash == ev.payload_hash => {
                    batch.uniques[i].copies += 1
                }
                Some(_) => batch.in_batch_conflicts.push((ev, d)),
                None => {
                    index.insert(ev.event_id, batch.uniques.len());
                    batch.uniques.push(Unique {
                        event: ev,
                        delivery: d,
                        copies: 1,
                    });
                }
            }
        }
        batch
    }

    /// The inbox entries of the batch's events; those in `poison` are recorded dead-lettered.
    pub(crate) fn inbox_entries(&self, poison: &HashMap<EventId, String>) -> Vec<InboxEntry<'a>> {
        self.uniques
            .iter()
            .map(|u| InboxEntry {
                event: u.event,
                copies: u.copies,
                dead_lettered: poison.contains_key(&u.event.event_id),
            })
            .collect()
    }
}

/// The events a handler applies, in the order it applies them: the new ones (not known to be
/// poison), sorted by business key, stably, so one key keeps its delivery order.
pub(crate) fn apply_order<'b, 'a>(
    uniques: &'b [Unique<'a>],
    results: &[Dedup],
    poison: &HashMap<EventId, String>,
    business_key: impl Fn(&InboundEvent) -> String,
) -> Vec<&'b Unique<'a>> {
    let mut apply: Vec<(String, &Unique<'_>)> = uniques
        .iter()
        .zip(results)
        .filter(|(u, r)| **r == Dedup::New && !poison.contains_key(&u.event.event_id))
        .map(|(u, _)| (business_key(u.event), u))
        .collect();
    apply.sort_by(|a, b| a.0.cmp(&b.0));
    apply.into_iter().map(|(_, u)| u).collect()
}

/// The offset of the last record of each partition in `records`.
pub(crate) fn last_offsets(records: &[Delivery]) -> Vec<(String, i32, i64)> {
    let mut last: BTreeMap<(String, i32), i64> = BTreeMap::new();
    for r in records {
        let e = last
            .entry((r.topic.clone(), r.partition))
            .or_insert(r.offset);
        *e = (*e).max(r.offset);
    }
    last.into_iter().map(|((t, p), o)| (t, p, o)).collect()
}

/// What one event (or record) of a committed batch counts as: the increments of the batch
/// report and of the metrics under its labels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    /// Applied by the handler.
    pub(crate) processed: u64,
    /// Dead-lettered.
    pub(crate) dead_lettered: u64,
    /// Copies conflicting with a known payload.
    pub(crate) conflicts: u64,
    /// Copies of an event delivered before.
    pub(crate) duplicate_deliveries: u64,
    /// Copies skipped because the event was applied.
    pub(crate) duplicate_skips: u64,
}

impl Counts {
    /// A later copy of an event id with another payload in the same batch.
    pub(crate) const IN_BATCH_CONFLICT: Counts = Counts {
        processed: 0,
        dead_lettered: 1,
        conflicts: 1,
        duplicate_deliveries: 1,
        duplicate_skips: 0,
    };

    /// A record that does not decode.
    pub(crate) const UNDECODABLE: Counts = Counts {
        processed: 0,
        dead_lettered: 1,
        conflicts: 0,
        duplicate_deliveries: 0,
        duplicate_skips: 0,
    };

    /// A distinct event with `copies` copies, as the inbox classified it; `poisoned` when the
    /// handler refused it.
    pub(crate) fn of(copies: i32, dedup: &Dedup, poisoned: bool) -> Counts {
        let copies = u64::try_from(copies).unwrap_or(0);
        let extra = copies.saturating_sub(1);
        match dedup {
            // One dead-letter row keeps the first copy; the others were skipped.
            Dedup::New if poisoned => Counts {
                dead_lettered: 1,
                duplicate_deliveries: extra,
                duplicate_skips: extra,
                ..Counts::default()
            },
            Dedup::New => Counts {
                processed: 1,
                duplicate_deliveries: extra,
                duplicate_skips: extra,
                ..Counts::default()
            },
            Dedup::Duplicate => Counts {
                duplicate_deliveries: copies,
                duplicate_skips: copies,
                ..Counts::default()
            },
            // Every copy is a conflicting delivery; one dead-letter row keeps the first.
            Dedup::Conflict => Counts {
                dead_lettered: 1,
                conflicts: copies,
                duplicate_deliveries: copies,
                ..Counts::default()
            },
        }
    }
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, c: Counts) {
        self.processed += c.processed;
        self.dead_lettered += c.dead_lettered;
        self.conflicts += c.conflicts;
        self.duplicate_deliveries += c.duplicate_deliveries;
        self.duplicate_skips += c.duplicate_skips;
    }
}

/// What a committed batch counts under one set of label values: the metrics are raised once
/// per group with `inc_by`, not once per event.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Group<'a> {
    /// The topic.
    pub(crate) topic: &'a str,
    /// The event type read from the record (empty when absent).
    pub(crate) event_type: &'a str,
    /// The aggregate type read from the record (empty when absent).
    pub(crate) aggregate_type: &'a str,
    /// The sum of its events' counts.
    pub(crate) counts: Counts,
    /// For each applied event with a record timestamp, the time from it to the commit.
    pub(crate) waited: Vec<Duration>,
}

/// A committed batch, counted: the sum, and the same per label group, in first-seen order.
#[derive(Debug, Default)]
pub(crate) struct Tally<'a> {
    /// Everything the batch counts as.
    pub(crate) total: Counts,
    /// Per (topic, event type, aggregate type).
    pub(crate) groups: Vec<Group<'a>>,
}

impl<'a> Tally<'a> {
    fn add(&mut self, key: (&'a str, &'a str, &'a str), c: Counts, waited: Option<Duration>) {
        self.total += c;
        let i = match self
            .groups
            .iter()
            .position(|g| (g.topic, g.event_type, g.aggregate_type) == key)
        {
            Some(i) => i,
            None => {
                self.groups.push(Group {
                    topic: key.0,
                    event_type: key.1,
                    aggregate_type: key.2,
                    ..Group::default()
                });
                self.groups.len() - 1
            }
        };
        let g = &mut self.groups[i];
        g.counts += c;
        if c.processed > 0
            && let Some(w) = waited
        {
            g.waited.push(w);
        }
    }
}

impl<'a> Batch<'a> {
    /// What the batch counts as once committed at `committed_at`, with the inbox's `results`
    /// (one per distinct event) and the events refused (`poison`).
    pub(crate) fn tally<'b>(
        &'b self,
        results: &[Dedup],
        poison: &HashMap<EventId, String>,
        committed_at: SystemTime,
    ) -> Tally<'b> {
        let mut t = Tally::default();
        let key = |e: &'b InboundEvent| {
            (
                e.topic.as_str(),
                e.event_type.as_str(),
                e.aggregate_type.as_str(),
            )
        };
        for (u, dedup) in self.uniques.iter().zip(results) {
            let poisoned = poison.contains_key(&u.event.event_id);
            let waited = u
                .delivery
                .timestamp
                .map(|published| committed_at.duration_since(published).unwrap_or_default());
            t.add(key(u.event), Counts::of(u.copies, dedup, poisoned), waited);
        }
        for (ev, _) in &self.in_batch_conflicts {
            t.add(key(ev), Counts::IN_BATCH_CONFLICT, None);
        }
        for d in &self.undecodable {
            let event_type = d.event_type.as_deref().unwrap_or_default();
            t.add(
                (d.topic.as_str(), event_type, ""),
                Counts::UNDECODABLE,
                None,
            );
        }
        t
    }
}

/// A record of topic `t`, partition 0, key `k`, with `ce_id` `id` and `ce_type` `order.paid`,
/// for unit tests.
#[cfg(test)]
pub(crate) fn test_delivery(offset: i64, id: &str, payload: &str) -> Delivery {
    Delivery {
        topic: "t".into(),
        partition: 0,
        offset,
        key: Some("k".into()),
        payload: Some(payload.as_bytes().to_vec()),
        headers: vec![
            ("ce_id".into(), id.into()),
            ("ce_type".into(), "order.paid".into()),
        ],
        timestamp: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(offset: i64, id: &str, payload: &str) -> Delivery {
        Delivery {
            partition: i32::from(offset >= 10),
            ..test_delivery(offset, id, payload)
        }
    }

    const A: &str = "0190a3d2-0000-7000-8000-000000000001";
    const B: &str = "0190a3d2-0000-7000-8000-000000000002";

    #[test]
    fn copies_are_counted_conflicts_and_undecodable_records_set_apart() {
        let records = [
            record(0, A, "{}"),
            record(1, A, "{}"),
            record(2, B, "{}"),
            record(3, A, r#"{"x":1}"#),
            record(10, "nope", "{}"),
        ];
        let decoded: Vec<_> = records.iter().map(idem_core::wire::decode).collect();
        let b = Batch::new(&records, &decoded);
        let copies: Vec<(String, i32)> = b
            .uniques
            .iter()
            .map(|u| (u.event.event_id.to_string(), u.copies))
            .collect();
        assert_eq!(copies, [(A.to_owned(), 2), (B.to_owned(), 1)]);
        assert_eq!(b.in_batch_conflicts.len(), 1);
        assert_eq!(b.in_batch_conflicts[0].1.offset, 3);
        assert_eq!(b.undecodable.len(), 1);
        assert_eq!(b.undecodable[0].reason, r#"ce_id "nope" is not a UUID"#);
        assert_eq!(
            last_offsets(&records),
            [("t".into(), 0, 3), ("t".into(), 1, 10)]
        );
    }

    #[test]
    fn new_events_are_applied_by_business_key_keeping_delivery_order_within_a_key() {
        let ids = [A, B, "0190a3d2-0000-7000-8000-000000000003"];
        let records: Vec<Delivery> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| record(i64::try_from(i).unwrap(), id, "{}"))
            .collect();
        let decoded: Vec<_> = records.iter().map(idem_core::wire::decode).collect();
        let b = Batch::new(&records, &decoded);
        let results = [Dedup::New, Dedup::New, Dedup::New];
        let key = |e: &InboundEvent| if e.offset == 1 { "a" } else { "z" }.to_owned();
        let offsets = |poison: &HashMap<EventId, String>| -> Vec<i64> {
            apply_order(&b.uniques, &results, poison, key)
                .iter()
                .map(|u| u.event.offset)
                .collect()
        };
        assert_eq!(offsets(&HashMap::new()), [1, 0, 2]);
        let poison = HashMap::from([(b.uniques[1].event.event_id, "no".to_owned())]);
        assert_eq!(offsets(&poison), [0, 2]);
    }

    #[test]
    fn a_batch_is_counted_once_per_label_group() {
        let mut records = vec![
            record(0, A, "{}"),
            record(1, A, "{}"),
            record(2, B, "{}"),
            record(3, "0190a3d2-0000-7000-8000-000000000003", "{}"),
            record(4, "nope", "{}"),
        ];
        records[3].headers[1].1 = "order.refunded".into();
        let published = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        for r in &mut records {
            r.timestamp = Some(published);
        }
        let decoded: Vec<_> = records.iter().map(idem_core::wire::decode).collect();
        let b = Batch::new(&records, &decoded);
        let results = [Dedup::New, Dedup::Duplicate, Dedup::New];
        let at = published + Duration::from_secs(2);
        let t = b.tally(&results, &HashMap::new(), at);
        let summary: Vec<(&str, u64, u64, usize)> = t
            .groups
            .iter()
            .map(|g| {
                let c = g.counts;
                (g.event_type, c.processed, c.duplicate_skips, g.waited.len())
            })
            .collect();
        assert_eq!(
            summary,
            [("order.paid", 1, 2, 1), ("order.refunded", 1, 0, 1)],
            "A new with a copy, B a duplicate, C another type"
        );
        assert_eq!(t.groups[0].waited, [Duration::from_secs(2)]);
        assert_eq!(
            (
                t.total.processed,
                t.total.dead_lettered,
                t.total.duplicate_deliveries
            ),
            (2, 1, 2)
        );
    }

    #[test]
    fn each_inbox_verdict_counts_its_copies() {
        let c = |copies, dedup, poisoned| {
            let c = Counts::of(copies, &dedup, poisoned);
            (
                c.processed,
                c.dead_lettered,
                c.conflicts,
                c.duplicate_deliveries,
                c.duplicate_skips,
            )
        };
        assert_eq!(c(3, Dedup::New, false), (1, 0, 0, 2, 2));
        assert_eq!(c(1, Dedup::New, true), (0, 1, 0, 0, 0));
        assert_eq!(c(2, Dedup::Duplicate, false), (0, 0, 0, 2, 2));
        assert_eq!(c(2, Dedup::Conflict, false), (0, 1, 2, 2, 0));
    }
}
