//! The metrics after a scripted run: relay and consumer against real PostgreSQL and librdkafka's
//! mock cluster, with a known number of republishes (a relay crash between the broker's
//! acknowledgement and the mark), deliberate duplicate deliveries, one idempotency conflict,
//! one parked row and known handler retries. The registries are scraped as Prometheus text and
//! every counter must equal the number the script produced, exactly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_conformance::backend::{Backend, OpenTx, Pg};
use idem_conformance::process::{eventually, metric_value as value};
use idem_consumer::{
    Consumer, ConsumerConfig, ConsumerMetrics, Handler, HandlerContext, HandlerError,
};
use idem_core::crash::{self, CrashPoint};
use idem_core::publish::{Message, Publisher};
use idem_core::{Error, Event, InboundEvent};
use idem_kafka::{EmbeddedCluster, KafkaPublisher, KafkaSource, consumer_config, inspect};
use idem_reference::Settlement;
use idem_relay::{Relay, RelayConfig, RelayMetrics};
use prometheus::{Encoder, Registry, TextEncoder};
use sqlx::PgConnection;
use tokio::sync::watch;

const TOPIC: &str = "outbox.event.order";
const GROUP: &str = "settlement";
const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
const ORDERS: u64 = 8;

/// Fails the first `failures` calls transiently (a lock timeout, say), then settles.
struct Flaky<H> {
    inner: H,
    failures: AtomicU32,
}

impl<H: Handler<PgConnection>> Handler<PgConnection> for Flaky<H> {
    async fn handle(
        &self,
        cx: &mut HandlerContext<'_, PgConnection>,
        event: &InboundEvent,
    ) -> Result<(), HandlerError> {
        if self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(HandlerError::transient("scripted: lock timeout"));
        }
        self.inner.handle(cx, event).await
    }
}

fn paid_order(n: u64) -> Event {
    Event::builder("order", format!("order-{n}"), "order.paid")
        .payload(&serde_json::json!({
            "order_id": format!("order-{n}"),
            "payment_id": format!("pay-{n}"),
            "amount_minor": 100 + n,
            "currency": "EUR",
        }))
        .traceparent(format!(
            "00-{TRACE_ID}-{:016x}-01",
            0xb7ad_6b71_6920_3300 + n
        ))
        .build()
        .unwrap()
}

/// Scrapes `registry` as a Prometheus server would: the text exposition format.
fn scrape(registry: &Registry) -> String {
    let mut buf = vec![];
    TextEncoder::new()
        .encode(&registry.gather(), &mut buf)
        .unwrap();
    String::from_utf8(buf).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines)] // one scripted scenario, read top to bottom
async fn the_exported_counters_equal_the_scripted_numbers() {
    let pg = Pg::new().await;
    idem_reference::ensure_schema_postgres(pg.pool())
        .await
        .unwrap();
    let cluster = EmbeddedCluster::start(1).unwrap();
    cluster.create_topic(TOPIC, 2).unwrap();
    let brokers = cluster.bootstrap_servers();

    // The outbox: eight paid orders, each with the trace it was written in, and one row too
    // large for the broker (its own aggregate, so it blocks nothing).
    let mut events: Vec<Event> = (1..=ORDERS).map(paid_order).collect();
    events.push(
        Event::builder("order", "order-big", "order.paid")
            .payload(&serde_json::json!({ "blob": "x".repeat(20_000) }))
            .build()
            .unwrap(),
    );
    let mut tx = pg.begin().await;
    tx.enqueue(&events).await.unwrap();
    tx.commit().await;

    // The relay: the first batch reaches Kafka and the relay dies before marking it; the second
    // publishes all eight again (8 republishes) and parks the oversized row.
    let relay_registry = Registry::new();
    let overrides = [("message.max.bytes".to_owned(), "10000".to_owned())];
    let publisher = Arc::new(
        KafkaPublisher::new(idem_kafka::producer_config(&brokers, &overrides).unwrap()).unwrap(),
    );
    let relay = Relay::new(
        pg.store().clone(),
        publisher.clone(),
        RelayConfig {
            max_attempts: 1,
            prune: None,
            ..RelayConfig::default()
        },
        RelayMetrics::new(&relay_registry).unwrap(),
    );
    crash::arm(
        CrashPoint::RelayAfterPublishBeforeMark,
        crash::Action::Error,
        1,
    )
    .unwrap();
    let crashed = relay.run_once().await.unwrap_err();
    assert!(matches!(crashed, Error::CrashPoint(_)), "{crashed}");
    pg.expire_leases().await;
    let second = relay.run_once().await.unwrap();
    assert_eq!(
        (second.published, second.republished, second.parked),
        (ORDERS, ORDERS, 1)
    );
    relay.refresh_status().await.unwrap();

    // Two more copies of two events, as a second producer replaying the topic would send them
    // (byte for byte), and one record reusing an event id with another payload.
    let published = {
        let b = brokers.clone();
        tokio::task::spawn_blocking(move || {
            inspect::read_all(&b, TOPIC, Duration::from_secs(30)).unwrap()
        })
        .await
        .unwrap()
    };
    assert_eq!(
        published.len() as u64,
        2 * ORDERS,
        "each order twice in the topic"
    );
    let resend = |r: &inspect::Record, payload: Option<String>| Message {
        topic: TOPIC.to_owned(),
        key: r.key.clone().unwrap(),
        payload: payload.unwrap_or_else(|| r.payload.clone().unwrap()),
        headers: r.headers.clone(),
    };
    let by_key = |k: &str| {
        published
            .iter()
            .find(|r| r.key.as_deref() == Some(k))
            .unwrap()
    };
    let extra = [
        resend(by_key("order-1"), None),
        resend(by_key("order-2"), None),
        resend(
            by_key("order-3"),
            Some(r#"{"order_id":"order-3","payment_id":"pay-3","amount_minor":999999,"currency":"EUR"}"#.to_owned()),
        ),
    ];
    assert!(publisher.publish(&extra).await.iter().all(Result::is_ok));
    let in_topic = 2 * i64::try_from(ORDERS).unwrap() + 3;

    // The settlement consumer, whose handler fails twice before it settles anything.
    let consumer_registry = Registry::new();
    let metrics = ConsumerMetrics::new(&consumer_registry).unwrap();
    let handler = Flaky {
        inner: Settlement::with_points("http://127.0.0.1:9/awards"),
        failures: AtomicU32::new(2),
    };
    let mut config = ConsumerConfig::new(GROUP);
    config.retry_backoff = Duration::from_millis(10);
    config.lag_interval = Duration::from_millis(100);
    let source = KafkaSource::new(
        &consumer_config(&brokers, GROUP, &[]).unwrap(),
        &[TOPIC.to_owned()],
    )
    .unwrap();
    let consumer = Consumer::new(pg.inbox(), handler, source, config, metrics.clone());
    let (stop, mut stopped) = watch::channel(false);
    let running = tokio::spawn(consumer.run(async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    eventually(
        "every record to be consumed and committed",
        Duration::from_secs(60),
        || {
            let b = brokers.clone();
            async move {
                let committed = tokio::task::spawn_blocking(move || {
                    inspect::committed_offsets(&b, GROUP, TOPIC, Duration::from_secs(10))
                })
                .await
                .unwrap()
                .ok()?;
                (committed.iter().map(|(_, o)| o).sum::<i64>() == in_topic).then_some(())
            }
        },
    )
    .await;
    eventually(
        "the lag gauge to show the drained topic",
        Duration::from_secs(30),
        || async {
            (value(&scrape(&consumer_registry), "idem_consumer_lag", &[]) == Some(0.0))
                .then_some(())
        },
    )
    .await;
    stop.send(true).unwrap();
    running.await.unwrap().unwrap();

    // The relay's scrape.
    let r = scrape(&relay_registry);
    let order = [("aggregate_type", "order")];
    let paid = [
        ("topic", TOPIC),
        ("event_type", "order.paid"),
        ("aggregate_type", "order"),
    ];
    assert_eq!(value(&r, "idem_outbox_published_total", &paid), Some(8.0));
    assert_eq!(value(&r, "idem_outbox_republish_total", &paid), Some(8.0));
    assert_eq!(value(&r, "idem_outbox_parked_total", &paid), Some(1.0));
    assert_eq!(
        value(
            &r,
            "idem_outbox_publish_failures_total",
            &[("kind", "permanent")]
        ),
        Some(1.0),
        "the crashed batch's failure was never counted: the crash came first"
    );
    assert_eq!(
        value(&r, "idem_outbox_commit_to_publish_seconds_count", &paid),
        Some(8.0)
    );
    assert_eq!(value(&r, "idem_outbox_pending", &order), Some(0.0));
    assert_eq!(value(&r, "idem_outbox_parked", &order), Some(1.0));
    assert_eq!(
        value(&r, "idem_outbox_oldest_pending_age_seconds", &order),
        Some(0.0)
    );
    assert_eq!(value(&r, "idem_outbox_lease_lost_total", &[]), Some(0.0));
    assert_eq!(value(&r, "idem_outbox_relay_errors_total", &[]), Some(0.0));

    // The consumer's scrape: 19 records = 8 events applied once + 8 republished copies + 2
    // replayed copies (10 skipped) + 1 conflicting copy (dead-lettered, never applied).
    let c = scrape(&consumer_registry);
    let settled = [
        ("topic", TOPIC),
        ("consumer_group", GROUP),
        ("event_type", "order.paid"),
        ("aggregate_type", "order"),
    ];
    assert_eq!(
        value(&c, "idem_consumer_processed_total", &settled),
        Some(8.0)
    );
    assert_eq!(
        value(&c, "idem_duplicate_delivery_total", &settled),
        Some(11.0)
    );
    assert_eq!(value(&c, "idem_duplicate_skip_total", &settled), Some(10.0));
    assert_eq!(
        value(&c, "idem_idempotency_conflict_total", &settled),
        Some(1.0)
    );
    assert_eq!(
        value(&c, "idem_consumer_dead_lettered_total", &settled),
        Some(1.0)
    );
    assert_eq!(value(&c, "idem_consumer_retry_total", &settled), Some(2.0));
    assert_eq!(
        value(&c, "idem_consumer_offset_commit_failures_total", &[]),
        Some(0.0)
    );
    assert_eq!(
        value(
            &c,
            "idem_consumer_publish_to_processed_seconds_count",
            &settled
        ),
        Some(8.0),
        "one observation per event applied"
    );
    assert_eq!(
        value(
            &c,
            "idem_consumer_lag",
            &[("topic", TOPIC), ("consumer_group", GROUP)]
        ),
        Some(0.0)
    );

    // What the counters claim, the databases confirm.
    let pool = pg.pool().clone();
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(count("SELECT count(*) FROM settlements").await, 8);
    assert_eq!(
        count("SELECT count(*) FROM settlement_applications").await,
        8
    );
    assert_eq!(
        count("SELECT coalesce(sum(delivery_count), 0)::bigint FROM idem_inbox").await,
        18,
        "every copy but the conflicting one raised a delivery count"
    );
    // The trace captured at enqueue reached the effect intents the handler recorded.
    let traces: Vec<Option<String>> =
        sqlx::query_scalar("SELECT traceparent FROM idem_effect_intents ORDER BY id")
            .fetch_all(pg.pool())
            .await
            .unwrap();
    assert_eq!(traces.len() as u64, ORDERS);
    for tp in &traces {
        let tp = tp.as_deref().expect("every intent carries a traceparent");
        assert_eq!(tp.split('-').nth(1), Some(TRACE_ID), "{tp}");
    }
}
