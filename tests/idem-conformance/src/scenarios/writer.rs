//! The write side of the outbox (idem-sql's `writer.rs`): events commit and roll back with the
//! business transaction and keep their order within an aggregate; the table holds writers in any
//! language to its contract (the five columns, its constraints, an event that cannot change once
//! written); writers of one aggregate are serialized in commit order, and a commit-order skew never
//! hides a row from the relay.

use std::time::Duration;

use idem_core::outbox::ClaimOutcome;
use idem_core::store::OutboxStore;
use idem_core::{Event, EventId};

use super::{event, ids, publish_all, req};
use crate::backend::{Backend, OpenTx};

scenarios! {
    writer_scenarios;
    commit_keeps_business_row_and_events,
    rollback_leaves_neither,
    enqueue_all_keeps_order_within_each_aggregate,
    minimal_contract_insert_is_publishable,
    an_event_cannot_change_once_written,
    contract_constraints_reject_bad_rows,
    duplicate_event_id_is_refused,
    commit_order_skew_never_skips_a_row,
    same_aggregate_writers_are_serialized_in_commit_order,
}

pub async fn commit_keeps_business_row_and_events<B: Backend>(b: &B) {
    let mut tx = b.begin().await;
    tx.exec("INSERT INTO test_orders (id, amount_minor) VALUES ('o-1', 1250)")
        .await
        .unwrap();
    tx.enqueue(&[event("o-1", 0), event("o-1", 1)])
        .await
        .unwrap();
    tx.commit().await;
    assert_eq!(b.scalar("SELECT count(*) FROM test_orders").await, 1);
    assert_eq!(b.store().status().await.unwrap().pending, 2);
}

pub async fn rollback_leaves_neither<B: Backend>(b: &B) {
    let mut tx = b.begin().await;
    tx.exec("INSERT INTO test_orders (id, amount_minor) VALUES ('o-1', 1250)")
        .await
        .unwrap();
    tx.enqueue(&[event("o-1", 0)]).await.unwrap();
    tx.rollback().await;
    assert_eq!(b.scalar("SELECT count(*) FROM test_orders").await, 0);
    let s = b.store().status().await.unwrap();
    assert_eq!((s.pending, s.published, s.parked), (0, 0, 0));
    assert!(
        b.store()
            .claim(&req("r", 10))
            .await
            .unwrap()
            .records
            .is_empty()
    );
}

pub async fn enqueue_all_keeps_order_within_each_aggregate<B: Backend>(b: &B) {
    let events: Vec<Event> = (0..10)
        .map(|i| event(if i % 2 == 0 { "b" } else { "a" }, i))
        .collect();
    let mut tx = b.begin().await;
    tx.enqueue(&events).await.unwrap();
    tx.commit().await;
    let claim = b.store().claim(&req("r", 100)).await.unwrap();
    for agg in ["a", "b"] {
        let want: Vec<EventId> = events
            .iter()
            .filter(|e| e.aggregate_id() == agg)
            .map(Event::id)
            .collect();
        let got: Vec<EventId> = claim
            .records
            .iter()
            .filter(|r| r.aggregate_id == agg)
            .map(|r| r.event_id)
            .collect();
        assert_eq!(got, want, "aggregate {agg}");
        let seqs: Vec<i64> = claim
            .records
            .iter()
            .filter(|r| r.aggregate_id == agg)
            .map(|r| r.aggregate_seq)
            .collect();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "aggregate_seq increases: {seqs:?}"
        );
    }
    let r = &claim.records[0];
    assert_eq!(r.attempt, 1);
    let payload: serde_json::Value = serde_json::from_str(&r.payload).unwrap();
    assert_eq!(payload, serde_json::json!({ "order_id": "a", "n": 1 }));
}

/// A writer in any language may insert only the five contract columns.
pub async fn minimal_contract_insert_is_publishable<B: Backend>(b: &B) {
    let t = b.tables().qualified("outbox");
    let id = uuid::Uuid::now_v7();
    b.exec(&format!(
        "INSERT INTO {t} (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('{id}', 'order', 'o-42', 'order.paid', '{{\"order_id\":\"o-42\"}}')"
    ))
    .await
    .unwrap();
    let claim = b.store().claim(&req("r", 10)).await.unwrap();
    assert_eq!(claim.records.len(), 1);
    let r = &claim.records[0];
    assert_eq!(r.event_id, EventId(id));
    assert!(r.headers.is_empty());
    assert_eq!(
        (r.topic.as_deref(), r.traceparent.as_deref(), r.attempt),
        (None, None, 1)
    );
    assert!(r.payload.contains("o-42"));
}

/// What a relay publishes is what the INSERT wrote, whichever relay reads the row: an UPDATE of
/// an event's columns is refused while the row is pending (in the inserting transaction too, as
/// an ORM's flush-then-update does) or published; a parked row may be corrected and retried, and
/// the correction is what goes out.
pub async fn an_event_cannot_change_once_written<B: Backend>(b: &B) {
    let t = b.tables().qualified("outbox");
    let mut tx = b.begin().await;
    tx.enqueue(&[event("o-1", 0)]).await.unwrap();
    let err = tx
        .exec(&format!("UPDATE {t} SET payload = '{{\"n\": 1}}'"))
        .await
        .expect_err("an update of a pending row in its own transaction");
    assert!(err.contains("written_once_check"), "{err}");
    drop(tx);
    assert_eq!(b.scalar(&format!("SELECT count(*) FROM {t}")).await, 0);

    let mut tx = b.begin().await;
    tx.enqueue(&[event("o-1", 0)]).await.unwrap();
    tx.commit().await;
    let columns = [
        "payload = '{\"n\": 1}'",
        "headers = '{\"tenant\": \"acme\"}'",
        "topic = 'elsewhere'",
        "aggregate_id = 'o-2'",
        "event_type = 'order.refunded'",
        "traceparent = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'",
    ];
    for set in columns {
        let err = b
            .exec(&format!("UPDATE {t} SET {set}"))
            .await
            .expect_err(set);
        assert!(err.contains("written_once_check"), "{set}: {err}");
    }
    // The relay's own columns still change: a status, a lease, an error.
    b.exec(&format!(
        "UPDATE {t} SET status = 'parked', last_error = 'held for a correction'"
    ))
    .await
    .unwrap();
    b.exec(&format!(
        "UPDATE {t} SET payload = '{{\"n\": 2}}', status = 'pending'"
    ))
    .await
    .unwrap();
    let claim = b.store().claim(&req("r", 10)).await.unwrap();
    assert_eq!(claim.records.len(), 1);
    assert!(
        claim.records[0].payload.contains("\"n\": 2")
            || claim.records[0].payload.contains("\"n\":2"),
        "{}",
        claim.records[0].payload
    );
    let outcome = ClaimOutcome {
        published: vec![claim.records[0].id],
        failed: vec![],
    };
    b.store().complete(&claim, &outcome).await.unwrap();
    let err = b
        .exec(&format!("UPDATE {t} SET payload = '{{\"n\": 3}}'"))
        .await
        .expect_err("an update of a published row");
    assert!(err.contains("written_once_check"), "{err}");
}

/// The table holds other writers to the same rules as the Rust API (CHECK constraints; on
/// PostgreSQL, since version 12, its row trigger).
pub async fn contract_constraints_reject_bad_rows<B: Backend>(b: &B) {
    let t = b.tables().qualified("outbox");
    let cases = [
        (
            "empty aggregate id",
            "'order'",
            "''",
            "'order.paid'",
            "'{}'",
        ),
        (
            "odd event type",
            "'order'",
            "'o-1'",
            "'order paid; drop'",
            "'{}'",
        ),
        (
            "bad aggregate type",
            "'or der'",
            "'o-1'",
            "'order.paid'",
            "'{}'",
        ),
        (
            "invalid JSON payload",
            "'order'",
            "'o-1'",
            "'order.paid'",
            "'{not json'",
        ),
    ];
    for (what, agg_type, agg_id, ev_type, payload) in cases {
        let id = uuid::Uuid::now_v7();
        let sql = format!(
            "INSERT INTO {t} (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('{id}', {agg_type}, {agg_id}, {ev_type}, {payload})"
        );
        assert!(b.exec(&sql).await.is_err(), "{what} was accepted");
    }
    let id = uuid::Uuid::now_v7();
    let bad_headers = format!(
        "INSERT INTO {t} (event_id, aggregate_type, aggregate_id, event_type, payload, headers) \
         VALUES ('{id}', 'order', 'o-1', 'order.paid', '{{}}', '[1]')"
    );
    assert!(
        b.exec(&bad_headers).await.is_err(),
        "non-object headers were accepted"
    );
    assert_eq!(
        b.store().status().await.unwrap().pending,
        0,
        "nothing was written"
    );
}

pub async fn duplicate_event_id_is_refused<B: Backend>(b: &B) {
    let e = event("o-1", 0);
    let mut tx = b.begin().await;
    tx.enqueue(std::slice::from_ref(&e)).await.unwrap();
    tx.commit().await;
    let mut tx = b.begin().await;
    let err = tx.enqueue(std::slice::from_ref(&e)).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("event_id is already in the outbox"),
        "{err}"
    );
    assert_eq!(err.kind(), idem_core::ErrorKind::Conflict, "{err}");
    tx.rollback().await;
    assert_eq!(b.store().status().await.unwrap().pending, 1);
}

/// Commit-order skew: a transaction that began first but commits last is still published.
/// An id watermark would skip it. (SQLite cannot interleave writers; there the sequential
/// case is checked.)
pub async fn commit_order_skew_never_skips_a_row<B: Backend>(b: &B) {
    let early = event("x", 0);
    let late = event("y", 0);
    if B::CONCURRENT_WRITERS {
        let mut tx1 = b.begin().await;
        tx1.enqueue(std::slice::from_ref(&early)).await.unwrap(); // lower id
        let mut tx2 = b.begin().await;
        tx2.enqueue(std::slice::from_ref(&late)).await.unwrap(); // higher id
        tx2.commit().await;
        assert_eq!(
            publish_all(b.store()).await,
            vec![late.id()],
            "only the committed row is visible"
        );
        tx1.commit().await;
    } else {
        let mut tx2 = b.begin().await;
        tx2.enqueue(std::slice::from_ref(&late)).await.unwrap();
        tx2.commit().await;
        assert_eq!(publish_all(b.store()).await, vec![late.id()]);
        let mut tx1 = b.begin().await;
        tx1.enqueue(std::slice::from_ref(&early)).await.unwrap();
        tx1.commit().await;
    }
    assert_eq!(
        publish_all(b.store()).await,
        vec![early.id()],
        "the late commit is not skipped"
    );
    assert_eq!(b.store().status().await.unwrap().published, 2);
}

/// Two writers of one aggregate: the second waits for the first to end, so aggregate order is
/// commit order; a rolled-back first writer leaves no gap.
pub async fn same_aggregate_writers_are_serialized_in_commit_order<B: Backend>(b: &B) {
    let first = event("x", 0);
    let rolled_back = event("x", 1);
    let second = event("x", 2);
    if B::CONCURRENT_WRITERS {
        let mut tx_rb = b.begin().await;
        tx_rb
            .enqueue(std::slice::from_ref(&rolled_back))
            .await
            .unwrap();
        let mut tx1 = b.begin().await;
        let blocked = {
            let first = first.clone();
            tokio::spawn(async move {
                tx1.enqueue(std::slice::from_ref(&first)).await.unwrap();
                tx1
            })
        };
        // Wait (bounded) until the second writer is observed waiting on the aggregate's lock.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while b.lock_waiters().await < 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "the second writer never waited for the lock"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(!blocked.is_finished(), "the second writer did not wait");
        tx_rb.rollback().await;
        let tx1 = blocked.await.unwrap();
        let mut tx2 = b.begin().await;
        let blocked2 = {
            let second = second.clone();
            tokio::spawn(async move {
                tx2.enqueue(std::slice::from_ref(&second)).await.unwrap();
                tx2
            })
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while b.lock_waiters().await < 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "the third writer never waited for the lock"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tx1.commit().await;
        blocked2.await.unwrap().commit().await;
    } else {
        for (e, commit) in [(&rolled_back, false), (&first, true), (&second, true)] {
            let mut tx = b.begin().await;
            tx.enqueue(std::slice::from_ref(e)).await.unwrap();
            if commit {
                tx.commit().await
            } else {
                tx.rollback().await
            }
        }
    }
    let claim = b.store().claim(&req("r", 10)).await.unwrap();
    assert_eq!(ids(&claim), vec![first.id(), second.id()]);
    if B::CONCURRENT_WRITERS {
        let seqs: Vec<i64> = claim.records.iter().map(|r| r.aggregate_seq).collect();
        assert_eq!(seqs, vec![1, 2], "the rolled-back writer left no gap");
    }
}
