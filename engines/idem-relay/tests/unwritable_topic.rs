//! Rows whose topic does not exist, on a cluster that creates no topic on first use (as
//! production clusters run), are parked with the reason once the cluster says so, and the
//! other aggregates' rows flow. A private one-node broker with `auto.create.topics.enable=false`;
//! the relay's producer creates no topic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use idem_conformance::backend::{Backend, OpenTx, Pg};
use idem_conformance::kafka::{self, KafkaCluster};
use idem_core::Event;
use idem_core::publish::{Message, Publisher};
use idem_kafka::KafkaPublisher;
use idem_relay::{CycleReport, Relay, RelayConfig, TopicNaming};

fn event(aggregate_type: &str, id: &str) -> Event {
    Event::builder(aggregate_type, id, format!("{aggregate_type}.happened"))
        .payload(&serde_json::json!({ "id": id }))
        .build()
        .unwrap()
}

/// Creates `topic` (a creating publisher sends it a first record).
async fn create(brokers: &str, topic: &str) {
    let producer = idem_kafka::producer_config(brokers, &[]).unwrap();
    let creator = KafkaPublisher::new(producer)
        .unwrap()
        .with_topic_creation(1, Some(1));
    let first = Message {
        topic: topic.to_owned(),
        key: "setup".to_owned(),
        payload: "{}".to_owned(),
        headers: vec![],
    };
    let sent = creator.publish(&[first]).await;
    assert!(sent.iter().all(Result::is_ok), "{sent:?}");
}

/// A relay with short timeouts and backoffs that parks rows of a topic failing for `grace`.
fn relay(
    pg: &Pg,
    brokers: &str,
    topics: TopicNaming,
    grace: Duration,
) -> Relay<<Pg as Backend>::Store, KafkaPublisher> {
    let producer = idem_kafka::producer_config(
        brokers,
        &[("message.timeout.ms".to_owned(), "1000".to_owned())],
    )
    .unwrap();
    let config = RelayConfig {
        lease: Duration::from_secs(10),
        retry_backoff: Duration::from_millis(100),
        retry_backoff_max: Duration::from_millis(500),
        unwritable_topic_grace: Some(grace),
        topics,
        prune: None,
        ..RelayConfig::default()
    };
    Relay::builder(pg.store().clone(), KafkaPublisher::new(producer).unwrap())
        .config(config)
        .build()
        .unwrap()
}

/// Runs `relay`'s cycles until one claims a row (a failed row waits out its backoff).
async fn turn(relay: &Relay<<Pg as Backend>::Store, KafkaPublisher>) -> CycleReport {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let report = relay.run_once().await.unwrap();
        if report.claimed > 0 {
            return report;
        }
        assert!(Instant::now() < deadline, "no row claimable for 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

type Row = (String, String, Option<String>);

async fn rows(pg: &Pg) -> Vec<Row> {
    sqlx::query_as("SELECT aggregate_id, status, last_error FROM idem_outbox ORDER BY id")
        .fetch_all(pg.pool())
        .await
        .unwrap()
}

/// Orders published, invoices parked.
fn settled(rows: &[Row]) -> bool {
    rows.iter().all(|(aggregate, status, _)| {
        let want = if aggregate.starts_with("o-") {
            "published"
        } else {
            "parked"
        };
        status == want
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_for_a_topic_that_does_not_exist_are_parked_and_the_others_flow() {
    let cluster = KafkaCluster::start_with(1, &[("auto.create.topics.enable", "false")]);
    let (orders, missing) = (
        kafka::unique("relay-orders"),
        kafka::unique("relay-missing"),
    );
    create(cluster.brokers(), &orders).await;
    let pg = Pg::new().await;
    let mut tx = pg.begin().await;
    let events = [
        event("order", "o-1"),
        event("invoice", "i-1"),
        event("invoice", "i-1"),
        event("order", "o-2"),
    ];
    tx.enqueue(&events).await.unwrap();
    tx.commit().await;

    let mut topics = TopicNaming::default();
    topics.overrides.insert("order".to_owned(), orders);
    topics
        .overrides
        .insert("invoice".to_owned(), missing.clone());
    let relay = relay(&pg, cluster.brokers(), topics, Duration::from_secs(2));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        relay.run_once().await.unwrap();
        let now = rows(&pg).await;
        if settled(&now) {
            for (_, _, why) in now.iter().filter(|(a, _, _)| a.starts_with("i-")) {
                let why = why.as_deref().unwrap_or_default();
                assert!(
                    why.contains(&format!("topic {missing} does not exist")),
                    "{why}"
                );
                assert!(why.contains("idem outbox retry"), "{why}");
            }
            break;
        }
        assert!(Instant::now() < deadline, "not settled in 60 s: {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two relays taking turns at a row of a missing topic: the first to see the topic fail for
/// its grace parks the row at that turn, whatever the other relay saw in between.
#[tokio::test(flavor = "multi_thread")]
async fn relays_taking_turns_park_the_row_at_the_first_turn_past_the_grace() {
    let cluster = KafkaCluster::start_with(1, &[("auto.create.topics.enable", "false")]);
    let missing = kafka::unique("relay-missing");
    let pg = Pg::new().await;
    let mut tx = pg.begin().await;
    tx.enqueue(&[event("invoice", "i-1")]).await.unwrap();
    tx.commit().await;
    let mut topics = TopicNaming::default();
    topics
        .overrides
        .insert("invoice".to_owned(), missing.clone());
    let grace = Duration::from_secs(1);
    let (a, b) = (
        relay(&pg, cluster.brokers(), topics.clone(), grace),
        relay(&pg, cluster.brokers(), topics, grace),
    );

    let first = turn(&a).await;
    let a_began = Instant::now();
    assert_eq!((first.claimed, first.parked), (1, 0), "{first:?}");
    let other = turn(&b).await;
    assert_eq!((other.claimed, other.parked), (1, 0), "{other:?}");
    // The grace is the relay's own clock: its end is the condition under test.
    tokio::time::sleep_until((a_began + grace).into()).await;
    let second = turn(&a).await;
    assert_eq!(second.parked, 1, "{second:?}: {:?}", rows(&pg).await);
    let (_, status, why) = &rows(&pg).await[0];
    assert_eq!(status, "parked");
    let why = why.as_deref().unwrap_or_default();
    assert!(
        why.contains(&format!("topic {missing} does not exist")),
        "{why}"
    );
}
