//! `Idempotency-Key` for services built with idem (IETF
//! `draft-ietf-httpapi-idempotency-key-header`), as an axum middleware layer.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use idem_http::{Idempotency, IdempotencyConfig};
//! # async fn award() -> &'static str { "ok" }
//! # fn demo(store: idem_sqlite::SqliteKeyStore) {
//! let app: Router = Router::new()
//!     .route("/awards", post(award))
//!     .route_layer(Idempotency::new(store, IdempotencyConfig::default()).layer());
//! # }
//! ```
//!
//! On the routes it wraps:
//!
//! * the `Idempotency-Key` header is required (missing → 400) and validated (an sf-string of 1 to
//!   255 printable ASCII characters, exactly one header field; otherwise 400 with the reason);
//! * keys are scoped per client — the [`ClientScope`] an authentication layer put in the request
//!   extensions, else a hash of the `Authorization` header (no client → 401) — so one client's key
//!   never reveals or replays another client's response;
//! * the key is **claimed atomically** (a unique key in the database, never a read then an
//!   insert): of concurrent requests with one key exactly one executes, the others get 409
//!   (`Retry-After: 1`) until it completes;
//! * the request fingerprint (SHA-256 of method, path and body) is stored with the key: the same
//!   key with a different request → 422;
//! * a completed key replays the stored status, content type and body with
//!   `Idempotent-Replayed: true`; a 5xx response is not stored (the key is released, so a retry
//!   executes again);
//! * errors are `application/problem+json` documents.
//!
//! Retention: a completed key is kept for [`IdempotencyConfig::retention`] (default 24 h);
//! [`spawn_sweeper`] deletes expired keys. An in-flight claim whose server died is taken over by
//! a retry of the same request after [`IdempotencyConfig::lock`] (default 30 s).

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use idem_core::idempotency::{
    IdempotencyKey, IdempotencyStore, KeyClaim, KeyError, StoredResponse,
};
use sha2::{Digest, Sha256};

/// The request header.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response header set on replays.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The client a request belongs to, as set by an authentication layer in the request extensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientScope(pub String);

/// Layer settings.
#[derive(Clone, Debug)]
pub struct IdempotencyConfig {
    /// How long an in-flight claim is exclusive (then a retry of the same request may take it).
    pub lock: Duration,
    /// How long a completed key is kept and replayed.
    pub retention: Duration,
    /// Largest request or response body buffered, in bytes.
    pub max_body: usize,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        IdempotencyConfig {
            lock: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
            max_body: 1 << 20,
        }
    }
}

/// Why the layer answered instead of the route: each is a problem+json response.
#[derive(Debug)]
#[non_exhaustive]
pub enum IdempotencyRejection {
    /// The key is missing or malformed (400).
    BadKey(KeyError),
    /// No client could be identified to scope the key (401).
    NoClient,
    /// The body is larger than the layer buffers (413).
    TooLarge,
    /// A request with this key is still executing (409).
    InFlight,
    /// The key was used with a different request (422).
    Mismatch,
    /// The key store failed (503).
    Store(idem_core::Error),
}

impl IntoResponse for IdempotencyRejection {
    fn into_response(self) -> Response {
        let (status, title, detail) = match &self {
            IdempotencyRejection::BadKey(e) => (StatusCode::BAD_REQUEST, "Invalid Idempotency-Key", e.to_string()),
            IdempotencyRejection::NoClient => (
                StatusCode::UNAUTHORIZED,
                "Client required",
                "Idempotency-Key is scoped per client: send credentials".to_owned(),
            ),
            IdempotencyRejection::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "Body too large",
                "the body is larger than the idempotency layer buffers".to_owned(),
            ),
            IdempotencyRejection::InFlight => (
                StatusCode::CONFLICT,
                "Request in progress",
                "a request with this Idempotency-Key is still being processed; retry later with the same key".to_owned(),
            ),
            IdempotencyRejection::Mismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "Idempotency-Key reused",
                "this Idempotency-Key was used with a different request; use a new key for a new request".to_owned(),
            ),
            IdempotencyRejection::Store(e) => {
                tracing::error!(error = %e, "idempotency key store failed");
                (StatusCode::SERVICE_UNAVAILABLE, "Try again", "the idempotency key store is unavailable".to_owned())
            }
        };
        let body = serde_json::json!({
            "type": "about:blank",
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
        });
        let mut resp = (
            status,
            [(header::CONTENT_TYPE, "application/problem+json")],
            body.to_string(),
        )
            .into_response();
        if matches!(
            self,
            IdempotencyRejection::InFlight | IdempotencyRejection::Store(_)
        ) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// The boxed middleware function the layer runs.
pub type Middleware<S> = fn(
    State<Idempotency<S>>,
    Request,
    Next,
) -> std::pin::Pin<Box<dyn Future<Output = Response> + Send>>;

/// The layer returned by [`Idempotency::layer`].
pub type IdempotencyLayer<S> =
    axum::middleware::FromFnLayer<Middleware<S>, Idempotency<S>, (State<Idempotency<S>>, Request)>;

/// The layer's state: a key store and settings.
#[derive(Clone, Debug)]
pub struct Idempotency<S> {
    store: S,
    config: IdempotencyConfig,
}

impl<S: IdempotencyStore> Idempotency<S> {
    /// Keys in `store`, with `config`.
    pub fn new(store: S, config: IdempotencyConfig) -> Self {
        Idempotency { store, config }
    }

    /// The axum layer; apply it with `Router::route_layer` to the routes that require a key.
    pub fn layer(self) -> IdempotencyLayer<S> {
        from_fn_with_state(self, |state, req, next| Box::pin(handle(state, req, next)))
    }
}

fn scope(req: &Request) -> Option<String> {
    if let Some(ClientScope(s)) = req.extensions().get::<ClientScope>() {
        return Some(format!("client:{s}"));
    }
    req.headers()
        .get(header::AUTHORIZATION)
        .map(|v| format!("credential:{}", hex(&Sha256::digest(v.as_bytes()))))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn fingerprint(method: &str, uri: &str, body: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(method.as_bytes());
    h.update([0]);
    h.update(uri.as_bytes());
    h.update([0]);
    h.update(body);
    hex(&h.finalize())
}

const REPLAYED_HEADERS: &[HeaderName] = &[header::CONTENT_TYPE, header::LOCATION];

fn replay(stored: StoredResponse) -> Response {
    let mut resp = Response::new(Body::from(stored.body));
    *resp.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers: &mut HeaderMap = resp.headers_mut();
    for (k, v) in stored.headers {
        if let (Ok(k), Ok(v)) = (HeaderName::try_from(k), HeaderValue::try_from(v)) {
            headers.append(k, v);
        }
    }
    headers.insert(
        HeaderName::from_static(IDEMPOTENT_REPLAYED),
        HeaderValue::from_static("true"),
    );
    resp
}

async fn handle<S: IdempotencyStore>(
    State(state): State<Idempotency<S>>,
    req: Request,
    next: Next,
) -> Response {
    match run(state, req, next).await {
        Ok(resp) => resp,
        Err(rejection) => rejection.into_response(),
    }
}

async fn run<S: IdempotencyStore>(
    state: Idempotency<S>,
    req: Request,
    next: Next,
) -> Result<Response, IdempotencyRejection> {
    let values: Vec<&[u8]> = req
        .headers()
        .get_all(IDEMPOTENCY_KEY)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    let key = IdempotencyKey::from_header_values(&values).map_err(IdempotencyRejection::BadKey)?;
    let scope = scope(&req).ok_or(IdempotencyRejection::NoClient)?;
    let (parts, body) = req.into_parts();
    let bytes: Bytes = axum::body::to_bytes(body, state.config.max_body)
        .await
        .map_err(|_| IdempotencyRejection::TooLarge)?;
    let uri = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_owned();
    let print = fingerprint(parts.method.as_str(), &uri, &bytes);
    match state
        .store
        .claim(
            &scope,
            &key,
            &print,
            state.config.lock,
            state.config.retention,
        )
        .await
        .map_err(IdempotencyRejection::Store)?
    {
        KeyClaim::New => {}
        KeyClaim::InFlight => return Err(IdempotencyRejection::InFlight),
        KeyClaim::Mismatch => return Err(IdempotencyRejection::Mismatch),
        KeyClaim::Completed(stored) => return Ok(replay(stored)),
    }
    // From here the request runs in its own task: a client that disconnects (a timeout) must
    // not cancel the handler between its effect and the key's completion, which would leave
    // the key in flight until the lock expires and let a retry execute again.
    let (store, max_body) = (state.store.clone(), state.config.max_body);
    let (scope2, key2) = (scope.clone(), key.clone());
    let task =
        tokio::spawn(
            async move { execute(store, max_body, &scope2, &key2, next, parts, bytes).await },
        );
    match task.await {
        Ok(resp) => Ok(resp),
        Err(e) => {
            // The handler panicked: whether its effect happened is unknown to us; release the
            // key so that a retry is not refused forever, and say so.
            let _ = state.store.release(&scope, &key).await;
            tracing::error!(error = %e, "the handler panicked; the idempotency key was released");
            Ok(StatusCode::INTERNAL_SERVER_ERROR.into_response())
        }
    }
}

async fn execute<S: IdempotencyStore>(
    store: S,
    max_body: usize,
    scope: &str,
    key: &IdempotencyKey,
    next: Next,
    parts: axum::http::request::Parts,
    bytes: Bytes,
) -> Response {
    let resp = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    let (parts, body) = resp.into_parts();
    let body = match axum::body::to_bytes(body, max_body).await {
        Ok(b) => b,
        Err(e) => {
            let _ = store.release(scope, key).await;
            tracing::error!(error = %e, "the response body could not be buffered; the key was released");
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
    };
    if parts.status.is_server_error() {
        // A retry may succeed: do not pin this failure to the key.
        if let Err(e) = store.release(scope, key).await {
            tracing::warn!(error = %e, "releasing an idempotency key after a server error");
        }
    } else {
        let stored = StoredResponse {
            status: parts.status.as_u16(),
            headers: REPLAYED_HEADERS
                .iter()
                .filter_map(|h| {
                    parts
                        .headers
                        .get(h)
                        .and_then(|v| v.to_str().ok())
                        .map(|v| (h.as_str().to_owned(), v.to_owned()))
                })
                .collect(),
            body: body.to_vec(),
        };
        if let Err(e) = store.complete(scope, key, &stored).await {
            // The effect happened; a retry will see the key in flight until the lock expires,
            // then execute again. Logged so an operator can see the window.
            tracing::error!(error = %e, "storing an idempotent response failed");
        }
    }
    Response::from_parts(parts, Body::from(body))
}

/// Deletes expired keys every `every`, until the runtime shuts down.
pub fn spawn_sweeper<S: IdempotencyStore>(
    store: S,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            match store.sweep().await {
                Ok(n) if n > 0 => tracing::info!(deleted = n, "swept expired idempotency keys"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "sweeping idempotency keys"),
            }
        }
    })
}
