//! The whole pipeline in one process, on SQLite and librdkafka's mock cluster: orders enqueue
//! `order.paid` events in their own transactions; the relay publishes them to Kafka; a consumer
//! settles each order and, in the same transaction, records a `points.award` effect; the
//! dispatcher sends every award to a points server this program starts, with the key
//! `event-<event id>-points.award`. No faults are injected. The program exits 0 when every
//! award happened once, and 1 otherwise.
//!
//! Run: `cargo run -p embedded-pipeline` (`ORDERS=500` for more orders).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::consumer::Consumer;
use idem::effects::{Dispatcher, DispatcherConfig};
use idem::kafka::{EmbeddedCluster, KafkaPublisher, KafkaSource, consumer_config, producer_config};
use idem::metrics::Registry;
use idem::prelude::*;
use idem::relay::{Relay, RelayConfig, RelayMetrics};
use idem::sqlite::{Outbox, SqliteInbox, SqliteIntents, SqliteStore};
use sqlx::SqliteConnection;
use tokio::sync::watch;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const TOPIC: &str = "outbox.event.order";

/// The consumer's handler: one settlement row per order, and one points award per settlement,
/// both in the consumer's transaction (with the inbox row).
struct Settle {
    points_url: String,
}

impl Handler<SqliteConnection> for Settle {
    async fn handle(
        &self,
        cx: &mut HandlerContext<'_, SqliteConnection>,
        event: &InboundEvent,
    ) -> Result<(), HandlerError> {
        let Some(order_id) = event.payload["order_id"].as_str() else {
            return Err(HandlerError::permanent("the payload has no order_id"));
        };
        // `?` classifies a database error by its code (busy: retried; refused: dead-lettered).
        sqlx::query("INSERT INTO settlements (order_id, event_id) VALUES (?1, ?2)")
            .bind(order_id)
            .bind(event.event_id.to_string())
            .execute(cx.conn())
            .await?;
        // Recorded with the row above; the key is `event-<event id>-points.award`.
        let body = serde_json::json!({ "order_id": order_id, "points": 10 });
        cx.effects().post("points.award", &self.points_url, body)?;
        Ok(())
    }
}

/// The points server: counts the requests it received per `Idempotency-Key`.
type Awards = Arc<Mutex<HashMap<String, u32>>>;

async fn award(
    axum::extract::State(awards): axum::extract::State<Awards>,
    headers: axum::http::HeaderMap,
) -> axum::http::StatusCode {
    let Some(key) = headers.get("idempotency-key").and_then(|k| k.to_str().ok()) else {
        return axum::http::StatusCode::BAD_REQUEST;
    };
    if let Ok(mut a) = awards.lock() {
        *a.entry(key.to_owned()).or_default() += 1;
    }
    axum::http::StatusCode::CREATED
}

/// Starts the points server on a loopback port; returns its award URL.
async fn points_server(awards: Awards) -> Result<String, BoxError> {
    let app = axum::Router::new()
        .route("/awards", axum::routing::post(award))
        .with_state(awards);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/awards", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

/// A database in `dir`, migrated.
async fn database(dir: &std::path::Path, name: &str) -> Result<sqlx::SqlitePool, BoxError> {
    let pool = idem::sqlite::connect(&format!("sqlite://{}", dir.join(name).display())).await?;
    idem::sqlite::migrate(&pool, &TableNames::default()).await?;
    Ok(pool)
}

/// Enqueues `n` paid orders, each in its own transaction with its business row.
async fn enqueue_orders(orders: &sqlx::SqlitePool, n: u32) -> Result<(), BoxError> {
    sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY, amount_minor INTEGER NOT NULL)")
        .execute(orders)
        .await?;
    let outbox = Outbox::default();
    for i in 0..n {
        let id = format!("order-{i}");
        let mut tx = orders.begin().await?;
        sqlx::query("INSERT INTO orders VALUES (?1, 1250)")
            .bind(&id)
            .execute(&mut *tx)
            .await?;
        let paid = Event::builder("order", &id, "order.paid")
            .payload(&serde_json::json!({ "order_id": id, "amount_minor": 1250 }))
            .build()?;
        outbox.enqueue(&mut tx, &paid).await?;
        tx.commit().await?;
    }
    Ok(())
}

/// Waits until `n` keys were awarded, or `deadline` passes.
async fn wait_for_awards(awards: &Awards, n: usize, deadline: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if awards.lock().map(|a| a.len()).unwrap_or(0) >= n {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

fn stopped(rx: &watch::Receiver<bool>) -> impl Future<Output = ()> + use<> {
    let mut rx = rx.clone();
    async move {
        let _ = rx.wait_for(|s| *s).await;
    }
}

type Stage = tokio::task::JoinHandle<idem::Result<()>>;

/// The relay: the orders database's outbox to Kafka.
fn spawn_relay(
    orders: &sqlx::SqlitePool,
    brokers: &str,
    registry: &Registry,
    stop: &watch::Receiver<bool>,
) -> Result<Stage, BoxError> {
    let config = RelayConfig {
        prune: None,
        ..RelayConfig::default()
    };
    let store = SqliteStore::new(orders.clone(), TableNames::default());
    let publisher = KafkaPublisher::new(producer_config(brokers, &[])?)?;
    let relay = Relay::new(store, publisher, config, RelayMetrics::new(registry)?);
    let shutdown = stopped(stop);
    Ok(tokio::spawn(async move { relay.run(shutdown).await }))
}

/// The consumer: Kafka to the settlement database, with the [`Settle`] handler.
fn spawn_consumer(
    settlement: &sqlx::SqlitePool,
    handler: Settle,
    brokers: &str,
    registry: &Registry,
    stop: &watch::Receiver<bool>,
) -> Result<Stage, BoxError> {
    let source = KafkaSource::new(
        &consumer_config(brokers, "settlement", &[])?,
        &[TOPIC.to_owned()],
    )?;
    // The group is the source's (`settlement`).
    let inbox = SqliteInbox::new(settlement.clone(), TableNames::default());
    let consumer = Consumer::builder(inbox, handler, source)
        .registry(registry)
        .build()?;
    Ok(tokio::spawn(consumer.run(stopped(stop))))
}

/// The dispatcher: the settlement database's effect intents to the points server.
fn spawn_dispatcher(
    intents: SqliteIntents,
    stop: &watch::Receiver<bool>,
) -> Result<Stage, BoxError> {
    // The dispatcher's metrics go to a registry of their own: it counts
    // `idem_idempotency_conflict_total` too (the client side), as the consumer does.
    let effect_registry = Registry::new();
    let dispatcher = Dispatcher::builder(intents)
        .config(DispatcherConfig::default())
        .metrics(&effect_registry)
        .build()?;
    let shutdown = stopped(stop);
    Ok(tokio::spawn(async move { dispatcher.run(shutdown).await }))
}

/// Waits (at most 10 s) until `n` intents are recorded done; returns how many are.
async fn wait_recorded(settlement: &sqlx::SqlitePool, n: i64) -> Result<i64, BoxError> {
    let start = Instant::now();
    loop {
        let done: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'done'")
                .fetch_one(settlement)
                .await?;
        if done >= n || start.elapsed() > Duration::from_secs(10) {
            return Ok(done);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let n: u32 = std::env::var("ORDERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let dir = std::env::temp_dir().join(format!("idem-embedded-pipeline-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (orders, settlement) = (
        database(&dir, "orders.db").await?,
        database(&dir, "settlement.db").await?,
    );
    sqlx::query("CREATE TABLE settlements (order_id TEXT PRIMARY KEY, event_id TEXT NOT NULL)")
        .execute(&settlement)
        .await?;
    enqueue_orders(&orders, n).await?;

    let cluster = EmbeddedCluster::start(1)?;
    cluster.create_topic(TOPIC, 2)?;
    let brokers = cluster.bootstrap_servers();
    let awards = Awards::default();
    let points_url = points_server(awards.clone()).await?;
    let registry = Registry::new();
    let (stop, stop_rx) = watch::channel(false);
    let intents = SqliteIntents::new(settlement.clone(), TableNames::default());
    let handler = Settle { points_url };
    let stages = [
        spawn_relay(&orders, &brokers, &registry, &stop_rx)?,
        spawn_consumer(&settlement, handler, &brokers, &registry, &stop_rx)?,
        spawn_dispatcher(intents, &stop_rx)?,
    ];

    let all_awarded = wait_for_awards(&awards, n as usize, Duration::from_secs(120)).await;
    // Every award's outcome recorded: nothing pending, parked or unknown.
    let done = wait_recorded(&settlement, i64::from(n)).await?;
    let _ = stop.send(true);
    for stage in stages {
        stage.await??;
    }
    let settled: i64 = sqlx::query_scalar("SELECT count(*) FROM settlements")
        .fetch_one(&settlement)
        .await?;
    let awards = awards.lock().map(|a| a.clone()).unwrap_or_default();
    let twice = awards.values().filter(|c| **c != 1).count();
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{n} orders: {settled} settled, {} awards received, {done} recorded done, {twice} keys sent more than once",
        awards.len()
    );
    let once = all_awarded && awards.len() == n as usize && twice == 0;
    if once && settled == i64::from(n) && done == i64::from(n) {
        println!("every effect happened once");
        Ok(())
    } else {
        eprintln!("not every effect happened once");
        std::process::exit(1);
    }
}
