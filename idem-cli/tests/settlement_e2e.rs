//! The reference pipeline as real OS processes — `idem orders`, `idem relay`, `idem settlement`
//! — against real PostgreSQL databases (an order DB and a settlement DB) and a Tansu broker:
//! a consumer crash between the database commit and the offset commit, and two consumers in
//! one group with rebalances in the middle of a run.
#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use idem_conformance::backend::{Backend, Pg};
use idem_conformance::process::{Proc, eventually, http_get, metric_sum};
use idem_conformance::tansu::Tansu;

const TOPIC: &str = "outbox.event.order";

fn idem(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args)
        .env("RUST_LOG", "info")
        .env_remove("IDEM_CRASH_POINTS");
    cmd
}

async fn databases() -> (Pg, Pg) {
    let (orders, settle) = (Pg::new().await, Pg::new().await);
    idem_reference::ensure_schema_postgres(settle.pool())
        .await
        .unwrap();
    (orders, settle)
}

async fn broker(partitions: i32) -> Tansu {
    let t = Tansu::start();
    idem_kafka::ensure_topics(&t.brokers(), &[TOPIC.to_owned()], partitions, 1)
        .await
        .unwrap();
    t
}

fn write_orders(db: &str, count: u64) {
    let out = idem(&["orders", "--db", db, "--count", &count.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn relay(db: &str, brokers: &str) -> Proc {
    Proc::spawn(
        "relay",
        idem(&["relay", "--db", db, "--brokers", brokers, "--no-prune"]),
    )
}

fn settlement(db: &str, brokers: &str) -> Command {
    idem(&[
        "settlement",
        "--db",
        db,
        "--brokers",
        brokers,
        "--metrics-addr",
        "127.0.0.1:0",
        "--batch-size",
        "50",
    ])
}

fn committed(brokers: &str) -> Vec<(i32, i64)> {
    idem_kafka::inspect::committed_offsets(brokers, "settlement", TOPIC, Duration::from_secs(10))
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_db_commit_before_offset_commit_redelivers_and_skips() {
    let ((orders, settle), tansu) = (databases().await, broker(1).await);
    let brokers = tansu.brokers();
    write_orders(orders.url(), 1);
    let _relay = relay(orders.url(), &brokers);

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("crashes");
    let mut cmd = settlement(settle.url(), &brokers);
    cmd.env(
        "IDEM_CRASH_POINTS",
        "consumer.after_db_commit_before_offset_commit",
    )
    .env("IDEM_CRASH_LOG", &log);
    let mut first = Proc::spawn("settlement-1", cmd);
    let status = first.wait_exit(Duration::from_secs(60));
    assert_eq!(
        status.signal(),
        Some(6),
        "the consumer did not abort: {status:?}"
    );
    assert_eq!(
        std::fs::read_to_string(&log).unwrap().trim(),
        "consumer.after_db_commit_before_offset_commit"
    );
    assert_eq!(
        settle.scalar("SELECT count(*) FROM settlements").await,
        1,
        "the database committed"
    );
    assert_eq!(
        settle
            .scalar("SELECT delivery_count::bigint FROM idem_inbox")
            .await,
        1
    );
    let b = brokers.clone();
    let before = tokio::task::spawn_blocking(move || committed(&b))
        .await
        .unwrap();
    assert!(
        before.iter().all(|(_, o)| *o == 0),
        "no offset was committed before the crash: {before:?}"
    );

    let second = Proc::spawn("settlement-2", settlement(settle.url(), &brokers));
    let metrics = second.metrics_addr();
    eventually(
        "the event to be delivered again",
        Duration::from_secs(60),
        || async {
            (settle
                .scalar("SELECT delivery_count::bigint FROM idem_inbox")
                .await
                == 2)
                .then_some(())
        },
    )
    .await;
    let moved = eventually("the offset to move on", Duration::from_secs(30), || async {
        let b = brokers.clone();
        let c = tokio::task::spawn_blocking(move || committed(&b))
            .await
            .unwrap();
        (c.iter().map(|(_, o)| o).sum::<i64>() == 1).then_some(c)
    })
    .await;
    assert_eq!(moved, vec![(0, 1)]);
    assert_eq!(
        settle.scalar("SELECT count(*) FROM settlements").await,
        1,
        "still one settlement"
    );
    let body = http_get(metrics, "/metrics");
    let labels = [
        ("consumer_group", "settlement"),
        ("topic", TOPIC),
        ("event_type", "order.paid"),
    ];
    assert_eq!(
        metric_sum(&body, "idem_duplicate_skip_total", &labels),
        1.0,
        "{body}"
    );
    assert_eq!(
        metric_sum(&body, "idem_duplicate_delivery_total", &labels),
        1.0
    );
    assert_eq!(
        metric_sum(&body, "idem_consumer_processed_total", &labels),
        0.0
    );
}

/// Two settlement processes in one group, with a rebalance when B joins and another when A is
/// SIGKILLed mid-run. The broker is librdkafka's mock cluster, hosted by the relay process
/// (`--brokers embedded`): Tansu 0.6.0 does not move a dead member's partitions to the
/// survivors, so group rebalancing is tested against the mock cluster's coordinator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_in_one_group_with_rebalances_settle_every_event_once() {
    const N: i64 = 3000;
    let (orders, settle) = databases().await;
    write_orders(orders.url(), N as u64);
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
    // The mock cluster creates the topic on the relay's first produce.
    eventually(
        "the relay to publish the first orders",
        Duration::from_secs(60),
        || async {
            (orders
                .scalar("SELECT count(*) FROM idem_outbox WHERE status = 'published'")
                .await
                > 0)
            .then_some(())
        },
    )
    .await;
    let settled = "SELECT count(*) FROM settlements";

    let mut a = Proc::spawn("settlement-a", settlement(settle.url(), &brokers));
    eventually(
        "consumer A to make progress",
        Duration::from_secs(60),
        || async { (settle.scalar(settled).await >= 300).then_some(()) },
    )
    .await;
    // B joins: the group rebalances while A is busy.
    let b = Proc::spawn("settlement-b", settlement(settle.url(), &brokers));
    b.wait_for_line("partitions assigned", Duration::from_secs(60));
    let at_join = settle.scalar(settled).await;
    eventually(
        "the group to make progress after the rebalance",
        Duration::from_secs(60),
        || async { (settle.scalar(settled).await >= at_join + 300).then_some(()) },
    )
    .await;
    // A dies without leaving the group: after its session times out, B takes its partitions.
    a.kill9();
    let at_kill = settle.scalar(settled).await;
    assert!(
        at_kill < N,
        "the kill came mid-run ({at_kill} of {N} settled)"
    );
    eventually(
        "every order to be settled",
        Duration::from_secs(120),
        || async { (settle.scalar(settled).await == N).then_some(()) },
    )
    .await;

    assert_eq!(
        settle
            .scalar("SELECT count(DISTINCT payment_id) FROM settlements")
            .await,
        N
    );
    assert_eq!(
        settle
            .scalar("SELECT count(*) FROM idem_inbox WHERE consumer_group = 'settlement'")
            .await,
        N
    );
    let sum = "SELECT sum(amount_minor)::bigint FROM ";
    assert_eq!(
        settle.scalar(&format!("{sum} settlements")).await,
        orders.scalar(&format!("{sum} orders")).await,
        "amounts reconcile"
    );
    let a_log = a.log().join("\n");
    assert!(
        a_log.contains("partitions revoked"),
        "A went through the rebalance when B joined"
    );
    // After A's session times out the group rebalances again and B takes A's partitions (B may
    // already have settled everything left if A's partitions were drained before the kill).
    eventually(
        "B to be assigned again after A died",
        Duration::from_secs(60),
        || async { (b.log().join("\n").matches("partitions assigned").count() >= 2).then_some(()) },
    )
    .await;
    let dups = settle
        .scalar("SELECT (sum(delivery_count) - count(*))::bigint FROM idem_inbox")
        .await;
    eprintln!(
        "settled {N} once each; {dups} duplicate deliveries absorbed; {at_kill} settled when A was killed"
    );
}

/// The whole reference pipeline with the effect stage: orders → relay → settlement (one
/// `points.award` intent per payment, in the settlement transaction) → dispatcher → points API,
/// with the dispatcher aborted between an award and recording it. Every paid order gets exactly
/// one award in the points API's own database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_paid_order_gets_one_points_award_through_the_effect_stage() {
    const N: i64 = 200;
    let ((orders, settle), tansu) = (databases().await, broker(2).await);
    let points = Pg::new().await;
    let brokers = tansu.brokers();
    write_orders(orders.url(), N as u64);
    let _relay = relay(orders.url(), &brokers);
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
    let mut cmd = settlement(settle.url(), &brokers);
    cmd.args(["--points-url", &target]);
    let _settlement = Proc::spawn("settlement", cmd);

    let dispatch = |crash: Option<&std::path::Path>| {
        let mut cmd = idem(&[
            "effects",
            "dispatch",
            "--db",
            settle.url(),
            "--authorization",
            "Bearer settlement",
            "--timeout",
            "5s",
        ]);
        if let Some(log) = crash {
            cmd.env(
                "IDEM_CRASH_POINTS",
                "effect.after_http_success_before_record@40",
            )
            .env("IDEM_CRASH_LOG", log);
        }
        cmd
    };
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("crashes");
    let mut first = Proc::spawn("dispatcher-1", dispatch(Some(&log)));
    let status = first.wait_exit(Duration::from_secs(120));
    assert_eq!(
        status.signal(),
        Some(6),
        "the dispatcher did not abort: {status:?}"
    );
    assert_eq!(
        std::fs::read_to_string(&log).unwrap().trim(),
        "effect.after_http_success_before_record"
    );
    let awards = "SELECT count(*) FROM points_awards";
    assert!(points.scalar(awards).await >= 40, "awards before the crash");

    let _second = Proc::spawn("dispatcher-2", dispatch(None));
    eventually(
        "every intent to be done",
        Duration::from_secs(120),
        || async {
            (settle
                .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'done'")
                .await
                == N)
                .then_some(())
        },
    )
    .await;
    assert_eq!(settle.scalar("SELECT count(*) FROM settlements").await, N);
    assert_eq!(
        settle
            .scalar("SELECT count(*) FROM idem_effect_intents")
            .await,
        N,
        "one intent per payment"
    );
    assert_eq!(points.scalar(awards).await, N, "one award per paid order");
    assert_eq!(
        points
            .scalar("SELECT count(DISTINCT payment_id) FROM points_awards")
            .await,
        N
    );
    assert!(
        settle
            .scalar("SELECT count(*) FROM idem_effect_intents WHERE attempts > 1")
            .await
            >= 1,
        "the award whose outcome was lost in the crash was sent again (and replayed)"
    );
    let sum = "SELECT sum(points)::bigint FROM points_awards";
    let expected: i64 = (1..=N as u64)
        .map(|n| {
            idem_reference::points_for(idem_reference::PaidOrder::numbered("", n).amount_minor)
        })
        .sum();
    assert_eq!(points.scalar(sum).await, expected, "points reconcile");
}
