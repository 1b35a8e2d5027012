//! What a handler is handed besides its event: the consumer's connection, in the batch's
//! transaction, and the effects it asks for ([`HandlerContext`], [`BatchContext`]).
//!
//! An effect a handler posts is an [`EffectIntent`] keyed by the event and the effect's name
//! (`event-<event id>-<effect>`): the runtime records the intents of the events it applies
//! through [`InboxStore::record_effects`](idem_core::store::InboxStore::record_effects), in the same
//! transaction as the handler's writes and the inbox rows, so an intent commits exactly when
//! its event counts as applied. A dispatcher delivers it later with that key on every attempt.

use idem_core::idempotency::{EffectIntent, IdempotencyKey};
use idem_core::{EventId, InboundEvent};

use crate::handler::{HandlerError, effect_traceparent, event_span};

/// The effect intents posted during one handler call, in posting order.
pub(crate) type Posted = Vec<EffectIntent>;

/// What [`Handler::handle`](crate::Handler::handle) works with for one event: the connection
/// of the consumer's transaction ([`conn`](Self::conn)), the event's effects
/// ([`effects`](Self::effects)) and the event itself ([`event`](Self::event)).
#[derive(Debug)]
pub struct HandlerContext<'a, C> {
    conn: &'a mut C,
    event: &'a InboundEvent,
    posted: &'a mut Posted,
}

impl<'a, C> HandlerContext<'a, C> {
    /// A context over `conn` for `event`, whose effects collect in `posted`. The runtime makes
    /// one for each event it hands a handler; a caller outside the consumer (a test of one's
    /// handler) records `posted` itself, in `conn`'s transaction
    /// ([`InboxStore::record_effects`](idem_core::store::InboxStore::record_effects)).
    pub fn new(
        conn: &'a mut C,
        event: &'a InboundEvent,
        posted: &'a mut Vec<EffectIntent>,
    ) -> Self {
        HandlerContext {
            conn,
            event,
            posted,
        }
    }

    /// The connection of the consumer's transaction: write through it
    /// (`sqlx::query(..).execute(cx.conn())`), never commit it.
    pub fn conn(&mut self) -> &mut C {
        self.conn
    }

    /// The event being handled: its id, type, aggregate, payload, `traceparent` and where the
    /// broker delivered it (topic, partition, offset).
    pub fn event(&self) -> &InboundEvent {
        self.event
    }

    /// This event as a batch of one, for a handler whose [`Handler::handle`] applies it with
    /// the statements of its [`Handler::handle_batch`].
    ///
    /// [`Handler::handle`]: crate::Handler::handle
    /// [`Handler::handle_batch`]: crate::Handler::handle_batch
    pub fn as_batch(&mut self) -> BatchContext<'_, C> {
        BatchContext {
            conn: self.conn,
            posted: self.posted,
            // The handler runs in the event's span already: its effects carry that one.
            spans: false,
        }
    }

    /// The effects of the event being handled.
    pub fn effects(&mut self) -> Effects<'_> {
        Effects {
            event: self.event,
            posted: self.posted,
            in_event_span: false,
        }
    }
}

/// What [`Handler::handle_batch`](crate::Handler::handle_batch) works with for a batch: the
/// connection of the consumer's transaction and the effects of each event.
#[derive(Debug)]
pub struct BatchContext<'a, C> {
    conn: &'a mut C,
    posted: &'a mut Posted,
    /// Whether [`BatchContext::effects`] makes the event's span for the trace context (the
    /// runtime's batch, outside the events' spans) or takes the current one ([`as_batch`],
    /// inside the handler's span).
    ///
    /// [`as_batch`]: HandlerContext::as_batch
    spans: bool,
}

impl<'a, C> BatchContext<'a, C> {
    /// A context over `conn` whose effects collect in `posted` (see [`HandlerContext::new`]).
    pub fn new(conn: &'a mut C, posted: &'a mut Vec<EffectIntent>) -> Self {
        BatchContext {
            conn,
            posted,
            spans: true,
        }
    }

    /// The connection of the consumer's transaction: write through it, never commit it.
    pub fn conn(&mut self) -> &mut C {
        self.conn
    }

    /// The effects of `event`, one of the batch's: each carries the trace context of the
    /// event's own span ([`event_span`]), as [`HandlerContext::effects`] does.
    pub fn effects<'e>(&'e mut self, event: &'e InboundEvent) -> Effects<'e> {
        Effects {
            event,
            posted: self.posted,
            in_event_span: self.spans,
        }
    }

    /// The context of one event of the batch, for handling it as
    /// [`Handler::handle`](crate::Handler::handle) does: the default `handle_batch` calls
    /// `handle` with it inside [`event_span`]`(event)`, whose context the effects it posts
    /// carry; an overriding `handle_batch` that calls `handle` instruments it the same way.
    pub fn for_event<'e>(&'e mut self, event: &'e InboundEvent) -> HandlerContext<'e, C> {
        HandlerContext {
            conn: self.conn,
            event,
            posted: self.posted,
        }
    }
}

/// The external effects of one event: each [`post`](Self::post) asks for one HTTP request,
/// recorded as an intent in the consumer's transaction and delivered later by a dispatcher
/// with the same `Idempotency-Key` on every attempt.
#[derive(Debug)]
pub struct Effects<'a> {
    event: &'a InboundEvent,
    posted: &'a mut Posted,
    /// Whether the trace context comes from a span of the event made here (a batch handler
    /// runs outside the events' spans) rather than the current one.
    in_event_span: bool,
}

impl Effects<'_> {
    /// Asks for a `POST` of `body` to `target` (an absolute URL) as the effect `effect` of the
    /// event, keyed `event-<event id>-<effect>` and carrying the handler's trace context (or
    /// the event's `traceparent`). The intent is recorded when the handler returns, with its
    /// writes: a refused or failed event records none. Posting the same effect twice for one
    /// event records it once (the key is the same); a later redelivery of the event is stopped
    /// by the inbox before the handler runs.
    ///
    /// An effect name that cannot make a key (empty, too long, characters outside the key's
    /// alphabet) is a permanent failure: `?` dead-letters the event with the reason. An
    /// intent the database then refuses for its data (a NUL byte in the URL, which
    /// PostgreSQL's text cannot hold) dead-letters the event as well, its writes rolled back.
    pub fn post(
        &mut self,
        effect: &str,
        target: impl Into<String>,
        body: serde_json::Value,
    ) -> Result<(), HandlerError> {
        let event_id = self.event.event_id;
        key_for(event_id, effect)?;
        let traceparent = if self.in_event_span {
            let _in_event = event_span(self.event).entered();
            effect_traceparent(self.event)
        } else {
            effect_traceparent(self.event)
        };
        self.posted.push(EffectIntent {
            event_id,
            effect: effect.to_owned(),
            target: target.into(),
            body,
            traceparent,
        });
        Ok(())
    }
}

/// The key of `effect` of event `event_id`, or why there is none (permanent).
fn key_for(event_id: EventId, effect: &str) -> Result<IdempotencyKey, HandlerError> {
    IdempotencyKey::for_effect(event_id, effect).map_err(|e| {
        HandlerError::permanent(format!(
            "effect {effect:?} of event {event_id} cannot be keyed: {e}"
        ))
    })
}

/// The intents of `posted` whose events were `applied`: what an attempt records.
pub(crate) fn kept(posted: Posted, applied: impl Fn(&EventId) -> bool) -> Posted {
    posted
        .into_iter()
        .filter(|i| applied(&i.event_id))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> InboundEvent {
        InboundEvent {
            event_id: "7f1d0c7e-0000-7000-8000-000000010042".parse().unwrap(),
            event_type: "order.paid".into(),
            aggregate_type: "order".into(),
            aggregate_id: "10042".into(),
            payload: serde_json::json!({}),
            payload_hash: String::new(),
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
            topic: "outbox.event.order".into(),
            partition: 0,
            offset: 0,
        }
    }

    #[test]
    fn a_posted_effect_is_keyed_by_the_event_and_carries_its_trace() {
        let (e, mut conn, mut posted) = (event(), (), vec![]);
        let mut cx = HandlerContext::new(&mut conn, &e, &mut posted);
        cx.effects()
            .post(
                "points.award",
                "http://h/awards",
                serde_json::json!({"points": 12}),
            )
            .unwrap();
        assert_eq!(posted.len(), 1);
        let intent = &posted[0];
        assert_eq!(
            intent.key().unwrap().as_str(),
            "event-7f1d0c7e-0000-7000-8000-000000010042-points.award"
        );
        assert_eq!(intent.target, "http://h/awards");
        assert_eq!(intent.body, serde_json::json!({"points": 12}));
        assert_eq!(
            intent.traceparent, e.traceparent,
            "outside an OpenTelemetry layer: the event's"
        );
    }

    #[test]
    fn an_effect_name_that_cannot_make_a_key_is_permanent_and_posts_nothing() {
        let (e, mut conn, mut posted) = (event(), (), vec![]);
        let mut cx = BatchContext::new(&mut conn, &mut posted);
        let err = cx
            .effects(&e)
            .post("points award", "http://h/awards", serde_json::json!({}))
            .unwrap_err();
        assert!(
            matches!(&err, HandlerError::Permanent(r) if r.contains("\"points award\"")),
            "{err:?}"
        );
        assert!(posted.is_empty());
    }

    #[test]
    fn only_the_intents_of_applied_events_are_kept() {
        let (a, mut b) = (event(), event());
        b.event_id = EventId::new();
        let (mut conn, mut posted) = ((), vec![]);
        let mut cx = BatchContext::new(&mut conn, &mut posted);
        for e in [&a, &b] {
            cx.effects(e)
                .post("points.award", "http://h", serde_json::json!({}))
                .unwrap();
        }
        let kept = kept(posted, |id| *id == a.event_id);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].event_id, a.event_id);
    }
}
