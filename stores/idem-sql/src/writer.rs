//! The write side of the outbox: events enqueued inside the caller's own transaction.

use std::sync::Arc;

use idem_core::{Error, Event, Result, TableNames};

use crate::Dialect;
use crate::dialect::is_unique_violation;
use crate::queries::{Queries, shared};

/// Enqueues events in the caller's transaction. Cheap to clone.
#[derive(Debug)]
pub struct Outbox<DB: Dialect> {
    pub(crate) tables: TableNames,
    pub(crate) queries: Arc<Queries>,
    dialect: std::marker::PhantomData<fn() -> DB>,
}

impl<DB: Dialect> Clone for Outbox<DB> {
    fn clone(&self) -> Self {
        Outbox {
            tables: self.tables.clone(),
            queries: Arc::clone(&self.queries),
            dialect: std::marker::PhantomData,
        }
    }
}

impl<DB: Dialect> Default for Outbox<DB> {
    fn default() -> Self {
        Outbox::new(TableNames::default())
    }
}

impl<DB: Dialect> Outbox<DB> {
    /// An outbox in the given (validated) tables. SQLite has no schemas: there a schema in
    /// `tables` names an attached database.
    pub fn new(tables: TableNames) -> Self {
        let queries = shared::<DB>(&tables);
        Outbox {
            tables,
            queries,
            dialect: std::marker::PhantomData,
        }
    }

    /// The table names in use.
    pub fn tables(&self) -> &TableNames {
        &self.tables
    }

    /// Inserts one event as part of the transaction `conn` belongs to.
    ///
    /// Nothing is visible to the relay until that transaction commits; a rollback removes it.
    pub async fn enqueue(&self, conn: &mut DB::Connection, event: &Event) -> Result<()> {
        self.enqueue_all(conn, std::slice::from_ref(event)).await
    }

    /// Inserts several events as part of the transaction `conn` belongs to. Events of one
    /// aggregate keep their slice order. PostgreSQL inserts them in one statement, grouped by
    /// aggregate so that the per-aggregate counter locks are always taken in the same order;
    /// SQLite inserts them one statement each, in slice order.
    pub async fn enqueue_all(&self, conn: &mut DB::Connection, events: &[Event]) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        DB::enqueue(conn, &self.queries.enqueue, events)
            .await
            .map_err(|e| enqueue_error::<DB>(e, &self.tables))
    }
}

/// The error of a failed enqueue: a duplicate event id is refused as such, a missing table
/// hints at `idem migrate`.
fn enqueue_error<DB: Dialect>(e: sqlx::Error, tables: &TableNames) -> Error {
    if let Some(db) = e.as_database_error() {
        let event_id_key = format!("{}_event_id_key", tables.bare("outbox"));
        // The outbox's only unique key a writer sets is event_id (SQLite names no constraint).
        if is_unique_violation(&e) && db.constraint().is_none_or(|c| c == event_id_key) {
            return Error::Conflict {
                what: "event_id",
                reason: format!("is already in the outbox ({})", db.message()),
            };
        }
    }
    if DB::is_undefined_table(&e) {
        return crate::dialect::db_error("enqueueing events (run `idem migrate` first?)", e);
    }
    crate::dialect::db_error("enqueueing events", e)
}
