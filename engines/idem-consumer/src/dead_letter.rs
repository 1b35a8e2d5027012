//! The dead letters of a batch: records kept as they arrived, with the reason. Pure.

use std::collections::{HashMap, HashSet};

use idem_core::store::{DeadLetter, Dedup, Delivery};
use idem_core::wire::{self, storable};
use idem_core::{EventId, InboundEvent};

use crate::batch::Batch;

/// The reason of a dead letter for a known event id received with another payload.
pub(crate) fn conflict_reason(id: EventId) -> String {
    format!(
        "idempotency conflict: event {id} was received before with a different payload; not applied"
    )
}

/// The reason of a dead letter for an event id appearing twice in one batch with different
/// payloads.
pub(crate) fn in_batch_conflict_reason(id: EventId) -> String {
    format!(
        "idempotency conflict: event {id} appears twice in one batch with different payloads; not applied"
    )
}

/// The dead letter of record `d` (decoded as `event`, when it decodes). Text is made storable
/// ([`storable`]); dead letters keep everything else.
pub(crate) fn dead_letter_of(
    d: &Delivery,
    event: Option<&InboundEvent>,
    reason: String,
) -> DeadLetter {
    DeadLetter {
        topic: d.topic.clone(),
        partition: d.partition,
        offset: d.offset,
        event_id: event
            .map(|e| e.event_id)
            .or_else(|| d.header(wire::CE_ID).and_then(|s| s.parse().ok())),
        event_type: event
            .map(|e| e.event_type.clone())
            .or_else(|| d.header(wire::CE_TYPE).map(storable)),
        reason: storable(&reason),
        key: d.key.as_deref().map(storable),
        payload: d
            .payload
            .as_deref()
            .map(|p| storable(&String::from_utf8_lossy(p))),
        headers: serde_json::Value::Object(
            d.headers
                .iter()
                .map(|(k, v)| (storable(k), serde_json::Value::String(storable(v))))
                .collect(),
        ),
    }
}

/// Every dead letter of an attempt, one per record position: the undecodable records, the new
/// events refused (known `poison`, or `refused` by the handler in this attempt), the conflicts
/// the inbox found (`results`, one per distinct event) and those inside the batch.
pub(crate) fn letters(
    batch: &Batch<'_>,
    results: &[Dedup],
    poison: &HashMap<EventId, String>,
    refused: &[(EventId, String)],
) -> Vec<DeadLetter> {
    let refused: HashMap<EventId, &String> = refused.iter().map(|(id, r)| (*id, r)).collect();
    let mut letters: Vec<DeadLetter> = batch.undecodable.clone();
    for (u, r) in batch.uniques.iter().zip(results) {
        let id = u.event.event_id;
        if let Some(reason) = poison.get(&id).or(refused.get(&id).copied())
            && *r == Dedup::New
        {
            letters.push(dead_letter_of(u.delivery, Some(u.event), reason.clone()));
        }
        if *r == Dedup::Conflict {
            letters.push(dead_letter_of(
                u.delivery,
                Some(u.event),
                conflict_reason(id),
            ));
        }
    }
    for (ev, d) in &batch.in_batch_conflicts {
        let reason = in_batch_conflict_reason(ev.event_id);
        letters.push(dead_letter_of(d, Some(ev), reason));
    }
    let mut seen: HashSet<(String, i32, i64)> = HashSet::new();
    letters.retain(|l| seen.insert((l.topic.clone(), l.partition, l.offset)));
    letters
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(offset: i64, id: &str, payload: &str) -> Delivery {
        let mut d = crate::batch::test_delivery(offset, id, payload);
        d.key = Some("k\0ey".into());
        d.headers[1].1 = "order\0paid".into();
        d
    }

    const A: &str = "0190a3d2-0000-7000-8000-000000000001";
    const B: &str = "0190a3d2-0000-7000-8000-000000000002";
    const C: &str = "0190a3d2-0000-7000-8000-000000000003";

    #[test]
    fn refused_conflicting_and_undecodable_records_each_get_one_letter_with_its_reason() {
        let records = [
            record(0, A, "{}"),
            record(1, B, "{}"),
            record(2, C, "{}"),
            record(3, C, r#"{"x":1}"#),
            record(4, A, "{oops"),
        ];
        let decoded: Vec<_> = records.iter().map(idem_core::wire::decode).collect();
        let batch = Batch::new(&records, &decoded);
        let a: EventId = A.parse().unwrap();
        let results = [Dedup::New, Dedup::Conflict, Dedup::Duplicate];
        let poison = HashMap::from([(a, "known poison".to_owned())]);
        let got: Vec<(i64, String)> = letters(&batch, &results, &poison, &[])
            .into_iter()
            .map(|l| (l.offset, l.reason))
            .collect();
        let b: EventId = B.parse().unwrap();
        let c: EventId = C.parse().unwrap();
        assert_eq!(
            got,
            [
                (
                    4,
                    "the record value is not valid JSON: key must be a string at line 1 column 2"
                        .to_owned()
                ),
                (0, "known poison".to_owned()),
                (1, conflict_reason(b)),
                (3, in_batch_conflict_reason(c)),
            ]
        );
    }

    #[test]
    fn an_undecodable_letter_keeps_what_it_can_read_made_storable() {
        let mut d = record(0, A, "{}");
        d.headers[0].1 = "nope".into();
        let l = dead_letter_of(&d, None, "bad\0reason".into());
        assert_eq!(l.event_id, None);
        assert_eq!(l.event_type.as_deref(), Some("order\u{FFFD}paid"));
        assert_eq!(l.reason, "bad\u{FFFD}reason");
        assert_eq!(l.key.as_deref(), Some("k\u{FFFD}ey"));
        assert_eq!(l.headers["ce_id"], "nope");
    }
}
