//! Migrations and table names (idem-sql's `migrate.rs`): migrating twice changes nothing, a table
//! prefix gives a second set of tables, and a store that meets a missing table says so by kind.

use idem_core::TableNames;
use idem_core::store::OutboxStore;

use super::{event, publish_all};
use crate::backend::{Backend, OpenTx};

scenarios! {
    migrate_scenarios;
    a_missing_table_is_an_error_of_kind_not_migrated,
    migrate_is_idempotent,
    custom_table_prefix_is_used,
}

/// A store that meets a table it needs missing says so by kind, not only in its message: the
/// caller can tell "run `idem migrate`" from a failure worth retrying.
pub async fn a_missing_table_is_an_error_of_kind_not_migrated<B: Backend>(b: &B) {
    let outbox = b.tables().qualified("outbox");
    b.exec(&format!("DROP TABLE {outbox}")).await.unwrap();
    let err = b.store().status().await.unwrap_err();
    assert_eq!(err.kind(), idem_core::ErrorKind::NotMigrated, "{err}");
    let mut tx = b.begin().await;
    let err = tx.enqueue(&[event("o-1", 0)]).await.unwrap_err();
    assert_eq!(err.kind(), idem_core::ErrorKind::NotMigrated, "{err}");
    tx.rollback().await;
}

pub async fn migrate_is_idempotent<B: Backend>(b: &B) {
    assert_eq!(
        b.migrate().await.unwrap(),
        Vec::<i64>::new(),
        "already migrated"
    );
    let version = b
        .scalar(&format!(
            "SELECT max(version) FROM {}",
            b.tables().qualified("schema_migrations")
        ))
        .await;
    assert_eq!(version, 23);
}

pub async fn custom_table_prefix_is_used<B: Backend>(b: &B) {
    let other = b.with_tables(TableNames::new(None, "billing_").unwrap());
    assert_eq!(
        other.migrate().await.unwrap(),
        vec![
            1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23
        ]
    );
    let mut tx = other.begin().await;
    tx.enqueue(&[event("o-1", 0)]).await.unwrap();
    tx.commit().await;
    assert_eq!(b.scalar("SELECT count(*) FROM billing_outbox").await, 1);
    assert_eq!(
        b.store().status().await.unwrap().pending,
        0,
        "the default outbox is untouched"
    );
    assert_eq!(publish_all(other.store()).await.len(), 1);
}
