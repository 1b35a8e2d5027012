//! The consumer source against librdkafka's mock cluster: broker trouble is waited out inside
//! the source instead of being handed to the consumer runtime, whose retry backoff (up to 5 s
//! per error) once made a consumer work through a burst of stale errors for minutes after a
//! broker restart.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem_core::publish::{Message, Publisher};
use idem_core::store::Source;
use idem_core::wire::CE_ID;
use idem_kafka::{EmbeddedCluster, KafkaPublisher, KafkaSource, consumer_config, producer_config};

fn message(n: u32) -> Vec<Message> {
    vec![Message {
        topic: "orders".to_owned(),
        key: "order-1".to_owned(),
        payload: format!("{{\"n\":{n}}}"),
        headers: vec![(CE_ID.to_owned(), format!("id-{n}"))],
    }]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_is_waited_out_and_the_next_record_is_returned() {
    let cluster = EmbeddedCluster::start(1).unwrap();
    cluster.create_topic("orders", 1).unwrap();
    let brokers = cluster.bootstrap_servers();
    let publisher = KafkaPublisher::new(producer_config(&brokers, &[]).unwrap()).unwrap();
    assert!(
        publisher
            .publish(&message(1))
            .await
            .iter()
            .all(Result::is_ok)
    );
    let config = consumer_config(&brokers, "source-test", &[]).unwrap();
    let source = KafkaSource::new(&config, &["orders".to_owned()]).unwrap();
    let first = tokio::time::timeout(
        Duration::from_secs(30),
        source.next_batch(10, Duration::from_millis(20)),
    )
    .await
    .expect("the first record within 30 s")
    .unwrap();
    assert_eq!(first.len(), 1);

    // The broker goes away while the source waits for the next record.
    let errors = source.transient_errors();
    cluster.broker_down(1).unwrap();
    let waiting =
        tokio::spawn(async move { source.next_batch(10, Duration::from_millis(20)).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while errors.load(Ordering::Relaxed) == 0 {
        assert!(
            Instant::now() < deadline,
            "the source saw no broker error in 30 s of outage"
        );
        assert!(!waiting.is_finished(), "{:?}", waiting.await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // It comes back: the same wait returns the next record, not the errors it waited out.
    cluster.broker_up(1).unwrap();
    assert!(
        publisher
            .publish(&message(2))
            .await
            .iter()
            .all(Result::is_ok)
    );
    let next = tokio::time::timeout(Duration::from_secs(60), waiting)
        .await
        .expect("the record written after the outage within 60 s")
        .unwrap()
        .expect("a transient broker error reached the runtime");
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].offset, 1);
}
