//! The outbox's trigger functions run with their own `search_path`, not the writer's: a writer
//! that shadows idem's tables with TEMP tables, or PostgreSQL's functions with functions of its
//! own in a schema it puts first, still gets the right `aggregate_seq` and `written_lsn`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_conformance::backend::{Backend, Pg};
use sqlx::{Connection, Executor, PgConnection};

const INSERT: &str = "INSERT INTO public.idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
                      VALUES (gen_random_uuid(), 'order', 'o-1', 'order.paid', '{}')";

/// A session of a hostile writer: TEMP tables named like the counter and the outbox, and a
/// schema ahead of `pg_catalog` with its own `pg_current_wal_insert_lsn()`, `jsonb_typeof()`,
/// `length()` and `octet_length()`.
async fn hostile(pg: &Pg) -> PgConnection {
    let mut conn = PgConnection::connect(pg.url()).await.unwrap();
    conn.execute(
        "CREATE TEMP TABLE idem_outbox_aggregates (aggregate_type text, aggregate_id text, \
             last_seq bigint, PRIMARY KEY (aggregate_type, aggregate_id)); \
         INSERT INTO idem_outbox_aggregates VALUES ('order', 'o-1', 1); \
         CREATE TEMP TABLE idem_outbox (LIKE public.idem_outbox); \
         CREATE SCHEMA IF NOT EXISTS shadow; \
         CREATE OR REPLACE FUNCTION shadow.pg_current_wal_insert_lsn() RETURNS pg_lsn \
             LANGUAGE sql AS $$ SELECT 'FFFFFFFF/FFFFFFFF'::pg_lsn $$; \
         CREATE OR REPLACE FUNCTION shadow.jsonb_typeof(jsonb) RETURNS text \
             LANGUAGE sql AS $$ SELECT 'object'::text $$; \
         CREATE OR REPLACE FUNCTION shadow.length(text) RETURNS integer \
             LANGUAGE sql AS $$ SELECT 1 $$; \
         CREATE OR REPLACE FUNCTION shadow.octet_length(text) RETURNS integer \
             LANGUAGE sql AS $$ SELECT 1 $$; \
         SET search_path = shadow, pg_temp, pg_catalog, public",
    )
    .await
    .unwrap();
    conn
}

#[tokio::test]
async fn a_writer_shadowing_the_counter_table_still_gets_the_next_number() {
    let pg = Pg::new().await;
    pg.exec(INSERT).await.unwrap();
    pg.exec(INSERT).await.unwrap();
    let mut evil = hostile(&pg).await;
    evil.execute(INSERT).await.unwrap();
    evil.close().await.unwrap();
    pg.exec(INSERT).await.unwrap();
    let seqs: Vec<i64> = sqlx::query_scalar("SELECT aggregate_seq FROM idem_outbox ORDER BY id")
        .fetch_all(pg.pool())
        .await
        .unwrap();
    assert_eq!(
        seqs,
        vec![1, 2, 3, 4],
        "one number per event, from the real counter"
    );
    assert_eq!(
        pg.scalar("SELECT last_seq FROM idem_outbox_aggregates WHERE aggregate_id = 'o-1'")
            .await,
        4
    );
}

#[tokio::test]
async fn a_writer_shadowing_pg_catalog_functions_cannot_hide_a_row_from_the_drain() {
    let pg = Pg::new().await;
    let mut evil = hostile(&pg).await;
    evil.execute(INSERT).await.unwrap();
    // The CDC relay's drain publishes the pending rows written before the slot's confirmed
    // position (engines/idem-cdc/src/drain.rs); a slot created now is past every row above.
    let hidden = pg
        .scalar(
            "SELECT count(*) FROM idem_outbox WHERE status = 'pending' \
             AND NOT (written_lsn IS NULL OR written_lsn < pg_current_wal_insert_lsn())",
        )
        .await;
    assert_eq!(hidden, 0, "every row is behind the server's WAL position");
    // The writer's rules are PostgreSQL's functions, not the writer's.
    let long = format!(
        "INSERT INTO public.idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers) \
         VALUES (gen_random_uuid(), 'order', '{}', 'order.paid', '{{}}', '{{}}')",
        "x".repeat(600)
    );
    let err = evil.execute(long.as_str()).await.unwrap_err().to_string();
    assert!(err.contains("idem_outbox_aggregate_id_check"), "{err}");
    let not_object = "INSERT INTO public.idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers) \
         VALUES (gen_random_uuid(), 'order', 'o-2', 'order.paid', '{}', '[]')";
    let err = evil.execute(not_object).await.unwrap_err().to_string();
    assert!(err.contains("idem_outbox_headers_check"), "{err}");
    evil.close().await.unwrap();
    assert_eq!(pg.scalar("SELECT count(*) FROM idem_outbox").await, 1);
}
