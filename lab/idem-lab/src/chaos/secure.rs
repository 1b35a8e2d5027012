//! `idem-lab chaos --tls`: the run secured end to end. Kafka is prepared with `scripts/kafka
//! prepare --security sasl_ssl` (a PKI and SCRAM users made for the run), and every Kafka
//! client — the relays, the consumers, the runner's own admin, metadata and inspection clients —
//! logs in with SCRAM-SHA-512 over TLS, trusting the run's CA. PostgreSQL is reached under
//! `sslmode=verify-full` as a password role that owns the run's databases (the user of `--db`
//! creates and drops them). The points API serves HTTPS with the run's certificate, which the
//! dispatcher trusts (`--ca-bundle`).
//!
//! Secrets reach the processes in files (`IDEM_DB_FILE`, `IDEM_KAFKA_SASL_PASSWORD_FILE`), never
//! on a command line. Once every process has stopped, every log of the run is searched for every
//! password it used ([`search`]): each hit fails the run, and so does a connection that was not
//! secured as it should be ([`shortfalls`]).

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use idem_kafka::{Connection, KafkaSecurity, SaslMechanism, Secret, SecurityProtocol};
use serde::Serialize;

use crate::demo::world::Databases;

/// The SASL mechanism of a secured run.
const MECHANISM: SaslMechanism = SaslMechanism::ScramSha512;

/// The role the processes reach PostgreSQL as, and its password.
#[derive(Clone, Debug)]
pub(super) struct DbRole {
    /// The role's name (an SQL identifier: letters, digits, `_`).
    pub name: String,
    password: Secret,
}

impl DbRole {
    /// Role `name` with the password held in `password_file` (one trailing newline dropped).
    pub(super) fn new(name: &str, password_file: &Path) -> anyhow::Result<DbRole> {
        let identifier = name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !identifier {
            bail!(
                "--tls-db-role {name:?} is not a plain role name: use letters, digits and _ only"
            );
        }
        let password = Secret::from_file(password_file, "database role's password")?;
        Ok(DbRole {
            name: name.to_owned(),
            password,
        })
    }

    /// The URL of this role on database `db` of the server of `admin` (its host, port and query
    /// parameters: `sslmode`, `sslrootcert`), the password percent-encoded in it.
    pub(super) fn url(&self, admin: &str, db: &str) -> anyhow::Result<String> {
        let server = idem_sql::postgres::PgUrl::parse(admin)?;
        let host = if server.host.contains(':') {
            format!("[{}]", server.host)
        } else {
            server.host.clone()
        };
        let query = admin
            .split_once('?')
            .map(|(_, q)| format!("?{q}"))
            .unwrap_or_default();
        Ok(format!(
            "postgres://{}:{}@{host}:{}/{db}{query}",
            self.name,
            percent_encoded(self.password.expose()),
            server.port
        ))
    }
}

/// `s` with every byte but ASCII letters and digits percent-encoded (a URL's user part).
fn percent_encoded(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Refuses a `--db` that `--tls` cannot use: it must verify the server fully.
pub(super) fn check_admin_url(admin: &str) -> anyhow::Result<()> {
    let url = idem_sql::postgres::PgUrl::parse(admin)?;
    if url.tls.mode != idem_sql::postgres::SslMode::VerifyFull {
        bail!(
            "with --tls, --db {} must use sslmode=verify-full (and sslrootcert=<the server's CA>): \
             the run's databases are created over it",
            url.redacted()
        );
    }
    Ok(())
}

/// What the processes of a secured run are given, and what the run checks afterwards.
#[derive(Clone, Debug)]
pub(super) struct Secured {
    /// The `IDEM_KAFKA_*` settings of the processes that use Kafka (the password in a file).
    pub kafka_env: Vec<(&'static str, String)>,
    /// The files holding the orders, settlement and points URLs (with the role's password):
    /// each process's `IDEM_DB_FILE`.
    pub db_files: [PathBuf; 3],
    /// The run's CA (the broker's and the points API's certificates).
    pub ca: PathBuf,
    /// The points API's certificate and key (SAN IP:127.0.0.1).
    pub api_cert: PathBuf,
    /// The key of [`Secured::api_cert`].
    pub api_key: PathBuf,
    /// The SCRAM user.
    pub scram_user: String,
    /// The PostgreSQL role.
    pub db_role: String,
    /// The brokers' logs (`User:…` principals).
    broker_logs: Vec<PathBuf>,
    /// Every password of the run: the role's, the SCRAM and PLAIN users', the broker's own.
    secrets: Vec<Secret>,
}

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

    /// The `IDEM_KAFKA_*` settings of an idem process that logs in so.
    pub(crate) fn idem_env(&self) -> Vec<(&'static str, String)> {
        vec![
            (
                "IDEM_KAFKA_SECURITY_PROTOCOL",
                SecurityProtocol::SaslSsl.as_str().to_owned(),
            ),
            ("IDEM_KAFKA_SASL_MECHANISM", MECHANISM.as_str().to_owned()),
            ("IDEM_KAFKA_SASL_USERNAME", self.user.clone()),
            (
                "IDEM_KAFKA_SASL_PASSWORD_FILE",
                self.password_file.display().to_string(),
            ),
            ("IDEM_KAFKA_SSL_CA", self.ca.display().to_string()),
        ]
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

impl Secured {
    /// The secured run over the Kafka prepared in `kafka_dir` (`scripts/kafka prepare
    /// --security sasl_ssl`) and the databases `urls` of `role`; its secret files go to
    /// `dir/secrets`. Returns it and the runner's own Kafka connection.
    pub(super) fn new(
        kafka_dir: &Path,
        bootstrap: &str,
        dir: &Path,
        urls: &[String; 3],
        role: &DbRole,
    ) -> anyhow::Result<(Secured, Connection)> {
        let secret_dir = secret_dir(dir)?;
        let login = KafkaLogin::new(kafka_dir, bootstrap, &secret_dir)?;
        let mut db_files = Vec::new();
        for (name, url) in ["orders", "settlement", "points"].iter().zip(urls) {
            let file = secret_dir.join(format!("{name}.url"));
            write_secret(&file, url)?;
            db_files.push(file);
        }
        let mut secrets = vec![role.password.clone()];
        secrets.extend(login.secrets.iter().cloned());
        let secured = Secured {
            kafka_env: login.idem_env(),
            db_files: db_files
                .try_into()
                .map_err(|_| anyhow::anyhow!("three database files"))?,
            ca: login.ca.clone(),
            api_cert: login.cert.clone(),
            api_key: login.key.clone(),
            scram_user: login.user.clone(),
            db_role: role.name.clone(),
            broker_logs: login.broker_logs.clone(),
            secrets,
        };
        Ok((secured, login.conn))
    }

    /// The backends on the run's databases now: how many, how many in clear, how many not of
    /// the run's role (`pg_stat_ssl`, read as the role: it sees its own backends' TLS state).
    pub(super) async fn backends(&self, dbs: &Databases) -> anyhow::Result<Backends> {
        let sql = "SELECT count(*)::bigint, \
                          count(*) FILTER (WHERE s.ssl IS NOT TRUE)::bigint, \
                          count(*) FILTER (WHERE a.usename IS DISTINCT FROM $1)::bigint \
                   FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
                   WHERE a.datname = current_database()";
        let mut seen = Backends::default();
        for pool in [&dbs.orders, &dbs.settlement, &dbs.points] {
            let idem_sql::AnyPool::Postgres(pool) = pool else {
                bail!("chaos runs on PostgreSQL only");
            };
            let (all, clear, other): (i64, i64, i64) = sqlx::query_as(sql)
                .bind(&self.db_role)
                .fetch_one(pool)
                .await
                .context("reading pg_stat_ssl")?;
            seen.all += u64::try_from(all)?;
            seen.in_clear += u64::try_from(clear)?;
            seen.other_roles += u64::try_from(other)?;
        }
        Ok(seen)
    }

    /// Whether a broker's log names the SCRAM principal (`User:<user>`): the broker
    /// authorized requests of that login.
    pub(super) fn principal_logged(&self) -> bool {
        let principal = format!("User:{}", self.scram_user);
        self.broker_logs
            .iter()
            .any(|log| std::fs::read_to_string(log).is_ok_and(|text| text.contains(&principal)))
    }

    /// The report of the secured run: what was secured how, what `pg_stat_ssl` showed, and
    /// the search of every log in `dir` for every password of the run.
    pub(super) fn report(
        &self,
        kafka: &Connection,
        api: &str,
        backends: Backends,
        dir: &Path,
    ) -> Tls {
        Tls {
            kafka: format!(
                "{} {} as {}",
                kafka.security().protocol,
                MECHANISM,
                self.scram_user
            ),
            postgres: format!("verify-full as {}", self.db_role),
            points_api: api.to_owned(),
            scram_principal_logged: self.principal_logged(),
            pg_backends: backends,
            secret_search: search(dir, &self.secrets),
        }
    }
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

/// What a secured run reports.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub(crate) struct Tls {
    /// How Kafka was reached: `SASL_SSL SCRAM-SHA-512 as <user>`.
    pub kafka: String,
    /// How PostgreSQL was reached: `verify-full as <role>`.
    pub postgres: String,
    /// The points API the dispatcher called (`https://…`).
    pub points_api: String,
    /// The broker's log names the SCRAM principal (`User:<user>`).
    pub scram_principal_logged: bool,
    /// The backends on the run's databases before the processes stopped.
    pub pg_backends: Backends,
    /// Every log of the run searched for every password of the run.
    pub secret_search: LogSearch,
}

/// Why a secured run's connections or logs fail it; none: secured as it should be.
pub(super) fn shortfalls(tls: &Tls) -> Vec<String> {
    let mut out = vec![];
    let b = tls.pg_backends;
    if b.all == 0 {
        out.push("no backend of the run was seen in pg_stat_ssl".to_owned());
    }
    if b.in_clear > 0 {
        out.push(format!(
            "{} PostgreSQL backend(s) of the run in clear",
            b.in_clear
        ));
    }
    if b.other_roles > 0 {
        out.push(format!(
            "{} PostgreSQL backend(s) of the run not connected as the run's role",
            b.other_roles
        ));
    }
    if !tls.scram_principal_logged {
        out.push("the broker's log never names the SCRAM principal".to_owned());
    }
    if let Some(first) = tls.secret_search.hits.first() {
        out.push(format!(
            "a password of the run in the logs: {} line(s), first at {first}",
            tls.secret_search.hits.len()
        ));
    }
    out
}

/// Searches every log under `dir` — the processes' logs, `faults.log`, `crashes.log`,
/// `diagnosis.txt`, the brokers' logs — for each of `secrets`. The brokers' data and the
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

    #[test]
    fn the_roles_url_keeps_the_servers_tls_parameters_and_encodes_the_password() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "a:b@c/d\n").unwrap();
        let role = DbRole::new("idem_tls", &file).unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "").unwrap();
        let params = format!("sslmode=verify-full&sslrootcert={}", ca.display());
        let admin = format!("postgres://postgres@127.0.0.1:5432/postgres?{params}");
        let url = role.url(&admin, "idem_demo_x_orders").unwrap();
        assert_eq!(
            url,
            format!("postgres://idem_tls:a%3Ab%40c%2Fd@127.0.0.1:5432/idem_demo_x_orders?{params}")
        );
        let parsed = idem_sql::postgres::PgUrl::parse(&url).unwrap();
        assert_eq!(parsed.password(), Some("a:b@c/d"));
        assert!(check_admin_url(&admin).is_ok());
        let plain = check_admin_url("postgres://postgres@127.0.0.1:5432/postgres").unwrap_err();
        assert!(plain.to_string().contains("sslmode=verify-full"), "{plain}");
        assert!(DbRole::new("x; DROP", &file).is_err());
    }

    #[test]
    fn a_run_is_secured_only_with_every_backend_encrypted_the_principal_seen_and_no_hit() {
        let tls = |backends: Backends, logged: bool, hits: &[&str]| Tls {
            kafka: String::new(),
            postgres: String::new(),
            points_api: String::new(),
            scram_principal_logged: logged,
            pg_backends: backends,
            secret_search: LogSearch {
                hits: hits.iter().map(|h| (*h).to_owned()).collect(),
                ..LogSearch::default()
            },
        };
        let good = Backends {
            all: 9,
            ..Backends::default()
        };
        assert!(shortfalls(&tls(good, true, &[])).is_empty());
        assert_eq!(shortfalls(&tls(good, false, &[])).len(), 1);
        assert_eq!(shortfalls(&tls(good, true, &["a.log:1"])).len(), 1);
        assert_eq!(shortfalls(&tls(Backends::default(), true, &[])).len(), 1);
        let clear = Backends {
            in_clear: 1,
            other_roles: 1,
            ..good
        };
        assert_eq!(shortfalls(&tls(clear, true, &[])).len(), 2);
    }
}
