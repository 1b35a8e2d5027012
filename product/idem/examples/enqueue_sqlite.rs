//! Shows the transactional outbox on SQLite: the business row and its event commit together,
//! and a rolled-back transaction leaves neither.
//!
//! Run: `cargo run -p idem --example enqueue_sqlite`

use idem::sqlite::{Outbox, SqliteStore};
use idem::store::OutboxStore;
use idem::{Event, TableNames};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let pool = idem::sqlite::connect(&format!(
        "sqlite://{}",
        dir.path().join("orders.db").display()
    ))
    .await?;
    idem::sqlite::migrate(&pool, &TableNames::default()).await?;
    sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, amount_minor INTEGER NOT NULL)")
        .execute(&pool)
        .await?;
    let outbox = Outbox::default();

    // Committed: the order and its event.
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO orders VALUES ('10042', 1250)")
        .execute(&mut *tx)
        .await?;
    let paid = Event::builder("order", "10042", "order.paid")
        .payload(
            &serde_json::json!({"order_id": "10042", "payment_id": "pay-1", "amount_minor": 1250}),
        )
        .build()?;
    outbox.enqueue(&mut tx, &paid).await?;
    tx.commit().await?;

    // Rolled back: neither.
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO orders VALUES ('10043', 990)")
        .execute(&mut *tx)
        .await?;
    let lost = Event::builder("order", "10043", "order.paid")
        .payload_json(r#"{"order_id":"10043"}"#)
        .build()?;
    outbox.enqueue(&mut tx, &lost).await?;
    tx.rollback().await?;

    let status = SqliteStore::new(pool, TableNames::default())
        .status()
        .await?;
    println!(
        "pending events: {} (the committed order only)",
        status.pending
    );
    Ok(())
}
