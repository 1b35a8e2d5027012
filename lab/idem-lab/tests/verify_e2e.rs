//! `idem verify` on a real reference pipeline: orders, the relay (hosting librdkafka's mock
//! cluster), the settlement consumer, the points API and the effect dispatcher run as processes
//! against three PostgreSQL databases; each test then breaks one thing and checks the report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};
use std::time::Duration;

use idem_conformance::backend::{Backend, Pg};
use idem_conformance::process::{Proc, eventually, http_get, metric_sum};
use serde_json::Value;

const N: i64 = 40;

fn idem(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args(args)
        .env("RUST_LOG", "info")
        .env_remove("IDEM_CRASH_POINTS");
    cmd
}

/// `idem-lab setup`: idem's tables and the reference tables in `db` (the reference services
/// create none).
fn setup(db: &str) {
    let out = idem(&["setup", "--db", db]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A settled pipeline: every order settled and awarded.
struct Pipeline {
    orders: Pg,
    settle: Pg,
    points: Pg,
    brokers: String,
    _relay: Proc,
    settlement: Proc,
    _api: Proc,
    _dispatcher: Proc,
    /// Where the verify configs are written.
    dir: tempfile::TempDir,
}

fn write_orders(db: &str, start: i64, count: i64) {
    setup(db);
    let out = idem(&[
        "orders",
        "--db",
        db,
        "--start",
        &start.to_string(),
        "--count",
        &count.to_string(),
    ])
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn pipeline() -> Pipeline {
    let (orders, settle, points) = (Pg::new().await, Pg::new().await, Pg::new().await);
    idem_reference::ensure_schema_postgres(settle.pool())
        .await
        .unwrap();
    write_orders(orders.url(), 1, N);
    setup(points.url());
    let relay = Proc::spawn(
        "relay",
        idem(&[
            "relay",
            "--db",
            orders.url(),
            "--brokers",
            "embedded",
            "--no-prune",
        ]),
    );
    let line = relay.wait_for_line("embedded mock cluster at ", Duration::from_secs(30));
    let brokers = line.rsplit(' ').next().unwrap().to_owned();
    let api = Proc::spawn(
        "points-api",
        idem(&[
            "points-api",
            "--db",
            points.url(),
            "--listen",
            "127.0.0.1:0",
        ]),
    );
    let line = api.wait_for_line("listening on http://", Duration::from_secs(30));
    let target = format!("{}/awards", line.rsplit(' ').next().unwrap());
    // The mock cluster creates the topic on the relay's first produce.
    eventually(
        "the relay to publish every order",
        Duration::from_secs(60),
        || async {
            (orders
                .scalar("SELECT count(*) FROM idem_outbox WHERE status = 'published'")
                .await
                == N)
                .then_some(())
        },
    )
    .await;
    let settlement = Proc::spawn(
        "settlement",
        idem(&[
            "settlement",
            "--db",
            settle.url(),
            "--brokers",
            &brokers,
            "--points-url",
            &target,
        ]),
    );
    let dispatcher = Proc::spawn(
        "dispatcher",
        idem(&[
            "effects",
            "dispatch",
            "--db",
            settle.url(),
            "--authorization",
            "Bearer settlement",
        ]),
    );
    eventually(
        "every order to be settled and awarded",
        Duration::from_secs(90),
        || async {
            (points.scalar("SELECT count(*) FROM points_awards").await == N
                && settle
                    .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'done'")
                    .await
                    == N)
                .then_some(())
        },
    )
    .await;
    Pipeline {
        orders,
        settle,
        points,
        brokers,
        _relay: relay,
        settlement,
        _api: api,
        _dispatcher: dispatcher,
        dir: tempfile::tempdir().unwrap(),
    }
}

impl Pipeline {
    /// The reference pipeline's checks, written by `idem-lab verify-config` (with the points
    /// stage or without it).
    fn config(&self, points: bool) -> String {
        let path = self.dir.path().join(format!("verify-{points}.toml"));
        let path = path.to_str().unwrap().to_owned();
        let mut args = vec![
            "verify-config",
            "--orders-db",
            self.orders.url(),
            "--settlement-db",
            self.settle.url(),
            "--out",
            &path,
        ];
        if points {
            args.extend(["--points-db", self.points.url()]);
        }
        let out = idem(&args).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        path
    }

    fn verify(&self, json: bool) -> Output {
        let config = self.config(true);
        let mut args = vec!["verify", "--config", &config];
        if json {
            args.push("--json");
        }
        idem(&args).output().unwrap()
    }

    /// Runs `idem verify --json`, checks the exit status, returns the report.
    fn report(&self, expect_status: i32) -> Value {
        let out = self.verify(true);
        assert_eq!(
            out.status.code(),
            Some(expect_status),
            "stdout: {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {report}"))
}

fn totals(check: &Value) -> &Value {
    &check["by_event_type"][0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_pipeline_verifies_clean_and_reports_the_attempts() {
    let p = pipeline().await;
    let report = p.report(0);
    assert_eq!(report["clean"], true);
    for name in ["settlements", "points"] {
        let t = totals(check(&report, name));
        assert_eq!(t["source_rows"], N, "{name}");
        assert_eq!(t["target_rows"], N, "{name}");
        assert_eq!(t["source_sum"], t["target_sum"], "{name}");
        assert_eq!(t["missing"], 0, "{name}");
        assert_eq!(t["duplicate_effects"], 0, "{name}");
    }
    assert_eq!(report["unique"][0]["rows"], N);
    assert_eq!(report["unique"][0]["duplicated_keys"], 0);
    let attempts = &report["attempts"];
    assert_eq!(attempts["outbox"][0]["published"], N);
    assert_eq!(attempts["inbox"][0]["events"], N);
    assert_eq!(attempts["effects"][0]["done"], N);
    // The table says the same for people.
    let out = p.verify(false);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("CLEAN"), "{table}");
    assert!(
        table.contains("inbox settlement @ ") && table.contains(&format!("{N} events")),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_settlement_and_a_deleted_award_are_lost_with_where_they_stopped() {
    let p = pipeline().await;
    p.settle
        .exec("DELETE FROM settlements WHERE payment_id = 'pay-7'")
        .await
        .unwrap();
    p.points
        .exec("DELETE FROM points_awards WHERE payment_id = 'pay-9'")
        .await
        .unwrap();
    // An order whose event was never enqueued (written around the outbox).
    p.orders
        .exec("INSERT INTO orders (order_id, payment_id, amount_minor, currency) VALUES ('order-x', 'pay-x', 500, 'EUR')")
        .await
        .unwrap();
    let report = p.report(1);
    assert_eq!(report["clean"], false);
    let s = check(&report, "settlements");
    assert_eq!(totals(s)["missing"], 2);
    let losses = s["losses"].as_array().unwrap();
    let stage = |key: &str| {
        losses
            .iter()
            .find(|l| l["key"] == key)
            .unwrap_or_else(|| panic!("{key} not reported lost: {losses:?}"))["stage"]
            .clone()
    };
    assert_eq!(stage("pay-7"), "processed_without_effect");
    assert_eq!(stage("pay-x"), "never_in_outbox");
    let points = check(&report, "points");
    let award = points["losses"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["key"] == "pay-9")
        .unwrap();
    assert_eq!(award["stage"], "effect_done_but_missing");
    assert!(award["event_id"].as_str().unwrap().len() == 36);
    let table = String::from_utf8_lossy(&p.verify(false).stdout).into_owned();
    assert!(
        table.contains("pay-x") && table.contains("never in the outbox"),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_duplicate_settlement_is_a_duplicate_effect() {
    let p = pipeline().await;
    p.settle
        .exec("ALTER TABLE settlements DROP CONSTRAINT settlements_payment_id_key")
        .await
        .unwrap();
    p.settle
        .exec(
            "INSERT INTO settlements (payment_id, order_id, amount_minor, currency, event_id) \
             SELECT payment_id, order_id, amount_minor, currency, event_id FROM settlements WHERE payment_id = 'pay-3'",
        )
        .await
        .unwrap();
    let report = p.report(1);
    let s = check(&report, "settlements");
    assert_eq!(totals(s)["duplicate_effects"], 1);
    assert_eq!(s["duplicates"][0]["key"], "pay-3");
    assert_eq!(s["duplicates"][0]["rows"], 2);
    assert_eq!(totals(s)["missing"], 0);
    assert_eq!(
        check(&report, "points")["by_event_type"][0]["duplicate_effects"],
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_amount_is_a_sum_gap() {
    let p = pipeline().await;
    p.settle
        .exec("UPDATE settlements SET amount_minor = amount_minor + 1 WHERE payment_id = 'pay-11'")
        .await
        .unwrap();
    let report = p.report(1);
    let s = check(&report, "settlements");
    let t = totals(s);
    assert_eq!(t["amount_mismatches"], 1);
    assert_eq!(
        t["target_sum"].as_i64().unwrap() - t["source_sum"].as_i64().unwrap(),
        1,
        "the sums differ by the change"
    );
    assert_eq!(s["mismatches"][0]["key"], "pay-11");
    let table = String::from_utf8_lossy(&p.verify(false).stdout).into_owned();
    assert!(table.contains("SUM GAP"), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_event_never_consumed_is_published_but_not_processed() {
    let mut p = pipeline().await;
    p.settlement.signal(15);
    let status = p.settlement.wait_exit(Duration::from_secs(30));
    assert!(
        status.success(),
        "the settlement stopped cleanly: {status:?}"
    );
    write_orders(p.orders.url(), N + 1, 1);
    eventually(
        "the relay to publish the new order",
        Duration::from_secs(60),
        || async {
            (p.orders
                .scalar("SELECT count(*) FROM idem_outbox WHERE status = 'published'")
                .await
                == N + 1)
                .then_some(())
        },
    )
    .await;
    let report = p.report(1);
    let key = format!("pay-{}", N + 1);
    for name in ["settlements", "points"] {
        let c = check(&report, name);
        assert_eq!(totals(c)["missing"], 1, "{name}");
        assert_eq!(c["losses"][0]["key"], key.as_str());
        assert_eq!(c["losses"][0]["stage"], "published_but_not_processed");
    }
    let _ = &p.brokers;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_config_exits_2_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("verify.toml");
    std::fs::write(
        &path,
        "[[check]]\nname = \"x\"\nsource = { db = \"postgres://127.0.0.1/x\", query = \"SELECT 1\", key = \"id; DROP\" }\ntarget = { db = \"postgres://127.0.0.1/x\", query = \"SELECT 1\", key = \"id\" }\n",
    )
    .unwrap();
    let out = idem(&["verify", "--config", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a plain column name"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_mode_exports_the_gap_as_a_gauge_and_follows_a_repair() {
    let p = pipeline().await;
    let watch = Proc::spawn(
        "verify-watch",
        idem(&[
            "verify",
            "--config",
            &p.config(false),
            "--watch",
            "100ms",
            "--metrics-addr",
            "127.0.0.1:0",
        ]),
    );
    let addr = watch.metrics_addr();
    let gap = move |kind: &'static str| {
        metric_sum(
            &http_get(addr, "/metrics"),
            "idem_reconciliation_gap",
            &[
                ("check", "settlements"),
                ("event_type", "order.paid"),
                ("kind", kind),
            ],
        )
    };
    watch.wait_for_line("idem verify: clean", Duration::from_secs(30));
    assert_eq!(gap("missing"), 0.0);
    // Move one settlement aside: the gauge shows it missing; put it back: the gauge clears.
    p.settle
        .exec("CREATE TABLE aside AS SELECT * FROM settlements WHERE payment_id = 'pay-5'")
        .await
        .unwrap();
    p.settle
        .exec("DELETE FROM settlements WHERE payment_id = 'pay-5'")
        .await
        .unwrap();
    eventually(
        "the gauge to show the gap",
        Duration::from_secs(30),
        || async { (gap("missing") == 1.0).then_some(()) },
    )
    .await;
    p.settle
        .exec("INSERT INTO settlements SELECT * FROM aside")
        .await
        .unwrap();
    eventually("the gauge to clear", Duration::from_secs(30), || async {
        (gap("missing") == 0.0).then_some(())
    })
    .await;
}
