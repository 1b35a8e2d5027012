//! Retention of the inbox and of done effect intents on a real database.

use idem_conformance::backend::Lite;

idem_conformance::retention_scenarios!(Lite::new().await);

/// SQLite keeps no per-aggregate counters (`aggregate_seq` is the row id): the counter prune
/// deletes nothing, and the numbering still increases within an aggregate afterwards.
#[tokio::test]
async fn the_counter_prune_has_nothing_to_do_on_sqlite() {
    use idem_conformance::backend::{Backend, OpenTx};
    use idem_core::retention::RetentionStore;
    let lite = Lite::new().await;
    let mut tx = lite.begin().await;
    tx.enqueue(&[idem_conformance::scenarios::event("o-1", 0)])
        .await
        .unwrap();
    tx.commit().await;
    lite.exec("UPDATE idem_outbox SET status = 'published'")
        .await
        .unwrap();
    assert_eq!(lite.store().prune_aggregate_counters(100).await.unwrap(), 0);
    let mut tx = lite.begin().await;
    tx.enqueue(&[idem_conformance::scenarios::event("o-1", 1)])
        .await
        .unwrap();
    tx.commit().await;
    assert_eq!(
        lite.scalar("SELECT count(DISTINCT id) FROM idem_outbox WHERE aggregate_id = 'o-1'")
            .await,
        2
    );
}
