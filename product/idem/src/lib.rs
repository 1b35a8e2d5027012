#![doc = include_str!("../../../README.md")]

pub use idem_core::{
    BoxError, Claim, ClaimRequest, Completed, Error, Event, EventBuilder, EventId, Failure,
    FailureKind, Message, OutboxRecord, OutboxStatus, OutboxStore, Outcome, ParkedRow, PrunePolicy,
    PublishError, Publisher, Result, TableNames, crash, event, trace,
};

/// The PostgreSQL outbox (production).
#[cfg(feature = "postgres")]
pub use idem_postgres as postgres;

/// The SQLite outbox (embedded default).
#[cfg(feature = "sqlite")]
pub use idem_sqlite as sqlite;
