//! The publisher against librdkafka's mock cluster: what a batch reports when the broker is
//! unreachable, and that the publisher recovers with a new producer afterwards.

use std::time::Duration;

use idem_core::publish::{FailureKind, Message, Publisher};
use idem_core::wire::CE_ID;
use idem_kafka::{EmbeddedCluster, KafkaPublisher, inspect, producer_config};

fn messages(topic: &str, ids: std::ops::Range<u32>) -> Vec<Message> {
    ids.map(|i| Message {
        topic: topic.to_owned(),
        key: format!("order-{}", i % 3),
        payload: format!("{{\"n\":{i}}}"),
        headers: vec![(CE_ID.to_owned(), format!("id-{i}"))],
    })
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_batch_is_reported_failed_and_the_producer_is_replaced() {
    let cluster = EmbeddedCluster::start(1).unwrap();
    cluster.create_topic("orders", 3).unwrap();
    let brokers = cluster.bootstrap_servers();
    let cfg = producer_config(
        &brokers,
        &[("message.timeout.ms".to_owned(), "1500".to_owned())],
    )
    .unwrap();
    let publisher = KafkaPublisher::new(cfg).unwrap();

    // Reachable broker: delivered, nothing replaced.
    let first = publisher.publish(&messages("orders", 0..5)).await;
    assert!(first.iter().all(|r| r.is_ok()), "{first:?}");
    assert_eq!(publisher.replacements(), 0);

    // Unreachable broker: every message times out and is reported as a transient failure,
    // never as delivered; the publisher then replaces its producer.
    cluster.broker_down(1).unwrap();
    let second = publisher.publish(&messages("orders", 5..10)).await;
    assert_eq!(second.len(), 5);
    for r in &second {
        let e = r
            .as_ref()
            .expect_err("a message to a down broker was reported delivered");
        assert_eq!(e.kind, FailureKind::Transient, "{e:?}");
    }
    assert_eq!(publisher.replacements(), 1);

    // The new producer publishes once the broker is back.
    cluster.broker_up(1).unwrap();
    let third = publisher.publish(&messages("orders", 5..10)).await;
    assert!(third.iter().all(|r| r.is_ok()), "{third:?}");
    assert_eq!(publisher.replacements(), 1);

    let ids: std::collections::BTreeSet<String> =
        inspect::read_all(&brokers, "orders", Duration::from_secs(20))
            .unwrap()
            .iter()
            .filter_map(|r| r.header(CE_ID).map(str::to_owned))
            .collect();
    let expected: std::collections::BTreeSet<String> = (0..10).map(|i| format!("id-{i}")).collect();
    // Every id is there; a message the broker had stored before the timeout may be there
    // twice (that is the relay's republish window), but none is missing.
    assert_eq!(ids, expected);
}

/// With `--create-topics` and no replication factor, the replica count is min(3, brokers). While
/// the brokers cannot be counted, nothing is created — a topic created with one replica for
/// want of a count would stay under-replicated for good — and the batch fails as not sent,
/// with the reason, for the relay to retry. (Creating through the admin API needs a real
/// broker: `kafka_e2e` and `kafka_cluster` in idem-cli create their topics this way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_are_not_created_while_the_brokers_cannot_be_counted() {
    // A loopback port nothing listens on: every request fails.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let brokers = closed.local_addr().unwrap().to_string();
    drop(closed);
    let cfg = producer_config(
        &brokers,
        &[("message.timeout.ms".to_owned(), "3000".to_owned())],
    )
    .unwrap();
    let publisher = KafkaPublisher::new(cfg)
        .unwrap()
        .with_topic_creation(2, None);
    let results = publisher.publish(&messages("created", 0..3)).await;
    assert_eq!(results.len(), 3);
    for r in &results {
        let e = r
            .as_ref()
            .expect_err("published to a cluster that does not answer");
        assert_eq!(e.kind, FailureKind::NotSent, "{e:?}");
        assert!(e.reason.contains("counting the cluster's brokers"), "{e:?}");
    }
}
