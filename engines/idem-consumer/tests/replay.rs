//! `idem_consumer::replay` on real PostgreSQL and SQLite: dead letters made by the consumer
//! itself, replayed through the handler once, whatever races them. And the
//! `transient-dead-letters` negative control: broken, the consumer dead-letters an event after a
//! few transient failures (the policy that loses an event behind a held lock), so a harness that drives transient
//! failures must see a loss. A broken mechanism stays broken for the whole process: that test
//! runs this binary again as a child process that breaks it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use idem_conformance::backend::{Backend, Lite, Pg};
use idem_conformance::process::eventually;
use idem_conformance::records::NoSource;
use idem_consumer::replay::{ReplayRequest, ReplayResult, preview, replay};
use idem_consumer::{
    Consumer, ConsumerConfig, ConsumerMetrics, Handler, HandlerContext, HandlerError,
};
use idem_core::crash::{BROKEN_TRANSIENT_BUDGET, Mechanism};
use idem_core::store::{Delivery, InboxStore};
use idem_core::{EventId, InboundEvent};
use tokio::sync::Semaphore;

const GROUP: &str = "settlement";

/// Writes one `replay_effects` row per call that succeeds (no unique key: a second application
/// shows as a second row). Refuses every event while `refuse` is set, fails transiently while
/// `flaky` is; when `gate` is set, each call first waits for a permit from it.
#[derive(Clone, Default)]
struct Effects {
    refuse: Arc<AtomicBool>,
    flaky: Arc<AtomicBool>,
    gate: Option<Arc<Semaphore>>,
    /// Calls begun (counted before the gate).
    entered: Arc<AtomicU32>,
}

impl Effects {
    async fn precheck(&self) -> std::result::Result<(), HandlerError> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        if let Some(gate) = &self.gate {
            gate.acquire().await.unwrap().forget();
        }
        if self.refuse.load(Ordering::SeqCst) {
            return Err(HandlerError::permanent("the order is unknown"));
        }
        if self.flaky.load(Ordering::SeqCst) {
            return Err(HandlerError::transient("the orders table is locked"));
        }
        Ok(())
    }
}

macro_rules! effects_handler {
    ($conn:ty, $sql:literal) => {
        impl Handler<$conn> for Effects {
            async fn handle(
                &self,
                cx: &mut HandlerContext<'_, $conn>,
                e: &InboundEvent,
            ) -> std::result::Result<(), HandlerError> {
                cx.effects().post(
                    "test.effect",
                    "http://127.0.0.1:9/effects",
                    serde_json::json!({}),
                )?;
                self.precheck().await?;
                sqlx::query($sql)
                    .bind(e.event_id.to_string())
                    .execute(cx.conn())
                    .await
                    .map_err(HandlerError::transient)?;
                Ok(())
            }
        }
    };
}
effects_handler!(
    sqlx::PgConnection,
    "INSERT INTO replay_effects (event_id) VALUES ($1)"
);
effects_handler!(
    sqlx::SqliteConnection,
    "INSERT INTO replay_effects (event_id) VALUES (?1)"
);

fn record(offset: i64, id: EventId) -> Delivery {
    Delivery {
        topic: "outbox.event.order".into(),
        partition: 0,
        offset,
        key: Some("o-1".into()),
        payload: Some(br#"{"order_id":"o-1","amount":"1.00"}"#.to_vec()),
        headers: vec![
            ("ce_id".into(), id.to_string()),
            ("ce_type".into(), "order.paid".into()),
            ("idem_aggregate_type".into(), "order".into()),
            ("idem_aggregate_id".into(), "o-1".into()),
        ],
        timestamp: None,
    }
}

fn consumer<B: Backend>(b: &B, h: Effects) -> Consumer<B::Inbox, Effects, NoSource>
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let mut config = ConsumerConfig::new(GROUP);
    config.retry_backoff = Duration::ZERO;
    let metrics = ConsumerMetrics::new(&prometheus::Registry::new()).unwrap();
    Consumer::new(b.inbox(), h, NoSource, config, metrics)
}

/// Members of the group running (`Consumer::run` over a source that never delivers), looking
/// for requested replays every 20 ms, until the guard is dropped.
struct Running(
    Vec<tokio::task::JoinHandle<()>>,
    tokio::sync::watch::Sender<bool>,
);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.1.send(true);
        for t in &self.0 {
            t.abort();
        }
    }
}

fn running<B: Backend>(b: &B, h: &Effects, members: usize) -> Running
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let (stop, rx) = tokio::sync::watch::channel(false);
    let tasks = (0..members)
        .map(|_| {
            let mut config = ConsumerConfig::new(GROUP);
            config.replay_poll = Duration::from_millis(20);
            let metrics = ConsumerMetrics::unregistered().unwrap();
            let c = Consumer::new(b.inbox(), h.clone(), NoSource, config, metrics);
            let mut rx = rx.clone();
            tokio::spawn(async move {
                c.run(async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await
                .unwrap();
            })
        })
        .collect();
    Running(tasks, stop)
}

/// Waits until no replay of `letter` is requested any more, and returns the letter.
async fn served<B: Backend>(b: &B, letter: i64) -> idem_core::store::StoredDeadLetter {
    eventually(
        "the requested replay served",
        Duration::from_secs(20),
        || async {
            let l = b.inbox().find_dead_letter(GROUP, letter).await.unwrap()?;
            l.replay_requested_at.is_none().then_some(l)
        },
    )
    .await
}

fn request(only: Option<i64>, dry_run: bool) -> ReplayRequest {
    ReplayRequest {
        group: GROUP.into(),
        only,
        dry_run,
        by: "ops@example".into(),
    }
}

/// A fresh database with one event the handler refused: its id and the letter's id.
async fn dead_lettered<B: Backend>(b: &B) -> (EventId, i64)
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    b.exec("CREATE TABLE replay_effects (event_id text NOT NULL)")
        .await
        .unwrap();
    let refusing = Effects::default();
    refusing.refuse.store(true, Ordering::SeqCst);
    let id = EventId::new();
    let r = consumer(b, refusing)
        .process(&[record(0, id)])
        .await
        .unwrap();
    assert_eq!(r.dead_lettered, 1);
    assert_eq!(inbox_status(b, id).await, "dead_lettered");
    let letters = b.inbox().dead_letters(GROUP, 10).await.unwrap();
    (id, letters[0].id)
}

/// A fresh database with `n` (1 or 2) records dead-lettered because they do not decode: one
/// without an event id, then one whose value is not JSON. Returns the handler.
async fn undecodable<B: Backend>(b: &B, n: usize) -> Effects
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    b.exec("CREATE TABLE replay_effects (event_id text NOT NULL)")
        .await
        .unwrap();
    let mut no_id = record(0, EventId::new());
    no_id.headers.retain(|(k, _)| k != "ce_id");
    let mut not_json = record(1, EventId::new());
    not_json.payload = Some(b"{oops".to_vec());
    let h = Effects::default();
    let records = [no_id, not_json];
    let r = consumer(b, h.clone()).process(&records[..n]).await.unwrap();
    assert_eq!(r.dead_lettered, n as u64);
    h
}

async fn effects<B: Backend>(b: &B) -> i64 {
    b.scalar("SELECT count(*) FROM replay_effects").await
}

async fn inbox_status<B: Backend>(b: &B, id: EventId) -> String {
    let processed = b
        .scalar(&format!(
            "SELECT count(*) FROM idem_inbox WHERE event_id = '{id}' AND status = 'processed'"
        ))
        .await;
    let dead = b
        .scalar(&format!(
            "SELECT count(*) FROM idem_inbox WHERE event_id = '{id}' AND status = 'dead_lettered'"
        ))
        .await;
    match (processed, dead) {
        (1, 0) => "processed".into(),
        (0, 1) => "dead_lettered".into(),
        other => format!("{other:?}"),
    }
}

async fn a_replay_applies_the_event_once_and_closes_the_letter<B: Backend>(b: B)
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let (id, letter) = dead_lettered(&b).await;
    let h = Effects::default();
    let done = replay(&b.inbox(), &h, &request(None, false)).await.unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(
        (done[0].id, done[0].event_id, &done[0].result),
        (letter, Some(id), &ReplayResult::Applied)
    );
    assert_eq!(effects(&b).await, 1);
    assert_eq!(inbox_status(&b, id).await, "processed");
    let stored = b.inbox().dead_letters(GROUP, 10).await.unwrap();
    assert_eq!(stored.len(), 1, "the letter is kept, marked");
    assert_eq!(stored[0].replay_outcome.as_deref(), Some("applied"));
    assert_eq!(stored[0].replayed_by.as_deref(), Some("ops@example"));
    assert!(stored[0].replayed_at.is_some());
    // A redelivery of the record afterwards is a duplicate.
    let r = consumer(&b, h).process(&[record(1, id)]).await.unwrap();
    assert_eq!((r.processed, r.duplicate_skips), (0, 1));
    assert_eq!(effects(&b).await, 1);
}

async fn a_replay_twice_applies_once<B: Backend>(b: B)
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let (_, letter) = dead_lettered(&b).await;
    let h = Effects::default();
    let first = replay(&b.inbox(), &h, &request(Some(letter), false))
        .await
        .unwrap();
    assert_eq!(first[0].result, ReplayResult::Applied);
    for only in [Some(letter), None] {
        let again = replay(&b.inbox(), &h, &request(only, false)).await.unwrap();
        assert!(
            again.is_empty(),
            "a closed letter is not replayed: {again:?}"
        );
    }
    // Even a letter reopened by hand (or a replay that read it before the first committed) finds
    // the inbox row processed and applies nothing.
    b.exec("UPDATE idem_dead_letters SET replay_outcome = NULL")
        .await
        .unwrap();
    let forced = replay(&b.inbox(), &h, &request(None, false)).await.unwrap();
    assert_eq!(forced[0].result, ReplayResult::AlreadyApplied);
    assert_eq!(effects(&b).await, 1);
    assert_eq!(
        b.scalar("SELECT count(*) FROM idem_effect_intents").await,
        1,
        "the refused delivery recorded no effect, the replay recorded one"
    );
    let stored = b.inbox().dead_letters(GROUP, 10).await.unwrap();
    assert_eq!(stored[0].replay_outcome.as_deref(), Some("already_applied"));
}

async fn a_dry_run_lists_and_changes_nothing<B: Backend>(b: B)
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let (id, letter) = dead_lettered(&b).await;
    let before = b.inbox().dead_letters(GROUP, 10).await.unwrap();
    let h = Effects::default();
    let listed = replay(&b.inbox(), &h, &request(None, true)).await.unwrap();
    assert_eq!(
        (listed[0].id, &listed[0].result),
        (letter, &ReplayResult::WouldReplay)
    );
    assert_eq!(preview(&b.inbox(), GROUP, None).await.unwrap(), listed);
    assert_eq!(b.inbox().dead_letters(GROUP, 10).await.unwrap(), before);
    assert_eq!(effects(&b).await, 0);
    assert_eq!(inbox_status(&b, id).await, "dead_lettered");
    let real = replay(&b.inbox(), &h, &request(None, false)).await.unwrap();
    assert_eq!(real[0].result, ReplayResult::Applied, "still replayable");
}

async fn a_failing_replay_keeps_the_letter_with_the_new_reason<B: Backend>(b: B)
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let (id, _) = dead_lettered(&b).await;
    let h = Effects::default();
    h.flaky.store(true, Ordering::SeqCst);
    let failed = replay(&b.inbox(), &h, &request(None, false)).await.unwrap();
    let ReplayResult::Failed(reason) = &failed[0].result else {
        panic!("{failed:?}");
    };
    assert!(reason.contains("the orders table is locked"), "{reason}");
    assert_eq!(effects(&b).await, 0);
    assert_eq!(inbox_status(&b, id).await, "dead_lettered", "rolled back");
    let stored = b.inbox().dead_letters(GROUP, 10).await.unwrap();
    assert_eq!(stored[0].reason, *reason, "the new reason");
    assert_eq!(stored[0].replay_outcome.as_deref(), Some("failed"));
    h.flaky.store(false, Ordering::SeqCst);
    let later = replay(&b.inbox(), &h, &request(None, false)).await.unwrap();
    assert_eq!(later[0].result, ReplayResult::Applied, "still open");
    assert_eq!(effects(&b).await, 1);
}

async fn an_undecodable_letter_is_reported_and_left_alone<B: Backend>(b: B)
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let h = undecodable(&b, 2).await;
    let before = b.inbox().dead_letters(GROUP, 10).await.unwrap();
    let done = replay(&b.inbox(), &h, &request(None, false)).await.unwrap();
    assert!(
        matches!(&done[0].result, ReplayResult::Undecodable(r) if r.contains("no ce_id")),
        "{done:?}"
    );
    assert!(
        matches!(&done[1].result, ReplayResult::Undecodable(r) if r.contains("not valid JSON")),
        "{done:?}"
    );
    assert_eq!(b.inbox().dead_letters(GROUP, 10).await.unwrap(), before);
    assert_eq!(effects(&b).await, 0);
}

async fn a_conflicting_copy_is_never_applied_by_a_replay<B: Backend>(b: B)
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    b.exec("CREATE TABLE replay_effects (event_id text NOT NULL)")
        .await
        .unwrap();
    let h = Effects::default();
    let id = EventId::new();
    let mut other = record(1, id);
    other.payload = Some(br#"{"order_id":"o-1","amount":"999.00"}"#.to_vec());
    let mut c = consumer(&b, h.clone());
    assert_eq!(c.process(&[record(0, id)]).await.unwrap().processed, 1);
    assert_eq!(c.process(&[other]).await.unwrap().conflicts, 1);
    let done = replay(&b.inbox(), &h, &request(None, false)).await.unwrap();
    assert_eq!(done[0].result, ReplayResult::AlreadyApplied, "{done:?}");
    assert_eq!(effects(&b).await, 1, "the conflicting copy was not applied");
    let again = replay(&b.inbox(), &h, &request(None, false)).await.unwrap();
    assert!(again.is_empty(), "the conflict letter is closed");
}

/// Two replays of one letter at once (PostgreSQL: concurrent writers). The first is held inside
/// the handler until the second waits on the inbox row; then the second finds it processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_concurrent_replays_apply_once() {
    let b = Pg::new().await;
    let (_, _) = dead_lettered(&b).await;
    let gate = Arc::new(Semaphore::new(0));
    let h = Effects {
        gate: Some(gate.clone()),
        ..Effects::default()
    };
    let first = tokio::spawn({
        let (inbox, h) = (b.inbox(), h.clone());
        async move { replay(&inbox, &h, &request(None, false)).await.unwrap() }
    });
    let second = tokio::spawn({
        let (inbox, h) = (b.inbox(), h.clone());
        async move { replay(&inbox, &h, &request(None, false)).await.unwrap() }
    });
    eventually(
        "one replay to wait on the other's inbox row",
        Duration::from_secs(30),
        || async { (b.lock_waiters().await >= 1).then_some(()) },
    )
    .await;
    gate.add_permits(2);
    let mut results: Vec<ReplayResult> = [first.await.unwrap(), second.await.unwrap()]
        .into_iter()
        .flatten()
        .map(|r| r.result)
        .collect();
    results.sort_by_key(|r| format!("{r:?}"));
    assert_eq!(
        results,
        vec![ReplayResult::AlreadyApplied, ReplayResult::Applied]
    );
    assert_eq!(effects(&b).await, 1);
    let stored = b.inbox().dead_letters(GROUP, 10).await.unwrap();
    assert_eq!(stored[0].replay_outcome.as_deref(), Some("applied"));
}

/// A redelivery of the record while a replay applies it: the redelivery's inbox insert waits
/// for the replay's transaction and then skips the event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_replay_racing_a_redelivery_applies_once() {
    let b = Pg::new().await;
    let (id, _) = dead_lettered(&b).await;
    let gate = Arc::new(Semaphore::new(0));
    let held = Effects {
        gate: Some(gate.clone()),
        ..Effects::default()
    };
    let entered = held.entered.clone();
    let replaying = tokio::spawn({
        let inbox = b.inbox();
        async move { replay(&inbox, &held, &request(None, false)).await.unwrap() }
    });
    eventually(
        "the replay to hold the inbox row (inside the handler)",
        Duration::from_secs(30),
        || async { (entered.load(Ordering::SeqCst) >= 1).then_some(()) },
    )
    .await;
    let mut redelivery = consumer(&b, Effects::default());
    let redelivered = tokio::spawn(async move { redelivery.process(&[record(7, id)]).await });
    eventually(
        "the redelivery to wait on the replay's inbox row",
        Duration::from_secs(30),
        || async { (b.lock_waiters().await >= 1).then_some(()) },
    )
    .await;
    gate.add_permits(1);
    assert_eq!(replaying.await.unwrap()[0].result, ReplayResult::Applied);
    let r = redelivered.await.unwrap().unwrap();
    assert_eq!((r.processed, r.duplicate_skips), (0, 1));
    assert_eq!(effects(&b).await, 1);
}

async fn a_requested_replay_is_served_once_by_the_running_consumers<B: Backend>(b: B)
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let (id, letter) = dead_lettered(&b).await;
    let h = Effects::default();
    let _members = running(&b, &h, 2);
    let requested = b
        .inbox()
        .request_replays(GROUP, None, None, "ops@example")
        .await
        .unwrap();
    assert_eq!(requested, vec![letter]);
    let stored = served(&b, letter).await;
    assert_eq!(stored.replay_outcome.as_deref(), Some("applied"));
    assert_eq!(stored.replayed_by.as_deref(), Some("ops@example"));
    assert_eq!(stored.replay_requested_by, None, "the request is served");
    assert_eq!(inbox_status(&b, id).await, "processed");
    assert_eq!(effects(&b).await, 1, "two members served one request once");
    let again = b
        .inbox()
        .request_replays(GROUP, None, None, "ops")
        .await
        .unwrap();
    assert!(
        again.is_empty(),
        "a closed letter is not requested: {again:?}"
    );
    let forced = b
        .inbox()
        .request_replays(GROUP, Some(letter), None, "ops")
        .await
        .unwrap();
    assert!(forced.is_empty(), "not by id either: {forced:?}");
    assert_eq!(effects(&b).await, 1);
}

async fn a_failed_request_is_served_and_the_letter_stays_open<B: Backend>(b: B)
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let (id, letter) = dead_lettered(&b).await;
    let h = Effects::default();
    h.flaky.store(true, Ordering::SeqCst);
    let _members = running(&b, &h, 1);
    b.inbox()
        .request_replays(GROUP, None, None, "ops")
        .await
        .unwrap();
    let stored = served(&b, letter).await;
    assert_eq!(stored.replay_outcome.as_deref(), Some("failed"));
    assert!(
        stored.reason.contains("the orders table is locked"),
        "{stored:?}"
    );
    assert_eq!(inbox_status(&b, id).await, "dead_lettered", "rolled back");
    assert_eq!(effects(&b).await, 0);
    h.flaky.store(false, Ordering::SeqCst);
    let requested = b
        .inbox()
        .request_replays(GROUP, Some(letter), None, "ops")
        .await
        .unwrap();
    assert_eq!(
        requested,
        vec![letter],
        "a failed letter can be requested again"
    );
    assert_eq!(
        served(&b, letter).await.replay_outcome.as_deref(),
        Some("applied")
    );
    assert_eq!(effects(&b).await, 1);
}

async fn an_undecodable_request_is_served_as_failed_with_the_reason<B: Backend>(b: B)
where
    Effects: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let h = undecodable(&b, 1).await;
    let dry = preview(&b.inbox(), GROUP, None).await.unwrap();
    assert!(
        matches!(&dry[0].result, ReplayResult::Undecodable(r) if r.contains("no ce_id")),
        "{dry:?}"
    );
    let _members = running(&b, &h, 1);
    let requested = b
        .inbox()
        .request_replays(GROUP, None, None, "ops")
        .await
        .unwrap();
    let stored = served(&b, requested[0]).await;
    assert_eq!(stored.replay_outcome.as_deref(), Some("failed"));
    assert!(stored.reason.contains("does not decode"), "{stored:?}");
    assert_eq!(effects(&b).await, 0);
}

macro_rules! both_stores {
    ($($name:ident),* $(,)?) => {
        mod postgres {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(Pg::new().await).await;
                }
            )*
        }
        mod sqlite {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(Lite::new().await).await;
                }
            )*
        }
    };
}

both_stores!(
    a_replay_applies_the_event_once_and_closes_the_letter,
    a_replay_twice_applies_once,
    a_dry_run_lists_and_changes_nothing,
    a_failing_replay_keeps_the_letter_with_the_new_reason,
    an_undecodable_letter_is_reported_and_left_alone,
    a_conflicting_copy_is_never_applied_by_a_replay,
    a_requested_replay_is_served_once_by_the_running_consumers,
    a_failed_request_is_served_and_the_letter_stays_open,
    an_undecodable_request_is_served_as_failed_with_the_reason,
);

// ---- the transient-dead-letters negative control ------------------------------------------

/// Fails transiently `failures` times, then succeeds.
struct Flaky(Arc<AtomicU32>);

impl Handler<sqlx::SqliteConnection> for Flaky {
    async fn handle(
        &self,
        _cx: &mut HandlerContext<'_, sqlx::SqliteConnection>,
        _e: &InboundEvent,
    ) -> std::result::Result<(), HandlerError> {
        let left = self.0.load(Ordering::SeqCst);
        if left > 0 {
            self.0.store(left - 1, Ordering::SeqCst);
            return Err(HandlerError::transient("lock timeout"));
        }
        Ok(())
    }
}

#[test]
fn the_transient_dead_letters_control_brings_back_the_defect() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "broken_run", "--ignored", "--nocapture"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
#[ignore = "run by the_transient_dead_letters_control_brings_back_the_defect in a child process"]
async fn broken_run() {
    idem_core::crash::break_mechanism(Mechanism::TransientDeadLetters).unwrap();
    assert!(idem_core::crash::broken(Mechanism::TransientDeadLetters));
    let b = Lite::new().await;
    let mut config = ConsumerConfig::new(GROUP);
    config.retry_backoff = Duration::ZERO;
    let handler = Flaky(Arc::new(AtomicU32::new(BROKEN_TRANSIENT_BUDGET + 5)));
    let metrics = ConsumerMetrics::new(&prometheus::Registry::new()).unwrap();
    let mut consumer = Consumer::new(b.inbox(), handler, NoSource, config, metrics);
    let r = consumer
        .process(&[record(0, EventId::new())])
        .await
        .unwrap();
    assert_eq!(
        (r.processed, r.dead_lettered),
        (0, 1),
        "the control did not break the mechanism"
    );
    let letters = consumer
        .inbox()
        .dead_letters("settlement", 10)
        .await
        .unwrap();
    assert!(
        letters[0].reason.contains("transient failures"),
        "{letters:?}"
    );
}
