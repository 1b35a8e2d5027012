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
use idem_http::{Idempotency, IdempotencyConfig};
use tokio::sync::Semaphore;
use tower::ServiceExt;

#[derive(Clone)]
struct App {
    executions: Arc<AtomicU64>,
    /// Each execution takes one permit: tests hold requests in flight by withholding permits.
    gate: Arc<Semaphore>,
}

async fn award(State(app): State<App>, body: String) -> impl IntoResponse {
    let _permit = app.gate.acquire().await.unwrap();
    let n = app.executions.fetch_add(1, Ordering::SeqCst) + 1;
    if body.contains("fail") {
        return (StatusCode::SERVICE_UNAVAILABLE, "try later".to_owned());
    }
    (
        StatusCode::CREATED,
        format!(r#"{{"award":{n},"request":{body}}}"#),
    )
}

fn app<S: IdempotencyStore>(store: S, permits: usize) -> (Router, App) {
    let state = App {
        executions: Arc::new(AtomicU64::new(0)),
        gate: Arc::new(Semaphore::new(permits)),
    };
    let router = Router::new()
        .route("/awards", post(award))
        .route_layer(Idempotency::new(store, IdempotencyConfig::default()).layer())
        .with_state(state.clone());
    (router, state)
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

async fn ten_concurrent_requests_with_one_key_execute_once<S: IdempotencyStore>(store: S) {
    let (router, app) = app(store, 0);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_requests_execute_once_on_sqlite() {
    ten_concurrent_requests_with_one_key_execute_once(Lite::new().await.keys()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_requests_execute_once_on_postgres() {
    ten_concurrent_requests_with_one_key_execute_once(Pg::new().await.keys()).await;
}
