//! `idem-lab demo` end to end, small: SQLite files, the points API on loopback, and the in-process
//! mock cluster (the default) or an Apache Kafka node the demo starts and stops itself
//! (`--brokers kafka`); every crash point fires (in-process restarts) and the verdict is clean.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

/// Runs a small demo with `extra` arguments, checks its verdict, and returns its report.
fn small_demo(extra: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
        .args([
            "demo",
            "--orders",
            "150",
            "--republish",
            "20",
            "--conflicts",
            "2",
            "--json",
        ])
        .args(extra)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("idem demo:"), "progress is shown: {stderr}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_clean(&r);
    r
}

#[test]
fn the_demo_fires_every_crash_point_absorbs_the_duplicates_and_verifies_clean() {
    let r = small_demo(&[]);
    assert_eq!(r["broker"], "embedded (librdkafka mock cluster)");
}

#[test]
fn the_demo_on_apache_kafka_verifies_clean_and_stops_its_broker() {
    let r = small_demo(&["--brokers", "kafka"]);
    assert_eq!(r["broker"], "apache kafka (scripts/kafka, one node)");
    let addr: SocketAddr = r["brokers"].as_str().unwrap().parse().unwrap();
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_err(),
        "the demo's Kafka node at {addr} still accepts connections after the demo"
    );
}

fn assert_clean(r: &serde_json::Value) {
    assert_eq!(r["ok"], true, "{r:#}");
    let orders = r["orders"].as_i64().unwrap();
    assert!(orders >= 150);
    assert_eq!(r["settlements"], orders);
    assert_eq!(r["points_awards"], orders);
    assert_eq!(r["events_published"], orders);
    assert_eq!(
        (r["lost"].as_u64(), r["duplicate_effects"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(r["duplicate_deliveries"].as_u64().unwrap() > 0);
    assert!(r["republishes"].as_u64().unwrap() >= 20);
    assert!(r["idempotency_conflicts"].as_u64().unwrap() >= 2);
    assert_eq!(
        r["dead_letters"], 2,
        "each conflicting copy dead-lettered once"
    );
    let fired = r["crash_points_fired"].as_object().unwrap();
    assert_eq!(fired.len(), 6);
    for (point, n) in fired {
        assert!(n.as_u64().unwrap() >= 3, "{point} fired {n}");
    }
    assert_eq!(r["verify"]["clean"], true);
}
