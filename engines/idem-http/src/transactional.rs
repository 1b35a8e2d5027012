//! The transactional flow: the key's claim, the handler's writes and the stored response in
//! one database transaction of the key store ([`Idempotency::transactional_layer`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_core::idempotency::{ClaimToken, IdempotencyKey, TransactionalKeyStore};
use tower::{Layer, Service};

use crate::decision::{self, Noted};
use crate::layer::{Next, ResponseFuture, prepare, run_handler};
use crate::metrics::Counters;
use crate::rejection::problem;
use crate::{Idempotency, IdempotencyRejection};

impl<S: TransactionalKeyStore> Idempotency<S> {
    /// The tower layer in which the key's claim, the handler's writes and the stored response
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
    pub fn transactional_layer(self) -> TransactionalIdempotencyLayer<S> {
        TransactionalIdempotencyLayer { idem: self }
    }
}

/// The tower [`Layer`] of [`Idempotency::transactional_layer`]: wraps a route in a
/// [`TransactionalIdempotencyService`].
#[derive(Clone, Debug)]
pub struct TransactionalIdempotencyLayer<S> {
    idem: Idempotency<S>,
}

impl<S: Clone, Inner> Layer<Inner> for TransactionalIdempotencyLayer<S> {
    type Service = TransactionalIdempotencyService<S, Inner>;

    fn layer(&self, inner: Inner) -> Self::Service {
        TransactionalIdempotencyService {
            idem: self.idem.clone(),
            inner,
        }
    }
}

/// The tower [`Service`] of [`TransactionalIdempotencyLayer`]: runs `Inner` with the key's
/// [`KeyTransaction`] and commits the response with its writes.
#[derive(Clone, Debug)]
pub struct TransactionalIdempotencyService<S, Inner> {
    idem: Idempotency<S>,
    inner: Inner,
}

impl<S, Inner> Service<Request> for TransactionalIdempotencyService<S, Inner>
where
    S: TransactionalKeyStore,
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
        Box::pin(async move { Ok(handle_transactional(idem, req, next).await) })
    }
}

async fn handle_transactional<S: TransactionalKeyStore>(
    idem: Idempotency<S>,
    req: Request,
    next: Next,
) -> Response {
    let counters = idem.counters.clone();
    match run_transactional(idem, req, next).await {
        Ok(resp) => resp,
        Err(rejection) => counters.reject(rejection),
    }
}

/// A claim held in an open transaction ([`Idempotency::transactional_layer`]).
struct TxHeld<S> {
    store: S,
    scope: String,
    key: IdempotencyKey,
    token: ClaimToken,
    max_body: usize,
    counters: Counters,
}

async fn run_transactional<S: TransactionalKeyStore>(
    idem: Idempotency<S>,
    req: Request,
    next: Next,
) -> Result<Response, IdempotencyRejection> {
    let mut p = prepare(&idem.config, req).await?;
    let c = &idem.config;
    let claim = idem
        .store
        .claim_in_transaction(&p.scope, &p.key, &p.fingerprint, c.lock, c.retention)
        .await
        .map_err(IdempotencyRejection::Store)?;
    let (tx, token) = match decision::claimed_in_transaction(claim) {
        Ok(held) => held,
        Err(refused) => return refused.answer(&idem.counters),
    };
    let slot = KeyTransaction::new(tx);
    p.parts.extensions.insert(slot.clone());
    let held = TxHeld {
        store: idem.store.clone(),
        scope: p.scope,
        key: p.key,
        token,
        max_body: c.max_body,
        counters: idem.counters.clone(),
    };
    // Its own task, as in the plain layer: a client that disconnects does not cancel the
    // commit. A panic drops the task and every handle of the transaction with it: it rolls back.
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
    match decision::decide(parts, body).noted(&held.counters) {
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
                    held.counters.claim_lost();
                    held.counters.reject(IdempotencyRejection::ClaimNotHeld)
                }
                Err(e) => held.counters.reject(IdempotencyRejection::NotCommitted(e)),
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
