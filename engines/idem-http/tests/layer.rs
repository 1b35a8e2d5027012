//! The Idempotency-Key layer over real key stores (SQLite, and PostgreSQL for concurrency).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use idem_conformance::backend::{Backend, Lite, Pg};
use idem_core::idempotency::IdempotencyStore;
use idem_http::{
    ClientScope, Idempotency, IdempotencyConfig, IdempotencyLayer, ScopeSource,
    TransactionalIdempotencyLayer,
};
use idem_sql::sqlite::SqliteKeyStore;
use prometheus::Registry;
use tokio::sync::Semaphore;
use tower::ServiceExt;

#[derive(Clone)]
struct App {
    /// Executions started (counted on entry, before the gate).
    entered: Arc<tokio::sync::watch::Sender<u64>>,
    executions: Arc<AtomicU64>,
    /// Executions running now, and the most ever running at once.
    running: Arc<AtomicU64>,
    max_running: Arc<AtomicU64>,
    /// Each execution takes one permit: tests hold requests in flight by withholding permits.
    gate: Arc<Semaphore>,
    /// The first execution answers 503 (a failure a retry may fix).
    fail_first: bool,
}

impl App {
    /// Waits until `n` executions have started.
    async fn entered(&self, n: u64) {
        let mut rx = self.entered.subscribe();
        rx.wait_for(|e| *e >= n).await.unwrap();
    }
}

const BIG: usize = 4096;

async fn award(State(app): State<App>, body: String) -> impl IntoResponse {
    let n = app.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let now = app.running.fetch_add(1, Ordering::SeqCst) + 1;
    app.max_running.fetch_max(now, Ordering::SeqCst);
    app.entered.send_modify(|e| *e += 1);
    let permit = app.gate.acquire().await.unwrap();
    drop(permit);
    app.running.fetch_sub(1, Ordering::SeqCst);
    if body.contains("fail") || (app.fail_first && n == 1) {
        return (StatusCode::SERVICE_UNAVAILABLE, "try later".to_owned());
    }
    if body.contains("big") {
        return (StatusCode::CREATED, "x".repeat(BIG));
    }
    (
        StatusCode::CREATED,
        format!(r#"{{"award":{n},"request":{body}}}"#),
    )
}

/// The authentication layer of the test service: `Authorization: Bearer <client>.<secret>`
/// identifies `<client>` (so a refreshed secret is the same client).
async fn authenticate(
    mut req: Request<Body>,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let client = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.split('.').next().unwrap_or(t).to_owned());
    if let Some(c) = client {
        req.extensions_mut().insert(ClientScope(c));
    }
    next.run(req).await
}

fn new_app(permits: usize, fail_first: bool) -> App {
    App {
        entered: Arc::new(tokio::sync::watch::Sender::new(0)),
        executions: Arc::new(AtomicU64::new(0)),
        running: Arc::new(AtomicU64::new(0)),
        max_running: Arc::new(AtomicU64::new(0)),
        gate: Arc::new(Semaphore::new(permits)),
        fail_first,
    }
}

/// The route behind the layer, without an authentication layer.
fn bare_app<S: IdempotencyStore>(store: S, state: App, config: IdempotencyConfig) -> Router {
    Router::new()
        .route("/awards", post(award))
        .route_layer(Idempotency::new(store, config).layer())
        .with_state(state)
}

fn app_with<S: IdempotencyStore>(store: S, state: App, config: IdempotencyConfig) -> (Router, App) {
    let router =
        bare_app(store, state.clone(), config).route_layer(axum::middleware::from_fn(authenticate));
    (router, state)
}

/// The route behind `layer`, inside the authentication layer.
fn app_with_layer<S: IdempotencyStore>(layer: Idempotency<S>, state: App) -> (Router, App) {
    let router = Router::new()
        .route("/awards", post(award))
        .route_layer(layer.layer())
        .with_state(state.clone())
        .route_layer(axum::middleware::from_fn(authenticate));
    (router, state)
}

fn app<S: IdempotencyStore>(store: S, permits: usize) -> (Router, App) {
    app_with(store, new_app(permits, false), IdempotencyConfig::default())
}

fn req(client: &str, keys: &[&str], body: &str) -> Request<Body> {
    let mut b = Request::post("/awards").header("authorization", format!("Bearer {client}"));
    for k in keys {
        b = b.header("idempotency-key", *k);
    }
    b.body(Body::from(body.to_owned())).unwrap()
}

async fn call(router: &Router, r: Request<Body>) -> (StatusCode, Option<String>, String) {
    let resp = router.clone().oneshot(r).await.unwrap();
    let status = resp.status();
    let replayed = resp
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (
        status,
        replayed,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

#[tokio::test]
async fn a_retry_after_a_lost_response_gets_the_replay_and_one_execution() {
    let lite = Lite::new().await;
    let (router, app) = app(lite.keys(), 100);
    let first = call(&router, req("a", &["\"k1\""], r#"{"points":10}"#)).await;
    // The client never saw `first` (timeout): it retries with the same key.
    let retry = call(&router, req("a", &["\"k1\""], r#"{"points":10}"#)).await;
    assert_eq!((first.0, first.1.as_deref()), (StatusCode::CREATED, None));
    assert_eq!(
        (retry.0, retry.1.as_deref()),
        (StatusCode::CREATED, Some("true"))
    );
    assert_eq!(retry.2, first.2, "the stored body is replayed");
    assert_eq!(app.executions.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_same_key_with_another_body_is_422_and_not_executed() {
    let lite = Lite::new().await;
    let (router, app) = app(lite.keys(), 100);
    call(&router, req("a", &["\"k1\""], r#"{"points":10}"#)).await;
    let (status, _, body) = call(&router, req("a", &["\"k1\""], r#"{"points":99}"#)).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(body.contains("different request"), "{body}");
    assert_eq!(app.executions.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn another_client_with_the_same_key_executes_independently() {
    let lite = Lite::new().await;
    let (router, app) = app(lite.keys(), 100);
    let a = call(
        &router,
        req("client-a", &["\"shared\""], r#"{"points":10}"#),
    )
    .await;
    let b = call(
        &router,
        req("client-b", &["\"shared\""], r#"{"points":10}"#),
    )
    .await;
    assert_eq!(
        (b.0, b.1.as_deref()),
        (StatusCode::CREATED, None),
        "B's request executed, not replayed"
    );
    assert_ne!(a.2, b.2, "B never receives A's stored response");
    assert_eq!(app.executions.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn bad_keys_are_400_with_a_clear_message() {
    let lite = Lite::new().await;
    let (router, app) = app(lite.keys(), 100);
    let long = format!("\"{}\"", "k".repeat(300));
    let cases: [(&[&str], &str); 5] = [
        (&[], "required"),
        (&["\"\""], "empty"),
        (&[long.as_str()], "limit is 255"),
        (&["\"a\tb\""], "printable ASCII"),
        (&["\"a\"", "\"b\""], "exactly once"),
    ];
    for (keys, want) in cases {
        let (status, _, body) = call(&router, req("a", keys, "{}")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{keys:?}");
        assert!(
            body.contains(want) && body.contains("\"status\":400"),
            "{keys:?}: {body}"
        );
    }
    let unquoted = call(&router, req("a", &["plain-token"], "{}")).await;
    assert_eq!(unquoted.0, StatusCode::BAD_REQUEST);
    let anonymous = Request::post("/awards")
        .header("idempotency-key", "\"k\"")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(call(&router, anonymous).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(app.executions.load(Ordering::SeqCst), 0, "nothing executed");
}

#[tokio::test]
async fn a_server_error_is_not_stored_so_the_retry_executes() {
    let lite = Lite::new().await;
    let (router, app) = app(lite.keys(), 100);
    assert_eq!(
        call(&router, req("a", &["\"k\""], r#"{"fail":1}"#)).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        call(&router, req("a", &["\"k\""], r#"{"fail":1}"#)).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(app.executions.load(Ordering::SeqCst), 2);
}

async fn ten_concurrent_requests_with_one_key_execute_once<B: Backend>(b: &B) {
    let (router, app) = app(b.keys(), 0);
    let mut tasks = vec![];
    for _ in 0..10 {
        let router = router.clone();
        tasks.push(tokio::spawn(async move {
            call(&router, req("a", &["\"k\""], r#"{"points":5}"#)).await
        }));
    }
    // Nine answer 409 while the tenth waits at the gate inside the handler.
    let mut conflicts = 0;
    let mut pending = vec![];
    for t in tasks {
        pending.push(t);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while conflicts < 9 {
        assert!(
            std::time::Instant::now() < deadline,
            "only {conflicts} conflicts"
        );
        let (done, rest): (Vec<_>, Vec<_>) = pending.into_iter().partition(|t| t.is_finished());
        pending = rest;
        for t in done {
            let (status, _, body) = t.await.unwrap();
            assert_eq!(status, StatusCode::CONFLICT, "{body}");
            conflicts += 1;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(pending.len(), 1);
    app.gate.add_permits(1);
    let (status, replayed, _) = pending.pop().unwrap().await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, None));
    let again = call(&router, req("a", &["\"k\""], r#"{"points":5}"#)).await;
    assert_eq!(
        (again.0, again.1.as_deref()),
        (StatusCode::CREATED, Some("true"))
    );
    assert_eq!(app.executions.load(Ordering::SeqCst), 1, "one execution");
}

// ---- a request slower than the key's lock -------------------------------------------------------

const LOCK: Duration = Duration::from_millis(300);

fn slow_config() -> IdempotencyConfig {
    IdempotencyConfig {
        lock: LOCK,
        ..IdempotencyConfig::default()
    }
}

/// A's handler is held past the lock; retry B arrives. Returns B's answer, or `None` when B
/// entered the handler (a takeover of a live request).
async fn retry_while_a_runs_past_its_lock(
    router: &Router,
    app: &App,
    body: &'static str,
) -> (
    tokio::task::JoinHandle<(StatusCode, Option<String>, String)>,
    Option<StatusCode>,
) {
    let r = router.clone();
    let a = tokio::spawn(async move { call(&r, req("a", &["\"k\""], body)).await });
    app.entered(1).await;
    // Time has to pass here: A's handler outlives its lock (what is under test; it
    // synchronises nothing).
    tokio::time::sleep(LOCK * 3).await;
    let r = router.clone();
    let b = tokio::spawn(async move { call(&r, req("a", &["\"k\""], body)).await });
    let b_answer = tokio::select! {
        got = b => Some(got.unwrap().0),
        () = app.entered(2) => None,
    };
    (a, b_answer)
}

async fn a_slow_request_that_completes_is_executed_once<B: Backend>(b: &B) {
    let (router, app) = app_with(b.keys(), new_app(0, false), slow_config());
    let body = r#"{"points":5}"#;
    let (a, b) = retry_while_a_runs_past_its_lock(&router, &app, body).await;
    app.gate.add_permits(1);
    let a = a.await.unwrap();
    app.gate.add_permits(10);
    let c = call(&router, req("a", &["\"k\""], body)).await;
    assert_eq!(app.executions.load(Ordering::SeqCst), 1, "one execution");
    assert_eq!(
        b,
        Some(StatusCode::CONFLICT),
        "the retry must get 409 while A runs, not take the key over"
    );
    assert_eq!((a.0, a.1.as_deref()), (StatusCode::CREATED, None));
    assert_eq!(
        (c.0, c.1.as_deref(), c.2),
        (StatusCode::CREATED, Some("true"), a.2)
    );
}

async fn a_slow_request_that_fails_never_runs_beside_a_retry<B: Backend>(b: &B) {
    let (router, app) = app_with(b.keys(), new_app(0, true), slow_config());
    let body = r#"{"points":5}"#;
    let (a, b) = retry_while_a_runs_past_its_lock(&router, &app, body).await;
    app.gate.add_permits(1);
    assert_eq!(a.await.unwrap().0, StatusCode::SERVICE_UNAVAILABLE);
    // A released its key (503): retry C executes, and must be the only execution running.
    let r = router.clone();
    let c = tokio::spawn(async move { call(&r, req("a", &["\"k\""], body)).await });
    let entered = if b.is_some() { 2 } else { 3 };
    app.entered(entered).await;
    app.gate.add_permits(10);
    assert_eq!(c.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(
        (
            app.max_running.load(Ordering::SeqCst),
            app.executions.load(Ordering::SeqCst)
        ),
        (1, 2),
        "(most executions of one key at once, executions): A (failed, released), then C"
    );
    assert_eq!(b, Some(StatusCode::CONFLICT), "B was refused while A ran");
}

// ---- a response larger than the layer stores ----------------------------------------------------

async fn an_oversized_success_is_replayed_not_executed_again<B: Backend>(b: &B) {
    let config = IdempotencyConfig {
        max_body: BIG / 4,
        ..IdempotencyConfig::default()
    };
    let (router, app) = app_with(b.keys(), new_app(100, false), config);
    let first = call(&router, req("a", &["\"k\""], r#"{"big":1}"#)).await;
    let retry = call(&router, req("a", &["\"k\""], r#"{"big":1}"#)).await;
    assert_eq!(
        app.executions.load(Ordering::SeqCst),
        1,
        "the retry of a request whose effect happened must not execute again"
    );
    assert_eq!(
        first.0,
        StatusCode::CREATED,
        "the handler's status, not 500"
    );
    assert_eq!(
        (retry.0, retry.1.as_deref()),
        (StatusCode::CREATED, Some("true"))
    );
    assert_eq!(
        (first.2.as_str(), retry.2.as_str()),
        ("", ""),
        "the body is not stored"
    );
    let again = router
        .clone()
        .oneshot(req("a", &["\"k\""], r#"{"big":1}"#))
        .await
        .unwrap();
    assert_eq!(
        again
            .headers()
            .get("idempotent-body-omitted")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "the replay says why its body is empty"
    );
}

// ---- the key's scope ----------------------------------------------------------------------------

#[tokio::test]
async fn without_a_client_scope_the_request_is_refused_not_scoped_by_credential() {
    let lite = Lite::new().await;
    let state = new_app(100, false);
    let router = bare_app(lite.keys(), state.clone(), IdempotencyConfig::default());
    let (status, _, body) = call(&router, req("a.secret-1", &["\"k\""], "{}")).await;
    assert_eq!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "no authentication layer set a ClientScope: {body}"
    );
    assert!(body.contains("ClientScope"), "{body}");
    assert_eq!(
        state.executions.load(Ordering::SeqCst),
        0,
        "nothing executed"
    );
}

#[tokio::test]
async fn a_retry_after_a_token_refresh_is_replayed_for_the_same_client() {
    let lite = Lite::new().await;
    let (router, app) = app(lite.keys(), 100);
    let first = call(&router, req("a.secret-1", &["\"k\""], "{}")).await;
    let retry = call(&router, req("a.secret-2", &["\"k\""], "{}")).await;
    assert_eq!(
        (retry.0, retry.1.as_deref(), retry.2),
        (first.0, Some("true"), first.2)
    );
    assert_eq!(app.executions.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn scoping_by_credential_is_opt_in_and_per_credential() {
    let lite = Lite::new().await;
    let state = new_app(100, false);
    let config = IdempotencyConfig {
        scope: ScopeSource::ClientScopeOrCredential,
        ..IdempotencyConfig::default()
    };
    let router = bare_app(lite.keys(), state.clone(), config);
    let first = call(&router, req("a.secret-1", &["\"k\""], "{}")).await;
    let retry = call(&router, req("a.secret-1", &["\"k\""], "{}")).await;
    let refreshed = call(&router, req("a.secret-2", &["\"k\""], "{}")).await;
    assert_eq!(
        (first.0, retry.1.as_deref()),
        (StatusCode::CREATED, Some("true"))
    );
    assert_eq!(
        (refreshed.0, refreshed.1.as_deref()),
        (StatusCode::CREATED, None),
        "another credential is another scope: documented, and why this is opt-in"
    );
    assert_eq!(state.executions.load(Ordering::SeqCst), 2);
    let anonymous = Request::post("/awards")
        .header("idempotency-key", "\"k\"")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(call(&router, anonymous).await.0, StatusCode::UNAUTHORIZED);
}

/// Runs one request under `layer` whose claim is taken from it while its handler runs (another
/// token written over it, as a retry's takeover would); returns its status and the router.
async fn lose_the_claim<B: Backend>(b: &B, layer: Idempotency<B::Keys>) -> (StatusCode, Router) {
    let state = new_app(0, false);
    let router = Router::new()
        .route("/awards", post(award))
        .route_layer(layer.layer())
        .with_state(state.clone())
        .route_layer(axum::middleware::from_fn(authenticate));
    let r = router.clone();
    let a = tokio::spawn(async move { call(&r, req("a", &["\"k\""], "{}")).await });
    state.entered(1).await;
    let taken = b
        .exec("UPDATE idem_idempotency_keys SET claim_token = 'another-request'")
        .await
        .unwrap();
    assert_eq!(taken, 1);
    state.gate.add_permits(10);
    (a.await.unwrap().0, router)
}

/// A request whose claim was taken from it (here: another token written over it, as a retry's
/// takeover would) stores nothing over the new claim, and the layer counts the loss.
async fn a_request_that_lost_its_claim_changes_nothing_and_is_counted<B: Backend>(b: &B) {
    let layer = Idempotency::new(b.keys(), IdempotencyConfig::default());
    let stats = layer.stats();
    let (status, router) = lose_the_claim(b, layer).await;
    assert_eq!(status, StatusCode::CREATED, "A's own answer");
    assert_eq!(
        stats.claims_lost.load(Ordering::SeqCst),
        1,
        "the loss is counted"
    );
    let retry = call(&router, req("a", &["\"k\""], "{}")).await;
    assert_eq!(
        retry.0,
        StatusCode::CONFLICT,
        "the other request's claim is still in flight, not overwritten by A's response"
    );
}

/// The loss of a claim is exported as `idem_http_claims_lost_total`, once, beside the stats.
async fn a_lost_claim_is_exported_as_a_metric<B: Backend>(b: &B) {
    let registry = Registry::new();
    let layer = Idempotency::new(b.keys(), IdempotencyConfig::default())
        .registry(&registry)
        .unwrap();
    let stats = layer.stats();
    let (status, _) = lose_the_claim(b, layer).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(counted(&registry, "idem_http_claims_lost_total", None), 1.0);
    assert_eq!(stats.claims_lost.load(Ordering::SeqCst), 1);
    assert_eq!(counted(&registry, "idem_http_replays_total", None), 0.0);
}

/// The value of counter `name` in `registry` (of its series with `reason`, when given).
fn counted(registry: &Registry, name: &str, reason: Option<&str>) -> f64 {
    let families = registry.gather();
    let family = families
        .iter()
        .find(|f| f.name() == name)
        .unwrap_or_else(|| panic!("{name} is not registered"));
    family
        .get_metric()
        .iter()
        .find(|m| reason.is_none_or(|r| m.get_label().iter().any(|l| l.value() == r)))
        .unwrap_or_else(|| panic!("{name} has no series {reason:?}"))
        .get_counter()
        .get_value()
}

/// Replays, 409s, other rejections and an omitted body, each counted under its own name.
async fn the_metrics_count_what_the_layer_answered<B: Backend>(b: &B) {
    let registry = Registry::new();
    let config = IdempotencyConfig {
        max_body: BIG / 4,
        ..IdempotencyConfig::default()
    };
    let layer = Idempotency::new(b.keys(), config)
        .registry(&registry)
        .unwrap();
    let (router, app) = app_with_layer(layer, new_app(0, false));
    let body = r#"{"points":5}"#;
    let r = router.clone();
    let a = tokio::spawn(async move { call(&r, req("a", &["\"k\""], body)).await });
    app.entered(1).await;
    let conflict = call(&router, req("a", &["\"k\""], body)).await;
    app.gate.add_permits(100);
    assert_eq!(
        (conflict.0, a.await.unwrap().0),
        (StatusCode::CONFLICT, StatusCode::CREATED)
    );
    let replay = call(&router, req("a", &["\"k\""], body)).await;
    assert_eq!(replay.1.as_deref(), Some("true"));
    let mismatch = call(&router, req("a", &["\"k\""], r#"{"points":6}"#)).await;
    let missing = call(&router, req("a", &[], body)).await;
    assert_eq!(
        (mismatch.0, missing.0),
        (StatusCode::UNPROCESSABLE_ENTITY, StatusCode::BAD_REQUEST)
    );
    let big = call(&router, req("a", &["\"big\""], r#"{"big":1}"#)).await;
    assert_eq!((big.0, big.2.as_str()), (StatusCode::CREATED, ""));
    let expected = [
        ("idem_http_replays_total", None, 1.0),
        ("idem_http_conflicts_total", None, 1.0),
        ("idem_http_bodies_omitted_total", None, 1.0),
        ("idem_http_claims_lost_total", None, 0.0),
        ("idem_http_renewal_failures_total", None, 0.0),
        ("idem_http_rejections_total", Some("in_flight"), 1.0),
        ("idem_http_rejections_total", Some("mismatch"), 1.0),
        ("idem_http_rejections_total", Some("bad_key"), 1.0),
        ("idem_http_rejections_total", Some("store"), 0.0),
    ];
    for (name, reason, want) in expected {
        assert_eq!(counted(&registry, name, reason), want, "{name} {reason:?}");
    }
}

/// One test per key store (SQLite, PostgreSQL) for each scenario `f(&backend)`.
macro_rules! on_both_stores {
    ($($sqlite:ident, $postgres:ident => $scenario:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $sqlite() {
            $scenario(&Lite::new().await).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $postgres() {
            $scenario(&Pg::new().await).await;
        }
    )*};
}

on_both_stores! {
    ten_concurrent_requests_execute_once_on_sqlite, ten_concurrent_requests_execute_once_on_postgres => ten_concurrent_requests_with_one_key_execute_once;
    a_request_slower_than_the_lock_is_not_taken_over_on_sqlite, a_request_slower_than_the_lock_is_not_taken_over_on_postgres => a_slow_request_that_completes_is_executed_once;
    a_slow_failure_never_releases_a_retry_s_claim_on_sqlite, a_slow_failure_never_releases_a_retry_s_claim_on_postgres => a_slow_request_that_fails_never_runs_beside_a_retry;
    a_lost_claim_changes_nothing_and_is_counted_on_sqlite, a_lost_claim_changes_nothing_and_is_counted_on_postgres => a_request_that_lost_its_claim_changes_nothing_and_is_counted;
    a_lost_claim_is_exported_on_sqlite, a_lost_claim_is_exported_on_postgres => a_lost_claim_is_exported_as_a_metric;
    the_metrics_count_what_the_layer_answered_on_sqlite, the_metrics_count_what_the_layer_answered_on_postgres => the_metrics_count_what_the_layer_answered;
    an_oversized_success_is_replayed_on_sqlite, an_oversized_success_is_replayed_on_postgres => an_oversized_success_is_replayed_not_executed_again;
}

/// A renewal that fails (the key store's table is gone for a while) is counted and tried again;
/// the request is not interrupted, keeps its claim and stores its response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_renewal_is_counted_and_the_request_completes_on_sqlite() {
    let lite = Lite::new().await;
    let registry = Registry::new();
    let layer = Idempotency::new(lite.keys(), slow_config())
        .registry(&registry)
        .unwrap();
    let stats = layer.stats();
    let (router, app) = app_with_layer(layer, new_app(0, false));
    let r = router.clone();
    let a = tokio::spawn(async move { call(&r, req("a", &["\"k\""], "{}")).await });
    app.entered(1).await;
    lite.exec("ALTER TABLE idem_idempotency_keys RENAME TO idem_keys_away")
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while stats.renewal_failures.load(Ordering::SeqCst) == 0 {
        assert!(std::time::Instant::now() < deadline, "no renewal failed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    lite.exec("ALTER TABLE idem_keys_away RENAME TO idem_idempotency_keys")
        .await
        .unwrap();
    app.gate.add_permits(10);
    let first = a.await.unwrap();
    let retry = call(&router, req("a", &["\"k\""], "{}")).await;
    assert_eq!((first.0, first.1.as_deref()), (StatusCode::CREATED, None));
    assert_eq!(
        (retry.0, retry.1.as_deref(), retry.2),
        (StatusCode::CREATED, Some("true"), first.2),
        "the claim survived the failed renewal and its response was stored"
    );
    let failures = stats.renewal_failures.load(Ordering::SeqCst);
    assert_eq!(
        counted(&registry, "idem_http_renewal_failures_total", None),
        f64::from(u32::try_from(failures).unwrap())
    );
    assert_eq!(counted(&registry, "idem_http_claims_lost_total", None), 0.0);
    assert_eq!(app.executions.load(Ordering::SeqCst), 1);
}

// ---- the layers are named tower layers ----------------------------------------------------------

/// A service can name the layer it applies.
fn named_layer(keys: SqliteKeyStore, registry: &Registry) -> IdempotencyLayer<SqliteKeyStore> {
    Idempotency::new(keys, IdempotencyConfig::default())
        .registry(registry)
        .unwrap()
        .layer()
}

/// A service can name the transactional layer it applies.
fn named_transactional_layer(
    keys: SqliteKeyStore,
    registry: &Registry,
) -> TransactionalIdempotencyLayer<SqliteKeyStore> {
    Idempotency::new(keys, IdempotencyConfig::default())
        .registry(registry)
        .unwrap()
        .transactional_layer()
}

#[tokio::test]
async fn the_named_layer_wraps_routes_with_route_layer() {
    let lite = Lite::new().await;
    let registry = Registry::new();
    let state = new_app(100, false);
    let router: Router = Router::new()
        .route("/awards", post(award))
        .route_layer(named_layer(lite.keys(), &registry))
        .with_state(state.clone())
        .route_layer(axum::middleware::from_fn(authenticate));
    let first = call(&router, req("a", &["\"n\""], "{}")).await;
    let retry = call(&router, req("a", &["\"n\""], "{}")).await;
    assert_eq!(
        (retry.0, retry.1.as_deref(), retry.2),
        (first.0, Some("true"), first.2)
    );
    assert_eq!(state.executions.load(Ordering::SeqCst), 1);
    assert_eq!(counted(&registry, "idem_http_replays_total", None), 1.0);
}

#[tokio::test]
async fn the_named_layer_wraps_any_tower_service_that_answers() {
    use tower::Layer as _;
    let lite = Lite::new().await;
    let executions = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&executions);
    let inner = tower::service_fn(move |_req: axum::extract::Request| {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move { Ok::<_, std::convert::Infallible>((StatusCode::CREATED, format!("{n}"))) }
    });
    let service = named_layer(lite.keys(), &Registry::new()).layer(inner);
    let keyed = || {
        let mut r = req("a", &["\"s\""], "{}");
        r.extensions_mut().insert(ClientScope("a".to_owned()));
        r
    };
    let first = service.clone().oneshot(keyed()).await.unwrap();
    let retry = service.clone().oneshot(keyed()).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

// ---- the transactional layer: claim, handler's writes and response in one transaction -----------

use idem_http::KeyTransaction;

#[derive(Clone, Default)]
struct TxApp {
    /// The first execution panics after its write (a fault between the award and the key's
    /// completion).
    panic_first: Arc<std::sync::atomic::AtomicBool>,
    /// The first execution answers 503 after its write.
    fail_first: Arc<std::sync::atomic::AtomicBool>,
    /// Set: every execution signals here after its write and never answers (a server killed
    /// between the award and the completion).
    hold: Option<Arc<std::sync::Mutex<std::sync::mpsc::Sender<()>>>>,
}

/// A transactional award handler over database `$db`: writes one `tx_awards` row in the layer's
/// transaction, then does what the [`TxApp`] says.
macro_rules! tx_award {
    ($name:ident, $db:ty) => {
        async fn $name(
            tx: KeyTransaction<sqlx::Transaction<'static, $db>>,
            State(app): State<TxApp>,
            body: String,
        ) -> (StatusCode, String) {
            let mut t = tx.take().unwrap();
            sqlx::query("INSERT INTO tx_awards (body) VALUES ($1)")
                .bind(body.clone())
                .execute(&mut *t)
                .await
                .unwrap();
            if app.panic_first.swap(false, Ordering::SeqCst) {
                panic!("the server fails between the award and the key's completion");
            }
            tx.put_back(t);
            if let Some(hold) = &app.hold {
                hold.lock().unwrap().send(()).unwrap();
                std::future::pending::<()>().await;
            }
            if app.fail_first.swap(false, Ordering::SeqCst) {
                return (StatusCode::SERVICE_UNAVAILABLE, "try later".to_owned());
            }
            (StatusCode::CREATED, format!(r#"{{"awarded":{body}}}"#))
        }
    };
}
tx_award!(tx_award_sqlite, sqlx::Sqlite);
tx_award!(tx_award_postgres, sqlx::Postgres);

fn tx_router<S: idem_core::idempotency::TransactionalKeyStore, H, T>(
    keys: S,
    handler: H,
    app: TxApp,
) -> Router
where
    H: axum::handler::Handler<T, TxApp>,
    T: 'static,
{
    Router::new()
        .route("/awards", post(handler))
        .route_layer(Idempotency::new(keys, IdempotencyConfig::default()).transactional_layer())
        .route_layer(axum::middleware::from_fn(authenticate))
        .with_state(app)
}

async fn tx_awards<B: Backend>(b: &B) -> i64 {
    b.scalar("SELECT count(*) FROM tx_awards").await
}

async fn with_tx_table<B: Backend>(b: B) -> B {
    b.exec("CREATE TABLE tx_awards (body text NOT NULL)")
        .await
        .unwrap();
    b
}

/// The write commits with the stored response: one row, and the retry is a replay.
async fn writes_commit_with_the_key<B: Backend>(b: &B, router: &Router) {
    let first = call(router, req("a", &["\"t1\""], r#"{"points":5}"#)).await;
    assert_eq!((first.0, first.1.as_deref()), (StatusCode::CREATED, None));
    let again = call(router, req("a", &["\"t1\""], r#"{"points":5}"#)).await;
    assert_eq!(again.0, StatusCode::CREATED);
    assert_eq!(again.1.as_deref(), Some("true"));
    assert_eq!(again.2, first.2);
    assert_eq!(tx_awards(b).await, 1);
    let other = call(router, req("a", &["\"t1\""], r#"{"points":6}"#)).await;
    assert_eq!(other.0, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(tx_awards(b).await, 1);
}

/// A panic after the write (before the key's completion) rolls both back: nothing is awarded,
/// the key is free, and the retry awards once. With the plain layer the write had committed
/// and the retry awarded again.
async fn a_panic_between_write_and_completion_rolls_both_back<B: Backend>(b: &B, router: &Router) {
    let first = call(router, req("a", &["\"t2\""], r#"{"points":7}"#)).await;
    assert_eq!(first.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        tx_awards(b).await,
        0,
        "the award rolled back with the claim"
    );
    let retry = call(router, req("a", &["\"t2\""], r#"{"points":7}"#)).await;
    assert_eq!((retry.0, retry.1.as_deref()), (StatusCode::CREATED, None));
    let replay = call(router, req("a", &["\"t2\""], r#"{"points":7}"#)).await;
    assert_eq!(replay.1.as_deref(), Some("true"));
    assert_eq!(tx_awards(b).await, 1);
}

/// A 5xx rolls the write back with the claim; the retry executes.
async fn a_server_error_rolls_the_write_back<B: Backend>(b: &B, router: &Router) {
    let first = call(router, req("a", &["\"t3\""], r#"{"points":8}"#)).await;
    assert_eq!(first.0, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(tx_awards(b).await, 0);
    let retry = call(router, req("a", &["\"t3\""], r#"{"points":8}"#)).await;
    assert_eq!(retry.0, StatusCode::CREATED);
    assert_eq!(tx_awards(b).await, 1);
}

#[tokio::test]
async fn a_transactional_handler_s_writes_commit_with_its_key_on_sqlite() {
    let lite = with_tx_table(Lite::new().await).await;
    let router = tx_router(lite.keys(), tx_award_sqlite, TxApp::default());
    writes_commit_with_the_key(&lite, &router).await;
}

#[tokio::test]
async fn the_named_transactional_layer_wraps_routes_with_route_layer() {
    let lite = with_tx_table(Lite::new().await).await;
    let registry = Registry::new();
    let router: Router = Router::new()
        .route("/awards", post(tx_award_sqlite))
        .route_layer(named_transactional_layer(lite.keys(), &registry))
        .route_layer(axum::middleware::from_fn(authenticate))
        .with_state(TxApp::default());
    writes_commit_with_the_key(&lite, &router).await;
    assert_eq!(counted(&registry, "idem_http_replays_total", None), 1.0);
    assert_eq!(
        counted(&registry, "idem_http_rejections_total", Some("mismatch")),
        1.0
    );
}

#[tokio::test]
async fn a_transactional_handler_s_writes_commit_with_its_key_on_postgres() {
    let pg = with_tx_table(Pg::new().await).await;
    let router = tx_router(pg.keys(), tx_award_postgres, TxApp::default());
    writes_commit_with_the_key(&pg, &router).await;
}

#[tokio::test]
async fn a_fault_between_the_award_and_the_key_s_completion_awards_once_on_sqlite() {
    let lite = with_tx_table(Lite::new().await).await;
    let app = TxApp::default();
    app.panic_first.store(true, Ordering::SeqCst);
    let router = tx_router(lite.keys(), tx_award_sqlite, app);
    a_panic_between_write_and_completion_rolls_both_back(&lite, &router).await;
}

#[tokio::test]
async fn a_fault_between_the_award_and_the_key_s_completion_awards_once_on_postgres() {
    let pg = with_tx_table(Pg::new().await).await;
    let app = TxApp::default();
    app.panic_first.store(true, Ordering::SeqCst);
    let router = tx_router(pg.keys(), tx_award_postgres, app);
    a_panic_between_write_and_completion_rolls_both_back(&pg, &router).await;
}

#[tokio::test]
async fn a_server_error_rolls_the_transactional_write_back_on_sqlite() {
    let lite = with_tx_table(Lite::new().await).await;
    let app = TxApp::default();
    app.fail_first.store(true, Ordering::SeqCst);
    let router = tx_router(lite.keys(), tx_award_sqlite, app);
    a_server_error_rolls_the_write_back(&lite, &router).await;
}

#[tokio::test]
async fn a_server_error_rolls_the_transactional_write_back_on_postgres() {
    let pg = with_tx_table(Pg::new().await).await;
    let app = TxApp::default();
    app.fail_first.store(true, Ordering::SeqCst);
    let router = tx_router(pg.keys(), tx_award_postgres, app);
    a_server_error_rolls_the_write_back(&pg, &router).await;
}

/// The server is killed (its runtime dropped) after the award is written, before the key's
/// completion: on the same file afterwards there is no award and the key is free, and the
/// retry awards once.
#[test]
fn a_server_killed_between_the_award_and_the_completion_leaves_neither_on_sqlite() {
    let main = tokio::runtime::Runtime::new().unwrap();
    let lite = main.block_on(async { with_tx_table(Lite::new().await).await });
    let url = format!("sqlite://{}", lite.path().display());
    let tables = lite.tables().clone();
    let (held, written) = std::sync::mpsc::channel();
    let server = tokio::runtime::Runtime::new().unwrap();
    let keys = server.block_on(async {
        let pool = idem_sql::sqlite::connect(&url).await.unwrap();
        idem_sql::sqlite::SqliteKeyStore::new(pool, tables.clone())
    });
    let app = TxApp {
        hold: Some(Arc::new(std::sync::Mutex::new(held))),
        ..TxApp::default()
    };
    let router = tx_router(keys, tx_award_sqlite, app);
    server.spawn(async move { call(&router, req("a", &["\"t4\""], r#"{"points":9}"#)).await });
    written.recv().unwrap();
    // The kill: every task of the server is dropped where it stands.
    server.shutdown_background();
    main.block_on(async {
        assert_eq!(tx_awards(&lite).await, 0, "the award died with the server");
        let pool = idem_sql::sqlite::connect(&url).await.unwrap();
        let keys = idem_sql::sqlite::SqliteKeyStore::new(pool, tables);
        let router = tx_router(keys, tx_award_sqlite, TxApp::default());
        let retry = call(&router, req("a", &["\"t4\""], r#"{"points":9}"#)).await;
        assert_eq!((retry.0, retry.1.as_deref()), (StatusCode::CREATED, None));
        assert_eq!(tx_awards(&lite).await, 1);
    });
}
