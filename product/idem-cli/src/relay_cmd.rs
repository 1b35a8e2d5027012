//! `idem relay`.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use idem_core::health::Health;
use idem_core::store::{OutboxStore, PrunePolicy};
use idem_kafka::{EMBEDDED, EmbeddedCluster, KafkaPublisher};
use idem_relay::{Relay, RelayConfig, RelayMetrics};

use crate::DbArgs;
use crate::db;
use crate::util::{duration_text, parse_duration, shutdown_signal};

#[derive(Args, Debug)]
pub struct RelayArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Kafka bootstrap servers (host:port,...), or `embedded` for librdkafka's in-process mock cluster.
    #[arg(long, env = "IDEM_BROKERS")]
    brokers: String,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9464; port 0 picks one).
    #[arg(long, env = "IDEM_METRICS_ADDR")]
    metrics_addr: Option<SocketAddr>,
    /// Rows per claim; claim, produce and mark are each one round trip per batch.
    #[arg(long, default_value_t = RelayConfig::default().batch_size)]
    batch_size: u32,
    /// How long a claim is exclusive to this relay (e.g. 60s). Must exceed twice message.timeout.ms.
    #[arg(long, default_value = duration_text(RelayConfig::default().lease), value_parser = parse_duration)]
    lease: Duration,
    /// Longest idle poll interval: the most latency an idle relay adds.
    #[arg(long, default_value = duration_text(RelayConfig::default().idle_poll_max), value_parser = parse_duration)]
    idle_poll_max: Duration,
    /// Permanent failures (too large, invalid topic) before a row is parked; transient ones never park.
    #[arg(long, default_value_t = RelayConfig::default().max_attempts)]
    max_attempts: i32,
    /// Backoff after a failed attempt (doubles per attempt, at most --retry-backoff-max).
    #[arg(long, default_value = duration_text(RelayConfig::default().retry_backoff), value_parser = parse_duration)]
    retry_backoff: Duration,
    /// Longest backoff between attempts at a failing row.
    #[arg(long, default_value = duration_text(RelayConfig::default().retry_backoff_max), value_parser = parse_duration)]
    retry_backoff_max: Duration,
    /// How long messages to one topic may fail without a success before the relay asks the
    /// cluster about it; a topic it says does not exist or may not be written has its rows
    /// parked at once, with the reason (`idem outbox retry` once it is fixed).
    #[arg(long, default_value = duration_text(RelayConfig::default().unwritable_topic_grace.unwrap_or_default()), value_parser = parse_duration)]
    unwritable_topic_grace: Duration,
    /// Topic prefix before the aggregate type.
    #[arg(long, default_value = idem_relay::DEFAULT_TOPIC_PREFIX)]
    topic_prefix: String,
    /// Topic for an aggregate type: AGGREGATE_TYPE=TOPIC (repeatable).
    #[arg(long = "topic", value_parser = idem_kafka::parse_setting)]
    topics: Vec<(String, String)>,
    /// CloudEvents `ce_source` (default /idem/AGGREGATE_TYPE).
    #[arg(long)]
    source: Option<String>,
    #[command(flatten)]
    producer: ProducerArgs,
    /// Keep published rows this long before pruning.
    #[arg(long, default_value = duration_text(PrunePolicy::default().retention), value_parser = parse_duration)]
    retention: Duration,
    /// How often to prune published rows.
    #[arg(long, default_value = duration_text(default_prune_interval()), value_parser = parse_duration)]
    prune_interval: Duration,
    /// Move pruned rows to the PREFIXoutbox_archive table instead of deleting them.
    #[arg(long)]
    archive: bool,
    /// Never prune published rows.
    #[arg(long, conflicts_with_all = ["archive"])]
    no_prune: bool,
    /// This relay's name in claimed_by (default relay-PID-RANDOM).
    #[arg(long)]
    relay_id: Option<String>,
}

/// How often [`RelayConfig::default`] prunes.
fn default_prune_interval() -> Duration {
    RelayConfig::default()
        .prune
        .map_or(Duration::from_secs(60), |(every, _)| every)
}

/// The relay's settings from its flags, whose defaults are [`RelayConfig::default`]'s.
fn relay_config(args: &RelayArgs, topics: idem_relay::TopicNaming) -> RelayConfig {
    RelayConfig {
        relay_id: args
            .relay_id
            .clone()
            .unwrap_or_else(idem_relay::default_relay_id),
        batch_size: args.batch_size.max(1),
        lease: args.lease,
        idle_poll_max: args.idle_poll_max,
        max_attempts: args.max_attempts.max(1),
        retry_backoff: args.retry_backoff,
        retry_backoff_max: args.retry_backoff_max.max(args.retry_backoff),
        unwritable_topic_grace: Some(args.unwritable_topic_grace),
        topics,
        source: args.source.clone(),
        prune: (!args.no_prune).then(|| {
            (
                args.prune_interval,
                PrunePolicy {
                    retention: args.retention,
                    archive: args.archive,
                    ..PrunePolicy::default()
                },
            )
        }),
        ..RelayConfig::default()
    }
}

pub(crate) async fn run(args: RelayArgs) -> anyhow::Result<()> {
    // Handlers first: a SIGTERM during start-up or the first batch must not kill the process.
    let mut shutdown = Box::pin(shutdown_signal()?);
    let topics = crate::kafka_args::topic_naming(&args.topic_prefix, &args.topics)?;
    // Fail early, with a clear message, when the tables are missing.
    let outbox_readable = |store: db::Store| async move {
        idem_sql::with_store!(&store, s => s.relay().status().await.map(|_| ()))
            .context("reading the outbox (did you run `idem migrate`?)")
    };
    let store = tokio::select! {
        store = db::open_checked(&args.db, 4, outbox_readable) => store?,
        () = &mut shutdown => return Ok(()),
    };

    let kafka = Kafka::connect(&args.brokers, &args.producer, "idem relay").await?;
    let (brokers, timeout_ms, publisher) =
        (kafka.brokers, kafka.message_timeout_ms, kafka.publisher);
    let _embedded = kafka.embedded;
    // A batch takes at most about 2 × message.timeout.ms (see KafkaPublisher::publish).
    if args.lease <= Duration::from_millis(timeout_ms.saturating_mul(2)) {
        bail!(
            "--lease {:?} must be longer than twice message.timeout.ms ({timeout_ms} ms), or a live relay could lose its lease mid-batch",
            args.lease
        );
    }
    let publisher = std::sync::Arc::new(publisher);

    let registry = prometheus::Registry::new();
    let metrics = RelayMetrics::new(&registry)?;
    registry.register(Box::new(ProducerReplacements::new(publisher.clone())?))?;
    registry.register(Box::new(TopicDurability::new(publisher.clone())?))?;
    // The tables were read and the broker checked above: both are reachable now.
    let health = Health::new();
    health.expect(idem_relay::DATABASE);
    health.ok(idem_relay::DATABASE);
    crate::readiness::watch_broker(publisher.config(), &health);
    if let Some(addr) = args.metrics_addr {
        let bound =
            crate::metrics_server::serve_with(addr, registry.clone(), health.clone()).await?;
        eprintln!("idem relay: metrics on http://{bound}/metrics (probes /healthz, /readyz)");
    }
    let config = relay_config(&args, topics);
    eprintln!(
        "idem relay {}: publishing {} to {brokers}",
        config.relay_id,
        idem_sql::redact(&args.db.db)
    );
    let result = idem_sql::with_store!(store, s => {
        let relay = Relay::builder(s.relay(), publisher.clone())
            .config(config)
            .metrics(metrics)
            .health(health)
            .build()?;
        relay.run(shutdown).await
    });
    // Every batch was completed (marked or released) before run() returned.
    if let Err(e) = publisher.flush(Duration::from_secs(5)) {
        tracing::warn!(error = %e, "producer flush at shutdown");
    }
    result?;
    eprintln!("idem relay: stopped cleanly");
    Ok(())
}

/// The producer settings both relays take.
#[derive(clap::Args)]
pub(crate) struct ProducerArgs {
    /// How to reach and authenticate to the cluster (TLS, SASL).
    #[command(flatten)]
    pub(crate) kafka: Box<crate::kafka_args::KafkaArgs>,
    /// librdkafka producer setting KEY=VALUE (repeatable). Settings the guarantee needs are refused.
    #[arg(long = "producer-config", value_parser = idem_kafka::parse_setting)]
    pub(crate) producer_config: Vec<(String, String)>,
    /// Create missing topics with this many partitions (for brokers without auto-creation).
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..))]
    pub(crate) create_topics: Option<i32>,
    /// Replicas of the topics --create-topics creates (default: min(3, the cluster's brokers);
    /// while the brokers cannot be counted, nothing is created and the batch is retried).
    #[arg(long, requires = "create_topics", value_parser = clap::value_parser!(i32).range(1..))]
    pub(crate) replication_factor: Option<i32>,
}

impl std::fmt::Debug for ProducerArgs {
    /// The `--producer-config` values of secret settings (`sasl.password=…`) are redacted.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProducerArgs")
            .field("kafka", &self.kafka)
            .field(
                "producer_config",
                &idem_kafka::security::describe_settings(&self.producer_config),
            )
            .field("create_topics", &self.create_topics)
            .field("replication_factor", &self.replication_factor)
            .finish()
    }
}

/// The Kafka side of a relay: the brokers (librdkafka's mock cluster for `embedded`, kept
/// alive here) and a publisher with idem's producer settings.
pub(crate) struct Kafka {
    /// The mock cluster, when `embedded` was asked for.
    pub(crate) embedded: Option<EmbeddedCluster>,
    /// The bootstrap servers.
    pub(crate) brokers: String,
    /// The producer's `message.timeout.ms`.
    pub(crate) message_timeout_ms: u64,
    /// The publisher: topic creation when asked, the durability check on real clusters.
    pub(crate) publisher: KafkaPublisher,
}

impl Kafka {
    /// Connects to `brokers` with the `--kafka-*` security and the `producer_config` overrides
    /// (the guarantee's settings are refused), checking a real cluster once before the relay
    /// starts (a refused login or certificate stops it here); `bin` names the command in what
    /// it prints.
    pub(crate) async fn connect(
        brokers: &str,
        args: &ProducerArgs,
        bin: &str,
    ) -> anyhow::Result<Self> {
        let conn = args.kafka.connection(brokers)?;
        let (embedded, conn) = if brokers == EMBEDDED {
            let cluster = EmbeddedCluster::start(1)?;
            let servers = cluster.bootstrap_servers();
            eprintln!("{bin}: embedded mock cluster at {servers}");
            (Some(cluster), conn.with_brokers(servers))
        } else {
            (None, conn)
        };
        let servers = conn.brokers().to_owned();
        let producer = conn.producer_config(&args.producer_config)?;
        if embedded.is_none() {
            args.kafka.check(&producer, bin).await?;
        }
        let message_timeout_ms: u64 = producer
            .get("message.timeout.ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000);
        let mut publisher = KafkaPublisher::new(producer)?;
        if let Some(p) = args.create_topics {
            publisher = publisher.with_topic_creation(p, args.replication_factor);
        }
        if embedded.is_none() {
            // The mock cluster keeps one copy of everything: only real clusters are checked.
            publisher = publisher.with_durability_check();
        }
        Ok(Kafka {
            embedded,
            brokers: servers,
            message_timeout_ms,
            publisher,
        })
    }
}

/// `idem_relay_producer_replacements_total`: read from the publisher at each scrape.
struct ProducerReplacements {
    publisher: std::sync::Arc<KafkaPublisher>,
    desc: prometheus::core::Desc,
}

impl ProducerReplacements {
    fn new(publisher: std::sync::Arc<KafkaPublisher>) -> prometheus::Result<Self> {
        let desc = prometheus::core::Desc::new(
            "idem_relay_producer_replacements_total".to_owned(),
            "Kafka producers this relay replaced after a fatal error or a timed-out batch"
                .to_owned(),
            vec![],
            std::collections::HashMap::new(),
        )?;
        Ok(ProducerReplacements { publisher, desc })
    }
}

impl prometheus::core::Collector for ProducerReplacements {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        vec![&self.desc]
    }

    #[expect(
        clippy::cast_precision_loss,
        reason = "the exposition format carries counters as f64; replacements stay far below 2^53"
    )]
    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let mut counter = prometheus::proto::Counter::default();
        counter.set_value(self.publisher.replacements() as f64);
        let mut metric = prometheus::proto::Metric::default();
        metric.set_counter(counter);
        let mut family = prometheus::proto::MetricFamily::default();
        family.set_name(self.desc.fq_name.clone());
        family.set_help(self.desc.help.clone());
        family.set_field_type(prometheus::proto::MetricType::COUNTER);
        family.set_metric(vec![metric]);
        vec![family]
    }
}

/// `idem_relay_topic_durability_at_risk{topic}`: 1 when a record acknowledged on that topic
/// would not survive the loss of one broker (fewer than 2 replicas, or
/// `min.insync.replicas` below 2), else 0; read when the relay first publishes to it.
struct TopicDurability {
    publisher: std::sync::Arc<KafkaPublisher>,
    desc: prometheus::core::Desc,
}

impl TopicDurability {
    fn new(publisher: std::sync::Arc<KafkaPublisher>) -> prometheus::Result<Self> {
        let desc = prometheus::core::Desc::new(
            "idem_relay_topic_durability_at_risk".to_owned(),
            "1 when a record acknowledged on the topic would not survive the loss of one broker (replicas < 2 or min.insync.replicas < 2)".to_owned(),
            vec!["topic".to_owned()],
            std::collections::HashMap::new(),
        )?;
        Ok(TopicDurability { publisher, desc })
    }
}

impl prometheus::core::Collector for TopicDurability {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let metrics: Vec<prometheus::proto::Metric> = self
            .publisher
            .durability()
            .into_iter()
            .map(|(topic, at_risk)| {
                let mut gauge = prometheus::proto::Gauge::default();
                gauge.set_value(if at_risk { 1.0 } else { 0.0 });
                let mut label = prometheus::proto::LabelPair::default();
                label.set_name("topic".to_owned());
                label.set_value(topic);
                let mut metric = prometheus::proto::Metric::default();
                metric.set_label(vec![label]);
                metric.set_gauge(gauge);
                metric
            })
            .collect();
        if metrics.is_empty() {
            return vec![];
        }
        let mut family = prometheus::proto::MetricFamily::default();
        family.set_name(self.desc.fq_name.clone());
        family.set_help(self.desc.help.clone());
        family.set_field_type(prometheus::proto::MetricType::GAUGE);
        family.set_metric(metrics);
        vec![family]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        relay: RelayArgs,
    }

    #[test]
    fn the_flags_default_to_the_library_defaults() {
        let cli = Cli::try_parse_from(["idem", "--db", "sqlite://x.db", "--brokers", "b:9092"])
            .map_err(|e| e.to_string());
        let args = cli.map(|c| c.relay);
        let Ok(args) = args else {
            panic!("{args:?}");
        };
        let topics = idem_relay::TopicNaming::default();
        let from_flags = relay_config(&args, topics.clone());
        let library = RelayConfig {
            relay_id: from_flags.relay_id.clone(),
            topics,
            ..RelayConfig::default()
        };
        assert_eq!(format!("{from_flags:?}"), format!("{library:?}"));
    }
}
