//! `Idempotency-Key` for services built with idem (IETF
//! `draft-ietf-httpapi-idempotency-key-header`), as an axum middleware layer.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use idem_http::{Idempotency, IdempotencyConfig};
//! # async fn award() -> &'static str { "ok" }
//! # async fn authenticate(req: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response { next.run(req).await }
//! # fn demo(store: idem_sql::sqlite::SqliteKeyStore) {
//! let app: Router = Router::new()
//!     .route("/awards", post(award))
//!     .route_layer(Idempotency::new(store, IdempotencyConfig::default()).layer())
//!     // Outermost: identifies the client and inserts its `idem_http::ClientScope`.
//!     .route_layer(axum::middleware::from_fn(authenticate));
//! # }
//! ```
//!
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
//!   [`LayerStats::claims_lost`]);
//! * the request fingerprint (SHA-256 of method, path and body) is stored with the key: the same
//!   key with a different request → 422;
//! * a completed key replays the stored status, content type, location and body with
//!   `Idempotent-Replayed: true`;
//! * a 5xx response is not stored: the key is released, so a retry executes again. Any other
//!   response is stored, whatever its size: a body larger than [`IdempotencyConfig::max_body`]
//!   (or one whose stream fails) is stored and answered as the status alone, with an empty body
//!   and `Idempotent-Body-Omitted: true`, because the handler's effect happened and a retry must
//!   not execute it again;
//! * errors are `application/problem+json` documents.
//!
//! Retention: a completed key is kept for [`IdempotencyConfig::retention`] (default 24 h);
//! [`spawn_sweeper`] deletes expired keys (never an in-flight claim whose lock is live). An
//! in-flight claim whose server died (it stops renewing) is taken over by a retry of the same
//! request after [`IdempotencyConfig::lock`] (default 30 s).
//!
//! **When renewal fails.** A renewal that fails (the key store is unreachable) is logged,
//! counted in [`LayerStats::renewal_failures`] and tried again at the next tick; the handler is
//! not interrupted, because stopping it part-way could leave half an effect. If the store stays
//! unreachable for longer than the lock while it is reachable to a retry, the retry may take the
//! key over and execute beside the first request; the first request's completion is then fenced
//! (it stores and deletes nothing) and counted in [`LayerStats::claims_lost`]. The handler's own
//! idempotency (a unique business key) is the last line there.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use idem_core::idempotency::{
    ClaimToken, IdempotencyKey, IdempotencyStore, KeyClaim, KeyError, StoredResponse,
    TransactionalKeyStore, TxClaim,
};
use sha2::{Digest, Sha256};

/// The request header ([`idem_core::idempotency::IDEMPOTENCY_KEY_HEADER`], the one the
/// dispatcher sends).
pub const IDEMPOTENCY_KEY: &str = idem_core::idempotency::IDEMPOTENCY_KEY_HEADER;
/// The response header set on replays.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// The response header set when the handler's body was not stored (larger than
/// [`IdempotencyConfig::max_body`], or its stream failed): the status is stored and replayed
/// with an empty body.
pub const IDEMPOTENT_BODY_OMITTED: &str = "idempotent-body-omitted";

/// The client a request belongs to, as set by an authentication layer in the request extensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientScope(pub String);

/// Where the layer takes the scope of a key from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ScopeSource {
    /// Only the [`ClientScope`] an authentication layer set; a request without one is refused.
    #[default]
    ClientScope,
    /// The [`ClientScope`], else a hash of the raw `Authorization` header. Opt-in: keys are then
    /// per credential, so a client's retry after a token refresh or rotation executes again.
    ClientScopeOrCredential,
}

/// Layer settings.
#[derive(Clone, Debug)]
pub struct IdempotencyConfig {
    /// How long an in-flight claim is exclusive without renewal (then a retry of the same
    /// request may take it). The layer renews it every third of this while the handler runs.
    pub lock: Duration,
    /// How long a completed key is kept and replayed.
    pub retention: Duration,
    /// Largest request body buffered, and largest response body stored, in bytes.
    pub max_body: usize,
    /// Where the key's scope comes from.
    pub scope: ScopeSource,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        IdempotencyConfig {
            lock: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
            max_body: 1 << 20,
            scope: ScopeSource::ClientScope,
        }
    }
}

/// What the layer counts (each also logged): read them with [`Idempotency::stats`].
#[derive(Debug, Default)]
pub struct LayerStats {
    /// Claims this layer found taken over or gone when it renewed, completed or released them:
    /// a request ran longer than its lock without renewing it. A retry may have executed beside
    /// it. Never normal.
    pub claims_lost: AtomicU64,
    /// Lock renewals that failed (the key store was unreachable) and were tried again.
    pub renewal_failures: AtomicU64,
    /// Responses stored without their body (too large to store, or the body stream failed).
    pub bodies_omitted: AtomicU64,
}

impl LayerStats {
    fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Why the layer answered instead of the route: each is a problem+json response.
#[derive(Debug)]
#[non_exhaustive]
pub enum IdempotencyRejection {
    /// The key is missing or malformed (400).
    BadKey(KeyError),
    /// The request carries no credentials, so no client could be identified (401).
    NoClient,
    /// The request carries credentials but no authentication layer set a [`ClientScope`], and
    /// scoping by credential is not enabled (500: the server's configuration, not the client).
    NoScope,
    /// The body is larger than the layer buffers (413).
    TooLarge,
    /// A request with this key is still executing (409).
    InFlight,
    /// The key was used with a different request (422).
    Mismatch,
    /// The key store failed (503).
    Store(idem_core::Error),
    /// Under [`Idempotency::transactional_layer`]: the request's commit failed; its writes and
    /// the key were rolled back or, when the connection broke during the commit, may have
    /// committed: a retry with the same key replays or executes, never both (503).
    NotCommitted(idem_core::Error),
    /// Under [`Idempotency::transactional_layer`]: the claim was not held when the response was
    /// stored (never expected: the open transaction holds it); everything was rolled back (503).
    ClaimNotHeld,
}

impl IdempotencyRejection {
    fn parts(&self) -> (StatusCode, &'static str, String) {
        match self {
            IdempotencyRejection::BadKey(e) => (StatusCode::BAD_REQUEST, "Invalid Idempotency-Key", e.to_string()),
            IdempotencyRejection::NoClient => (
                StatusCode::UNAUTHORIZED,
                "Client required",
                "Idempotency-Key is scoped per client: send credentials".to_owned(),
            ),
            IdempotencyRejection::NoScope => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "Client not identified",
                "the server did not identify the client (no ClientScope from an authentication layer), so it cannot scope the Idempotency-Key; nothing was executed".to_owned(),
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
            IdempotencyRejection::Store(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "Try again", "the idempotency key store is unavailable".to_owned())
            }
            IdempotencyRejection::NotCommitted(_) | IdempotencyRejection::ClaimNotHeld => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Try again",
                "the request's writes were not committed; retry with the same Idempotency-Key".to_owned(),
            ),
        }
    }
}

impl IntoResponse for IdempotencyRejection {
    fn into_response(self) -> Response {
        match &self {
            IdempotencyRejection::Store(e) => {
                tracing::error!(error = %e, "idempotency key store failed");
            }
            IdempotencyRejection::NotCommitted(e) => {
                tracing::error!(error = %e, "an idempotent request's transaction did not commit");
            }
            IdempotencyRejection::ClaimNotHeld => tracing::error!(
                "the idempotency key's claim was not held when its response was stored; the request's transaction was rolled back"
            ),
            IdempotencyRejection::NoScope => tracing::error!(
                "a request with an Idempotency-Key reached the layer without a ClientScope: add an authentication layer that inserts idem_http::ClientScope (or opt in to ScopeSource::ClientScopeOrCredential)"
            ),
            _ => {}
        }
        let (status, title, detail) = self.parts();
        let mut resp = problem(status, title, &detail);
        if matches!(
            self,
            IdempotencyRejection::InFlight
                | IdempotencyRejection::Store(_)
                | IdempotencyRejection::NotCommitted(_)
                | IdempotencyRejection::ClaimNotHeld
        ) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// An `application/problem+json` response.
fn problem(status: StatusCode, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
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
    stats: Arc<LayerStats>,
}

impl<S: IdempotencyStore> Idempotency<S> {
    /// Keys in `store`, with `config`.
    pub fn new(store: S, config: IdempotencyConfig) -> Self {
        Idempotency {
            store,
            config,
            stats: Arc::default(),
        }
    }

    /// The layer's counters (shared by every clone and by the layer).
    pub fn stats(&self) -> Arc<LayerStats> {
        Arc::clone(&self.stats)
    }

    /// The axum layer; apply it with `Router::route_layer` to the routes that require a key,
    /// inside the authentication layer that sets [`ClientScope`].
    pub fn layer(self) -> IdempotencyLayer<S> {
        from_fn_with_state(self, |state, req, next| Box::pin(handle(state, req, next)))
    }
}

impl<S: TransactionalKeyStore> Idempotency<S> {
    /// The axum layer in which the key's claim, the handler's writes and the stored response
    /// are **one** database transaction of the key store: the handler extracts the
    /// [`KeyTransaction`] and writes in it, and the layer commits it with the response, so an
    /// effect is never committed without its key's completion, nor the completion without the
    /// effect (see [`TransactionalKeyStore`] for what concurrent requests then do). Use it when
    /// the handler's writes are in the key store's database; apply it like [`Idempotency::layer`].
    ///
    /// The claim is never in flight for others to see, so nothing is renewed: the database's
    /// lock is the claim. A 5xx rolls the writes and the claim back; a commit that fails is
    /// answered 503 ([`IdempotencyRejection::NotCommitted`]); a panicking handler is answered
    /// 500 with everything rolled back.
    pub fn transactional_layer(self) -> IdempotencyLayer<S> {
        from_fn_with_state(self, |state, req, next| {
            Box::pin(handle_transactional(state, req, next))
        })
    }
}

/// The scope of a request's key: a pure decision over what the request carries.
fn scope(
    client: Option<&ClientScope>,
    authorization: Option<&HeaderValue>,
    source: ScopeSource,
) -> Result<String, IdempotencyRejection> {
    match (client, authorization, source) {
        (Some(ClientScope(s)), _, _) => Ok(format!("client:{s}")),
        (None, None, _) => Err(IdempotencyRejection::NoClient),
        (None, Some(v), ScopeSource::ClientScopeOrCredential) => {
            Ok(format!("credential:{}", hex(&Sha256::digest(v.as_bytes()))))
        }
        (None, Some(_), ScopeSource::ClientScope) => Err(IdempotencyRejection::NoScope),
    }
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

fn response_of(stored: StoredResponse) -> Response {
    let mut resp = Response::new(Body::from(stored.body));
    *resp.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers: &mut HeaderMap = resp.headers_mut();
    for (k, v) in stored.headers {
        if let (Ok(k), Ok(v)) = (HeaderName::try_from(k), HeaderValue::try_from(v)) {
            headers.append(k, v);
        }
    }
    resp
}

fn replay(stored: StoredResponse) -> Response {
    let mut resp = response_of(stored);
    resp.headers_mut().insert(
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

/// A claim this request holds.
struct Held<S> {
    store: S,
    scope: String,
    key: IdempotencyKey,
    token: ClaimToken,
    config: IdempotencyConfig,
    stats: Arc<LayerStats>,
    /// Set once the claim was found lost (counted once per claim).
    lost: std::sync::atomic::AtomicBool,
}

/// What the layer reads from a request before it claims the key.
struct Prepared {
    key: IdempotencyKey,
    scope: String,
    parts: axum::http::request::Parts,
    bytes: Bytes,
    fingerprint: String,
}

/// The key, its scope, the buffered body and the fingerprint of `req`.
async fn prepare(
    config: &IdempotencyConfig,
    req: Request,
) -> Result<Prepared, IdempotencyRejection> {
    let values: Vec<&[u8]> = req
        .headers()
        .get_all(IDEMPOTENCY_KEY)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    let key = IdempotencyKey::from_header_values(&values).map_err(IdempotencyRejection::BadKey)?;
    let scope = scope(
        req.extensions().get::<ClientScope>(),
        req.headers().get(header::AUTHORIZATION),
        config.scope,
    )?;
    let (parts, body) = req.into_parts();
    let bytes: Bytes = axum::body::to_bytes(body, config.max_body)
        .await
        .map_err(|_| IdempotencyRejection::TooLarge)?;
    let uri = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_owned();
    let fingerprint = fingerprint(parts.method.as_str(), &uri, &bytes);
    Ok(Prepared {
        key,
        scope,
        parts,
        bytes,
        fingerprint,
    })
}

async fn run<S: IdempotencyStore>(
    state: Idempotency<S>,
    req: Request,
    next: Next,
) -> Result<Response, IdempotencyRejection> {
    let p = prepare(&state.config, req).await?;
    let c = &state.config;
    let token = match state
        .store
        .claim(&p.scope, &p.key, &p.fingerprint, c.lock, c.retention)
        .await
        .map_err(IdempotencyRejection::Store)?
    {
        KeyClaim::New(token) => token,
        KeyClaim::InFlight => return Err(IdempotencyRejection::InFlight),
        KeyClaim::Mismatch => return Err(IdempotencyRejection::Mismatch),
        KeyClaim::Completed(stored) => return Ok(replay(stored)),
    };
    let held = Arc::new(Held {
        store: state.store.clone(),
        scope: p.scope,
        key: p.key,
        token,
        config: state.config.clone(),
        stats: state.stats(),
        lost: std::sync::atomic::AtomicBool::new(false),
    });
    // From here the request runs in its own task: a client that disconnects (a timeout) must
    // not cancel the handler between its effect and the key's completion, which would leave
    // the key in flight until the lock expires and let a retry execute again.
    let task = tokio::spawn(execute(Arc::clone(&held), next, p.parts, p.bytes));
    match task.await {
        Ok(resp) => Ok(resp),
        Err(e) => {
            // The handler panicked: whether its effect happened is unknown to us; release the
            // key so that a retry is not refused forever, and say so.
            held.release().await;
            tracing::error!(error = %e, "the handler panicked; the idempotency key was released");
            Ok(StatusCode::INTERNAL_SERVER_ERROR.into_response())
        }
    }
}

/// Runs the handler on the buffered request; its response head and buffered body.
async fn run_handler(
    next: Next,
    parts: axum::http::request::Parts,
    bytes: Bytes,
    max_body: usize,
) -> (axum::http::response::Parts, Result<Bytes, axum::Error>) {
    let resp = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    let (parts, body) = resp.into_parts();
    let body = axum::body::to_bytes(body, max_body).await;
    (parts, body)
}

/// Counts and logs a response stored without its body.
fn note_omitted(stats: &LayerStats, omitted: Option<axum::Error>, status: u16) {
    if let Some(e) = omitted {
        LayerStats::count(&stats.bodies_omitted);
        tracing::error!(error = %e, status, "the response body could not be stored; the status is stored and replayed with an empty body");
    }
}

async fn execute<S: IdempotencyStore>(
    held: Arc<Held<S>>,
    next: Next,
    parts: axum::http::request::Parts,
    bytes: Bytes,
) -> Response {
    let work = run_handler(next, parts, bytes, held.config.max_body);
    let (parts, body) = held.while_renewing(work).await;
    match decide(parts, body).noted(&held.stats) {
        // A 5xx: a retry may succeed, so do not pin this failure to the key.
        Noted::Release(resp) => {
            held.release().await;
            resp
        }
        Noted::Store(stored, answer) => {
            held.complete(&stored).await;
            answer
        }
    }
}

async fn handle_transactional<S: TransactionalKeyStore>(
    State(state): State<Idempotency<S>>,
    req: Request,
    next: Next,
) -> Response {
    match run_transactional(state, req, next).await {
        Ok(resp) => resp,
        Err(rejection) => rejection.into_response(),
    }
}

/// A claim held in an open transaction ([`Idempotency::transactional_layer`]).
struct TxHeld<S> {
    store: S,
    scope: String,
    key: IdempotencyKey,
    token: ClaimToken,
    max_body: usize,
    stats: Arc<LayerStats>,
}

async fn run_transactional<S: TransactionalKeyStore>(
    state: Idempotency<S>,
    req: Request,
    next: Next,
) -> Result<Response, IdempotencyRejection> {
    let mut p = prepare(&state.config, req).await?;
    let c = &state.config;
    let (tx, token) = match state
        .store
        .claim_in_transaction(&p.scope, &p.key, &p.fingerprint, c.lock, c.retention)
        .await
        .map_err(IdempotencyRejection::Store)?
    {
        TxClaim::New { tx, token } => (tx, token),
        TxClaim::InFlight => return Err(IdempotencyRejection::InFlight),
        TxClaim::Mismatch => return Err(IdempotencyRejection::Mismatch),
        TxClaim::Completed(stored) => return Ok(replay(stored)),
    };
    let slot = KeyTransaction::new(tx);
    p.parts.extensions.insert(slot.clone());
    let held = TxHeld {
        store: state.store.clone(),
        scope: p.scope,
        key: p.key,
        token,
        max_body: c.max_body,
        stats: state.stats(),
    };
    // Its own task, as in `run`: a client that disconnects does not cancel the commit. A panic
    // drops the task and every handle of the transaction with it: it rolls back.
    match tokio::spawn(execute_transactional(held, slot, next, p.parts, p.bytes)).await {
        Ok(resp) => Ok(resp),
        Err(e) => {
            tracing::error!(error = %e, "the handler panicked; its transaction and the key's claim were rolled back");
            Ok(StatusCode::INTERNAL_SERVER_ERROR.into_response())
        }
    }
}

async fn execute_transactional<S: TransactionalKeyStore>(
    held: TxHeld<S>,
    slot: KeyTransaction<S::Transaction>,
    next: Next,
    parts: axum::http::request::Parts,
    bytes: Bytes,
) -> Response {
    let (parts, body) = run_handler(next, parts, bytes, held.max_body).await;
    let Some(tx) = slot.take() else {
        // The handler dropped the transaction: the claim and its writes are rolled back.
        tracing::error!(
            "the handler did not put the idempotency layer's transaction back; nothing was committed"
        );
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    match decide(parts, body).noted(&held.stats) {
        Noted::Release(resp) => {
            held.store.roll_back(tx).await;
            resp
        }
        Noted::Store(stored, answer) => {
            let committed = held
                .store
                .complete_and_commit(tx, &held.scope, &held.key, &held.token, &stored)
                .await;
            match committed {
                Ok(true) => answer,
                Ok(false) => {
                    LayerStats::count(&held.stats.claims_lost);
                    IdempotencyRejection::ClaimNotHeld.into_response()
                }
                Err(e) => IdempotencyRejection::NotCommitted(e).into_response(),
            }
        }
    }
}

/// What to do with the handler's response: a pure decision.
enum Decision {
    /// A 5xx: release the key and answer this.
    Release(Response),
    /// The effect happened: store `stored` and answer `answer` (`omitted`: why the body is not
    /// stored, in which case the answer has no body either, like the replays).
    Store {
        stored: StoredResponse,
        answer: Response,
        omitted: Option<axum::Error>,
    },
}

/// A [`Decision`] once an omitted body is counted.
enum Noted {
    /// Release the key and answer this.
    Release(Response),
    /// Store the response and answer the second.
    Store(StoredResponse, Response),
}

impl Decision {
    /// What to do, with an omitted body counted and logged.
    fn noted(self, stats: &LayerStats) -> Noted {
        match self {
            Decision::Release(resp) => Noted::Release(resp),
            Decision::Store {
                stored,
                answer,
                omitted,
            } => {
                note_omitted(stats, omitted, stored.status);
                Noted::Store(stored, answer)
            }
        }
    }
}

fn decide(mut parts: axum::http::response::Parts, body: Result<Bytes, axum::Error>) -> Decision {
    if parts.status.is_server_error() {
        let body = body.unwrap_or_default();
        return Decision::Release(Response::from_parts(parts, Body::from(body)));
    }
    let (body, omitted) = match body {
        Ok(body) => (body, None),
        Err(e) => {
            for h in [
                header::CONTENT_TYPE,
                header::CONTENT_LENGTH,
                header::TRANSFER_ENCODING,
            ] {
                parts.headers.remove(h);
            }
            parts.headers.insert(
                HeaderName::from_static(IDEMPOTENT_BODY_OMITTED),
                HeaderValue::from_static("true"),
            );
            (Bytes::new(), Some(e))
        }
    };
    let kept = |h: &HeaderName| {
        parts
            .headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .map(|v| (h.as_str().to_owned(), v.to_owned()))
    };
    let mut headers: Vec<(String, String)> = REPLAYED_HEADERS.iter().filter_map(kept).collect();
    if omitted.is_some() {
        headers.push((IDEMPOTENT_BODY_OMITTED.to_owned(), "true".to_owned()));
    }
    let stored = StoredResponse {
        status: parts.status.as_u16(),
        headers,
        body: body.to_vec(),
    };
    Decision::Store {
        stored,
        answer: Response::from_parts(parts, Body::from(body)),
        omitted,
    }
}

impl<S: IdempotencyStore> Held<S> {
    /// Runs `work` while renewing the claim's lock.
    async fn while_renewing<T>(&self, work: impl Future<Output = T>) -> T {
        let work = std::pin::pin!(work);
        let mut work = work;
        tokio::select! {
            biased;
            out = &mut work => out,
            () = self.heartbeat() => work.await,
        }
    }

    /// Renews the lock every third of it; returns only when the claim is lost.
    async fn heartbeat(&self) {
        if idem_core::crash::broken(idem_core::crash::BREAK_KEY_LOCK_RENEWAL) {
            return std::future::pending().await;
        }
        let every =
            (self.config.lock / 3).clamp(Duration::from_millis(1), Duration::from_secs(3600));
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let renewed = self
                .store
                .renew(&self.scope, &self.key, &self.token, self.config.lock)
                .await;
            match renewed {
                Ok(true) => {}
                Ok(false) => return self.lost("renewing its lock"),
                Err(e) => {
                    LayerStats::count(&self.stats.renewal_failures);
                    tracing::warn!(error = %e, "renewing the lock of an idempotency key failed; trying again");
                }
            }
        }
    }

    fn lost(&self, doing: &str) {
        if !self.lost.swap(true, Ordering::Relaxed) {
            LayerStats::count(&self.stats.claims_lost);
        }
        tracing::error!(
            key = self.key.as_str(),
            "the idempotency key's claim was lost (its lock ran out and a retry took it over, or it was swept) when {doing}: a retry may have executed beside this request; nothing was changed"
        );
    }

    async fn complete(&self, stored: &StoredResponse) {
        match self
            .store
            .complete(&self.scope, &self.key, &self.token, stored)
            .await
        {
            Ok(true) => {}
            Ok(false) => self.lost("storing its response"),
            // The effect happened; a retry will see the key in flight until the lock expires,
            // then execute again. Logged so an operator can see the window.
            Err(e) => tracing::error!(error = %e, "storing an idempotent response failed"),
        }
    }

    async fn release(&self) {
        match self
            .store
            .release(&self.scope, &self.key, &self.token)
            .await
        {
            Ok(true) => {}
            Ok(false) => self.lost("releasing it"),
            Err(e) => {
                tracing::warn!(error = %e, "releasing an idempotency key after a server error")
            }
        }
    }
}

/// The open database transaction of a request under [`Idempotency::transactional_layer`]: the
/// key's claim is in it, the handler's writes go in it, and the layer stores the response in it
/// and commits, so the effect and the key's completion are one commit.
///
/// Extract it in the handler, [`take`](KeyTransaction::take) the transaction, write in it and
/// [`put it back`](KeyTransaction::put_back) before answering:
///
/// ```no_run
/// use idem_http::KeyTransaction;
/// # async fn award(tx: KeyTransaction<sqlx::Transaction<'static, sqlx::Sqlite>>) -> axum::http::StatusCode {
/// let Some(mut t) = tx.take() else { return axum::http::StatusCode::INTERNAL_SERVER_ERROR };
/// let written = sqlx::query("INSERT INTO awards (points) VALUES (1)").execute(&mut *t).await;
/// tx.put_back(t);
/// if written.is_ok() { axum::http::StatusCode::CREATED } else { axum::http::StatusCode::SERVICE_UNAVAILABLE }
/// # }
/// ```
///
/// A 5xx answer rolls the writes back with the claim (a retry executes again), any other answer
/// commits them with the stored response; a failed commit is answered 503 and a retry replays
/// or executes, never both. A transaction not put back was dropped, and with it the claim and
/// the writes: the layer answers 500 and stores nothing. A handler routed without the
/// transactional layer finds no transaction: the extractor refuses the request (500) before it
/// runs.
pub struct KeyTransaction<T>(Arc<std::sync::Mutex<Option<T>>>);

impl<T> Clone for KeyTransaction<T> {
    fn clone(&self) -> Self {
        KeyTransaction(Arc::clone(&self.0))
    }
}

impl<T> std::fmt::Debug for KeyTransaction<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyTransaction(..)")
    }
}

impl<T: Send + 'static> KeyTransaction<T> {
    fn new(tx: T) -> Self {
        KeyTransaction(Arc::new(std::sync::Mutex::new(Some(tx))))
    }

    /// Takes the transaction for the handler's writes; `None` when it is taken already.
    pub fn take(&self) -> Option<T> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Gives the transaction back, for the layer to store the response in it and commit.
    pub fn put_back(&self, tx: T) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
    }
}

/// Why a handler could not get its [`KeyTransaction`]: the route is not behind
/// [`Idempotency::transactional_layer`] (a server configuration error, answered 500).
#[derive(Debug)]
pub struct NoKeyTransaction;

impl IntoResponse for NoKeyTransaction {
    fn into_response(self) -> Response {
        tracing::error!(
            "a handler asked for a KeyTransaction on a route without Idempotency::transactional_layer"
        );
        problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "No transaction",
            "the route expects the idempotency layer's transaction but is not behind the transactional layer; nothing was executed",
        )
    }
}

impl<T: Send + 'static, St: Send + Sync> axum::extract::FromRequestParts<St> for KeyTransaction<T> {
    type Rejection = NoKeyTransaction;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &St,
    ) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<KeyTransaction<T>>()
            .cloned()
            .ok_or(NoKeyTransaction)
    }
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parts(status: u16) -> axum::http::response::Parts {
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .header("x-request-id", "r-1")
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn a_success_is_stored_and_answered_with_all_its_headers() {
        let Decision::Store {
            stored,
            answer,
            omitted,
        } = decide(parts(201), Ok(Bytes::from_static(b"{}")))
        else {
            panic!("a 201 must be stored");
        };
        assert!(omitted.is_none());
        assert_eq!(stored.body, b"{}");
        assert_eq!(
            stored.headers,
            [("content-type".to_owned(), "application/json".to_owned())]
        );
        assert_eq!(
            answer.headers()["x-request-id"],
            "r-1",
            "the first answer is whole"
        );
    }

    #[test]
    fn a_success_whose_body_failed_is_stored_as_its_status_with_the_marker() {
        let Decision::Store {
            stored,
            answer,
            omitted,
        } = decide(parts(200), Err(axum::Error::new("length limit exceeded")))
        else {
            panic!("a 200 must be stored, never released");
        };
        assert!(omitted.is_some());
        assert_eq!((stored.status, stored.body.len()), (200, 0));
        assert_eq!(
            stored.headers,
            [(IDEMPOTENT_BODY_OMITTED.to_owned(), "true".to_owned())]
        );
        assert_eq!(answer.headers()[IDEMPOTENT_BODY_OMITTED], "true");
        assert!(answer.headers().get(header::CONTENT_TYPE).is_none());
    }

    #[test]
    fn only_a_server_error_releases_the_key() {
        assert!(matches!(
            decide(parts(503), Ok(Bytes::new())),
            Decision::Release(_)
        ));
        assert!(matches!(
            decide(parts(500), Err(axum::Error::new("stream failed"))),
            Decision::Release(_)
        ));
        for status in [200, 201, 301, 404, 409, 422, 429] {
            assert!(
                matches!(
                    decide(parts(status), Ok(Bytes::new())),
                    Decision::Store { .. }
                ),
                "{status}"
            );
        }
    }

    #[test]
    fn the_scope_is_the_client_and_the_credential_only_on_opt_in() {
        let auth = HeaderValue::from_static("Bearer t");
        let client = ClientScope("a".to_owned());
        let src = ScopeSource::ClientScope;
        assert_eq!(scope(Some(&client), Some(&auth), src).unwrap(), "client:a");
        assert!(matches!(
            scope(None, Some(&auth), src),
            Err(IdempotencyRejection::NoScope)
        ));
        assert!(matches!(
            scope(None, None, src),
            Err(IdempotencyRejection::NoClient)
        ));
        let opt_in = ScopeSource::ClientScopeOrCredential;
        assert!(
            scope(None, Some(&auth), opt_in)
                .unwrap()
                .starts_with("credential:")
        );
    }
}
