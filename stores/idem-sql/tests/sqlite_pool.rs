//! A SQLite pool never hands out, or keeps, a connection left inside a transaction.
//!
//! sqlx's `begin_with("BEGIN IMMEDIATE")` has a cancellation window: the `BEGIN` is executed and
//! acknowledged, then `begin_with` awaits the connection's handle to check it; a future dropped
//! there (an aborted task, a cancelled claim) leaves no `Transaction` to roll back. The pooled
//! connection then held SQLite's write lock, and every other writer waited out its busy timeout
//! and failed with "database is locked" (the effect pipeline's kill test failed so about once in
//! thirty runs on a loaded machine). The pool now checks each connection it takes back and closes
//! one that is still in a transaction. The window itself cannot be hit on demand, so this test
//! makes the state it leaves: a `BEGIN IMMEDIATE` sqlx does not know about.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use sqlx::Executor;

#[tokio::test]
async fn a_connection_released_inside_a_transaction_is_closed_not_reused_with_the_write_lock() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("pool.db").display());
    let pool = idem_sql::sqlite::connect(&url).await.unwrap();
    pool.execute("CREATE TABLE t (n integer NOT NULL)")
        .await
        .unwrap();
    {
        let mut conn = pool.acquire().await.unwrap();
        conn.execute("BEGIN IMMEDIATE").await.unwrap();
        conn.execute("INSERT INTO t VALUES (1)").await.unwrap();
    } // released to the pool inside its transaction, holding the write lock

    // Another process's writer: it waits (busy timeout, 5 s) until the lock is freed, and
    // failed with "database is locked" when the connection went back to the pool.
    let other = idem_sql::sqlite::connect(&url).await.unwrap();
    other.execute("INSERT INTO t VALUES (2)").await.unwrap();
    // The released transaction was rolled back, not committed by a later user of the pool.
    for _ in 0..8 {
        pool.execute("INSERT INTO t VALUES (3)").await.unwrap();
    }
    let ones: i64 = sqlx::query_scalar("SELECT count(*) FROM t WHERE n = 1")
        .fetch_one(&other)
        .await
        .unwrap();
    assert_eq!(ones, 0);
    let threes: i64 = sqlx::query_scalar("SELECT count(*) FROM t WHERE n = 3")
        .fetch_one(&other)
        .await
        .unwrap();
    assert_eq!(
        threes, 8,
        "every later write of the pool committed on its own"
    );
}
