//! A consumer with its own handler: every `order.paid` event adds a row to a ledger, in the
//! consumer's transaction together with the inbox row that makes a redelivered event a no-op.
//! To have something to consume, the program enqueues a few events into an SQLite outbox and
//! runs the relay; the broker is librdkafka's mock cluster unless `BROKERS` names a real one.
//!
//! Run: `cargo run -p consumer-handler` (or `BROKERS=127.0.0.1:9092 cargo run -p consumer-handler`).

use std::time::{Duration, Instant};

use idem::consumer::Consumer;
use idem::kafka::{EmbeddedCluster, KafkaPublisher, KafkaSource, consumer_config, producer_config};
use idem::metrics::Registry;
use idem::prelude::*;
use idem::relay::{Relay, RelayConfig, RelayMetrics};
use idem::sqlite::{Outbox, SqliteInbox, SqliteStore};
use sqlx::SqliteConnection;
use tokio::sync::watch;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The handler: writes through the consumer's connection and never commits; its rows commit
/// with the inbox row or not at all.
struct Ledger;

/// The amount an event carries, or why it can never be applied.
fn amount(event: &InboundEvent) -> Result<i64, String> {
    event.payload["amount_minor"]
        .as_i64()
        .ok_or_else(|| "the payload has no integer amount_minor".to_owned())
}

impl Handler<SqliteConnection> for Ledger {
    /// Checked before any SQL: a refused event is dead-lettered with the reason and the rest of
    /// the batch applied, with no rollback.
    fn validate(&self, event: &InboundEvent) -> Result<(), String> {
        amount(event).map(|_| ())
    }

    /// One event (the default `handle_batch` calls it for each new event of a batch; override
    /// `handle_batch` to write a batch with set-based statements instead).
    async fn handle(
        &self,
        cx: &mut HandlerContext<'_, SqliteConnection>,
        event: &InboundEvent,
    ) -> Result<(), HandlerError> {
        // Can never work: the event is dead-lettered with this reason.
        let amount = amount(event).map_err(HandlerError::Permanent)?;
        // `?` classifies a database error by its code: busy or locked is retried, a refused
        // row (constraint, bad data) is dead-lettered with its reason.
        sqlx::query("INSERT INTO ledger (event_id, order_id, amount_minor) VALUES (?1, ?2, ?3)")
            .bind(event.event_id.to_string())
            .bind(&event.aggregate_id)
            .bind(amount)
            .execute(cx.conn())
            .await?;
        Ok(())
    }
}

/// Something to consume: three events enqueued (for the relay to publish), and the broker:
/// `BROKERS`, or librdkafka's mock cluster (kept alive by the returned handle).
async fn feed(db: &sqlx::SqlitePool) -> Result<(Option<EmbeddedCluster>, String), BoxError> {
    let mut tx = db.begin().await?;
    for (order, amount) in [("10042", 1250), ("10043", 990), ("10044", 4100)] {
        let e = Event::builder("order", order, "order.paid")
            .payload(&serde_json::json!({ "order_id": order, "amount_minor": amount }))
            .build()?;
        Outbox::default().enqueue(&mut tx, &e).await?;
    }
    tx.commit().await?;
    Ok(match std::env::var("BROKERS") {
        Ok(b) => (None, b),
        Err(_) => {
            let c = EmbeddedCluster::start(1)?;
            c.create_topic("outbox.event.order", 1)?;
            let b = c.bootstrap_servers();
            (Some(c), b)
        }
    })
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let dir = std::env::temp_dir().join(format!("idem-consumer-handler-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let db = idem::sqlite::connect(&format!("sqlite://{}", dir.join("app.db").display())).await?;
    idem::sqlite::migrate(&db, &TableNames::default()).await?;
    sqlx::query(
        "CREATE TABLE ledger (event_id TEXT PRIMARY KEY, order_id TEXT, amount_minor INTEGER)",
    )
    .execute(&db)
    .await?;

    let (_cluster, brokers) = feed(&db).await?;
    let registry = Registry::new();
    let (stop, stop_rx) = watch::channel(false);
    let stopped = || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let relay = Relay::new(
        SqliteStore::new(db.clone(), TableNames::default()),
        KafkaPublisher::new(producer_config(&brokers, &[])?)?,
        RelayConfig {
            prune: None,
            ..RelayConfig::default()
        },
        RelayMetrics::new(&registry)?,
    );
    let relay = tokio::spawn({
        let shutdown = stopped();
        async move { relay.run(shutdown).await }
    });

    // The consumer: group `ledger` (named once, by the source), the inbox in the same
    // database as the ledger.
    let source = KafkaSource::new(
        &consumer_config(&brokers, "ledger", &[])?,
        &["outbox.event.order".to_owned()],
    )?;
    let inbox = SqliteInbox::new(db.clone(), TableNames::default());
    let consumer = Consumer::builder(inbox, Ledger, source)
        .registry(&registry)
        .build()?;
    let consumer = tokio::spawn(consumer.run(stopped()));

    let start = Instant::now();
    let mut rows: i64 = 0;
    while rows < 3 && start.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        rows = sqlx::query_scalar("SELECT count(*) FROM ledger")
            .fetch_one(&db)
            .await?;
    }
    let _ = stop.send(true);
    relay.await??;
    consumer.await??;
    let _ = std::fs::remove_dir_all(&dir);
    println!("{rows} ledger rows, one per event");
    if rows == 3 {
        Ok(())
    } else {
        Err("the consumer did not apply every event".into())
    }
}
