//! A secured Kafka node's login (`scripts/kafka prepare --security sasl_ssl`: a PKI and SCRAM
//! users made for the run): every Kafka client of the run — the components, the runner's own
//! admin, metadata and inspection clients — logs in with SCRAM-SHA-512 over TLS, trusting the
//! run's CA, its password in a file, never on a command line. Once every process has stopped,
//! every log of the run is searched for every password it used ([`search`]).

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use idem_kafka::{Connection, KafkaSecurity, SaslMechanism, Secret, SecurityProtocol};
use serde::Serialize;

/// The SASL mechanism of a secured run.
pub(crate) const MECHANISM: SaslMechanism = SaslMechanism::ScramSha512;

/// The login of a secured node's clients: its SCRAM user, the file holding the user's
/// password, the run's PKI, and every password the node's users have.
#[derive(Clone, Debug)]
pub(crate) struct KafkaLogin {
    /// The SCRAM user.
    pub user: String,
    /// The file holding its password (only its owner reads it).
    pub password_file: PathBuf,
    /// The run's CA (the broker's certificate's).
    pub ca: PathBuf,
    /// A certificate the CA signed (SAN IP:127.0.0.1), for a server of the run's, and its key.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The runner's own connection, logged in as [`KafkaLogin::user`].
    pub conn: Connection,
    /// The brokers' logs (`User:…` principals).
    broker_logs: Vec<PathBuf>,
    /// Every password of the node: the SCRAM and PLAIN users', the broker's own.
    pub secrets: Vec<Secret>,
}

impl KafkaLogin {
    /// The login to the node prepared in `kafka_dir` (`scripts/kafka prepare --security
    /// sasl_ssl`) at `bootstrap`; the password file goes to `secret_dir`.
    pub(crate) fn new(
        kafka_dir: &Path,
        bootstrap: &str,
        secret_dir: &Path,
    ) -> anyhow::Result<KafkaLogin> {
        let users = std::fs::read_to_string(kafka_dir.join("users"))
            .context("reading the prepared cluster's users")?;
        let mut secrets = vec![];
        let mut scram = None;
        for line in users.lines() {
            let mut f = line.split_whitespace();
            let (Some(mechanism), Some(user), Some(password)) = (f.next(), f.next(), f.next())
            else {
                continue;
            };
            secrets.push(Secret::new(password));
            if mechanism == MECHANISM.as_str() {
                scram = Some((user.to_owned(), Secret::new(password)));
            }
        }
        let Some((user, password)) = scram else {
            bail!("the prepared cluster has no {MECHANISM} user");
        };
        secrets.push(Secret::from_file(
            &kafka_dir.join("admin-password"),
            "broker's own password",
        )?);
        let password_file = secret_dir.join("kafka-password");
        write_secret(&password_file, password.expose())?;
        let pki = kafka_dir.join("pki");
        let ca = pki.join("ca.pem");
        let conn = Connection::new(
            bootstrap,
            KafkaSecurity {
                protocol: SecurityProtocol::SaslSsl,
                mechanism: Some(MECHANISM),
                username: Some(user.clone()),
                password: Some(password),
                ca_file: Some(ca.clone()),
                ..KafkaSecurity::default()
            },
        )?;
        let broker_logs = std::fs::read_dir(kafka_dir)
            .with_context(|| format!("listing {}", kafka_dir.display()))?
            .filter_map(Result::ok)
            .map(|e| e.path().join("broker.log"))
            .filter(|p| p.parent().is_some_and(Path::is_dir))
            .collect();
        Ok(KafkaLogin {
            user,
            password_file,
            ca,
            cert: pki.join("broker.pem"),
            key: pki.join("broker.key"),
            conn,
            broker_logs,
            secrets,
        })
    }

    /// How clients reached the node: `SASL_SSL SCRAM-SHA-512 as <user>`.
    pub(crate) fn described(&self) -> String {
        format!(
            "{} {} as {}",
            SecurityProtocol::SaslSsl,
            MECHANISM,
            self.user
        )
    }

    /// Whether a broker's log names the SCRAM principal (`User:<user>`): the broker
    /// authorized requests of that login.
    pub(crate) fn principal_logged(&self) -> bool {
        let principal = format!("User:{}", self.user);
        self.broker_logs
            .iter()
            .any(|log| std::fs::read_to_string(log).is_ok_and(|text| text.contains(&principal)))
    }
}

/// Makes `dir/secrets`, a folder only its owner enters.
pub(crate) fn secret_dir(dir: &Path) -> anyhow::Result<PathBuf> {
    let secret_dir = dir.join("secrets");
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&secret_dir)
        .with_context(|| format!("creating {}", secret_dir.display()))?;
    Ok(secret_dir)
}

/// Writes `value` to a new file only its owner can read.
pub(crate) fn write_secret(path: &Path, value: &str) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    writeln!(f, "{value}").with_context(|| format!("writing {}", path.display()))
}

/// The backends of the run's databases, as `pg_stat_ssl` showed them.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub(crate) struct Backends {
    /// Every backend.
    pub all: u64,
    /// Backends without TLS.
    pub in_clear: u64,
    /// Backends of another role than the run's.
    pub other_roles: u64,
}

/// The search of a run's logs for its secrets.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub(crate) struct LogSearch {
    /// Secrets searched for.
    pub secrets: usize,
    /// Log files searched.
    pub files: usize,
    /// Lines searched.
    pub lines: u64,
    /// Where a secret was found: `file:line` (the line itself is never repeated).
    pub hits: Vec<String>,
}

/// Searches every log under `dir` — the processes' logs, `faults.log`, `crashes.log`,
/// the brokers' logs — for each of `secrets`. The brokers' data and the
/// run's PKI and secret files are not logs and are left out.
pub(crate) fn search(dir: &Path, secrets: &[Secret]) -> LogSearch {
    let mut out = LogSearch {
        secrets: secrets.len(),
        ..LogSearch::default()
    };
    let mut files = vec![];
    logs_under(dir, &mut files);
    files.sort();
    for file in files {
        let Ok(bytes) = std::fs::read(&file) else {
            continue;
        };
        out.files += 1;
        let text = String::from_utf8_lossy(&bytes);
        let shown = file
            .strip_prefix(dir)
            .unwrap_or(&file)
            .display()
            .to_string();
        for (i, line) in text.lines().enumerate() {
            out.lines += 1;
            if secrets
                .iter()
                .any(|s| !s.expose().is_empty() && line.contains(s.expose()))
            {
                out.hits.push(format!("{shown}:{}", i + 1));
            }
        }
    }
    out
}

/// The log files under `dir` (`*.log`, `*.txt`), outside data, PKI and secret directories.
fn logs_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        let name = entry.file_name();
        if path.is_dir() {
            if !matches!(name.to_str(), Some("data" | "pki" | "secrets")) {
                logs_under(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "log" || e == "txt") {
            out.push(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_log_line_holding_a_secret_is_a_hit_named_by_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("relay-0.log"), "started\nlogin s3cr3t-a failed\n").unwrap();
        std::fs::create_dir_all(d.join("kafka/node1/data")).unwrap();
        std::fs::write(d.join("kafka/node1/broker.log"), "User:idem_scram\n").unwrap();
        // Not logs: the broker's data, the secret files.
        std::fs::write(d.join("kafka/node1/data/0.log"), "s3cr3t-b\n").unwrap();
        std::fs::create_dir_all(d.join("secrets")).unwrap();
        std::fs::write(d.join("secrets/orders.url"), "s3cr3t-a\n").unwrap();
        std::fs::write(d.join("faults.log"), "x s3cr3t-b y\nz\n").unwrap();
        let found = search(d, &[Secret::new("s3cr3t-a"), Secret::new("s3cr3t-b")]);
        assert_eq!(found.hits, ["faults.log:1", "relay-0.log:2"]);
        assert_eq!((found.secrets, found.files, found.lines), (2, 3, 5));
    }
}
