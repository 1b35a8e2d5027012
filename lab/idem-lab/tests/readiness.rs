//! The probes of a running relay: `/healthz` while the process serves, `/readyz` following its
//! dependencies — not ready while its broker is down, ready again once it restarts — and the
//! outage logged once, not once per attempt; SIGTERM stops it cleanly within its bound.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};

use idem_conformance::backend::Pg;
use idem_conformance::kafka::KafkaCluster;
use idem_conformance::process::{Proc, eventually, http_get};

/// `/readyz`'s JSON.
fn readyz(addr: SocketAddr) -> serde_json::Value {
    serde_json::from_str(&http_get(addr, "/readyz")).unwrap_or(serde_json::Value::Null)
}

fn broker_check(report: &serde_json::Value) -> Option<serde_json::Value> {
    report["checks"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == "broker")
        .cloned()
}

fn lines_with(p: &Proc, needle: &str) -> usize {
    p.log().iter().filter(|l| l.contains(needle)).count()
}

#[tokio::test(flavor = "multi_thread")]
async fn readyz_follows_the_broker_down_and_up_and_the_outage_is_logged_once() {
    let pg = Pg::new().await;
    let mut kafka = KafkaCluster::start(1);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args([
        "relay",
        "--db",
        pg.url(),
        "--brokers",
        kafka.brokers(),
        "--metrics-addr",
        "127.0.0.1:0",
        "--no-prune",
    ])
    .env("RUST_LOG", "info")
    .env_remove("IDEM_CRASH_POINTS");
    let mut relay = Proc::spawn("relay", cmd);
    let addr = relay.metrics_addr();

    eventually("the relay is ready", Duration::from_secs(60), || async {
        (readyz(addr)["ready"] == true).then_some(())
    })
    .await;
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&http_get(addr, "/healthz")).unwrap()["alive"],
        true
    );

    kafka.kill(1);
    let down = Instant::now();
    let report = eventually(
        "not ready without its broker",
        Duration::from_secs(60),
        || async {
            let r = readyz(addr);
            (r["ready"] == false).then_some(r)
        },
    )
    .await;
    let broker = broker_check(&report).unwrap_or_else(|| panic!("no broker check: {report}"));
    assert_eq!(broker["ready"], false, "{report}");
    assert!(
        broker["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{report}"
    );
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&http_get(addr, "/healthz")).unwrap()["alive"],
        true,
        "alive while a dependency is down"
    );

    kafka.restart(1);
    eventually(
        "ready again after the broker restarts",
        Duration::from_secs(120),
        || async { (readyz(addr)["ready"] == true).then_some(()) },
    )
    .await;
    let outage = down.elapsed();
    let unavailable = lines_with(&relay, "broker is unavailable");
    let reminders = lines_with(&relay, "broker still unavailable");
    assert_eq!(unavailable, 1, "the outage starts once: {:#?}", relay.log());
    assert!(
        reminders as u64 <= outage.as_secs() / 30 + 1,
        "{reminders} reminders in {outage:?}: {:#?}",
        relay.log()
    );
    assert_eq!(
        lines_with(&relay, "broker is reachable again"),
        1,
        "{:#?}",
        relay.log()
    );

    // SIGTERM: a clean stop within the bound docs/operating/deploy.md gives.
    let asked = Instant::now();
    relay.signal(15);
    let status = relay.wait_exit(Duration::from_secs(30));
    assert!(
        status.success(),
        "SIGTERM: {status:?} (signal {:?})",
        status.signal()
    );
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "stopped after {:?}",
        asked.elapsed()
    );
}
