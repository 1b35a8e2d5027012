//! The reference pipeline file, secured: Kafka over SASL_SSL with SCRAM-SHA-512 (`[kafka]
//! security = "sasl_ssl"`: a node of the runner's, with a PKI and SCRAM users made for the run,
//! SIGKILLed and restarted), PostgreSQL under `verify-full` as `idem_tls` (a role the suite's
//! server refuses in clear; its password in a `PGPASSFILE`, never in a URL), the points API
//! over HTTPS with the run's CA — loses nothing and doubles nothing. While it runs, every
//! backend on its databases is encrypted and of `idem_tls`, and no command line on the host
//! holds a password; afterwards the broker's log names the SCRAM principal, the awards went to
//! `https://`, and no log line of the run holds a password: the runner's own search says so,
//! and this test searches again.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use idem_conformance::pg::{PgTlsMaterial, admin_url};
use sqlx::postgres::PgPool;

/// What the test saw while the run went on.
#[derive(Default)]
struct Seen {
    /// The most backends on the run's databases at once.
    most_backends: usize,
    /// `(user, backend type, ssl)` of every backend seen.
    backends: BTreeSet<(String, String, bool)>,
    /// Every command line of the host's processes.
    cmdlines: BTreeSet<String>,
}

async fn look(pool: &PgPool, prefix: &str, seen: &mut Seen) {
    let rows: Vec<(String, String, bool)> = sqlx::query_as(
        "SELECT coalesce(a.usename, '')::text, coalesce(a.backend_type, ''), \
                coalesce(s.ssl, false) \
         FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.datname LIKE $1",
    )
    .bind(format!("{prefix}%"))
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    seen.most_backends = seen.most_backends.max(rows.len());
    seen.backends.extend(rows);
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        if let Ok(raw) = std::fs::read(entry.path().join("cmdline")) {
            seen.cmdlines
                .insert(String::from_utf8_lossy(&raw).replace('\0', " "));
        }
    }
}

/// The log files of a run's directory (outside the brokers' data, the PKI and the secrets).
fn logs(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            let name = entry.file_name();
            if !["data", "pki", "secrets"].contains(&name.to_str().unwrap()) {
                logs(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "log" || e == "txt") {
            out.push(path);
        }
    }
}

/// The reference pipeline file secured: its databases `urls` (by name), its Kafka clients
/// logging in with the node's placeholders, the points API serving HTTPS and the dispatcher
/// trusting the run's CA.
fn secured_file(dir: &Path, urls: &[(&str, String)]) -> PathBuf {
    let reference = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/reference");
    let mut t = std::fs::read_to_string(reference.join("pipeline.toml")).unwrap();
    let replace = |t: &mut String, from: &str, to: &str, n: usize| {
        assert_eq!(t.matches(from).count(), n, "{from}");
        *t = t.replace(from, to);
    };
    let (start, end) = (
        t.find("[databases]\n").unwrap(),
        t.find("\n[kafka]").unwrap(),
    );
    let databases: String = urls
        .iter()
        .map(|(name, url)| format!("{name} = \"{url}\"\n"))
        .collect();
    t = format!("{}[databases]\n{databases}{}", &t[..start], &t[end..]);
    replace(
        &mut t,
        "nodes = 1\n",
        "nodes = 1\nsecurity = \"sasl_ssl\"\n",
        1,
    );
    replace(
        &mut t,
        "env = { RUST_LOG = \"warn,idem=info\" }",
        "env = { RUST_LOG = \"warn,idem=info\", IDEM_KAFKA_SECURITY_PROTOCOL = \"SASL_SSL\", \
         IDEM_KAFKA_SASL_MECHANISM = \"{kafka.mechanism}\", \
         IDEM_KAFKA_SASL_USERNAME = \"{kafka.user}\", \
         IDEM_KAFKA_SASL_PASSWORD_FILE = \"{kafka.password_file}\", \
         IDEM_KAFKA_SSL_CA = \"{tls.ca}\" }",
        4,
    );
    replace(
        &mut t,
        "\"--listen\", \"127.0.0.1:{port}\"]",
        "\"--listen\", \"127.0.0.1:{port}\",\n           \"--tls-cert\", \"{tls.cert}\", \
         \"--tls-key\", \"{tls.key}\"]",
        1,
    );
    replace(
        &mut t,
        "\"http://{remote.points}/awards\"",
        "\"https://{remote.points}/awards\"",
        1,
    );
    replace(
        &mut t,
        "\"--concurrency\", \"64\",",
        "\"--concurrency\", \"64\", \"--ca-bundle\", \"{tls.ca}\",",
        1,
    );
    std::fs::copy(reference.join("verify.toml"), dir.join("verify.toml")).unwrap();
    let file = dir.join("pipeline.toml");
    std::fs::write(&file, t).unwrap();
    file
}

/// A `PGPASSFILE` (only its owner reads it) giving role `idem_tls`'s password for any port of
/// 127.0.0.1: the runner's fault proxies listen on ports of their own.
fn passfile(dir: &Path, password: &str) -> PathBuf {
    let path = dir.join("pgpass");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .unwrap();
    std::io::Write::write_all(
        &mut f,
        format!("127.0.0.1:*:*:idem_tls:{password}\n").as_bytes(),
    )
    .unwrap();
    path
}

/// The chaos runner on `file`, with the environment cleared of the lab's variables and
/// `idem-lab` on the `PATH`.
fn chaos(file: &Path, passfile: &Path) -> Command {
    let lab = Path::new(env!("CARGO_BIN_EXE_idem-lab"));
    let mut path = vec![lab.parent().unwrap().to_path_buf()];
    path.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let mut cmd = Command::new(lab);
    for (k, _) in std::env::vars() {
        if (k.starts_with("IDEM_") && !k.starts_with("IDEM_TEST_")) || k.starts_with("PG") {
            cmd.env_remove(k);
        }
    }
    cmd.args(["chaos", "--pipeline"])
        .arg(file)
        .args(["--duration", "40s", "--seed", "1", "--keep", "--json"])
        .env("PATH", std::env::join_paths(path).unwrap())
        .env("PGPASSFILE", passfile)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Creates databases `prefix{orders,settlement,points}` owned by `idem_tls` and sets each up
/// as `idem_tls` over `verify-full` (`idem-lab setup`); their URLs, without a password.
async fn databases(
    admin: &PgPool,
    tls: &PgTlsMaterial,
    prefix: &str,
    passfile: &Path,
) -> Vec<(&'static str, String)> {
    let mut urls = vec![];
    for (name, more) in [
        ("orders", None),
        ("settlement", Some("--business-rule")),
        ("points", None),
    ] {
        let db = format!("{prefix}{name}");
        sqlx::query(&format!("CREATE DATABASE {db} OWNER idem_tls"))
            .execute(admin)
            .await
            .unwrap();
        let url = format!(
            "postgres://idem_tls@127.0.0.1:5432/{db}?sslmode=verify-full&sslrootcert={}",
            tls.ca()
        );
        let setup = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
            .args(["setup", "--db", &url])
            .args(more)
            .env("PGPASSFILE", passfile)
            .env_remove("PGPASSWORD")
            .output()
            .unwrap();
        assert!(setup.status.success(), "{setup:?}");
        urls.push((name, url));
    }
    urls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines)] // one run, and everything it must show
async fn the_reference_pipeline_over_tls_scram_and_https_loses_nothing_and_leaks_no_password() {
    let tls = PgTlsMaterial::get();
    let admin = PgPool::connect(&admin_url()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let passfile = passfile(dir.path(), &tls.password());
    let prefix = format!("idem_tls_pipeline_{}_", std::process::id());
    let urls = databases(&admin, &tls, &prefix, &passfile).await;
    let file = secured_file(dir.path(), &urls);
    let mut child = chaos(&file, &passfile).spawn().unwrap();
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let stdout = std::thread::spawn(move || {
        let mut s = String::new();
        out.read_to_string(&mut s).unwrap();
        s
    });
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        err.read_to_string(&mut s).unwrap();
        s
    });
    // Sampled until the runner exits: what its processes connect with, and their command lines.
    let mut seen = Seen::default();
    while child.try_wait().unwrap().is_none() {
        look(&admin, &prefix, &mut seen).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let code = child.wait().unwrap().code();
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    let r: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("no JSON report ({e}); stderr: {stderr}"));
    let logs_dir = PathBuf::from(r["logs"].as_str().expect("--keep keeps the logs"));

    // The passwords of the run: idem_tls's and every Kafka user's (the broker's own too).
    let mut passwords = vec![tls.password()];
    let users = std::fs::read_to_string(logs_dir.join("kafka/users")).unwrap();
    passwords.extend(
        users
            .lines()
            .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned)),
    );
    passwords.push(
        std::fs::read_to_string(logs_dir.join("kafka/admin-password"))
            .unwrap()
            .trim()
            .to_owned(),
    );
    assert!(
        passwords.iter().all(|p| p.len() >= 16),
        "{}",
        passwords.len()
    );

    // Awards went to the HTTPS points API.
    let settlement_url = format!(
        "{}/{prefix}settlement",
        admin_url().rsplit_once('/').unwrap().0
    );
    let settlement = PgPool::connect(&settlement_url).await.unwrap();
    let (done, https): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'done'), \
                count(*) FILTER (WHERE status = 'done' AND target LIKE 'https://127.0.0.1:%') \
         FROM idem_effect_intents",
    )
    .fetch_one(&settlement)
    .await
    .unwrap();
    settlement.close().await;
    for (name, _) in &urls {
        sqlx::query(&format!(
            "DROP DATABASE IF EXISTS {prefix}{name} WITH (FORCE)"
        ))
        .execute(&admin)
        .await
        .unwrap();
    }

    assert_eq!(code, Some(0), "{r:#}\n{stderr}");
    assert_eq!(r["ok"], true, "{r:#}");
    assert_eq!(
        (r["lost"].as_u64(), r["duplicate_effects"].as_u64()),
        (Some(0), Some(0)),
        "{r:#}"
    );
    assert_eq!(r["verify"]["clean"], true, "{r:#}");
    let faults = r["faults"].as_object().unwrap();
    for kind in ["sigkill", "broker_kill", "net_partition_postgres"] {
        assert!(
            faults.get(kind).and_then(|v| v.as_u64()).unwrap_or(0) > 0,
            "no {kind}: {r:#}"
        );
    }
    assert!(
        r["verify"]["attempts"]["inbox"][0]["duplicate_deliveries"]
            .as_i64()
            .unwrap_or(0)
            > 0,
        "{r:#}"
    );
    assert!(
        done > 0 && https == done,
        "{https} of {done} awards over HTTPS"
    );
    // A foreign writer's row for a topic an ACL denies the run's principal: parked as such.
    let denied: Vec<&str> = r["hostile_rows"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with("topic_the_relay_may_not_write "))
        .map(|(_, v)| v.as_str().unwrap())
        .collect();
    assert!(!denied.is_empty(), "{r:#}");
    assert!(
        denied
            .iter()
            .all(|f| f.contains("may not write topic chaos-denied-topic")),
        "{denied:?}"
    );

    // The runner's own account: secured as asked, and no password in its logs.
    let t = &r["tls"];
    eprintln!("faults {}; tls {t}", r["faults"]);
    assert_eq!(t["kafka"], "SASL_SSL SCRAM-SHA-512 as idem_scram", "{t:#}");
    assert_eq!(t["scram_principal_logged"], true, "{t:#}");
    let b = &t["pg_backends"];
    assert!(b["all"].as_u64().unwrap() > 0, "{t:#}");
    assert_eq!((&b["in_clear"], &b["other_roles"]), (&0.into(), &0.into()));
    let search = &t["secret_search"];
    assert_eq!(search["hits"], serde_json::json!([]), "{t:#}");
    // The node's four (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, the broker's own) and idem_tls's.
    assert!(search["secrets"].as_u64().unwrap() >= 5, "{t:#}");
    assert!(search["lines"].as_u64().unwrap() > 100, "{t:#}");

    // What the test saw itself while the run went on: every backend on the run's databases
    // encrypted and of idem_tls (the pools of the relays, consumers, dispatcher, points API and
    // the runner), and no password on any command line.
    eprintln!(
        "backends seen (at most {} at once): {:?}",
        seen.most_backends, seen.backends
    );
    assert!(seen.most_backends >= 8, "{:?}", seen.backends);
    assert!(
        seen.backends
            .iter()
            .all(|(user, _, ssl)| user == "idem_tls" && *ssl),
        "a backend in clear or of another role: {:?}",
        seen.backends
    );
    // The run's processes: its databases' prefix or the run's directory is on their command
    // lines (other tests on this host may pass idem_tls's password on theirs).
    let processes: Vec<&String> = seen
        .cmdlines
        .iter()
        .filter(|c| c.contains(&prefix) || c.contains(logs_dir.to_str().unwrap()))
        .collect();
    assert!(processes.len() >= 5, "the run's processes were not seen");
    for line in processes {
        for p in &passwords {
            assert!(
                !line.contains(p.as_str()),
                "a password on a command line: {}",
                line.replace(p.as_str(), "***")
            );
        }
    }

    // The broker authenticated the SCRAM user, and this test finds no password in any log
    // line of the run (the runner's stderr and report included).
    let broker_log = std::fs::read_to_string(logs_dir.join("kafka/node1/broker.log")).unwrap();
    assert!(
        broker_log.contains("User:idem_scram"),
        "{}",
        logs_dir.display()
    );
    let mut files = vec![];
    logs(&logs_dir, &mut files);
    assert!(files.len() >= 10, "{files:?}");
    let mut lines = 0;
    for file in &files {
        let text = String::from_utf8_lossy(&std::fs::read(file).unwrap()).into_owned();
        for (i, line) in text.lines().enumerate() {
            lines += 1;
            for p in &passwords {
                assert!(
                    !line.contains(p.as_str()),
                    "a password in {}:{}",
                    file.display(),
                    i + 1
                );
            }
        }
    }
    for line in stderr.lines().chain(stdout.lines()) {
        for p in &passwords {
            assert!(
                !line.contains(p.as_str()),
                "a password in the runner's output"
            );
        }
    }
    eprintln!(
        "{} passwords searched in {lines} lines of {} log files and the runner's output: 0 hits",
        passwords.len(),
        files.len()
    );
    std::fs::remove_dir_all(&logs_dir).unwrap();
}
