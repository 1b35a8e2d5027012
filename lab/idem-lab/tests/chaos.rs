//! `idem-lab chaos`, the reference runner, where the reference pipeline file does not reach
//! yet: a run failing PostgreSQL over to a standby must lose nothing and double nothing. (Every
//! other chaos run, the negative controls and an interrupted run included, is on the reference
//! pipeline file: `chaos_pipeline.rs`; the TLS run is `chaos_tls.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn chaos(args: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
        .arg("chaos")
        .args(args)
        .arg("--json")
        .env("RUST_LOG", "warn")
        .env_remove("IDEM_CRASH_POINTS")
        .env_remove("IDEM_BREAK")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON report ({e}); stderr: {stderr}"));
    (out.status.code(), report, stderr)
}

/// CDC relays on a PostgreSQL server of the run's own with a synchronous standby, failed over
/// to it mid-run (`--pg-failover`): the standby has no logical slot, so the relays stop on it
/// and the runner restarts one with `--create-slot` as an operator would; table mode's drain
/// publishes what committed in between, and nothing is lost or doubled.
#[test]
fn a_chaos_run_failing_over_to_a_standby_without_the_slot_loses_nothing() {
    let (code, r, stderr) = chaos(&["--duration", "40s", "--seed", "2", "--cdc", "--pg-failover"]);
    assert_eq!(code, Some(0), "{r:#}\n{stderr}");
    assert_eq!(r["ok"], true);
    assert_eq!(
        (r["lost"].as_u64(), r["duplicate_effects"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(r["faults"]["postgres_failover"], 1, "{r:#}");
    assert_eq!(r["faults"]["cdc_slot_created_after_failover"], 1, "{r:#}");
    assert_eq!(r["panics"], serde_json::json!([]));
}
