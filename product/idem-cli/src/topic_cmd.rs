//! `idem topic create | dump`.

use std::time::Duration;

use clap::Subcommand;

use crate::kafka_args::KafkaArgs;

#[derive(Subcommand, Debug)]
pub enum TopicCommand {
    /// Create topics (existing ones are left alone).
    Create {
        /// Kafka bootstrap servers.
        #[arg(long, env = "IDEM_BROKERS")]
        brokers: String,
        /// Topic name (repeatable).
        #[arg(long = "topic", required = true)]
        topics: Vec<String>,
        /// Partitions per topic.
        #[arg(long, default_value_t = 3)]
        partitions: i32,
        /// Replicas per partition.
        #[arg(long, default_value_t = 1)]
        replication: i32,
        /// How to reach and authenticate to the cluster (TLS, SASL).
        #[command(flatten)]
        kafka: Box<KafkaArgs>,
    },
    /// Print every record of a topic as JSON lines (partition, offset, key, headers, payload).
    Dump {
        /// Kafka bootstrap servers.
        #[arg(long, env = "IDEM_BROKERS")]
        brokers: String,
        /// Topic name.
        #[arg(long)]
        topic: String,
        /// Give up after this long.
        #[arg(long, default_value = "30s", value_parser = crate::util::parse_duration)]
        timeout: Duration,
        /// How to reach and authenticate to the cluster (TLS, SASL).
        #[command(flatten)]
        kafka: Box<KafkaArgs>,
    },
}

pub(crate) async fn run(cmd: TopicCommand) -> anyhow::Result<()> {
    match cmd {
        TopicCommand::Create {
            brokers,
            topics,
            partitions,
            replication,
            kafka,
        } => {
            for t in &topics {
                idem_core::event::validate_topic(t).map_err(anyhow::Error::msg)?;
            }
            let conn = kafka.connection(&brokers)?.client_config();
            kafka.check(&conn, "idem topic create").await?;
            idem_kafka::ensure_topics_with(&conn, &topics, partitions, replication).await?;
            println!("topics ready: {}", topics.join(", "));
        }
        TopicCommand::Dump {
            brokers,
            topic,
            timeout,
            kafka,
        } => {
            let conn = kafka.connection(&brokers)?.client_config();
            kafka.check(&conn, "idem topic dump").await?;
            let records = tokio::task::spawn_blocking(move || {
                idem_kafka::inspect::read_all_with(&conn, &topic, timeout)
            })
            .await??;
            for r in records {
                let headers: serde_json::Map<String, serde_json::Value> = r
                    .headers
                    .iter()
                    .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                    .collect();
                println!(
                    "{}",
                    serde_json::json!({
                        "partition": r.partition,
                        "offset": r.offset,
                        "key": r.key,
                        "headers": headers,
                        "payload": r.payload,
                    })
                );
            }
        }
    }
    Ok(())
}
