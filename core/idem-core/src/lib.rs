//! Core types of idem: the event envelope, the error type, validated table names, the
//! [`store`] traits the database crates implement and the [`publish`] traits the Kafka crate
//! implements, the Kafka wire contract ([`wire`]), and the named crash points used by
//! fault-injection tests.
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
pub mod store;
pub mod tables;
pub mod trace;
pub mod wire;

pub use error::{BoxError, Error, ErrorKind, Result};
pub use event::{Event, EventBuilder, EventId};
pub use inbox::InboundEvent;
pub use tables::TableNames;
