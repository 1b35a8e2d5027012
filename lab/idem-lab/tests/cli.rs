//! The lab's own commands on the command line: the Kafka-transactions negative control refuses
//! to run outside chaos, and the reference services refuse a database not set up.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

/// Runs `idem-lab` with `args`, no crash point armed.
fn idem(args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args(args).env_remove("IDEM_CRASH_POINTS");
    cmd.output().unwrap()
}

/// Standard output and standard error, as text.
fn text(o: &Output) -> (String, String) {
    let lossy = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (lossy(&o.stdout), lossy(&o.stderr))
}

/// A migrated SQLite database in a directory of its own.
struct Db {
    _dir: tempfile::TempDir,
    url: String,
}

fn sqlite() -> Db {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("lab.db").display());
    let o = idem(&["migrate", "--db", &url]);
    assert!(o.status.success(), "{:?}", text(&o));
    Db { _dir: dir, url }
}

/// The Kafka-transactions consumer applies effects twice on purpose: outside `idem-lab chaos
/// --break kafka-transactions` it refuses to start, before touching any database or broker.
#[test]
fn the_kafka_transactions_negative_control_refuses_to_run_outside_chaos() {
    let o = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
        .args([
            "kafka-txn-settlement",
            "--db",
            "postgres://nobody@127.0.0.1:1/none",
            "--brokers",
            "127.0.0.1:1",
            "--group",
            "g",
            "--topic",
            "t",
        ])
        .env_remove("IDEM_BREAK")
        .env_remove("IDEM_CRASH_POINTS")
        .output()
        .unwrap();
    let (_, stderr) = text(&o);
    assert!(!o.status.success(), "{stderr}");
    assert!(stderr.contains("negative control"), "{stderr}");
    assert!(
        stderr.contains("idem-lab chaos --break kafka-transactions"),
        "{stderr}"
    );
}

/// The reference services create no table in a database they are given: one nobody set up
/// (not migrated, or migrated without the reference tables) stops each at start with what is
/// missing and the command that creates it, before any broker is dialled (the broker given is
/// a closed port); `idem-lab setup` creates both, and is idempotent.
#[test]
fn a_reference_service_refuses_a_database_not_set_up_and_setup_creates_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("fresh.db").display());
    let closed = "127.0.0.1:9";
    let services: [Vec<&str>; 3] = [
        vec!["orders", "--db", &url, "--count", "1"],
        vec!["settlement", "--db", &url, "--brokers", closed],
        vec!["points-api", "--db", &url, "--listen", "127.0.0.1:0"],
    ];
    for args in &services {
        let o = idem(args);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{args:?} started on an empty database");
        assert!(
            err.contains("schema is at version 0") && err.contains("idem-lab setup --db"),
            "{args:?}: {err}"
        );
    }
    let migrated = sqlite();
    let o = idem(&["orders", "--db", &migrated.url, "--count", "1"]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("the reference tables orders, settlements")
            && err.contains("idem-lab setup --db"),
        "{err}"
    );
    for _ in 0..2 {
        let o = idem(&["setup", "--db", &url]);
        assert!(o.status.success(), "{:?}", text(&o));
        assert!(text(&o).0.contains("reference tables (orders, settlements"));
    }
    let o = idem(&["orders", "--db", &url, "--count", "3"]);
    assert!(o.status.success(), "{:?}", text(&o));
    // Nothing was created by the refused runs: the migrated database still has no orders table.
    let o = idem(&["orders", "--db", &migrated.url, "--count", "1"]);
    assert!(!o.status.success());
}

/// The subcommands `idem-lab <path> --help` lists.
fn subcommands(path: &[String]) -> Vec<String> {
    let args: Vec<&str> = path.iter().map(String::as_str).chain(["--help"]).collect();
    let (out, _) = text(&idem(&args));
    out.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

/// The lab's flags take lengths of time in the product's one syntax (`40s`, `500ms`): none is
/// named for a unit (`--seconds`, `--lock-timeout-ms`).
#[test]
fn no_lab_flag_is_named_for_a_unit_of_time() {
    let mut paths: Vec<Vec<String>> = vec![vec![]];
    let mut flags = 0;
    while let Some(path) = paths.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).chain(["--help"]).collect();
        let (out, _) = text(&idem(&args));
        for word in out.split_whitespace().filter(|w| w.starts_with("--")) {
            let name = word.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
            flags += 1;
            for unit in [
                "-ms", "-millis", "-secs", "-seconds", "-minutes", "-hours", "-days",
            ] {
                assert!(
                    !name.ends_with(unit) && name != "--seconds",
                    "`idem-lab {}` has {name}: take a duration (`30s`) instead",
                    path.join(" ")
                );
            }
        }
        for sub in subcommands(&path) {
            let mut next = path.clone();
            next.push(sub);
            paths.push(next);
        }
    }
    assert!(flags > 150, "only {flags} flags were read");
}
