//! The settlement handler with points: one `points.award` intent per payment, posted by the
//! handler and recorded in its transaction, on PostgreSQL and SQLite.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_conformance::backend::{Backend, Lite, Pg};
use idem_consumer::{Handler, HandlerContext};
use idem_core::idempotency::IntentStore;
use idem_core::store::InboxStore;
use idem_core::{EventId, InboundEvent};
use idem_reference::{PaidOrder, Settlement};

const TARGET: &str = "http://127.0.0.1:8088/awards";

fn inbound(order: &PaidOrder) -> InboundEvent {
    let event = order.event().unwrap();
    InboundEvent {
        event_id: EventId::new(),
        event_type: event.event_type().to_owned(),
        aggregate_type: "order".into(),
        aggregate_id: order.order_id.clone(),
        payload: serde_json::from_str(event.payload()).unwrap(),
        payload_hash: String::new(),
        traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
        topic: "outbox.event.order".into(),
        partition: 0,
        offset: 0,
    }
}

/// Applies `first` (committed), `again` (the same payment under another event id: committed)
/// and `rolled_back` (rolled back), then checks the intents.
async fn one_intent_per_payment<B: Backend>(b: &B, apply: impl AsyncFn(&InboundEvent, bool)) {
    let order = PaidOrder::numbered("", 4_250);
    let (first, again) = (inbound(&order), inbound(&order));
    let rolled_back = inbound(&PaidOrder::numbered("", 7));
    apply(&first, true).await;
    apply(&again, true).await;
    apply(&rolled_back, false).await;
    let claimed = b
        .intents()
        .claim(10, std::time::Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1, "one intent: {claimed:?}");
    let c = &claimed[0];
    assert_eq!(
        c.key.as_str(),
        format!("event-{}-points.award", first.event_id),
        "keyed by the event that settled the payment"
    );
    assert_eq!(c.intent.target, TARGET);
    assert_eq!(
        c.intent.body,
        serde_json::json!({"order_id": "order-4250", "payment_id": "pay-4250", "points": 43})
    );
    assert_eq!(
        c.intent.traceparent, first.traceparent,
        "trace context kept"
    );
    assert_eq!(b.scalar("SELECT count(*) FROM settlements").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_settlement_records_one_points_intent_per_payment() {
    let b = Pg::new().await;
    idem_reference::ensure_schema_postgres(b.pool())
        .await
        .unwrap();
    let handler = Settlement::with_points(TARGET);
    let (pool, inbox) = (b.pool().clone(), b.inbox());
    one_intent_per_payment(&b, async |event, commit| {
        let mut tx = pool.begin().await.unwrap();
        let mut posted = vec![];
        let mut cx = HandlerContext::new(&mut *tx, event, &mut posted);
        handler.handle(&mut cx, event).await.unwrap();
        inbox.record_effects(&mut *tx, &posted).await.unwrap();
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_settlement_records_one_points_intent_per_payment() {
    let b = Lite::new().await;
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", b.path().display()))
        .await
        .unwrap();
    idem_reference::ensure_schema_sqlite(&pool).await.unwrap();
    let handler = Settlement::with_points(TARGET);
    let inbox = b.inbox();
    one_intent_per_payment(&b, async |event, commit| {
        let mut tx = pool.begin().await.unwrap();
        let mut posted = vec![];
        let mut cx = HandlerContext::new(&mut *tx, event, &mut posted);
        handler.handle(&mut cx, event).await.unwrap();
        inbox.record_effects(&mut *tx, &posted).await.unwrap();
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
    })
    .await;
}
