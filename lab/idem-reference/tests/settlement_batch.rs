//! The settlement handler's batch path under the consumer runtime, on PostgreSQL and SQLite:
//! hostile batches (a malformed payload, a payment settled before with another amount, one
//! payment twice in a batch, an event of another type, an event only the database refuses) are
//! applied in one attempt where Rust can decide, and through the isolating retry only where the
//! database refuses; every event is applied once or dead-lettered with its reason.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_conformance::backend::{Backend, Lite, Pg};
use idem_conformance::records::{self, NoSource};
use idem_consumer::{BatchReport, Consumer, ConsumerConfig, ConsumerMetrics, Handler};
use idem_core::EventId;
use idem_core::store::{Delivery, InboxStore};
use idem_reference::{PaidOrder, Settlement};

const TARGET: &str = "http://127.0.0.1:8088/awards";

fn delivery(offset: i64, id: EventId, event_type: &str, key: &str, payload: &str) -> Delivery {
    records::delivery("outbox.event.order", offset, id, event_type, key, payload)
}

/// The `order.paid` record of `order` under a fresh event id.
fn paid(offset: i64, order: &PaidOrder) -> (EventId, Delivery) {
    let e = order.event().unwrap();
    let d = delivery(offset, e.id(), "order.paid", &order.order_id, e.payload());
    (e.id(), d)
}

fn order(n: u64) -> PaidOrder {
    PaidOrder::numbered("batch-", n)
}

async fn consumer<B: Backend>(b: &B) -> Consumer<B::Inbox, Settlement, NoSource>
where
    Settlement: Handler<<B::Inbox as InboxStore>::Conn>,
{
    let mut config = ConsumerConfig::new("settlement");
    config.retry_backoff = Duration::ZERO;
    let metrics = ConsumerMetrics::unregistered().unwrap();
    let handler = Settlement::with_points(TARGET);
    Consumer::new(b.inbox(), handler, NoSource, config, metrics)
}

async fn count<B: Backend>(b: &B, sql: &str) -> i64 {
    b.scalar(sql).await
}

async fn reasons<B: Backend>(b: &B) -> Vec<(Option<String>, String)> {
    let mut letters = b.inbox().dead_letters("settlement", 100).await.unwrap();
    letters.sort_by_key(|l| l.offset);
    letters
        .into_iter()
        .map(|l| (l.event_id, l.reason))
        .collect()
}

/// Rust-decidable refusals in one batch: no rollback, no isolating retry.
async fn refusals_rust_can_decide_cost_no_retry<B: Backend>(b: &B, schema: &str)
where
    Settlement: Handler<<B::Inbox as InboxStore>::Conn>,
{
    b.exec(schema).await.unwrap();
    let mut c = consumer(b).await;
    let (settled_before, d0) = paid(0, &order(2));
    let first = c.process(&[d0]).await.unwrap();
    assert_eq!((first.processed, first.retries), (1, 0));

    let (good, d1) = paid(1, &order(1));
    let malformed_id = EventId::new();
    let malformed = delivery(
        2,
        malformed_id,
        "order.paid",
        "o-x",
        r#"{"order_id":"o-x"}"#,
    );
    let other_type_id = EventId::new();
    let other_type = delivery(3, other_type_id, "order.refunded", "o-y", r#"{"x":1}"#);
    let mut changed = order(2);
    changed.amount_minor += 1;
    let (conflicting, d4) = paid(4, &changed);
    let (twice_a, d5) = paid(5, &order(3));
    let (twice_b, d6) = paid(6, &order(3));
    let mut other_order = order(3);
    other_order.order_id = "batch-order-other".into();
    let (twice_conflict, d7) = paid(7, &other_order);
    let copy = d1.clone();
    let batch = [d1, malformed, other_type, d4, d5, d6, d7, copy];
    let r: BatchReport = c.process(&batch).await.unwrap();
    assert_eq!(
        (r.processed, r.dead_lettered, r.retries, r.duplicate_skips),
        (3, 4, 0, 1),
        "applied: the good one and the same payment twice; refused without a retry: {r:?}"
    );
    assert_eq!(count(b, "SELECT count(*) FROM settlements").await, 3);
    assert_eq!(
        count(b, "SELECT count(*) FROM settlement_applications").await,
        4,
        "one application per applied event (the first batch's included)"
    );
    assert_eq!(
        count(b, "SELECT count(*) FROM idem_effect_intents").await,
        3,
        "one points intent per settlement inserted"
    );
    let letters = reasons(b).await;
    let reason_of = |id: EventId| {
        letters
            .iter()
            .find(|(e, _)| e.as_deref() == Some(id.to_string().as_str()))
            .map(|(_, r)| r.as_str())
            .unwrap_or_else(|| panic!("no dead letter for {id}: {letters:?}"))
    };
    assert!(
        reason_of(malformed_id).contains("no payment_id"),
        "{letters:?}"
    );
    assert!(reason_of(other_type_id).contains("unexpected event type"));
    assert!(reason_of(conflicting).contains("already settled"));
    assert!(reason_of(twice_conflict).contains("already settled"));
    assert_eq!(letters.len(), 4);
    for applied in [settled_before, good, twice_a, twice_b] {
        let sql =
            format!("SELECT count(*) FROM settlement_applications WHERE event_id = '{applied}'");
        assert_eq!(count(b, &sql).await, 1, "{applied}");
    }
    // Redelivered, the whole batch is skipped: nothing applied twice, nothing new dead-lettered.
    let again = c.process(&batch).await.unwrap();
    assert_eq!((again.processed, again.dead_lettered), (0, 0), "{again:?}");
    assert_eq!(
        count(b, "SELECT count(*) FROM settlement_applications").await,
        4
    );
}

/// A constraint only the database knows refuses one event of the set-based statement: the
/// batch is retried one event at a time, exactly that event is dead-lettered, the rest applied.
async fn a_database_refusal_dead_letters_exactly_the_poison_event<B: Backend>(b: &B, schema: &str)
where
    Settlement: Handler<<B::Inbox as InboxStore>::Conn>,
{
    b.exec(schema).await.unwrap();
    b.exec("CREATE UNIQUE INDEX lab_one_settlement_per_order ON settlements (order_id)")
        .await
        .unwrap();
    let mut c = consumer(b).await;
    let (_, d0) = paid(0, &order(20));
    c.process(&[d0]).await.unwrap();
    let (a, d1) = paid(1, &order(21));
    let mut poison_order = order(22);
    poison_order.order_id = order(20).order_id;
    let (poison, d2) = paid(2, &poison_order);
    let (z, d3) = paid(3, &order(23));
    let (z_again, d4) = paid(4, &order(23));
    let r = c.process(&[d1, d2, d3, d4]).await.unwrap();
    assert_eq!(
        (r.processed, r.dead_lettered, r.retries),
        (3, 1, 1),
        "one rolled-back attempt, then one isolated pass: {r:?}"
    );
    let letters = reasons(b).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].0.as_deref(), Some(poison.to_string().as_str()));
    assert!(letters[0].1.contains("the database refused"), "{letters:?}");
    for applied in [a, z, z_again] {
        let sql =
            format!("SELECT count(*) FROM settlement_applications WHERE event_id = '{applied}'");
        assert_eq!(count(b, &sql).await, 1, "{applied}");
    }
    assert_eq!(count(b, "SELECT count(*) FROM settlements").await, 3);
    assert_eq!(
        count(b, "SELECT count(*) FROM idem_effect_intents").await,
        3,
        "the isolated pass records the intents of the settlements it inserted, once"
    );
}

#[tokio::test]
async fn postgres_refusals_rust_can_decide_cost_no_retry() {
    refusals_rust_can_decide_cost_no_retry(&Pg::new().await, idem_reference::POSTGRES_SCHEMA).await;
}

#[tokio::test]
async fn sqlite_refusals_rust_can_decide_cost_no_retry() {
    refusals_rust_can_decide_cost_no_retry(&Lite::new().await, idem_reference::SQLITE_SCHEMA).await;
}

#[tokio::test]
async fn postgres_a_database_refusal_dead_letters_exactly_the_poison_event() {
    a_database_refusal_dead_letters_exactly_the_poison_event(
        &Pg::new().await,
        idem_reference::POSTGRES_SCHEMA,
    )
    .await;
}

#[tokio::test]
async fn sqlite_a_database_refusal_dead_letters_exactly_the_poison_event() {
    a_database_refusal_dead_letters_exactly_the_poison_event(
        &Lite::new().await,
        idem_reference::SQLITE_SCHEMA,
    )
    .await;
}

/// PostgreSQL `text` cannot hold NUL, which a payload's JSON string can: only the database
/// refuses it (SQLSTATE 22021), so the batch falls back to one event at a time and exactly that
/// event is dead-lettered.
#[tokio::test]
async fn postgres_a_nul_in_a_payment_id_is_refused_by_the_database_only() {
    let b = Pg::new().await;
    b.exec(idem_reference::POSTGRES_SCHEMA).await.unwrap();
    let mut c = consumer(&b).await;
    let (a, d0) = paid(0, &order(30));
    let nul = EventId::new();
    let payload =
        r#"{"order_id":"o-nul","payment_id":"pay-\u0000","amount":"1.00","currency":"EUR"}"#;
    let d1 = delivery(1, nul, "order.paid", "o-nul", payload);
    let (z, d2) = paid(2, &order(31));
    let r = c.process(&[d0, d1, d2]).await.unwrap();
    assert_eq!(
        (r.processed, r.dead_lettered, r.retries),
        (2, 1, 1),
        "{r:?}"
    );
    let letters = reasons(&b).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].0.as_deref(), Some(nul.to_string().as_str()));
    for applied in [a, z] {
        let sql =
            format!("SELECT count(*) FROM settlement_applications WHERE event_id = '{applied}'");
        assert_eq!(count(&b, &sql).await, 1);
    }
}

/// Two instances apply batches holding the same payments under other event ids, delivered in
/// opposite orders, at the same time: the events are applied sorted by payment (the lock
/// order), so neither deadlocks (no retry), and each payment is settled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_instances_on_the_same_payments_take_locks_in_one_order() {
    let b = Pg::new().await;
    b.exec(idem_reference::POSTGRES_SCHEMA).await.unwrap();
    let (mut one, mut two) = (consumer(&b).await, consumer(&b).await);
    let forward: Vec<Delivery> = (0..100)
        .map(|n| paid(n, &order(100 + n.unsigned_abs())).1)
        .collect();
    let backward: Vec<Delivery> = (0..100)
        .rev()
        .map(|n| paid(99 - n, &order(100 + n.unsigned_abs())).1)
        .collect();
    let (r1, r2) = tokio::join!(one.process(&forward), two.process(&backward));
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    assert_eq!(
        (r1.processed, r1.retries, r2.processed, r2.retries),
        (100, 0, 100, 0)
    );
    assert_eq!(count(&b, "SELECT count(*) FROM settlements").await, 100);
    assert_eq!(
        count(&b, "SELECT count(*) FROM settlement_applications").await,
        200
    );
    assert_eq!(
        count(&b, "SELECT count(*) FROM idem_effect_intents").await,
        100
    );
}
