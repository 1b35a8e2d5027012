//! A consumer with its own handler: every `order.paid` event adds a row to a ledger, in the
//! consumer's transaction together with the inbox row that makes a redelivered event a no-op.
//!
//! Two ways to run it:
//! - `cargo run -p consumer-handler`: a self-contained demo. To have something to consume, it
//!   enqueues three events into an SQLite outbox and runs the relay; the broker is librdkafka's
//!   mock cluster unless `BROKERS` names a real one.
//! - `consumer-handler serve`: the consumer alone, as a service, until SIGTERM or Ctrl-C. It
//!   reads `TOPIC` (default `outbox.event.order`) from `BROKERS` as group `GROUP` (default
//!   `ledger`) into the SQLite database `DATABASE_URL` (e.g. `sqlite:///var/lib/ledger.db`),
//!   and prints `consuming <topic>` once it runs. Several replicas may share the database
//!   file. `examples/consumer-handler/pipeline.toml` runs it under `idem-lab chaos --pipeline`.

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

/// An `order.paid` event's fields the ledger keeps: the payment and its amount in minor units
/// (cents), or why the event can never be applied.
fn paid(event: &InboundEvent) -> Result<(&str, i64), String> {
    let payment = event.payload["payment_id"]
        .as_str()
        .ok_or("the payload has no payment_id string")?;
    let amount = event.payload["amount"]
        .as_str()
        .ok_or("the payload has no amount string")?;
    Ok((payment, minor_units(amount)?))
}

/// An exact decimal amount (`"12.50"`) in minor units (`1250`): never through a float.
fn minor_units(amount: &str) -> Result<i64, String> {
    let refused = || format!("the amount {amount:?} is not a decimal with at most 2 places");
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (units, fraction) = match amount.split_once('.') {
        Some((u, f)) if digits(f) && f.len() <= 2 => (u, f),
        Some(_) => return Err(refused()),
        None => (amount, ""),
    };
    if !digits(units) {
        return Err(refused());
    }
    let cents: i64 = format!("{fraction:0<2}").parse().map_err(|_| refused())?;
    units
        .parse::<i64>()
        .ok()
        .and_then(|u| u.checked_mul(100)?.checked_add(cents))
        .ok_or_else(refused)
}

impl Handler<SqliteConnection> for Ledger {
    /// Checked before any SQL: a refused event is dead-lettered with the reason and the rest of
    /// the batch applied, with no rollback.
    fn validate(&self, event: &InboundEvent) -> Result<(), String> {
        paid(event).map(|_| ())
    }

    /// One event (the default `handle_batch` calls it for each new event of a batch; override
    /// `handle_batch` to write a batch with set-based statements instead).
    async fn handle(
        &self,
        cx: &mut HandlerContext<'_, SqliteConnection>,
        event: &InboundEvent,
    ) -> Result<(), HandlerError> {
        // Can never work: the event is dead-lettered with this reason.
        let (payment, amount) = paid(event).map_err(HandlerError::Permanent)?;
        // `?` classifies a database error by its code: busy or locked is retried, a refused
        // row (constraint, bad data) is dead-lettered with its reason.
        sqlx::query(
            "INSERT INTO ledger (event_id, order_id, payment_id, amount_minor) \
             VALUES (?1, ?2, ?3, ?4)",
        )
        .bind(event.event_id.to_string())
        .bind(&event.aggregate_id)
        .bind(payment)
        .bind(amount)
        .execute(cx.conn())
        .await?;
        Ok(())
    }
}

/// Opens the database and creates idem's tables and the ledger where missing.
async fn open(url: &str) -> Result<sqlx::SqlitePool, BoxError> {
    let db = idem::sqlite::connect(url).await?;
    idem::sqlite::migrate(&db, &TableNames::default()).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS ledger (event_id TEXT PRIMARY KEY, order_id TEXT NOT NULL, \
         payment_id TEXT NOT NULL, amount_minor INTEGER NOT NULL)",
    )
    .execute(&db)
    .await?;
    Ok(db)
}

/// The consumer: group `group` (named once, by the source) reading `topic`, the inbox in the
/// same database as the ledger.
fn consumer(
    db: &sqlx::SqlitePool,
    brokers: &str,
    group: &str,
    topic: &str,
    registry: &Registry,
) -> Result<Consumer<SqliteInbox, Ledger, KafkaSource>, BoxError> {
    let source = KafkaSource::new(&consumer_config(brokers, group, &[])?, &[topic.to_owned()])?;
    let inbox = SqliteInbox::new(db.clone(), TableNames::default());
    Ok(Consumer::builder(inbox, Ledger, source)
        .registry(registry)
        .build()?)
}

/// Something to consume: three events enqueued (for the relay to publish), and the broker:
/// `BROKERS`, or librdkafka's mock cluster (kept alive by the returned handle).
async fn feed(db: &sqlx::SqlitePool) -> Result<(Option<EmbeddedCluster>, String), BoxError> {
    let mut tx = db.begin().await?;
    for (order, amount) in [("10042", "12.50"), ("10043", "9.90"), ("10044", "41.00")] {
        let e = Event::builder("order", order, "order.paid")
            .payload(&serde_json::json!({
                "order_id": order,
                "payment_id": format!("pay-{order}"),
                "amount": amount,
                "currency": "EUR",
            }))
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

/// The self-contained demo: an outbox, the relay and the consumer in one process.
async fn demo() -> Result<(), BoxError> {
    let dir = std::env::temp_dir().join(format!("idem-consumer-handler-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let db = open(&format!("sqlite://{}", dir.join("app.db").display())).await?;

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
    let consumer = consumer(&db, &brokers, "ledger", "outbox.event.order", &registry)?;
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

/// An environment variable, or `default`; an error naming it when it is required and unset.
fn setting(name: &str, default: Option<&str>) -> Result<String, BoxError> {
    match (std::env::var(name), default) {
        (Ok(v), _) => Ok(v),
        (Err(_), Some(d)) => Ok(d.to_owned()),
        (Err(_), None) => Err(format!("{name} is not set (consumer-handler serve)").into()),
    }
}

/// Resolves on SIGTERM or Ctrl-C.
async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// The consumer alone, as a service, until SIGTERM or Ctrl-C.
async fn serve() -> Result<(), BoxError> {
    let url = setting("DATABASE_URL", None)?;
    let brokers = setting("BROKERS", None)?;
    let topic = setting("TOPIC", Some("outbox.event.order"))?;
    let group = setting("GROUP", Some("ledger"))?;
    let db = open(&url).await?;
    let consumer = consumer(&db, &brokers, &group, &topic, &Registry::new())?;
    println!("consuming {topic}");
    consumer.run(terminated()).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    match std::env::args().nth(1).as_deref() {
        None => demo().await,
        Some("serve") => serve().await,
        Some(other) => Err(format!("unknown command {other:?}: run it bare, or `serve`").into()),
    }
}

#[cfg(test)]
mod tests {
    use super::minor_units;

    #[test]
    fn decimal_amounts_become_exact_minor_units() {
        assert_eq!(minor_units("12.50"), Ok(1250));
        assert_eq!(minor_units("9.9"), Ok(990));
        assert_eq!(minor_units("41"), Ok(4100));
        for refused in [
            "",
            ".5",
            "1.",
            "1.234",
            "-1.00",
            "1e3",
            "9223372036854775807.00",
        ] {
            assert!(minor_units(refused).is_err(), "{refused:?} was accepted");
        }
    }
}
