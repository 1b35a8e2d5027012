//! The relay's own bookkeeping (a claim's lease, a batch's mark) commits without waiting for
//! the WAL flush, and that setting never leaves the relay's transaction.
//!
//! Why it is safe: a lease or a mark lost to a PostgreSQL crash leaves rows pending (unleased,
//! or leased until the lease ends) that are published again, which the consumer's inbox absorbs
//! (docs/concepts/duplicate-windows.md). Why it matters: under write load a flush waits behind
//! every writer's WAL (40–230 ms measured in the bench), and a cycle paid two of them. What must
//! never happen: the setting leaking into the pooled connection, where a caller's business
//! transaction (a pool shared with the application) would then commit without durability.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_conformance::backend::{Backend, Pg};
use idem_core::outbox::{ClaimOutcome, ClaimRequest};
use idem_core::store::OutboxStore;
use sqlx::PgConnection;

const GUARD: &str = include_str!("../sql/postgres/claim_guard.sql");
const MARK: &str = include_str!("../sql/postgres/complete.sql");

async fn synchronous_commit(conn: &mut PgConnection) -> String {
    sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// The claim's guard and the mark statement turn `synchronous_commit` off for their own
/// transaction only.
#[tokio::test]
async fn the_claim_guard_and_the_mark_commit_without_waiting_for_the_flush() {
    let pg = Pg::new().await;
    let mut tx = pg.pool().begin().await.unwrap();
    assert_eq!(synchronous_commit(&mut tx).await, "on");
    sqlx::query(GUARD)
        .bind("10000")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(synchronous_commit(&mut tx).await, "off");
    tx.rollback().await.unwrap();

    let mut tx = pg.pool().begin().await.unwrap();
    let mark = MARK.replace("{outbox}", "idem_outbox");
    let none: Vec<i64> = vec![];
    sqlx::query(&mark)
        .bind(&none)
        .bind(uuid::Uuid::now_v7())
        .bind(&none)
        .bind(Vec::<String>::new())
        .bind(&none)
        .bind(Vec::<bool>::new())
        .bind(Vec::<bool>::new())
        .bind(Vec::<bool>::new())
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(synchronous_commit(&mut tx).await, "off");
    tx.commit().await.unwrap();
    let mut conn = pg.pool().acquire().await.unwrap();
    assert_eq!(synchronous_commit(&mut conn).await, "on");
}

/// After a claim and a mark through the store, the one pooled connection they used is back to
/// the server's setting.
#[tokio::test]
async fn the_relay_s_asynchronous_commit_never_leaks_into_its_pool() {
    let pg = Pg::new().await;
    pg.exec(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'o-' || n, 'order.paid', '{}' \
         FROM generate_series(1, 10) n ORDER BY n",
    )
    .await
    .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(pg.url())
        .await
        .unwrap();
    let store = idem_sql::RelayStore::new(pool.clone(), idem_core::TableNames::default());
    let request = ClaimRequest {
        relay_id: "durability".into(),
        batch_size: 100,
        lease: Duration::from_secs(60),
    };
    let claim = store.claim(&request).await.unwrap();
    assert_eq!(claim.records.len(), 10);
    assert_eq!(
        synchronous_commit(&mut pool.acquire().await.unwrap()).await,
        "on"
    );
    let outcome = ClaimOutcome {
        published: claim.records.iter().map(|r| r.id).collect(),
        failed: vec![],
    };
    assert_eq!(store.complete(&claim, &outcome).await.unwrap().marked, 10);
    assert_eq!(
        synchronous_commit(&mut pool.acquire().await.unwrap()).await,
        "on"
    );
    assert_eq!(
        pg.scalar("SELECT count(*) FROM idem_outbox WHERE status = 'published'")
            .await,
        10
    );
}
