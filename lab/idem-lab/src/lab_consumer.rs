//! What the lab's variants of `idem-lab settlement` share on their command line: the bench's
//! consumer without an inbox (`idem-lab bench no-inbox-consumer`) and the chaos runner's Kafka
//! transactions consumer (`idem-lab kafka-txn-settlement`). Neither is effectively-once; both are
//! hidden commands.

use clap::Args;

/// Where a lab consumer reads and writes, and how much per transaction.
#[derive(Args)]
pub(crate) struct LabConsumerArgs {
    /// Settlement database (PostgreSQL).
    #[arg(long)]
    pub db: String,
    /// Kafka bootstrap servers.
    #[arg(long)]
    pub brokers: String,
    /// How to reach and authenticate to the cluster (TLS, SASL).
    #[command(flatten)]
    pub kafka: Box<idem_cli::kafka_args::KafkaArgs>,
    /// Consumer group.
    #[arg(long)]
    pub group: String,
    /// Topic.
    #[arg(long)]
    pub topic: String,
    /// Records per transaction.
    #[arg(long, default_value_t = 200)]
    pub batch_size: usize,
    /// librdkafka consumer setting KEY=VALUE (repeatable).
    #[arg(long = "consumer-config", value_parser = idem_kafka::parse_setting)]
    pub consumer_config: Vec<(String, String)>,
}

impl LabConsumerArgs {
    /// The consumer configuration for the group: the `--kafka-*` security, the
    /// `--consumer-config` overrides, idem's forced settings.
    pub(crate) fn consumer_config(&self) -> anyhow::Result<idem_kafka::ClientConfig> {
        Ok(self
            .kafka
            .connection(&self.brokers)?
            .consumer_config(&self.group, &self.consumer_config)?)
    }
}

impl std::fmt::Debug for LabConsumerArgs {
    /// The `--consumer-config` values of secret settings (`sasl.password=…`) are redacted.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LabConsumerArgs")
            .field("db", &idem_sql::redact(&self.db))
            .field("brokers", &self.brokers)
            .field("kafka", &self.kafka)
            .field("group", &self.group)
            .field("topic", &self.topic)
            .field("batch_size", &self.batch_size)
            .field(
                "consumer_config",
                &idem_kafka::security::describe_settings(&self.consumer_config),
            )
            .finish()
    }
}
