//! `idem verify --watch` must not keep showing a clean result while it cannot verify: a failed
//! run sets `idem_reconciliation_up` to 0, removes the gap series (no answer is not a zero) and
//! leaves `idem_reconciliation_last_success_timestamp_seconds` at the last good run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use idem_conformance::backend::{Backend, Pg};
use idem_conformance::process::{Proc, eventually, http_get, metric_value};

#[allow(clippy::too_many_lines)] // one scripted scenario, read top to bottom
fn config(db: &str) -> String {
    format!(
        "[[check]]\nname = \"facts\"\nevent_type = \"fact.made\"\n\
         source = {{ db = \"{db}\", query = \"SELECT k, amount FROM facts\", key = \"k\", amount = \"amount\" }}\n\
         target = {{ db = \"{db}\", query = \"SELECT k, amount FROM effects\", key = \"k\", amount = \"amount\" }}\n"
    )
}

async fn facts_db() -> (Pg, tempfile::TempDir, std::path::PathBuf) {
    let pg = Pg::new().await;
    for sql in [
        "CREATE TABLE facts (k text NOT NULL, amount bigint NOT NULL)",
        "CREATE TABLE effects (k text NOT NULL, amount bigint NOT NULL)",
        "INSERT INTO facts VALUES ('a', 1), ('b', 2)",
        "INSERT INTO effects VALUES ('a', 1), ('b', 2)",
    ] {
        pg.exec(sql).await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("verify.toml");
    std::fs::write(&path, config(pg.url())).unwrap();
    (pg, dir, path)
}

fn watch(path: &std::path::Path, extra: &[&str]) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args([
        "verify",
        "--config",
        path.to_str().unwrap(),
        "--watch",
        "100ms",
        "--metrics-addr",
        "127.0.0.1:0",
    ])
    .args(extra);
    Proc::spawn("verify-watch", cmd)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_run_after_a_clean_one_reports_down_not_a_stale_zero() {
    let (pg, _dir, path) = facts_db().await;
    let watch = watch(&path, &[]);
    let addr = watch.metrics_addr();
    let metric = move |name: &str, labels: &[(&str, &str)]| {
        metric_value(&http_get(addr, "/metrics"), name, labels)
    };
    let missing = [
        ("check", "facts"),
        ("event_type", "fact.made"),
        ("kind", "missing"),
    ];
    watch.wait_for_line("idem verify: clean", Duration::from_secs(30));
    eventually(
        "a clean run to be exported",
        Duration::from_secs(30),
        || async {
            (metric("idem_reconciliation_gap", &missing) == Some(0.0)
                && metric("idem_reconciliation_up", &[]) == Some(1.0))
            .then_some(())
        },
    )
    .await;
    let last_success = metric("idem_reconciliation_last_success_timestamp_seconds", &[]).unwrap();
    assert!(last_success > 1.0e9, "{last_success}");

    // The target query starts failing: nothing is verified any more.
    pg.exec("ALTER TABLE effects RENAME TO effects_moved")
        .await
        .unwrap();
    watch.wait_for_line("could not verify", Duration::from_secs(30));
    eventually("up to drop to 0", Duration::from_secs(30), || async {
        (metric("idem_reconciliation_up", &[]) == Some(0.0)).then_some(())
    })
    .await;
    assert_eq!(
        metric("idem_reconciliation_gap", &missing),
        None,
        "a failed run must not leave the last clean gap value behind"
    );
    assert_eq!(
        metric("idem_reconciliation_last_success_timestamp_seconds", &[]),
        Some(last_success),
        "the last success stays where it was"
    );

    // Repaired: up again, the gap is back, the last success moves on.
    pg.exec("ALTER TABLE effects_moved RENAME TO effects")
        .await
        .unwrap();
    eventually(
        "verification to recover",
        Duration::from_secs(30),
        || async {
            (metric("idem_reconciliation_up", &[]) == Some(1.0)
                && metric("idem_reconciliation_gap", &missing) == Some(0.0)
                && metric("idem_reconciliation_last_success_timestamp_seconds", &[])
                    .is_some_and(|t| t > last_success))
            .then_some(())
        },
    )
    .await;
}

/// The chaos runner's negative control: with the hidden flag the old stale proof comes back
/// (up stays 1, the gap stays 0 while nothing is verified), so a harness check on `up` fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_negative_control_keeps_the_stale_proof() {
    let (pg, _dir, path) = facts_db().await;
    let watch = watch(&path, &["--lab-keep-stale-metrics"]);
    let addr = watch.metrics_addr();
    let metric = move |name: &str| metric_value(&http_get(addr, "/metrics"), name, &[]);
    watch.wait_for_line("idem verify: clean", Duration::from_secs(30));
    eventually(
        "a clean run to be exported",
        Duration::from_secs(30),
        || async { (metric("idem_reconciliation_up") == Some(1.0)).then_some(()) },
    )
    .await;
    pg.exec("ALTER TABLE effects RENAME TO effects_moved")
        .await
        .unwrap();
    watch.wait_for_line("could not verify", Duration::from_secs(30));
    assert_eq!(metric("idem_reconciliation_up"), Some(1.0));
    assert_eq!(metric("idem_reconciliation_gap"), Some(0.0));
}
