//! The effect dispatcher: delivers effect intents (recorded by handlers in their own
//! transactions) to external HTTP APIs.
//!
//! # Delivery semantics
//!
//! At least once *attempted*; converging to once *applied* where the remote honours
//! `Idempotency-Key`. Every attempt of an intent carries the key stored with it
//! (`event-<event id>-<effect>`) — after a retry, a crash or a restart alike; the dispatcher never
//! mints a key. Outcomes:
//!
//! | response | outcome |
//! |---|---|
//! | 2xx | done; the response is stored |
//! | timeout, connection error, 5xx | retried with backoff (or the `Retry-After` the remote sent), same key |
//! | 409 (the remote is still processing the key), 429 | retried with exponential backoff (never shorter than the remote's `Retry-After`), same key, until [`DispatcherConfig::busy_attempts`]; then parked for a person |
//! | 422 (the key was used with a different body) | parked for a person; `idem_idempotency_conflict_total` |
//! | other 4xx | parked with the reason |
//! | TLS handshake failure (certificate not trusted, expired or for another name; a client certificate demanded or refused; not TLS) | parked with the reason ([`TlsFailure`]); `idem_effect_tls_failure_total` |
//!
//! HTTPS uses rustls (ring) with the system's roots, a CA bundle and a client certificate
//! ([`HttpTls`], in [`DispatcherConfig::tls`]); a target's scheme is never changed.
//!
//! Duplicate windows: a crash after the remote applied the effect and before the outcome is
//! recorded (`effect.after_http_success_before_record`) leads to a new attempt with the same
//! key, which the remote answers from its stored response. A remote that ignores keys would
//! apply it twice: declare it with an [`EffectPolicy`] (`remote_ignores_keys`). The dispatcher
//! then commits a sending mark before every request ([`IntentStore::mark_sending`](idem_core::idempotency::IntentStore::mark_sending)); an attempt
//! that finds an earlier attempt's mark with no recorded outcome (the dispatcher died or lost
//! its lease after sending) and every ambiguous failure go to the [`StatusProbe`], or, without
//! one, to the *unknown* state instead of a re-send; a [`Compensation`] settles unknown intents.
//! The [`remote`] module documents the window that remains.
//!
//! A claim takes at most the free ones of `concurrency` slots, and no probe or request starts
//! unless its intent's lease ends after `now + timeout + lease_margin` ([`lease_allows_send`]).
//! [`Dispatcher::run`] claims again as soon as half of the slots are free (one slow remote holds
//! one slot, not the next claim) and records outcomes in batches
//! ([`IntentStore::finish_all`](idem_core::idempotency::IntentStore::finish_all), fenced per
//! attempt), after [`DispatcherConfig::outcome_delay`] or [`DispatcherConfig::outcome_batch`]
//! outcomes and on shutdown: a kill loses at most the buffered outcomes, whose intents are sent
//! again after the lease with the same key ([`pipeline`]).
//!
//! # Layout
//!
//! [`classify`](mod@classify) holds the pure decisions (an answer → a [`Verdict`], waits, lease checks),
//! `dispatcher.rs` the I/O around them ([`Dispatcher`], [`Dispatcher::run`]), [`pipeline`] the
//! decisions of `run`'s loop (when to claim, when to write),
//! [`remote`] the remotes that ignore keys, [`EffectMetrics`] the metrics and
//! [`IntentStatus`] an intent's stored state.

pub mod classify;
mod dispatcher;
mod metrics;
pub mod pipeline;
pub mod remote;
pub mod tls;

pub use classify::{
    ParkKind, ProbeResult, Reply, Verdict, backoff_after, bound_busy, classify, lease_allows_send,
    predecessor_outcome,
};
pub use dispatcher::{CompensateError, DATABASE, Dispatcher, DispatcherBuilder, DispatcherConfig};
pub use idem_core::idempotency::{IntentStatus, UnknownStatus};
pub use metrics::EffectMetrics;
pub use pipeline::{claim_size, may_claim, store_backoff};
pub use remote::{
    AppliedWhen, Compensation, CompensationError, EffectPolicy, HttpCompensation, HttpStatusProbe,
    Probe, StatusProbe, TemplateError,
};
pub use tls::{HttpTls, LoadedTls, TlsConfigError, TlsFailure, tls_failure};
