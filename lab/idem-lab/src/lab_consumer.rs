//! What the lab's variants of `idem-lab settlement` share on their command line: the bench's
//! consumer without an inbox (`idem-lab bench no-inbox-consumer`) and the chaos runner's Kafka
//! transactions consumer (`idem-lab kafka-txn-settlement`). Neither is effectively-once; both are
//! hidden commands.

use clap::Args;

/// Where a lab consumer reads and writes, and how much per transaction.
#[derive(Args, Debug)]
pub struct LabConsumerArgs {
    /// Settlement database (PostgreSQL).
    #[arg(long)]
    pub db: String,
    /// Kafka bootstrap servers.
    #[arg(long)]
    pub brokers: String,
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
