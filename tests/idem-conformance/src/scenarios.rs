//! Store scenarios, written once and run against every [`Backend`].

use std::collections::HashSet;
use std::time::Duration;

use idem_core::outbox::{Claim, ClaimOutcome, ClaimRequest, Disposition, Failure, PrunePolicy};
use idem_core::store::{DeadLetter, Dedup, InboxEntry, InboxStore, OutboxStore};
use idem_core::{Event, EventId, InboundEvent, TableNames};

use crate::backend::{Backend, OpenTx};

pub fn event(agg: &str, i: usize) -> Event {
    Event::builder("order", agg, "order.paid")
        .payload(&serde_json::json!({ "order_id": agg, "n": i }))
        .build()
        .unwrap()
}

fn req(relay: &str, batch: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: relay.to_owned(),
        batch_size: batch,
        lease: Duration::from_secs(60),
    }
}

fn ids(c: &Claim) -> Vec<EventId> {
    c.records.iter().map(|r| r.event_id).collect()
}

/// Claims everything claimable and marks it published; returns the event ids in claim order.
pub async fn publish_all<S: OutboxStore>(store: &S) -> Vec<EventId> {
    let mut out = vec![];
    loop {
        let claim = store.claim(&req("publish-all", 1000)).await.unwrap();
        if claim.records.is_empty() {
            return out;
        }
        out.extend(ids(&claim));
        let outcome = ClaimOutcome {
            published: claim.records.iter().map(|r| r.id).collect(),
            failed: vec![],
        };
        store.complete(&claim, &outcome).await.unwrap();
    }
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

/// A store that meets a table it needs missing says so by kind, not only in its message: the
/// caller can tell "run `idem migrate`" from a failure worth retrying.
pub async fn a_missing_table_is_an_error_of_kind_not_migrated<B: Backend>(b: &B) {
    let outbox = b.tables().qualified("outbox");
    b.exec(&format!("DROP TABLE {outbox}")).await.unwrap();
    let err = b.store().status().await.unwrap_err();
    assert_eq!(err.kind(), idem_core::ErrorKind::NotMigrated, "{err}");
    let mut tx = b.begin().await;
    let err = tx.enqueue(&[event("o-1", 0)]).await.unwrap_err();
    assert_eq!(err.kind(), idem_core::ErrorKind::NotMigrated, "{err}");
    tx.rollback().await;
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

/// Concurrent claims never hand rows of one aggregate to two relays.
pub async fn claims_never_share_an_aggregate<B: Backend>(b: &B) {
    // More aggregates than one claim takes, two rows each: a claim that ignored heads or
    // leases would take a second row of an aggregate the other claim holds.
    let mut tx = b.begin().await;
    let events: Vec<Event> = (0..60)
        .map(|i| event(&format!("agg-{:02}", i % 30), i))
        .collect();
    tx.enqueue(&events).await.unwrap();
    tx.commit().await;
    let (s1, s2, s3) = (b.store().clone(), b.store().clone(), b.store().clone());
    let (c1, c2, c3) = tokio::join!(
        async move { s1.claim(&req("one", 12)).await.unwrap() },
        async move { s2.claim(&req("two", 12)).await.unwrap() },
        async move { s3.claim(&req("three", 12)).await.unwrap() }
    );
    let aggs = |c: &Claim| {
        c.records
            .iter()
            .map(|r| r.aggregate_id.clone())
            .collect::<HashSet<_>>()
    };
    assert!(
        aggs(&c1).is_disjoint(&aggs(&c2)),
        "{:?} / {:?}",
        aggs(&c1),
        aggs(&c2)
    );
    assert!(aggs(&c1).is_disjoint(&aggs(&c3)) && aggs(&c2).is_disjoint(&aggs(&c3)));
    assert_eq!(
        c1.records.len() + c2.records.len() + c3.records.len(),
        36,
        "three claims of 12 heads"
    );
    // Each claim holds a prefix of each of its aggregates.
    for c in [&c1, &c2, &c3] {
        for agg in aggs(c) {
            let want: Vec<EventId> = events
                .iter()
                .filter(|e| e.aggregate_id() == agg)
                .map(Event::id)
                .collect();
            let got: Vec<EventId> = c
                .records
                .iter()
                .filter(|r| r.aggregate_id == agg)
                .map(|r| r.event_id)
                .collect();
            assert_eq!(got[..], want[..got.len()], "{agg}: not a prefix");
        }
    }
    // The remaining heads are claimable; rows behind leased heads are not.
    let rest = b.store().claim(&req("four", 100)).await.unwrap();
    let held: HashSet<String> = [&c1, &c2, &c3].iter().flat_map(|c| aggs(c)).collect();
    assert_eq!(
        rest.records.len(),
        2 * (30 - held.len()),
        "both rows of each free aggregate"
    );
    assert!(aggs(&rest).is_disjoint(&held));
}

pub async fn stale_claim_cannot_mark<B: Backend>(b: &B) {
    let mut tx = b.begin().await;
    tx.enqueue(&[event("o-1", 0)]).await.unwrap();
    tx.commit().await;
    let stale = b.store().claim(&req("stale", 10)).await.unwrap();
    b.expire_leases().await;
    let fresh = b.store().claim(&req("fresh", 10)).await.unwrap();
    assert_eq!(ids(&fresh), ids(&stale), "the expired lease was taken over");
    assert_eq!(fresh.records[0].attempt, 2);
    let all = |c: &Claim| ClaimOutcome {
        published: c.records.iter().map(|r| r.id).collect(),
        failed: vec![],
    };
    let done = b.store().complete(&stale, &all(&stale)).await.unwrap();
    assert_eq!(
        (done.marked, done.fenced),
        (0, 1),
        "the stale relay is fenced"
    );
    let done = b.store().complete(&fresh, &all(&fresh)).await.unwrap();
    assert_eq!((done.marked, done.fenced), (1, 0));
}

pub async fn failed_rows_back_off_and_park<B: Backend>(b: &B) {
    let mut tx = b.begin().await;
    tx.enqueue(&[event("o-1", 0), event("o-2", 0)])
        .await
        .unwrap();
    tx.commit().await;
    let claim = b.store().claim(&req("r", 10)).await.unwrap();
    let outcome = ClaimOutcome {
        published: vec![],
        failed: vec![
            Failure {
                id: claim.records[0].id,
                reason: "broker unreachable".into(),
                backoff: Duration::from_secs(3600),
                disposition: Disposition::Retry,
            },
            Failure {
                id: claim.records[1].id,
                reason: "message too large".into(),
                backoff: Duration::ZERO,
                disposition: Disposition::Park,
            },
        ],
    };
    let done = b.store().complete(&claim, &outcome).await.unwrap();
    assert_eq!(done.released, 2);
    assert!(
        b.store()
            .claim(&req("r", 10))
            .await
            .unwrap()
            .records
            .is_empty(),
        "backoff and parking hold both rows"
    );
    let s = b.store().status().await.unwrap();
    assert_eq!((s.pending, s.parked), (1, 1));
    let parked = b.store().parked(10).await.unwrap();
    assert_eq!(parked[0].last_error.as_deref(), Some("message too large"));
    b.expire_leases().await;
    let again = b.store().claim(&req("r", 10)).await.unwrap();
    assert_eq!(ids(&again), vec![claim.records[0].event_id]);
    assert_eq!(again.records[0].attempt, 2);
    assert_eq!(b.store().retry_parked(None).await.unwrap(), 1);
    assert_eq!(b.store().status().await.unwrap().parked, 0);
}

/// The relay's backlog gauges: pending and parked rows per aggregate type, published rows not
/// counted, drained types absent.
pub async fn backlog_counts_pending_and_parked_rows_per_aggregate_type<B: Backend>(b: &B) {
    assert!(b.store().backlog().await.unwrap().is_empty());
    let customer = |i: usize| {
        Event::builder("customer", format!("c-{i}"), "customer.created")
            .payload(&serde_json::json!({ "n": i }))
            .build()
            .unwrap()
    };
    let mut tx = b.begin().await;
    tx.enqueue(&[
        event("o-1", 0),
        event("o-2", 0),
        event("o-3", 0),
        customer(1),
    ])
    .await
    .unwrap();
    tx.commit().await;
    let claim = b.store().claim(&req("r", 10)).await.unwrap();
    let ids_of = |t: &str| -> Vec<i64> {
        claim
            .records
            .iter()
            .filter(|r| r.aggregate_type == t)
            .map(|r| r.id)
            .collect()
    };
    let (order_ids, customer_ids) = (ids_of("order"), ids_of("customer"));
    // One order published, one parked, one released; the customer event published.
    let failure = |id: i64, park: bool| Failure {
        id,
        reason: "scripted".into(),
        backoff: Duration::ZERO,
        disposition: if park {
            Disposition::Park
        } else {
            Disposition::Retry
        },
    };
    let outcome = ClaimOutcome {
        published: vec![order_ids[0], customer_ids[0]],
        failed: vec![failure(order_ids[1], true), failure(order_ids[2], false)],
    };
    b.store().complete(&claim, &outcome).await.unwrap();
    let backlog = b.store().backlog().await.unwrap();
    assert_eq!(
        backlog.len(),
        1,
        "the drained customer type is absent: {backlog:?}"
    );
    assert_eq!(
        (
            backlog[0].aggregate_type.as_str(),
            backlog[0].pending,
            backlog[0].parked
        ),
        ("order", 1, 1)
    );
    let age = backlog[0].oldest_pending_age_seconds.unwrap();
    assert!((0.0..60.0).contains(&age), "age {age}");
    assert_eq!(b.store().retry_parked(None).await.unwrap(), 1);
    publish_all(b.store()).await;
    assert!(b.store().backlog().await.unwrap().is_empty());
}

pub async fn prune_deletes_or_archives_published_rows<B: Backend>(b: &B) {
    let mut tx = b.begin().await;
    tx.enqueue(&[event("o-1", 0), event("o-2", 0), event("o-3", 0)])
        .await
        .unwrap();
    tx.commit().await;
    assert_eq!(publish_all(b.store()).await.len(), 3);
    let mut tx = b.begin().await;
    tx.enqueue(&[event("o-4", 0)]).await.unwrap();
    tx.commit().await;
    let keep = PrunePolicy {
        retention: Duration::from_secs(3600),
        archive: false,
        batch: 10,
    };
    assert_eq!(
        b.store().prune(&keep).await.unwrap(),
        0,
        "recent rows are kept"
    );
    let archive = PrunePolicy {
        retention: Duration::ZERO,
        archive: true,
        batch: 2,
    };
    assert_eq!(
        b.store().prune(&archive).await.unwrap(),
        2,
        "bounded by the batch"
    );
    let archived = b
        .scalar(&format!(
            "SELECT count(*) FROM {}",
            b.tables().qualified("outbox_archive")
        ))
        .await;
    assert_eq!(archived, 2);
    let delete = PrunePolicy {
        retention: Duration::ZERO,
        archive: false,
        batch: 10,
    };
    assert_eq!(b.store().prune(&delete).await.unwrap(), 1);
    let s = b.store().status().await.unwrap();
    assert_eq!(
        (s.published, s.pending),
        (0, 1),
        "pending rows are never pruned"
    );
}

pub async fn migrate_is_idempotent<B: Backend>(b: &B) {
    assert_eq!(
        b.migrate().await.unwrap(),
        Vec::<i64>::new(),
        "already migrated"
    );
    let version = b
        .scalar(&format!(
            "SELECT max(version) FROM {}",
            b.tables().qualified("schema_migrations")
        ))
        .await;
    assert_eq!(version, 21);
}

pub async fn custom_table_prefix_is_used<B: Backend>(b: &B) {
    let other = b.with_tables(TableNames::new(None, "billing_").unwrap());
    assert_eq!(
        other.migrate().await.unwrap(),
        vec![
            1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21
        ]
    );
    let mut tx = other.begin().await;
    tx.enqueue(&[event("o-1", 0)]).await.unwrap();
    tx.commit().await;
    assert_eq!(b.scalar("SELECT count(*) FROM billing_outbox").await, 1);
    assert_eq!(
        b.store().status().await.unwrap().pending,
        0,
        "the default outbox is untouched"
    );
    assert_eq!(publish_all(other.store()).await.len(), 1);
}

// ---- consumer inbox -------------------------------------------------------------------------

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

// ---- server-side idempotency keys -----------------------------------------------------------

use idem_core::idempotency::{
    ClaimToken, IdempotencyKey, IdempotencyStore, KeyClaim, StoredResponse, TransactionalKeyStore,
    TxClaim,
};

const MINUTE: Duration = Duration::from_secs(60);
const SECOND: Duration = Duration::from_secs(1);

/// The token of a claim that must be new.
#[track_caller]
fn new_claim(c: KeyClaim) -> ClaimToken {
    match c {
        KeyClaim::New(token) => token,
        other => panic!("expected a new claim, got {other:?}"),
    }
}

/// Claims `k` for client "c" with a lock that has already run out.
async fn claim_with_zero_lock<K: IdempotencyStore>(keys: &K, k: &IdempotencyKey) -> ClaimToken {
    new_claim(
        keys.claim("c", k, "fp", Duration::ZERO, MINUTE)
            .await
            .unwrap(),
    )
}

fn empty(status: u16) -> StoredResponse {
    StoredResponse {
        status,
        headers: vec![],
        body: vec![],
    }
}

pub async fn idempotency_keys_claim_replay_and_scope<B: Backend>(b: &B) {
    let keys = b.keys();
    let k = IdempotencyKey::new("order-10042-points").unwrap();
    let a = new_claim(
        keys.claim("client-a", &k, "fp1", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    assert_eq!(
        keys.claim("client-a", &k, "fp1", MINUTE, MINUTE)
            .await
            .unwrap(),
        KeyClaim::InFlight
    );
    assert_eq!(
        keys.claim("client-a", &k, "fp2", MINUTE, MINUTE)
            .await
            .unwrap(),
        KeyClaim::Mismatch
    );
    let b_token = new_claim(
        keys.claim("client-b", &k, "fp1", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    assert_ne!(a, b_token, "every claim has its own token");
    let resp = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: br#"{"award":1}"#.to_vec(),
    };
    assert!(keys.complete("client-a", &k, &a, &resp).await.unwrap());
    assert_eq!(
        keys.claim("client-a", &k, "fp1", MINUTE, MINUTE)
            .await
            .unwrap(),
        KeyClaim::Completed(resp)
    );
    assert_eq!(
        keys.claim("client-a", &k, "fp2", MINUTE, MINUTE)
            .await
            .unwrap(),
        KeyClaim::Mismatch
    );
    assert_eq!(
        keys.claim("client-b", &k, "fp1", MINUTE, MINUTE)
            .await
            .unwrap(),
        KeyClaim::InFlight,
        "B never sees A's response"
    );
}

pub async fn idempotency_keys_release_expire_and_sweep<B: Backend>(b: &B) {
    let keys = b.keys();
    let k = IdempotencyKey::new("k").unwrap();
    let t = new_claim(keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap());
    assert!(keys.release("c", &k, &t).await.unwrap());
    new_claim(
        keys.claim("c", &k, "fp", Duration::ZERO, MINUTE)
            .await
            .unwrap(),
    );
    // The in-flight lock ran out (its server died mid-request): the same request takes over.
    // (Time has to pass here: this waits past the zero-length lock, it synchronises nothing.)
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        keys.claim("c", &k, "other", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::Mismatch,
        "a dead claim is taken over only by the same request"
    );
    let t = new_claim(keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap());
    assert!(keys.complete("c", &k, &t, &empty(200)).await.unwrap());
    let old = IdempotencyKey::new("old").unwrap();
    let t = new_claim(
        keys.claim("c", &old, "fp", MINUTE, Duration::ZERO)
            .await
            .unwrap(),
    );
    assert!(keys.complete("c", &old, &t, &empty(200)).await.unwrap());
    let live = IdempotencyKey::new("live").unwrap();
    new_claim(
        keys.claim("c", &live, "fp", MINUTE, Duration::ZERO)
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        keys.sweep().await.unwrap(),
        1,
        "only the expired completed key is swept, not an expired claim whose lock is live"
    );
    assert!(matches!(
        keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::Completed(_)
    ));
    assert_eq!(
        keys.claim("c", &live, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::InFlight,
        "a live claim is not taken over, even past its retention"
    );
    new_claim(
        keys.claim("c", &old, "other", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
}

/// At the store: A's lock runs out, B takes the key over; A's renew, complete and
/// release change nothing and say so, and B's claim is intact.
pub async fn idempotency_claims_are_fenced_by_their_token<B: Backend>(b: &B) {
    let keys = b.keys();
    let k = IdempotencyKey::new("slow").unwrap();
    let a = claim_with_zero_lock(&keys, &k).await;
    // Time has to pass: A's zero-length lock runs out.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let b_token = new_claim(keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap());
    assert!(
        !keys.renew("c", &k, &a, MINUTE).await.unwrap(),
        "A's renew is fenced"
    );
    assert!(
        !keys.release("c", &k, &a).await.unwrap(),
        "A's release is fenced"
    );
    assert!(
        !keys.complete("c", &k, &a, &empty(201)).await.unwrap(),
        "A's completion is fenced"
    );
    assert_eq!(
        keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::InFlight,
        "B's claim survived A's release and completion"
    );
    assert!(keys.renew("c", &k, &b_token, MINUTE).await.unwrap());
    assert!(keys.complete("c", &k, &b_token, &empty(202)).await.unwrap());
    assert_eq!(
        keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::Completed(empty(202)),
        "B's response, not A's"
    );
    assert!(
        !keys.complete("c", &k, &b_token, &empty(203)).await.unwrap(),
        "once"
    );
    assert!(
        !keys.release("c", &k, &b_token).await.unwrap(),
        "a completed key is kept"
    );
}

/// A claim renewed before its lock runs out is never taken over.
pub async fn a_renewed_claim_is_not_taken_over<B: Backend>(b: &B) {
    let keys = b.keys();
    let k = IdempotencyKey::new("renewed").unwrap();
    let a = claim_with_zero_lock(&keys, &k).await;
    assert!(keys.renew("c", &k, &a, MINUTE).await.unwrap());
    // Time passes beyond the claim's first lock; the renewal holds it.
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::InFlight
    );
    assert!(keys.complete("c", &k, &a, &empty(201)).await.unwrap());
}

pub async fn concurrent_claims_of_one_key_let_exactly_one_execute<B: Backend>(b: &B) {
    let k = IdempotencyKey::new("same").unwrap();
    let mut tasks = vec![];
    for _ in 0..10 {
        let (keys, k) = (b.keys(), k.clone());
        tasks.push(tokio::spawn(async move {
            keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap()
        }));
    }
    let mut new = 0;
    for t in tasks {
        match t.await.unwrap() {
            KeyClaim::New(_) => new += 1,
            KeyClaim::InFlight => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(new, 1);
}

/// The open transaction of a claim that must be new.
#[track_caller]
fn new_tx<T>(c: TxClaim<T>) -> (T, ClaimToken) {
    match c {
        TxClaim::New { tx, token } => (tx, token),
        TxClaim::InFlight => panic!("expected a new claim, got InFlight"),
        TxClaim::Mismatch => panic!("expected a new claim, got Mismatch"),
        TxClaim::Completed(r) => panic!("expected a new claim, got Completed({r:?})"),
    }
}

/// A claim made in a transaction exists only when the transaction commits with the response:
/// rolled back (or fenced by a wrong token) it leaves the key free; committed, it replays; a
/// claim in flight outside a transaction is in flight for a transactional claim too.
pub async fn a_key_claimed_in_a_transaction_commits_or_rolls_back_with_it<B: Backend>(b: &B) {
    let keys = b.keys();
    let k = IdempotencyKey::new("tx").unwrap();
    let (tx, _) = new_tx(
        keys.claim_in_transaction("c", &k, "fp", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    keys.roll_back(tx).await;
    let (tx, token) = new_tx(
        keys.claim_in_transaction("c", &k, "fp", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    let wrong = ClaimToken::random();
    assert!(
        !keys
            .complete_and_commit(tx, "c", &k, &wrong, &empty(201))
            .await
            .unwrap(),
        "a completion with another token is fenced and rolls back"
    );
    let (tx, token2) = new_tx(
        keys.claim_in_transaction("c", &k, "fp", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    assert_ne!(token.as_str(), token2.as_str());
    assert!(
        keys.complete_and_commit(tx, "c", &k, &token2, &empty(201))
            .await
            .unwrap()
    );
    assert_eq!(
        keys.claim("c", &k, "fp", MINUTE, MINUTE).await.unwrap(),
        KeyClaim::Completed(empty(201))
    );
    match keys
        .claim_in_transaction("c", &k, "fp", MINUTE, MINUTE)
        .await
        .unwrap()
    {
        TxClaim::Completed(r) => assert_eq!(r, empty(201)),
        _ => panic!("a committed key replays"),
    }
    assert!(matches!(
        keys.claim_in_transaction("c", &k, "other", MINUTE, MINUTE)
            .await
            .unwrap(),
        TxClaim::Mismatch
    ));
    let in_flight = IdempotencyKey::new("plain").unwrap();
    new_claim(
        keys.claim("c", &in_flight, "fp", MINUTE, MINUTE)
            .await
            .unwrap(),
    );
    assert!(matches!(
        keys.claim_in_transaction("c", &in_flight, "fp", MINUTE, MINUTE)
            .await
            .unwrap(),
        TxClaim::InFlight
    ));
}

/// PostgreSQL: a second claim of a key held by an open transaction waits on the key's row,
/// then replays the committed response (or claims the key when the first rolled back). SQLite
/// has one writer at a time: the second transaction waits for the write lock, which the
/// scenario above covers by running one after the other.
pub async fn a_claim_waits_for_the_transaction_holding_the_key<B: Backend>(b: &B) {
    if !B::CONCURRENT_WRITERS {
        return;
    }
    for commit in [true, false] {
        let keys = b.keys();
        let k = IdempotencyKey::new(if commit { "held-c" } else { "held-r" }).unwrap();
        let (tx, token) = new_tx(
            keys.claim_in_transaction("c", &k, "fp", MINUTE, MINUTE)
                .await
                .unwrap(),
        );
        let waiters = b
            .scalar("SELECT count(*) FROM pg_locks WHERE NOT granted")
            .await;
        let (keys2, k2) = (keys.clone(), k.clone());
        let second = tokio::spawn(async move {
            keys2
                .claim_in_transaction("c", &k2, "fp", MINUTE, MINUTE)
                .await
                .unwrap()
        });
        while b
            .scalar("SELECT count(*) FROM pg_locks WHERE NOT granted")
            .await
            <= waiters
        {
            tokio::task::yield_now().await;
        }
        assert!(!second.is_finished(), "the second claim waits on the key");
        if commit {
            assert!(
                keys.complete_and_commit(tx, "c", &k, &token, &empty(201))
                    .await
                    .unwrap()
            );
            match second.await.unwrap() {
                TxClaim::Completed(r) => assert_eq!(r, empty(201)),
                _ => panic!("the second claim replays the committed response"),
            }
        } else {
            keys.roll_back(tx).await;
            let (tx2, _) = new_tx(second.await.unwrap());
            keys.roll_back(tx2).await;
        }
    }
}

// ---- client-side effect intents -------------------------------------------------------------

use idem_core::idempotency::{EffectIntent, IntentOutcome, IntentStatus, IntentStore};

fn intent(event: EventId) -> EffectIntent {
    EffectIntent {
        event_id: event,
        effect: "points.award".into(),
        target: "http://127.0.0.1:8088/awards".into(),
        body: serde_json::json!({"payment_id": "pay-1", "points": 12}),
        traceparent: None,
    }
}

pub async fn intents_commit_with_the_handler_and_keep_their_key<B: Backend>(b: &B) {
    let (kept, dropped) = (intent(EventId::new()), intent(EventId::new()));
    let mut tx = b.begin().await;
    assert!(tx.record_intent(&dropped).await.unwrap());
    tx.rollback().await;
    let mut tx = b.begin().await;
    assert!(tx.record_intent(&kept).await.unwrap());
    assert!(
        !tx.record_intent(&kept).await.unwrap(),
        "recording the same effect twice is a no-op"
    );
    tx.commit().await;
    let intents = b.intents();
    let claimed = intents.claim(10, MINUTE).await.unwrap();
    assert_eq!(claimed.len(), 1, "the rolled-back intent does not exist");
    assert_eq!(claimed[0].key, kept.key().unwrap());
    assert_eq!((claimed[0].attempt, &claimed[0].intent), (1, &kept));
    assert!(
        intents.claim(10, MINUTE).await.unwrap().is_empty(),
        "leased"
    );
}

pub async fn intents_recorded_as_a_batch_are_recorded_as_one_by_one<B: Backend>(b: &B) {
    let (a, c, d) = (
        intent(EventId::new()),
        intent(EventId::new()),
        intent(EventId::new()),
    );
    let b2 = EffectIntent {
        traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
        body: serde_json::json!({"payment_id": "pay-\"2\"", "points": 3}),
        ..intent(EventId::new())
    };
    let mut tx = b.begin().await;
    assert!(tx.record_intents(&[]).await.unwrap().is_empty());
    assert!(tx.record_intent(&d).await.unwrap());
    assert_eq!(
        tx.record_intents(&[c.clone(), b2.clone(), c.clone(), a.clone(), d.clone()])
            .await
            .unwrap(),
        [true, true, false, true, false],
        "a key earlier in the batch or already recorded is skipped"
    );
    assert!(!tx.record_intent(&a).await.unwrap(), "one-by-one sees it");
    tx.commit().await;
    let mut tx = b.begin().await;
    let e = intent(EventId::new());
    assert_eq!(tx.record_intents(&[e]).await.unwrap(), [true]);
    tx.rollback().await;
    let mut claimed = b.intents().claim(10, MINUTE).await.unwrap();
    claimed.sort_by_key(|c| c.id);
    let got: Vec<&EffectIntent> = claimed.iter().map(|c| &c.intent).collect();
    let mut want = vec![&d, &c, &b2, &a];
    want.sort_by_key(|i| i.key().unwrap().as_str().to_owned());
    let mut got_sorted = got.clone();
    got_sorted.sort_by_key(|i| i.key().unwrap().as_str().to_owned());
    assert_eq!(
        got_sorted, want,
        "every column kept; the rolled-back batch is gone"
    );
    assert_eq!(got[0], &d, "recorded first");
}

pub async fn intent_outcomes_are_fenced_by_the_attempt<B: Backend>(b: &B) {
    let i = intent(EventId::new());
    let mut tx = b.begin().await;
    tx.record_intent(&i).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let first = store.claim(10, Duration::ZERO).await.unwrap().remove(0);
    tokio::time::sleep(Duration::from_millis(5)).await; // past the zero-length lease
    let second = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(
        (second.attempt, &second.key),
        (2, &first.key),
        "a new attempt, the same key"
    );
    let done = IntentOutcome::Done {
        status: 201,
        body: "{}".into(),
    };
    assert!(
        !store.finish(first.id, first.attempt, &done).await.unwrap(),
        "the stale dispatcher is fenced"
    );
    assert!(
        store
            .finish(
                second.id,
                second.attempt,
                &IntentOutcome::Retry {
                    after: MINUTE,
                    reason: "503".into()
                }
            )
            .await
            .unwrap()
    );
    assert!(
        store.claim(10, MINUTE).await.unwrap().is_empty(),
        "backing off"
    );
}

/// A batch of outcomes is recorded in one write, each fenced by its own attempt: the outcome of
/// an attempt whose claim expired and was taken again changes nothing, the others are recorded.
pub async fn a_batch_of_outcomes_is_fenced_per_attempt<B: Backend>(b: &B) {
    use idem_core::idempotency::FinishedAttempt;
    let mut tx = b.begin().await;
    for _ in 0..3 {
        tx.record_intent(&intent(EventId::new())).await.unwrap();
    }
    tx.commit().await;
    let store = b.intents();
    let stale = store.claim(1, Duration::ZERO).await.unwrap().remove(0);
    tokio::time::sleep(Duration::from_millis(5)).await; // past the zero-length lease
    let mut claimed = store.claim(10, MINUTE).await.unwrap();
    claimed.sort_by_key(|c| c.id);
    assert_eq!(claimed.len(), 3, "the expired one and the two others");
    let retaken = claimed.iter().find(|c| c.id == stale.id).unwrap();
    assert_eq!(retaken.attempt, 2);
    let done = |id, attempt| FinishedAttempt {
        id,
        attempt,
        outcome: IntentOutcome::Done {
            status: 201,
            body: format!("{{\"id\":{id}}}"),
        },
    };
    let mut batch: Vec<FinishedAttempt> = claimed
        .iter()
        .filter(|c| c.id != stale.id)
        .map(|c| done(c.id, c.attempt))
        .collect();
    batch.push(done(stale.id, stale.attempt));
    let mut recorded = store.finish_all(&batch).await.unwrap();
    recorded.sort_unstable();
    let others: Vec<i64> = claimed
        .iter()
        .map(|c| c.id)
        .filter(|id| *id != stale.id)
        .collect();
    assert_eq!(
        recorded, others,
        "the stale attempt is fenced, the others recorded"
    );
    let (_, status) = store.get(stale.id).await.unwrap().unwrap();
    assert_eq!(
        status,
        IntentStatus::Pending,
        "the fenced outcome changed nothing"
    );
    assert!(store.finish_all(&[]).await.unwrap().is_empty());
    assert_eq!(
        store.finish_all(&batch).await.unwrap(),
        vec![stale.id; 0],
        "a batch recorded once is not recorded again"
    );
    let again = store
        .finish_all(&[done(retaken.id, retaken.attempt)])
        .await
        .unwrap();
    assert_eq!(again, vec![stale.id], "the live attempt records");
    for c in &claimed {
        let (_, status) = store.get(c.id).await.unwrap().unwrap();
        assert_eq!(status, IntentStatus::Done, "{}", c.id);
    }
}

pub async fn parked_intents_are_listed_and_retried_with_the_same_key<B: Backend>(b: &B) {
    let i = intent(EventId::new());
    let mut tx = b.begin().await;
    tx.record_intent(&i).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let c = store.claim(10, MINUTE).await.unwrap().remove(0);
    let reason = "422: the key was used with a different request";
    assert!(
        store
            .finish(
                c.id,
                c.attempt,
                &IntentOutcome::Park {
                    reason: reason.into()
                }
            )
            .await
            .unwrap()
    );
    let stuck = store.stuck(10).await.unwrap();
    assert_eq!(stuck.len(), 1);
    assert_eq!(
        (stuck[0].status.as_str(), stuck[0].reason.as_deref()),
        ("parked", Some(reason))
    );
    assert_eq!(store.retry_stuck(Some(&[c.id])).await.unwrap(), 1);
    let again = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!((again.key, again.attempt), (c.key, 2));
}

pub async fn unknown_intents_are_read_and_resolved_by_a_decision<B: Backend>(b: &B) {
    use idem_core::idempotency::Resolution;
    let (applied, resent) = (intent(EventId::new()), intent(EventId::new()));
    let mut tx = b.begin().await;
    tx.record_intent(&applied).await.unwrap();
    tx.record_intent(&resent).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let claimed = store.claim(10, MINUTE).await.unwrap();
    let unknown = IntentOutcome::Unknown {
        reason: "timed out; the remote ignores keys".into(),
    };
    for c in &claimed {
        assert!(store.finish(c.id, c.attempt, &unknown).await.unwrap());
    }
    let (a, r) = (&claimed[0], &claimed[1]);
    let (read, status) = store.get(a.id).await.unwrap().unwrap();
    assert_eq!(
        (read.key.clone(), status.as_str()),
        (a.key.clone(), "unknown")
    );
    assert_eq!(read.intent, applied);
    assert!(store.get(a.id + 1_000).await.unwrap().is_none());

    assert!(
        store
            .resolve(a.id, Resolution::Applied, "checked at the remote")
            .await
            .unwrap()
    );
    assert!(
        !store
            .resolve(a.id, Resolution::Pending, "again")
            .await
            .unwrap(),
        "a done intent is not reopened"
    );
    assert_eq!(
        store.get(a.id).await.unwrap().unwrap().1,
        IntentStatus::Done
    );
    assert!(
        store
            .resolve(r.id, Resolution::Pending, "compensated")
            .await
            .unwrap()
    );
    let again = store.claim(10, MINUTE).await.unwrap();
    assert_eq!(again.len(), 1, "only the re-sent one is due");
    assert_eq!(
        (again[0].id, &again[0].key, again[0].attempt),
        (r.id, &r.key, 2)
    );
    assert!(store.stuck(10).await.unwrap().is_empty());
}

/// The claim looks at a bounded window of pending rows, made of claimable aggregate heads: one
/// aggregate whose head backs off and whose rows fill the oldest positions never hides the
/// others (a window of the oldest rows would find nothing, and the outbox would move one batch
/// per full scan), so two claims in a row both find the other aggregates.
pub async fn a_backing_off_aggregate_does_not_slow_the_others<B: Backend>(b: &B) {
    // 70 rows of one aggregate first (more than the 64-row window of a batch of 10), then 20
    // single-row aggregates.
    let hot: Vec<Event> = (0..70).map(|i| event("hot-1", i)).collect();
    let cold: Vec<Event> = (0..20).map(|i| event(&format!("cold-{i}"), 0)).collect();
    for events in [&hot, &cold] {
        let mut tx = b.begin().await;
        tx.enqueue(events).await.unwrap();
        tx.commit().await;
    }
    // The hot aggregate's head fails and backs off for an hour.
    let head = b.store().claim(&req("r", 1)).await.unwrap();
    assert_eq!(head.records.len(), 1);
    assert_eq!(head.records[0].aggregate_id, "hot-1");
    let outcome = ClaimOutcome {
        published: vec![],
        failed: vec![Failure {
            id: head.records[0].id,
            reason: "partition unavailable".into(),
            backoff: Duration::from_secs(3600),
            disposition: Disposition::Retry,
        }],
    };
    b.store().complete(&head, &outcome).await.unwrap();

    let first = b.store().claim(&req("r", 10)).await.unwrap();
    let second = b.store().claim(&req("r", 10)).await.unwrap();
    for (n, c) in [(1, &first), (2, &second)] {
        assert_eq!(c.records.len(), 10, "claim {n}: {:?}", ids(c));
        assert!(
            c.records
                .iter()
                .all(|r| r.aggregate_id.starts_with("cold-")),
            "claim {n} took a row behind the backing-off head"
        );
    }
    let taken: std::collections::HashSet<i64> = first
        .records
        .iter()
        .chain(&second.records)
        .map(|r| r.id)
        .collect();
    assert_eq!(taken.len(), 20, "the two claims overlap");
}

/// A row written through the SQL contract by a foreign writer that cannot be decoded (here an
/// empty key) must not fail the whole claim after it committed, every lease period, so that no
/// intent is delivered any more: it is parked with its reason; the others are claimed.
pub async fn an_undecodable_intent_is_parked_and_the_others_are_claimed<B: Backend>(b: &B) {
    let t = b.tables().qualified("effect_intents");
    b.exec(&format!(
        "INSERT INTO {t} (idem_key, effect, target, event_id, body) \
         VALUES ('', 'points.award', 'http://127.0.0.1:1/awards', '018f0000-0000-7000-8000-000000000001', '{{}}')"
    ))
    .await
    .unwrap();
    let good = intent(EventId::new());
    let mut tx = b.begin().await;
    tx.record_intent(&good).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let claimed = store.claim(10, MINUTE).await.unwrap();
    assert_eq!(claimed.len(), 1, "the decodable intent is delivered");
    assert_eq!(claimed[0].intent, good);
    let stuck = store.stuck(10).await.unwrap();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert_eq!(stuck[0].status, IntentStatus::Parked);
    assert!(
        stuck[0]
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("cannot be decoded"),
        "{stuck:?}"
    );
    assert!(store.claim(10, MINUTE).await.unwrap().is_empty());
}

/// A sending mark holds every later attempt back for the policy's settle: the successor of a
/// dispatcher that died with the request in flight asks the remote only once the remote had
/// `settle` to finish that request (a probe asked sooner finds nothing, and the effect is sent
/// twice), although the lease ended long before.
pub async fn a_sending_mark_holds_the_next_attempt_for_its_settle<B: Backend>(b: &B) {
    let i = intent(EventId::new());
    let mut tx = b.begin().await;
    tx.record_intent(&i).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let first = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert!(
        store
            .mark_sending(first.id, 1, SECOND, 60 * MINUTE)
            .await
            .unwrap()
    );
    // The dispatcher dies with the request in flight; its lease ends.
    b.end_intent_leases().await;
    assert!(
        store.claim(10, MINUTE).await.unwrap().is_empty(),
        "claimed again before the remote had its settle time"
    );
    // Once the settle time is over, the next attempt sees the unrecorded send.
    b.expire_intent_leases().await;
    let second = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!((second.attempt, second.unrecorded_send), (2, Some(1)));
}

/// The durable sending mark: written only while the attempt holds enough lease,
/// seen by every later attempt until an outcome of the marked attempt is recorded, kept by a
/// retry of an attempt that sent nothing, cleared by a decision.
pub async fn a_sending_mark_lasts_until_an_outcome_of_its_attempt_is_recorded<B: Backend>(b: &B) {
    let i = intent(EventId::new());
    let mut tx = b.begin().await;
    tx.record_intent(&i).await.unwrap();
    tx.commit().await;
    let store = b.intents();
    let first = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(first.unrecorded_send, None);
    assert!(
        !store
            .mark_sending(first.id, 1, 2 * MINUTE, Duration::ZERO)
            .await
            .unwrap(),
        "the lease is too short for this request"
    );
    assert!(
        !store
            .mark_sending(first.id, 2, SECOND, Duration::ZERO)
            .await
            .unwrap(),
        "not this attempt's lease"
    );
    assert!(
        store
            .mark_sending(first.id, 1, SECOND, Duration::ZERO)
            .await
            .unwrap()
    );

    // The dispatcher dies; after the lease, the next attempt sees the unrecorded send.
    b.expire_intent_leases().await;
    let second = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!((second.attempt, second.unrecorded_send), (2, Some(1)));
    let retry = |reason: &str| IntentOutcome::Retry {
        after: Duration::ZERO,
        reason: reason.into(),
    };
    assert!(
        !store.finish(first.id, 1, &retry("late")).await.unwrap(),
        "the dead attempt is fenced"
    );
    assert!(
        store
            .finish(second.id, 2, &retry("not sent: too little lease left"))
            .await
            .unwrap()
    );
    let third = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(
        third.unrecorded_send,
        Some(1),
        "a retry of an attempt that sent nothing keeps the mark"
    );
    assert!(
        store
            .mark_sending(third.id, 3, SECOND, Duration::ZERO)
            .await
            .unwrap()
    );
    assert!(store.finish(third.id, 3, &retry("429")).await.unwrap());
    let fourth = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(
        fourth.unrecorded_send, None,
        "attempt 3's outcome is recorded"
    );
    assert_eq!(
        store
            .get(fourth.id)
            .await
            .unwrap()
            .unwrap()
            .0
            .unrecorded_send,
        None
    );

    assert!(
        store
            .mark_sending(fourth.id, 4, SECOND, Duration::ZERO)
            .await
            .unwrap()
    );
    let unknown = IntentOutcome::Unknown {
        reason: "attempt 4 was sent and its outcome never recorded".into(),
    };
    b.expire_intent_leases().await;
    let fifth = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(fifth.unrecorded_send, Some(4));
    assert!(store.finish(fifth.id, 5, &unknown).await.unwrap());
    assert_eq!(store.retry_stuck(Some(&[fifth.id])).await.unwrap(), 1);
    let sixth = store.claim(10, MINUTE).await.unwrap().remove(0);
    assert_eq!(
        (sixth.attempt, sixth.unrecorded_send),
        (6, None),
        "a person's retry is a decision: the mark is gone"
    );
}
