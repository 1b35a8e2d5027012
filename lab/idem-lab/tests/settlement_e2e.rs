//! The reference pipeline as real OS processes — `idem-lab orders`, `idem relay`, `idem-lab settlement`
//! — against real PostgreSQL databases (an order DB and a settlement DB) and Apache Kafka (the
//! suite's shared broker; each test its own topic and consumer group): a consumer crash between
//! the database commit and the offset commit, and two consumers in one group with rebalances in
//! the middle of a run, under both group protocols (classic and KIP-848).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use idem_conformance::backend::{Backend, Pg};
use idem_conformance::kafka;
use idem_conformance::process::{Proc, eventually, http_get, metric_sum};

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

async fn databases() -> (Pg, Pg) {
    let (orders, settle) = (Pg::new().await, Pg::new().await);
    idem_reference::ensure_schema_postgres(settle.pool())
        .await
        .unwrap();
    (orders, settle)
}

/// The shared broker, with this test's own topic (`<prefix>order`) and consumer group.
struct Kafka {
    brokers: String,
    prefix: String,
    topic: String,
    group: String,
}

async fn broker(partitions: i32) -> Kafka {
    let brokers = kafka::shared();
    let prefix = format!("{}.", kafka::unique("settlement-e2e"));
    let topic = format!("{prefix}order");
    idem_kafka::ensure_topics(&brokers, std::slice::from_ref(&topic), partitions, 1)
        .await
        .unwrap();
    Kafka {
        brokers,
        prefix,
        topic,
        group: kafka::unique("settlement"),
    }
}

fn write_orders(db: &str, count: u64) {
    setup(db);
    let out = idem(&["orders", "--db", db, "--count", &count.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn relay(db: &str, k: &Kafka) -> Proc {
    Proc::spawn(
        "relay",
        idem(&[
            "relay",
            "--db",
            db,
            "--brokers",
            &k.brokers,
            "--topic-prefix",
            &k.prefix,
            "--no-prune",
        ]),
    )
}

fn settlement(db: &str, k: &Kafka, extra: &[&str]) -> Command {
    let mut cmd = idem(&[
        "settlement",
        "--db",
        db,
        "--brokers",
        &k.brokers,
        "--group",
        &k.group,
        "--topic",
        &k.topic,
        "--metrics-addr",
        "127.0.0.1:0",
        "--batch-size",
        "50",
    ]);
    cmd.args(extra);
    cmd
}

fn committed(brokers: &str, group: &str, topic: &str) -> Vec<(i32, i64)> {
    idem_kafka::inspect::committed_offsets(brokers, group, topic, Duration::from_secs(10))
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_db_commit_before_offset_commit_redelivers_and_skips() {
    let ((orders, settle), k) = (databases().await, broker(1).await);
    write_orders(orders.url(), 1);
    let _relay = relay(orders.url(), &k);

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("crashes");
    let mut cmd = settlement(settle.url(), &k, &[]);
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
    let (b, g, t) = (k.brokers.clone(), k.group.clone(), k.topic.clone());
    let before = tokio::task::spawn_blocking(move || committed(&b, &g, &t))
        .await
        .unwrap();
    assert!(
        before.iter().all(|(_, o)| *o == 0),
        "no offset was committed before the crash: {before:?}"
    );

    let second = Proc::spawn("settlement-2", settlement(settle.url(), &k, &[]));
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
        let (b, g, t) = (k.brokers.clone(), k.group.clone(), k.topic.clone());
        let c = tokio::task::spawn_blocking(move || committed(&b, &g, &t))
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
        ("consumer_group", k.group.as_str()),
        ("topic", k.topic.as_str()),
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
/// SIGKILLed mid-run, on Kafka with the classic group protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_with_rebalances_settle_every_event_once_classic_protocol() {
    rebalances_settle_every_event_once(&[]).await;
}

/// The same with KIP-848's consumer group protocol (`group.protocol=consumer`): the broker
/// assigns partitions incrementally and owns the session timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_with_rebalances_settle_every_event_once_kip848_protocol() {
    rebalances_settle_every_event_once(&["--consumer-config", "group.protocol=consumer"]).await;
}

/// No step waits on how fast anything runs: the first orders are all settled by A before B
/// joins, the rest are written only after the rebalance (at a bounded rate), and A is killed
/// while that writer is still running, so the kill always lands mid-run.
#[allow(clippy::too_many_lines)] // one scripted scenario, read top to bottom
async fn rebalances_settle_every_event_once(protocol: &[&str]) {
    const FIRST: i64 = 600;
    const SECOND: i64 = 2400;
    const N: i64 = FIRST + SECOND;
    let ((orders, settle), k) = (databases().await, broker(4).await);
    let settled = "SELECT count(*) FROM settlements";
    write_orders(orders.url(), FIRST as u64);
    let _relay = relay(orders.url(), &k);

    let mut a = Proc::spawn("settlement-a", settlement(settle.url(), &k, protocol));
    eventually(
        "consumer A alone to settle the first orders",
        Duration::from_secs(120),
        || async { (settle.scalar(settled).await == FIRST).then_some(()) },
    )
    .await;
    // B joins: A gives up some of its partitions.
    let b = Proc::spawn("settlement-b", settlement(settle.url(), &k, protocol));
    eventually(
        "the rebalance after B joined (A revoked, B assigned)",
        Duration::from_secs(120),
        || async {
            let revoked = a.log().iter().any(|l| l.contains("partitions revoked"));
            let assigned = b
                .log()
                .iter()
                .any(|l| l.contains("partitions assigned") && !l.contains("partitions=0"));
            (revoked && assigned).then_some(())
        },
    )
    .await;
    // Only now are the other orders written, 250 a second: about 10 s of work for both.
    let mut writer = Proc::spawn(
        "writer",
        idem(&[
            "orders",
            "--db",
            orders.url(),
            "--count",
            &SECOND.to_string(),
            "--start",
            &(FIRST + 1).to_string(),
            "--rate",
            "250",
        ]),
    );
    eventually(
        "the group to settle orders written after the rebalance",
        Duration::from_secs(120),
        || async { (settle.scalar(settled).await >= FIRST + 300).then_some(()) },
    )
    .await;
    // A dies without leaving the group, while orders are still being written.
    let written_at_kill = orders.scalar("SELECT count(*) FROM orders").await;
    a.kill9();
    let at_kill = settle.scalar(settled).await;
    assert!(
        written_at_kill < N,
        "the kill came mid-run ({written_at_kill} of {N} orders written)"
    );
    let status = writer.wait_exit(Duration::from_secs(120));
    assert!(status.success(), "the writer failed: {status:?}");
    eventually(
        "every order to be settled",
        Duration::from_secs(180),
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
            .scalar(&format!(
                "SELECT count(*) FROM idem_inbox WHERE consumer_group = '{}'",
                k.group
            ))
            .await,
        N
    );
    let sum = "SELECT sum(amount_minor)::bigint FROM ";
    assert_eq!(
        settle.scalar(&format!("{sum} settlements")).await,
        orders.scalar(&format!("{sum} orders")).await,
        "amounts reconcile"
    );
    // A's partitions went to B: B settled orders that were written after A died.
    let b_assignments = b
        .log()
        .iter()
        .filter(|l| l.contains("partitions assigned") && !l.contains("partitions=0"))
        .count();
    assert!(
        b_assignments >= 2,
        "B was assigned A's partitions after A died: {b_assignments} assignments"
    );
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
#[allow(clippy::too_many_lines)] // one scripted scenario, read top to bottom
async fn every_paid_order_gets_one_points_award_through_the_effect_stage() {
    const N: i64 = 200;
    let ((orders, settle), k) = (databases().await, broker(2).await);
    let points = Pg::new().await;
    setup(points.url());
    write_orders(orders.url(), N as u64);
    let _relay = relay(orders.url(), &k);
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
    let mut cmd = settlement(settle.url(), &k, &[]);
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

/// A static group member fenced by another with the same `group.instance.id` has a fatal
/// librdkafka error: its client can never consume again (librdkafka#3437: a member can even
/// fence itself after a session timeout, which wedged a chaos run). `idem-lab settlement` then
/// exits with the reason, for its supervisor to restart it, instead of idling forever with
/// its partitions stuck; the member that took its place settles what is written next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_consumer_exits_with_the_reason_instead_of_idling() {
    let (orders, settle) = databases().await;
    let k = broker(2).await;
    let member = kafka::unique("member");
    let same_id = ["--consumer-config", &format!("group.instance.id={member}")];
    let mut a = Proc::spawn("settlement-a", settlement(settle.url(), &k, &same_id));
    a.wait_for_line("partitions assigned", Duration::from_secs(60));
    let mut b = Proc::spawn("settlement-b", settlement(settle.url(), &k, &same_id));

    let status = a.wait_exit(Duration::from_secs(60));
    assert!(!status.success(), "a fenced consumer exited cleanly");
    let log = a.log().join("\n");
    assert!(
        log.contains("fatal broker client error") && log.contains("group.instance.id"),
        "the exit does not give the reason:\n{log}"
    );

    b.wait_for_line("partitions assigned", Duration::from_secs(60));
    write_orders(orders.url(), 50);
    let mut relay = relay(orders.url(), &k);
    eventually(
        "the new member to settle 50 orders",
        Duration::from_secs(60),
        || async { (settle.scalar("SELECT count(*) FROM settlements").await == 50).then_some(()) },
    )
    .await;
    relay.kill9();
    b.kill9();
}

/// An `order.paid` event of order `o-N`, written through the SQL contract.
async fn insert_order(db: &Pg, n: u32) {
    sqlx::query(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', 'o-' || $1, 'order.paid', jsonb_build_object(\
         'order_id', 'o-' || $1, 'payment_id', 'pay-' || $1, 'amount', '1.00', 'currency', 'EUR'))",
    )
    .bind(n.to_string())
    .execute(db.pool())
    .await
    .unwrap();
}

async fn count(db: &Pg, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(db.pool()).await.unwrap()
}

/// `idem prune` of the inbox at a declared redelivery horizon of 2 s, until it deleted it all.
async fn prune_inbox_at_the_horizon(db: &Pg) {
    eventually(
        "the inbox pruned at the horizon",
        Duration::from_secs(30),
        || async {
            let out = idem(&[
                "prune",
                "--db",
                db.url(),
                "--inbox-older-than",
                "2s",
                "--redelivery-horizon",
                "2s",
            ])
            .output()
            .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            (count(db, "SELECT count(*) FROM idem_inbox").await == 0).then_some(())
        },
    )
    .await;
}

/// A CDC mark that fails (the row locked past the database's `lock_timeout`) is made again in
/// the same session, so the event is never left pending to be published again by a later
/// session: the settlement applies it once, the inbox is pruned at the declared redelivery
/// horizon, and the relay's next session publishes no copy that the pruned inbox would apply a
/// second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_cdc_mark_then_a_prune_at_the_horizon_still_applies_once() {
    let (db, k) = (Pg::new().await, broker(1).await);
    idem_reference::ensure_schema_postgres(db.pool())
        .await
        .unwrap();
    let timeout = "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET lock_timeout = 300', \
                   current_database()); END $$";
    db.exec(timeout).await.unwrap();
    let (slot, topic) = (
        kafka::unique("horizon").replace('-', "_"),
        format!("order={}", k.topic),
    );
    let argv = [
        "cdc",
        "relay",
        "--db",
        db.url(),
        "--brokers",
        &k.brokers,
        "--slot",
        &slot,
        "--topic",
        &topic,
    ];
    let mut relay = Proc::spawn("cdc", idem(&argv));
    relay.wait_for_line("CDC session started", Duration::from_secs(60));
    let mut consumer = Proc::spawn("settlement", settlement(db.url(), &k, &[]));

    // Order 1's mark waits on a lock longer than the database's lock_timeout.
    insert_order(&db, 1).await;
    let mut lock = db.pool().begin().await.unwrap();
    sqlx::query("SELECT id FROM idem_outbox WHERE aggregate_id = 'o-1' FOR UPDATE")
        .execute(&mut *lock)
        .await
        .unwrap();
    relay.wait_for_line("marking published rows failed", Duration::from_secs(30));
    lock.commit().await.unwrap();
    let applied = |payment: &str| {
        let sql =
            format!("SELECT count(*) FROM settlement_applications WHERE payment_id = '{payment}'");
        let db = &db;
        async move { count(db, &sql).await }
    };
    eventually(
        "o-1 applied and marked published",
        Duration::from_secs(60),
        || async {
            let published = count(
                &db,
                "SELECT count(*) FROM idem_outbox WHERE status = 'published'",
            );
            (applied("pay-1").await == 1 && published.await == 1).then_some(())
        },
    )
    .await;

    prune_inbox_at_the_horizon(&db).await;
    relay.signal(15);
    assert!(relay.wait_exit(Duration::from_secs(30)).success());
    let mut relay = Proc::spawn("cdc", idem(&argv));
    relay.wait_for_line("CDC session started", Duration::from_secs(60));
    // Once order 2, written after the restart, is applied, the session published all it would.
    insert_order(&db, 2).await;
    eventually("order 2 applied", Duration::from_secs(60), || async {
        (applied("pay-2").await == 1).then_some(())
    })
    .await;
    assert_eq!(applied("pay-1").await, 1, "pay-1 applied twice");
    for p in [&mut relay, &mut consumer] {
        p.signal(15);
        p.wait_exit(Duration::from_secs(30));
    }
    db.exec(&format!("SELECT pg_drop_replication_slot('{slot}')"))
        .await
        .unwrap();
}

/// `dead-letters replay` against the running settlement service: a payment its handler refuses
/// (a rule the test adds to the settlements table) is dead-lettered while the others settle; the
/// dry run lists it and changes nothing; a confirmed replay while the rule holds is served,
/// fails and keeps the letter; once the rule is gone a confirmed replay settles the payment
/// once, and a further replay of that letter is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_is_replayed_once_through_the_running_consumer() {
    let ((orders, settle), k) = (databases().await, broker(1).await);
    setup(orders.url());
    settle
        .exec("ALTER TABLE settlements ADD CONSTRAINT held CHECK (amount_minor <> 500000)")
        .await
        .unwrap();
    insert_order(&orders, 1).await;
    sqlx::query(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', 'o-2', 'order.paid', jsonb_build_object(\
         'order_id', 'o-2', 'payment_id', 'pay-2', 'amount', '5000.00', 'currency', 'EUR'))",
    )
    .execute(orders.pool())
    .await
    .unwrap();
    let _relay = relay(orders.url(), &k);
    let service = Proc::spawn("settlement", settlement(settle.url(), &k, &[]));
    eventually(
        "one settled, one dead-lettered",
        Duration::from_secs(60),
        || async {
            let s = count(&settle, "SELECT count(*) FROM settlements").await;
            let d = count(&settle, "SELECT count(*) FROM idem_dead_letters").await;
            (s == 1 && d == 1).then_some(())
        },
    )
    .await;
    let replay = |extra: &[&str]| {
        let mut cmd = idem(&[
            "dead-letters",
            "replay",
            "--db",
            settle.url(),
            "--group",
            &k.group,
            "--by",
            "on-call",
        ]);
        cmd.args(extra);
        let o = cmd.output().unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (o.status.success(), text(&o.stdout), text(&o.stderr))
    };
    let requested = "SELECT count(*) FROM idem_dead_letters WHERE replay_requested_at IS NOT NULL";

    let (ok, out, err) = replay(&["--all"]);
    assert!(
        ok && out.contains("would replay") && out.contains("--confirm"),
        "{out}{err}"
    );
    assert_eq!(
        count(&settle, requested).await,
        0,
        "the dry run requests nothing"
    );

    let (ok, out, err) = replay(&["--all", "--confirm"]);
    assert!(!ok && err.contains("1 of 1 replays failed"), "{out}{err}");
    assert!(
        out.contains("replay: failed") && out.contains("held"),
        "{out}"
    );
    assert_eq!(count(&settle, "SELECT count(*) FROM settlements").await, 1);

    settle
        .exec("ALTER TABLE settlements DROP CONSTRAINT held")
        .await
        .unwrap();
    let (ok, out, err) = replay(&["--all", "--confirm"]);
    assert!(
        ok && out.contains("replay: applied") && out.contains("by on-call"),
        "{out}{err}"
    );
    assert_eq!(
        count(
            &settle,
            "SELECT count(*) FROM settlements WHERE payment_id = 'pay-2'"
        )
        .await,
        1
    );
    let letter = count(&settle, "SELECT id FROM idem_dead_letters")
        .await
        .to_string();
    let (ok, _, err) = replay(&["--id", &letter, "--confirm"]);
    assert!(!ok && err.contains("no open dead letter"), "{err}");
    assert_eq!(count(&settle, "SELECT count(*) FROM settlements").await, 2);
    let metrics = http_get(service.metrics_addr(), "/metrics");
    for (outcome, n) in [("failed", 1.0), ("applied", 1.0)] {
        let labels = [("consumer_group", k.group.as_str()), ("outcome", outcome)];
        assert_eq!(
            metric_sum(&metrics, "idem_consumer_replays_total", &labels),
            n,
            "{outcome}"
        );
    }
}
