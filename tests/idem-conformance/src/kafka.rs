//! Apache Kafka for end-to-end tests: the suite's shared single-node broker, and clusters of
//! their own for the tests that kill brokers.
//!
//! Both come from `scripts/kafka` (a pinned Apache Kafka 4.x from Maven Central, KRaft mode):
//!
//! * [`shared`] is the broker `scripts/test` starts for the whole suite, its bootstrap list in
//!   `IDEM_TEST_KAFKA`. Without that variable (a test run by hand), `scripts/kafka up` starts
//!   the same broker, or finds the one already running. Tests isolate themselves with unique
//!   topics and group ids ([`unique`]).
//! * [`secured`] is a single-node broker with a TLS (mutual TLS) or SASL_SSL (PLAIN, SCRAM,
//!   and OAUTHBEARER against the binary's own [`IdentityProvider`]) listener and a PKI made for
//!   the run, one per mode and test binary, killed when it exits.
//! * [`KafkaCluster`] is a cluster a test owns: `scripts/kafka prepare` writes each node's
//!   configuration and launch command, and the cluster runs every node as a child process that
//!   it can SIGKILL, SIGSTOP, SIGCONT and restart; dropping it kills them all.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::oidc::IdentityProvider;
use crate::process::Proc;

/// The repository's `scripts/kafka`.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/kafka")
}

/// Runs `scripts/kafka ARGS` and returns the last line it printed (the bootstrap list).
fn run_script(args: &[&str]) -> String {
    let out = Command::new(script())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run scripts/kafka: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "scripts/kafka {args:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// The suite's shared single-node broker (`IDEM_TEST_KAFKA`, else `scripts/kafka up`).
pub fn shared() -> String {
    static SHARED: OnceLock<String> = OnceLock::new();
    SHARED
        .get_or_init(|| match std::env::var("IDEM_TEST_KAFKA") {
            Ok(b) if !b.trim().is_empty() => b,
            _ => run_script(&["up", "--nodes", "1"]),
        })
        .clone()
}

/// A name no other test uses (topics, groups, prefixes): `prefix` and a random suffix.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// Waits until `brokers` reports `n` brokers, or panics after `timeout`.
pub fn wait_for_brokers(brokers: &str, n: usize, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        match idem_kafka::admin::broker_ids(
            &idem_kafka::admin::connection(brokers),
            Duration::from_secs(2),
        ) {
            Ok(ids) if ids.len() >= n => return,
            other => assert!(
                Instant::now() < deadline,
                "{brokers} did not report {n} brokers within {timeout:?}: {other:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Rewrites `key=value` lines of a properties file: each of `settings` replaces its key's line,
/// or is appended.
fn set_properties(file: &Path, settings: &[(&str, &str)]) {
    if settings.is_empty() {
        return;
    }
    let text = std::fs::read_to_string(file).unwrap();
    let mut lines: Vec<String> = text
        .lines()
        .filter(|l| {
            !settings
                .iter()
                .any(|(k, _)| l.split_once('=').is_some_and(|(lk, _)| lk.trim() == *k))
        })
        .map(str::to_owned)
        .collect();
    lines.extend(settings.iter().map(|(k, v)| format!("{k}={v}")));
    std::fs::write(file, lines.join("\n") + "\n").unwrap();
}

struct Node {
    id: i32,
    port: u16,
    argv: Vec<String>,
    proc: Option<Proc>,
}

/// A Kafka cluster of a test's own, every node a child process of the test.
pub struct KafkaCluster {
    nodes: Vec<Node>,
    bootstrap: String,
    _dir: tempfile::TempDir,
}

impl KafkaCluster {
    /// Prepares `n` nodes (1 or 3) with `scripts/kafka prepare`, starts them all and waits
    /// until the cluster reports every broker.
    pub fn start(n: usize) -> Self {
        Self::start_with(n, &[])
    }

    /// [`KafkaCluster::start`] with broker `settings` (`key`, `value`) replacing the prepared
    /// ones, e.g. `("auto.create.topics.enable", "false")` as production clusters run.
    pub fn start_with(n: usize, settings: &[(&str, &str)]) -> Self {
        Self::start_prepared(n, settings, 0)
    }

    /// [`KafkaCluster::start`] with `listeners` proxied listeners on every node (`scripts/kafka
    /// prepare --proxied-listeners`): their routes are in [`KafkaCluster::dir`]`/proxied/`,
    /// for the test's fault proxies to serve.
    pub fn start_proxied(n: usize, listeners: usize) -> Self {
        Self::start_prepared(n, &[], listeners)
    }

    fn start_prepared(n: usize, settings: &[(&str, &str)], proxied: usize) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("idem-kafka-")
            .tempdir()
            .unwrap();
        let path = dir.path().display().to_string();
        let bootstrap = run_script(&[
            "prepare",
            "--nodes",
            &n.to_string(),
            "--dir",
            &path,
            "--proxied-listeners",
            &proxied.to_string(),
        ]);
        for i in 1..=n {
            set_properties(
                &dir.path().join(format!("node{i}/server.properties")),
                settings,
            );
        }
        let nodes = (1..=n)
            .map(|i| {
                let node_dir = dir.path().join(format!("node{i}"));
                let read = |f: &str| {
                    std::fs::read_to_string(node_dir.join(f))
                        .unwrap_or_else(|e| panic!("{}/{f}: {e}", node_dir.display()))
                };
                Node {
                    id: i32::try_from(i).unwrap(),
                    port: read("port").trim().parse().unwrap(),
                    argv: read("argv")
                        .lines()
                        .filter(|l| !l.is_empty())
                        .map(str::to_owned)
                        .collect(),
                    proc: None,
                }
            })
            .collect();
        let mut cluster = KafkaCluster {
            nodes,
            bootstrap,
            _dir: dir,
        };
        for id in 1..=i32::try_from(n).unwrap() {
            cluster.spawn(id);
        }
        wait_for_brokers(&cluster.bootstrap, n, Duration::from_secs(120));
        cluster
    }

    fn node(&mut self, id: i32) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.id == id)
            .unwrap_or_else(|| panic!("no node {id}"))
    }

    fn spawn(&mut self, id: i32) {
        let node = self.node(id);
        let mut cmd = Command::new(&node.argv[0]);
        cmd.args(&node.argv[1..]);
        node.proc = Some(Proc::spawn(&format!("kafka-{id}"), cmd));
    }

    /// The directory `scripts/kafka prepare` wrote.
    pub fn dir(&self) -> &Path {
        self._dir.path()
    }

    /// The bootstrap list of every node.
    pub fn brokers(&self) -> &str {
        &self.bootstrap
    }

    /// `127.0.0.1:PORT` of node `id` alone.
    pub fn node_address(&self, id: i32) -> String {
        let port = self
            .nodes
            .iter()
            .find(|n| n.id == id)
            .map(|n| n.port)
            .unwrap_or_else(|| panic!("no node {id}"));
        format!("127.0.0.1:{port}")
    }

    /// The process id of node `id`, while it runs.
    pub fn pid(&mut self, id: i32) -> Option<u32> {
        self.node(id).proc.as_ref().map(Proc::pid)
    }

    /// SIGKILLs node `id` and waits until it is gone; returns how it ended (killed by signal 9).
    pub fn kill(&mut self, id: i32) -> std::process::ExitStatus {
        let mut proc = self
            .node(id)
            .proc
            .take()
            .unwrap_or_else(|| panic!("node {id} is not running"));
        proc.kill9()
    }

    /// SIGSTOPs node `id`.
    pub fn pause(&mut self, id: i32) {
        self.signal(id, "-STOP");
    }

    /// SIGCONTs node `id`.
    pub fn resume(&mut self, id: i32) {
        self.signal(id, "-CONT");
    }

    fn signal(&mut self, id: i32, sig: &str) {
        let pid = self
            .pid(id)
            .unwrap_or_else(|| panic!("node {id} is not running"));
        let status = Command::new("kill")
            .arg(sig)
            .arg(pid.to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill {sig} {pid} failed");
    }

    /// Starts node `id` again, with the storage it had (never reformatted).
    pub fn restart(&mut self, id: i32) {
        assert!(self.node(id).proc.is_none(), "node {id} is still running");
        self.spawn(id);
    }
}

/// How a [`SecuredKafka`] broker's client listener is secured (`scripts/kafka --security`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Security {
    /// TLS with `ssl.client.auth=required`: clients present a certificate (mutual TLS).
    Ssl,
    /// SASL_SSL with PLAIN, SCRAM-SHA-256 and SCRAM-SHA-512.
    SaslSsl,
    /// SASL_SSL with PLAIN, SCRAM and OAUTHBEARER: JWTs of the binary's [`IdentityProvider`],
    /// whose JWKS URL the broker reads at start.
    SaslSslOAuth,
}

impl Security {
    fn mode(self) -> &'static str {
        match self {
            Security::Ssl => "ssl",
            Security::SaslSsl => "sasl_ssl",
            Security::SaslSslOAuth => "sasl_ssl_oauth",
        }
    }
}

/// A single-node broker whose client listener is secured, made by `scripts/kafka prepare
/// --security` in a directory of its own, with a PKI and passwords made for the run. One per
/// mode and test binary ([`secured`]); it is killed, and its directory removed, when the test
/// binary exits (a watchdog shell holds the broker and waits on a pipe the binary keeps open).
pub struct SecuredKafka {
    bootstrap: String,
    dir: PathBuf,
    security: Security,
    idp: Option<IdentityProvider>,
    /// The watchdog shell and the write end of its stdin.
    _watchdog: std::sync::Mutex<(std::process::Child, std::process::ChildStdin)>,
}

/// The shared secured broker of this test binary for `security`, started on first use.
pub fn secured(security: Security) -> &'static SecuredKafka {
    static SSL: OnceLock<SecuredKafka> = OnceLock::new();
    static SASL_SSL: OnceLock<SecuredKafka> = OnceLock::new();
    static SASL_SSL_OAUTH: OnceLock<SecuredKafka> = OnceLock::new();
    let cell = match security {
        Security::Ssl => &SSL,
        Security::SaslSsl => &SASL_SSL,
        Security::SaslSslOAuth => &SASL_SSL_OAUTH,
    };
    cell.get_or_init(|| SecuredKafka::start(security))
}

impl SecuredKafka {
    fn start(security: Security) -> Self {
        let dir = std::env::temp_dir().join(unique(&format!("idem-kafka-{}", security.mode())));
        let path = dir.display().to_string();
        // The identity provider listens first: the broker fetches its JWKS at start.
        let idp = (security == Security::SaslSslOAuth)
            .then(|| IdentityProvider::start(&dir.join("oauth")));
        let mut args = vec![
            "prepare".to_owned(),
            "--nodes".to_owned(),
            "1".to_owned(),
            "--dir".to_owned(),
            path.clone(),
            "--security".to_owned(),
            security.mode().to_owned(),
        ];
        if let Some(idp) = &idp {
            args.extend(["--oauth-jwks-url".to_owned(), idp.jwks_url()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let bootstrap = run_script(&args);
        let argv: Vec<String> = std::fs::read_to_string(dir.join("node1/argv"))
            .unwrap_or_else(|e| panic!("{path}/node1/argv: {e}"))
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect();
        // The broker runs under a shell that kills it and removes DIR once its stdin (this
        // binary's end of the pipe) closes: when the test binary exits, however it exits.
        let mut child = Command::new("bash")
            .arg("-c")
            .arg(
                r#"dir="$1"; shift
"$@" </dev/null >>"$dir/node1/out.log" 2>&1 &
pid=$!
read -r _ || true
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
rm -rf -- "$dir""#,
            )
            .arg("watchdog")
            .arg(&dir)
            .args(&argv)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the secured broker: {e}"));
        let stdin = child.stdin.take().unwrap();
        let kafka = SecuredKafka {
            bootstrap,
            dir,
            security,
            idp,
            _watchdog: std::sync::Mutex::new((child, stdin)),
        };
        kafka.wait_ready(Duration::from_secs(120));
        kafka
    }

    fn wait_ready(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let conn = self.connection().client_config();
        loop {
            match idem_kafka::admin::broker_ids(&conn, Duration::from_secs(2)) {
                Ok(ids) if !ids.is_empty() => return,
                other => assert!(
                    Instant::now() < deadline,
                    "the {:?} broker at {} did not answer within {timeout:?}: {other:?}\n{}",
                    self.security,
                    self.bootstrap,
                    self.broker_log()
                ),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The bootstrap list of the secured listener (`127.0.0.1:PORT`).
    pub fn brokers(&self) -> &str {
        &self.bootstrap
    }

    /// The run's directory (`scripts/kafka prepare --security`'s layout).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A file of the run's PKI: `ca.pem`, `client.pem`, `client.key`, `expired.pem`,
    /// `expired.key`, `other-ca.pem`, …
    pub fn pki(&self, name: &str) -> PathBuf {
        self.dir.join("pki").join(name)
    }

    /// The user and password of `mechanism` (`PLAIN`, `SCRAM-SHA-256`, `SCRAM-SHA-512`).
    pub fn user(&self, mechanism: &str) -> (String, String) {
        let users = std::fs::read_to_string(self.dir.join("users"))
            .unwrap_or_else(|e| panic!("{}/users: {e}", self.dir.display()));
        users
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                Some((f.next()?, f.next()?, f.next()?))
            })
            .find(|(m, _, _)| *m == mechanism)
            .map(|(_, u, p)| (u.to_owned(), p.to_owned()))
            .unwrap_or_else(|| panic!("no {mechanism} user in {}/users", self.dir.display()))
    }

    /// The identity provider whose tokens the broker accepts ([`Security::SaslSslOAuth`]).
    pub fn identity_provider(&self) -> &IdentityProvider {
        self.idp
            .as_ref()
            .unwrap_or_else(|| panic!("the {:?} broker takes no OAUTHBEARER", self.security))
    }

    /// Denies `principal` (`User:…`) every operation on `topic` with an ACL
    /// (`scripts/kafka deny`).
    pub fn deny(&self, principal: &str, topic: &str) {
        let out = Command::new(script())
            .arg("deny")
            .arg(&self.dir)
            .args([principal, topic])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/kafka deny: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The broker's log (authorized requests with their principals, refused logins).
    pub fn broker_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("node1/broker.log")).unwrap_or_default()
    }

    /// How many lines of the broker's log authorize a `request` (`Produce`, `Fetch`,
    /// `CreateTopics`, …) of `principal` (`User:…`).
    pub fn authorized(&self, principal: &str, request: &str) -> usize {
        let needle = format!("Principal = {principal} is Allowed");
        let request = format!("for request = {request} ");
        self.broker_log()
            .lines()
            .filter(|l| l.contains(&needle) && l.contains(&request))
            .count()
    }

    /// A connection that the broker accepts: SCRAM-SHA-512 over TLS (SASL_SSL), or the client
    /// certificate (SSL); the run's CA in both.
    pub fn connection(&self) -> idem_kafka::Connection {
        let mut security = idem_kafka::KafkaSecurity {
            ca_file: Some(self.pki("ca.pem")),
            ..idem_kafka::KafkaSecurity::default()
        };
        match self.security {
            Security::Ssl => {
                security.protocol = idem_kafka::SecurityProtocol::Ssl;
                security.cert_file = Some(self.pki("client.pem"));
                security.key_file = Some(self.pki("client.key"));
            }
            Security::SaslSsl | Security::SaslSslOAuth => {
                let (user, password) = self.user("SCRAM-SHA-512");
                security.protocol = idem_kafka::SecurityProtocol::SaslSsl;
                security.mechanism = Some(idem_kafka::SaslMechanism::ScramSha512);
                security.username = Some(user);
                security.password = Some(idem_kafka::Secret::new(password));
            }
        }
        idem_kafka::Connection::new(self.bootstrap.clone(), security)
            .unwrap_or_else(|e| panic!("{e}"))
    }
}
