//! The effect stage: effect intents recorded in a handler's transaction, delivered by the
//! [`Dispatcher`] with the same `Idempotency-Key` on every attempt.
//!
//! A handler asks for an effect with one call, [`HandlerContext::effects`]'s `post`: the
//! intent is recorded in the consumer's transaction, with the handler's writes, keyed by the
//! event and the effect's name.
//!
//! ```no_run
//! # #[cfg(feature = "sqlite")]
//! # mod doc {
//! use idem::prelude::*;
//!
//! struct Award {
//!     points_url: String,
//! }
//!
//! impl Handler<sqlx::SqliteConnection> for Award {
//!     async fn handle(
//!         &self,
//!         cx: &mut HandlerContext<'_, sqlx::SqliteConnection>,
//!         event: &InboundEvent,
//!     ) -> Result<(), HandlerError> {
//!         // Key `event-<event id>-points.award`; the trace context is the handler's.
//!         cx.effects().post("points.award", &self.points_url, serde_json::json!({"points": 12}))?;
//!         Ok(())
//!     }
//! }
//! # }
//! ```
//!
//! The intent commits (or rolls back) with the handler's writes; a [`Dispatcher`] delivers it
//! later with the same `Idempotency-Key` on every attempt.
//!
//! [`HandlerContext::effects`]: crate::consumer::HandlerContext::effects

pub use idem_core::idempotency::{
    ClaimedIntent, EffectIntent, IdempotencyKey, IntentOutcome, IntentStore, KeyError, Resolution,
    StuckIntent,
};
pub use idem_effects::*;
