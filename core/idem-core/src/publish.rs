//! The broker side of the relay: a [`Publisher`] sends a batch of messages and reports, for each
//! one, whether the broker acknowledged it.

use std::future::Future;

/// One message to publish: a Kafka record as the wire contract ([`crate::wire`]) lays it out.
pub type Message = crate::wire::WireRecord;

/// Whether retrying a failed publish can help.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The broker was unreachable, slow or busy: retry later, forever.
    Transient,
    /// The message itself is unpublishable (too large, an invalid record or topic name):
    /// retried a bounded number of times, then parked.
    Permanent,
    /// Never handed to the broker because an earlier message with the same topic and key
    /// failed in the same call (sending it would break per-key order). Not an attempt.
    NotSent,
    /// Its topic has failed every message for a grace period and the cluster then answered that
    /// the topic is missing or refuses this producer ([`TopicState::is_unwritable`]): nothing
    /// sent to it can succeed until an operator acts. Parked at once, with the reason.
    Unwritable,
}

impl FailureKind {
    /// Whether retrying the message where it is cannot help ([`Permanent`](Self::Permanent) or
    /// [`Unwritable`](Self::Unwritable)): it is parked, or dead-lettered, instead.
    pub fn is_permanent(self) -> bool {
        matches!(self, FailureKind::Permanent | FailureKind::Unwritable)
    }
}

/// Why one message was not acknowledged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishError {
    /// Retry class.
    pub kind: FailureKind,
    /// Person-readable reason.
    pub reason: String,
}

/// Whether a topic can take records, as the cluster answers a question about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TopicState {
    /// It exists and this producer may write it.
    Writable,
    /// The cluster answered that it does not exist (and did not create it).
    Missing,
    /// The cluster answered that this producer may not write it (an ACL).
    NotAuthorized,
    /// No answer (the cluster unreachable, a timeout) or one that says neither: nothing is
    /// known about the topic itself.
    Unknown,
}

impl TopicState {
    /// Whether the cluster answered that no record can go to the topic until an operator acts
    /// (creates it, grants a write).
    pub fn is_unwritable(self) -> bool {
        matches!(self, TopicState::Missing | TopicState::NotAuthorized)
    }
}

/// Sends messages and waits for their delivery reports.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `messages` and resolves once every message has a delivery report (success or
    /// failure). Messages with the same topic and key must reach the broker in slice order; once
    /// one of them fails before it is sent, the later ones are reported [`FailureKind::NotSent`].
    /// The result has one entry per message, in the same order.
    fn publish(
        &self,
        messages: &[Message],
    ) -> impl Future<Output = Vec<Result<(), PublishError>>> + Send;

    /// The longest one [`Publisher::publish`] call can take before every message has its
    /// report, or `None` when the publisher cannot bound it. The relay produces a claimed
    /// batch only while its lease outlasts this bound, so a live relay never publishes rows
    /// another relay may already have taken over (`idem_outbox_lease_lost_total`).
    fn longest_publish(&self) -> Option<std::time::Duration> {
        None
    }

    /// Asks the cluster whether `topic` can take records: what tells a topic that does not
    /// exist, or that this producer may not write, from a cluster that is down. The default
    /// knows nothing ([`TopicState::Unknown`]).
    fn topic_state(&self, topic: &str) -> impl Future<Output = TopicState> + Send {
        let _ = topic;
        std::future::ready(TopicState::Unknown)
    }
}

impl<T: Publisher> Publisher for std::sync::Arc<T> {
    fn publish(
        &self,
        messages: &[Message],
    ) -> impl Future<Output = Vec<Result<(), PublishError>>> + Send {
        (**self).publish(messages)
    }

    fn longest_publish(&self) -> Option<std::time::Duration> {
        (**self).longest_publish()
    }

    fn topic_state(&self, topic: &str) -> impl Future<Output = TopicState> + Send {
        (**self).topic_state(topic)
    }
}
