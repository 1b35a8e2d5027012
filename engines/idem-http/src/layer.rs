//! The layer's state ([`Idempotency`]), its tower [`Layer`] and [`Service`], and the flow of a
//! request through them: prepare, claim, run the route in its own task while renewing the
//! claim, then store or release.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::idempotency::{IdempotencyKey, IdempotencyStore};
use prometheus::Registry;
use tower::{Layer, Service};

use crate::decision::{self, Noted};
use crate::metrics::Counters;
use crate::renewal::Held;
use crate::{ClientScope, HttpMetrics, IdempotencyConfig, IdempotencyRejection, LayerStats};

/// The layer's state: a key store, settings and where it counts.
#[derive(Clone, Debug)]
pub struct Idempotency<S> {
    pub(crate) store: S,
    pub(crate) config: IdempotencyConfig,
    pub(crate) counters: Counters,
}

impl<S: IdempotencyStore> Idempotency<S> {
    /// Keys in `store`, with `config`. It counts into its [`LayerStats`]; give it a registry
    /// ([`Idempotency::registry`]) to export [`HttpMetrics`] too.
    pub fn new(store: S, config: IdempotencyConfig) -> Self {
        Idempotency {
            store,
            config,
            counters: Counters::default(),
        }
    }

    /// Creates the layer's [`HttpMetrics`] and registers them in `registry`. Fails when the
    /// registry holds them already: layers of one process share one set with
    /// [`Idempotency::shared_metrics`].
    pub fn registry(self, registry: &Registry) -> idem_core::Result<Self> {
        Ok(self.shared_metrics(HttpMetrics::new(registry)?))
    }

    /// Counts into `metrics`, created (and registered) by the caller, for instance shared by the
    /// plain and the transactional layer of one service.
    pub fn shared_metrics(mut self, metrics: HttpMetrics) -> Self {
        self.counters.metrics = Some(metrics);
        self
    }

    /// The layer's Prometheus metrics, when it has them.
    pub fn metrics(&self) -> Option<&HttpMetrics> {
        self.counters.metrics.as_ref()
    }

    /// The layer's counters (shared by every clone and by the layer).
    pub fn stats(&self) -> Arc<LayerStats> {
        Arc::clone(&self.counters.stats)
    }

    /// The tower layer; apply it with `Router::route_layer` to the routes that require a key,
    /// inside the authentication layer that sets [`ClientScope`].
    pub fn layer(self) -> IdempotencyLayer<S> {
        IdempotencyLayer { idem: self }
    }
}

/// The tower [`Layer`] of [`Idempotency::layer`]: wraps a route in an [`IdempotencyService`].
#[derive(Clone, Debug)]
pub struct IdempotencyLayer<S> {
    idem: Idempotency<S>,
}

impl<S: Clone, Inner> Layer<Inner> for IdempotencyLayer<S> {
    type Service = IdempotencyService<S, Inner>;

    fn layer(&self, inner: Inner) -> Self::Service {
        IdempotencyService {
            idem: self.idem.clone(),
            inner,
        }
    }
}

/// The future of the layers' services: the answer, never an error.
pub type ResponseFuture = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

/// The tower [`Service`] of [`IdempotencyLayer`]: executes a keyed request once through
/// `Inner` and replays its response to retries.
#[derive(Clone, Debug)]
pub struct IdempotencyService<S, Inner> {
    idem: Idempotency<S>,
    inner: Inner,
}

impl<S, Inner> Service<Request> for IdempotencyService<S, Inner>
where
    S: IdempotencyStore,
    Inner: Service<Request, Error = Infallible> + Clone + Send + 'static,
    Inner::Response: IntoResponse,
    Inner::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> ResponseFuture {
        let next = Next::ready(&mut self.inner);
        let idem = self.idem.clone();
        Box::pin(async move { Ok(handle(idem, req, next).await) })
    }
}

/// The boxed answer of the route.
type RouteFuture = Pin<Box<dyn Future<Output = Response> + Send>>;

/// The rest of the stack (the route), ready for one request.
pub(crate) struct Next(Box<dyn FnOnce(Request) -> RouteFuture + Send>);

impl Next {
    /// Takes the inner service that `poll_ready` readied, leaving a clone in its place.
    pub(crate) fn ready<Inner>(inner: &mut Inner) -> Self
    where
        Inner: Service<Request, Error = Infallible> + Clone + Send + 'static,
        Inner::Response: IntoResponse,
        Inner::Future: Send + 'static,
    {
        let clone = inner.clone();
        let mut ready = std::mem::replace(inner, clone);
        Next(Box::new(move |req| {
            let answer = ready.call(req);
            Box::pin(async move {
                match answer.await {
                    Ok(resp) => resp.into_response(),
                    Err(never) => match never {},
                }
            })
        }))
    }

    /// Runs the route on `req`.
    pub(crate) async fn run(self, req: Request) -> Response {
        (self.0)(req).await
    }
}

/// What the layer reads from a request before it claims the key.
pub(crate) struct Prepared {
    pub(crate) key: IdempotencyKey,
    pub(crate) scope: String,
    pub(crate) parts: axum::http::request::Parts,
    pub(crate) bytes: Bytes,
    pub(crate) fingerprint: String,
}

/// The key, its scope, the buffered body and the fingerprint of `req`.
pub(crate) async fn prepare(
    config: &IdempotencyConfig,
    req: Request,
) -> Result<Prepared, IdempotencyRejection> {
    let key = decision::key_of(req.headers())?;
    let scope = decision::scope(
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
    let fingerprint = decision::fingerprint(parts.method.as_str(), &uri, &bytes);
    Ok(Prepared {
        key,
        scope,
        parts,
        bytes,
        fingerprint,
    })
}

/// Runs the route on the buffered request; its response head and buffered body.
pub(crate) async fn run_handler(
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

async fn handle<S: IdempotencyStore>(idem: Idempotency<S>, req: Request, next: Next) -> Response {
    let counters = idem.counters.clone();
    match run(idem, req, next).await {
        Ok(resp) => resp,
        Err(rejection) => counters.reject(rejection),
    }
}

async fn run<S: IdempotencyStore>(
    idem: Idempotency<S>,
    req: Request,
    next: Next,
) -> Result<Response, IdempotencyRejection> {
    let p = prepare(&idem.config, req).await?;
    let c = &idem.config;
    let claim = idem
        .store
        .claim(&p.scope, &p.key, &p.fingerprint, c.lock, c.retention)
        .await
        .map_err(IdempotencyRejection::Store)?;
    let token = match decision::claimed(claim) {
        Ok(token) => token,
        Err(refused) => return refused.answer(&idem.counters),
    };
    let held = Arc::new(Held {
        store: idem.store.clone(),
        scope: p.scope,
        key: p.key,
        token,
        config: idem.config.clone(),
        counters: idem.counters.clone(),
        lost: AtomicBool::new(false),
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

async fn execute<S: IdempotencyStore>(
    held: Arc<Held<S>>,
    next: Next,
    parts: axum::http::request::Parts,
    bytes: Bytes,
) -> Response {
    let work = run_handler(next, parts, bytes, held.config.max_body);
    let (parts, body) = held.while_renewing(work).await;
    match decision::decide(parts, body).noted(&held.counters) {
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
