//! The store conformance suite against a real PostgreSQL server (`IDEM_TEST_PG_URL`).

use idem_conformance::backend::{Backend, OpenTx, Pg};
use idem_conformance::scenarios;
use idem_core::{OutboxStore, TableNames};

idem_conformance::conformance_tests!(Pg::new().await);

#[tokio::test]
async fn tables_in_a_named_schema() {
    let pg = Pg::new().await;
    let billing = pg.with_tables(TableNames::new(Some("billing"), "idem_").unwrap());
    assert_eq!(billing.migrate().await.unwrap(), vec![1, 2, 3, 4, 5]);
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
    assert_eq!(applied, [vec![], vec![1, 2, 3, 4, 5]]);
}
