//! Core types of idem: the event envelope, the error type, validated table names, the
//! [`OutboxStore`] and [`Publisher`] traits that the database and Kafka crates implement, the
//! Kafka wire contract ([`wire`]), and the named crash points used by fault-injection tests.
//!
//! Most users depend on the `idem` facade crate instead of this one.

pub mod backoff;
pub mod crash;
pub mod envelope;
pub mod error;
pub mod event;
pub mod health;
pub mod idempotency;
pub mod inbox;
pub mod metrics;
pub mod ordering;
pub mod outbox;
pub mod publish;
pub mod retention;
pub mod tables;
pub mod trace;
pub mod wire;

pub use error::{BoxError, Error, ErrorKind, Result};
pub use event::{Event, EventBuilder, EventId};
pub use inbox::{
    DeadLetter, DeadLetterRow, Dedup, Delivery, InboundEvent, InboxEntry, InboxStore, LagProbe,
    OpenDeadLetter, ReplayOutcome, Source, StoredDeadLetter,
};
pub use outbox::{
    Backlog, Claim, ClaimOutcome, ClaimRequest, Completed, Disposition, Failure, OutboxRecord,
    OutboxStatus, OutboxStore, ParkedRow, PrunePolicy,
};
pub use publish::{FailureKind, Message, PublishError, Publisher};
pub use tables::TableNames;
