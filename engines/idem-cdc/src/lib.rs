//! idem's change-data-capture (CDC) relay for PostgreSQL: a pure core that takes every decision
//! about what the relay reads from a logical replication slot, with no I/O, and the I/O around
//! it (`session`, `slot`, `relay`).
//!
//! The relay reads the outbox from PostgreSQL's log instead of polling the table: transactions
//! arrive in commit order, so one aggregate's events are in commit order without a counter row.
//! The connection, the slot and the publishing loop decide with the pure modules:
//!
//! - [`pgoutput`]: a decoder for the pgoutput protocol (version 1, text format) messages that
//!   carry the outbox table's inserts, with a relation cache. Malformed input is an error,
//!   never a panic.
//! - [`record`]: an inserted outbox row to the [`idem_core::outbox::OutboxRecord`] the polling
//!   relay would have claimed for the same row, so both relays share one wire contract.
//! - [`idem_core::envelope`] (shared with the writer): the table-less outbox, events written with `pg_logical_emit_message`: the
//!   writer's content format and the relay's checks of it (any role allowed to call the
//!   function can write anything).
//! - [`ack`]: which log position the relay may confirm to the server, so that a restart never
//!   skips an event Kafka has not acknowledged.
//!
//! How the relay uses them, per replication event:
//!
//! ```text
//! Begin { final_lsn, .. }        → tracker.begin(); the commit's position for message mode
//! XLogData(bytes)                → decoder.decode(bytes)
//!   Insert { relation, values }  → if outbox.matches(&relation): record::decode_insert(..)
//!                                  (Err(Row(e)): e.action() says park by e.id, skip or stop)
//!   Ignored { .. }               → count it (someone altered the publication)
//! Message { transactional: true, lsn, prefix, content } with the relay's prefix
//!                                → held, then envelope::decode_committed(lsn, final_lsn, ..)
//! a batch of the open one held   → publish that part now (confirms nothing of it)
//! Commit { end_lsn, .. }         → publish the rest of it, tracker.commit(end_lsn, n)
//! delivery report                → tracker.delivered(txn); confirm tracker.confirmable()
//! keepalive { wal_end }          → tracker.keepalive(wal_end); confirm tracker.confirmable()
//! ```
//!
//! Delivery is at least once: a relay that stops after publishing and before confirming sends
//! those events again after its restart, and consumers absorb the copies by `ce_id` (the inbox).

pub mod ack;
pub mod batch;
pub mod changes;
pub mod drain;
pub mod error;
pub mod metrics;
pub mod pgoutput;
pub mod record;
pub mod relay;
pub mod replay;
pub mod session;
pub mod slot;

pub use error::CdcError;
pub use metrics::CdcMetrics;
pub use relay::{
    CdcConfig, CdcRelay, CdcRelayBuilder, DEFAULT_DEAD_LETTER_TOPIC, DEFAULT_MESSAGES_PUBLICATION,
    DEFAULT_SLOT, DEFAULT_TABLE_PUBLICATION, Mode,
};
pub use slot::{Name, SlotState, drop_slot, forget_slot, slot_state, slots_here};
