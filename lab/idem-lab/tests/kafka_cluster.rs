//! The relay against a 3-node Apache Kafka cluster of the test's own (replication 3,
//! `min.insync.replicas=2`): the leader of a partition in use is SIGKILLed mid-run and a
//! follower paused, and nothing acknowledged is lost; the killed node restarts and rejoins.
//! Also: the relay's durability warning, which a 3-node topic silences and the suite's
//! single-node broker raises.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use idem_conformance::backend::{Backend, OpenTx, Pg};
use idem_conformance::kafka::{self, KafkaCluster};
use idem_conformance::process::{Proc, eventually, http_get, metric_value};
use idem_conformance::scenarios::event;
use idem_core::Event;
use idem_core::store::OutboxStore;
use idem_kafka::{admin, inspect};

fn relay(db: &str, brokers: &str, prefix: &str) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args([
        "relay",
        "--db",
        db,
        "--brokers",
        brokers,
        "--topic-prefix",
        prefix,
        "--metrics-addr",
        "127.0.0.1:0",
        "--no-prune",
        "--batch-size",
        "200",
    ])
    .env("RUST_LOG", "info")
    .env_remove("IDEM_CRASH_POINTS");
    Proc::spawn("relay", cmd)
}

async fn enqueue(pg: &Pg, events: &[Event]) {
    let mut tx = pg.begin().await;
    tx.enqueue(events).await.unwrap();
    tx.commit().await;
}

fn events(n: usize, tag: &str) -> Vec<Event> {
    (0..n)
        .map(|i| event(&format!("{tag}-{}", i % 50), i))
        .collect()
}

async fn partitions(brokers: &str, topic: &str) -> Vec<admin::PartitionInfo> {
    let (b, t) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        admin::partitions(&admin::connection(&b), &t, Duration::from_secs(5))
    })
    .await
    .unwrap()
    .unwrap_or_default()
}

/// Partition 0 of `topic` as the metadata reports it now.
async fn partition_0(brokers: &str, topic: &str) -> admin::PartitionInfo {
    partitions(brokers, topic)
        .await
        .into_iter()
        .find(|p| p.id == 0)
        .unwrap_or_else(|| panic!("no partition 0 of {topic} in the metadata"))
}

async fn published(pg: &Pg) -> i64 {
    pg.store().status().await.unwrap().published
}

fn at_risk(relay: &Proc, topic: &str) -> Option<f64> {
    let body = http_get(relay.metrics_addr(), "/metrics");
    metric_value(
        &body,
        "idem_relay_topic_durability_at_risk",
        &[("topic", topic)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines)] // one scripted scenario, read top to bottom
async fn a_killed_leader_and_a_paused_follower_lose_nothing_acknowledged() {
    let mut cluster = KafkaCluster::start(3);
    let brokers = cluster.brokers().to_owned();
    let pg = Pg::new().await;
    let prefix = format!("{}.", kafka::unique("cluster"));
    let topic = format!("{prefix}order");
    idem_kafka::ensure_topics(&brokers, std::slice::from_ref(&topic), 3, 3)
        .await
        .unwrap();
    let first = events(3000, "a");
    enqueue(&pg, &first).await;
    let relay = relay(pg.url(), &brokers, &prefix);
    eventually("the relay to publish", Duration::from_secs(60), || async {
        (published(&pg).await >= 300).then_some(())
    })
    .await;

    // Kill the leader of partition 0 while the relay is publishing: the relay is held
    // (SIGSTOP) while the leader is looked up and killed, so it cannot finish in between.
    relay.signal(19);
    let before_kill = published(&pg).await;
    let leader = partition_0(&brokers, &topic).await.leader;
    assert!(leader >= 1, "partition 0 has a leader");
    let status = cluster.kill(leader);
    assert_eq!(status.signal(), Some(9), "node {leader} was SIGKILLed");
    assert!(
        before_kill < i64::try_from(first.len()).unwrap(),
        "the kill came mid-run ({before_kill} of {} published)",
        first.len()
    );
    relay.signal(18);
    let new_leader = eventually(
        "another node to lead partition 0",
        Duration::from_secs(60),
        || async {
            let p = partitions(&brokers, &topic).await;
            p.first()
                .map(|p| p.leader)
                .filter(|l| *l >= 1 && *l != leader)
        },
    )
    .await;
    eventually(
        "every row to be published without the killed node",
        Duration::from_secs(120),
        || async { (published(&pg).await == i64::try_from(first.len()).unwrap()).then_some(()) },
    )
    .await;

    // The killed node comes back with its storage and rejoins every in-sync set.
    cluster.restart(leader);
    eventually(
        "the restarted node to rejoin the in-sync replicas",
        Duration::from_secs(120),
        || async {
            let p = partitions(&brokers, &topic).await;
            (p.len() == 3 && p.iter().all(|p| p.isr.contains(&leader))).then_some(())
        },
    )
    .await;

    // Pause a follower of partition 0 (as the metadata says now) while more rows go out, then
    // let it go.
    let p0 = partition_0(&brokers, &topic).await;
    let follower = p0
        .isr
        .iter()
        .copied()
        .find(|b| *b != p0.leader)
        .expect("partition 0 has an in-sync follower");
    cluster.pause(follower);
    let second = events(1000, "b");
    enqueue(&pg, &second).await;
    let total = i64::try_from(first.len() + second.len()).unwrap();
    eventually(
        "the rows written while a follower is paused to be published",
        Duration::from_secs(120),
        || async { (published(&pg).await == total).then_some(()) },
    )
    .await;
    cluster.resume(follower);

    let records = {
        let (b, t) = (brokers.clone(), topic.clone());
        tokio::task::spawn_blocking(move || {
            inspect::read_all(&b, &t, Duration::from_secs(60)).unwrap()
        })
        .await
        .unwrap()
    };
    let ids: HashSet<&str> = records.iter().filter_map(|r| r.header("ce_id")).collect();
    for e in first.iter().chain(&second) {
        assert!(
            ids.contains(e.id().to_string().as_str()),
            "event {} is missing from the topic",
            e.id()
        );
    }
    // A replicated topic with min.insync.replicas=2 survives the loss of one broker.
    assert_eq!(at_risk(&relay, &topic), Some(0.0));
    eprintln!(
        "leader {leader} killed, {new_leader} took over, follower {follower} paused; {} records for {total} events",
        records.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_with_one_replica_is_reported_at_risk() {
    let brokers = kafka::shared();
    let pg = Pg::new().await;
    let prefix = format!("{}.", kafka::unique("durability"));
    let topic = format!("{prefix}order");
    idem_kafka::ensure_topics(&brokers, std::slice::from_ref(&topic), 1, 1)
        .await
        .unwrap();
    enqueue(&pg, &events(5, "c")).await;
    let relay = relay(pg.url(), &brokers, &prefix);
    let line = relay.wait_for_line("1 replica(s)", Duration::from_secs(60));
    assert!(line.contains(&topic), "{line}");
    eventually("the metric", Duration::from_secs(30), || async {
        (at_risk(&relay, &topic) == Some(1.0)).then_some(())
    })
    .await;
}
