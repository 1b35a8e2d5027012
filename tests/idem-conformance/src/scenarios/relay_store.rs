//! The relay's view of the outbox ([`OutboxStore`], idem-sql's `relay_store.rs`): concurrent claims
//! never share an aggregate, a stale claim is fenced, failed rows back off or park, the backlog
//! gauges count what waits, pruning keeps what is not published, and an aggregate that backs off
//! never slows the others.

use std::collections::HashSet;
use std::time::Duration;

use idem_core::outbox::{Claim, ClaimOutcome, Disposition, Failure, PrunePolicy};
use idem_core::store::OutboxStore;
use idem_core::{Event, EventId};

use super::{event, ids, publish_all, req};
use crate::backend::{Backend, OpenTx};

scenarios! {
    relay_store_scenarios;
    claims_never_share_an_aggregate,
    stale_claim_cannot_mark,
    failed_rows_back_off_and_park,
    backlog_counts_pending_and_parked_rows_per_aggregate_type,
    prune_deletes_or_archives_published_rows,
    a_backing_off_aggregate_does_not_slow_the_others,
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
