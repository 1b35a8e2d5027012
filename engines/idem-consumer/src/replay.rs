//! Replaying dead letters through the handler. An operator requests a replay (`idem
//! dead-letters replay --confirm`, the console, or [`InboxStore::request_replays`]) and the
//! group's running [`Consumer`](crate::Consumer) serves it through its own handler
//! ([`serve_requested`]); an embedder may also call [`replay`] with a handler directly.
//! [`preview`] is the dry run: it decodes each letter as the consumer would, and needs no handler.
//!
//! A dead letter keeps the record as it arrived: key, value and headers. [`replay`] decodes it
//! again with the consumer's own decoder and, **in one transaction**, makes the event's inbox row
//! `processed` ([`InboxStore::claim_replay`]), runs the handler, and marks the letter replayed
//! (who, when, `applied`). The inbox row is the fence: a second replay, or a redelivery of the
//! record racing the replay, waits for that transaction and then finds the row `processed`, so
//! the event is applied once. A replay whose handler fails is rolled back entirely; the letter
//! stays open with the new reason. A letter that does not decode (no event id, a value that is
//! not JSON) is reported and left alone.

use idem_core::store::{DeadLetter, Delivery, InboxStore, OpenDeadLetter, ReplayOutcome};
use idem_core::{EventId, InboundEvent, Result};

use tracing::Instrument;

use crate::context::{HandlerContext, kept};
use crate::{Handler, HandlerError, decode, event_span};
use idem_core::wire::storable;

/// Which dead letters to replay, and how.
#[derive(Clone, Debug)]
pub struct ReplayRequest {
    /// Consumer group whose dead letters (and inbox) these are.
    pub group: String,
    /// Only this dead letter (its id in `idem dead-letters`); `None`: every open one.
    pub only: Option<i64>,
    /// List what would be replayed, change nothing.
    pub dry_run: bool,
    /// Who replays (recorded on each letter replayed).
    pub by: String,
}

/// What happened to one dead letter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayResult {
    /// Dry run: it decodes and would be handed to the handler.
    WouldReplay,
    /// Applied by the handler; the letter is closed.
    Applied,
    /// The inbox already said `processed` (replayed before, or applied from a redelivery), or
    /// holds the event id under another payload (an idempotency conflict, which must never be
    /// applied): not applied; the letter is closed.
    AlreadyApplied,
    /// The handler failed again (nothing of it committed); the letter stays open with this
    /// reason.
    Failed(String),
    /// The record cannot be decoded (no event id, a value that is not JSON, …): not replayed,
    /// left as it is.
    Undecodable(String),
}

impl ReplayResult {
    /// `would_replay`, `applied`, `already_applied`, `failed` or `undecodable`: the outcome
    /// label of `idem_consumer_replays_total` and of `idem dead-letters replay --json`.
    pub fn label(&self) -> &'static str {
        match self {
            ReplayResult::WouldReplay => "would_replay",
            ReplayResult::Applied => "applied",
            ReplayResult::AlreadyApplied => "already_applied",
            ReplayResult::Failed(_) => "failed",
            ReplayResult::Undecodable(_) => "undecodable",
        }
    }
}

/// One dead letter and what its replay did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replayed {
    /// The letter's id.
    pub id: i64,
    /// Where the record was.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// The event id, when the record has one.
    pub event_id: Option<EventId>,
    /// The outcome.
    pub result: ReplayResult,
}

/// Letters read per round trip.
const PAGE: u32 = 100;

/// Replays the open dead letters of `request.group` (never replayed, or whose last replay
/// failed) through `handler`, oldest first, and says what happened to each. Errors of the
/// database end the run; letters replayed before it stay replayed.
pub async fn replay<I, H>(inbox: &I, handler: &H, request: &ReplayRequest) -> Result<Vec<Replayed>>
where
    I: InboxStore,
    H: Handler<I::Conn>,
{
    let mut out = vec![];
    let mut after = 0;
    loop {
        let page = inbox
            .open_dead_letters(&request.group, after, request.only, PAGE)
            .await?;
        let Some(last) = page.last() else {
            return Ok(out);
        };
        after = last.id;
        for letter in &page {
            let result = replay_one(inbox, handler, request, letter).await?;
            out.push(replayed(letter, result));
        }
    }
}

/// The dry run of a replay of `group`'s open dead letters (only `only`, when given): each one
/// decodes ([`ReplayResult::WouldReplay`]) or not ([`ReplayResult::Undecodable`]), as the
/// consumer's decoder sees it. Changes nothing, and needs no handler.
pub async fn preview<I: InboxStore>(
    inbox: &I,
    group: &str,
    only: Option<i64>,
) -> Result<Vec<Replayed>> {
    let mut out = vec![];
    let mut after = 0;
    loop {
        let page = inbox.open_dead_letters(group, after, only, PAGE).await?;
        let Some(last) = page.last() else {
            return Ok(out);
        };
        after = last.id;
        out.extend(page.iter().map(|open| replayed(open, decoded(open))));
    }
}

/// What a dry run says of one letter.
fn decoded(open: &OpenDeadLetter) -> ReplayResult {
    match decode(&delivery_of(&open.letter)) {
        Ok(_) => ReplayResult::WouldReplay,
        Err(reason) => ReplayResult::Undecodable(reason.to_string()),
    }
}

/// Serves the requested replays of `group` ([`InboxStore::requested_replays`]) through
/// `handler`, oldest first, each as [`replay`] does it and on behalf of whoever requested it.
/// Every request ends served: a letter that does not decode is recorded as a failed replay with
/// the decoder's reason (it stays open), so it is not served again until someone asks again.
/// Errors of the database end the round; the requests not served yet stay for the next one.
pub async fn serve_requested<I, H>(inbox: &I, handler: &H, group: &str) -> Result<Vec<Replayed>>
where
    I: InboxStore,
    H: Handler<I::Conn>,
{
    let mut out = vec![];
    let mut after = 0;
    loop {
        let page = inbox.requested_replays(group, after, PAGE).await?;
        let Some(last) = page.last() else {
            return Ok(out);
        };
        after = last.open.id;
        for requested in &page {
            let request = ReplayRequest {
                group: group.to_owned(),
                only: Some(requested.open.id),
                dry_run: false,
                by: requested.by.clone(),
            };
            let result = match replay_one(inbox, handler, &request, &requested.open).await? {
                ReplayResult::Undecodable(reason) => {
                    let reason = format!("replay failed: the record does not decode: {reason}");
                    record_failure(inbox, &request, requested.open.id, reason.clone()).await?;
                    ReplayResult::Undecodable(reason)
                }
                result => result,
            };
            out.push(replayed(&requested.open, result));
        }
    }
}

fn replayed(open: &OpenDeadLetter, result: ReplayResult) -> Replayed {
    Replayed {
        id: open.id,
        topic: open.letter.topic.clone(),
        partition: open.letter.partition,
        offset: open.letter.offset,
        event_id: open.letter.event_id,
        result,
    }
}

/// The record a dead letter keeps, as the broker delivered it (headers in name order).
pub fn delivery_of(letter: &DeadLetter) -> Delivery {
    let headers = letter
        .headers
        .as_object()
        .map(|h| {
            h.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned())))
                .collect()
        })
        .unwrap_or_default();
    Delivery {
        topic: letter.topic.clone(),
        partition: letter.partition,
        offset: letter.offset,
        key: letter.key.clone(),
        payload: letter.payload.as_ref().map(|p| p.as_bytes().to_vec()),
        headers,
        timestamp: None,
    }
}

async fn replay_one<I, H>(
    inbox: &I,
    handler: &H,
    request: &ReplayRequest,
    open: &OpenDeadLetter,
) -> Result<ReplayResult>
where
    I: InboxStore,
    H: Handler<I::Conn>,
{
    if request.dry_run {
        return Ok(decoded(open));
    }
    let event = match decode(&delivery_of(&open.letter)) {
        Ok(event) => event,
        Err(reason) => return Ok(ReplayResult::Undecodable(reason.to_string())),
    };
    let mut tx = inbox.begin().await?;
    let applied = match apply(inbox, handler, &request.group, &mut tx, &event).await {
        Ok(applied) => applied,
        Err(reason) => {
            if let Err(e) = inbox.rollback(tx).await {
                tracing::warn!(error = %e, "rollback failed (the connection is discarded)");
            }
            return record_failure(inbox, request, open.id, reason).await;
        }
    };
    let outcome = if applied {
        ReplayOutcome::Applied
    } else {
        ReplayOutcome::AlreadyApplied
    };
    inbox
        .finish_replay(&mut tx, open.id, &request.by, outcome, None)
        .await?;
    inbox.commit(tx).await?;
    Ok(if applied {
        ReplayResult::Applied
    } else {
        ReplayResult::AlreadyApplied
    })
}

/// In the replay's transaction: claims the inbox row and runs the handler. `Ok(false)`: the
/// inbox says the event was applied; `Err(reason)`: the handler or the database failed, and the
/// transaction must be rolled back.
async fn apply<I, H>(
    inbox: &I,
    handler: &H,
    group: &str,
    tx: &mut I::Tx,
    event: &InboundEvent,
) -> std::result::Result<bool, String>
where
    I: InboxStore,
    H: Handler<I::Conn>,
{
    let claimed = inbox
        .claim_replay(&mut *tx, group, event)
        .await
        .map_err(|e| format!("replay failed: {e}"))?;
    if !claimed {
        return Ok(false);
    }
    let mut posted = vec![];
    let handled = handler
        .handle(
            &mut HandlerContext::new(&mut **tx, event, &mut posted),
            event,
        )
        .instrument(event_span(event))
        .await;
    match handled {
        Ok(()) => {}
        Err(HandlerError::Permanent(reason)) => return Err(format!("replay refused: {reason}")),
        Err(HandlerError::Transient(e)) => {
            return Err(format!("replay failed (transient): {e}"));
        }
        Err(HandlerError::Unclassified(e)) => {
            return Err(format!(
                "replay failed ({}, of no known class): {e}",
                crate::handler::code_of(&e)
            ));
        }
    }
    // A handler that swallowed a database error left the transaction unable to commit.
    inbox
        .check_usable(&mut *tx)
        .await
        .map_err(|e| format!("replay failed: {e}"))?;
    let posted = kept(posted, |id| *id == event.event_id);
    inbox
        .record_effects(&mut *tx, &posted)
        .await
        .map_err(|e| format!("replay failed recording the effects: {e}"))?;
    Ok(true)
}

async fn record_failure<I: InboxStore>(
    inbox: &I,
    request: &ReplayRequest,
    id: i64,
    reason: String,
) -> Result<ReplayResult> {
    let reason = storable(&reason);
    let mut tx = inbox.begin().await?;
    inbox
        .finish_replay(
            &mut tx,
            id,
            &request.by,
            ReplayOutcome::Failed,
            Some(&reason),
        )
        .await?;
    inbox.commit(tx).await?;
    Ok(ReplayResult::Failed(reason))
}
