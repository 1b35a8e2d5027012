//! The points API over SQLite: awards are executed once per key and client, replayed to
//! retries, and visible through the status probe.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use axum::body::Body;
use axum::http::{Request, StatusCode};
use idem_conformance::backend::{Backend, Lite};
use idem_http::IdempotencyConfig;
use idem_reference::points::{Award, PointsDb, router};
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

#[tokio::test]
async fn one_award_per_key_replayed_to_retries_and_visible_to_the_probe() {
    let lite = Lite::new().await;
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", lite.path().display()))
        .await
        .unwrap();
    idem_reference::ensure_schema_sqlite(&pool).await.unwrap();
    let app = router(
        PointsDb::Sqlite(pool),
        lite.keys(),
        IdempotencyConfig::default(),
    );
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
