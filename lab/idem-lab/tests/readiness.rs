//! The probes of running processes: `/healthz` while the process serves, `/readyz` following
//! its dependencies — a relay not ready while its broker is down, ready again once it restarts,
//! and the outage logged once, not once per attempt; two consumers of a one-partition topic
//! (one holding no partition) ready once in their group, not ready while the broker or their
//! database is down; a dispatcher not ready while its database is down — and SIGTERM stopping
//! each cleanly within its bound.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};

use idem_conformance::backend::Pg;
use idem_conformance::kafka::{self, KafkaCluster};
use idem_conformance::private_pg::PrivatePg;
use idem_conformance::process::{Proc, eventually, http_get};

/// `/readyz`'s JSON.
fn readyz(addr: SocketAddr) -> serde_json::Value {
    serde_json::from_str(&http_get(addr, "/readyz")).unwrap_or(serde_json::Value::Null)
}

fn broker_check(report: &serde_json::Value) -> Option<serde_json::Value> {
    check(report, "broker")
}

/// The check named `name` of a `/readyz` report.
fn check(report: &serde_json::Value, name: &str) -> Option<serde_json::Value> {
    report["checks"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == name)
        .cloned()
}

/// The names of a report's checks.
fn check_names(report: &serde_json::Value) -> Vec<String> {
    report["checks"]
        .as_array()
        .map(|cs| {
            cs.iter()
                .filter_map(|c| c["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until every one of `addrs` reports `ready`; returns their reports.
async fn all_ready(what: &str, addrs: &[SocketAddr], ready: bool) -> Vec<serde_json::Value> {
    eventually(what, Duration::from_secs(120), || async {
        let reports: Vec<_> = addrs.iter().map(|a| readyz(*a)).collect();
        reports
            .iter()
            .all(|r| r["ready"] == ready)
            .then_some(reports)
    })
    .await
}

/// `idem-lab ARGS` with info logs and no crash point, as the process `name`.
fn spawn(name: &str, args: &[&str]) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args(args)
        .env("RUST_LOG", "info")
        .env_remove("IDEM_CRASH_POINTS");
    Proc::spawn(name, cmd)
}

/// `idem-lab migrate --db URL`.
fn migrate(url: &str) {
    lab(&["migrate", "--db", url]);
}

/// Runs `idem-lab <args>` to its end, which must be a success.
fn lab(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// SIGTERM, then a clean exit within `bound`.
fn stops_cleanly(p: &mut Proc, bound: Duration) {
    let asked = Instant::now();
    p.signal(15);
    let status = p.wait_exit(Duration::from_secs(60));
    assert!(
        status.success(),
        "SIGTERM: {status:?} (signal {:?}): {:#?}",
        status.signal(),
        p.log()
    );
    assert!(
        asked.elapsed() < bound,
        "stopped after {:?}",
        asked.elapsed()
    );
}

fn lines_with(p: &Proc, needle: &str) -> usize {
    p.log().iter().filter(|l| plain(l).contains(needle)).count()
}

/// `line` without its terminal colours (`ESC [ … m`).
fn plain(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Waits until `p` has logged a line with `needle` (the state a probe reports may be visible
/// just before its log line is written).
async fn logged(p: &Proc, needle: &str) {
    eventually(needle, Duration::from_secs(10), || async {
        (lines_with(p, needle) > 0).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn readyz_follows_the_broker_down_and_up_and_the_outage_is_logged_once() {
    let pg = Pg::new().await;
    let mut kafka = KafkaCluster::start(1);
    let mut relay = spawn(
        "relay",
        &[
            "relay",
            "--db",
            pg.url(),
            "--brokers",
            kafka.brokers(),
            "--metrics-addr",
            "127.0.0.1:0",
            "--no-prune",
        ],
    );
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
    // librdkafka's report of each reconnection attempt is debug: the outage is said above.
    let attempts = relay
        .log()
        .iter()
        .map(|l| plain(l))
        .filter(|l| l.contains("librdkafka") && l.contains("Connection refused"))
        .count();
    assert_eq!(attempts, 0, "{:#?}", relay.log());

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

/// A consumer is ready once it is in its group — with partitions or, one member of two on a
/// one-partition topic, with none — and its database and broker answer; not ready while the
/// broker is down or while its database is, ready again once each is back.
#[tokio::test(flavor = "multi_thread")]
async fn a_consumers_readyz_follows_its_group_broker_and_database() {
    let pg = PrivatePg::start();
    lab(&["setup", "--db", &pg.url()]);
    let mut cluster = KafkaCluster::start(1);
    let topic = kafka::unique("readiness.order");
    idem_kafka::ensure_topics(cluster.brokers(), std::slice::from_ref(&topic), 1, 1)
        .await
        .unwrap();
    let group = kafka::unique("readiness");
    let url = pg.url();
    let consumer = |name: &str| {
        spawn(
            name,
            &[
                "settlement",
                "--db",
                &url,
                "--brokers",
                cluster.brokers(),
                "--group",
                &group,
                "--topic",
                &topic,
                "--metrics-addr",
                "127.0.0.1:0",
            ],
        )
    };
    // One after the other: each creates the reference tables at start, which two processes
    // must not do at once.
    let mut a = consumer("settlement-a");
    all_ready("the first member ready", &[a.metrics_addr()], true).await;
    let mut b = consumer("settlement-b");
    let addrs = [a.metrics_addr(), b.metrics_addr()];

    let reports = all_ready("both members ready", &addrs, true).await;
    for r in &reports {
        assert_eq!(check_names(r), ["broker", "database", "group"], "{r}");
    }
    assert!(
        [&a, &b]
            .iter()
            .any(|p| lines_with(p, "partitions assigned partitions=0") > 0),
        "the member without a partition was told its empty assignment: {:#?} {:#?}",
        a.log(),
        b.log()
    );

    cluster.kill(1);
    let reports = all_ready("neither ready without the broker", &addrs, false).await;
    for r in &reports {
        let broker = broker_check(r).unwrap_or_else(|| panic!("no broker check: {r}"));
        assert_eq!(broker["ready"], false, "{r}");
        assert!(
            broker["reason"].as_str().is_some_and(|s| !s.is_empty()),
            "{r}"
        );
    }
    for addr in addrs {
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&http_get(addr, "/healthz")).unwrap()["alive"],
            true,
            "alive while the broker is down"
        );
    }
    cluster.restart(1);
    all_ready("both ready again after the broker restarts", &addrs, true).await;

    pg.try_crash().unwrap();
    let reports = all_ready("neither ready without the database", &addrs, false).await;
    for r in &reports {
        let db = check(r, "database").unwrap_or_else(|| panic!("no database check: {r}"));
        assert_eq!(db["ready"], false, "{r}");
        assert_eq!(check(r, "group").unwrap()["ready"], true, "{r}");
    }
    pg.try_start_again().unwrap();
    all_ready("both ready again after the database restarts", &addrs, true).await;
    for p in [&a, &b] {
        logged(p, "database is reachable again").await;
        assert_eq!(
            lines_with(p, "database is unavailable"),
            1,
            "the outage starts once: {:#?}",
            p.log()
        );
    }

    stops_cleanly(&mut a, Duration::from_secs(15));
    stops_cleanly(&mut b, Duration::from_secs(15));
}

/// The dispatcher is ready while its database answers, not ready while it is down — the process
/// rides the outage out instead of stopping — and ready again once it is back; SIGTERM stops
/// it cleanly.
#[tokio::test(flavor = "multi_thread")]
async fn the_dispatchers_readyz_follows_its_database() {
    let pg = PrivatePg::start();
    migrate(&pg.url());
    let url = pg.url();
    let args = [
        "effects",
        "dispatch",
        "--db",
        &url,
        "--metrics-addr",
        "127.0.0.1:0",
    ];
    let mut dispatcher = spawn("dispatcher", &args);
    let addr = dispatcher.metrics_addr();

    let report = all_ready("the dispatcher is ready", &[addr], true).await;
    assert_eq!(check_names(&report[0]), ["database"], "{}", report[0]);

    pg.try_crash().unwrap();
    let report = all_ready("not ready without its database", &[addr], false).await;
    let db = check(&report[0], "database").unwrap();
    assert!(db["reason"].as_str().is_some_and(|s| !s.is_empty()), "{db}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&http_get(addr, "/healthz")).unwrap()["alive"],
        true,
        "alive while the database is down"
    );

    pg.try_start_again().unwrap();
    all_ready("ready again after the database restarts", &[addr], true).await;
    logged(&dispatcher, "database is reachable again").await;
    assert_eq!(
        lines_with(&dispatcher, "database is unavailable"),
        1,
        "the outage starts once: {:#?}",
        dispatcher.log()
    );
    assert_eq!(
        lines_with(&dispatcher, "database is reachable again"),
        1,
        "{:#?}",
        dispatcher.log()
    );
    stops_cleanly(&mut dispatcher, Duration::from_secs(10));
}

/// A CDC relay whose slot is gone (dropped behind its back, or absent on a standby a failover
/// promoted) stops streaming and stays up: `/metrics` shows `idem_cdc_slot_lost` 1 and
/// `/readyz` says why, until SIGTERM, after which it exits with the error. A relay that exited
/// at once would take the gauge with it, and the alert on it would never fire.
#[tokio::test(flavor = "multi_thread")]
async fn a_cdc_relay_whose_slot_is_gone_stays_up_to_report_it() {
    let pg = Pg::new().await;
    let slot = format!("lost_{}", kafka::unique("s").replace('-', "_"));
    let publication = format!("{slot}_pub");
    let brokers = kafka::shared();
    let args = [
        "cdc",
        "relay",
        "--db",
        pg.url(),
        "--brokers",
        &brokers,
        "--slot",
        &slot,
        "--publication",
        &publication,
        "--metrics-addr",
        "127.0.0.1:0",
    ];
    let mut first = spawn("cdc-first", &args);
    first.wait_for_line("idem cdc relay: slot", Duration::from_secs(60));
    first.signal(15);
    assert!(first.wait_exit(Duration::from_secs(30)).success());
    let dropped = eventually("the slot dropped", Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(pg_drop_replication_slot(slot_name)) FROM pg_replication_slots \
             WHERE slot_name = $1 AND NOT active",
        )
        .bind(&slot)
        .fetch_one(pg.pool())
        .await
        .ok()
        .filter(|n| *n == 1)
    })
    .await;
    assert_eq!(dropped, 1);

    let mut second = spawn("cdc-second", &args);
    let addr = second.metrics_addr();
    eventually("idem_cdc_slot_lost 1", Duration::from_secs(60), || async {
        let body = http_get(addr, "/metrics");
        (idem_conformance::process::metric_value(&body, "idem_cdc_slot_lost", &[]) == Some(1.0))
            .then_some(())
    })
    .await;
    let report = readyz(addr);
    assert_eq!(report["ready"], false, "{report}");
    let why = check(&report, "slot").unwrap_or_default().to_string();
    assert!(why.contains("--create-slot"), "{report}");
    second.wait_for_line("stopped streaming", Duration::from_secs(10));
    second.signal(15);
    let status = second.wait_exit(Duration::from_secs(30));
    assert!(!status.success(), "{status:?}");
}
