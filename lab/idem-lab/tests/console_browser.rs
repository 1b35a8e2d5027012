//! The operator console in a real browser (Debian's Chromium, driven over WebDriver by
//! chromedriver) against the reference pipeline as OS processes — `idem-lab orders`, `idem
//! relay`, `idem-lab settlement` — on PostgreSQL and Apache Kafka: the overview's numbers are
//! the databases'; a hostile row written with SQL shows parked, is corrected and returned to
//! pending by a click, and is published and settled; a dead letter is replayed by a click after
//! its dry run and settles once; an unknown effect resolved by a click leaves an audit row; an
//! action without the credential or with a wrong CSRF token is refused; `--read-only` renders
//! no action. Every page is saved as a screenshot at 1280×800 and at a phone's width, in
//! `$CARGO_TARGET_TMPDIR/console-screenshots/` (docs/operating/console.md shows them).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use fantoccini::Locator;
use idem_conformance::backend::{Backend, Pg};
use idem_conformance::kafka;
use idem_conformance::process::{Proc, eventually};
use support::browser::{Browser, console};

mod support;

fn idem(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args(args)
        .env("RUST_LOG", "info")
        .env_remove("IDEM_CRASH_POINTS");
    cmd
}

fn run(args: &[&str]) {
    let out = idem(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The reference pipeline's databases with the reference tables, a topic and a group of this
/// test's own.
struct Pipeline {
    orders: Pg,
    settle: Pg,
    brokers: String,
    prefix: String,
    topic: String,
    group: String,
}

async fn pipeline() -> Pipeline {
    let (orders, settle) = (Pg::new().await, Pg::new().await);
    run(&["setup", "--db", orders.url()]);
    run(&["setup", "--db", settle.url()]);
    let brokers = kafka::shared();
    let prefix = format!("{}.", kafka::unique("console"));
    let topic = format!("{prefix}order");
    idem_kafka::ensure_topics(&brokers, std::slice::from_ref(&topic), 2, 1)
        .await
        .unwrap();
    Pipeline {
        orders,
        settle,
        brokers,
        prefix,
        topic,
        group: kafka::unique("settlement"),
    }
}

impl Pipeline {
    fn relay(&self) -> Proc {
        let cmd = idem(&[
            "relay",
            "--db",
            self.orders.url(),
            "--brokers",
            &self.brokers,
            "--topic-prefix",
            &self.prefix,
            "--no-prune",
        ]);
        Proc::spawn("relay", cmd)
    }

    fn settlement(&self) -> Proc {
        let cmd = idem(&[
            "settlement",
            "--db",
            self.settle.url(),
            "--brokers",
            &self.brokers,
            "--group",
            &self.group,
            "--topic",
            &self.topic,
            "--metrics-addr",
            "127.0.0.1:0",
        ]);
        Proc::spawn("settlement", cmd)
    }

    /// `idem-lab console` over both databases; its address.
    fn console(&self, extra: &[&str], metrics: Option<&str>) -> (Proc, String) {
        let orders = format!("orders={}", self.orders.url());
        let settle = format!("settlement={}", self.settle.url());
        let mut cmd = idem(&[
            "console",
            "--db",
            &orders,
            "--db",
            &settle,
            "--brokers",
            &self.brokers,
            "--topic",
            &self.topic,
            "--listen",
            "127.0.0.1:0",
            "--sample-every",
            "1s",
        ]);
        if let Some(m) = metrics {
            cmd.args(["--metrics-url", m]);
        }
        cmd.args(extra);
        console(cmd)
    }

    async fn count(&self, db: &Pg, sql: &str) -> i64 {
        db.scalar(sql).await
    }
}

/// A paid order written through the outbox contract with SQL, with its `orders` row.
async fn paid(db: &Pg, n: &str, (amount, minor): (&str, i64), extra_payload: &str) {
    db.exec(&format!(
        "INSERT INTO orders (order_id, payment_id, amount_minor, currency) VALUES ('o-{n}', 'pay-{n}', {minor}, 'EUR')"
    ))
    .await
    .unwrap();
    db.exec(&format!(
        "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', 'o-{n}', 'order.paid', jsonb_build_object(\
         'order_id', 'o-{n}', 'payment_id', 'pay-{n}', 'amount', '{amount}', 'currency', 'EUR'{extra_payload}))"
    ))
    .await
    .unwrap();
}

const SETTLED: &str = "SELECT count(*) FROM settlements";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_drives_the_reference_pipeline_in_a_browser() {
    let p = pipeline().await;
    p.settle
        .exec("ALTER TABLE settlements ADD CONSTRAINT held CHECK (amount_minor <> 500000)")
        .await
        .unwrap();
    run(&["orders", "--db", p.orders.url(), "--count", "20"]);
    paid(&p.orders, "refused", ("5000.00", 500_000), "").await;
    paid(
        &p.orders,
        "hostile",
        ("1.00", 100),
        ", 'pad', repeat('x', 1200000)",
    )
    .await;
    let _relay = p.relay();
    let service = p.settlement();
    eventually(
        "20 settled, one dead letter, one parked row",
        Duration::from_secs(90),
        || async {
            let s = p.count(&p.settle, SETTLED).await;
            let d = p
                .count(&p.settle, "SELECT count(*) FROM idem_dead_letters")
                .await;
            let k = p
                .count(
                    &p.orders,
                    "SELECT count(*) FROM idem_outbox WHERE status = 'parked'",
                )
                .await;
            (s == 20 && d == 1 && k == 1).then_some(())
        },
    )
    .await;
    for key in ["k-unknown", "k-tampered"] {
        p.settle
            .exec(&format!(
                "INSERT INTO idem_effect_intents (idem_key, effect, target, event_id, body, status, last_error, attempts) \
                 VALUES ('{key}', 'points.award', 'http://127.0.0.1:9/awards', gen_random_uuid(), '{{}}', 'unknown', \
                 'the request left; no answer within 5 s', 3)"
            ))
            .await
            .unwrap();
    }
    let metrics = format!("http://{}/metrics", service.metrics_addr());
    let verify = tempfile::NamedTempFile::new().unwrap();
    let vpath = verify.path().to_str().unwrap().to_owned();
    run(&[
        "verify-config",
        "--orders-db",
        p.orders.url(),
        "--settlement-db",
        p.settle.url(),
        "--out",
        &vpath,
    ]);
    let (_console, base) = p.console(&["--verify-config", &vpath], Some(&metrics));
    let b = Browser::open(&base).await;
    b.login().await;

    overview(&b, &p).await;
    hostile_row(&b, &p).await;
    replay(&b, &p).await;
    resolve_and_refusals(&b, &p).await;
    proof_and_audit(&b).await;
    b.close().await;
}

async fn overview(b: &Browser, p: &Pipeline) {
    b.go("/").await;
    let text = b.text().await;
    let pending = p
        .count(
            &p.orders,
            "SELECT count(*) FROM idem_outbox WHERE status = 'pending'",
        )
        .await;
    assert!(
        text.contains(&format!(
            "Outbox · orders\namber\npending\n{pending}\nparked\n1"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("Group {}\namber", p.group)),
        "{text}"
    );
    assert!(text.contains("dead letters\n1"), "{text}");
    assert!(
        text.contains("Effects → remotes · settlement\namber\npending\n0\nunknown\n2"),
        "{text}"
    );
    b.shot("overview").await;
    b.go("/consumers").await;
    let text = b.text().await;
    assert!(text.contains(&p.group) && text.contains(&p.topic), "{text}");
    b.shot("consumers").await;
}

async fn hostile_row(b: &Browser, p: &Pipeline) {
    b.go("/outbox?db=orders").await;
    let text = b.text().await;
    assert!(text.contains("o-hostile"), "{text}");
    b.shot("outbox").await;
    p.orders
        .exec("UPDATE idem_outbox SET payload = payload - 'pad' WHERE aggregate_id = 'o-hostile'")
        .await
        .unwrap();
    b.type_in(
        "tr[id^=row-] input[name=why]",
        "the writer's padding removed",
    )
    .await;
    b.click("tr[id^=row-] button").await;
    let done = b.text().await;
    let url = b.client.current_url().await.unwrap();
    assert!(
        done.contains("1 row(s) returned to pending"),
        "{url}: {done}"
    );
    eventually(
        "the corrected row published and settled",
        Duration::from_secs(60),
        || async {
            let s = p
                .count(
                    &p.settle,
                    "SELECT count(*) FROM settlements WHERE payment_id = 'pay-hostile'",
                )
                .await;
            (s == 1).then_some(())
        },
    )
    .await;
}

async fn replay(b: &Browser, p: &Pipeline) {
    p.settle
        .exec("ALTER TABLE settlements DROP CONSTRAINT held")
        .await
        .unwrap();
    b.go("/consumers").await;
    b.click("a[href^='/consumers/replay']").await;
    let dry = b.text().await;
    assert!(
        dry.contains("nothing has changed") && dry.contains("be handed to the group's consumer"),
        "{dry}"
    );
    b.shot("replay-dry-run").await;
    assert_eq!(
        p.count(
            &p.settle,
            "SELECT count(*) FROM idem_dead_letters WHERE replay_requested_at IS NOT NULL"
        )
        .await,
        0
    );
    b.type_in("input[name=why]", "the rule is lifted").await;
    b.click("button.primary").await;
    let done = b.text().await;
    assert!(done.contains("1 replay(s) requested"), "{done}");
    eventually(
        "the dead letter settled",
        Duration::from_secs(30),
        || async {
            let done = p
                .count(
                    &p.settle,
                    "SELECT count(*) FROM idem_dead_letters WHERE replay_outcome = 'applied'",
                )
                .await;
            (done == 1).then_some(())
        },
    )
    .await;
    assert_eq!(
        p.count(
            &p.settle,
            "SELECT count(*) FROM settlements WHERE payment_id = 'pay-refused'"
        )
        .await,
        1
    );
    b.go(&format!(
        "/consumers/letters?db=settlement&group={}&all=1",
        p.group
    ))
    .await;
    assert!(b.text().await.contains("applied"));
    b.shot("dead-letters").await;
}

async fn resolve_and_refusals(b: &Browser, p: &Pipeline) {
    let unknown = "SELECT count(*) FROM idem_effect_intents WHERE status = 'unknown'";
    let audit = "SELECT count(*) FROM idem_audit";
    b.go("/effects?db=settlement").await;
    b.shot("effects").await;
    let first = "tr[id^=intent-]:first-of-type";
    b.type_in(
        &format!("{first} input[name=why]"),
        "the remote shows the award",
    )
    .await;
    b.client
        .find(Locator::Css(&format!("{first} select")))
        .await
        .unwrap()
        .select_by_value("applied")
        .await
        .unwrap();
    b.click(&format!("{first} button")).await;
    assert!(b.text().await.contains("applied"));
    assert_eq!(p.count(&p.settle, unknown).await, 1);
    assert_eq!(
        p.count(
            &p.settle,
            "SELECT count(*) FROM idem_audit WHERE action = 'effects.applied' AND actor = 'ana'"
        )
        .await,
        1
    );

    // A wrong CSRF token: refused, nothing changes, nothing is audited.
    let audited = p.count(&p.settle, audit).await;
    b.go("/effects?db=settlement").await;
    b.client
        .execute(
            "document.querySelectorAll('input[name=csrf]').forEach(e => e.value = 'forged')",
            vec![],
        )
        .await
        .unwrap();
    b.type_in(&format!("{first} input[name=why]"), "forged")
        .await;
    b.click(&format!("{first} button")).await;
    let refused = b.text().await;
    assert!(
        refused.contains("CSRF token is not this session's"),
        "{refused}"
    );
    assert_eq!(p.count(&p.settle, unknown).await, 1);
    assert_eq!(p.count(&p.settle, audit).await, audited);

    // No credential: the session's cookie gone, the same click lands on the login page.
    b.go("/effects?db=settlement").await;
    b.client.delete_all_cookies().await.unwrap();
    b.type_in(&format!("{first} input[name=why]"), "no session")
        .await;
    b.click(&format!("{first} button")).await;
    assert!(
        b.client
            .current_url()
            .await
            .unwrap()
            .path()
            .ends_with("/login")
    );
    assert_eq!(p.count(&p.settle, unknown).await, 1);
    assert_eq!(p.count(&p.settle, audit).await, audited);
    b.shot("login").await;
    b.login().await;
}

async fn proof_and_audit(b: &Browser) {
    b.go("/proof").await;
    b.click("form[action='/proof/run'] button").await;
    let verdict = eventually("a verdict", Duration::from_secs(60), || async {
        b.go("/proof").await;
        let t = b.text().await;
        t.contains("Verified").then_some(t)
    })
    .await;
    assert!(verdict.contains("clean"), "{verdict}");
    b.shot("proof").await;
    b.go("/audit?db=settlement").await;
    let text = b.text().await;
    for action in ["dead_letters.replay", "effects.applied"] {
        assert!(text.contains(action), "{text}");
    }
    b.shot("audit").await;
    b.go("/audit?db=orders").await;
    assert!(b.text().await.contains("outbox.retry"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_console_renders_no_action_in_a_browser() {
    let p = pipeline().await;
    run(&["orders", "--db", p.orders.url(), "--count", "3"]);
    p.orders
        .exec("UPDATE idem_outbox SET status = 'parked', last_error = 'parked by the test'")
        .await
        .unwrap();
    p.settle
        .exec(
            "INSERT INTO idem_dead_letters (consumer_group, topic, record_partition, record_offset, reason, payload) \
             VALUES ('settlement', 't', 0, 1, 'refused', '{}')",
        )
        .await
        .unwrap();
    let (_console, base) = p.console(&["--read-only"], None);
    let b = Browser::open(&base).await;
    b.login().await;
    for path in [
        "/",
        "/outbox?db=orders",
        "/consumers",
        "/consumers/letters?db=settlement&group=settlement",
        "/effects?db=settlement",
        "/proof",
        "/audit",
    ] {
        b.go(path).await;
        let text = b.text().await;
        assert!(!text.is_empty(), "{path}");
        assert_eq!(b.forms().await, 0, "{path} offers an action: {text}");
        assert!(
            !text.contains("replay…") && !text.contains("return to pending"),
            "{path}: {text}"
        );
    }
    b.go("/outbox?db=orders").await;
    assert!(b.text().await.contains("parked by the test"));
    b.close().await;
}
