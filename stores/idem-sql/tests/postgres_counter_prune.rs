//! Pruning the outbox's per-aggregate counters (`idem_outbox_aggregates`): only aggregates with
//! no pending or parked row lose their counter, a counter a writer holds is skipped, the delete
//! checks again after its locks, and writers racing the prune keep their order: every new row
//! gets a number above every pending row of its aggregate, and no two pending rows of one
//! aggregate share a number.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use idem_conformance::backend::{Backend, OpenTx, Pg};
use idem_conformance::process::eventually;
use idem_conformance::scenarios::event;
use idem_core::retention::RetentionStore;

async fn enqueue(pg: &Pg, agg: &str) {
    let mut tx = pg.begin().await;
    tx.enqueue(&[event(agg, 0)]).await.unwrap();
    tx.commit().await;
}

async fn counter(pg: &Pg, agg: &str) -> i64 {
    pg.scalar(&format!(
        "SELECT coalesce(max(last_seq), -1) FROM idem_outbox_aggregates WHERE aggregate_id = '{agg}'"
    ))
    .await
}

async fn last_seq(pg: &Pg, agg: &str) -> i64 {
    pg.scalar(&format!(
        "SELECT aggregate_seq FROM idem_outbox WHERE aggregate_id = '{agg}' ORDER BY id DESC LIMIT 1"
    ))
    .await
}

async fn set_status(pg: &Pg, agg: &str, status: &str) {
    pg.exec(&format!(
        "UPDATE idem_outbox SET status = '{status}', \
         published_at = CASE WHEN '{status}' = 'published' THEN now() END \
         WHERE aggregate_id = '{agg}'"
    ))
    .await
    .unwrap();
}

#[tokio::test]
async fn only_counters_of_aggregates_without_pending_or_parked_rows_are_pruned() {
    let pg = Pg::new().await;
    for agg in ["published", "pending", "parked"] {
        enqueue(&pg, agg).await;
        enqueue(&pg, agg).await;
    }
    set_status(&pg, "published", "published").await;
    set_status(&pg, "parked", "parked").await;
    let store = pg.store();
    assert_eq!(store.prune_aggregate_counters(100).await.unwrap(), 1);
    assert_eq!(store.prune_aggregate_counters(100).await.unwrap(), 0);
    assert_eq!(counter(&pg, "published").await, -1, "pruned");
    assert_eq!(
        (counter(&pg, "pending").await, counter(&pg, "parked").await),
        (2, 2),
        "kept"
    );
    for agg in ["published", "pending", "parked"] {
        enqueue(&pg, agg).await;
    }
    assert_eq!(last_seq(&pg, "published").await, 1, "restarted at 1");
    assert_eq!(last_seq(&pg, "pending").await, 3, "continued");
    assert_eq!(last_seq(&pg, "parked").await, 3, "continued");
}

#[tokio::test]
async fn prune_batches_are_bounded() {
    let pg = Pg::new().await;
    for i in 0..5 {
        enqueue(&pg, &format!("o-{i}")).await;
    }
    pg.exec("UPDATE idem_outbox SET status = 'published', published_at = now()")
        .await
        .unwrap();
    let store = pg.store();
    let counts = [
        store.prune_aggregate_counters(2).await.unwrap(),
        store.prune_aggregate_counters(2).await.unwrap(),
        store.prune_aggregate_counters(2).await.unwrap(),
        store.prune_aggregate_counters(2).await.unwrap(),
    ];
    assert_eq!(counts, [2, 2, 1, 0]);
}

/// A writer inside its transaction holds its aggregate's counter (the trigger's upsert): the
/// prune skips it instead of deleting a counter whose new number is not committed yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_a_writer_holds_is_skipped() {
    let pg = Pg::new().await;
    enqueue(&pg, "o-1").await;
    set_status(&pg, "o-1", "published").await;
    let mut writer = pg.begin().await;
    writer.enqueue(&[event("o-1", 1)]).await.unwrap();
    let store = pg.store();
    assert_eq!(
        store.prune_aggregate_counters(100).await.unwrap(),
        0,
        "skipped, not waited for"
    );
    writer.commit().await;
    assert_eq!(last_seq(&pg, "o-1").await, 2);
    assert_eq!(counter(&pg, "o-1").await, 2);
}

/// The delete checks again in its own snapshot: a candidate whose aggregate has a pending row
/// by then (a writer committed after the candidates were chosen) keeps its counter.
#[tokio::test]
async fn the_delete_checks_the_candidates_again() {
    let pg = Pg::new().await;
    enqueue(&pg, "busy").await; // pending
    enqueue(&pg, "idle").await;
    set_status(&pg, "idle", "published").await;
    let tables = idem_core::TableNames::default();
    let bases = ["outbox_aggregates", "outbox"];
    let prune = tables.render(include_str!("../sql/postgres/counters_prune.sql"), &bases);
    // As if the lock statement had chosen both before the writer of "busy" committed.
    let deleted = sqlx::query(&prune)
        .bind(vec!["order".to_owned(), "order".to_owned()])
        .bind(vec!["busy".to_owned(), "idle".to_owned()])
        .execute(pg.pool())
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(deleted, 1);
    assert_eq!(
        (counter(&pg, "busy").await, counter(&pg, "idle").await),
        (1, -1)
    );
}

/// Writers of a few hot aggregates, a relay that publishes what is pending, and the prune, all
/// at once until the prune has deleted counters under the writers' feet. Each writer checks, in
/// its own transaction, that its row's number is above every pending row of its aggregate; at
/// the end no two pending rows of one aggregate share a number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_racing_the_prune_keep_their_order() {
    let pg = Arc::new(Pg::new().await);
    let stop = Arc::new(AtomicBool::new(false));
    let (pruned, written) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut writers = vec![];
    for w in 0..3 {
        let (pg, stop, written) = (Arc::clone(&pg), Arc::clone(&stop), Arc::clone(&written));
        writers.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let agg = format!("hot-{}", (i + w) % 3);
                let e = event(&agg, i);
                let mut tx = pg.begin().await;
                tx.enqueue(std::slice::from_ref(&e)).await.unwrap();
                let below = tx
                    .exec(&format!(
                        "SELECT 1 FROM idem_outbox o, idem_outbox m \
                         WHERE m.event_id = '{}' AND o.aggregate_id = m.aggregate_id \
                           AND o.status = 'pending' AND o.id <> m.id \
                           AND o.aggregate_seq >= m.aggregate_seq",
                        e.id()
                    ))
                    .await
                    .unwrap();
                assert_eq!(
                    below, 0,
                    "a new row of {agg} is not above a pending row of it"
                );
                tx.commit().await;
                written.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    let relay = {
        let (pg, stop) = (Arc::clone(&pg), Arc::clone(&stop));
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                pg.exec("UPDATE idem_outbox SET status = 'published', published_at = now() WHERE status = 'pending'")
                    .await
                    .unwrap();
                tokio::task::yield_now().await;
            }
        })
    };
    let prune = {
        let (pg, stop, pruned) = (Arc::clone(&pg), Arc::clone(&stop), Arc::clone(&pruned));
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let n = pg.store().prune_aggregate_counters(10).await.unwrap();
                pruned.fetch_add(n, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        })
    };
    eventually(
        "counters pruned while 300 rows were written",
        Duration::from_secs(120),
        || async {
            (pruned.load(Ordering::Relaxed) >= 20 && written.load(Ordering::Relaxed) >= 300)
                .then_some(())
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for t in writers.into_iter().chain([relay, prune]) {
        t.await.unwrap();
    }
    let shared = pg
        .scalar(
            "SELECT count(*) FROM (SELECT 1 FROM idem_outbox WHERE status = 'pending' \
             GROUP BY aggregate_type, aggregate_id, aggregate_seq HAVING count(*) > 1) d",
        )
        .await;
    assert_eq!(
        shared, 0,
        "two pending rows of one aggregate share a number"
    );
}
