//! The consumer's inbox and dead letters ([`InboxStore`], idem-sql's `inbox.rs`): a delivery
//! applies once per consumer group, a second payload under one event id is a conflict, inbox rows
//! roll back with the handler's transaction, and a poison record is kept once.

use std::time::Duration;

use idem_core::store::{DeadLetter, Dedup, InboxEntry, InboxStore};
use idem_core::{EventId, InboundEvent};

use crate::backend::Backend;

scenarios! {
    inbox_scenarios;
    inbox_dedups_per_group_and_counts_deliveries,
    inbox_detects_a_payload_conflict,
    inbox_rows_roll_back_with_the_transaction,
    concurrent_inbox_inserts_let_exactly_one_apply,
    dead_letters_are_kept_once_per_record,
}

fn inbound(id: EventId, hash: &str) -> InboundEvent {
    InboundEvent {
        event_id: id,
        event_type: "order.paid".into(),
        aggregate_type: "order".into(),
        aggregate_id: "o-1".into(),
        payload: serde_json::json!({}),
        payload_hash: hash.into(),
        traceparent: None,
        topic: "outbox.event.order".into(),
        partition: 0,
        offset: 0,
    }
}

fn entry(e: &InboundEvent, copies: i32) -> InboxEntry<'_> {
    InboxEntry {
        event: e,
        copies,
        dead_lettered: false,
    }
}

async fn record_once<I: InboxStore>(
    inbox: &I,
    group: &str,
    entries: &[InboxEntry<'_>],
) -> Vec<Dedup> {
    let mut tx = inbox.begin().await.unwrap();
    let r = inbox.record(&mut tx, group, entries).await.unwrap();
    inbox.commit(tx).await.unwrap();
    r
}

pub async fn inbox_dedups_per_group_and_counts_deliveries<B: Backend>(b: &B) {
    let inbox = b.inbox();
    let e = inbound(EventId::new(), "h1");
    assert_eq!(
        record_once(&inbox, "settlement", &[entry(&e, 1)]).await,
        vec![Dedup::New]
    );
    assert_eq!(
        record_once(&inbox, "settlement", &[entry(&e, 2)]).await,
        vec![Dedup::Duplicate]
    );
    assert_eq!(
        record_once(&inbox, "audit", &[entry(&e, 1)]).await,
        vec![Dedup::New],
        "another group applies it too"
    );
    let t = b.tables().qualified("inbox");
    assert_eq!(
        b.scalar(&format!(
            "SELECT CAST(delivery_count AS BIGINT) FROM {t} WHERE consumer_group = 'settlement'"
        ))
        .await,
        3
    );
    assert_eq!(b.scalar(&format!("SELECT count(*) FROM {t}")).await, 2);
}

pub async fn inbox_detects_a_payload_conflict<B: Backend>(b: &B) {
    let inbox = b.inbox();
    let id = EventId::new();
    let (first, other) = (inbound(id, "h1"), inbound(id, "h2"));
    record_once(&inbox, "g", &[entry(&first, 1)]).await;
    assert_eq!(
        record_once(&inbox, "g", &[entry(&other, 1)]).await,
        vec![Dedup::Conflict]
    );
    let t = b.tables().qualified("inbox");
    assert_eq!(
        b.scalar(&format!(
            "SELECT count(*) FROM {t} WHERE payload_hash = 'h1'"
        ))
        .await,
        1,
        "the first payload stays"
    );
}

pub async fn inbox_rows_roll_back_with_the_transaction<B: Backend>(b: &B) {
    let inbox = b.inbox();
    let e = inbound(EventId::new(), "h1");
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox.record(&mut tx, "g", &[entry(&e, 1)]).await.unwrap(),
        vec![Dedup::New]
    );
    inbox.rollback(tx).await.unwrap();
    assert_eq!(
        record_once(&inbox, "g", &[entry(&e, 1)]).await,
        vec![Dedup::New],
        "a rolled-back delivery is new again"
    );
}

/// Two consumers record the same event at once: exactly one sees it as new. (SQLite cannot
/// overlap writers; there the second transaction runs after the first.)
pub async fn concurrent_inbox_inserts_let_exactly_one_apply<B: Backend>(b: &B) {
    let e = inbound(EventId::new(), "h1");
    let (i1, i2) = (b.inbox(), b.inbox());
    let results = if B::CONCURRENT_WRITERS {
        let mut tx1 = i1.begin().await.unwrap();
        let first = i1.record(&mut tx1, "g", &[entry(&e, 1)]).await.unwrap();
        let e2 = e.clone();
        let second = tokio::spawn(async move {
            let mut tx2 = i2.begin().await.unwrap();
            let r = i2.record(&mut tx2, "g", &[entry(&e2, 1)]).await.unwrap();
            i2.commit(tx2).await.unwrap();
            r
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while b.lock_waiters().await < 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "the second insert never waited on the key"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        i1.commit(tx1).await.unwrap();
        vec![first, second.await.unwrap()]
    } else {
        vec![
            record_once(&i1, "g", &[entry(&e, 1)]).await,
            record_once(&i2, "g", &[entry(&e, 1)]).await,
        ]
    };
    assert_eq!(results, vec![vec![Dedup::New], vec![Dedup::Duplicate]]);
}

pub async fn dead_letters_are_kept_once_per_record<B: Backend>(b: &B) {
    let inbox = b.inbox();
    let letter = DeadLetter {
        topic: "outbox.event.order".into(),
        partition: 1,
        offset: 42,
        event_id: None,
        event_type: None,
        reason: "the record has no ce_id header (event id)".into(),
        key: Some("o-1".into()),
        payload: Some("{}".into()),
        headers: serde_json::json!({}),
    };
    for _ in 0..2 {
        let mut tx = inbox.begin().await.unwrap();
        inbox
            .dead_letter(&mut tx, "g", std::slice::from_ref(&letter))
            .await
            .unwrap();
        inbox.commit(tx).await.unwrap();
    }
    let stored = inbox.dead_letters("g", 10).await.unwrap();
    assert_eq!(
        stored.len(),
        1,
        "a redelivered poison record is stored once"
    );
    assert_eq!((stored[0].partition, stored[0].offset), (1, 42));
    assert_eq!(stored[0].reason, letter.reason);
    assert!(inbox.dead_letters("other", 10).await.unwrap().is_empty());
}
