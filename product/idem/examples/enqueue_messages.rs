//! Shows the outbox with no table (the CDC relay's message mode): an order row and its event
//! written in one statement, so the event costs the writer no extra round trip.
//!
//! Run: `DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run -p idem --example enqueue_messages`
//! (it creates an `example_orders` table; the messages are published by
//! `idem cdc relay --messages --db … --brokers …`, which needs `wal_level = logical`).

use idem::Event;
use idem::postgres::MessageOutbox;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let pool = idem::postgres::connect(&url, 2).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS example_orders (id text PRIMARY KEY, amount_minor bigint NOT NULL)")
        .execute(&pool)
        .await?;
    let outbox = MessageOutbox::default(); // prefix idem.outbox, the relay's default
    let order_id = uuid::Uuid::now_v7().to_string();
    let paid = Event::builder("order", &order_id, "order.paid")
        .payload(&serde_json::json!({"order_id": order_id, "amount_minor": 1250}))
        .build()?;

    let mut tx = pool.begin().await?;
    let write = sqlx::query("INSERT INTO example_orders VALUES ($1, $2)")
        .bind(&order_id)
        .bind(1250_i64);
    // The row and the event in one statement: both commit, or neither.
    outbox.enqueue_with(&mut tx, write, &[paid]).await?;
    tx.commit().await?;
    println!("order {order_id}: its event is in the WAL; `idem cdc relay --messages` publishes it");
    Ok(())
}
