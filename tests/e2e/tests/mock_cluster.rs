//! The relay against real PostgreSQL and librdkafka's in-process mock cluster: ordering with
//! several relays and concurrent writers, parking, headers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use idem_conformance::backend::{Backend, OpenTx, Pg};
use idem_conformance::process::eventually;
use idem_core::Event;
use idem_core::store::OutboxStore;
use idem_kafka::{EmbeddedCluster, KafkaPublisher, inspect};
use idem_relay::{Relay, RelayConfig, RelayMetrics};
use idem_sql::postgres::PgStore;
use sqlx::Row;
use tokio::sync::watch;

const TOPIC: &str = "outbox.event.order";

fn relay(
    store: PgStore,
    brokers: &str,
    overrides: &[(&str, &str)],
    config: RelayConfig,
) -> Relay<PgStore, Arc<KafkaPublisher>> {
    let overrides: Vec<(String, String)> = overrides
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let publisher =
        KafkaPublisher::new(idem_kafka::producer_config(brokers, &overrides).unwrap()).unwrap();
    let metrics = RelayMetrics::new(&prometheus::Registry::new()).unwrap();
    Relay::new(store, Arc::new(publisher), config, metrics)
}

fn spawn_relay(
    r: Relay<PgStore, Arc<KafkaPublisher>>,
    stop: &watch::Receiver<bool>,
) -> tokio::task::JoinHandle<Relay<PgStore, Arc<KafkaPublisher>>> {
    let mut stop = stop.clone();
    tokio::spawn(async move {
        r.run(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await
        .unwrap();
        r
    })
}

async fn wait_drained(store: &PgStore) {
    eventually("the outbox to drain", Duration::from_secs(60), || async {
        let s = store.status().await.unwrap();
        (s.pending == 0).then_some(())
    })
    .await;
}

fn read(brokers: &str, topic: &str) -> Vec<inspect::Record> {
    inspect::read_all(brokers, topic, Duration::from_secs(30)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_and_concurrent_writers_keep_each_aggregate_in_commit_order() {
    let pg = Pg::new().await;
    let cluster = EmbeddedCluster::start(3).unwrap();
    cluster.create_topic(TOPIC, 4).unwrap();
    let brokers = cluster.bootstrap_servers();
    let (stop_tx, stop_rx) = watch::channel(false);
    let config = || RelayConfig {
        batch_size: 25,
        prune: None,
        ..RelayConfig::default()
    };
    let relays = [
        spawn_relay(relay(pg.store().clone(), &brokers, &[], config()), &stop_rx),
        spawn_relay(relay(pg.store().clone(), &brokers, &[], config()), &stop_rx),
    ];
    // Four writers, 100 transactions each, 1–3 events per transaction over 12 shared aggregates.
    let pg = Arc::new(pg);
    let mut writers = vec![];
    for w in 0..4usize {
        let pg = pg.clone();
        writers.push(tokio::spawn(async move {
            for t in 0..100usize {
                let events: Vec<Event> = (0..1 + (w + t) % 3)
                    .map(|k| {
                        Event::builder(
                            "order",
                            format!("agg-{}", (w * 7 + t * 5 + k) % 12),
                            "order.paid",
                        )
                        .payload(&serde_json::json!({ "writer": w, "tx": t, "k": k }))
                        .build()
                        .unwrap()
                    })
                    .collect();
                let mut tx = pg.begin().await;
                tx.enqueue(&events).await.unwrap();
                tx.commit().await;
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    wait_drained(pg.store()).await;
    stop_tx.send(true).unwrap();
    let mut published_by_relays = 0;
    for r in relays {
        published_by_relays += r.await.unwrap().metrics().published_total();
    }

    // The database's commit order per aggregate.
    let rows = sqlx::query("SELECT event_id::text AS id, aggregate_id, aggregate_seq FROM idem_outbox ORDER BY aggregate_id, aggregate_seq")
        .fetch_all(pg.pool())
        .await
        .unwrap();
    let mut expected: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in &rows {
        expected
            .entry(r.get("aggregate_id"))
            .or_default()
            .push(r.get("id"));
    }
    assert_eq!(
        rows.len(),
        usize::try_from(published_by_relays).unwrap(),
        "every row was published once by the relays"
    );
    let written: usize = (0..4usize)
        .flat_map(|w| (0..100usize).map(move |t| 1 + (w + t) % 3))
        .sum();
    assert_eq!(
        rows.len(),
        written,
        "every committed event is in the outbox"
    );

    // First copy of each event per key, in partition order.
    let records = read(&brokers, TOPIC);
    let mut seen = HashSet::new();
    let mut got: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut partition_of: HashMap<String, i32> = HashMap::new();
    for rec in &records {
        let key = rec.key.clone().unwrap();
        let p = *partition_of.entry(key.clone()).or_insert(rec.partition);
        assert_eq!(p, rec.partition, "aggregate {key} spans partitions");
        let id = rec.header("ce_id").unwrap().to_owned();
        if seen.insert(id.clone()) {
            got.entry(key).or_default().push(id);
        }
    }
    assert_eq!(
        got, expected,
        "per-aggregate order in Kafka = commit order, nothing missing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_row_is_parked_without_blocking_other_aggregates() {
    let pg = Pg::new().await;
    let cluster = EmbeddedCluster::start(1).unwrap();
    cluster.create_topic(TOPIC, 2).unwrap();
    let brokers = cluster.bootstrap_servers();
    let big = Event::builder("order", "big", "order.paid")
        .payload(&serde_json::json!({ "blob": "x".repeat(20_000) }))
        .build()
        .unwrap();
    let after_big = Event::builder("order", "big", "order.paid")
        .payload_json("{}")
        .build()
        .unwrap();
    let small: Vec<Event> = (0..5)
        .map(|i| {
            Event::builder("order", format!("small-{i}"), "order.paid")
                .payload_json("{}")
                .build()
                .unwrap()
        })
        .collect();
    let mut tx = pg.begin().await;
    tx.enqueue(std::slice::from_ref(&big)).await.unwrap();
    tx.enqueue(&small).await.unwrap();
    tx.enqueue(std::slice::from_ref(&after_big)).await.unwrap();
    tx.commit().await;

    let (stop_tx, stop_rx) = watch::channel(false);
    let config = RelayConfig {
        max_attempts: 2,
        retry_backoff: Duration::ZERO,
        prune: None,
        ..RelayConfig::default()
    };
    let handle = spawn_relay(
        relay(
            pg.store().clone(),
            &brokers,
            &[("message.max.bytes", "10000")],
            config,
        ),
        &stop_rx,
    );
    eventually(
        "the big row to be parked and the rest published",
        Duration::from_secs(30),
        || async {
            let s = pg.store().status().await.unwrap();
            (s.parked == 1 && s.pending == 0).then_some(())
        },
    )
    .await;
    stop_tx.send(true).unwrap();
    let r = handle.await.unwrap();
    let parked = pg.store().parked(10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].event_id, big.id());
    assert_eq!(
        parked[0].attempts, 2,
        "parked after the bounded number of attempts"
    );
    let reason = parked[0].last_error.clone().unwrap();
    assert!(
        reason.to_lowercase().contains("too large"),
        "reason: {reason}"
    );
    let ids: HashSet<String> = read(&brokers, TOPIC)
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_owned())
        .collect();
    for e in small.iter().chain([&after_big]) {
        assert!(
            ids.contains(&e.id().to_string()),
            "{} was blocked",
            e.aggregate_id()
        );
    }
    assert!(!ids.contains(&big.id().to_string()));
    assert_eq!(r.metrics().published_total(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_follow_cloudevents_binary_mode_and_carry_the_trace() {
    let pg = Pg::new().await;
    let cluster = EmbeddedCluster::start(1).unwrap();
    let brokers = cluster.bootstrap_servers();
    cluster.create_topic("payments.v1", 1).unwrap();
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let e = Event::builder("order", "o-7", "order.paid")
        .payload(&serde_json::json!({ "order_id": "o-7", "amount_minor": 1250 }))
        .header("tenant", "acme")
        .traceparent(tp)
        .topic("payments.v1")
        .build()
        .unwrap();
    let mut tx = pg.begin().await;
    tx.enqueue(std::slice::from_ref(&e)).await.unwrap();
    tx.commit().await;
    let r = relay(pg.store().clone(), &brokers, &[], RelayConfig::default());
    assert_eq!(r.run_once().await.unwrap().published, 1);
    let recs = read(&brokers, "payments.v1");
    assert_eq!(recs.len(), 1);
    let rec = &recs[0];
    assert_eq!(rec.key.as_deref(), Some("o-7"));
    let payload: serde_json::Value = serde_json::from_str(rec.payload.as_deref().unwrap()).unwrap();
    assert_eq!(payload["amount_minor"], 1250);
    let expect = [
        ("ce_specversion", "1.0".to_owned()),
        ("ce_id", e.id().to_string()),
        ("ce_type", "order.paid".to_owned()),
        ("ce_source", "/idem/order".to_owned()),
        ("ce_subject", "o-7".to_owned()),
        ("content-type", "application/json".to_owned()),
        ("idem_aggregate_type", "order".to_owned()),
        ("idem_aggregate_id", "o-7".to_owned()),
        ("idem_aggregate_seq", "1".to_owned()),
        ("idem_attempt", "1".to_owned()),
        ("traceparent", tp.to_owned()),
        ("tenant", "acme".to_owned()),
    ];
    for (k, v) in expect {
        assert_eq!(rec.header(k), Some(v.as_str()), "header {k}");
    }
    let ce_time = chrono::DateTime::parse_from_rfc3339(rec.header("ce_time").unwrap()).unwrap();
    assert_eq!(
        ce_time.timestamp_micros(),
        e.occurred_at().timestamp_micros()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_deliveries_are_never_marked() {
    let pg = Pg::new().await;
    let cluster = EmbeddedCluster::start(1).unwrap();
    cluster.create_topic(TOPIC, 1).unwrap();
    let brokers = cluster.bootstrap_servers();
    let events: Vec<Event> = (0..3)
        .map(|i| idem_conformance::scenarios::event("o-1", i))
        .collect();
    let mut tx = pg.begin().await;
    tx.enqueue(&events).await.unwrap();
    tx.commit().await;
    let config = RelayConfig {
        retry_backoff: Duration::ZERO,
        prune: None,
        ..RelayConfig::default()
    };
    let r = relay(
        pg.store().clone(),
        &brokers,
        &[("message.timeout.ms", "1500")],
        config,
    );
    cluster.broker_down(1).unwrap();
    let report = r.run_once().await.unwrap();
    assert_eq!(
        (report.claimed, report.published, report.retried),
        (3, 0, 3)
    );
    let rows: Vec<(String, i32, Option<String>)> = sqlx::query_as(
        "SELECT status, attempts, last_error FROM idem_outbox ORDER BY aggregate_seq",
    )
    .fetch_all(pg.pool())
    .await
    .unwrap();
    for (status, attempts, err) in &rows {
        assert_eq!((status.as_str(), *attempts), ("pending", 1));
        assert!(
            err.as_deref()
                .unwrap_or("")
                .to_lowercase()
                .contains("timed out"),
            "{err:?}"
        );
    }
    cluster.broker_up(1).unwrap();
    eventually(
        "the retry to publish after the broker is back",
        Duration::from_secs(30),
        || async {
            r.run_once().await.unwrap();
            (pg.store().status().await.unwrap().published == 3).then_some(())
        },
    )
    .await;
    let ids: Vec<String> = read(&brokers, TOPIC)
        .iter()
        .map(|r| r.header("ce_id").unwrap().to_owned())
        .collect();
    let want: Vec<String> = events.iter().map(|e| e.id().to_string()).collect();
    assert_eq!(ids, want, "each event once, in order");
}
