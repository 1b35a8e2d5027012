//! The run's topology: which processes the pipeline is made of and their command lines (pure,
//! [`specs`]), then spawning them as supervised children and starting them in order: the
//! brokers, the topic, everything else.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::Context;

use super::kafka;
use super::procs::{Proc, Role};
use super::secure::Secured;
use super::windows;

/// What the processes of a run connect to.
#[derive(Clone, Debug)]
pub(super) struct Topology {
    /// The orders database (writers, relays).
    pub orders_url: String,
    /// The settlement database (consumers, dispatcher).
    pub settle_url: String,
    /// The points database (points API).
    pub points_url: String,
    /// The points API's port.
    pub api_port: u16,
    /// The brokers' bootstrap address.
    pub brokers: String,
    /// The brokers' bootstrap address and security, for the runner's own Kafka clients.
    pub kafka: idem_kafka::Connection,
    /// The relays' topic prefix.
    pub prefix: String,
    /// The topic the consumers read.
    pub topic: String,
    /// Orders per second, per writer.
    pub rate: f64,
    /// The `kafka-transactions` negative control: settlement consumers without an inbox.
    pub kafka_transactions: bool,
    /// The slot of CDC relays (`--cdc`); `None`: polling relays.
    pub cdc_slot: Option<String>,
    /// `--tls`: what the processes are secured with.
    pub secure: Option<Secured>,
}

impl Topology {
    /// The topic of the burst written before the relays start (no consumer reads it).
    pub(super) fn burst_topic(&self) -> String {
        format!("{}{}", self.prefix, super::burst::AGGREGATE_TYPE)
    }

    /// The crash points of this run's pipeline.
    pub(super) fn points(&self) -> &'static [idem_core::crash::CrashPoint] {
        super::schedule::run_points(self.cdc_slot.is_some())
    }

    /// The points API's base URL: HTTPS in a secured run.
    pub(super) fn api_base(&self) -> String {
        let scheme = if self.secure.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://127.0.0.1:{}", self.api_port)
    }
}

/// One process to supervise: `{n}` in its arguments becomes its incarnation.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Spec {
    /// Its role.
    pub role: Role,
    /// Its name (and its log's).
    pub name: String,
    /// The `idem-lab` arguments.
    pub argv: Vec<String>,
    /// Its environment, beside the run's (a secured run's settings and secret files).
    pub env: Vec<(&'static str, String)>,
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| (*x).to_owned()).collect()
}

/// The pipeline's processes, brokers aside, in the order the schedule indexes them: the points
/// API, two order writers, two relays, two settlement consumers, the audit consumer, the effect
/// dispatcher. In a secured run each is then [`secured`].
pub(super) fn specs(t: &Topology) -> Vec<Spec> {
    let spec = |role, name: String, argv| Spec {
        role,
        name,
        argv,
        env: vec![],
    };
    let listen = format!("127.0.0.1:{}", t.api_port);
    let mut out = vec![spec(
        Role::Api,
        "points-api".to_owned(),
        strings(&["points-api", "--db", &t.points_url, "--listen", &listen]),
    )];
    for i in 0..2 {
        out.push(spec(Role::Writer, format!("writer-{i}"), writer(t, i)));
    }
    for i in 0..2 {
        out.push(spec(Role::Relay, format!("relay-{i}"), relay(t)));
    }
    for i in 0..2 {
        let member = format!("settlement-{i}");
        let argv = consumer(t, "settlement", "settlement", &member);
        out.push(spec(Role::Settlement, member, argv));
    }
    out.push(spec(
        Role::Audit,
        "audit".to_owned(),
        consumer(t, "audit", "audit", "audit-0"),
    ));
    out.push(spec(
        Role::Dispatcher,
        "dispatcher".to_owned(),
        dispatcher(t),
    ));
    match &t.secure {
        Some(s) => out.into_iter().map(|spec| secured(spec, s)).collect(),
        None => out,
    }
}

/// A process of a secured run: its database URL (which holds the role's password) in a file
/// (`IDEM_DB_FILE`) instead of `--db`, the Kafka clients with the run's SASL_SSL settings (the
/// password in a file too), the points API serving HTTPS, the dispatcher trusting the run's CA.
fn secured(mut spec: Spec, s: &Secured) -> Spec {
    if let Some(i) = spec.argv.iter().position(|a| a == "--db") {
        spec.argv.drain(i..(i + 2).min(spec.argv.len()));
    }
    let db = match spec.role {
        Role::Api => &s.db_files[2],
        Role::Writer | Role::Relay | Role::Broker | Role::Component => &s.db_files[0],
        Role::Settlement | Role::Audit | Role::Dispatcher => &s.db_files[1],
    };
    spec.env.push(("IDEM_DB_FILE", db.display().to_string()));
    match spec.role {
        Role::Relay | Role::Settlement | Role::Audit => spec.env.extend(s.kafka_env.clone()),
        Role::Api => spec.argv.extend([
            "--tls-cert".to_owned(),
            s.api_cert.display().to_string(),
            "--tls-key".to_owned(),
            s.api_key.display().to_string(),
        ]),
        Role::Dispatcher => {
            spec.argv
                .extend(["--ca-bundle".to_owned(), s.ca.display().to_string()]);
        }
        Role::Writer | Role::Broker | Role::Component => {}
    }
    spec
}

fn writer(t: &Topology, i: usize) -> Vec<String> {
    let mut argv = strings(&[
        "orders",
        "--db",
        &t.orders_url,
        "--count",
        "100000000",
        "--rate",
        &t.rate.to_string(),
        "--prefix",
        &format!("w{i}-{{n}}-"),
    ]);
    if i == 1 {
        // Slow transactions: rows committed after rows with higher ids.
        argv.extend(strings(&["--slow-every", "5", "--slow", "400ms"]));
    }
    argv
}

/// A relay: the polling relay, or with `--cdc` a CDC relay on the run's slot.
fn relay(t: &Topology) -> Vec<String> {
    let mut argv = match &t.cdc_slot {
        Some(slot) => strings(&["cdc", "relay", "--slot", slot, "--publication", slot]),
        // A claim plus one publish (2 × 2 s) must fit: claims under load take seconds. The
        // hostile row of a missing topic is parked at the first turn of a relay that saw it
        // fail --unwritable-topic-grace earlier: backoffs of at most 5 s give the two relays
        // enough turns to park it well inside the settle bound.
        None => strings(&[
            "relay",
            "--retry-backoff-max",
            "5s",
            "--lease",
            "8s",
            "--batch-size",
            "100",
            "--no-prune",
        ]),
    };
    argv.extend(strings(&[
        "--db",
        &t.orders_url,
        "--brokers",
        &t.brokers,
        "--topic-prefix",
        &t.prefix,
        "--producer-config",
        "message.timeout.ms=2000",
        // The hostile topic that does not exist is parked within the run.
        "--unwritable-topic-grace",
        "10s",
        "--metrics-addr",
        "127.0.0.1:0",
    ]));
    argv
}

/// A consumer of `group` with `handler`. Static group membership: a restarted consumer takes
/// its predecessor's place (and partitions) in the group at once, instead of waiting for a dead
/// member to expire. The kafka-transactions control replaces the settlement group's consumers
/// (not the audit group's) with one that has no inbox and commits offsets in Kafka transactions.
fn consumer(t: &Topology, group: &str, handler: &str, member: &str) -> Vec<String> {
    let settlement = handler == "settlement";
    let mut v = strings(&[
        "--db",
        &t.settle_url,
        "--brokers",
        &t.brokers,
        "--group",
        group,
        "--topic",
        &t.topic,
    ]);
    if t.kafka_transactions && settlement {
        v.insert(0, "kafka-txn-settlement".to_owned());
    } else {
        v.insert(0, "settlement".to_owned());
        v.extend(strings(&[
            "--handler",
            handler,
            "--metrics-addr",
            "127.0.0.1:0",
        ]));
        if settlement {
            // The long-lock window: a locked settlements table fails handlers fast.
            v.extend(strings(&["--lock-timeout", windows::LOCK_TIMEOUT]));
        }
    }
    v.extend(strings(&[
        "--batch-size",
        "50",
        "--consumer-config",
        "session.timeout.ms=10000",
        "--consumer-config",
        "max.poll.interval.ms=10000",
        "--consumer-config",
        "heartbeat.interval.ms=1000",
        "--consumer-config",
        &format!("group.instance.id={member}"),
    ]));
    if settlement {
        let target = format!("{}/awards", t.api_base());
        v.extend(strings(&["--points-url", &target]));
    }
    v
}

fn dispatcher(t: &Topology) -> Vec<String> {
    strings(&[
        "effects",
        "dispatch",
        "--db",
        &t.settle_url,
        "--authorization",
        "Bearer settlement",
        "--timeout",
        "2s",
        // Spare capacity: in a slow window a slow award holds its claim until the timeout,
        // and its retry must not queue behind a backlog (windows.rs).
        "--concurrency",
        "64",
        "--metrics-addr",
        "127.0.0.1:0",
    ])
}

/// This binary with `args` and `env`, and none of the lab's fault variables inherited.
fn idem_cmd(args: &[&str], env: &[(&str, String)]) -> anyhow::Result<Command> {
    let mut cmd = Command::new(std::env::current_exe().context("locating the idem binary")?);
    cmd.args(args)
        .env("RUST_LOG", "warn,idem=info")
        .env_remove("IDEM_CRASH_POINTS")
        .env_remove("IDEM_LAB_AWARD_DELAY")
        .env_remove("IDEM_POINTS_KEY_LOCK")
        .env_remove("IDEM_LAB_SLOW_ONE_IN");
    for (k, v) in env {
        cmd.env(k, v);
    }
    Ok(cmd)
}

/// A supervised process of `spec`, every incarnation with `env`.
pub(super) fn spawn(
    spec: Spec,
    dir: &Path,
    env: &[(&'static str, String)],
) -> anyhow::Result<Proc> {
    // Fail now on an unusable binary path rather than inside the closure.
    idem_cmd(&[], &[])?;
    let Spec {
        role,
        name,
        argv,
        env: own,
    } = spec;
    let mut env = env.to_vec();
    env.extend(own);
    Ok(Proc::new(
        role,
        name,
        dir,
        Box::new(move |n| {
            let argv: Vec<String> = argv
                .iter()
                .map(|a| a.replace("{n}", &n.to_string()))
                .collect();
            let refs: Vec<&str> = argv.iter().map(String::as_str).collect();
            idem_cmd(&refs, &env).unwrap_or_else(|_| Command::new("false"))
        }),
    ))
}

/// Starts the brokers, waits for them, creates the topics (the events' and the burst's,
/// replicated as production topics should be: min(3, nodes) copies), then starts everything
/// else.
pub(super) async fn start(
    procs: &mut [Proc],
    t: &Topology,
    nodes: usize,
    dir: &Path,
) -> anyhow::Result<()> {
    for p in procs.iter_mut().filter(|p| p.role == Role::Broker) {
        p.start(&[])?;
    }
    kafka::wait_ready(&t.kafka, nodes, Duration::from_secs(120))
        .await
        .with_context(|| format!("starting Kafka (see {})", dir.display()))?;
    let replication = i32::try_from(nodes.min(3))?;
    let topics = [t.topic.clone(), t.burst_topic()];
    idem_kafka::ensure_topics_with(&t.kafka.client_config(), &topics, 4, replication)
        .await
        .context("creating the topics")?;
    for p in procs.iter_mut().filter(|p| p.role != Role::Broker) {
        p.start(&[])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topology(kafka_transactions: bool) -> Topology {
        Topology {
            orders_url: "postgres://o".to_owned(),
            settle_url: "postgres://s".to_owned(),
            points_url: "postgres://p".to_owned(),
            api_port: 4000,
            brokers: "127.0.0.1:9092".to_owned(),
            kafka: idem_kafka::Connection::plaintext("127.0.0.1:9092"),
            prefix: "chaos-r.".to_owned(),
            topic: "chaos-r.order".to_owned(),
            rate: 25.0,
            kafka_transactions,
            cdc_slot: None,
            secure: None,
        }
    }

    #[test]
    fn the_pipeline_is_nine_processes_in_the_schedules_order() {
        let names: Vec<String> = specs(&topology(false))
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(
            names,
            [
                "points-api",
                "writer-0",
                "writer-1",
                "relay-0",
                "relay-1",
                "settlement-0",
                "settlement-1",
                "audit",
                "dispatcher"
            ]
        );
    }

    /// A secured run's processes with their settings: a fake prepared cluster's users and CA,
    /// and the role URLs `urls`.
    fn secured_topology(dir: &Path, urls: &[String; 3]) -> Topology {
        let kafka_dir = dir.join("kafka");
        std::fs::create_dir_all(kafka_dir.join("pki")).unwrap();
        std::fs::create_dir_all(kafka_dir.join("node1")).unwrap();
        std::fs::write(
            kafka_dir.join("users"),
            "PLAIN idem_plain pw-plain\nSCRAM-SHA-512 idem_scram pw-scram\n",
        )
        .unwrap();
        std::fs::write(kafka_dir.join("admin-password"), "pw-admin\n").unwrap();
        std::fs::write(
            kafka_dir.join("pki/ca.pem"),
            "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let password = dir.join("db-password");
        std::fs::write(&password, "pw-db\n").unwrap();
        let role = super::super::secure::DbRole::new("idem_tls", &password).unwrap();
        let (secure, kafka) = Secured::new(&kafka_dir, "127.0.0.1:9093", dir, urls, &role).unwrap();
        Topology {
            kafka,
            secure: Some(secure),
            ..topology(false)
        }
    }

    #[test]
    fn a_secured_run_keeps_every_secret_off_the_command_lines() {
        let dir = tempfile::tempdir().unwrap();
        let urls = ["orders", "settlement", "points"]
            .map(|db| format!("postgres://idem_tls:pw-db@127.0.0.1:5432/{db}?sslmode=verify-full"));
        let t = secured_topology(dir.path(), &urls);
        let specs = specs(&t);
        for s in &specs {
            for a in &s.argv {
                assert!(
                    !a.contains("pw-"),
                    "{}: a secret on the command line: {a}",
                    s.name
                );
            }
            assert!(!s.argv.contains(&"--db".to_owned()), "{}", s.name);
            let (_, file) = s.env.iter().find(|(k, _)| *k == "IDEM_DB_FILE").unwrap();
            let db = match s.role {
                Role::Api => "points",
                Role::Writer | Role::Relay => "orders",
                _ => "settlement",
            };
            let url = std::fs::read_to_string(file).unwrap();
            assert!(url.contains(&format!("/{db}?")), "{}: {url}", s.name);
            let kafka = s.env.iter().any(|(k, _)| k.starts_with("IDEM_KAFKA_"));
            let client = matches!(s.role, Role::Relay | Role::Settlement | Role::Audit);
            assert_eq!(kafka, client, "{}", s.name);
        }
        let by_name = |n: &str| specs.iter().find(|s| s.name == n).unwrap();
        let password_file = &by_name("relay-0")
            .env
            .iter()
            .find(|(k, _)| *k == "IDEM_KAFKA_SASL_PASSWORD_FILE")
            .unwrap()
            .1;
        assert_eq!(
            std::fs::read_to_string(password_file).unwrap(),
            "pw-scram\n"
        );
        assert!(
            by_name("points-api")
                .argv
                .contains(&"--tls-cert".to_owned())
        );
        assert!(
            by_name("dispatcher")
                .argv
                .contains(&"--ca-bundle".to_owned())
        );
        assert!(
            by_name("settlement-0")
                .argv
                .contains(&"https://127.0.0.1:4000/awards".to_owned())
        );
    }

    #[test]
    fn kafka_transactions_replace_the_settlement_consumers_only() {
        let specs = specs(&topology(true));
        let command = |name: &str| {
            let s = specs
                .iter()
                .find(|s| s.name == name)
                .expect("in the topology");
            s.argv[0].clone()
        };
        assert_eq!(command("settlement-0"), "kafka-txn-settlement");
        assert_eq!(command("settlement-1"), "kafka-txn-settlement");
        assert_eq!(command("audit"), "settlement");
    }

    #[test]
    fn settlement_consumers_award_points_and_keep_their_place_in_the_group() {
        let specs = specs(&topology(false));
        let s = &specs[5].argv;
        assert!(
            s.windows(2)
                .any(|w| w == ["--points-url", "http://127.0.0.1:4000/awards"])
        );
        assert!(s.contains(&"group.instance.id=settlement-0".to_owned()));
        assert!(!specs[7].argv.contains(&"--points-url".to_owned()));
        // Writers name orders by incarnation.
        assert!(specs[1].argv.contains(&"w0-{n}-".to_owned()));
    }
}
