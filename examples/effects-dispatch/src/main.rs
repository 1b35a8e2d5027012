//! Recording an effect in a handler's transaction, and dispatching it: the handler posts a
//! `points.award` effect next to its own row (one call, `cx.effects().post`); the dispatcher sends
//! it to a points server this program starts, with the key `event-<event id>-points.award` on
//! every attempt. The server answers the first attempt 503, so the award is retried with the
//! same key. No broker: the event is handed to the handler the way the consumer would.
//!
//! Run: `cargo run -p effects-dispatch`

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::consumer::InboxStore;
use idem::effects::{Dispatcher, DispatcherConfig};
use idem::prelude::*;
use idem::sqlite::{SqliteInbox, SqliteIntents};
use sqlx::SqliteConnection;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A handler that settles a payment and asks for a points award, in one transaction.
struct Settle {
    points_url: String,
}

impl Handler<SqliteConnection> for Settle {
    async fn handle(
        &self,
        cx: &mut HandlerContext<'_, SqliteConnection>,
        event: &InboundEvent,
    ) -> Result<(), HandlerError> {
        // `?` classifies a database error by its code (busy: retried; refused: dead-lettered).
        sqlx::query("INSERT INTO settlements (event_id) VALUES (?1)")
            .bind(event.event_id.to_string())
            .execute(cx.conn())
            .await?;
        let body = serde_json::json!({ "order_id": event.aggregate_id, "points": 12 });
        cx.effects().post("points.award", &self.points_url, body)?;
        Ok(())
    }
}

/// The `Idempotency-Key` of every request the points server received.
type Seen = Arc<Mutex<Vec<String>>>;

async fn points(
    axum::extract::State(seen): axum::extract::State<Seen>,
    headers: axum::http::HeaderMap,
) -> axum::http::StatusCode {
    let key = headers
        .get("idempotency-key")
        .and_then(|k| k.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let Ok(mut seen) = seen.lock() else {
        return axum::http::StatusCode::INTERNAL_SERVER_ERROR;
    };
    seen.push(key);
    if seen.len() == 1 {
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    } else {
        axum::http::StatusCode::CREATED
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let dir = std::env::temp_dir().join(format!("idem-effects-dispatch-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let db =
        idem::sqlite::connect(&format!("sqlite://{}", dir.join("settlement.db").display())).await?;
    idem::sqlite::migrate(&db, &TableNames::default()).await?;
    sqlx::query("CREATE TABLE settlements (event_id TEXT PRIMARY KEY)")
        .execute(&db)
        .await?;

    let seen = Seen::default();
    let app = axum::Router::new()
        .route("/awards", axum::routing::post(points))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let points_url = format!("http://{}/awards", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    // The handler's transaction: its row and the intent commit together, as the consumer
    // runs it: the handler, then the effects it posted recorded through the inbox.
    let intents = SqliteIntents::new(db.clone(), TableNames::default());
    let inbox = SqliteInbox::new(db.clone(), TableNames::default());
    let handler = Settle { points_url };
    let event = InboundEvent {
        event_id: EventId::new(),
        event_type: "order.paid".into(),
        aggregate_type: "order".into(),
        aggregate_id: "10042".into(),
        payload: serde_json::json!({ "order_id": "10042" }),
        payload_hash: String::new(),
        traceparent: None,
        topic: "outbox.event.order".into(),
        partition: 0,
        offset: 0,
    };
    let mut tx = db.begin().await?;
    let mut posted = vec![];
    handler
        .handle(
            &mut HandlerContext::new(&mut *tx, &event, &mut posted),
            &event,
        )
        .await
        .map_err(|e| format!("{e:?}"))?;
    inbox.record_effects(&mut *tx, &posted).await?;
    tx.commit().await?;

    // The dispatcher: no backoff, so the retry after the 503 follows at once.
    let config = DispatcherConfig {
        retry_backoff: Duration::ZERO,
        ..DispatcherConfig::default()
    };
    let dispatcher = Dispatcher::builder(intents).config(config).build()?;
    for _ in 0..50 {
        dispatcher.run_once().await?;
        if seen.lock().map(|s| s.len()).unwrap_or(0) >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = seen.lock().map(|s| s.clone()).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "the points server saw {} requests, keys {seen:?}",
        seen.len()
    );
    let expected = format!("\"event-{}-points.award\"", event.event_id);
    if seen.len() == 2 && seen.iter().all(|k| *k == expected) {
        println!("a 503 and a retry, both with the same key");
        Ok(())
    } else {
        Err("the award was not delivered as expected".into())
    }
}
