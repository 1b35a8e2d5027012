//! The consumer's partition lanes, asynchronous offset commits and overlapped fetches against
//! brokers (librdkafka's mock cluster and Apache Kafka) and PostgreSQL: per-aggregate order and
//! every event applied once across rebalances, a crash point and a kill; an offset committed
//! only for batches whose transaction committed, and the stored ones committed when a run ends.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_conformance::backend::{Backend, Pg};
use idem_conformance::kafka;
use idem_conformance::process::eventually;
use idem_consumer::{
    Consumer, ConsumerConfig, ConsumerMetrics, Handler, HandlerContext, HandlerError,
};
use idem_core::crash::{self, Action};
use idem_core::publish::{Message, Publisher};
use idem_core::{EventId, InboundEvent};
use idem_kafka::{EmbeddedCluster, KafkaPublisher, KafkaSource, consumer_config};
use tokio::sync::watch;

/// Records each application: (aggregate, n) in the order the transactions applied them.
#[derive(Clone, Copy)]
struct Applier;

impl Handler<sqlx::PgConnection> for Applier {
    async fn handle(
        &self,
        cx: &mut HandlerContext<'_, sqlx::PgConnection>,
        e: &InboundEvent,
    ) -> Result<(), HandlerError> {
        let n = e.payload["n"]
            .as_i64()
            .ok_or_else(|| HandlerError::permanent("no n"))?;
        sqlx::query("INSERT INTO applied (event_id, aggregate, n) VALUES ($1, $2, $3)")
            .bind(e.event_id.to_string())
            .bind(&e.aggregate_id)
            .bind(n)
            .execute(cx.conn())
            .await
            .map_err(HandlerError::transient)?;
        Ok(())
    }
}

async fn database() -> Pg {
    let pg = Pg::new().await;
    pg.exec(
        "CREATE TABLE applied (seq bigserial PRIMARY KEY, event_id text NOT NULL, aggregate text NOT NULL, n bigint NOT NULL)",
    )
    .await
    .unwrap();
    pg
}

/// `per` events for each of `aggregates` aggregates, numbered 0.. per aggregate, as the relay
/// would publish them (keyed by aggregate).
fn events(aggregates: usize, per: usize, topic: &str) -> Vec<Message> {
    (0..per)
        .flat_map(|n| {
            (0..aggregates).map(move |a| {
                let key = format!("agg-{a}");
                Message {
                    topic: topic.to_owned(),
                    key: key.clone(),
                    payload: format!(r#"{{"n":{n}}}"#),
                    headers: vec![
                        ("ce_id".into(), EventId::new().to_string()),
                        ("ce_type".into(), "thing.happened".into()),
                        ("idem_aggregate_type".into(), "thing".into()),
                        ("idem_aggregate_id".into(), key),
                    ],
                }
            })
        })
        .collect()
}

/// A member of `group` running in the background until `stop` says so (or it crashes).
fn member(
    pg: &Pg,
    brokers: &str,
    group: &str,
    topic: &str,
    settings: &[(String, String)],
    stop: &watch::Sender<bool>,
) -> tokio::task::JoinHandle<idem_core::Result<()>> {
    let source = KafkaSource::new(
        &consumer_config(brokers, group, settings).unwrap(),
        &[topic.to_owned()],
    )
    .unwrap();
    let mut config = ConsumerConfig::new(group);
    config.batch_size = 20;
    config.retry_backoff = Duration::from_millis(10);
    config.retry_backoff_max = Duration::from_millis(50);
    let metrics = ConsumerMetrics::new(&prometheus::Registry::new()).unwrap();
    let consumer = Consumer::new(pg.inbox(), Applier, source, config, metrics);
    let mut rx = stop.subscribe();
    tokio::spawn(consumer.run(async move {
        let _ = rx.wait_for(|s| *s).await;
    }))
}

async fn applied(pg: &Pg) -> i64 {
    pg.scalar("SELECT count(DISTINCT event_id) FROM applied")
        .await
}

/// Two members, a third joining, one crashing at `consumer.after_db_commit_before_offset_commit`
/// (error mode: the in-process restart of the demo), one killed at an await (its task aborted):
/// every event applied exactly once, each aggregate's events in order.
async fn rebalance_and_kill(brokers: &str, topic: &str, settings: &[(String, String)]) {
    let pg = database().await;
    let group = kafka::unique("lanes");
    let publisher =
        KafkaPublisher::new(idem_kafka::producer_config(brokers, &[]).unwrap()).unwrap();
    let all = events(24, 25, topic);
    let total = i64::try_from(all.len()).unwrap();
    for chunk in all.chunks(100) {
        let acks = publisher.publish(chunk).await;
        assert!(acks.iter().all(Result::is_ok), "{acks:?}");
    }
    let (stop, _) = watch::channel(false);
    let a = member(&pg, brokers, &group, topic, settings, &stop);
    eventually(
        "the first member to apply some",
        Duration::from_secs(60),
        || async { (applied(&pg).await > 0).then_some(()) },
    )
    .await;
    let b = member(&pg, brokers, &group, topic, settings, &stop);
    // Whichever member commits a transaction next crashes before storing its offsets.
    crash::arm(
        idem_core::crash::CrashPoint::ConsumerAfterDbCommitBeforeOffsetCommit,
        Action::Error,
        1,
    )
    .unwrap();
    let (mut a, mut b) = (a, b);
    let (crashed, survivor) = tokio::select! {
        r = &mut a => (r, b),
        r = &mut b => (r, a),
    };
    let crashed = crashed.unwrap();
    assert!(
        matches!(crashed, Err(idem_core::Error::CrashPoint(_))),
        "{crashed:?}"
    );
    let c = member(&pg, brokers, &group, topic, settings, &stop);
    let seen = applied(&pg).await;
    eventually("more to be applied", Duration::from_secs(60), || async {
        (applied(&pg).await > seen || applied(&pg).await == total).then_some(())
    })
    .await;
    survivor.abort(); // killed at whatever await it was in
    let _ = survivor.await;
    let d = member(&pg, brokers, &group, topic, settings, &stop);
    eventually(
        "every event to be applied",
        Duration::from_secs(120),
        || async { (applied(&pg).await == total).then_some(()) },
    )
    .await;
    stop.send(true).unwrap();
    c.await.unwrap().unwrap();
    d.await.unwrap().unwrap();

    assert_eq!(
        pg.scalar("SELECT count(*) FROM applied").await,
        total,
        "an event was applied twice"
    );
    assert_eq!(
        pg.scalar("SELECT count(*) FROM idem_inbox").await,
        total,
        "one inbox row per event"
    );
    let out_of_order: i64 = pg
        .scalar(
            "SELECT count(*) FROM (SELECT n < lag(n) OVER (PARTITION BY aggregate ORDER BY seq) AS back FROM applied) x WHERE back",
        )
        .await;
    assert_eq!(
        out_of_order, 0,
        "an aggregate's events were applied out of order"
    );
    crash::disarm_all();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_mock_cluster_partitions_keep_their_order_and_apply_once_across_rebalances_a_crash_and_a_kill()
 {
    let cluster = EmbeddedCluster::start(1).unwrap();
    let topic = "lanes.thing";
    cluster.create_topic(topic, 4).unwrap();
    // The mock cluster holds every classic rebalance for session.timeout.ms − 1 s.
    let settings = [
        ("session.timeout.ms".to_owned(), "3000".to_owned()),
        ("heartbeat.interval.ms".to_owned(), "500".to_owned()),
    ];
    rebalance_and_kill(&cluster.bootstrap_servers(), topic, &settings).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_kafka_partitions_keep_their_order_and_apply_once_across_rebalances_a_crash_and_a_kill()
{
    let brokers = kafka::shared();
    let topic = format!("{}.thing", kafka::unique("lanes"));
    idem_kafka::ensure_topics(&brokers, std::slice::from_ref(&topic), 4, 1)
        .await
        .unwrap();
    rebalance_and_kill(&brokers, &topic, &[]).await;
}

/// A transaction rolled back (`consumer.after_dedup_before_handler` in error mode) commits no
/// offset; the next member applies the events and its run's end commits their offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_kafka_an_offset_is_committed_only_after_its_transaction_committed() {
    let pg = database().await;
    let brokers = kafka::shared();
    let topic = format!("{}.thing", kafka::unique("rollback"));
    idem_kafka::ensure_topics(&brokers, std::slice::from_ref(&topic), 1, 1)
        .await
        .unwrap();
    let group = kafka::unique("rollback");
    let publisher =
        KafkaPublisher::new(idem_kafka::producer_config(&brokers, &[]).unwrap()).unwrap();
    let msgs = events(3, 1, &topic);
    assert!(publisher.publish(&msgs).await.iter().all(Result::is_ok));
    let committed = || {
        let (b, g, t) = (brokers.clone(), group.clone(), topic.clone());
        async move {
            tokio::task::spawn_blocking(move || {
                idem_kafka::inspect::committed_offsets(&b, &g, &t, Duration::from_secs(10))
                    .unwrap_or_default()
            })
            .await
            .unwrap()
        }
    };

    crash::arm(
        idem_core::crash::CrashPoint::ConsumerAfterDedupBeforeHandler,
        Action::Error,
        1,
    )
    .unwrap();
    let (stop, _) = watch::channel(false);
    let first = member(&pg, &brokers, &group, &topic, &[], &stop)
        .await
        .unwrap();
    assert!(
        matches!(first, Err(idem_core::Error::CrashPoint(_))),
        "{first:?}"
    );
    assert_eq!(applied(&pg).await, 0);
    assert_eq!(pg.scalar("SELECT count(*) FROM idem_inbox").await, 0);
    assert!(
        committed().await.iter().all(|(_, o)| *o <= 0),
        "an offset was committed for a rolled-back batch: {:?}",
        committed().await
    );

    let second = member(&pg, &brokers, &group, &topic, &[], &stop);
    eventually(
        "the events to be applied",
        Duration::from_secs(60),
        || async { (applied(&pg).await == 3).then_some(()) },
    )
    .await;
    stop.send(true).unwrap();
    second.await.unwrap().unwrap();
    assert_eq!(
        committed().await,
        vec![(0, 3)],
        "the end of the run commits what was stored"
    );
}
