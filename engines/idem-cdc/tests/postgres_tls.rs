//! The CDC relay over TLS against the suite's real PostgreSQL server: a role the server refuses
//! in clear (`idem_tls`), `sslmode=verify-full` with the CA made for the run, and every backend
//! of that role — the relay's pool and its walsender — encrypted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{World, event, spawn, stop};
use idem_cdc::{CdcMetrics, CdcRelay};
use idem_conformance::pg::PgTlsMaterial;
use idem_kafka::KafkaPublisher;

/// Hands the world's database and its tables to `idem_tls` (the publication needs the table's
/// owner; the drain writes the outbox).
async fn give_to_idem_tls(w: &World) {
    sqlx::raw_sql(
        "DO $$ DECLARE r record; BEGIN \
           EXECUTE format('ALTER DATABASE %I OWNER TO idem_tls', current_database()); \
           FOR r IN SELECT tablename FROM pg_tables WHERE schemaname = 'public' LOOP \
             EXECUTE format('ALTER TABLE public.%I OWNER TO idem_tls', r.tablename); \
           END LOOP; END $$",
    )
    .execute(w.pg.pool())
    .await
    .unwrap();
}

/// `(backend_type, ssl)` of every backend of role `idem_tls` in the world's database, the
/// walsender included (it has no database: matched by application name).
async fn idem_tls_backends(w: &World) -> Vec<(String, bool)> {
    sqlx::query_as(
        "SELECT a.backend_type, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.usename = 'idem_tls' \
           AND (a.datname = current_database() OR a.application_name = $1) \
         ORDER BY a.backend_type",
    )
    .bind(format!("idem-cdc-{}", w.slot))
    .fetch_all(w.pg.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cdc_relay_streams_over_verify_full_tls_with_every_backend_encrypted() {
    let tls = PgTlsMaterial::get();
    let w = World::new().await;
    give_to_idem_tls(&w).await;
    let db: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(w.pg.pool())
        .await
        .unwrap();
    let url = tls.verify_full_url(&db);
    let pool = idem_sql::postgres::connect(&url, 4)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let producer = idem_kafka::producer_config(&w.brokers, &[]).unwrap();
    let publisher = KafkaPublisher::new(producer)
        .unwrap()
        .with_topic_creation(1, Some(1));
    let relay = CdcRelay::new(
        &url,
        pool,
        publisher,
        w.config(),
        CdcMetrics::unregistered().unwrap(),
    );
    relay.prepare().await.unwrap_or_else(|e| panic!("{e}"));
    let mut running = spawn(relay);
    let before = w.streaming(&mut running).await;
    let e = event("tls-1", 1);
    w.commit(std::slice::from_ref(&e)).await;
    let got = w.records(before + 1, &mut running).await;
    assert_eq!(
        got[before].header("ce_id"),
        Some(e.id().to_string().as_str())
    );

    let backends = idem_tls_backends(&w).await;
    assert!(
        backends.iter().any(|(t, _)| t == "walsender"),
        "no walsender of idem_tls: {backends:?}"
    );
    assert!(
        backends.iter().any(|(t, _)| t == "client backend"),
        "no pool connection of idem_tls: {backends:?}"
    );
    assert!(
        backends.iter().all(|(_, ssl)| *ssl),
        "a backend in clear: {backends:?}"
    );
    stop(running).await;
}
