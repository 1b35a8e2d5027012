//! `Idempotency-Key` for services built with idem (IETF
//! `draft-ietf-httpapi-idempotency-key-header`), as a tower layer for axum routes.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use idem_http::{Idempotency, IdempotencyConfig};
//! # async fn award() -> &'static str { "ok" }
//! # async fn authenticate(req: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response { next.run(req).await }
//! # fn demo(store: idem_sql::sqlite::SqliteKeyStore) -> idem_core::Result<()> {
//! let registry = prometheus::Registry::new();
//! let app: Router = Router::new()
//!     .route("/awards", post(award))
//!     .route_layer(
//!         Idempotency::new(store, IdempotencyConfig::default())
//!             .registry(&registry)?
//!             .layer(),
//!     )
//!     // Outermost: identifies the client and inserts its `idem_http::ClientScope`.
//!     .route_layer(axum::middleware::from_fn(authenticate));
//! # Ok(())
//! # }
//! ```
//!
//! [`Idempotency::layer`] is an [`IdempotencyLayer`], a [`tower::Layer`] whose service,
//! [`IdempotencyService`], answers every request (its error is [`std::convert::Infallible`]).
//! On the routes it wraps:
//!
//! * the `Idempotency-Key` header is required (missing → 400) and validated (an sf-string of 1 to
//!   255 printable ASCII characters, exactly one header field; otherwise 400 with the reason);
//! * keys are scoped per client: the [`ClientScope`] an authentication layer put in the request
//!   extensions, so one client's key never reveals or replays another client's response, and a
//!   client's retry after a token refresh is still a retry. Without a `ClientScope` the request
//!   is refused and not executed: 401 when it carries no `Authorization` header, else 500 (the
//!   server has no authentication layer that names clients). Scoping by a hash of the raw
//!   `Authorization` header is opt-in ([`ScopeSource::ClientScopeOrCredential`]) and is per
//!   credential: a retry after a token refresh executes again;
//! * the key is **claimed atomically** (a unique key in the database, never a read then an
//!   insert) with a random claim token: of concurrent requests with one key one executes, the
//!   others get 409 (`Retry-After: 1`) until it completes. While the handler runs, the layer
//!   renews the claim's lock every third of [`IdempotencyConfig::lock`], so a request slower than
//!   the lock is not taken over by a retry; storing the response and releasing the key are
//!   fenced by the token, so a request that did lose its claim never overwrites or deletes the
//!   claim of the request that took it over (it logs an error and counts it in
//!   [`LayerStats::claims_lost`] and `idem_http_claims_lost_total`);
//! * the request fingerprint (SHA-256 of method, path and body) is stored with the key: the same
//!   key with a different request → 422;
//! * a completed key replays the stored status, content type, location and body with
//!   `Idempotent-Replayed: true`;
//! * a 5xx response is not stored: the key is released, so a retry executes again. Any other
//!   response is stored, whatever its size: a body larger than [`IdempotencyConfig::max_body`]
//!   (or one whose stream fails) is stored and answered as the status alone, with an empty body
//!   and `Idempotent-Body-Omitted: true`, because the handler's effect happened and a retry must
//!   not execute it again;
//! * errors are `application/problem+json` documents ([`IdempotencyRejection`]).
//!
//! Retention: a completed key is kept for [`IdempotencyConfig::retention`] (default 24 h);
//! [`spawn_sweeper`] deletes expired keys (never an in-flight claim whose lock is live). An
//! in-flight claim whose server died (it stops renewing) is taken over by a retry of the same
//! request after [`IdempotencyConfig::lock`] (default 30 s).
//!
//! **When renewal fails.** A renewal that fails (the key store is unreachable) is logged,
//! counted in [`LayerStats::renewal_failures`] and `idem_http_renewal_failures_total` and tried
//! again at the next tick; the handler is not interrupted, because stopping it part-way could
//! leave half an effect. If the store stays unreachable for longer than the lock while it is
//! reachable to a retry, the retry may take the key over and execute beside the first request;
//! the first request's completion is then fenced (it stores and deletes nothing) and counted as
//! a lost claim. The handler's own idempotency (a unique business key) is the last line there.
//!
//! **Metrics.** [`Idempotency::registry`] registers the layer's [`HttpMetrics`] in a Prometheus
//! registry: `idem_http_claims_lost_total`, `idem_http_renewal_failures_total`,
//! `idem_http_bodies_omitted_total`, `idem_http_replays_total`, `idem_http_conflicts_total` (409,
//! a request with the key in flight) and `idem_http_rejections_total{reason}` (every
//! problem+json answer, by [`IdempotencyRejection::reason`]: a fixed set of values).
//! [`Idempotency::shared_metrics`] lets several layers of one process count into one set.

mod config;
mod decision;
mod layer;
mod metrics;
mod rejection;
mod renewal;
mod sweeper;
mod transactional;

pub use config::{ClientScope, IdempotencyConfig, ScopeSource};
pub use layer::{Idempotency, IdempotencyLayer, IdempotencyService, ResponseFuture};
pub use metrics::{HttpMetrics, LayerStats};
pub use rejection::IdempotencyRejection;
pub use sweeper::spawn_sweeper;
pub use transactional::{
    KeyTransaction, NoKeyTransaction, TransactionalIdempotencyLayer,
    TransactionalIdempotencyService,
};

/// The request header ([`idem_core::idempotency::IDEMPOTENCY_KEY_HEADER`], the one the
/// dispatcher sends).
pub const IDEMPOTENCY_KEY: &str = idem_core::idempotency::IDEMPOTENCY_KEY_HEADER;
/// The response header set on replays.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// The response header set when the handler's body was not stored (larger than
/// [`IdempotencyConfig::max_body`], or its stream failed): the status is stored and replayed
/// with an empty body.
pub const IDEMPOTENT_BODY_OMITTED: &str = "idempotent-body-omitted";
