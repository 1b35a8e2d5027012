//! Runs the example, so that it cannot rot: the demo applies each of its three events once;
//! the service refuses to start without its settings, naming the one missing.

use std::process::Command;

#[test]
fn the_demo_applies_each_event_once() {
    let out = Command::new(env!("CARGO_BIN_EXE_consumer-handler"))
        .env_remove("BROKERS")
        .output()
        .expect("the example starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("3 ledger rows, one per event"), "{stdout}");
}

#[test]
fn the_service_names_a_missing_setting() {
    let out = Command::new(env!("CARGO_BIN_EXE_consumer-handler"))
        .arg("serve")
        .env_remove("DATABASE_URL")
        .env("BROKERS", "127.0.0.1:9")
        .output()
        .expect("the example starts");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("DATABASE_URL is not set"), "{stderr}");
}
