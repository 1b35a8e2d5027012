//! Publishing whole-record dead letters again once their topics take records.
//!
//! Message mode has no table to park in: a record the cluster refuses for its topic (missing,
//! or not writable by the relay: [`idem_relay::unwritable`]) is dead-lettered whole, with the
//! topic it was meant for ([`crate::changes::DEAD_LETTER_TOPIC`]), and the slot's confirmation
//! moves on. Once the topic exists or the write is granted, [`replay`] publishes those
//! records to their topics as they were. At least once: a letter replayed twice reaches its
//! topic twice, and the consumers' inboxes, keyed by the event id, apply it once. A replayed
//! event reaches its topic after later events of its aggregate, as a retried parked row does.

use idem_core::publish::{Message, Publisher};
use serde::Serialize;

use crate::changes::replayable;

/// What [`replay`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Replayed {
    /// Records published to their topics.
    pub published: usize,
    /// Records not published, with their topic and why (their letters stay: run it again).
    pub failed: Vec<(String, String)>,
    /// Letters that are excerpts (a record refused for itself: too large, undecodable):
    /// nothing to publish again.
    pub excerpts: usize,
    /// Whole-record letters for topics other than the ones asked for.
    pub other_topics: usize,
}

/// Publishes the whole-record letters among `letters` whose topic is in `topics` (every topic
/// when empty) through `publisher`.
pub async fn replay<P: Publisher>(
    publisher: &P,
    letters: &[Message],
    topics: &[String],
) -> Replayed {
    let mut out = Replayed::default();
    let mut records = vec![];
    for letter in letters {
        match replayable(letter) {
            None => out.excerpts += 1,
            Some(r) if topics.is_empty() || topics.contains(&r.topic) => records.push(r),
            Some(_) => out.other_topics += 1,
        }
    }
    if records.is_empty() {
        return out;
    }
    let results = publisher.publish(&records).await;
    for (r, result) in records.iter().zip(results) {
        match result {
            Ok(()) => out.published += 1,
            Err(e) => out.failed.push((r.topic.clone(), e.reason)),
        }
    }
    out
}
