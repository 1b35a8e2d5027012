//! Shows the transactional outbox on PostgreSQL with several events in one transaction.
//!
//! Run: `DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idem --example enqueue_postgres`
//! (it creates the `idem_outbox` tables and an `example_orders` table in that database).

use idem::postgres::Outbox;
use idem::{Event, TableNames};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let pool = idem::postgres::connect(&url, 2).await?;
    idem::postgres::migrate(&pool, &TableNames::default()).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS example_orders (id text PRIMARY KEY, amount_minor bigint NOT NULL)")
        .execute(&pool)
        .await?;
    let outbox = Outbox::default();
    let order_id = uuid::Uuid::now_v7().to_string();

    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO example_orders VALUES ($1, $2)")
        .bind(&order_id)
        .bind(1250_i64)
        .execute(&mut *tx)
        .await?;
    let events = [
        Event::builder("order", &order_id, "order.placed").payload(&serde_json::json!({"order_id": order_id})).build()?,
        Event::builder("order", &order_id, "order.paid")
            .payload(&serde_json::json!({"order_id": order_id, "payment_id": "pay-1", "amount_minor": 1250}))
            .build()?,
    ];
    outbox.enqueue_all(&mut tx, &events).await?;
    tx.commit().await?;
    println!(
        "order {order_id}: 2 events enqueued; run `idem relay --db {url} --brokers ...` to publish them"
    );
    Ok(())
}
