//! One attempt at a batch: a transaction that records the inbox rows, runs the handler for the
//! new events and writes the dead letters, then commits, or rolls back with an [`Attempt`]
//! failure saying what to do next ([`crate::retry`]).

use std::collections::HashMap;

use idem_core::crash::{self, CrashPoint};
use idem_core::store::{Dedup, InboxStore, Source};
use idem_core::{Error, ErrorKind, EventId, InboundEvent};

use crate::Consumer;
use crate::batch::{Batch, Unique, apply_order};
use crate::context::{BatchContext, Posted, kept};
use crate::dead_letter::letters;
use crate::handler::{BatchError, Handler, HandlerError, Outcome, code_of};

/// Why an attempt rolled back.
#[derive(Debug)]
pub(crate) enum Attempt {
    /// The handler refused this event permanently, outside isolation: dead-letter it and retry
    /// the batch with a savepoint per event.
    Poison(EventId, String),
    /// The database refused the handler's set-based statements for the batch (permanently, and
    /// without naming an event), or the handler broke its contract: retry the batch at once with
    /// a savepoint per event, which dead-letters exactly the events refused one by one.
    Refused(String),
    /// Might work later; charged to the event when one is named.
    Transient(Option<EventId>, Error),
    /// The event's handler failed with a database error the rule does not classify (what it
    /// is, as `SQLSTATE XY123`, and the error): retried as transient a bounded number of times
    /// ([`crate::ConsumerConfig::max_unclassified_failures`]), then dead-lettered.
    Unclassified(EventId, String, Error),
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
        let selected = if crash::broken(crash::Mechanism::SelectThenInsert) {
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
        crash::crash_point(CrashPoint::ConsumerAfterDedupBeforeHandler).map_err(Attempt::Fatal)?;

        let apply = apply_order(&cx.batch.uniques, &results, cx.poison, |e| {
            self.handler.business_key(e)
        });
        let (apply, mut refused) = validated(&self.handler, apply);
        let mut posted = vec![];
        if cx.isolate {
            for u in apply {
                if let Some(reason) = self.handle_one(tx, u).await? {
                    refused.push((u.event.event_id, reason));
                }
            }
        } else {
            let (refusals, effects) = self.handle_all(tx, &apply).await?;
            refused.extend(refusals);
            posted = effects;
        }
        if !cx.isolate
            && let Err(e) = self.inbox.check_usable(&mut *tx).await
        {
            // A handler swallowed a database error; which one, isolating each tells.
            return Err(Attempt::Unusable(e));
        }
        self.inbox
            .record_effects(&mut *tx, &posted)
            .await
            .map_err(effects_failure)?;
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

    /// Runs the handler once for the whole batch (`apply`: new, valid, in apply order): the
    /// events it refused and the effects of the others, or why the attempt rolls back.
    async fn handle_all(
        &self,
        tx: &mut I::Tx,
        apply: &[&Unique<'_>],
    ) -> Result<(Vec<(EventId, String)>, Posted), Attempt> {
        if apply.is_empty() {
            return Ok((vec![], vec![]));
        }
        let events: Vec<&InboundEvent> = apply.iter().map(|u| u.event).collect();
        let mut posted = vec![];
        let outcomes = self
            .handler
            .handle_batch(&mut BatchContext::new(&mut **tx, &mut posted), &events)
            .await
            .map_err(batch_failure)?;
        let refused = refusals(&events, outcomes)?;
        let applied = |id: &EventId| {
            events.iter().any(|e| e.event_id == *id) && !refused.iter().any(|(r, _)| r == id)
        };
        let posted = kept(posted, applied);
        Ok((refused, posted))
    }

    /// Runs the handler for one new event in a savepoint of its own, and records its effects
    /// there. `Ok(Some(reason))`: refused permanently (its savepoint rolled back); the caller
    /// dead-letters it.
    async fn handle_one(&self, tx: &mut I::Tx, u: &Unique<'_>) -> Result<Option<String>, Attempt> {
        let id = u.event.event_id;
        self.inbox.savepoint(&mut *tx).await.map_err(db)?;
        let mut posted = vec![];
        let outcome = self
            .handler
            .handle_batch(&mut BatchContext::new(&mut **tx, &mut posted), &[u.event])
            .await
            .map_err(|e| match e {
                BatchError::Event { error, .. } | BatchError::Batch(error) => error,
            })
            .and_then(|outcomes| single(id, outcomes));
        match outcome {
            Ok(Outcome::Applied) => {
                // Reported success, but did it leave the transaction usable?
                if let Err(e) = self.inbox.check_usable(&mut *tx).await {
                    self.inbox
                        .rollback_to_savepoint(&mut *tx)
                        .await
                        .map_err(db)?;
                    return Err(Attempt::Transient(Some(id), e));
                }
                let posted = kept(posted, |e| *e == id);
                if let Err(e) = self.inbox.record_effects(&mut *tx, &posted).await {
                    self.inbox
                        .rollback_to_savepoint(&mut *tx)
                        .await
                        .map_err(db)?;
                    return match effects_failure(e) {
                        Attempt::Refused(reason) => Ok(Some(reason)),
                        other => Err(other.charged_to(id)),
                    };
                }
                self.inbox.release_savepoint(&mut *tx).await.map_err(db)?;
                Ok(None)
            }
            Ok(Outcome::Refused(reason)) | Err(HandlerError::Permanent(reason)) => {
                self.inbox
                    .rollback_to_savepoint(&mut *tx)
                    .await
                    .map_err(db)?;
                Ok(Some(reason))
            }
            Err(HandlerError::Transient(e)) => Err(Attempt::Transient(
                Some(id),
                Error::database("running the handler", e),
            )),
            Err(HandlerError::Unclassified(e)) => Err(Attempt::Unclassified(
                id,
                code_of(&e),
                Error::database("running the handler", e),
            )),
        }
    }
}

/// Splits `apply` into the events [`Handler::validate`] accepts (in order) and those it
/// refuses, with the reasons.
fn validated<'b, 'a, C, H: Handler<C>>(
    handler: &H,
    apply: Vec<&'b Unique<'a>>,
) -> (Vec<&'b Unique<'a>>, Vec<(EventId, String)>) {
    let mut refused = vec![];
    let valid = apply
        .into_iter()
        .filter(|u| match handler.validate(u.event) {
            Ok(()) => true,
            Err(reason) => {
                refused.push((u.event.event_id, reason));
                false
            }
        })
        .collect();
    (valid, refused)
}

/// What a failure to record the posted effects means: the database refusing an intent for
/// its data (a NUL byte in a URL, a body it cannot store) refuses the event that posted it, as
/// any permanent failure of its handler would; anything else is transient.
fn effects_failure(e: Error) -> Attempt {
    match e.kind() {
        ErrorKind::Invalid | ErrorKind::Conflict => {
            Attempt::Refused(format!("its effects cannot be recorded: {e}"))
        }
        _ => Attempt::Transient(None, e),
    }
}

impl Attempt {
    /// A transient failure no event was charged with, charged to `id`.
    fn charged_to(self, id: EventId) -> Attempt {
        match self {
            Attempt::Transient(None, e) => Attempt::Transient(Some(id), e),
            other => other,
        }
    }
}

/// What a failed [`Handler::handle_batch`] of a whole batch means for the attempt.
fn batch_failure(e: BatchError) -> Attempt {
    match e {
        BatchError::Event {
            event,
            error: HandlerError::Permanent(reason),
        } => Attempt::Poison(event, reason),
        // Without savepoints the failure may be an earlier event's doing (a handler that
        // swallowed an error and left the transaction aborted): it is charged to an event
        // only when the events are isolated.
        BatchError::Event {
            error: HandlerError::Transient(e),
            ..
        }
        | BatchError::Batch(HandlerError::Transient(e)) => {
            Attempt::Transient(None, Error::database("running the handler", e))
        }
        BatchError::Event {
            error: HandlerError::Unclassified(e),
            ..
        }
        | BatchError::Batch(HandlerError::Unclassified(e)) => {
            Attempt::Transient(None, Error::database("running the handler", e))
        }
        BatchError::Batch(HandlerError::Permanent(reason)) => Attempt::Refused(reason),
    }
}

/// The events of a batch the handler refused, from its outcomes (one per event, in order).
/// Any other number of outcomes breaks the handler's contract: the batch is retried one event
/// at a time.
fn refusals(
    events: &[&InboundEvent],
    outcomes: Vec<Outcome>,
) -> Result<Vec<(EventId, String)>, Attempt> {
    if outcomes.len() != events.len() {
        return Err(Attempt::Refused(outcome_count(
            events.len(),
            outcomes.len(),
        )));
    }
    Ok(events
        .iter()
        .zip(outcomes)
        .filter_map(|(e, o)| match o {
            Outcome::Applied => None,
            Outcome::Refused(reason) => Some((e.event_id, reason)),
        })
        .collect())
}

/// The one outcome of a batch of one event; any other number is a transient failure charged
/// to it (the handler breaks its contract: nothing is dead-lettered on its word).
fn single(id: EventId, outcomes: Vec<Outcome>) -> Result<Outcome, HandlerError> {
    let n = outcomes.len();
    match <[Outcome; 1]>::try_from(outcomes) {
        Ok([outcome]) => Ok(outcome),
        Err(_) => Err(HandlerError::transient(format!(
            "event {id}: {}",
            outcome_count(1, n)
        ))),
    }
}

fn outcome_count(events: usize, outcomes: usize) -> String {
    format!(
        "the handler returned {outcomes} outcomes for a batch of {events} events (handle_batch must return one per event)"
    )
}
