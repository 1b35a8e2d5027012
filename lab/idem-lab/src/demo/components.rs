//! The pipeline's components, each spawned under [`supervise`]: the points API, the relays,
//! the settlement consumers and the effect dispatcher. Each is wired once, generic over the
//! database ([`with_store!`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use idem_consumer::{Consumer, ConsumerConfig, ConsumerMetrics};
use idem_core::TableNames;
use idem_effects::{Dispatcher, DispatcherConfig, EffectMetrics};
use idem_kafka::{KafkaPublisher, KafkaSource};
use idem_reference::Settlement;
use idem_relay::{Relay, RelayConfig, RelayMetrics, TopicNaming};
use idem_sql::{AnyPool, AnyStore, with_store};
use tokio::task::JoinHandle;

use super::supervise::{Ctl, supervise};

/// The spawned components, by name, in the order they stop.
#[derive(Default)]
pub(super) struct Tasks(Vec<(&'static str, JoinHandle<anyhow::Result<()>>)>);

impl Tasks {
    fn push(&mut self, name: &'static str, task: JoinHandle<anyhow::Result<()>>) {
        self.0.push((name, task));
    }

    /// Waits for each component to stop (they were told to), 30 s at most each.
    pub(super) async fn join(self) -> anyhow::Result<()> {
        for (name, task) in self.0 {
            match tokio::time::timeout(Duration::from_secs(30), task).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => return Err(e.context(format!("{name} stopped with an error"))),
                Ok(Err(e)) => bail!("{name} panicked: {e}"),
                Err(_) => bail!("{name} did not stop within 30 s"),
            }
        }
        Ok(())
    }
}

/// Serves the points API on a loopback port until `ctl` stops; returns its awards URL.
pub(super) async fn points_api(
    tasks: &mut Tasks,
    ctl: &Ctl,
    points: &AnyPool,
    tables: &TableNames,
) -> anyhow::Result<String> {
    let config = idem_http::IdempotencyConfig::default();
    // The award and its key's completion in one transaction: one commit per award.
    let app = idem_reference::points::transactional_router(points.clone(), tables, config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let target = format!("http://{}/awards", listener.local_addr()?);
    let api_stop = ctl.shutdown();
    tasks.push(
        "points-api",
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(api_stop)
                .await
                .context("the points API")
        }),
    );
    Ok(target)
}

/// The relays' configuration: short message timeout and lease so that a crashed relay's rows
/// come back soon.
fn relay_config(i: usize, prefix: &str) -> RelayConfig {
    RelayConfig {
        relay_id: format!("demo-relay-{i}"),
        batch_size: 100,
        lease: Duration::from_millis(2500),
        topics: TopicNaming {
            prefix: prefix.to_owned(),
            overrides: BTreeMap::new(),
        },
        prune: None,
        ..RelayConfig::default()
    }
}

/// Starts `count` relays over the orders database, publishing through `publisher`.
pub(super) fn relays(
    tasks: &mut Tasks,
    ctl: &Ctl,
    count: usize,
    orders: &AnyStore,
    publisher: &Arc<KafkaPublisher>,
    prefix: &str,
    metrics: &RelayMetrics,
) {
    for i in 0..count {
        let (ctl2, orders) = (ctl.clone(), orders.clone());
        let (publisher, metrics) = (publisher.clone(), metrics.clone());
        let config = relay_config(i, prefix);
        let task = supervise(ctl.clone(), "relay", move || {
            let (orders, publisher) = (orders.clone(), publisher.clone());
            let (config, metrics) = (config.clone(), metrics.clone());
            let shutdown = ctl2.shutdown();
            async move {
                with_store!(orders, s => {
                    Relay::new(s.relay(), publisher, config, metrics)
                        .run(shutdown)
                        .await
                })
            }
        });
        tasks.push("relay", tokio::spawn(task));
    }
}

/// The demo consumers' Kafka settings on top of idem's defaults. A crashed member's source is
/// dropped, which leaves the group at once (librdkafka's close sends LeaveGroup), and its
/// restart joins as a new member. Real Kafka rebalances as soon as the remaining members have
/// rejoined; librdkafka's mock cluster instead holds every rebalance of a group that is up for
/// `session.timeout.ms` − 1 s (`rd_kafka_mock_cgrp_classic_rebalance`), whether or not every
/// member has rejoined: with idem's 10 s that was 9 s of nothing consumed per crash. On the
/// mock cluster the session is 4 s (a rebalance holds 3 s). It cannot be shorter than the
/// mock's first join, which waits 3 s (its `group.initial.rebalance.delay.ms`): with 1.5 s no
/// member ever got an assignment. Static membership would not help there, as the mock keeps a
/// static member that closed until its session times out.
pub(super) fn consumer_settings(embedded: bool) -> Vec<(String, String)> {
    if !embedded {
        return vec![];
    }
    [
        ("session.timeout.ms", "4000"),
        ("heartbeat.interval.ms", "500"),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect()
}

/// Starts `count` settlement consumers, one group; each restart is a new group member.
///
/// The Kafka group (in `kafka`) is unique to the run (a shared broker may hold other runs'
/// groups); the inbox's group is "settlement", as `idem verify`'s reference configuration
/// expects, in databases that are this run's alone.
#[allow(clippy::too_many_arguments)]
pub(super) fn consumers(
    tasks: &mut Tasks,
    ctl: &Ctl,
    count: usize,
    settlement: &AnyStore,
    kafka: &rdkafka::ClientConfig,
    topic: &str,
    target: &str,
    metrics: &ConsumerMetrics,
) {
    for _ in 0..count {
        let (ctl2, metrics, kafka) = (ctl.clone(), metrics.clone(), kafka.clone());
        let (settle, target, topic) = (settlement.clone(), target.to_owned(), topic.to_owned());
        let task = supervise(ctl.clone(), "settlement", move || {
            let (settle, target, metrics) = (settle.clone(), target.clone(), metrics.clone());
            let source = KafkaSource::new(&kafka, std::slice::from_ref(&topic));
            let shutdown = ctl2.shutdown();
            async move {
                let source = source?;
                let mut config = ConsumerConfig::new("settlement");
                config.batch_size = 100;
                with_store!(settle, s => {
                    let handler = Settlement::with_points(target);
                    Consumer::new(s.inbox(), handler, source, config, metrics)
                        .run(shutdown)
                        .await
                })
            }
        });
        tasks.push("settlement", tokio::spawn(task));
    }
}

/// The dispatcher's configuration: a probe and a request fit in the lease (2 × timeout +
/// margin); idle waits from 2 to 50 ms.
fn dispatcher_config() -> DispatcherConfig {
    DispatcherConfig {
        batch_size: 50,
        lease: Duration::from_secs(3),
        timeout: Duration::from_secs(1),
        retry_backoff: Duration::from_millis(50),
        retry_backoff_max: Duration::from_secs(1),
        authorization: Some("Bearer settlement".to_owned()),
        concurrency: 16,
        idle_poll_min: Duration::from_millis(2),
        idle_poll_max: Duration::from_millis(50),
        ..DispatcherConfig::default()
    }
}

/// Starts the effect dispatcher over the settlement database's intents. Its metrics outlive
/// each restart.
pub(super) fn dispatcher(
    tasks: &mut Tasks,
    ctl: &Ctl,
    settlement: &AnyStore,
    metrics: &EffectMetrics,
) {
    let (ctl2, metrics, settle) = (ctl.clone(), metrics.clone(), settlement.clone());
    let config = dispatcher_config();
    let task = supervise(ctl.clone(), "dispatcher", move || {
        let (settle, config, metrics) = (settle.clone(), config.clone(), metrics.clone());
        let shutdown = ctl2.shutdown();
        async move {
            with_store!(settle, s => {
                Dispatcher::builder(s.intents())
                    .config(config)
                    .shared_metrics(metrics)
                    .build()?
                    .run(shutdown)
                    .await
            })
        }
    });
    tasks.push("dispatcher", tokio::spawn(task));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_the_mock_cluster_a_rebalance_holds_three_seconds_and_elsewhere_idem_defaults_hold() {
        assert!(consumer_settings(false).is_empty());
        let mock = consumer_settings(true);
        let cfg = idem_kafka::consumer_config("b:1", "g", &mock).unwrap();
        let ms = |k: &str| -> u64 { cfg.get(k).and_then(|v| v.parse().ok()).unwrap_or(0) };
        assert_eq!(ms("session.timeout.ms"), 4000);
        // Longer than the mock's first join (3 s), or no member is ever assigned a partition.
        assert!(ms("session.timeout.ms") > 3000);
        assert!(ms("heartbeat.interval.ms") * 3 <= ms("session.timeout.ms"));
        let created: Result<rdkafka::consumer::BaseConsumer, _> = cfg.create();
        assert!(created.is_ok(), "{:?}", created.err());
    }
}
