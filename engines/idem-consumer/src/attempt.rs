//! One attempt at a batch: a transaction that records the inbox rows, runs the handler for the
//! new events and writes the dead letters, then commits, or rolls back with an [`Attempt`]
//! failure saying what to do next ([`crate::retry`]).

use std::collections::HashMap;

use idem_core::crash::{self, CONSUMER_AFTER_DEDUP_BEFORE_HANDLER};
use idem_core::{Dedup, Error, EventId, InboxStore, Source};
use tracing::Instrument;

use crate::Consumer;
use crate::batch::{Batch, Unique, apply_order};
use crate::dead_letter::letters;
use crate::handler::{Handler, HandlerError, handle_span};

/// Why an attempt rolled back.
#[derive(Debug)]
pub(crate) enum Attempt {
    /// The handler refused this event permanently, outside isolation: dead-letter it and retry
    /// the batch with a savepoint per event.
    Poison(EventId, String),
    /// Might work later; charged to the event when one is named.
    Transient(Option<EventId>, Error),
    /// A crash point fired in error mode: the run ends.
    Fatal(Error),
    /// A handler reported success but left the transaction unable to commit
    /// ([`InboxStore::check_usable`]): retried at once with a savepoint per event, to find it.
    Unusable(Error),
}

/// What a committed attempt did.
#[derive(Debug)]
pub(crate) struct Attempted {
    /// The inbox's verdict on each distinct event of the batch.
    pub(crate) results: Vec<Dedup>,
    /// Events the handler refused permanently under isolation, with the reasons.
    pub(crate) refused: Vec<(EventId, String)>,
}

/// What one attempt works on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttemptCx<'c, 'a> {
    /// The batch.
    pub(crate) batch: &'c Batch<'a>,
    /// Events known to be refused: recorded dead-lettered, not handed to the handler.
    pub(crate) poison: &'c HashMap<EventId, String>,
    /// A savepoint around each handler call, so a failure is charged to its event.
    pub(crate) isolate: bool,
}

/// A database failure no event is charged with.
fn db(e: Error) -> Attempt {
    Attempt::Transient(None, e)
}

impl<I, H, S> Consumer<I, H, S>
where
    I: InboxStore,
    H: Handler<I::Conn>,
    S: Source,
{
    /// One transaction for the batch: committed when [`Consumer::attempt_in`] succeeds, rolled
    /// back otherwise.
    pub(crate) async fn attempt(&self, cx: AttemptCx<'_, '_>) -> Result<Attempted, Attempt> {
        let selected = if crash::broken(crash::BREAK_SELECT_THEN_INSERT) {
            // Negative control: "is it new?" asked in a transaction of its own, rolled back.
            let mut probe = self.inbox.begin().await.map_err(db)?;
            let entries = cx.batch.inbox_entries(cx.poison);
            let found = self
                .inbox
                .record(&mut probe, self.inbox_group(), &entries)
                .await
                .map_err(db)?;
            let _ = self.inbox.rollback(probe).await;
            Some(found)
        } else {
            None
        };
        let mut tx = self.inbox.begin().await.map_err(db)?;
        match self.attempt_in(&mut tx, cx, selected).await {
            Ok(done) => {
                self.inbox.commit(tx).await.map_err(db)?;
                Ok(done)
            }
            Err(e) => {
                if let Err(rb) = self.inbox.rollback(tx).await {
                    tracing::warn!(error = %rb, "rollback failed (the connection is discarded)");
                }
                Err(e)
            }
        }
    }

    /// In the attempt's transaction: the inbox rows (or the verdicts `selected` before it, under
    /// the `select-then-insert` control), the handler for each new event, the dead letters.
    async fn attempt_in(
        &self,
        tx: &mut I::Tx,
        cx: AttemptCx<'_, '_>,
        selected: Option<Vec<Dedup>>,
    ) -> Result<Attempted, Attempt> {
        let entries = cx.batch.inbox_entries(cx.poison);
        let results = match selected {
            Some(found) => found,
            None => self
                .inbox
                .record(&mut *tx, self.inbox_group(), &entries)
                .await
                .map_err(db)?,
        };
        crash::crash_point(CONSUMER_AFTER_DEDUP_BEFORE_HANDLER).map_err(Attempt::Fatal)?;

        let apply = apply_order(&cx.batch.uniques, &results, cx.poison, |e| {
            self.handler.business_key(e)
        });
        let mut refused: Vec<(EventId, String)> = vec![];
        for u in apply {
            if let Some(reason) = self.handle_one(tx, u, cx.isolate).await? {
                refused.push((u.event.event_id, reason));
            }
        }
        if !cx.isolate
            && let Err(e) = self.inbox.check_usable(&mut *tx).await
        {
            // A handler swallowed a database error; which one, isolating each tells.
            return Err(Attempt::Unusable(e));
        }
        if !refused.is_empty() {
            let ids: Vec<EventId> = refused.iter().map(|(id, _)| *id).collect();
            self.inbox
                .mark_dead_lettered(&mut *tx, self.inbox_group(), &ids)
                .await
                .map_err(db)?;
        }
        let letters = letters(cx.batch, &results, cx.poison, &refused);
        self.inbox
            .dead_letter(&mut *tx, &self.config.group, &letters)
            .await
            .map_err(db)?;
        Ok(Attempted { results, refused })
    }

    /// Runs the handler for one new event. `Ok(Some(reason))`: refused permanently under
    /// isolation (its savepoint rolled back); the caller dead-letters it.
    async fn handle_one(
        &self,
        tx: &mut I::Tx,
        u: &Unique<'_>,
        isolate: bool,
    ) -> Result<Option<String>, Attempt> {
        let span = handle_span(u.event);
        if isolate {
            self.inbox.savepoint(&mut *tx).await.map_err(db)?;
        }
        match self
            .handler
            .handle(&mut *tx, u.event)
            .instrument(span)
            .await
        {
            Ok(()) if isolate => {
                // Reported success, but did it leave the transaction usable?
                if let Err(e) = self.inbox.check_usable(&mut *tx).await {
                    self.inbox
                        .rollback_to_savepoint(&mut *tx)
                        .await
                        .map_err(db)?;
                    return Err(Attempt::Transient(Some(u.event.event_id), e));
                }
                self.inbox.release_savepoint(&mut *tx).await.map_err(db)?;
                Ok(None)
            }
            Ok(()) => Ok(None),
            Err(HandlerError::Permanent(reason)) if isolate => {
                self.inbox
                    .rollback_to_savepoint(&mut *tx)
                    .await
                    .map_err(db)?;
                Ok(Some(reason))
            }
            Err(HandlerError::Permanent(reason)) => Err(Attempt::Poison(u.event.event_id, reason)),
            // Without savepoints the failure may be an earlier handler's doing (one that
            // swallowed an error and left the transaction aborted): it is charged to the
            // event only when the events are isolated.
            Err(HandlerError::Transient(e)) => Err(Attempt::Transient(
                isolate.then_some(u.event.event_id),
                Error::database("running the handler", e),
            )),
        }
    }
}
