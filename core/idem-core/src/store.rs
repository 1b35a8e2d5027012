//! What a store or a broker client implements, and what the engines exchange with it: the
//! relay's view of the outbox ([`OutboxStore`] and its claim, outcome and status types), the
//! consumer's view of the inbox ([`InboxStore`], its dead letters and replay) and the source it
//! reads ([`Source`]). A user of idem's own stores calls their methods through these traits
//! (`store.status()`); only an author of another store or source implements them.
//!
//! The publisher a relay writes with is in [`publish`](crate::publish).

pub use crate::inbox::{
    DeadLetter, DeadLetterRow, Dedup, Delivery, InboxEntry, InboxStore, LagProbe, OpenDeadLetter,
    ReplayOutcome, RequestedReplay, Source, StoredDeadLetter,
};
pub use crate::outbox::{
    Backlog, Claim, ClaimOutcome, ClaimRequest, Completed, Disposition, Failure, OutboxRecord,
    OutboxStatus, OutboxStore, ParkedRow, PrunePolicy,
};
