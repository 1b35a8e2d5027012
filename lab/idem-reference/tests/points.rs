//! The points API over SQLite: awards are executed once per key and client, replayed to
//! retries, and visible through the status probe.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use axum::body::Body;
use axum::http::{Request, StatusCode};
use std::time::Duration;

use idem_conformance::backend::{Backend, Lite, Pg};
use idem_core::idempotency::IdempotencyStore;
use idem_http::IdempotencyConfig;
use idem_reference::points::{Award, Lab, PointsDb, lab_router, router, transactional_router};
use tower::ServiceExt;

async fn send(
    app: &axum::Router,
    client: &str,
    key: Option<&str>,
    body: &str,
) -> (StatusCode, Option<String>, String) {
    let mut r = Request::post("/awards")
        .header("authorization", format!("Bearer {client}"))
        .header("content-type", "application/json");
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    let resp = app
        .clone()
        .oneshot(r.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
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

async fn probe(app: &axum::Router, client: &str, payment: &str) -> Vec<Award> {
    let r = Request::get(format!("/awards/by-payment/{payment}"))
        .header("authorization", format!("Bearer {client}"));
    let resp = app
        .clone()
        .oneshot(r.body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    serde_json::from_slice(
        &axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap(),
    )
    .unwrap()
}

/// The points tables in the SQLite database of `lite`.
async fn points_db(lite: &Lite) -> sqlx::SqlitePool {
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", lite.path().display()))
        .await
        .unwrap();
    idem_reference::ensure_schema_sqlite(&pool).await.unwrap();
    pool
}

#[tokio::test]
async fn one_award_per_key_replayed_to_retries_and_visible_to_the_probe() {
    let lite = Lite::new().await;
    let pool = points_db(&lite).await;
    let app = router(
        PointsDb::Sqlite(pool),
        lite.keys(),
        IdempotencyConfig::default(),
    );
    one_award_per_key(&app).await;
}

/// The transactional router (the award and its key's completion in one transaction, as the
/// demo serves it) keeps every promise of the plain one.
#[tokio::test]
async fn the_transactional_router_awards_once_per_key_on_sqlite() {
    let lite = Lite::new().await;
    let pool = points_db(&lite).await;
    let app = transactional_router(
        PointsDb::Sqlite(pool),
        lite.tables(),
        IdempotencyConfig::default(),
    );
    one_award_per_key(&app).await;
}

#[tokio::test]
async fn the_transactional_router_awards_once_per_key_on_postgres() {
    let pg = Pg::new().await;
    idem_reference::ensure_schema_postgres(pg.pool())
        .await
        .unwrap();
    let app = transactional_router(
        PointsDb::Postgres(pg.pool().clone()),
        pg.tables(),
        IdempotencyConfig::default(),
    );
    one_award_per_key(&app).await;
}

/// One award per key, replayed to retries, refused without a key or with another request,
/// and visible to the probe of its client only.
async fn one_award_per_key(app: &axum::Router) {
    let app = app.clone();
    let body = r#"{"order_id":"order-1","payment_id":"pay-1","points":12}"#;
    let key = "\"event-01936f5e-4c1a-7d55-9a51-0cc0f0d4a7e2-points.award\"";
    let first = send(&app, "settlement", Some(key), body).await;
    let retry = send(&app, "settlement", Some(key), body).await;
    assert_eq!(
        (first.0, retry.0),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(retry.1.as_deref(), Some("true"));
    assert_eq!(retry.2, first.2);
    assert_eq!(
        probe(&app, "settlement", "pay-1").await.len(),
        1,
        "one award despite the retry"
    );
    assert_eq!(
        send(&app, "settlement", None, body).await.0,
        StatusCode::BAD_REQUEST,
        "the key is required"
    );
    let other = send(
        &app,
        "settlement",
        Some(key),
        r#"{"order_id":"order-1","payment_id":"pay-1","points":99}"#,
    )
    .await;
    assert_eq!(other.0, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        probe(&app, "someone-else", "pay-1").await.is_empty(),
        "the probe is scoped per client"
    );
}

/// Sends `body` with `key` until the answer is not 409 (a client honouring `Retry-After`).
async fn send_until_done(app: &axum::Router, key: &str, body: &str) -> (StatusCode, String) {
    loop {
        let (status, _, text) = send(app, "settlement", Some(key), body).await;
        if status != StatusCode::CONFLICT {
            return (status, text);
        }
        // The client's own backoff between retries (what a client does on 409).
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn lab_counts(app: &axum::Router) -> serde_json::Value {
    let r = Request::get("/lab/award-executions")
        .body(Body::empty())
        .unwrap();
    let resp = app.clone().oneshot(r).await.unwrap();
    serde_json::from_slice(
        &axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap(),
    )
    .unwrap()
}

/// The harness's "points API slower than the key lock": awards take 700 ms, the lock is 200 ms;
/// concurrent requests with one key, each retried on 409, give one award and no overlapping
/// executions.
async fn a_points_api_slower_than_its_key_lock_awards_once<K: IdempotencyStore>(
    db: PointsDb,
    keys: K,
) {
    let config = IdempotencyConfig {
        lock: Duration::from_millis(200),
        ..IdempotencyConfig::default()
    };
    let lab = Lab {
        award_delay: Duration::from_millis(700),
        slow_one_in: 1,
    };
    let app = lab_router(db, keys, config, lab);
    let body = r#"{"order_id":"order-1","payment_id":"pay-1","points":12}"#;
    let key = "\"event-01936f5e-4c1a-7d55-9a51-0cc0f0d4a7e2-points.award\"";
    let mut tasks = vec![];
    for _ in 0..4 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            send_until_done(&app, key, body).await
        }));
    }
    let mut answers = vec![];
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    assert!(
        answers.iter().all(|a| a.0 == StatusCode::CREATED),
        "{answers:?}"
    );
    assert!(
        answers.iter().all(|a| a.1 == answers[0].1),
        "one award, replayed: {answers:?}"
    );
    let counts = lab_counts(&app).await;
    assert_eq!(
        (
            counts["executions"].as_u64(),
            counts["overlapping"].as_u64()
        ),
        (Some(1), Some(0)),
        "{counts}"
    );
    assert_eq!(probe(&app, "settlement", "pay-1").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_points_api_slower_than_its_key_lock_awards_once_on_sqlite() {
    let lite = Lite::new().await;
    let pool = points_db(&lite).await;
    a_points_api_slower_than_its_key_lock_awards_once(PointsDb::Sqlite(pool), lite.keys()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_points_api_slower_than_its_key_lock_awards_once_on_postgres() {
    let pg = Pg::new().await;
    idem_reference::ensure_schema_postgres(pg.pool())
        .await
        .unwrap();
    a_points_api_slower_than_its_key_lock_awards_once(
        PointsDb::Postgres(pg.pool().clone()),
        pg.keys(),
    )
    .await;
}

/// The lab's slow keys: all of them by default; with `slow_one_in` a stable fraction, the same
/// for every execution of a key (so a retry of a slow award is slow too).
#[test]
fn one_key_in_n_is_slow_and_always_the_same_keys() {
    let every = Lab {
        award_delay: Duration::from_millis(1),
        slow_one_in: 1,
    };
    let some = Lab {
        slow_one_in: 8,
        ..every.clone()
    };
    let keys: Vec<String> = (0..800)
        .map(|i| format!("\"event-{i}-points.award\""))
        .collect();
    assert!(keys.iter().all(|k| every.is_slow(k)));
    let slow = keys.iter().filter(|k| some.is_slow(k)).count();
    assert!((50..=150).contains(&slow), "{slow} of 800 keys slow");
    // Another process (another instance) picks the same keys: no per-instance random hasher.
    let other = Lab {
        award_delay: Duration::from_secs(5),
        slow_one_in: 8,
    };
    assert!(keys.iter().all(|k| some.is_slow(k) == other.is_slow(k)));
}
