//! What a cluster says about itself: its brokers, who leads each partition, and whether a
//! topic's acknowledged records survive the loss of one broker.
//!
//! The relay reads a topic's [`Durability`] beside its first batch to it ([`topic_durability`],
//! again every ten minutes) and warns through [`Durability::warning`]; test harnesses and `idem
//! chaos` use [`broker_ids`] to wait for a cluster and [`partitions`] to find the leader of a
//! partition in use. Every function takes a [`connection`] (or [`connection_of`] a client's
//! configuration, so that a secured cluster accepts it).

use std::time::Duration;

use idem_core::{Error, Result};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::consumer::{BaseConsumer, Consumer};

/// One partition as the metadata reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionInfo {
    /// The partition id.
    pub id: i32,
    /// The broker id of its leader (-1 while it has none).
    pub leader: i32,
    /// Its replicas' broker ids.
    pub replicas: Vec<i32>,
    /// Its in-sync replicas' broker ids.
    pub isr: Vec<i32>,
}

/// Settings prefixes that say how to reach and authenticate to a cluster, whatever the client.
const CONNECTION_PREFIXES: &[&str] = &[
    "bootstrap.servers",
    "security.",
    "ssl.",
    "sasl.",
    "client.",
    "socket.",
    "broker.address.",
    "enable.ssl.",
];

/// The settings of `config` (a producer's or a consumer's) that reach and authenticate to its
/// cluster — bootstrap servers, `security.*`, `ssl.*`, `sasl.*`, `client.*`, `socket.*` — for
/// the metadata and admin clients built beside it: a secured cluster refuses a client made
/// from the bootstrap servers alone.
///
/// The values are read with [`ClientConfig::get`]: rdkafka's `config_map` replaces secrets
/// (`sasl.password`, …) with a placeholder, which a copy would send to the broker as the
/// password.
pub fn connection_of(config: &ClientConfig) -> ClientConfig {
    let mut conn = ClientConfig::new();
    for k in config.config_map().keys() {
        if CONNECTION_PREFIXES.iter().any(|p| k.starts_with(p))
            && let Some(v) = config.get(k)
        {
            conn.set(*k, v);
        }
    }
    conn
}

/// A connection to the cluster at `brokers` with no further settings.
pub fn connection(brokers: &str) -> ClientConfig {
    let mut conn = ClientConfig::new();
    conn.set("bootstrap.servers", brokers);
    conn
}

fn metadata_client(conn: &ClientConfig) -> Result<BaseConsumer<crate::client_log::Reported>> {
    conn.create_with_context(crate::client_log::Reported)
        .map_err(|e| {
            Error::broker(
                "creating a metadata client",
                crate::security::client_error(&e),
            )
        })
}

/// The ids of the brokers the cluster reports, sorted.
pub fn broker_ids(conn: &ClientConfig, timeout: Duration) -> Result<Vec<i32>> {
    let client = metadata_client(conn)?;
    let metadata = client
        .fetch_metadata(None, timeout)
        .map_err(|e| Error::broker("reading cluster metadata", e))?;
    let mut ids: Vec<i32> = metadata.brokers().iter().map(|b| b.id()).collect();
    ids.sort_unstable();
    Ok(ids)
}

/// `topic`'s partitions, sorted by id (empty if the topic does not exist).
pub fn partitions(
    conn: &ClientConfig,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<PartitionInfo>> {
    let client = metadata_client(conn)?;
    let metadata = client
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| Error::broker(format!("reading metadata of {topic}"), e))?;
    let mut out: Vec<PartitionInfo> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions())
        .map(|p| PartitionInfo {
            id: p.id(),
            leader: p.leader(),
            replicas: p.replicas().to_vec(),
            isr: p.isr().to_vec(),
        })
        .collect();
    out.sort_by_key(|p| p.id);
    Ok(out)
}

/// How many copies of a topic's acknowledged records exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Durability {
    /// The topic.
    pub topic: String,
    /// The smallest replica count over its partitions.
    pub replication: usize,
    /// Its `min.insync.replicas` (the topic's, else the broker's default).
    pub min_insync: Option<i32>,
    /// Its `unclean.leader.election.enable` (`None`: not read).
    pub unclean_leader_election: Option<bool>,
}

impl Durability {
    /// Why a record acknowledged with `acks=all` might not survive the loss of one broker, or
    /// `None` when it does. With `acks=all` the leader acknowledges once every in-sync replica
    /// has the record, and the in-sync set may shrink to `min.insync.replicas` brokers: both
    /// the replica count and that floor must be at least 2.
    pub fn warning(&self) -> Option<String> {
        let topic = &self.topic;
        if self.replication < 2 {
            return Some(format!(
                "topic {topic} has {} replica(s): a record acknowledged with acks=all is lost with that broker's disk; create it with a replication factor of 3 (`idem relay --create-topics N --replication-factor 3`)",
                self.replication
            ));
        }
        if self.unclean_leader_election == Some(true) {
            return Some(format!(
                "topic {topic} has unclean.leader.election.enable=true: a replica that missed acknowledged records may become leader and drop them; set it to false"
            ));
        }
        match self.min_insync {
            Some(m) if usize::try_from(m).is_ok_and(|m| m > self.replication) => Some(format!(
                "topic {topic} has min.insync.replicas={m} but {} replicas: every acks=all send fails (NOT_ENOUGH_REPLICAS) and the relay retries forever; lower min.insync.replicas or add replicas",
                self.replication
            )),
            Some(m) if m >= 2 => None,
            Some(m) => Some(format!(
                "topic {topic} has min.insync.replicas={m}: with the in-sync set shrunk to one broker, acks=all acknowledges records that broker alone holds; set min.insync.replicas=2 (`kafka-configs --alter --entity-type topics --entity-name {topic} --add-config min.insync.replicas=2`)"
            )),
            None => Some(format!(
                "topic {topic}: min.insync.replicas could not be read, so acknowledged records may be held by one broker alone"
            )),
        }
    }
}

/// Whether broker `broker` creates a topic when a record is first produced to it
/// (`auto.create.topics.enable`), or `None` when its configuration cannot be read (an ACL, a
/// timeout). `conn` is a connection's configuration: servers and security only.
pub async fn broker_auto_creates_topics(
    conn: &ClientConfig,
    broker: i32,
    timeout: Duration,
) -> Option<bool> {
    let admin: AdminClient<crate::client_log::Reported> =
        conn.create_with_context(crate::client_log::Reported).ok()?;
    let opts = AdminOptions::new().request_timeout(Some(timeout));
    let configs = admin
        .describe_configs([&ResourceSpecifier::Broker(broker)], &opts)
        .await
        .ok()?;
    configs
        .into_iter()
        .filter_map(std::result::Result::ok)
        .find_map(|resource| {
            resource
                .get("auto.create.topics.enable")
                .and_then(|entry| entry.value.as_deref())
                .and_then(|v| v.parse::<bool>().ok())
        })
}

/// The settings of a client configuration that say where the cluster is and how to reach it
/// (servers, security, client id): what an admin client made beside a consumer needs, without
/// the consumer's own settings, which librdkafka would warn about.
pub(crate) fn connection_only(config: &ClientConfig) -> ClientConfig {
    let mut out = ClientConfig::new();
    for (key, value) in config.config_map() {
        let connection = ["bootstrap.servers", "security.protocol", "client.id"].contains(&key)
            || ["ssl.", "sasl.", "socket.", "broker.", "enable.ssl."]
                .iter()
                .any(|p| key.starts_with(p));
        if connection {
            out.set(key, value);
        }
    }
    out
}

/// Reads `topic`'s replica count (from the metadata) and its `min.insync.replicas` (from its
/// configuration). An error if the topic does not exist.
pub async fn topic_durability(
    conn: &ClientConfig,
    topic: &str,
    timeout: Duration,
) -> Result<Durability> {
    let parts = {
        let (conn, topic) = (conn.clone(), topic.to_owned());
        tokio::task::spawn_blocking(move || partitions(&conn, &topic, timeout))
            .await
            .map_err(|e| Error::broker("reading topic metadata", e))??
    };
    let Some(replication) = parts.iter().map(|p| p.replicas.len()).min() else {
        return Err(Error::broker(
            format!("reading the replication of {topic}"),
            "the topic does not exist",
        ));
    };
    let admin: AdminClient<crate::client_log::Reported> = conn
        .create_with_context(crate::client_log::Reported)
        .map_err(|e| {
            Error::broker(
                "creating the Kafka admin client",
                crate::security::client_error(&e),
            )
        })?;
    let opts = AdminOptions::new().request_timeout(Some(timeout));
    let configs = admin
        .describe_configs([&ResourceSpecifier::Topic(topic)], &opts)
        .await
        .map_err(|e| Error::broker(format!("describing the configuration of {topic}"), e))?;
    let resources: Vec<_> = configs
        .into_iter()
        .filter_map(std::result::Result::ok)
        .collect();
    let value = |name: &str| {
        resources
            .iter()
            .find_map(|resource| resource.get(name).and_then(|entry| entry.value.clone()))
    };
    let min_insync = value("min.insync.replicas").and_then(|v| v.parse::<i32>().ok());
    let unclean_leader_election =
        value("unclean.leader.election.enable").and_then(|v| v.parse::<bool>().ok());
    Ok(Durability {
        topic: topic.to_owned(),
        replication,
        min_insync,
        unclean_leader_election,
    })
}

#[cfg(test)]
mod tests {
    use super::Durability;

    fn d(replication: usize, min_insync: Option<i32>) -> Durability {
        Durability {
            topic: "t".to_owned(),
            replication,
            min_insync,
            unclean_leader_election: Some(false),
        }
    }

    #[test]
    fn a_record_must_survive_the_loss_of_one_broker() {
        assert_eq!(d(3, Some(2)).warning(), None);
        assert_eq!(d(2, Some(2)).warning(), None);
        let one_replica = d(1, Some(1)).warning().unwrap_or_default();
        assert!(one_replica.contains("1 replica"), "{one_replica}");
        let floor_of_one = d(3, Some(1)).warning().unwrap_or_default();
        assert!(
            floor_of_one.contains("min.insync.replicas=1"),
            "{floor_of_one}"
        );
        assert!(d(3, None).warning().is_some());
        let floor_above_replicas = d(2, Some(3)).warning().unwrap_or_default();
        assert!(
            floor_above_replicas.contains("every acks=all send fails"),
            "{floor_above_replicas}"
        );
        let unclean = Durability {
            unclean_leader_election: Some(true),
            ..d(3, Some(2))
        };
        assert!(
            unclean
                .warning()
                .unwrap_or_default()
                .contains("unclean.leader.election.enable=true")
        );
    }

    #[test]
    fn side_clients_keep_the_connection_and_security_settings_only() {
        let mut producer = rdkafka::ClientConfig::new();
        producer
            .set("bootstrap.servers", "b:9093")
            .set("security.protocol", "SASL_SSL")
            .set("sasl.mechanism", "SCRAM-SHA-512")
            .set("sasl.username", "relay")
            .set("sasl.password", "the-password")
            .set("ssl.ca.location", "/etc/ca.pem")
            .set("acks", "all")
            .set("enable.idempotence", "true");
        let conn = super::connection_of(&producer);
        for key in [
            "bootstrap.servers",
            "security.protocol",
            "sasl.mechanism",
            "sasl.username",
            "sasl.password",
            "ssl.ca.location",
        ] {
            assert_eq!(conn.get(key), producer.get(key), "{key}");
        }
        assert_eq!(conn.get("acks"), None);
        assert_eq!(conn.get("enable.idempotence"), None);
    }
}
