//! Engine tests against a real SQLite outbox and a scripted publisher. The guarantees against a
//! real broker are tested in `tests/e2e` (mock cluster) and `lab/idem-lab/tests` (Apache Kafka).

use std::collections::HashMap;
use std::sync::Mutex;

use idem_core::crash::{self, CrashPoint};
use idem_core::outbox::{ClaimOutcome, ClaimRequest};
use idem_core::publish::{FailureKind, Message, PublishError};
use idem_core::{Event, TableNames};
use idem_sql::sqlite::SqliteStore;

use super::*;
use crate::cycle::produce_deadline;

/// Records every message; fails the event ids it is told to, with the given kind.
#[derive(Default)]
struct ScriptedPublisher {
    sent: Mutex<Vec<Message>>,
    fail: Mutex<HashMap<String, FailureKind>>,
    longest: Mutex<Option<Duration>>,
}

impl ScriptedPublisher {
    fn fail(&self, event_id: impl ToString, kind: FailureKind) {
        self.fail.lock().unwrap().insert(event_id.to_string(), kind);
    }
    fn heal(&self) {
        self.fail.lock().unwrap().clear();
    }
    fn sent_ids(&self) -> Vec<String> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .map(|m| header(m, "ce_id"))
            .collect()
    }
}

fn header(m: &Message, k: &str) -> String {
    m.headers
        .iter()
        .find(|(hk, _)| hk == k)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

impl Publisher for &'static ScriptedPublisher {
    async fn publish(&self, messages: &[Message]) -> Vec<std::result::Result<(), PublishError>> {
        let fail = self.fail.lock().unwrap().clone();
        let mut out = vec![];
        for m in messages {
            match fail.get(&header(m, "ce_id")) {
                Some(kind) => out.push(Err(PublishError {
                    kind: *kind,
                    reason: "scripted failure".into(),
                })),
                None => {
                    self.sent.lock().unwrap().push(m.clone());
                    out.push(Ok(()));
                }
            }
        }
        out
    }

    fn longest_publish(&self) -> Option<Duration> {
        *self.longest.lock().unwrap()
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    store: SqliteStore,
    publisher: &'static ScriptedPublisher,
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("outbox.db").display());
    let pool = idem_sql::sqlite::connect(&url).await.unwrap();
    idem_sql::sqlite::migrate(&pool, &TableNames::default())
        .await
        .unwrap();
    Fixture {
        _dir: dir,
        store: SqliteStore::new(pool, TableNames::default()),
        publisher: Box::leak(Box::default()),
    }
}

impl Fixture {
    async fn enqueue(&self, agg: &str, n: usize) -> Vec<Event> {
        let events: Vec<Event> = (0..n)
            .map(|i| {
                Event::builder("order", agg, "order.paid")
                    .payload(&serde_json::json!({ "i": i }))
                    .build()
                    .unwrap()
            })
            .collect();
        let mut tx = self.store.pool().begin().await.unwrap();
        self.store
            .outbox()
            .enqueue_all(&mut tx, &events)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        events
    }

    fn relay(&self, config: RelayConfig) -> Relay<SqliteStore, &'static ScriptedPublisher> {
        let metrics = RelayMetrics::new(&prometheus::Registry::new()).unwrap();
        Relay::new(self.store.clone(), self.publisher, config, metrics)
    }

    async fn expire_leases(&self) {
        sqlx::query("UPDATE idem_outbox SET claimed_until = 0, next_attempt_at = 0")
            .execute(self.store.pool())
            .await
            .unwrap();
    }
}

fn fast() -> RelayConfig {
    RelayConfig {
        retry_backoff: Duration::ZERO,
        max_attempts: 3,
        ..RelayConfig::default()
    }
}

#[tokio::test]
async fn publishes_each_aggregate_in_order_with_cloudevents_headers() {
    let f = fixture().await;
    let a = f.enqueue("a", 3).await;
    let b = f.enqueue("b", 2).await;
    let relay = f.relay(fast());
    let r = relay.run_once().await.unwrap();
    assert_eq!((r.claimed, r.published, r.republished), (5, 5, 0));
    let sent = f.publisher.sent.lock().unwrap().clone();
    let ids_of = |key: &str| {
        sent.iter()
            .filter(|m| m.key == key)
            .map(|m| header(m, "ce_id"))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        ids_of("a"),
        a.iter().map(|e| e.id().to_string()).collect::<Vec<_>>()
    );
    assert_eq!(
        ids_of("b"),
        b.iter().map(|e| e.id().to_string()).collect::<Vec<_>>()
    );
    let m = &sent[0];
    assert_eq!(m.topic, "outbox.event.order");
    for k in [
        "ce_specversion",
        "ce_id",
        "ce_type",
        "ce_source",
        "ce_time",
        "idem_aggregate_type",
        "idem_aggregate_id",
        "idem_attempt",
    ] {
        assert!(!header(m, k).is_empty(), "missing header {k}");
    }
    assert_eq!(header(m, "ce_type"), "order.paid");
    assert_eq!(header(m, "idem_attempt"), "1");
    assert_eq!(relay.store().status().await.unwrap().published, 5);
    assert_eq!(
        relay.run_once().await.unwrap().claimed,
        0,
        "published rows are not claimed again"
    );
}

#[tokio::test]
async fn a_later_row_is_not_marked_while_an_earlier_one_of_its_aggregate_failed() {
    let f = fixture().await;
    let a = f.enqueue("a", 2).await;
    f.publisher.fail(a[0].id(), FailureKind::Transient);
    let relay = f.relay(fast());
    let r = relay.run_once().await.unwrap();
    assert_eq!((r.claimed, r.published, r.retried), (2, 0, 2));
    assert_eq!(
        f.publisher.sent_ids(),
        vec![a[1].id().to_string()],
        "row 2 reached the broker"
    );
    f.publisher.heal();
    f.expire_leases().await;
    let r = relay.run_once().await.unwrap();
    assert_eq!((r.published, r.republished), (2, 2));
    assert_eq!(
        f.publisher.sent_ids(),
        vec![
            a[1].id().to_string(),
            a[0].id().to_string(),
            a[1].id().to_string()
        ],
        "after the retry, row 1 precedes a second copy of row 2"
    );
    assert_eq!(relay.metrics().republished_total(), 2);
}

#[tokio::test]
async fn permanent_failures_are_parked_without_blocking_other_aggregates() {
    let f = fixture().await;
    let bad = f.enqueue("bad", 1).await;
    let good = f.enqueue("good", 1).await;
    f.publisher.fail(bad[0].id(), FailureKind::Permanent);
    let relay = f.relay(fast());
    let r = relay.run_once().await.unwrap();
    assert_eq!((r.published, r.parked), (1, 0));
    assert_eq!(f.publisher.sent_ids(), vec![good[0].id().to_string()]);
    for attempt in 2..=3 {
        f.expire_leases().await;
        let r = relay.run_once().await.unwrap();
        assert_eq!(r.claimed, 1, "attempt {attempt}");
        assert_eq!(r.parked, u64::from(attempt == 3));
    }
    f.expire_leases().await;
    assert_eq!(
        relay.run_once().await.unwrap().claimed,
        0,
        "a parked row is not retried"
    );
    let parked = relay.store().parked(10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].last_error.as_deref(), Some("scripted failure"));
    assert_eq!(relay.store().status().await.unwrap().parked, 1);
    f.publisher.heal();
    assert_eq!(
        relay
            .store()
            .retry_parked(Some(&[bad[0].id()]))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        relay.run_once().await.unwrap().published,
        1,
        "a retried row is published"
    );
}

#[tokio::test]
async fn an_invalid_topic_is_never_sent_and_ends_parked() {
    let f = fixture().await;
    f.enqueue("a", 1).await;
    let mut config = fast();
    config.max_attempts = 1;
    config
        .topics
        .overrides
        .insert("order".into(), "no spaces allowed".into());
    let relay = f.relay(config);
    let r = relay.run_once().await.unwrap();
    assert_eq!((r.claimed, r.parked), (1, 1));
    assert!(f.publisher.sent_ids().is_empty());
    let parked = relay.store().parked(10).await.unwrap();
    assert!(
        parked[0]
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("no spaces allowed")
    );
}

#[tokio::test]
async fn not_sent_rows_do_not_count_as_attempts() {
    let f = fixture().await;
    let a = f.enqueue("a", 2).await;
    f.publisher.fail(a[0].id(), FailureKind::Transient);
    f.publisher.fail(a[1].id(), FailureKind::NotSent);
    let relay = f.relay(fast());
    relay.run_once().await.unwrap();
    f.publisher.heal();
    f.expire_leases().await;
    relay.run_once().await.unwrap();
    let sent = f.publisher.sent.lock().unwrap().clone();
    let attempts: Vec<(String, String)> = sent
        .iter()
        .map(|m| (header(m, "ce_id"), header(m, "idem_attempt")))
        .collect();
    assert_eq!(
        attempts,
        vec![
            (a[0].id().to_string(), "2".into()),
            (a[1].id().to_string(), "1".into())
        ]
    );
}

#[tokio::test]
async fn a_stale_relay_cannot_mark_rows_taken_over_by_another() {
    let f = fixture().await;
    f.enqueue("a", 1).await;
    let stale = f
        .store
        .claim(&ClaimRequest {
            relay_id: "stale".into(),
            batch_size: 10,
            lease: Duration::from_secs(60),
        })
        .await
        .unwrap();
    f.expire_leases().await;
    let relay = f.relay(fast());
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    let outcome = ClaimOutcome {
        published: vec![stale.records[0].id],
        failed: vec![],
    };
    let done = f.store.complete(&stale, &outcome).await.unwrap();
    assert_eq!((done.marked, done.fenced), (0, 1));
}

/// A publish that may last as long as the lease could still be producing when another relay
/// takes the rows over: such a batch is abandoned before anything is sent (a check that allows
/// a share of the lease for the claim, whatever the publish could take, would produce it).
#[tokio::test]
async fn a_batch_is_not_produced_when_the_lease_cannot_outlast_the_publish() {
    let f = fixture().await;
    f.enqueue("a", 2).await;
    let lease = Duration::from_secs(30);
    let relay = f.relay(RelayConfig { lease, ..fast() });
    *f.publisher.longest.lock().unwrap() = Some(lease);
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.published), (2, 0));
    assert!(f.publisher.sent_ids().is_empty(), "nothing may be produced");
    assert_eq!(relay.metrics.abandoned.get(), 2);
    // Once the publish fits in the lease, the same rows go out after the lease expires.
    *f.publisher.longest.lock().unwrap() = Some(lease / 2);
    f.expire_leases().await;
    assert_eq!(relay.run_once().await.unwrap().published, 2);
    assert_eq!(f.publisher.sent_ids().len(), 2);
}

#[test]
fn the_produce_deadline_leaves_the_longest_publish_inside_the_lease() {
    let t0 = Instant::now();
    let lease = Duration::from_secs(10);
    assert_eq!(
        produce_deadline(t0, lease, Some(Duration::from_secs(4))),
        t0 + Duration::from_secs(6)
    );
    assert_eq!(
        produce_deadline(t0, lease, Some(Duration::from_secs(20))),
        t0
    );
    assert_eq!(
        produce_deadline(t0, lease, None),
        t0 + Duration::from_secs(9)
    );
}

#[tokio::test]
async fn two_relays_never_hold_the_same_aggregate() {
    let f = fixture().await;
    let a = f.enqueue("a", 3).await;
    let b = f.enqueue("b", 3).await;
    let req = |id: &str, batch| ClaimRequest {
        relay_id: id.into(),
        batch_size: batch,
        lease: Duration::from_secs(60),
    };
    let one = f.store.claim(&req("one", 2)).await.unwrap();
    let ids =
        |c: &idem_core::store::Claim| c.records.iter().map(|r| r.event_id).collect::<Vec<_>>();
    assert_eq!(
        ids(&one),
        vec![a[0].id(), b[0].id()],
        "heads of both aggregates"
    );
    let two = f.store.claim(&req("two", 10)).await.unwrap();
    assert!(
        two.records.is_empty(),
        "later rows of leased aggregates are not heads: {:?}",
        ids(&two)
    );
    let done = ClaimOutcome {
        published: one.records.iter().map(|r| r.id).collect(),
        failed: vec![],
    };
    f.store.complete(&one, &done).await.unwrap();
    let three = f.store.claim(&req("three", 3)).await.unwrap();
    assert_eq!(
        ids(&three),
        vec![a[1].id(), a[2].id(), b[1].id()],
        "prefixes by rank: heads first"
    );
    let four = f.store.claim(&req("four", 10)).await.unwrap();
    assert!(
        four.records.is_empty(),
        "b's last row waits behind b's leased row"
    );
}

#[tokio::test]
async fn crash_point_after_publish_before_mark_leads_to_a_counted_republish() {
    let f = fixture().await;
    let a = f.enqueue("a", 1).await;
    let relay = f.relay(fast());
    crash::arm(
        CrashPoint::RelayAfterPublishBeforeMark,
        crash::Action::Error,
        1,
    )
    .unwrap();
    let err = relay.run_once().await.unwrap_err();
    assert!(
        matches!(
            err,
            Error::CrashPoint(CrashPoint::RelayAfterPublishBeforeMark)
        ),
        "{err}"
    );
    assert_eq!(
        relay.store().status().await.unwrap().pending,
        1,
        "not marked"
    );
    f.expire_leases().await;
    let r = relay.run_once().await.unwrap();
    assert_eq!((r.published, r.republished), (1, 1));
    assert_eq!(
        f.publisher.sent_ids(),
        vec![a[0].id().to_string(); 2],
        "the event is in the topic twice"
    );
}

#[tokio::test]
async fn backlog_gauges_follow_each_aggregate_type_and_marked_rows_are_timed() {
    let f = fixture().await;
    f.enqueue("a", 3).await;
    let relay = f.relay(fast());
    let m = relay.metrics().clone();
    relay.refresh_status().await.unwrap();
    assert_eq!(m.pending.with_label_values(&["order"]).get(), 3);
    assert_eq!(m.parked_rows.with_label_values(&["order"]).get(), 0);
    let age = m.oldest_pending_age.with_label_values(&["order"]).get();
    assert!((0.0..60.0).contains(&age), "age {age}");

    // A crash before the mark: nothing is timed, the republish is.
    crash::arm(
        CrashPoint::RelayAfterPublishBeforeMark,
        crash::Action::Error,
        1,
    )
    .unwrap();
    relay.run_once().await.unwrap_err();
    let timed =
        m.commit_to_publish
            .with_label_values(&["outbox.event.order", "order.paid", "order"]);
    assert_eq!(timed.get_sample_count(), 0);
    f.expire_leases().await;
    assert_eq!(relay.run_once().await.unwrap().published, 3);
    assert_eq!(
        timed.get_sample_count(),
        3,
        "one observation per marked row"
    );

    relay.refresh_status().await.unwrap();
    assert_eq!(
        m.pending.with_label_values(&["order"]).get(),
        0,
        "a drained type drops to 0"
    );
    assert_eq!(
        m.oldest_pending_age.with_label_values(&["order"]).get(),
        0.0
    );
}

#[tokio::test]
async fn a_built_relay_registers_its_metrics_only_when_given_a_registry() {
    let f = fixture().await;
    f.enqueue("a", 1).await;
    let quiet = Relay::builder(f.store.clone(), f.publisher)
        .config(fast())
        .build()
        .unwrap();
    assert_eq!(quiet.run_once().await.unwrap().published, 1);
    assert_eq!(
        quiet.metrics().published_total(),
        1,
        "counted, not exported"
    );
    let registry = prometheus::Registry::new();
    let exported = Relay::builder(f.store.clone(), f.publisher)
        .registry(&registry)
        .build()
        .unwrap();
    assert!(format!("{exported:?}").starts_with("Relay {"));
    let exports = |name: &str| registry.gather().iter().any(|mf| mf.name() == name);
    assert!(exports("idem_outbox_abandoned_total"));
    assert!(
        Relay::builder(f.store.clone(), f.publisher)
            .registry(&registry)
            .build()
            .is_err(),
        "a second relay's metrics clash in the same registry"
    );
}

/// Batch N+1 is claimed while batch N is produced: N's aggregates are leased, so N+1 holds none
/// of their later rows; when a row of N fails it stays pending (here backing off for an hour), so
/// its aggregate's later rows are still not heads when the next batch is claimed.
#[tokio::test]
async fn a_failed_batch_does_not_let_the_pipelined_next_publish_a_later_row_of_its_aggregates() {
    let f = fixture().await;
    let a = f.enqueue("a", 3).await;
    let b = f.enqueue("b", 3).await;
    f.enqueue("c", 3).await;
    f.publisher.fail(a[0].id(), FailureKind::Transient);
    let relay = f.relay(RelayConfig {
        batch_size: 2,
        retry_backoff: Duration::from_secs(3600),
        ..fast()
    });
    let (first, next) = relay.cycle(None).await;
    let first = first.unwrap();
    assert_eq!((first.claimed, first.published, first.retried), (2, 1, 1));
    let (_, held) = next.as_ref().expect("a full batch claims the next one");
    let aggregates: Vec<&str> = held
        .records
        .iter()
        .map(|r| r.aggregate_id.as_str())
        .collect();
    assert!(
        !aggregates.contains(&"a"),
        "a's rows wait behind a[0]: {aggregates:?}"
    );
    assert!(
        !held.records.iter().any(|r| r.event_id == b[2].id()),
        "b's rows come in order: {aggregates:?}"
    );
    let (second, _) = relay.cycle(next).await;
    assert_eq!(second.unwrap().claimed, 2);
    // Until a[0] is delivered, no later row of a is sent.
    loop {
        let (r, held) = relay.cycle(None).await;
        let drained = r.unwrap().claimed == 0 && held.is_none();
        if drained {
            break;
        }
        if let Some(held) = held {
            relay.cycle(Some(held)).await.0.unwrap();
        }
    }
    let sent = f.publisher.sent_ids();
    assert!(
        !sent.contains(&a[1].id().to_string()),
        "a[1] sent before a[0]: {sent:?}"
    );
    f.publisher.heal();
    f.expire_leases().await;
    while relay.run_once().await.unwrap().claimed > 0 {}
    let sent_a: Vec<String> = f
        .publisher
        .sent
        .lock()
        .unwrap()
        .iter()
        .filter(|m| m.key == "a")
        .map(|m| header(m, "ce_id"))
        .collect();
    let a_ids: Vec<String> = a.iter().map(|e| e.id().to_string()).collect();
    assert_eq!(sent_a, a_ids);
    assert_eq!(relay.store().status().await.unwrap().pending, 0);
}

/// Two relays, each claiming its next batch while it produces the current one, drain
/// interleaved aggregates: every aggregate's events reach the broker once each, in order.
#[tokio::test]
async fn pipelined_batches_of_two_relays_keep_each_aggregate_in_order() {
    let f = fixture().await;
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for round in 0..6 {
        for agg in 0..12 {
            let key = format!("agg-{agg}");
            let e = f.enqueue(&key, 1 + (agg + round) % 2).await;
            expected
                .entry(key)
                .or_default()
                .extend(e.iter().map(|e| e.id().to_string()));
        }
    }
    let config = |id: &str| RelayConfig {
        relay_id: id.into(),
        batch_size: 7,
        prune: None,
        ..fast()
    };
    let (one, two) = (f.relay(config("one")), f.relay(config("two")));
    let drained = || async {
        // Polls the outbox, as an operator would; the relays stop once it is empty.
        while f.store.status().await.unwrap().pending > 0 {
            tokio::task::yield_now().await;
        }
    };
    let (r1, r2) = tokio::join!(one.run(drained()), two.run(drained()));
    r1.unwrap();
    r2.unwrap();
    let sent = f.publisher.sent.lock().unwrap().clone();
    for (key, ids) in &expected {
        let got: Vec<String> = sent
            .iter()
            .filter(|m| &m.key == key)
            .map(|m| header(m, "ce_id"))
            .collect();
        assert_eq!(&got, ids, "{key}: once each, in order");
    }
    assert_eq!(sent.len(), expected.values().map(Vec::len).sum::<usize>());
}
