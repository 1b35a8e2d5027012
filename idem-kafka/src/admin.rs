//! What a cluster says about itself: its brokers, who leads each partition, and whether a
//! topic's acknowledged records survive the loss of one broker.
//!
//! The relay reads a topic's [`Durability`] when it starts ([`topic_durability`]) and warns
//! through [`Durability::warning`]; test harnesses and `idem chaos` use [`broker_ids`] to wait
//! for a cluster and [`partitions`] to find the leader of a partition in use.

use std::time::Duration;

use idem_core::{Error, Result};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
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

fn metadata_client(brokers: &str) -> Result<BaseConsumer> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| Error::broker("creating a metadata client", e))
}

/// The ids of the brokers the cluster reports, sorted.
pub fn broker_ids(brokers: &str, timeout: Duration) -> Result<Vec<i32>> {
    let client = metadata_client(brokers)?;
    let metadata = client
        .fetch_metadata(None, timeout)
        .map_err(|e| Error::broker("reading cluster metadata", e))?;
    let mut ids: Vec<i32> = metadata.brokers().iter().map(|b| b.id()).collect();
    ids.sort_unstable();
    Ok(ids)
}

/// `topic`'s partitions, sorted by id (empty if the topic does not exist).
pub fn partitions(brokers: &str, topic: &str, timeout: Duration) -> Result<Vec<PartitionInfo>> {
    let client = metadata_client(brokers)?;
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
        match self.min_insync {
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

/// Reads `topic`'s replica count (from the metadata) and its `min.insync.replicas` (from its
/// configuration). An error if the topic does not exist.
pub async fn topic_durability(brokers: &str, topic: &str, timeout: Duration) -> Result<Durability> {
    let parts = {
        let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
        tokio::task::spawn_blocking(move || partitions(&brokers, &topic, timeout))
            .await
            .map_err(|e| Error::broker("reading topic metadata", e))??
    };
    let Some(replication) = parts.iter().map(|p| p.replicas.len()).min() else {
        return Err(Error::broker(
            format!("reading the replication of {topic}"),
            "the topic does not exist",
        ));
    };
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| Error::broker("creating the Kafka admin client", e))?;
    let opts = AdminOptions::new().request_timeout(Some(timeout));
    let configs = admin
        .describe_configs([&ResourceSpecifier::Topic(topic)], &opts)
        .await
        .map_err(|e| Error::broker(format!("describing the configuration of {topic}"), e))?;
    let min_insync = configs
        .into_iter()
        .filter_map(std::result::Result::ok)
        .find_map(|resource| {
            resource
                .get("min.insync.replicas")
                .and_then(|entry| entry.value.as_deref())
                .and_then(|v| v.parse::<i32>().ok())
        });
    Ok(Durability {
        topic: topic.to_owned(),
        replication,
        min_insync,
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
    }
}
