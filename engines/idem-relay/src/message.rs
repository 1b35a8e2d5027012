//! From claimed rows to the messages handed to the publisher, and back from the publisher's
//! delivery reports to one result per row. Pure: the record layout itself is the wire contract
//! ([`idem_core::wire::encode`]).

use idem_core::event::validate_topic;
use idem_core::outbox::OutboxRecord;
use idem_core::publish::{FailureKind, Message, PublishError};
use idem_core::wire::{self, TopicNaming};

/// Why a row the publisher was given has no delivery report.
pub(crate) const NO_REPORT: &str = "the publisher returned no delivery report";

/// What the relay does with one claimed row before publishing.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Planned {
    /// Handed to the publisher as the message at this index.
    Send(usize),
    /// Never handed to the broker: its topic is unusable.
    Refused(PublishError),
}

/// The messages of one claim and, per claimed row, what became of it.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    /// The topic of each row, in claim order.
    pub(crate) topics: Vec<String>,
    /// The messages to publish (rows with a valid topic), in claim order.
    pub(crate) messages: Vec<Message>,
    /// Per claimed row, in claim order.
    pub(crate) rows: Vec<Planned>,
}

/// Names each row's topic and encodes the rows whose topic Kafka accepts; rows with an unusable
/// topic are never handed to the broker and fail permanently.
pub(crate) fn plan(records: &[OutboxRecord], naming: &TopicNaming, source: Option<&str>) -> Plan {
    let topics: Vec<String> = records.iter().map(|r| naming.topic_for(r)).collect();
    let mut messages = Vec::with_capacity(records.len());
    let rows = records
        .iter()
        .zip(&topics)
        .map(|(r, topic)| match validate_topic(topic) {
            Ok(()) => {
                messages.push(wire::encode(r, topic, source));
                Planned::Send(messages.len() - 1)
            }
            Err(reason) => Planned::Refused(PublishError {
                kind: FailureKind::Permanent,
                reason,
            }),
        })
        .collect();
    Plan {
        topics,
        messages,
        rows,
    }
}

impl Plan {
    /// One result per claimed row, from the publisher's reports (one per message, in order). A
    /// message the publisher did not report on failed transiently.
    pub(crate) fn results(
        &self,
        delivered: Vec<Result<(), PublishError>>,
    ) -> Vec<Result<(), PublishError>> {
        let mut reports: Vec<Option<Result<(), PublishError>>> =
            delivered.into_iter().map(Some).collect();
        self.rows
            .iter()
            .map(|row| match row {
                Planned::Refused(e) => Err(e.clone()),
                Planned::Send(i) => {
                    reports
                        .get_mut(*i)
                        .and_then(Option::take)
                        .unwrap_or_else(|| {
                            Err(PublishError {
                                kind: FailureKind::Transient,
                                reason: NO_REPORT.to_owned(),
                            })
                        })
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, aggregate_type: &str) -> OutboxRecord {
        crate::test_row(id, aggregate_type, "a")
    }

    #[test]
    fn a_row_with_an_unusable_topic_is_refused_and_the_others_are_encoded_in_order() {
        let rows = [row(1, "order"), row(2, "no spaces"), row(3, "order")];
        let p = plan(&rows, &TopicNaming::default(), Some("/s"));
        assert_eq!(p.topics[1], "outbox.event.no spaces");
        assert_eq!(p.messages.len(), 2);
        assert_eq!(
            p.messages[1].header(wire::CE_ID),
            Some(rows[2].event_id.to_string().as_str())
        );
        assert_eq!(p.rows[0], Planned::Send(0));
        assert_eq!(p.rows[2], Planned::Send(1));
        let Planned::Refused(e) = &p.rows[1] else {
            panic!("{:?}", p.rows[1])
        };
        assert_eq!(e.kind, FailureKind::Permanent);
        assert!(e.reason.contains("no spaces"), "{}", e.reason);
    }

    #[test]
    fn a_message_without_a_report_failed_transiently() {
        let rows = [row(1, "order"), row(2, "no spaces"), row(3, "order")];
        let p = plan(&rows, &TopicNaming::default(), None);
        let results = p.results(vec![Ok(())]);
        assert_eq!(results[0], Ok(()));
        assert_eq!(
            results[1].as_ref().map_err(|e| e.kind),
            Err(FailureKind::Permanent)
        );
        assert_eq!(
            results[2],
            Err(PublishError {
                kind: FailureKind::Transient,
                reason: NO_REPORT.into()
            })
        );
    }
}
