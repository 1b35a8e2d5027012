//! `Dispatcher::run` as a pipeline against the reference points API on a loopback port: one
//! request held at the remote does not stall the others (no barrier per claim); outcomes are
//! written in batches, on shutdown too; a kill loses only the buffered outcomes, whose intents
//! are sent again with the same key (PostgreSQL and SQLite); an outcome of an attempt taken over
//! is fenced and counted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::Response;
use idem_conformance::backend::{Backend, Lite, OpenTx, Pg};
use idem_conformance::process::eventually;
use idem_core::EventId;
use idem_core::idempotency::{EffectIntent, IntentStore};
use idem_effects::{Dispatcher, DispatcherConfig, EffectMetrics, IntentStatus};
use idem_reference::points::{PointsDb, router};

mod support;

/// What the remote has seen, and the one payment it holds until released.
#[derive(Clone)]
struct Remote {
    /// Idempotency-Key of every POST, in arrival order.
    keys: Arc<Mutex<Vec<String>>>,
    /// POSTs of this payment wait for `released` before they reach the API.
    hold: Arc<Mutex<Option<String>>>,
    /// How many held requests arrived.
    held: Arc<tokio::sync::watch::Sender<usize>>,
    released: Arc<tokio::sync::watch::Sender<bool>>,
}

async fn remote_mw(State(r): State<Remote>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
    if let Some(k) = parts.headers.get("idempotency-key") {
        r.keys.lock().unwrap().push(k.to_str().unwrap().to_owned());
    }
    let payment = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get("payment_id")?.as_str().map(str::to_owned));
    let held = payment.is_some() && *r.hold.lock().unwrap() == payment;
    if held {
        r.held.send_modify(|n| *n += 1);
        let mut released = r.released.subscribe();
        released.wait_for(|r| *r).await.unwrap();
    }
    next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
        .await
}

/// A client database `B`, the points API over its own SQLite database, and the remote's view.
struct World<B: Backend> {
    client: B,
    _server: Lite,
    server_pool: sqlx::SqlitePool,
    target: String,
    remote: Remote,
}

async fn world<B: Backend>(client: B) -> World<B> {
    let server = Lite::new().await;
    let server_pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", server.path().display()))
        .await
        .unwrap();
    idem_reference::ensure_schema_sqlite(&server_pool)
        .await
        .unwrap();
    let remote = Remote {
        keys: Arc::default(),
        hold: Arc::default(),
        held: Arc::new(tokio::sync::watch::channel(0).0),
        released: Arc::new(tokio::sync::watch::channel(false).0),
    };
    let app = router(
        PointsDb::Sqlite(server_pool.clone()),
        server.keys(),
        idem_http::IdempotencyConfig::default(),
    )
    .layer(from_fn_with_state(remote.clone(), remote_mw));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = format!("http://{}/awards", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    World {
        client,
        _server: server,
        server_pool,
        target,
        remote,
    }
}

/// Settings with a request timeout no test reaches (a held request is never timed out).
fn config(tune: impl FnOnce(DispatcherConfig) -> DispatcherConfig) -> DispatcherConfig {
    tune(DispatcherConfig {
        timeout: Duration::from_secs(60),
        lease: Duration::from_secs(180),
        retry_backoff: Duration::ZERO,
        authorization: Some("Bearer settlement".into()),
        concurrency: 4,
        ..DispatcherConfig::default()
    })
}

/// Outcomes written only when 1000 wait or after an hour: only shutdown (or nothing) writes.
fn buffered(c: DispatcherConfig) -> DispatcherConfig {
    DispatcherConfig {
        outcome_batch: 1000,
        outcome_delay: Duration::from_secs(3600),
        ..c
    }
}

impl<B: Backend> World<B> {
    fn dispatcher_over<S: IntentStore>(&self, store: S, c: DispatcherConfig) -> Dispatcher<S> {
        Dispatcher::new(
            store,
            c,
            EffectMetrics::new(&prometheus::Registry::new()).unwrap(),
        )
        .unwrap()
    }

    fn dispatcher(&self, c: DispatcherConfig) -> Dispatcher<B::Intents> {
        self.dispatcher_over(self.client.intents(), c)
    }

    /// Records one intent per payment; their keys.
    async fn record(&self, payments: &[String]) -> Vec<String> {
        let mut tx = self.client.begin().await;
        let mut keys = vec![];
        for p in payments {
            let intent = EffectIntent {
                event_id: EventId::new(),
                effect: "points.award".into(),
                target: self.target.clone(),
                body: serde_json::json!({"order_id": "o", "payment_id": p, "points": 3}),
                traceparent: None,
            };
            keys.push(intent.key().unwrap().header_value());
            assert!(tx.record_intent(&intent).await.unwrap());
        }
        tx.commit().await;
        keys
    }

    async fn done(&self) -> i64 {
        self.client
            .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'done'")
            .await
    }

    async fn awards(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM points_awards")
            .fetch_one(&self.server_pool)
            .await
            .unwrap()
    }

    fn keys(&self) -> Vec<String> {
        self.remote.keys.lock().unwrap().clone()
    }
}

fn payments(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("pay-{i}")).collect()
}

/// The successes counted by `d` for `target`.
fn successes_at<S: IntentStore>(d: &Dispatcher<S>, target: &str) -> u64 {
    let host = target
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap();
    d.metrics()
        .successes
        .with_label_values(&["points.award", host])
        .get()
}

/// The barrier as reported: `run` claimed `concurrency` intents and waited for all of them
/// before claiming again, so one request held by the remote (up to the 10 s timeout) stalled
/// every other intent. Now the held request keeps its slot and the others flow past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_that_hangs_for_one_key_does_not_stall_the_others() {
    let w = world(Lite::new().await).await;
    *w.remote.hold.lock().unwrap() = Some("pay-slow".into());
    w.record(&["pay-slow".to_owned()]).await; // first in claim order
    let others = payments(12);
    w.record(&others).await;
    let d = w.dispatcher(config(|c| c));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        d.run(async {
            let _ = stopped.await;
        })
        .await
    });
    let mut held = w.remote.held.subscribe();
    held.wait_for(|n| *n == 1).await.unwrap();
    eventually(
        "the 12 other intents to be done while one request is held",
        Duration::from_secs(30),
        || async { (w.done().await == 12).then_some(()) },
    )
    .await;
    assert!(
        !*w.remote.released.borrow(),
        "the slow request is still held"
    );
    assert_eq!(
        w.awards().await,
        12,
        "the held award has not reached the API"
    );
    w.remote.released.send_replace(true);
    eventually(
        "the held intent to be done",
        Duration::from_secs(30),
        || async { (w.done().await == 13).then_some(()) },
    )
    .await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(w.awards().await, 13);
    assert_eq!(w.keys().len(), 13, "every intent sent once");
}

/// Runs `d` until every one of `n` intents got its answer (counted as a success), then ends it
/// with `end`: a shutdown signal, or the run future dropped as a kill would end it.
async fn run_until_answered<S: IntentStore>(
    d: Dispatcher<S>,
    target: &str,
    n: u64,
    kill: bool,
) -> Option<idem_core::Result<()>> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let d = Arc::new(d);
    let runner = Arc::clone(&d);
    let run = tokio::spawn(async move {
        runner
            .run(async {
                let _ = stopped.await;
            })
            .await
    });
    eventually("every answer", Duration::from_secs(30), || async {
        (successes_at(&d, target) == n).then_some(())
    })
    .await;
    if kill {
        run.abort();
        assert!(run.await.unwrap_err().is_cancelled());
        return None;
    }
    stop.send(()).unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(30), run).await;
    Some(ended.expect("run ends on shutdown").unwrap())
}

async fn a_kill_loses_only_the_buffered_outcomes<B: Backend>(client: B) {
    let w = world(client).await;
    let keys = w.record(&payments(6)).await;
    let first = w.dispatcher(config(buffered));
    assert!(
        run_until_answered(first, &w.target, 6, true)
            .await
            .is_none(),
        "killed"
    );
    assert_eq!(w.awards().await, 6, "the remote applied every award");
    assert_eq!(
        w.done().await,
        0,
        "the buffered outcomes died with the dispatcher"
    );
    assert_eq!(
        w.client
            .scalar(
                "SELECT count(*) FROM idem_effect_intents WHERE status = 'pending' AND attempts = 1"
            )
            .await,
        6
    );
    w.client.expire_intent_leases().await; // the lease runs out
    let second = w.dispatcher(config(|c| c));
    assert_eq!(
        run_until_answered(second, &w.target, 6, false)
            .await
            .map(|r| r.is_ok()),
        Some(true)
    );
    assert_eq!(w.done().await, 6);
    assert_eq!(
        w.awards().await,
        6,
        "the re-sends were replayed, not applied"
    );
    let mut seen: HashMap<String, usize> = HashMap::new();
    for k in w.keys() {
        *seen.entry(k).or_default() += 1;
    }
    let expected: HashMap<String, usize> = keys.into_iter().map(|k| (k, 2)).collect();
    assert_eq!(seen, expected, "each intent sent twice, with its one key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_loses_only_the_buffered_outcomes_and_they_are_resent_with_the_same_key_on_postgres()
{
    a_kill_loses_only_the_buffered_outcomes(Pg::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_loses_only_the_buffered_outcomes_and_they_are_resent_with_the_same_key_on_sqlite() {
    a_kill_loses_only_the_buffered_outcomes(Lite::new().await).await;
}

async fn shutdown_records_the_buffered_outcomes<B: Backend>(client: B) {
    let w = world(client).await;
    w.record(&payments(9)).await;
    let d = w.dispatcher(config(buffered));
    assert_eq!(
        run_until_answered(d, &w.target, 9, false)
            .await
            .map(|r| r.is_ok()),
        Some(true)
    );
    assert_eq!(w.done().await, 9, "written on shutdown");
    assert_eq!((w.awards().await, w.keys().len()), (9, 9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_records_every_buffered_outcome_on_postgres() {
    shutdown_records_the_buffered_outcomes(Pg::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_records_every_buffered_outcome_on_sqlite() {
    shutdown_records_the_buffered_outcomes(Lite::new().await).await;
}

/// A batch holding the outcome of an attempt whose claim expired and was taken again: that
/// outcome changes nothing (the new attempt keeps the intent), the others are recorded, and the
/// fenced one is counted in `idem_effect_fenced_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_of_a_taken_over_attempt_is_fenced_and_counted() {
    let w = world(Lite::new().await).await;
    w.record(&payments(3)).await;
    let victim = w
        .client
        .scalar("SELECT min(id) FROM idem_effect_intents")
        .await;
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", w.client.path().display()))
        .await
        .unwrap();
    // Before the batch is written, the victim's lease runs out and another dispatcher claims
    // it: the batch then holds one stale attempt.
    let other = w.client.intents();
    let store = support::HookedFinish {
        inner: w.client.intents(),
        hook: Arc::new(move |_| {
            let (pool, other) = (pool.clone(), other.clone());
            Box::pin(async move {
                sqlx::query("UPDATE idem_effect_intents SET claimed_until = 0 WHERE id = ?1")
                    .bind(victim)
                    .execute(&pool)
                    .await
                    .unwrap();
                let taken = other.claim(10, Duration::from_secs(60)).await?;
                assert_eq!(
                    taken.iter().map(|c| (c.id, c.attempt)).collect::<Vec<_>>(),
                    vec![(victim, 2)],
                    "only the victim's lease ran out"
                );
                Ok(())
            })
        }),
    };
    let d = w.dispatcher_over(store, config(|c| c));
    assert_eq!(d.run_once().await.unwrap(), 3);
    let mut statuses = HashSet::new();
    for id in [victim, victim + 1, victim + 2] {
        statuses.insert((id, w.client.intents().get(id).await.unwrap().unwrap().1));
    }
    let expected: HashSet<(i64, IntentStatus)> = [
        (victim, IntentStatus::Pending),
        (victim + 1, IntentStatus::Done),
        (victim + 2, IntentStatus::Done),
    ]
    .into_iter()
    .collect();
    assert_eq!(statuses, expected, "the stale outcome changed nothing");
    let host = w
        .target
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap();
    assert_eq!(
        d.metrics()
            .fenced
            .with_label_values(&["points.award", host])
            .get(),
        1
    );
    assert_eq!(
        w.client
            .scalar(&format!(
                "SELECT attempts FROM idem_effect_intents WHERE id = {victim}"
            ))
            .await,
        2,
        "the new attempt holds the intent"
    );
}
