//! Apache Kafka for end-to-end tests: the suite's shared single-node broker, and clusters of
//! their own for the tests that kill brokers.
//!
//! Both come from `scripts/kafka` (a pinned Apache Kafka 4.x from Maven Central, KRaft mode):
//!
//! * [`shared`] is the broker `scripts/test` starts for the whole suite, its bootstrap list in
//!   `IDEM_TEST_KAFKA`. Without that variable (a test run by hand), `scripts/kafka up` starts
//!   the same broker, or finds the one already running. Tests isolate themselves with unique
//!   topics and group ids ([`unique`]).
//! * [`KafkaCluster`] is a cluster a test owns: `scripts/kafka prepare` writes each node's
//!   configuration and launch command, and the cluster runs every node as a child process that
//!   it can SIGKILL, SIGSTOP, SIGCONT and restart; dropping it kills them all.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

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
        let dir = tempfile::Builder::new()
            .prefix("idem-kafka-")
            .tempdir()
            .unwrap();
        let path = dir.path().display().to_string();
        let bootstrap = run_script(&["prepare", "--nodes", &n.to_string(), "--dir", &path]);
        let nodes = (1..=n)
            .map(|i| {
                let node_dir = dir.path().join(format!("node{i}"));
                let read = |f: &str| {
                    std::fs::read_to_string(node_dir.join(f))
                        .unwrap_or_else(|e| panic!("{}/{f}: {e}", node_dir.display()))
                };
                Node {
                    id: i as i32,
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
        for id in 1..=n as i32 {
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
