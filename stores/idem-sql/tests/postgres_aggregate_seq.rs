//! `aggregate_seq` numbers only the rows that are inserted: an idempotent re-enqueue through
//! the SQL contract (`INSERT … ON CONFLICT (event_id) DO NOTHING`, or `DO UPDATE`) must not
//! burn a number, or a consumer that waits for `last + 1` waits forever.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_conformance::backend::{Backend, Pg};
use idem_conformance::process::eventually;

const E1: &str = "0190b6a4-0000-7000-8000-000000000001";
const E2: &str = "0190b6a4-0000-7000-8000-000000000002";
const E3: &str = "0190b6a4-0000-7000-8000-000000000003";

fn insert(event_id: &str, conflict: &str) -> String {
    format!(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('{event_id}', 'order', 'o-1', 'order.paid', '{{}}') {conflict}"
    )
}

async fn seqs(pg: &Pg) -> (Vec<i64>, i64) {
    let seqs: Vec<i64> = sqlx::query_scalar(
        "SELECT aggregate_seq FROM idem_outbox WHERE aggregate_id = 'o-1' ORDER BY aggregate_seq",
    )
    .fetch_all(pg.pool())
    .await
    .unwrap();
    let last = pg
        .scalar("SELECT last_seq FROM idem_outbox_aggregates WHERE aggregate_id = 'o-1'")
        .await;
    (seqs, last)
}

#[tokio::test]
async fn an_on_conflict_re_insert_takes_no_sequence_number() {
    let pg = Pg::new().await;
    pg.exec(&insert(E1, "")).await.unwrap();
    // The idempotent re-enqueue the contract invites (same event_id), both forms.
    let n = pg
        .exec(&insert(E1, "ON CONFLICT (event_id) DO NOTHING"))
        .await
        .unwrap();
    assert_eq!(n, 0);
    let n = pg
        .exec(&insert(
            E1,
            "ON CONFLICT (event_id) DO UPDATE SET payload = EXCLUDED.payload",
        ))
        .await
        .unwrap();
    assert_eq!(n, 1, "DO UPDATE updates the existing row");
    // A plain duplicate is still refused.
    let err = pg.exec(&insert(E1, "")).await.unwrap_err();
    assert!(err.contains("idem_outbox_event_id_key"), "{err}");
    pg.exec(&insert(E2, "")).await.unwrap();
    assert_eq!(seqs(&pg).await, (vec![1, 2], 2), "no number burnt");
    // Several rows in one statement, one of them a re-insert.
    let many = format!(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('{E2}', 'order', 'o-1', 'order.paid', '{{}}'), ('{E3}', 'order', 'o-1', 'order.paid', '{{}}') \
         ON CONFLICT (event_id) DO NOTHING"
    );
    assert_eq!(pg.exec(&many).await.unwrap(), 1);
    assert_eq!(seqs(&pg).await, (vec![1, 2, 3], 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_insert_racing_the_first_insert_takes_no_sequence_number() {
    let pg = Pg::new().await;
    let mut first = pg.pool().begin().await.unwrap();
    sqlx::query(&insert(E1, ""))
        .execute(&mut *first)
        .await
        .unwrap();
    // A second writer re-enqueues the same event while the first has not committed: it waits
    // for the aggregate's counter, then finds the committed row.
    let pool = pg.pool().clone();
    let second = tokio::spawn(async move {
        sqlx::query(&insert(E1, "ON CONFLICT (event_id) DO NOTHING"))
            .execute(&pool)
            .await
            .map(|r| r.rows_affected())
    });
    eventually(
        "the second writer to wait for the first",
        Duration::from_secs(10),
        || async { (pg.lock_waiters().await >= 1).then_some(()) },
    )
    .await;
    first.commit().await.unwrap();
    assert_eq!(second.await.unwrap().unwrap(), 0);
    pg.exec(&insert(E2, "")).await.unwrap();
    assert_eq!(seqs(&pg).await, (vec![1, 2], 2), "no number burnt");
}
