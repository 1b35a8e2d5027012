//! The chaos run's Apache Kafka: one node or a 3-node cluster, prepared by `scripts/kafka
//! prepare` (configuration, formatted storage, each node's launch command) and run as the
//! runner's own children, so that it can SIGKILL, pause and restart each node. The broker faults
//! are chosen here, apart from the processes that carry them out.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::procs::{Proc, Role};
use crate::broker::script;

/// A prepared cluster: its bootstrap list, its directory and one process per node (not
/// started).
pub(crate) struct Prepared {
    pub bootstrap: String,
    pub dir: std::path::PathBuf,
    pub nodes: Vec<Proc>,
    /// Every port chosen for the cluster (clients, controllers, proxies), bound only once it
    /// runs.
    pub ports: Vec<u16>,
}

/// Runs `scripts/kafka prepare` for `nodes` nodes in `dir/kafka` — with `secured`, one node
/// whose client listener is SASL_SSL (`--security sasl_ssl`: a PKI and SCRAM users made for the
/// run, in `dir/kafka/pki` and `dir/kafka/users`) — and builds their processes (named
/// `kafka-N`, N the node id).
pub(crate) fn prepare(
    nodes: usize,
    dir: &Path,
    secured: bool,
    proxied_listeners: usize,
) -> anyhow::Result<Prepared> {
    let kafka_dir = dir.join("kafka");
    let script = script();
    let mut cmd = Command::new(&script);
    cmd.args(["prepare", "--nodes", &nodes.to_string(), "--dir"])
        .arg(&kafka_dir);
    if secured {
        cmd.args(["--security", "sasl_ssl"]);
    }
    if proxied_listeners > 0 {
        cmd.args(["--proxied-listeners", &proxied_listeners.to_string()]);
    }
    let out = cmd
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} prepare failed ({}): {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let bootstrap = std::fs::read_to_string(kafka_dir.join("bootstrap"))
        .context("reading the prepared cluster's bootstrap list")?
        .trim()
        .to_owned();
    let ports = std::fs::read_to_string(kafka_dir.join("ports"))
        .context("reading the prepared cluster's ports")?
        .lines()
        .map(|l| l.trim().parse::<u16>())
        .collect::<Result<Vec<_>, _>>()
        .context("reading the prepared cluster's ports")?;
    let mut procs = vec![];
    for id in 1..=nodes {
        let argv: Vec<String> = std::fs::read_to_string(kafka_dir.join(format!("node{id}/argv")))
            .with_context(|| format!("reading node {id}'s launch command"))?
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect();
        let Some((java, rest)) = argv.split_first() else {
            bail!("node {id}'s launch command is empty");
        };
        let (java, rest) = (java.clone(), rest.to_vec());
        procs.push(Proc::new(
            Role::Broker,
            format!("kafka-{id}"),
            dir,
            Box::new(move |_| {
                let mut cmd = Command::new(&java);
                cmd.args(&rest);
                cmd
            }),
        ));
    }
    Ok(Prepared {
        bootstrap,
        dir: kafka_dir,
        nodes: procs,
        ports,
    })
}

/// Waits until the cluster of `kafka` reports `nodes` brokers.
pub(crate) async fn wait_ready(
    kafka: &idem_kafka::Connection,
    nodes: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let bootstrap = kafka.brokers();
    loop {
        let conn = kafka.client_config();
        let ids = tokio::task::spawn_blocking(move || {
            idem_kafka::admin::broker_ids(&conn, Duration::from_secs(2))
        })
        .await?;
        match ids {
            Ok(ids) if ids.len() >= nodes => return Ok(()),
            other if Instant::now() >= deadline => {
                bail!(
                    "Kafka at {bootstrap} did not report {nodes} brokers within {timeout:?}: {other:?}"
                )
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// A broker fault, by node id (1-based).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BrokerFault {
    /// SIGKILL the only node and restart it.
    Kill(i32),
    /// SIGKILL the leader of a partition in use and restart it.
    LeaderKill(i32),
    /// SIGSTOP a follower of a partition in use for a while.
    FollowerPause(i32),
    /// SIGSTOP the only node for a while.
    Pause(i32),
}

impl BrokerFault {
    /// The name the report counts it under.
    pub(crate) fn kind(self) -> &'static str {
        match self {
            BrokerFault::Kill(_) => "broker_kill",
            BrokerFault::LeaderKill(_) => "leader_kill",
            BrokerFault::FollowerPause(_) => "follower_pause",
            BrokerFault::Pause(_) => "broker_pause",
        }
    }
}

/// Chooses a broker fault. The `first` of a run is always a kill, so that every run kills a
/// broker at least once. One node: killed three times in four, else paused. Three nodes: the
/// leader of `partition` killed, or one of its in-sync followers paused, every other time
/// (`roll` even: kill). `None` when the partition has no leader or no in-sync follower, which
/// means the cluster is still recovering from the last fault.
pub(crate) fn choose(
    nodes: usize,
    roll: u64,
    first: bool,
    partition: Option<&idem_kafka::admin::PartitionInfo>,
) -> Option<BrokerFault> {
    let roll = if first { 0 } else { roll };
    if nodes == 1 {
        return Some(if roll % 4 == 3 {
            BrokerFault::Pause(1)
        } else {
            BrokerFault::Kill(1)
        });
    }
    let p = partition?;
    if p.leader < 1 || p.isr.len() < nodes {
        return None;
    }
    if roll.is_multiple_of(2) {
        return Some(BrokerFault::LeaderKill(p.leader));
    }
    let followers: Vec<i32> = p.isr.iter().copied().filter(|b| *b != p.leader).collect();
    let pick = followers.get((roll / 2) as usize % followers.len().max(1))?;
    Some(BrokerFault::FollowerPause(*pick))
}

/// Kills the node of `fault` (restarted after `down`) or pauses it for `down`.
pub(crate) fn hit_broker(
    procs: &mut [Proc],
    fault: BrokerFault,
    down: Duration,
    now: Instant,
) -> anyhow::Result<()> {
    let (BrokerFault::Kill(id)
    | BrokerFault::LeaderKill(id)
    | BrokerFault::FollowerPause(id)
    | BrokerFault::Pause(id)) = fault;
    let Some(node) = procs.iter_mut().find(|p| p.name == format!("kafka-{id}")) else {
        bail!("the cluster reported broker {id}, which this run did not start");
    };
    match fault {
        BrokerFault::Kill(_) | BrokerFault::LeaderKill(_) => {
            node.kill9();
            node.restart_at = Some(now + down);
        }
        BrokerFault::FollowerPause(_) | BrokerFault::Pause(_) => {
            node.signal(19);
            node.paused_until = Some(now + down);
        }
    }
    Ok(())
}

/// The partitions of the run's topic (none when the cluster cannot say in time).
pub(crate) async fn partitions(
    kafka: &idem_kafka::Connection,
    topic: &str,
) -> anyhow::Result<Vec<idem_kafka::admin::PartitionInfo>> {
    let (conn, t) = (kafka.client_config(), topic.to_owned());
    Ok(tokio::task::spawn_blocking(move || {
        idem_kafka::admin::partitions(&conn, &t, Duration::from_secs(2))
    })
    .await?
    .unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::{BrokerFault, choose};
    use idem_kafka::admin::PartitionInfo;

    fn part(leader: i32, isr: &[i32]) -> PartitionInfo {
        PartitionInfo {
            id: 0,
            leader,
            replicas: vec![1, 2, 3],
            isr: isr.to_vec(),
        }
    }

    #[test]
    fn one_node_is_killed_or_paused() {
        assert_eq!(choose(1, 0, false, None), Some(BrokerFault::Kill(1)));
        assert_eq!(choose(1, 3, false, None), Some(BrokerFault::Pause(1)));
        // The first broker fault of a run is a kill, whatever the roll.
        assert_eq!(choose(1, 3, true, None), Some(BrokerFault::Kill(1)));
        let healthy = part(2, &[1, 2, 3]);
        assert_eq!(
            choose(3, 1, true, Some(&healthy)),
            Some(BrokerFault::LeaderKill(2))
        );
    }

    #[test]
    fn three_nodes_lose_the_leader_or_a_follower_never_two_at_once() {
        let healthy = part(2, &[1, 2, 3]);
        assert_eq!(
            choose(3, 0, false, Some(&healthy)),
            Some(BrokerFault::LeaderKill(2))
        );
        let paused = choose(3, 1, false, Some(&healthy));
        assert!(matches!(paused, Some(BrokerFault::FollowerPause(b)) if b != 2));
        // A cluster still missing a replica is left alone.
        assert_eq!(choose(3, 0, false, Some(&part(2, &[2, 3]))), None);
        assert_eq!(choose(3, 0, false, Some(&part(-1, &[1, 2, 3]))), None);
        assert_eq!(choose(3, 0, false, None), None);
    }
}
