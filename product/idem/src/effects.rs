//! The effect stage: effect intents recorded in a handler's transaction, delivered by the
//! [`Dispatcher`] with the same `Idempotency-Key` on every attempt.
//!
//! Recording an effect from a handler is one call, [`RecordEffect::record_effect`], on the
//! intent store of the handler's database:
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # mod doc {
//! use idem::prelude::*;
//!
//! struct Award {
//!     intents: idem::sqlite::SqliteIntents,
//!     points_url: String,
//! }
//!
//! impl Handler<sqlx::SqliteConnection> for Award {
//!     async fn handle(
//!         &self,
//!         conn: &mut sqlx::SqliteConnection,
//!         event: &InboundEvent,
//!     ) -> Result<(), HandlerError> {
//!         // Key `event-<event id>-points.award`; the trace context is the handler's.
//!         self.intents
//!             .record_effect(conn, event, "points.award", &self.points_url, serde_json::json!({"points": 12}))
//!             .await?;
//!         Ok(())
//!     }
//! }
//! # }
//! ```
//!
//! The intent commits (or rolls back) with the handler's writes; a [`Dispatcher`] delivers it
//! later with the same `Idempotency-Key` on every attempt.

pub use idem_core::idempotency::{
    ClaimedIntent, EffectIntent, IdempotencyKey, IntentOutcome, IntentStore, KeyError, Resolution,
    StuckIntent,
};
pub use idem_effects::*;

use idem_consumer::HandlerError;
use idem_core::InboundEvent;

/// Records effect intents from a handler, in the handler's transaction. Implemented by every
/// [`IntentStore`] (`idem::postgres::PgIntents`, `idem::sqlite::SqliteIntents`).
pub trait RecordEffect: IntentStore {
    /// Records `effect` of `event`: a `POST` of `body` to `target`, keyed
    /// `event-<event id>-<effect>`, carrying the current trace context (the handler's span, or
    /// the event's `traceparent`). Returns false when the event had already recorded this
    /// effect (recording is idempotent). An effect name that cannot make a key is a permanent
    /// failure (the event is dead-lettered with the reason); a store failure is transient.
    fn record_effect(
        &self,
        conn: &mut Self::Conn,
        event: &InboundEvent,
        effect: &str,
        target: &str,
        body: serde_json::Value,
    ) -> impl std::future::Future<Output = Result<bool, HandlerError>> + Send;
}

/// The intent [`RecordEffect::record_effect`] records.
pub fn intent_for(
    event: &InboundEvent,
    effect: &str,
    target: &str,
    body: serde_json::Value,
) -> EffectIntent {
    EffectIntent {
        event_id: event.event_id,
        effect: effect.to_owned(),
        target: target.to_owned(),
        body,
        traceparent: idem_consumer::effect_traceparent(event),
    }
}

impl<S: IntentStore> RecordEffect for S {
    async fn record_effect(
        &self,
        conn: &mut Self::Conn,
        event: &InboundEvent,
        effect: &str,
        target: &str,
        body: serde_json::Value,
    ) -> Result<bool, HandlerError> {
        let intent = intent_for(event, effect, target, body);
        if let Err(e) = intent.key() {
            return Err(HandlerError::permanent(format!(
                "effect {effect:?} of event {} cannot be keyed: {e}",
                event.event_id
            )));
        }
        // An invalid intent is permanent (dead-lettered), anything else transient (retried).
        self.record(conn, &intent).await.map_err(HandlerError::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_intent_is_keyed_by_the_event_and_the_effect() {
        let event = InboundEvent {
            event_id: "7f1d0c7e-0000-7000-8000-000000010042".parse().unwrap(),
            ..sample_event()
        };
        let intent = intent_for(
            &event,
            "points.award",
            "http://h/awards",
            serde_json::json!({}),
        );
        assert_eq!(
            intent.key().unwrap().as_str(),
            "event-7f1d0c7e-0000-7000-8000-000000010042-points.award"
        );
        assert_eq!(
            intent.traceparent, event.traceparent,
            "outside a span: the event's"
        );
    }

    fn sample_event() -> InboundEvent {
        InboundEvent {
            event_id: idem_core::EventId::new(),
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
}
