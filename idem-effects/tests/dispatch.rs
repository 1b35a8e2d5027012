//! The dispatcher against the reference points API on a loopback port (SQLite on both sides):
//! a lost response, a 503 and a 422, each with the same key on every attempt; and a remote that
//! ignores keys, with and without a status probe, and its compensation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use idem_conformance::backend::{Backend, Lite, OpenTx};
use idem_core::EventId;
use idem_core::idempotency::{EffectIntent, IntentStore};
use idem_effects::{
    Dispatcher, DispatcherConfig, EffectMetrics, EffectPolicy, HttpCompensation, HttpStatusProbe,
};
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
    traceparents_seen: Arc<Mutex<Vec<String>>>,
}

async fn faults(State(f): State<Faults>, req: Request, next: Next) -> Response {
    if let Some(k) = req.headers().get("idempotency-key") {
        f.keys_seen
            .lock()
            .unwrap()
            .push(k.to_str().unwrap().to_owned());
    }
    if let Some(tp) = req.headers().get("traceparent") {
        f.traceparents_seen
            .lock()
            .unwrap()
            .push(tp.to_str().unwrap().to_owned());
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
    world_with("/awards", |_| EffectPolicy::default()).await
}

/// A world whose dispatcher sends to `path` with the policy `policy(base URL)`.
async fn world_with(path: &str, policy: impl Fn(&str) -> EffectPolicy) -> World {
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
        traceparents_seen: Arc::new(Mutex::new(vec![])),
    };
    let app = router(
        PointsDb::Sqlite(server_pool.clone()),
        server_db.keys(),
        idem_http::IdempotencyConfig::default(),
    )
    .layer(from_fn_with_state(faults.clone(), faults_mw));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let target = format!("{base}{path}");
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
    .unwrap()
    .with_policy("points.award", policy(&base));
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
        self.record_traced(points, None).await
    }

    async fn record_traced(&self, points: i64, traceparent: Option<&str>) -> EffectIntent {
        let intent = EffectIntent {
            event_id: EventId::new(),
            effect: "points.award".into(),
            target: self.target.clone(),
            body: serde_json::json!({"order_id": "order-1", "payment_id": "pay-1", "points": points}),
            traceparent: traceparent.map(str::to_owned),
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

// ---- a remote that ignores Idempotency-Key ---------------------------------------------------

fn keyless(base: &str, probe: bool) -> EffectPolicy {
    let auth = Some("Bearer settlement".to_owned());
    EffectPolicy {
        remote_ignores_keys: true,
        probe: probe.then(|| {
            Arc::new(HttpStatusProbe::new(
                format!("{base}/awards/by-payment/{{payment_id}}"),
                auth.clone(),
            )) as Arc<dyn idem_effects::StatusProbe>
        }),
        compensation: Some(Arc::new(HttpCompensation::new(
            format!("{base}/awards/by-payment/{{payment_id}}/reversal"),
            auth,
        ))),
        settle: Duration::ZERO,
    }
}

impl World {
    async fn intent_status(&self) -> String {
        let stuck = self.client_db.intents().stuck(10).await.unwrap();
        match stuck.as_slice() {
            [] => "not stuck".to_owned(),
            [one] => one.status.clone(),
            many => panic!("{many:?}"),
        }
    }

    fn posts(&self) -> usize {
        self.faults.keys_seen.lock().unwrap().len()
    }

    fn probes(&self, result: &str) -> u64 {
        self.dispatcher
            .metrics()
            .probes
            .with_label_values(&["points.award", &seen_host(&self.target), result])
            .get()
    }

    async fn active_awards(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM points_awards a WHERE NOT EXISTS (SELECT 1 FROM points_reversals r WHERE r.award_id = a.id)",
        )
        .fetch_one(&self.server_pool)
        .await
        .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_probe_a_lost_response_from_a_keyless_remote_becomes_unknown_not_a_resend() {
    let w = world_with("/keyless/awards", |base| keyless(base, false)).await;
    w.record(12).await;
    *w.faults.next.lock().unwrap() = Fault::LoseResponse;
    w.dispatcher.run_once().await.unwrap();
    assert_eq!(w.awards().await, 1, "the remote applied it");
    assert_eq!(w.intent_status().await, "unknown");
    assert_eq!(
        w.dispatcher.run_once().await.unwrap(),
        0,
        "an unknown intent is not sent again"
    );
    assert_eq!((w.posts(), w.awards().await), (1, 1));
    let stuck = w.client_db.intents().stuck(10).await.unwrap();
    assert!(
        stuck[0]
            .reason
            .as_deref()
            .unwrap()
            .contains("no status probe"),
        "{stuck:?}"
    );
    assert_eq!(
        w.dispatcher
            .metrics()
            .unknown
            .with_label_values(&["points.award", &seen_host(&w.target)])
            .get(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_finds_an_award_whose_response_was_lost_and_nothing_is_resent() {
    let w = world_with("/keyless/awards", |base| keyless(base, true)).await;
    w.record(12).await;
    *w.faults.next.lock().unwrap() = Fault::LoseResponse;
    w.dispatcher.run_once().await.unwrap();
    assert_eq!((w.awards().await, w.status().await.as_str()), (1, "0"));
    assert_eq!(w.dispatcher.run_once().await.unwrap(), 1, "re-attempted");
    assert_eq!(w.status().await, "1", "done from the probe's answer");
    assert_eq!(
        (w.posts(), w.awards().await),
        (1, 1),
        "the award was not sent again"
    );
    assert_eq!(w.probes("applied"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_lets_an_effect_that_did_not_happen_be_sent_again() {
    let w = world_with("/keyless/awards", |base| keyless(base, true)).await;
    w.record(12).await;
    *w.faults.next.lock().unwrap() = Fault::Unavailable; // a 503: maybe applied, maybe not
    w.dispatcher.run_once().await.unwrap();
    assert_eq!((w.awards().await, w.status().await.as_str()), (0, "0"));
    w.dispatcher.run_once().await.unwrap();
    assert_eq!(w.probes("not_applied"), 1);
    assert_eq!(
        (w.posts(), w.awards().await, w.status().await.as_str()),
        (2, 1, "1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compensation_reverses_an_unknown_award_before_it_is_sent_again() {
    let w = world_with("/keyless/awards", |base| keyless(base, false)).await;
    w.record(12).await;
    *w.faults.next.lock().unwrap() = Fault::LoseResponse;
    w.dispatcher.run_once().await.unwrap();
    let id = w.client_db.intents().stuck(10).await.unwrap()[0].id;
    assert_eq!(w.intent_status().await, "unknown");
    let note = w.dispatcher.compensate(id, true).await.unwrap();
    assert!(note.contains("compensated"), "{note}");
    assert_eq!(w.active_awards().await, 0, "the unknown award was reversed");
    w.dispatcher.run_once().await.unwrap();
    assert_eq!(w.status().await, "1");
    assert_eq!(
        (w.awards().await, w.active_awards().await),
        (2, 1),
        "one award stands: the reversed one and the re-sent one"
    );
    assert!(
        matches!(
            w.dispatcher.compensate(id, true).await,
            Err(idem_effects::CompensateError::NotStuck { .. })
        ),
        "a done intent is not compensated"
    );
    assert_eq!(
        w.dispatcher
            .metrics()
            .compensations
            .with_label_values(&["points.award", &seen_host(&w.target), "ok"])
            .get(),
        1
    );
}

#[tokio::test]
async fn every_attempt_carries_the_traceparent_recorded_with_the_intent() {
    let w = world().await;
    // As the consumer records it: the trace captured at enqueue, the handler span as parent.
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-b7ad6b7169203331-01";
    w.record_traced(10, Some(tp)).await;
    *w.faults.next.lock().unwrap() = Fault::Unavailable;
    assert_eq!(w.dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(w.dispatcher.run_once().await.unwrap(), 1);
    assert_eq!(w.awards().await, 1);
    assert_eq!(
        *w.faults.traceparents_seen.lock().unwrap(),
        vec![tp.to_owned(); 2],
        "the failed attempt and the retry both continue the event's trace"
    );
}
