//! The dispatcher against the reference points API on a loopback port (SQLite on both sides):
//! a lost response, a 503 and a 422, each with the same key on every attempt; and a remote that
//! ignores keys, with and without a status probe, and its compensation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
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

mod support;

/// What the fault middleware does to the next request.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// Let the server apply the award, then hold the response past the client's timeout.
    LoseResponse,
    /// Answer 503 without reaching the API.
    Unavailable,
    /// Let the server apply the award, signal `Faults::applied`, then hold the response for
    /// longer than any test runs (the dispatcher dies or times out with the award applied).
    ApplyThenHold,
    /// Answer this status without reaching the API, to every request.
    Always(u16),
    /// Wait until an `ApplyThenHold` request was applied, then pass.
    AfterApplied,
    /// A remote still processing: signal `Faults::received`, apply the award only once
    /// `Faults::released` is set (in a task of its own, which the client's disconnect does not
    /// end), then answer.
    ProcessUntilReleased,
}

#[derive(Clone)]
struct Faults {
    next: Arc<Mutex<Fault>>,
    /// One-shot faults for the POSTs of one payment (by `payment_id`).
    by_payment: Arc<Mutex<HashMap<String, Fault>>>,
    /// Applies to every request when not `None`.
    every: Arc<Mutex<Fault>>,
    /// How many `ApplyThenHold` requests were applied.
    applied: Arc<tokio::sync::watch::Sender<usize>>,
    /// How many `ProcessUntilReleased` requests arrived, and whether they may be applied.
    received: Arc<tokio::sync::watch::Sender<usize>>,
    released: Arc<tokio::sync::watch::Sender<bool>>,
    keys_seen: Arc<Mutex<Vec<String>>>,
    traceparents_seen: Arc<Mutex<Vec<String>>>,
    /// For each POST: how long the intent's lease still had to run when the request arrived
    /// (ms, read from the dispatcher's database).
    lease_left_ms: Arc<Mutex<Vec<i64>>>,
    client_pool: sqlx::SqlitePool,
}

/// The one-shot fault of this POST's payment, and the request rebuilt after reading its body.
async fn payment_fault(f: &Faults, req: Request) -> (Fault, Request) {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
    let payment = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get("payment_id")?.as_str().map(str::to_owned));
    let fault = payment
        .and_then(|p| f.by_payment.lock().unwrap().remove(&p))
        .unwrap_or(Fault::None);
    (
        fault,
        Request::from_parts(parts, axum::body::Body::from(bytes)),
    )
}

async fn record_lease_left(f: &Faults, key: &str) {
    let until: Option<i64> =
        sqlx::query_scalar("SELECT claimed_until FROM idem_effect_intents WHERE idem_key = ?1")
            .bind(key.trim_matches('"'))
            .fetch_optional(&f.client_pool)
            .await
            .unwrap()
            .flatten();
    if let Some(until) = until {
        let now = i64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis(),
        )
        .unwrap();
        f.lease_left_ms.lock().unwrap().push(until - now);
    }
}

async fn faults(State(f): State<Faults>, req: Request, next: Next) -> Response {
    if let Some(k) = req.headers().get("idempotency-key") {
        let k = k.to_str().unwrap().to_owned();
        record_lease_left(&f, &k).await;
        f.keys_seen.lock().unwrap().push(k);
    }
    if let Some(tp) = req.headers().get("traceparent") {
        f.traceparents_seen
            .lock()
            .unwrap()
            .push(tp.to_str().unwrap().to_owned());
    }
    let (by_payment, req) = if req.method() == axum::http::Method::POST {
        payment_fault(&f, req).await
    } else {
        (Fault::None, req)
    };
    let every = *f.every.lock().unwrap();
    let next_fault = std::mem::replace(&mut *f.next.lock().unwrap(), Fault::None);
    let fault = [by_payment, every, next_fault]
        .into_iter()
        .find(|f| *f != Fault::None)
        .unwrap_or(Fault::None);
    match fault {
        Fault::Always(status) => (
            axum::http::StatusCode::from_u16(status).unwrap(),
            "refused by the fault middleware",
        )
            .into_response(),
        Fault::AfterApplied => {
            let mut applied = f.applied.subscribe();
            applied.wait_for(|n| *n > 0).await.unwrap();
            next.run(req).await
        }
        Fault::ProcessUntilReleased => {
            f.received.send_modify(|n| *n += 1);
            let mut released = f.released.subscribe();
            let processing = tokio::spawn(async move {
                released.wait_for(|r| *r).await.unwrap();
                next.run(req).await
            });
            processing.await.unwrap()
        }
        Fault::ApplyThenHold => {
            let resp = next.run(req).await;
            f.applied.send_modify(|n| *n += 1);
            tokio::time::sleep(Duration::from_secs(60)).await;
            resp
        }
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
    config: DispatcherConfig,
    policy: EffectPolicy,
    client_db: Lite,
    server_db: Lite,
    server_pool: sqlx::SqlitePool,
    target: String,
    faults: Faults,
    dispatcher: Dispatcher<idem_sql::sqlite::SqliteIntents>,
}

async fn world() -> World {
    world_with("/awards", |_| EffectPolicy::default()).await
}

/// A world whose dispatcher sends to `path` with the policy `policy(base URL)`.
async fn world_with(path: &str, policy: impl Fn(&str) -> EffectPolicy) -> World {
    world_configured(path, policy, |c| c).await
}

/// The dispatcher settings of the test worlds (before `tune`).
fn test_config() -> DispatcherConfig {
    DispatcherConfig {
        timeout: Duration::from_millis(300),
        retry_backoff: Duration::ZERO,
        lease: Duration::from_secs(5),
        authorization: Some("Bearer settlement".into()),
        ..DispatcherConfig::default()
    }
}

/// [`world_with`] with dispatcher settings changed by `tune`.
async fn world_configured(
    path: &str,
    policy: impl Fn(&str) -> EffectPolicy,
    tune: impl Fn(DispatcherConfig) -> DispatcherConfig,
) -> World {
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
        by_payment: Arc::new(Mutex::new(HashMap::new())),
        every: Arc::new(Mutex::new(Fault::None)),
        applied: Arc::new(tokio::sync::watch::channel(0).0),
        received: Arc::new(tokio::sync::watch::channel(0).0),
        released: Arc::new(tokio::sync::watch::channel(false).0),
        keys_seen: Arc::new(Mutex::new(vec![])),
        traceparents_seen: Arc::new(Mutex::new(vec![])),
        lease_left_ms: Arc::new(Mutex::new(vec![])),
        client_pool: sqlx::SqlitePool::connect(&format!("sqlite://{}", client_db.path().display()))
            .await
            .unwrap(),
    };
    let app = router(
        PointsDb::Sqlite(server_pool.clone()),
        server_db.keys(),
        idem_http::IdempotencyConfig::default(),
    )
    .route(
        "/odd-probe/{payment_id}",
        axum::routing::get(|| async { axum::Json(serde_json::json!({"awards": []})) }),
    )
    .layer(from_fn_with_state(faults.clone(), faults_mw));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let target = format!("{base}{path}");
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let config = tune(test_config());
    let policy = policy(&base);
    let dispatcher = Dispatcher::new(
        client_db.intents(),
        config.clone(),
        EffectMetrics::new(&prometheus::Registry::new()).unwrap(),
    )
    .unwrap()
    .with_policy("points.award", policy.clone());
    World {
        config,
        policy,
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
            [one] => one.status.to_string(),
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

// ---- a keyless remote whose attempt was sent and never recorded -------------------------------

/// Settings for tests that hold a request at the remote: a timeout no test run reaches.
fn patient(c: DispatcherConfig) -> DispatcherConfig {
    DispatcherConfig {
        timeout: Duration::from_secs(5),
        lease: Duration::from_secs(15),
        ..c
    }
}

impl World {
    /// Another dispatcher over the same intents, settings and policy (a second process).
    fn another_dispatcher(&self) -> Dispatcher<idem_sql::sqlite::SqliteIntents> {
        self.dispatcher_over(self.client_db.intents())
    }

    fn dispatcher_over<S: IntentStore>(&self, store: S) -> Dispatcher<S> {
        Dispatcher::new(
            store,
            self.config.clone(),
            EffectMetrics::new(&prometheus::Registry::new()).unwrap(),
        )
        .unwrap()
        .with_policy("points.award", self.policy.clone())
    }

    /// Time passes: every lease and backoff is over.
    /// Ends the pending intents' leases, their next attempt times left as they are.
    async fn end_leases(&self) {
        self.client_db
            .exec("UPDATE idem_effect_intents SET claimed_until = 0 WHERE status = 'pending'")
            .await
            .unwrap();
    }

    async fn expire_leases(&self) {
        self.client_db
            .exec("UPDATE idem_effect_intents SET claimed_until = 0, next_attempt_at = 0 WHERE status = 'pending'")
            .await
            .unwrap();
    }

    async fn record_payment(&self, payment: &str) -> i64 {
        let intent = EffectIntent {
            event_id: EventId::new(),
            effect: "points.award".into(),
            target: self.target.clone(),
            body: serde_json::json!({"order_id": "order-1", "payment_id": payment, "points": 3}),
            traceparent: None,
        };
        let mut tx = self.client_db.begin().await;
        assert!(tx.record_intent(&intent).await.unwrap());
        tx.commit().await;
        self.client_db
            .scalar(&format!(
                "SELECT id FROM idem_effect_intents WHERE json_extract(body, '$.payment_id') = '{payment}'"
            ))
            .await
    }

    async fn awards_of(&self, payment: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM points_awards WHERE payment_id = ?1")
            .bind(payment)
            .fetch_one(&self.server_pool)
            .await
            .unwrap()
    }

    async fn status_of(&self, id: i64) -> String {
        self.client_db
            .intents()
            .get(id)
            .await
            .unwrap()
            .unwrap()
            .1
            .to_string()
    }

    /// Sends the intent; the remote applies it and holds the response, and the dispatcher dies
    /// there: its `run_once` future is dropped at that await, as a SIGKILL would end it.
    async fn die_after_the_award(&self) {
        *self.faults.next.lock().unwrap() = Fault::ApplyThenHold;
        tokio::select! {
            biased;
            () = self.wait_applied() => {}
            r = self.dispatcher.run_once() => panic!("the response is held, yet run_once ended: {r:?}"),
        }
    }

    async fn wait_applied(&self) {
        let mut applied = self.faults.applied.subscribe();
        applied.wait_for(|n| *n > 0).await.unwrap();
    }
}

/// The dispatcher dies after the keyless remote applied the award and before the outcome is
/// recorded (here: its `run_once` future is dropped at that await, as a SIGKILL would end it);
/// restarted after the lease, it must not POST again (two awards, intent `done`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_killed_after_a_keyless_award_leaves_the_intent_unknown_not_resent() {
    let w = world_configured("/keyless/awards", |b| keyless(b, false), patient).await;
    let id = w.record_payment("pay-1").await;
    w.die_after_the_award().await;
    assert_eq!(w.awards_of("pay-1").await, 1, "the remote applied it");
    w.expire_leases().await;
    w.another_dispatcher().run_once().await.unwrap();
    assert_eq!(
        (w.awards_of("pay-1").await, w.posts()),
        (1, 1),
        "the restarted dispatcher sent the award again"
    );
    assert_eq!(w.status_of(id).await, "unknown");
    let stuck = w.client_db.intents().stuck(10).await.unwrap();
    assert!(
        stuck[0]
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("never recorded"),
        "{stuck:?}"
    );
}

/// The same crash with a status probe: the probe decides (it finds the award; nothing is sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_crash_the_probe_decides_whether_a_keyless_intent_is_sent_again() {
    let w = world_configured("/keyless/awards", |b| keyless(b, true), patient).await;
    let id = w.record_payment("pay-1").await;
    w.die_after_the_award().await;
    w.expire_leases().await;
    w.another_dispatcher().run_once().await.unwrap();
    assert_eq!((w.awards_of("pay-1").await, w.posts()), (1, 1));
    assert_eq!(w.status_of(id).await, "done", "the probe found the award");
}

/// Lease takeover: a second dispatcher claims the intent while the first one's request is
/// still in flight at the keyless remote (the first one paused past its lease); it must not
/// send again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyless_intent_taken_over_while_its_request_is_in_flight_is_not_resent() {
    let w = world_configured("/keyless/awards", |b| keyless(b, false), patient).await;
    let id = w.record_payment("pay-1").await;
    *w.faults.next.lock().unwrap() = Fault::ApplyThenHold;
    let first = w.another_dispatcher();
    let first = tokio::spawn(async move { first.run_once().await });
    w.wait_applied().await;
    w.expire_leases().await;
    w.dispatcher.run_once().await.unwrap();
    first.abort();
    assert_eq!(
        (w.awards_of("pay-1").await, w.posts()),
        (1, 1),
        "the second dispatcher sent the award again"
    );
    assert_eq!(w.status_of(id).await, "unknown");
}

/// Review N3: a dispatcher dies while the keyless remote still processes its request (for
/// longer than the lease). The successor must not probe before `settle` from that send: the
/// probe would find nothing yet and the award would be sent a second time. It claims nothing
/// until then, and afterwards the probe finds the award the remote finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyless_intent_is_not_probed_before_settle_from_a_send_its_dispatcher_died_in() {
    let settle = |b: &str| EffectPolicy {
        settle: Duration::from_secs(2),
        ..keyless(b, true)
    };
    let w = world_configured("/keyless/awards", settle, patient).await;
    let id = w.record_payment("pay-1").await;
    *w.faults.next.lock().unwrap() = Fault::ProcessUntilReleased;
    let first = w.another_dispatcher();
    let first = tokio::spawn(async move { first.run_once().await });
    let mut received = w.faults.received.subscribe();
    received.wait_for(|n| *n > 0).await.unwrap();
    // SIGKILL: the sending mark is committed, no outcome recorded; the lease ends.
    first.abort();
    let _ = first.await;
    w.end_leases().await;
    w.dispatcher.run_once().await.unwrap();
    assert_eq!(
        (w.posts(), w.probes("not_applied")),
        (1, 0),
        "probed and sent again while the remote was still processing the first send"
    );
    w.faults.released.send_replace(true);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while w.status_of(id).await != "done" {
        assert!(std::time::Instant::now() < deadline, "never settled");
        w.dispatcher.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!((w.awards_of("pay-1").await, w.posts()), (1, 1));
}

/// An intent store whose `finish_all` fails for a batch holding intent `fail`: a store error in
/// the recording of a batch.
fn fail_finish(
    inner: idem_sql::sqlite::SqliteIntents,
    fail: i64,
) -> support::HookedFinish<idem_sql::sqlite::SqliteIntents> {
    support::HookedFinish {
        inner,
        hook: Arc::new(move |finished| {
            Box::pin(async move {
                if finished.iter().any(|f| f.id == fail) {
                    return Err(idem_core::Error::Config("the database went away".into()));
                }
                Ok(())
            })
        }),
    }
}

/// One send of a batch fails (a store error) while another intent's request is in flight at
/// the keyless remote; `run_once` waits for that request and records it, where returning at
/// once would drop it unrecorded and the next attempt would send it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_send_does_not_drop_another_keyless_request_unrecorded() {
    let w = world_configured(
        "/keyless/awards",
        |b| keyless(b, false),
        |c| DispatcherConfig {
            timeout: Duration::from_secs(1),
            lease: Duration::from_secs(4),
            ..c
        },
    )
    .await;
    let held = w.record_payment("pay-held").await;
    let failing = w.record_payment("pay-failing").await;
    w.faults.by_payment.lock().unwrap().extend([
        ("pay-held".to_owned(), Fault::ApplyThenHold),
        ("pay-failing".to_owned(), Fault::AfterApplied),
    ]);
    let broken = w.dispatcher_over(fail_finish(w.client_db.intents(), failing));
    assert!(broken.run_once().await.is_err(), "the store error surfaces");
    assert_eq!(
        w.awards_of("pay-held").await,
        1,
        "the held request was applied"
    );
    w.expire_leases().await;
    w.dispatcher.run_once().await.unwrap();
    assert_eq!(
        w.awards_of("pay-held").await,
        1,
        "the dropped request was sent again"
    );
    assert_eq!(w.status_of(held).await, "unknown");
}

// ---- the lease and the batch --------------------------------------------------------------------

/// A slow remote and a batch of intents sent one at a time: a request sent on the lease taken
/// for the whole batch could go out after it expired (when another dispatcher may hold it). No
/// request may start with less than `timeout` left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_starts_after_the_safe_point_of_its_lease() {
    let w = world_configured(
        "/awards",
        |_| EffectPolicy::default(),
        |c| DispatcherConfig {
            timeout: Duration::from_millis(300),
            lease: Duration::from_millis(1200),
            batch_size: 6,
            concurrency: 1,
            ..c
        },
    )
    .await;
    for p in 0..6 {
        w.record_payment(&format!("pay-{p}")).await;
    }
    *w.faults.every.lock().unwrap() = Fault::LoseResponse; // every request ends in a timeout
    for _ in 0..20 {
        let seen: std::collections::HashSet<String> =
            w.faults.keys_seen.lock().unwrap().iter().cloned().collect();
        if seen.len() == 6 {
            break;
        }
        w.dispatcher.run_once().await.unwrap();
    }
    let left = w.faults.lease_left_ms.lock().unwrap().clone();
    assert!(left.len() >= 6, "{left:?}");
    assert!(
        left.iter().all(|ms| *ms >= 300),
        "requests started with less than the timeout left on their lease (ms): {left:?}"
    );
}

// ---- answers that say nothing ------------------------------------------------------------------

/// A remote that keeps answering 409 (or 429) is not retried forever: after a bounded number
/// of attempts the intent is parked, where `idem effects stuck` shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_409_and_429_answers_park_the_intent_after_a_bound() {
    for status in [409, 429] {
        let w = world().await;
        let id = w.record_payment("pay-1").await;
        *w.faults.every.lock().unwrap() = Fault::Always(status);
        for _ in 0..40 {
            w.expire_leases().await;
            w.dispatcher.run_once().await.unwrap();
        }
        assert_eq!(w.status_of(id).await, "parked", "{status}");
        let stuck = w.client_db.intents().stuck(10).await.unwrap();
        let reason = stuck[0].reason.clone().unwrap_or_default();
        assert!(reason.starts_with(&status.to_string()), "{reason}");
        assert!(w.posts() < 40, "{status}: {} posts", w.posts());
    }
}

/// A probe answer that is a JSON object says nothing by itself (`{"awards": []}` has no award):
/// counting it as applied would make the intent `done` with the effect never applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_answer_that_does_not_meet_the_applied_condition_is_unknown_not_done() {
    let w = world_with("/keyless/awards", |base| EffectPolicy {
        probe: Some(Arc::new(HttpStatusProbe::new(
            format!("{base}/odd-probe/{{payment_id}}"),
            Some("Bearer settlement".to_owned()),
        ))),
        ..keyless(base, false)
    })
    .await;
    let id = w.record_payment("pay-1").await;
    *w.faults.next.lock().unwrap() = Fault::Unavailable; // a 503: maybe applied, maybe not
    w.dispatcher.run_once().await.unwrap();
    w.dispatcher.run_once().await.unwrap();
    assert_eq!(w.awards().await, 0);
    assert_eq!(w.status_of(id).await, "unknown", "done without an award");
    assert_eq!(w.probes("unknown"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_dispatches_until_shutdown_with_a_dispatcher_built_without_a_registry() {
    let w = world().await;
    w.record(7).await;
    *w.faults.next.lock().unwrap() = Fault::Unavailable;
    let d = Dispatcher::builder(w.client_db.intents())
        .config(w.config.clone())
        .policy("points.award", w.policy.clone())
        .build()
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        d.run(async {
            let _ = stopped.await;
        })
        .await
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while w.status().await != "1" {
        assert!(tokio::time::Instant::now() < deadline, "never delivered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("run stops on shutdown")
        .unwrap()
        .unwrap();
    assert_eq!(
        w.awards().await,
        1,
        "the 503 was retried once, applied once"
    );
    let seen = w.faults.keys_seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0], seen[1]);
}

/// `run` shows its pipeline in gauges: claims counted while it runs, and after a clean stop
/// nothing in flight, reserved or buffered (the gauges a dispatcher that stopped claiming is
/// diagnosed with).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_reports_its_claims_and_an_empty_pipeline_after_a_clean_stop() {
    let w = world().await;
    w.record(7).await;
    let registry = prometheus::Registry::new();
    let d = std::sync::Arc::new(
        Dispatcher::builder(w.client_db.intents())
            .config(w.config.clone())
            .policy("points.award", w.policy.clone())
            .metrics(&registry)
            .build()
            .unwrap(),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = d.clone();
    let run = tokio::spawn(async move {
        running
            .run(async {
                let _ = stopped.await;
            })
            .await
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while w.awards().await != 1 {
        assert!(tokio::time::Instant::now() < deadline, "never delivered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("run stops on shutdown")
        .unwrap()
        .unwrap();
    let m = d.metrics();
    assert!(m.claims.get() >= 1);
    assert_eq!(
        (m.in_flight.get(), m.reserved.get(), m.buffered.get()),
        (0, 0, 0)
    );
    let names: Vec<String> = registry
        .gather()
        .iter()
        .map(|f| f.name().to_owned())
        .collect();
    assert!(
        names.iter().any(|n| n == "idem_effect_claims_total"),
        "{names:?}"
    );
}
