//! `idem-lab chaos --pipeline`: the runner on a pipeline described by a file, as a team
//! describes its own — two databases, a Kafka node the runner starts, components as command
//! lines with readiness checks, a load, and a verify config. A run with every fault kind must
//! pass with nothing lost or doubled; the same pipeline with a consumer that commits offsets
//! before its database must fail, with each loss located. The consumers are the lab's, and
//! `examples/python-consumer` (kafka-python and psycopg, no idem). The reference pipeline
//! file (`pipelines/reference`) passes with its crash points armed, and fails with each
//! mechanism it can break broken (`--break`): the negative controls. Over databases of the
//! tests' own server, it leaves them for the operator console, opened over them in a real
//! browser: its pages show what the run left, and are saved as screenshots.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use idem_conformance::pg::TestDb;
use idem_conformance::ports::lease::Owner;

mod support;
use support::controls;

/// The pipeline: order writers (the load), two polling relays, and `consumers` (a
/// `[[component]]` reading `shop.order` into database `target`). `aimed`: the network faults
/// go to the consumers alone (the relays and writers take signals only). `copies`: the runner
/// produces copies of recent records (which can also deliver a lost event again and hide its
/// loss).
fn pipeline(orders: &str, target: &str, consumers: &str, aimed: bool, copies: bool) -> String {
    let lab = env!("CARGO_BIN_EXE_idem-lab");
    let (relay_faults, writer_faults) = if aimed {
        (r#"["kill", "pause", "restart"]"#, r#"["kill"]"#)
    } else {
        (
            r#"["kill", "pause", "restart", "network"]"#,
            r#"["kill", "network"]"#,
        )
    };
    format!(
        r#"
[databases]
orders = "{orders}"
target = "{target}"

[kafka]
nodes = 1
topics = ["shop.order"]
redeliver = {copies}

[[component]]
name = "relay"
replicas = 2
command = ["{lab}", "relay", "--db", "{{db.orders}}", "--brokers", "{{kafka}}",
           "--topic-prefix", "shop.", "--lease", "8s", "--retry-backoff-max", "5s",
           "--producer-config", "message.timeout.ms=2000", "--metrics-addr", "127.0.0.1:0"]
env = {{ RUST_LOG = "warn,idem=info" }}
ready = {{ log = "metrics on http://" }}
faults = {relay_faults}
{consumers}
[[load]]
name = "writer"
replicas = 2
command = ["{lab}", "orders", "--db", "{{db.orders}}", "--count", "100000000",
           "--rate", "40", "--prefix", "w{{replica}}-{{incarnation}}-"]
faults = {writer_faults}

[verify]
config = "verify.toml"
"#
    )
}

/// Two consumers of the `audit` group, the lab's (each event adds an `audit_log` row), with
/// `env` added to their environment.
fn audit_consumers(env: &str) -> String {
    let lab = env!("CARGO_BIN_EXE_idem-lab");
    format!(
        r#"
[[component]]
name = "consumer"
replicas = 2
command = ["{lab}", "settlement", "--db", "{{db.target}}", "--brokers", "{{kafka}}",
           "--group", "audit", "--topic", "shop.order", "--handler", "audit",
           "--batch-size", "50", "--metrics-addr", "127.0.0.1:{{port}}",
           "--consumer-config", "session.timeout.ms=10000",
           "--consumer-config", "max.poll.interval.ms=10000",
           "--consumer-config", "heartbeat.interval.ms=1000",
           "--consumer-config", "group.instance.id=audit-{{replica}}"]
env = {{ RUST_LOG = "warn,idem=info"{env} }}
ready = {{ http = "http://127.0.0.1:{{port}}/healthz" }}
"#
    )
}

/// Two consumers of `examples/python-consumer` (kafka-python, psycopg) in `mode`.
fn python_consumers(mode: &str) -> String {
    let python = std::env::var("IDEM_EXAMPLES_PYTHON").expect(
        "IDEM_EXAMPLES_PYTHON: a Python with examples/python-consumer/requirements.txt \
         (scripts/test makes one)",
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/python-consumer/consumer.py")
        .canonicalize()
        .unwrap();
    format!(
        r#"
[[component]]
name = "py-consumer"
replicas = 2
command = ["{python}", "{script}", "--db", "{{db.target}}", "--brokers", "{{kafka}}",
           "--topic", "shop.order", "--group", "ledger", "--mode", "{mode}"{crash}]
ready = {{ log = "consuming shop.order" }}
"#,
        script = script.display(),
        // Offset-first: every incarnation also crashes right after its third offset commit.
        crash = if mode == "offset-first" {
            r#", "--crash-after-commit", "3""#
        } else {
            ""
        }
    )
}

/// The check: every paid order has one row in `table` of the target, with its amount; each
/// loss located through the inbox of consumer group `locate`, when given.
fn verify(orders: &str, target: &str, table: &str, locate: Option<&str>) -> String {
    let locate = match locate {
        Some(group) => format!(
            r#"locate = {{ aggregate_type = "order", event_type = "order.paid", inbox_db = "{target}", consumer_group = "{group}" }}"#
        ),
        None => String::new(),
    };
    format!(
        r#"
[[check]]
name = "ledger"
event_type = "order.paid"
source = {{ db = "{orders}", query = "SELECT payment_id, amount_minor, order_id FROM orders", key = "payment_id", amount = "amount_minor", aggregate_id = "order_id" }}
target = {{ db = "{target}", query = "SELECT payment_id, amount_minor FROM {table}", key = "payment_id", amount = "amount_minor" }}
{locate}
"#
    )
}

/// Two databases (the target set up for the lab's services with `setup_target`), the files
/// written into `dir` (the network faults `aimed` at the consumers, and `copies` of records):
/// the pipeline file's path.
async fn prepare(
    dir: &Path,
    consumers: &str,
    table: &str,
    setup_target: bool,
    (aimed, copies): (bool, bool),
) -> (TestDb, TestDb, std::path::PathBuf) {
    let (orders, target) = (TestDb::create().await, TestDb::create().await);
    let set_up = if setup_target {
        vec![&orders, &target]
    } else {
        vec![&orders]
    };
    for db in set_up {
        let setup = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
            .args(["setup", "--db", db.url()])
            .output()
            .unwrap();
        assert!(setup.status.success(), "{setup:?}");
    }
    let file = dir.join("pipeline.toml");
    std::fs::write(
        &file,
        pipeline(orders.url(), target.url(), consumers, aimed, copies),
    )
    .unwrap();
    let check = verify(
        orders.url(),
        target.url(),
        table,
        setup_target.then_some("audit"),
    );
    std::fs::write(dir.join("verify.toml"), check).unwrap();
    (orders, target, file)
}

/// `idem-lab chaos --pipeline file args --json`, with `idem-lab` on the `PATH` (pipeline files
/// name it so): its exit status, report and standard error.
fn chaos(file: &Path, args: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let lab = Path::new(env!("CARGO_BIN_EXE_idem-lab"));
    let mut path = vec![lab.parent().unwrap().to_path_buf()];
    path.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let out = Command::new(lab)
        .args(["chaos", "--pipeline"])
        .arg(file)
        .args(args)
        .arg("--json")
        .env("PATH", std::env::join_paths(path).unwrap())
        .env("RUST_LOG", "warn")
        .env_remove("IDEM_CRASH_POINTS")
        .env_remove("IDEM_BREAK")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON report ({e}); stderr: {stderr}"));
    // The run's figures, for `--success-output immediate`.
    let orders = &report["verify"]["checks"][0]["by_event_type"][0]["source_rows"];
    eprintln!(
        "ok {} orders {orders} lost {} duplicate effects {} faults {} crash points fired {} \
         failures {}",
        report["ok"],
        report["lost"],
        report["duplicate_effects"],
        report["faults"],
        report["crash_points_fired"],
        report["failures"]
    );
    (out.status.code(), report, stderr)
}

/// Asserts that the run had each signal, a broker kill, a partition from PostgreSQL, and each
/// of `more`.
fn every_fault(r: &serde_json::Value, more: &[&str]) {
    let every = [
        "sigkill",
        "sigstop",
        "sigterm_restart",
        "broker_kill",
        "net_partition_postgres",
    ];
    for kind in every.iter().chain(more) {
        assert!(count(r, kind) > 0, "no {kind}: {r:#}");
    }
}

/// Database `name` on the runner's own PostgreSQL server, set up by `idem-lab setup`.
fn started(name: &str) -> String {
    let lab = env!("CARGO_BIN_EXE_idem-lab");
    format!(r#"{name} = {{ start = true, setup = ["{lab}", "setup", "--db", "{{db.{name}}}"] }}"#)
}

/// Writes pipeline file `text` (databases `orders` and `target` of the runner's own server) and
/// its verify config (`audit_log` rows of group `audit`) into `dir`: the pipeline file's path.
fn on_started_databases(dir: &Path, text: &str) -> std::path::PathBuf {
    on_started_databases_checking(dir, text, "audit_log", Some("audit"))
}

/// [`on_started_databases`], checking rows of `table` and locating losses through group
/// `locate`'s inbox when given.
fn on_started_databases_checking(
    dir: &Path,
    text: &str,
    table: &str,
    locate: Option<&str>,
) -> std::path::PathBuf {
    let file = dir.join("pipeline.toml");
    std::fs::write(&file, text).unwrap();
    let check = verify("{db.orders}", "{db.target}", table, locate);
    std::fs::write(dir.join("verify.toml"), check).unwrap();
    file
}

/// Asserts that the run passed: exit status 0, nothing lost, no duplicate effect.
fn passed(code: Option<i32>, r: &serde_json::Value, stderr: &str) {
    assert_eq!(code, Some(0), "{r:#}\n{stderr}");
    assert_eq!(r["ok"], true);
    assert_eq!(
        (r["lost"].as_u64(), r["duplicate_effects"].as_u64()),
        (Some(0), Some(0))
    );
}

/// The reference file's run crashed its PostgreSQL server. Its crashes are due at 40 % and 70 %
/// of the faults, but one due while the points API's slow window is open (the API keeps its
/// keys there) waits for the window's end, and a fault loop held up meanwhile (a broker being
/// restarted) can push the second past the end of the faults: once at least.
fn crashed(r: &serde_json::Value) {
    let n = count(r, "postgres_restart");
    assert!((1..=2).contains(&n), "{n} PostgreSQL crashes: {r:#}");
}

fn count(r: &serde_json::Value, key: &str) -> u64 {
    r["faults"].get(key).and_then(|v| v.as_u64()).unwrap_or(0)
}

/// 30 s of every fault kind on the pipeline file: signals at every component, a broker kill,
/// partitions, resets and slow links between each process and PostgreSQL and Kafka.
#[test]
fn a_pipeline_file_under_every_fault_loses_nothing_and_doubles_nothing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let consumers = audit_consumers("");
    let (_orders, _audit, file) = rt.block_on(prepare(
        dir.path(),
        &consumers,
        "audit_log",
        true,
        (false, true),
    ));
    let (code, r, stderr) = chaos(&file, &["--duration", "30s", "--seed", "1"]);
    passed(code, &r, &stderr);
    assert_eq!(r["settled"], true);
    every_fault(&r, &["net_partition_kafka", "redelivered_records"]);
    let events = r["verify"]["checks"][0]["by_event_type"][0]["source_rows"]
        .as_u64()
        .unwrap();
    assert!(events >= 1000, "{events} events is too little load: {r:#}");
    let deliveries = &r["verify"]["attempts"]["inbox"][0];
    assert!(
        deliveries["duplicate_deliveries"].as_i64().unwrap_or(0) > 0,
        "no event was delivered twice: the faults tested no duplicate: {r:#}"
    );
    assert_eq!(r["panics"], serde_json::json!([]));
}

/// The same pipeline whose consumers commit offsets before their database transaction and
/// crash at every incarnation's second batch, after the commit: the run fails, and every loss
/// is located where its event stopped.
#[test]
fn a_consumer_committing_offsets_before_its_database_is_caught_as_loss() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let broken = r#", IDEM_BREAK = "offset-before-commit", IDEM_CRASH_POINTS = "consumer.after_dedup_before_handler@2", IDEM_CRASH_LOG = "{dir}/crashes.log""#;
    let consumers = audit_consumers(broken);
    let (_orders, _audit, file) = rt.block_on(prepare(
        dir.path(),
        &consumers,
        "audit_log",
        true,
        (false, false),
    ));
    let (code, r, stderr) = chaos(
        &file,
        &[
            "--duration",
            "20s",
            "--seed",
            "1",
            "--settle-deadline",
            "20s",
        ],
    );
    assert_eq!(code, Some(1), "the loss went unnoticed: {r:#}\n{stderr}");
    assert_eq!(r["ok"], false);
    assert!(r["lost"].as_u64().unwrap() > 0, "{r:#}");
    let losses = r["verify"]["checks"][0]["losses"].as_array().unwrap();
    assert!(!losses.is_empty(), "{r:#}");
    let stage = |l: &serde_json::Value| l["stage"].as_str().unwrap().to_owned();
    assert!(
        losses
            .iter()
            .all(|l| ["published_but_not_processed", "not_located"].contains(&stage(l).as_str())),
        "{losses:#?}"
    );
    assert!(
        losses
            .iter()
            .any(|l| stage(l) == "published_but_not_processed"),
        "{losses:#?}"
    );
    let logs = Path::new(r["logs"].as_str().unwrap());
    assert!(logs.join("faults.log").exists(), "{r:#}");
    // The crash point fired: the processes that aborted there wrote its name.
    let crashes = std::fs::read_to_string(logs.join("crashes.log")).unwrap_or_default();
    assert!(
        crashes
            .lines()
            .any(|l| l == "consumer.after_dedup_before_handler"),
        "the crash point never fired: {crashes:?}"
    );
    std::fs::remove_dir_all(logs).unwrap();
}

/// A file that cannot run, and a component that exits before it is ready, end the run with
/// status 2 and the reason; the second keeps the logs that show why.
#[test]
fn a_pipeline_that_cannot_run_says_why_with_status_2() {
    let dir = tempfile::tempdir().unwrap();
    let never_read = "postgres://127.0.0.1:9/none";
    let config = verify(never_read, never_read, "t", None);
    let run_with = |file: &str, config: &str| {
        let path = dir.path().join("pipeline.toml");
        std::fs::write(&path, file).unwrap();
        std::fs::write(dir.path().join("verify.toml"), config).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
            .args(["chaos", "--pipeline"])
            .arg(&path)
            .args(["--duration", "1s"])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let run = |file: &str| run_with(file, &config);
    let file = r#"
        [kafka]
        bootstrap = "127.0.0.1:9"
        [[component]]
        name = "consumer"
        command = ["sh", "-c", "echo the queue is gone >&2; exit 3", "{db.orders}"]
        ready = { log = "consuming" }
        [verify]
        config = "verify.toml"
    "#;
    let (code, stderr) = run(file);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("`consumer` names `{db.orders}`, which the file does not define"),
        "{stderr}"
    );
    let (code, stderr) = run(&file.replace(", \"{db.orders}\"", ""));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("consumer-0 exited before it was ready")
            && stderr.contains("the queue is gone"),
        "{stderr}"
    );
    let logs = stderr.split("the run's logs are in ").nth(1).unwrap();
    let logs = Path::new(logs.split([':', '\n']).next().unwrap().trim());
    assert!(logs.join("consumer-0.log").exists(), "{stderr}");
    std::fs::remove_dir_all(logs).unwrap();
    let missing = file.replace(r#"["sh", "-c""#, r#"["/nonexistent/consumer", "-c""#);
    let (code, stderr) = run(&missing.replace(", \"{db.orders}\"", ""));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("starting consumer-0 (/nonexistent/consumer): No such file"),
        "{stderr}"
    );
    let logs = stderr.split("the run's logs are in ").nth(1).unwrap();
    std::fs::remove_dir_all(logs.split([':', '\n']).next().unwrap().trim()).unwrap();
    // A verify config naming a database the file does not define, refused before anything
    // starts.
    let unknown = config.replacen(never_read, "{db.ledger}", 1);
    let (code, stderr) = run_with(&file.replace(", \"{db.orders}\"", ""), &unknown);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("names {db.ledger}, a database [databases] does not define")
            && !stderr.contains("logs are in"),
        "{stderr}"
    );
}

/// `examples/python-consumer` in `mode` under every fault kind, the network faults `aimed` at
/// it (partitions with a kill inside among them) or spread over every process, copies of
/// records produced again except for `offset-first` (a copy can deliver a lost event again and
/// hide the loss): the report.
fn python_run(mode: &str, aimed: bool) -> (Option<i32>, serde_json::Value, String) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let consumers = python_consumers(mode);
    let (_orders, _target, file) = rt.block_on(prepare(
        dir.path(),
        &consumers,
        "py_ledger",
        false,
        (aimed, mode != "offset-first"),
    ));
    python_chaos(mode, &file)
}

/// The same on databases of the runner's own server, which it crashes twice (the consumer
/// creates its own tables).
fn python_run_on_started_databases(mode: &str) -> (Option<i32>, serde_json::Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let text = pipeline("@", "@", &python_consumers(mode), false, true)
        .replacen(r#"orders = "@""#, &started("orders"), 1)
        .replacen(r#"target = "@""#, "target = { start = true }", 1);
    let file = on_started_databases_checking(dir.path(), &text, "py_ledger", None);
    python_chaos(mode, &file)
}

/// 40 s of faults on the Python pipeline file at `file` (the offset-first control's relays
/// only paused), settling for at most 60 s.
fn python_chaos(mode: &str, file: &Path) -> (Option<i32>, serde_json::Value, String) {
    if mode == "offset-first" {
        // The relays are paused, never killed: a relay killed between its publish and its
        // mark publishes its batch again after the lease, the freshest events, which are the
        // ones a consumer killed after its offset commit has just lost; the copies would
        // deliver them again and hide the loss.
        let text = std::fs::read_to_string(file).unwrap();
        let relays = r#"faults = ["kill", "pause", "restart"]"#;
        assert!(text.contains(relays), "{text}");
        std::fs::write(file, text.replacen(relays, r#"faults = ["pause"]"#, 1)).unwrap();
    }
    chaos(
        file,
        &[
            "--duration",
            "40s",
            "--seed",
            "1",
            "--settle-deadline",
            "60s",
        ],
    )
}

/// A consumer idem did not write, in Python, with its own inbox in its database transaction
/// and offsets committed after it: nothing lost, nothing doubled, with the network faults
/// spread over every process (relays republishing) and PostgreSQL crashed twice, and with the
/// network faults on it alone (partitions with a kill inside).
#[test]
fn a_python_consumer_with_its_own_inbox_passes() {
    let (code, r, stderr) = python_run_on_started_databases("inbox");
    passed(code, &r, &stderr);
    assert!(count(&r, "redelivered_records") > 0, "{r:#}");
    assert_eq!(count(&r, "postgres_restart"), 2, "{r:#}");
    let (code, aimed, stderr) = python_run("inbox", true);
    assert_eq!(code, Some(0), "{aimed:#}\n{stderr}");
    assert!(
        count(&aimed, "net_partition_kill_postgres") > 0,
        "{aimed:#}"
    );
    every_fault(&r, &[]);
}

/// The same consumer committing its offsets before its transaction: crashed right after an
/// offset commit (each incarnation at its third batch, `--crash-after-commit`, as the lab's
/// crash points do) or killed inside a partition from its database (the network faults aimed
/// at it), it loses the batch, and the run fails on it.
#[test]
fn a_python_consumer_committing_offsets_first_is_caught_as_loss() {
    let (code, r, stderr) = python_run("offset-first", true);
    assert_eq!(code, Some(1), "the loss went unnoticed: {r:#}\n{stderr}");
    assert!(r["lost"].as_u64().unwrap() > 0, "{r:#}");
    let crashed = r["unexpected_exits"].as_array().unwrap().iter().any(|e| {
        e.as_str()
            .unwrap()
            .contains("crashing after the offset commit")
    });
    assert!(crashed, "no consumer crashed in the window: {r:#}");
}

/// The same consumer without an inbox: an event delivered again (the runner produces copies
/// of records already in the topic) is written again, and the run fails on the duplicate
/// effects.
#[test]
fn a_python_consumer_without_an_inbox_is_caught_as_duplicate_effects() {
    let (code, r, stderr) = python_run("no-inbox", true);
    assert_eq!(
        code,
        Some(1),
        "the duplicates went unnoticed: {r:#}\n{stderr}"
    );
    assert!(r["duplicate_effects"].as_u64().unwrap() > 0, "{r:#}");
}

/// The lab's Rust consumer with every batch's transaction held open 400 ms before its commit,
/// the network faults aimed at it: resets, partitions and kills inside a partition land in
/// open transactions (PostgreSQL counts them rolled back in the consumers' database, where
/// nothing else rolls back), and nothing is lost or doubled.
#[test]
fn a_rust_consumer_holding_transactions_open_across_partitions_passes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let consumers = audit_consumers("").replace(
        r#""--batch-size", "50","#,
        r#""--batch-size", "50", "--hold", "400ms","#,
    );
    assert!(consumers.contains("--hold"));
    let (_orders, audit, file) = rt.block_on(prepare(
        dir.path(),
        &consumers,
        "audit_log",
        true,
        (true, true),
    ));
    let (code, r, stderr) = chaos(&file, &["--duration", "40s", "--seed", "1"]);
    passed(code, &r, &stderr);
    every_fault(&r, &["net_partition_kill_postgres", "net_reset_postgres"]);
    let rolled_back: i64 = rt.block_on(async {
        sqlx::query_scalar(
            "SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(audit.pool())
        .await
        .unwrap()
    });
    assert!(rolled_back > 0, "no fault broke an open transaction: {r:#}");
}

/// Two replicas of `examples/consumer-handler serve` (an idem consumer with its own handler,
/// its inbox and ledger in one SQLite file), built next to `idem-lab`.
fn handler_consumers() -> String {
    let bin = Path::new(env!("CARGO_BIN_EXE_idem-lab")).with_file_name("consumer-handler");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p consumer-handler` (the workspace's \
         test run builds it)",
        bin.display()
    );
    format!(
        r#"
[[component]]
name = "handler"
replicas = 2
command = ["{bin}", "serve"]
env = {{ DATABASE_URL = "{{db.target}}", BROKERS = "{{kafka}}", TOPIC = "shop.order", RUST_LOG = "warn" }}
ready = {{ log = "consuming shop.order" }}
"#,
        bin = bin.display()
    )
}

/// `examples/consumer-handler` as a team's own consumer, run as a service: under signals, a
/// broker kill, partitions and resets between it and Kafka (its database is a file), the
/// relays and writers cut from PostgreSQL, the orders' server crashed twice, and copies of
/// records produced again, every paid order has its one ledger row.
#[test]
fn the_consumer_handler_example_as_a_service_passes() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = format!("sqlite://{}", dir.path().join("ledger.db").display());
    let file = dir.path().join("pipeline.toml");
    let text = pipeline("@", &ledger, &handler_consumers(), false, true).replacen(
        r#"orders = "@""#,
        &started("orders"),
        1,
    );
    std::fs::write(&file, text).unwrap();
    let check = verify("{db.orders}", &ledger, "ledger", Some("ledger"));
    std::fs::write(dir.path().join("verify.toml"), check).unwrap();
    let (code, r, stderr) = chaos(&file, &["--duration", "40s", "--seed", "1"]);
    passed(code, &r, &stderr);
    every_fault(&r, &["net_partition_kafka", "redelivered_records"]);
    assert_eq!(count(&r, "postgres_restart"), 2, "{r:#}");
    let deliveries = &r["verify"]["attempts"]["inbox"];
    assert!(
        deliveries.as_array().is_some_and(|d| d
            .iter()
            .any(|g| g["duplicate_deliveries"].as_i64().unwrap_or(0) > 0)),
        "no event was delivered twice: the faults tested no duplicate: {r:#}"
    );
}

/// Both databases on a PostgreSQL server the runner starts (`start = true`, each set up by
/// `idem-lab setup`) and crashes twice, among every other fault: every component loses its
/// sessions and what the server had not flushed, and nothing is lost or doubled.
#[test]
fn a_postgresql_the_runner_starts_and_crashes_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let text = pipeline("@", "@", &audit_consumers(""), false, true)
        .replacen(r#"orders = "@""#, &started("orders"), 1)
        .replacen(r#"target = "@""#, &started("target"), 1);
    assert!(text.contains("start = true"), "{text}");
    let file = on_started_databases(dir.path(), &text);
    let (code, r, stderr) = chaos(&file, &["--duration", "40s", "--seed", "1"]);
    passed(code, &r, &stderr);
    assert_eq!(count(&r, "postgres_restart"), 2, "{r:#}");
    every_fault(&r, &["net_partition_kafka"]);
    let deliveries = &r["verify"]["attempts"]["inbox"][0];
    assert!(
        deliveries["duplicate_deliveries"].as_i64().unwrap_or(0) > 0,
        "no event was delivered twice: the faults tested no duplicate: {r:#}"
    );
}

/// The reference pipeline as a pipeline file (`lab/idem-lab/pipelines/reference`): writers,
/// relays, settlement and audit consumers, the effect dispatcher and the points API, on a
/// PostgreSQL server the runner starts and crashes and a Kafka node it kills, with network
/// faults between every process and both and between the dispatcher and the points API, and
/// every crash point fired: every settlement, points award and audit row once. No process
/// gives up on the network; the one exit the runner did not cause that may come is a
/// consumer's documented stop: a static member whose partition outlasted its session is fenced
/// by librdkafka (librdkafka#3437, `docs/integrating/consumer.md`), and the runner restarts it
/// as a supervisor would.
#[test]
fn the_reference_pipeline_file_passes_with_network_faults_and_postgresql_crashes() {
    let (code, r, stderr) = chaos(&reference_file(), &["--duration", "40s", "--seed", "1"]);
    passed(code, &r, &stderr);
    crashed(&r);
    // The awards reached the points API through its remote's proxy: the remote's faults hit
    // the dispatcher's requests.
    let through = r["remote_connections"]["points"].as_u64().unwrap_or(0);
    assert!(through > 0, "no award passed the remote's proxy: {r:#}");
    let partitions = ["net_partition_kafka", "net_partition_remote"];
    every_fault(
        &r,
        &[&partitions[..], &["net_partition_kill_postgres"]].concat(),
    );
    for kind in ["reset", "slow"] {
        let n: u64 = ["postgres", "kafka", "remote"]
            .iter()
            .map(|d| count(&r, &format!("net_{kind}_{d}")))
            .sum();
        assert!(n > 0, "no {kind}: {r:#}");
    }
    for exit in r["unexpected_exits"].as_array().unwrap() {
        let exit = exit.as_str().unwrap();
        assert!(
            exit.contains("FencedInstanceId"),
            "a process gave up: {exit}"
        );
    }
    let fired = r["crash_points_fired"].as_object().unwrap();
    assert_eq!(fired.len(), 6, "{r:#}");
    assert!(fired.values().all(|n| n.as_u64() > Some(0)), "{r:#}");
    let checks: Vec<&str> = r["verify"]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(checks, ["settlements", "points", "audit"], "{r:#}");
    the_hostile_rows_were_contained(&r);
    // The points API's slow window opened, and its key lock kept every retry out.
    assert_eq!(count(&r, "window_slow_awards"), 1, "{r:#}");
    assert_eq!(r["verify"]["empty"][0]["rows"], 0, "{r:#}");
    // The settlements table was locked, and no event was given up for it.
    assert_eq!(count(&r, "lock_settlements"), 1, "{r:#}");
    // The outbox's rows were locked and the sessions waiting on them ended: nothing was lost.
    assert!(count(&r, "lock_outbox") >= 1, "{r:#}");
    // The burst written before the relays started (250 events per second of the run) drained
    // within the faults, at 200 rows/s or faster (a slower drain fails the run).
    assert_eq!(r["burst"]["rows"], 10_000, "{r:#}");
    assert!(r["burst"]["drained_seconds"].as_f64().is_some(), "{r:#}");
}

/// The reference pipeline file over databases of the user's own server (URLs, where the file
/// has `start = true`: left alone, never crashed), which the run leaves behind: it passes,
/// with each fault of the file, and the operator console opened over those databases shows the
/// parked rows and dead letters the run left and verifies them clean.
#[test]
fn the_reference_pipeline_over_your_own_databases_passes_and_the_console_shows_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dbs = rt.block_on(async {
        after_the_run::Databases {
            orders: TestDb::create().await,
            settlement: TestDb::create().await,
            points: TestDb::create().await,
        }
    });
    for (db, more) in [
        (&dbs.orders, None),
        (&dbs.settlement, Some("--business-rule")),
        (&dbs.points, None),
    ] {
        let setup = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
            .args(["setup", "--db", db.url()])
            .args(more)
            .output()
            .unwrap();
        assert!(setup.status.success(), "{setup:?}");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = reference_edited(dir.path(), |t| {
        let (start, end) = (
            t.find("[databases]\n").unwrap(),
            t.find("\n[kafka]").unwrap(),
        );
        let urls = format!(
            "[databases]\norders = \"{}\"\nsettlement = \"{}\"\npoints = \"{}\"\n",
            dbs.orders.url(),
            dbs.settlement.url(),
            dbs.points.url()
        );
        format!("{}{urls}{}", &t[..start], &t[end..])
    });
    let (code, r, stderr) = chaos(&file, &["--duration", "40s", "--seed", "2"]);
    passed(code, &r, &stderr);
    assert_eq!(count(&r, "postgres_restart"), 0, "a URL is never crashed");
    every_fault(&r, &["net_partition_kafka", "net_partition_remote"]);
    the_hostile_rows_were_contained(&r);
    for kind in ["lock_settlements", "lock_outbox", "window_slow_awards"] {
        assert!(count(&r, kind) >= 1, "no {kind}: {r:#}");
    }
    assert_eq!(r["burst"]["rows"], 10_000, "{r:#}");
    let deliveries = &r["verify"]["attempts"]["inbox"][0];
    assert!(
        deliveries["duplicate_deliveries"].as_i64().unwrap_or(0) > 0,
        "no event was delivered twice: the faults tested no duplicate: {r:#}"
    );
    after_the_run::the_console_shows_it(&dbs);
}

/// Interrupting a pipeline run (SIGTERM, or Ctrl-C's SIGINT) kills every process it started —
/// its components and loads and its Kafka node — instead of leaving them running (some of them
/// paused) behind it, stops its PostgreSQL server (which `pg_ctl` detaches: it is no
/// descendant of the run), and the run fails saying so. A process is told from a later one
/// given its id by its start time.
#[test]
fn an_interrupted_pipeline_run_leaves_no_process_behind() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    let lab = Path::new(env!("CARGO_BIN_EXE_idem-lab"));
    let mut path = vec![lab.parent().unwrap().to_path_buf()];
    path.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let mut child = Command::new(lab)
        .args(["chaos", "--pipeline"])
        .arg(reference_file())
        .args(["--duration", "120s", "--seed", "4"])
        .env("PATH", std::env::join_paths(path).unwrap())
        .env("RUST_LOG", "warn")
        .env_remove("IDEM_CRASH_POINTS")
        .env_remove("IDEM_BREAK")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    // "idem chaos --pipeline: seed 4 for 120 s; logs in DIR", printed before anything starts.
    let started = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.contains("; logs in "))
        .expect("the run did not start");
    let dir = std::path::PathBuf::from(started.rsplit("; logs in ").next().unwrap().trim());
    // Drain the rest, so that the run never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    // The first faults are on the timeline once every component runs.
    let deadline = Instant::now() + Duration::from_secs(180);
    while std::fs::read_to_string(dir.join("faults.log")).map_or(0, |t| t.lines().count()) < 3 {
        assert!(Instant::now() < deadline, "no fault within 180 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(200));
    }
    let ours = descendants(child.id());
    let names: Vec<String> = ours.iter().map(|(_, n)| n.clone()).collect();
    for program in ["java", "idem-lab"] {
        assert!(
            names.iter().any(|n| n == program),
            "no {program} among the run's processes: {names:?}"
        );
    }
    // The chaos tests have the machine to themselves (`.config/nextest.toml`): a server of the
    // runner's kind started since the run did is the run's.
    let run = Owner::of(child.id())
        .ok()
        .flatten()
        .expect("the run is running");
    let servers = private_servers_since(&run);
    assert!(
        !servers.is_empty(),
        "the run's PostgreSQL server was not seen"
    );

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    let exit = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "the run did not end within 60 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        exit.code(),
        Some(2),
        "an interrupted run is one that could not run"
    );
    let alive: Vec<&(Owner, String)> = ours.iter().filter(|(p, _)| lives(p)).collect();
    assert!(
        alive.is_empty(),
        "processes of the run survived it: {alive:?}"
    );
    // `pg_ctl stop -w` returns once the pid file is gone, a moment before the postmaster
    // exits.
    let deadline = Instant::now() + Duration::from_secs(10);
    while servers.iter().any(lives) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let running: Vec<&Owner> = servers.iter().filter(|s| lives(s)).collect();
    assert!(
        running.is_empty(),
        "the run's PostgreSQL server survived it: {running:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every process below `root` (its children, theirs, …): pid and program name.
fn descendants(root: u32) -> Vec<(Owner, String)> {
    let stats: Vec<(u32, u32, String)> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // "PID (COMM) STATE PPID …": COMM may hold spaces and parentheses.
            let (head, tail) = stat.rsplit_once(')')?;
            let comm = head.split_once('(')?.1.to_owned();
            let ppid = tail.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid, comm))
        })
        .collect();
    let mut found = vec![root];
    let mut out = vec![];
    while let Some(parent) = found.pop() {
        for (pid, ppid, comm) in &stats {
            if *ppid == parent {
                found.push(*pid);
                if let Some(owner) = Owner::of(*pid).ok().flatten() {
                    out.push((owner, comm.clone()));
                }
            }
        }
    }
    out
}

/// Whether `p` still runs (the same process, not a later one given its id; not a zombie).
fn lives(p: &Owner) -> bool {
    Owner::of(p.pid()).ok().flatten() == Some(*p)
        && std::fs::read_to_string(format!("/proc/{}/stat", p.pid())).is_ok_and(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
}

/// The postmasters of PostgreSQL servers of the runner's kind (data directories under
/// `idem-private-pg-…`) that started no earlier than `run`.
fn private_servers_since(run: &Owner) -> Vec<Owner> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|raw| {
                let line = String::from_utf8_lossy(&raw).replace('\0', " ");
                line.contains("bin/postgres -D ") && line.contains("idem-private-pg-")
            })
        })
        .filter_map(|pid| Owner::of(pid).ok().flatten())
        .filter(|o| o.started_since(run))
        .collect()
}

/// The foreign writer's rows: some refused at insert, the oversized payload parked by a relay
/// with its reason, the event the business rule refuses dead-lettered by both groups.
fn the_hostile_rows_were_contained(r: &serde_json::Value) {
    assert!(count(r, "hostile_rows_refused") > 0, "{r:#}");
    assert_eq!(r["hostile_violations"], serde_json::json!([]), "{r:#}");
    let rows = r["hostile_rows"].as_object().unwrap();
    let fate = |name: &str| {
        let (_, fate) = rows
            .iter()
            .find(|(k, _)| k.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no hostile row {name}: {r:#}"));
        fate.as_str().unwrap().to_owned()
    };
    assert!(
        fate("payload_over_a_megabyte").starts_with("parked: "),
        "{r:#}"
    );
    let refused = fate("refused_by_a_business_rule");
    assert!(
        refused.contains("settlement: dead-lettered") && refused.contains("audit: dead-lettered"),
        "{refused}"
    );
}

fn reference_file() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/reference/pipeline.toml")
}

/// The reference pipeline file passed through `edit`, written into `dir` beside a copy of its
/// verify config: the new file's path.
fn reference_edited(dir: &Path, edit: impl FnOnce(String) -> String) -> std::path::PathBuf {
    let text = edit(std::fs::read_to_string(reference_file()).unwrap());
    let verify = reference_file().with_file_name("verify.toml");
    std::fs::copy(verify, dir.join("verify.toml")).unwrap();
    let file = dir.join("pipeline.toml");
    std::fs::write(&file, text).unwrap();
    file
}

/// The reference pipeline file with the period `from` of a window or lock written `to`.
fn period_edited(dir: &Path, from: &str, to: &str) -> std::path::PathBuf {
    reference_edited(dir, |t| {
        assert_eq!(t.matches(from).count(), 1, "{from}");
        t.replacen(from, to, 1)
    })
}

/// Pipeline file `text` with component `name`'s section (from its `name = ` line up to the
/// next table) replaced by `section`.
fn section_replaced(text: &str, name: &str, section: &str) -> String {
    let start = text.find(&format!("name = \"{name}\"\n")).unwrap();
    let end = start + text[start..].find("\n[[").unwrap() + 1;
    format!("{}{section}\n{}", &text[..start], &text[end..])
}

/// A negative control on the pipeline file at `file`: `--break mechanism` for 30 s (seed 3).
/// The run must fail, say that the mechanism was broken, and have opened the mechanism's
/// window (`window`, a crash point, fired). Returns the report; its logs are removed.
fn broken(file: &Path, mechanism: &str, window: Option<&str>) -> serde_json::Value {
    broken_with(file, mechanism, window, &[])
}

fn broken_with(
    file: &Path,
    mechanism: &str,
    window: Option<&str>,
    extra: &[&str],
) -> serde_json::Value {
    let mut args = vec!["--duration", "30s", "--seed", "3", "--break", mechanism];
    args.extend(extra);
    let (code, r, stderr) = chaos(file, &args);
    controls::assert_caught(mechanism, (code, &r, &stderr));
    if let Some(point) = window {
        let fired = r["crash_points_fired"][point].as_u64().unwrap_or(0);
        assert!(fired > 0, "{point} never fired: {r:#}");
    }
    if let Some(logs) = r["logs"].as_str() {
        std::fs::remove_dir_all(logs).unwrap();
    }
    r
}

fn lost(r: &serde_json::Value) -> u64 {
    r["lost"].as_u64().unwrap()
}

fn doubled(r: &serde_json::Value) -> u64 {
    r["duplicate_effects"].as_u64().unwrap()
}

/// A relay that never parks retries the foreign writer's unpublishable row (over a megabyte)
/// forever: the run reports the row still pending. (Waiting for it is pointless, hence the
/// short settle deadline.)
#[test]
fn a_relay_that_never_parks_is_caught_wedged_by_a_hostile_row() {
    let wait = ["--settle-deadline", "40s"];
    let r = broken_with(&reference_file(), "never-park", None, &wait);
    let failures = r["failures"].to_string();
    assert!(
        failures.contains("hostile row payload_over_a_megabyte")
            && failures.contains("still pending"),
        "{r:#}"
    );
}

/// Without lock renewal, the points API's slow window (one award in eight takes 10 s, a 2 s key
/// lock, the dispatcher's 2 s timeout) lets a retry take over a live execution of its key: the
/// verify config's `[[empty]]` check of `points_lab_overlaps` finds the overlaps. The window is
/// made quiet: a dispatcher killed, or a key store crashed, in it sends no retry to overlap.
#[test]
fn a_key_lock_that_is_not_renewed_is_caught_as_overlapping_executions() {
    let dir = tempfile::tempdir().unwrap();
    // Due at 2 s, it opens once the run has been calm for 8 s, and ends before the faults.
    let file = period_edited(
        dir.path(),
        r#"period = { first = "8s", every = "40s", lasts = "15s" }"#,
        r#"period = { first = "2s", every = "40s", lasts = "15s", quiet = true }"#,
    );
    let r = broken(&file, "key-lock-renewal", None);
    assert_eq!(count(&r, "window_slow_awards"), 1, "{r:#}");
    let overlaps = &r["verify"]["empty"][0];
    assert_eq!(overlaps["name"], "overlapping executions of one key");
    assert!(overlaps["rows"].as_u64() > Some(0), "{r:#}");
}

/// The consumer policy that dead-letters after a few transient failures: the lock on
/// `settlements` fails the settlement handlers at their 50 ms `lock_timeout` for 5 s, and the
/// events dead-lettered for it are lost. The lock is made quiet, so that events reach the
/// handlers while it is held.
#[test]
fn dead_lettering_transient_failures_is_caught_as_loss() {
    let dir = tempfile::tempdir().unwrap();
    let file = period_edited(
        dir.path(),
        r#"period = { first = "12s", every = "30s", lasts = "5s" }"#,
        r#"period = { first = "12s", every = "30s", lasts = "5s", quiet = true }"#,
    );
    let r = broken(&file, "transient-dead-letters", None);
    assert_eq!(count(&r, "lock_settlements"), 1, "{r:#}");
    assert!(lost(&r) > 0, "{r:#}");
}

#[test]
fn marking_before_the_delivery_report_is_caught_as_loss() {
    let window = "relay.after_claim_before_publish";
    let r = broken(&reference_file(), "mark-before-report", Some(window));
    assert!(lost(&r) > 0, "{r:#}");
}

#[test]
fn committing_the_offset_before_the_database_is_caught_as_loss() {
    let window = "consumer.after_dedup_before_handler";
    let r = broken(&reference_file(), "offset-before-commit", Some(window));
    assert!(lost(&r) > 0, "{r:#}");
}

#[test]
fn select_then_insert_dedup_is_caught_as_a_duplicate_effect() {
    let window = "consumer.after_db_commit_before_offset_commit";
    let r = broken(&reference_file(), "select-then-insert", Some(window));
    assert!(doubled(&r) > 0, "{r:#}");
}

#[test]
fn a_new_key_per_retry_is_caught_as_a_duplicate_effect() {
    let window = "effect.after_http_success_before_record";
    let r = broken(&reference_file(), "new-key-per-retry", Some(window));
    assert!(doubled(&r) > 0, "{r:#}");
    let checks = r["verify"]["checks"].as_array().unwrap();
    let points = checks.iter().find(|c| c["name"] == "points").unwrap();
    let duplicates = points["duplicates"].as_array();
    assert!(duplicates.is_some_and(|d| !d.is_empty()), "{points:#}");
}

#[test]
fn an_inbox_not_scoped_by_group_is_caught_as_loss() {
    let r = broken(&reference_file(), "inbox-ignores-group", None);
    assert!(lost(&r) > 0, "{r:#}");
}

#[test]
fn a_relay_reading_by_id_watermark_is_caught_as_loss() {
    let r = broken(&reference_file(), "id-watermark", None);
    assert!(lost(&r) > 0, "{r:#}");
}

/// "We turned on Kafka exactly-once": the reference pipeline file with its settlement
/// consumers replaced by one that reads `read_committed` and commits offsets in a Kafka
/// transaction after the database commit, with no inbox. The database effect is outside the
/// Kafka transaction, so redeliveries apply it again.
#[test]
fn kafka_transactions_instead_of_the_inbox_are_caught_as_duplicate_effects() {
    let txn = r#"name = "settlement"
replicas = 2
command = ["idem-lab", "kafka-txn-settlement", "--db", "{db.settlement}", "--brokers", "{kafka}",
           "--group", "settlement", "--topic", "shop.order", "--batch-size", "50",
           "--points-url", "http://{remote.points}/awards",
           "--consumer-config", "session.timeout.ms=10000",
           "--consumer-config", "max.poll.interval.ms=10000",
           "--consumer-config", "heartbeat.interval.ms=1000",
           "--consumer-config", "group.instance.id=settlement-{replica}"]
crash_points = ["consumer.after_db_commit_before_offset_commit"]
"#;
    let dir = tempfile::tempdir().unwrap();
    let file = reference_edited(dir.path(), |t| section_replaced(&t, "settlement", txn));
    let window = "consumer.after_db_commit_before_offset_commit";
    let r = broken(&file, "kafka-transactions", Some(window));
    assert!(doubled(&r) > 0, "{r:#}");
    assert_eq!(lost(&r), 0, "{r:#}");
    assert!(
        r["remote_connections"]["points"].as_u64() > Some(0),
        "{r:#}"
    );
}

/// The reference pipeline's relays as CDC relays in table mode, two replicas on one slot.
const CDC_RELAYS: &str = r#"name = "relay"
replicas = 2
command = ["idem-lab", "cdc", "relay", "--slot", "shop", "--publication", "shop",
           "--db", "{db.orders}", "--brokers", "{kafka}", "--topic-prefix", "shop.",
           "--producer-config", "message.timeout.ms=2000", "--unwritable-topic-grace", "10s",
           "--metrics-addr", "127.0.0.1:{port}"]
env = { RUST_LOG = "warn,idem=info" }
ready = { http = "http://127.0.0.1:{port}/healthz" }
crash_points = ["cdc.after_publish_before_confirm"]
"#;

/// The reference pipeline file with CDC relays in table mode (two replicas on one slot: one
/// streams, the other waits to take over) instead of the polling ones, on the server the
/// runner crashes twice: the CDC crash point fires for real (a relay aborts between Kafka's
/// acknowledgement and the confirmation to the slot), and nothing is lost or doubled.
#[test]
fn the_reference_pipeline_file_with_cdc_relays_passes() {
    let dir = tempfile::tempdir().unwrap();
    let file = reference_edited(dir.path(), |t| section_replaced(&t, "relay", CDC_RELAYS));
    let (code, r, stderr) = chaos(&file, &["--duration", "40s", "--seed", "1"]);
    passed(code, &r, &stderr);
    crashed(&r);
    let fired = r["crash_points_fired"].as_object().unwrap();
    assert!(
        fired["cdc.after_publish_before_confirm"].as_u64() > Some(0),
        "{r:#}"
    );
    assert!(
        !fired.contains_key("relay.after_publish_before_mark"),
        "{r:#}"
    );
    assert_eq!(r["panics"], serde_json::json!([]));
}

/// The reference pipeline file's CDC relays on a server with a synchronous standby, failed
/// over to it at 40 % of the run (`[postgres] failover = true`): the standby has no logical
/// slot, so the relays are restarted with `--create-slot` (`after_failover`), as an operator
/// answers that error; table mode's drain publishes what committed in between, and nothing is
/// lost or doubled. Relays that never made the slot again would publish nothing after the
/// failover, and every order written since would be lost.
#[test]
fn the_reference_pipeline_file_failing_over_to_a_standby_without_the_slot_loses_nothing() {
    let relays =
        format!("{CDC_RELAYS}after_failover = {{ env = {{ IDEM_CREATE_SLOT = \"true\" }} }}\n");
    let dir = tempfile::tempdir().unwrap();
    let file = reference_edited(dir.path(), |t| {
        assert_eq!(t.matches("\n[kafka]\n").count(), 1, "{t}");
        section_replaced(&t, "relay", &relays).replacen(
            "\n[kafka]\n",
            "\n[postgres]\nfailover = true\n\n[kafka]\n",
            1,
        )
    });
    let (code, r, stderr) = chaos(&file, &["--duration", "40s", "--seed", "2"]);
    passed(code, &r, &stderr);
    assert_eq!(count(&r, "postgres_failover"), 1, "{r:#}");
    assert_eq!(count(&r, "restarted_after_failover"), 2, "{r:#}");
    assert!(count(&r, "postgres_restart") <= 1, "{r:#}");
    assert_eq!(r["panics"], serde_json::json!([]));
}

/// The reference pipeline file on a 3-node cluster of the runner's (replication 3,
/// `min.insync.replicas=2`): the first broker fault kills the leader of a partition in use.
#[test]
fn the_reference_pipeline_file_on_three_kafka_nodes_survives_a_leader_kill() {
    let dir = tempfile::tempdir().unwrap();
    let file = reference_edited(dir.path(), |t| {
        assert_eq!(t.matches("nodes = 1\n").count(), 1, "{t}");
        t.replacen("nodes = 1\n", "nodes = 3\n", 1)
    });
    let (code, r, stderr) = chaos(&file, &["--duration", "40s", "--seed", "2"]);
    passed(code, &r, &stderr);
    assert!(count(&r, "leader_kill") > 0, "no leader kill: {r:#}");
    assert_eq!(r["verify"]["clean"], true);
}

/// The CDC relay in message mode (two replicas on one slot: one streams, the other waits to
/// take over) behind writers that emit each order's event as a logical decoding message, on a
/// server the runner crashes twice: every audit row once.
#[test]
fn message_mode_writers_and_cdc_relays_lose_nothing_across_postgresql_crashes() {
    let lab = env!("CARGO_BIN_EXE_idem-lab");
    let dir = tempfile::tempdir().unwrap();
    let cdc = r#"command = ["{lab}", "cdc", "relay", "--db", "{db.orders}", "--brokers", "{kafka}",
           "--slot", "shop_messages", "--messages", "--topic-prefix", "shop.",
           "--producer-config", "message.timeout.ms=2000", "--metrics-addr", "127.0.0.1:{port}"]
ready = { http = "http://127.0.0.1:{port}/healthz" }
faults = ["kill", "pause", "restart", "network"]"#
        .replace("{lab}", lab);
    let text = pipeline("@", "@", &audit_consumers(""), false, true)
        .replacen(r#"orders = "@""#, &started("orders"), 1)
        .replacen(r#"target = "@""#, &started("target"), 1)
        .replacen(
            r#""--rate", "40","#,
            r#""--rate", "40", "--events", "messages","#,
            1,
        );
    let polling = text.find(r#"command = [""#).unwrap();
    let ready = text[polling..].find("faults = ").unwrap() + polling;
    let end = text[ready..].find('\n').unwrap() + ready;
    let text = format!("{}{cdc}{}", &text[..polling], &text[end..]);
    assert!(
        text.contains("--messages") && text.contains(r#""--events", "messages""#),
        "{text}"
    );
    let file = on_started_databases(dir.path(), &text);
    let (code, r, stderr) = chaos(&file, &["--duration", "30s", "--seed", "1"]);
    passed(code, &r, &stderr);
    assert_eq!(count(&r, "postgres_restart"), 2, "{r:#}");
    let events = r["verify"]["checks"][0]["by_event_type"][0]["source_rows"]
        .as_u64()
        .unwrap();
    assert!(events >= 500, "{events} events is too little load: {r:#}");
}

/// The operator console over the databases a run left.
mod after_the_run {
    use std::process::Command;
    use std::time::Duration;

    use idem_conformance::pg::TestDb;
    use idem_conformance::process::eventually;
    use sqlx::PgPool;

    use crate::support::browser::{Browser, console};

    /// The databases a run used and left behind, dropped on drop.
    pub(crate) struct Databases {
        pub(crate) orders: TestDb,
        pub(crate) settlement: TestDb,
        pub(crate) points: TestDb,
    }

    async fn count(url: &str, sql: &str) -> i64 {
        let pool = PgPool::connect(url).await.unwrap();
        let n = sqlx::query_scalar(sql).fetch_one(&pool).await.unwrap();
        pool.close().await;
        n
    }

    fn lab(args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
        cmd.args(args).env("RUST_LOG", "info");
        cmd
    }

    /// The console over `dbs`, in a real browser: the overview, the outbox, the consumers, the
    /// effects, a verification run from the proof page and its audit row.
    pub(crate) fn the_console_shows_it(dbs: &Databases) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(pages(dbs));
    }

    async fn pages(dbs: &Databases) {
        let (orders, settlement) = (dbs.orders.url(), dbs.settlement.url());
        let verify = tempfile::NamedTempFile::new().unwrap();
        let vpath = verify.path().to_str().unwrap();
        let out = lab(&[
            "verify-config",
            "--orders-db",
            orders,
            "--settlement-db",
            settlement,
        ])
        .args(["--points-db", dbs.points.url(), "--out", vpath])
        .output()
        .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut cmd = lab(&["console", "--listen", "127.0.0.1:0", "--sample-every", "1s"]);
        cmd.args(["--db", &format!("orders={orders}")])
            .args(["--db", &format!("settlement={settlement}")])
            .args(["--verify-config", vpath]);
        let (_console, base) = console(cmd);
        let b = Browser::open(&base).await;
        b.login().await;

        let parked = count(
            orders,
            "SELECT count(*) FROM idem_outbox WHERE status = 'parked'",
        )
        .await;
        let open = "SELECT count(*) FROM idem_dead_letters WHERE replay_outcome IS NULL \
                    AND consumer_group = ";
        let letters = count(settlement, &format!("{open}'settlement'")).await;
        assert!(
            parked > 0 && letters > 0,
            "the run left parked rows and dead letters"
        );
        b.go("/").await;
        let text = b.text().await;
        let outbox = format!("Outbox · orders\namber\npending\n0\nparked\n{parked}\n");
        assert!(text.contains(&outbox), "{text}");
        let group = "Group settlement\namber\n";
        let at = text.find(group).unwrap_or_else(|| panic!("{text}"));
        assert!(
            text[at..].contains(&format!("dead letters\n{letters}\n")),
            "{text}"
        );
        b.shot("after-chaos-overview").await;

        b.go("/outbox?db=orders").await;
        assert!(b.text().await.contains("parked"));
        assert!(
            b.forms().await > 1,
            "each parked row can be returned to pending"
        );
        b.shot("after-chaos-outbox").await;
        b.go("/consumers?db=settlement").await;
        assert!(b.text().await.contains("dead letters"));
        b.shot("after-chaos-consumers").await;
        b.go("/effects?db=settlement").await;
        b.shot("after-chaos-effects").await;

        b.go("/proof").await;
        b.click("form[action='/proof/run'] button").await;
        let verdict = eventually("a verdict", Duration::from_secs(120), || async {
            b.go("/proof").await;
            let t = b.text().await;
            t.contains("Verified").then_some(t)
        })
        .await;
        assert!(verdict.contains("clean"), "{verdict}");
        b.shot("after-chaos-proof").await;
        b.go("/audit?db=orders").await;
        assert!(
            b.text().await.contains("proof.verify"),
            "the run of the proof is audited"
        );
        b.shot("after-chaos-audit").await;
        b.close().await;
    }
}
