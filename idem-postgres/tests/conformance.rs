//! The store conformance suite against a real PostgreSQL server (`IDEM_TEST_PG_URL`).

use idem_conformance::backend::{Backend, OpenTx, Pg};
use idem_conformance::scenarios;
use idem_core::{OutboxStore, TableNames};

idem_conformance::conformance_tests!(Pg::new().await);

#[tokio::test]
async fn tables_in_a_named_schema() {
    let pg = Pg::new().await;
    let billing = pg.with_tables(TableNames::new(Some("billing"), "idem_").unwrap());
    assert_eq!(billing.migrate().await.unwrap(), vec![1, 2, 3, 4, 5, 6]);
    let mut tx = billing.begin().await;
    tx.enqueue(&[scenarios::event("o-1", 0)]).await.unwrap();
    tx.commit().await;
    assert_eq!(
        pg.scalar("SELECT count(*) FROM billing.idem_outbox").await,
        1
    );
    assert_eq!(pg.store().status().await.unwrap().pending, 0);
}

#[tokio::test]
async fn concurrent_migrations_apply_once() {
    let pg = Pg::new().await;
    let other = pg.with_tables(TableNames::new(None, "twice_").unwrap());
    let again = pg.with_tables(TableNames::new(None, "twice_").unwrap());
    let (a, b) = tokio::join!(other.migrate(), again.migrate());
    let mut applied = [a.unwrap(), b.unwrap()];
    applied.sort();
    assert_eq!(applied, [vec![], vec![1, 2, 3, 4, 5, 6]]);
}

/// Timestamps PostgreSQL stores and no client library holds: refused since version 6.
const HOSTILE_TIMES: &[&str] = &[
    "infinity",
    "-infinity",
    "270000-01-01 00:00:00+00",
    "10000-01-01 00:00:00+00",
];
/// Those of them chrono cannot hold either (it ends at year 262142).
const UNDECODABLE_TIMES: &[&str] = &["infinity", "-infinity", "270000-01-01 00:00:00+00"];

/// A row written through the SQL contract, as a foreign writer would.
fn foreign_insert(
    aggregate_id: &str,
    occurred_at: &str,
) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
         VALUES (gen_random_uuid(), 'order', $1, 'order.paid', '{}', $2::timestamptz)",
    )
    .bind(aggregate_id.to_owned())
    .bind(occurred_at.to_owned())
}

/// `occurred_at` = 'infinity' (or a year no client can hold) passed every check of the
/// contract, and sqlx's decoder then panicked in every relay that claimed the row, after the
/// claim had committed: no aggregate moved any more (review §1). The contract now refuses such
/// values at insert, and a row stored before that is claimed as corrupt (the relay parks it)
/// while the rows of other aggregates are claimed as usual.
#[tokio::test]
async fn timestamps_no_client_can_hold_are_refused_and_old_ones_parked_not_panicked() {
    let pg = Pg::new().await;
    for t in HOSTILE_TIMES {
        let e = foreign_insert("refused", t)
            .execute(pg.pool())
            .await
            .expect_err(t);
        assert!(e.to_string().contains("occurred_at_check"), "{t}: {e}");
    }

    // Rows stored before version 6 added the check.
    sqlx::query("ALTER TABLE idem_outbox DROP CONSTRAINT idem_outbox_occurred_at_check")
        .execute(pg.pool())
        .await
        .unwrap();
    for (i, t) in UNDECODABLE_TIMES.iter().enumerate() {
        foreign_insert(&format!("hostile-{i}"), t)
            .execute(pg.pool())
            .await
            .unwrap();
        foreign_insert(&format!("good-{i}"), "2026-12-01 10:00:00+00")
            .execute(pg.pool())
            .await
            .unwrap();
    }
    let claim = pg
        .store()
        .claim(&idem_core::outbox::ClaimRequest {
            relay_id: "r".to_owned(),
            batch_size: 100,
            lease: std::time::Duration::from_secs(60),
        })
        .await
        .unwrap();
    let good: Vec<&str> = claim
        .records
        .iter()
        .map(|r| r.aggregate_id.as_str())
        .collect();
    assert_eq!(good.len(), UNDECODABLE_TIMES.len(), "{good:?}");
    assert!(good.iter().all(|a| a.starts_with("good-")), "{good:?}");
    assert_eq!(
        claim.corrupt.len(),
        UNDECODABLE_TIMES.len(),
        "{:?}",
        claim.corrupt
    );
    assert!(
        claim
            .corrupt
            .iter()
            .any(|(_, why)| why.contains("'infinity'")),
        "{:?}",
        claim.corrupt
    );
}
