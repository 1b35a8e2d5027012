//! The broker a lab command (`idem-lab demo`, `idem-lab bench`) runs against, chosen by `--brokers`:
//! bootstrap servers given by the user, `embedded` (librdkafka's mock cluster, in this process)
//! or `kafka` (a single-node Apache Kafka that `scripts/kafka up` starts for the run and
//! `scripts/kafka down` stops when the run ends, also when it fails).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, bail};
use idem_kafka::EmbeddedCluster;

/// `--brokers kafka`: start a single-node Apache Kafka for the run.
pub(crate) const KAFKA: &str = "kafka";

/// `scripts/kafka` of the source tree this binary was built from, unless `IDEM_KAFKA_SCRIPT`
/// names another.
pub(crate) fn script() -> PathBuf {
    std::env::var_os("IDEM_KAFKA_SCRIPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/kafka"))
}

/// Where the brokers are.
pub(crate) enum Broker {
    /// Bootstrap servers given by the user.
    External(String),
    /// librdkafka's mock cluster, in this process.
    Embedded(EmbeddedCluster),
    /// A single-node Apache Kafka started for this run, stopped when this value is dropped.
    Kafka {
        /// `127.0.0.1:PORT`, the last line `scripts/kafka up` printed.
        bootstrap: String,
        /// Its state directory (configuration, log segments, the node's pid).
        dir: tempfile::TempDir,
    },
}

impl Broker {
    /// `kafka`, `embedded`, or bootstrap servers.
    pub(crate) async fn start(brokers: &str) -> anyhow::Result<Self> {
        match brokers {
            idem_kafka::EMBEDDED => Ok(Broker::Embedded(EmbeddedCluster::start(1)?)),
            KAFKA => start_kafka(None).await,
            other => Ok(Broker::External(other.to_owned())),
        }
    }

    /// `--brokers kafka` with the client listener secured (`scripts/kafka up --security ssl` or
    /// `sasl_ssl`, a PKI and users made for the run), and the security its clients log in with:
    /// the run's CA and, for `sasl_ssl`, the SCRAM-SHA-512 user, for `ssl`, the client
    /// certificate.
    pub(crate) async fn start_secured(
        security: SecuredMode,
    ) -> anyhow::Result<(Self, idem_kafka::KafkaSecurity)> {
        let broker = start_kafka(Some(security)).await?;
        let Broker::Kafka { dir, .. } = &broker else {
            bail!("scripts/kafka up started no broker");
        };
        let login = security.login(dir.path())?;
        Ok((broker, login))
    }

    /// Bootstrap servers for clients (and child processes).
    pub(crate) fn bootstrap(&self) -> String {
        match self {
            Broker::External(b) => b.clone(),
            Broker::Embedded(c) => c.bootstrap_servers(),
            Broker::Kafka { bootstrap, .. } => bootstrap.clone(),
        }
    }

    /// What it is, for reports.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Broker::External(_) => "external",
            Broker::Embedded(_) => "embedded (librdkafka mock cluster)",
            Broker::Kafka { .. } => "apache kafka (scripts/kafka, one node)",
        }
    }

    /// Creates `topic` with `partitions` partitions (replication 1: every broker here that
    /// this run starts has one node; an external cluster's own default is not assumed).
    pub(crate) async fn create_topic(&self, topic: &str, partitions: i32) -> anyhow::Result<()> {
        let conn = idem_kafka::Connection::plaintext(self.bootstrap());
        self.create_topic_over(&conn, topic, partitions).await
    }

    /// [`Broker::create_topic`] through `conn` (its servers and security).
    pub(crate) async fn create_topic_over(
        &self,
        conn: &idem_kafka::Connection,
        topic: &str,
        partitions: i32,
    ) -> anyhow::Result<()> {
        match self {
            Broker::Embedded(c) => c.create_topic(topic, partitions)?,
            _ => idem_kafka::ensure_topics_with(
                &conn.client_config(),
                &[topic.to_owned()],
                partitions,
                1,
            )
            .await
            .with_context(|| format!("creating topic {topic} on {}", conn.brokers()))?,
        }
        Ok(())
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Broker::Kafka { dir, .. } = self {
            // Blocks for the second or two the node takes to stop: it must not outlive the run.
            let stopped = std::process::Command::new(script())
                .args(["down", "--dir"])
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if !matches!(stopped, Ok(s) if s.success()) {
                tracing::warn!(dir = %dir.path().display(), "scripts/kafka down failed; a Kafka node may still run");
            }
        }
    }
}

/// How a broker that a lab command starts secures its client listener (`scripts/kafka
/// --security`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SecuredMode {
    /// TLS with client certificates required (mutual TLS).
    Ssl,
    /// SASL_SSL: SCRAM-SHA-512 (and PLAIN, SCRAM-SHA-256) over TLS.
    #[value(name = "sasl_ssl")]
    SaslSsl,
}

impl SecuredMode {
    /// `scripts/kafka --security`'s name.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SecuredMode::Ssl => "ssl",
            SecuredMode::SaslSsl => "sasl_ssl",
        }
    }

    /// The login of a client of the broker prepared in `dir`: its CA, and the client
    /// certificate (`ssl`) or the SCRAM-SHA-512 user of `dir/users` (`sasl_ssl`).
    fn login(self, dir: &Path) -> anyhow::Result<idem_kafka::KafkaSecurity> {
        use idem_kafka::{KafkaSecurity, SaslMechanism, Secret, SecurityProtocol};
        let pki = dir.join("pki");
        let mut security = KafkaSecurity {
            ca_file: Some(pki.join("ca.pem")),
            ..KafkaSecurity::default()
        };
        match self {
            SecuredMode::Ssl => {
                security.protocol = SecurityProtocol::Ssl;
                security.cert_file = Some(pki.join("client.pem"));
                security.key_file = Some(pki.join("client.key"));
            }
            SecuredMode::SaslSsl => {
                let mechanism = SaslMechanism::ScramSha512;
                let users = std::fs::read_to_string(dir.join("users"))
                    .context("reading the secured broker's users")?;
                let (user, password) = users
                    .lines()
                    .filter_map(|l| {
                        let mut f = l.split_whitespace();
                        Some((f.next()?, f.next()?, f.next()?))
                    })
                    .find(|(m, _, _)| *m == mechanism.as_str())
                    .map(|(_, u, p)| (u.to_owned(), Secret::new(p)))
                    .with_context(|| format!("the secured broker has no {mechanism} user"))?;
                security.protocol = SecurityProtocol::SaslSsl;
                security.mechanism = Some(mechanism);
                security.username = Some(user);
                security.password = Some(password);
            }
        }
        security.validate()?;
        Ok(security)
    }
}

async fn start_kafka(security: Option<SecuredMode>) -> anyhow::Result<Broker> {
    let dir = tempfile::Builder::new()
        .prefix("idem-kafka-")
        .tempdir()
        .context("creating the Kafka state directory")?;
    let script = script();
    let mut up = tokio::process::Command::new(&script);
    up.args(["up", "--nodes", "1", "--dir"]).arg(dir.path());
    if let Some(s) = security {
        up.args(["--security", s.as_str()]);
    }
    let out = up
        .stderr(Stdio::inherit())
        .output()
        .await
        .with_context(|| format!("running {}", script.display()))?;
    let bootstrap = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_owned();
    // From here on a node may run: dropping the value stops it, also on the error below.
    let broker = Broker::Kafka { bootstrap, dir };
    if !out.status.success() {
        bail!("{} up failed ({})", script.display(), out.status);
    }
    Ok(broker)
}
