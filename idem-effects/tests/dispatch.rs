//! The dispatcher against the reference points API on a loopback port (SQLite on both sides):
//! a lost response, a 503 and a 422, each with the same key on every attempt.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use idem_conformance::backend::{Backend, Lite, OpenTx};
use idem_core::EventId;
use idem_core::idempotency::{EffectIntent, IntentStore};
use idem_effects::{Dispatcher, DispatcherConfig, EffectMetrics};
use idem_reference::points::{PointsDb, router};

/// What the fault middleware does to the next request.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// Let the server apply the award, then hold the response past the client's timeout.
    LoseResponse,
    /// Answer 503 without reaching the API.
    Unavailable,
}

#[derive(Clone)]
struct Faults {
    next: Arc<Mutex<Fault>>,
    keys_seen: Arc<Mutex<Vec<String>>>,
}

async fn faults(State(f): State<Faults>, req: Request, next: Next) -> Response {
    if let Some(k) = req.headers().get("idempotency-key") {
        f.keys_seen
            .lock()
            .unwrap()
            .push(k.to_str().unwrap().to_owned());
    }
    let fault = std::mem::replace(&mut *f.next.lock().unwrap(), Fault::None);
    match fault {
        Fault::Unavailable => (axum::http::StatusCode::SERVICE_UNAVAILABLE, "down").into_response(),
        Fault::LoseResponse => {
            let resp = next.run(req).await;
            tokio::time::sleep(Duration::from_millis(800)).await; // beyond the client's timeout
            resp
        }
        Fault::None => next.run(req).await,
    }
}

struct World {
    client_db: Lite,
    server_db: Lite,
    server_pool: sqlx::SqlitePool,
    target: String,
    faults: Faults,
    dispatcher: Dispatcher<idem_sqlite::SqliteIntents>,
}

async fn world() -> World {
    let (client_db, server_db) = (Lite::new().await, Lite::new().await);
    let server_pool =
        sqlx::SqlitePool::connect(&format!("sqlite://{}", server_db.path().display()))
            .await
            .unwrap();
    idem_reference::ensure_schema_sqlite(&server_pool)
        .await
        .unwrap();
    let faults = Faults {
        next: Arc::new(Mutex::new(Fault::None)),
        keys_seen: Arc::new(Mutex::new(vec![])),
    };
    let app = router(
        PointsDb::Sqlite(server_pool.clone()),
        server_db.keys(),
        idem_http::IdempotencyConfig::default(),
    )
    .layer(from_fn_with_state(faults.clone(), faults_mw));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = format!("http://{}/awards", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let config = DispatcherConfig {
        timeout: Duration::from_millis(300),
        backoff: Duration::ZERO,
        lease: Duration::from_secs(5),
        authorization: Some("Bearer settlement".into()),
        ..DispatcherConfig::default()
    };
    let dispatcher = Dispatcher::new(
        client_db.intents(),
        config,
        EffectMetrics::new(&prometheus::Registry::new()).unwrap(),
    )
    .unwrap();
    World {
        client_db,
        server_db,
        server_pool,
        target,
        faults,
        dispatcher,
    }
}

async fn faults_mw(state: State<Faults>, req: Request, next: Next) -> Response {
    faults(state, req, next).await
}

impl World {
    async fn record(&self, points: i64) -> EffectIntent {
        let intent = EffectIntent {
            event_id: EventId::new(),
            effect: "points.award".into(),
            target: self.target.clone(),
            body: serde_json::json!({"order_id": "order-1", "payment_id": "pay-1", "points": points}),
            traceparent: None,
        };
        let mut tx = self.client_db.begin().await;
        assert!(tx.record_intent(&intent).await.unwrap());
        tx.commit().await;
        intent
    }

    async fn awards(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM points_awards")
            .fetch_one(&self.server_pool)
            .await
            .unwrap()
    }

    async fn status(&self) -> String {
        self.client_db
            .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'done'")
            .await
            .to_string()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_response_is_retried_with_the_same_key_and_replayed_once() {
    let w = world().await;
    let intent = w.record(12).await;
    *w.faults.next.lock().unwrap() = Fault::LoseResponse;
    assert_eq!(w.dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(w.awards().await, 1, "the server applied the award");
    assert_eq!(w.status().await, "0", "but the client saw a timeout");
    assert_eq!(
        w.dispatcher.run_once().await.unwrap(),
        1,
        "retried at once (zero backoff)"
    );
    assert_eq!(w.status().await, "1");
    assert_eq!(w.awards().await, 1, "the retry was replayed, not executed");
    let seen = w.faults.keys_seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![intent.key().unwrap().header_value(); 2],
        "the same key on both attempts"
    );
    let _ = &w.server_db;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_is_retried_with_the_same_key() {
    let w = world().await;
    w.record(5).await;
    *w.faults.next.lock().unwrap() = Fault::Unavailable;
    w.dispatcher.run_once().await.unwrap();
    assert_eq!((w.awards().await, w.status().await.as_str()), (0, "0"));
    w.dispatcher.run_once().await.unwrap();
    assert_eq!((w.awards().await, w.status().await.as_str()), (1, "1"));
    let seen = w.faults.keys_seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0], seen[1]);
    assert_eq!(
        w.dispatcher
            .metrics()
            .retries
            .with_label_values(&["points.award", &seen_host(&w.target)])
            .get(),
        1
    );
}

fn seen_host(target: &str) -> String {
    target
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_422_parks_the_intent_and_counts_a_conflict() {
    let w = world().await;
    let intent = w.record(7).await;
    // Somebody already used this key with another body.
    let other = reqwest_post(
        &w.target,
        &intent.key().unwrap().header_value(),
        r#"{"order_id":"x","payment_id":"y","points":1}"#,
    )
    .await;
    assert_eq!(other, 201);
    w.dispatcher.run_once().await.unwrap();
    let stuck = w.client_db.intents().stuck(10).await.unwrap();
    assert_eq!(stuck.len(), 1);
    assert!(
        stuck[0].reason.as_deref().unwrap_or("").starts_with("422"),
        "{stuck:?}"
    );
    assert_eq!(
        w.dispatcher
            .metrics()
            .conflicts
            .with_label_values(&["points.award", &seen_host(&w.target)])
            .get(),
        1
    );
    assert_eq!(w.awards().await, 1, "only the other request's award");
}

async fn reqwest_post(url: &str, key: &str, body: &str) -> u16 {
    let listener_free = tokio::task::spawn_blocking({
        let (url, key, body) = (url.to_owned(), key.to_owned(), body.to_owned());
        move || {
            let mut s = std::net::TcpStream::connect(
                url.trim_start_matches("http://").split('/').next().unwrap(),
            )
            .unwrap();
            use std::io::{Read, Write};
            write!(
                s,
                "POST /awards HTTP/1.0\r\nauthorization: Bearer settlement\r\nidempotency-key: {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            out.split(' ').nth(1).unwrap().parse::<u16>().unwrap()
        }
    });
    listener_free.await.unwrap()
}
