//! The effect dispatcher and the points API as real processes: the dispatcher is aborted after
//! the API applied the award and before the outcome was recorded; restarted, it sends the same
//! key, the API replays, and there is one award. Against the API's route that ignores keys
//! (`POST /keyless/awards`) the dispatcher is aborted at its crash points and SIGKILLed, and no
//! payment is ever awarded twice; with the sending mark broken (`IDEM_BREAK=skip-sending-mark`,
//! the negative control) a payment is. Behind a fault proxy that holds the API's answers, a
//! dispatcher whose request was applied but never answered sends the same key again.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use idem_conformance::backend::{Backend, Lite, OpenTx, Pg};
use idem_conformance::process::{Proc, eventually};
use idem_core::EventId;
use idem_core::idempotency::EffectIntent;

fn idem(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args(args)
        .env("RUST_LOG", "info")
        .env_remove("IDEM_CRASH_POINTS");
    cmd
}

/// The effect dispatcher over the settlement database `client_url`, a 2 s request timeout.
fn dispatcher(client_url: &str) -> Command {
    idem(&[
        "effects",
        "dispatch",
        "--db",
        client_url,
        "--authorization",
        "Bearer settlement",
        "--timeout",
        "2s",
    ])
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

/// A settlement (client) and a points (server) database, and the points API over the server
/// one: (client, server, client URL, the API process, its base URL).
async fn points_api() -> (Lite, Lite, String, Proc, String) {
    let (client, server) = (Lite::new().await, Lite::new().await);
    let client_url = format!("sqlite://{}", client.path().display());
    let (api, base) = spawn_points_api(&server);
    (client, server, client_url, api, base)
}

/// The points API over `server`, and its base URL.
fn spawn_points_api(server: &Lite) -> (Proc, String) {
    let server_url = format!("sqlite://{}", server.path().display());
    setup(&server_url);
    let api = Proc::spawn(
        "points-api",
        idem(&["points-api", "--db", &server_url, "--listen", "127.0.0.1:0"]),
    );
    let line = api.wait_for_line("listening on http://", Duration::from_secs(30));
    let base = line.rsplit(' ').next().unwrap().to_owned();
    (api, base)
}

/// Waits until the one intent of `client` is recorded done, then checks that `server` holds
/// one award: the retry was replayed.
async fn done_with_one_award(client: &Lite, server: &Lite) {
    eventually(
        "the intent to be recorded done",
        Duration::from_secs(60),
        || async {
            (client
                .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'done'")
                .await
                == 1)
                .then_some(())
        },
    )
    .await;
    let awards = server.scalar("SELECT count(*) FROM points_awards").await;
    assert_eq!(awards, 1, "one award: the retry was replayed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_killed_after_the_award_resends_the_same_key_and_the_api_replays() {
    let (client, server, client_url, _api, base) = points_api().await;
    let target = format!("{base}/awards");

    let intent = EffectIntent {
        event_id: EventId::new(),
        effect: "points.award".into(),
        target,
        body: serde_json::json!({"order_id": "order-1", "payment_id": "pay-1", "points": 12}),
        traceparent: None,
    };
    let mut tx = client.begin().await;
    tx.record_intent(&intent).await.unwrap();
    tx.commit().await;

    let dispatch = |crash: bool| {
        let mut cmd = dispatcher(&client_url);
        if crash {
            cmd.env(
                "IDEM_CRASH_POINTS",
                "effect.after_http_success_before_record",
            );
        }
        cmd
    };
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("crashes");
    let mut first_cmd = dispatch(true);
    first_cmd.env("IDEM_CRASH_LOG", &log);
    let mut first = Proc::spawn("dispatcher-1", first_cmd);
    let status = first.wait_exit(Duration::from_secs(60));
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
    assert_eq!(server.scalar(awards).await, 1, "the API applied the award");
    assert_eq!(
        client
            .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'pending'")
            .await,
        1,
        "unrecorded"
    );

    let _second = Proc::spawn("dispatcher-2", dispatch(false));
    done_with_one_award(&client, &server).await;
    assert_eq!(
        client
            .scalar("SELECT attempts FROM idem_effect_intents")
            .await,
        2,
        "a second attempt was made"
    );
    let body: String = sqlx::query_scalar("SELECT response_body FROM idem_effect_intents")
        .fetch_one(&sqlx::SqlitePool::connect(&client_url).await.unwrap())
        .await
        .unwrap();
    assert!(
        body.contains("\"award_id\":1"),
        "the replayed response names the first award: {body}"
    );
}

/// The dispatcher reaches the points API through a fault proxy that holds the API's answers:
/// the request leaves, the API applies the award, and the answer never arrives before the
/// dispatcher's timeout. The intent stays unrecorded; once the way heals the dispatcher sends
/// the same key again, the API replays its first answer, and one award stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_whose_answer_is_lost_after_the_award_resends_the_key_and_one_award_stands() {
    let (client, server, client_url, _api, base) = points_api().await;
    let api: std::net::SocketAddr = base.trim_start_matches("http://").parse().unwrap();
    let proxy = idem_netfault::Proxy::start("127.0.0.1:0".parse().unwrap(), api, 9)
        .await
        .unwrap();
    let intent = EffectIntent {
        event_id: EventId::new(),
        effect: "points.award".into(),
        target: format!("http://{}/awards", proxy.addr()),
        body: serde_json::json!({"order_id": "order-1", "payment_id": "pay-1", "points": 12}),
        traceparent: None,
    };
    let mut tx = client.begin().await;
    tx.record_intent(&intent).await.unwrap();
    tx.commit().await;
    proxy.set(idem_netfault::Conditions::answers_held());
    let _dispatcher = Proc::spawn("dispatcher", dispatcher(&client_url));
    let awards = "SELECT count(*) FROM points_awards";
    eventually(
        "the API to apply the award",
        Duration::from_secs(60),
        || async { (server.scalar(awards).await == 1).then_some(()) },
    )
    .await;
    // The dispatcher's request timed out without an answer: it recorded the attempt as failed.
    eventually("the attempt to fail", Duration::from_secs(60), || async {
        (client
            .scalar("SELECT count(*) FROM idem_effect_intents WHERE status <> 'done' AND last_error IS NOT NULL")
            .await
            == 1)
            .then_some(())
    })
    .await;
    proxy.reset_all();
    proxy.set(idem_netfault::Conditions::healthy());
    done_with_one_award(&client, &server).await;
    assert!(
        client
            .scalar("SELECT attempts FROM idem_effect_intents")
            .await
            >= 2,
        "a second attempt was made"
    );
}

// ---- a points API route that ignores keys, with dispatcher kills ------------------------------

/// The points API, a settlement database with one `points.award` intent per payment, all
/// targeting `POST /keyless/awards`.
struct Keyless<B: Backend> {
    client: B,
    server: Lite,
    client_url: String,
    payments: usize,
    base: String,
    _api: Proc,
    dir: tempfile::TempDir,
}

/// The settlement database on SQLite.
async fn lite() -> (Lite, String) {
    let client = Lite::new().await;
    let url = format!("sqlite://{}", client.path().display());
    (client, url)
}

/// The settlement database on PostgreSQL.
async fn pg() -> (Pg, String) {
    let client = Pg::new().await;
    let url = client.url().to_owned();
    (client, url)
}

impl<B: Backend> Keyless<B> {
    async fn new((client, client_url): (B, String), payments: usize) -> Self {
        let server = Lite::new().await;
        let (api, base) = spawn_points_api(&server);
        let mut tx = client.begin().await;
        for p in 0..payments {
            let intent = EffectIntent {
                event_id: EventId::new(),
                effect: "points.award".into(),
                target: format!("{base}/keyless/awards"),
                body: serde_json::json!({"order_id": format!("order-{p}"), "payment_id": format!("pay-{p}"), "points": 5}),
                traceparent: None,
            };
            tx.record_intent(&intent).await.unwrap();
        }
        tx.commit().await;
        Keyless {
            client,
            server,
            client_url,
            payments,
            base,
            _api: api,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// `idem effects dispatch --remote-ignores-keys` (with the reference status probe when
    /// `probe`), crash points from `crash`, the negative control when `broken`.
    fn dispatcher(&self, probe: bool, crash: Option<&str>, broken: bool) -> Command {
        let probe_url = format!("{}/awards/by-payment/{{payment_id}}", self.base);
        let mut args = vec![
            "effects",
            "dispatch",
            "--db",
            &self.client_url,
            "--authorization",
            "Bearer settlement",
            "--timeout",
            "1s",
            "--settle",
            "0s",
            "--effect",
            idem_reference::POINTS_AWARD,
            "--remote-ignores-keys",
        ];
        if probe {
            args.extend(["--probe-url", &probe_url]);
        }
        let mut cmd = idem(&args);
        cmd.env("IDEM_CRASH_LOG", self.crash_log());
        if let Some(points) = crash {
            cmd.env("IDEM_CRASH_POINTS", points);
        }
        if broken {
            cmd.env("IDEM_BREAK", "skip-sending-mark");
        }
        cmd
    }

    fn crash_log(&self) -> std::path::PathBuf {
        self.dir.path().join("crashes")
    }

    fn crashes(&self) -> usize {
        std::fs::read_to_string(self.crash_log())
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    async fn pending(&self) -> i64 {
        self.client
            .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'pending'")
            .await
    }

    async fn awards(&self) -> i64 {
        self.server
            .scalar("SELECT count(*) FROM points_awards")
            .await
    }

    /// Runs a dispatcher armed at `point` until it aborts there (the crash log proves it), or
    /// until nothing is pending any more (then it is SIGKILLed).
    async fn abort_at(&self, probe: bool, point: &str, broken: bool) {
        let before = self.crashes();
        let mut d = Proc::spawn("dispatcher", self.dispatcher(probe, Some(point), broken));
        let fired = eventually(
            "the crash point to fire or the intents to settle",
            Duration::from_secs(60),
            || async {
                if self.crashes() > before {
                    Some(true)
                } else {
                    (self.pending().await == 0).then_some(false)
                }
            },
        )
        .await;
        if fired {
            let status = d.wait_exit(Duration::from_secs(30));
            assert_eq!(status.signal(), Some(6), "not aborted: {status:?}");
        } else {
            d.kill9();
        }
    }

    /// Runs a dispatcher until the API applied one more award (or nothing is pending), then
    /// SIGKILLs it, possibly with requests in flight.
    async fn kill_after_progress(&self, probe: bool) {
        let before = self.awards().await;
        let mut d = Proc::spawn("dispatcher", self.dispatcher(probe, None, false));
        eventually("one more award", Duration::from_secs(60), || async {
            (self.awards().await > before || self.pending().await == 0).then_some(())
        })
        .await;
        d.kill9();
    }

    /// Runs a dispatcher until nothing is pending.
    async fn settle(&self, probe: bool, broken: bool) {
        let _d = Proc::spawn("dispatcher", self.dispatcher(probe, None, broken));
        eventually(
            "every intent to settle",
            Duration::from_secs(90),
            || async { (self.pending().await == 0).then_some(()) },
        )
        .await;
    }

    /// (payment, awards) with more than one award.
    async fn doubled(&self) -> Vec<(String, i64)> {
        let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", self.server.path().display()))
            .await
            .unwrap();
        sqlx::query_as("SELECT payment_id, count(*) FROM points_awards GROUP BY payment_id HAVING count(*) > 1")
            .fetch_all(&pool)
            .await
            .unwrap()
    }

    /// Checks the battery's outcome: at most one award per payment, every intent `done` or
    /// `unknown`, every `done` intent awarded exactly once.
    async fn assert_at_most_once(&self) {
        assert_eq!(self.doubled().await, vec![], "a payment was awarded twice");
        for p in 0..self.payments {
            let payment = format!("pay-{p}");
            let n = self
                .server
                .scalar(&format!(
                    "SELECT count(*) FROM points_awards WHERE payment_id = '{payment}'"
                ))
                .await;
            let status = |s: &str| {
                format!(
                    "SELECT count(*) FROM idem_effect_intents WHERE body ->> 'payment_id' = '{payment}' AND status = '{s}'"
                )
            };
            let done = self.client.scalar(&status("done")).await;
            let unknown = self.client.scalar(&status("unknown")).await;
            assert_eq!(
                done + unknown,
                1,
                "{payment} ended neither done nor unknown"
            );
            if done == 1 {
                assert_eq!(n, 1, "{payment} is done with {n} awards");
            }
        }
    }
}

/// Aborted at `effect.after_http_success_before_record` against the keyless route, then
/// restarted after the lease, the dispatcher does not award `pay-0` a second time: the intent is
/// `unknown` and there is one award.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyless_dispatcher_aborted_after_the_award_leaves_the_intent_unknown() {
    aborted_after_the_award(Keyless::new(lite().await, 1).await).await;
    aborted_after_the_award(Keyless::new(pg().await, 1).await).await;
}

async fn aborted_after_the_award<B: Backend>(w: Keyless<B>) {
    w.abort_at(false, "effect.after_http_success_before_record", false)
        .await;
    assert_eq!(w.awards().await, 1);
    w.settle(false, false).await;
    assert_eq!(w.awards().await, 1, "sent again after the restart");
    assert_eq!(
        w.client
            .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'unknown'")
            .await,
        1
    );
}

/// The negative control: with the sending mark skipped (`IDEM_BREAK=skip-sending-mark`), the
/// same crash and restart award the payment twice — the harness notices a broken mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_sending_mark_the_same_crash_awards_twice() {
    let w = Keyless::new(lite().await, 1).await;
    w.abort_at(false, "effect.after_http_success_before_record", true)
        .await;
    w.settle(false, true).await;
    assert_eq!(w.doubled().await, vec![("pay-0".to_owned(), 2)]);
}

/// The battery: 12 payments against the keyless route, the dispatcher aborted at both crash
/// points around sending and SIGKILLed after progress (requests may be in flight), restarted
/// each time; without a probe the intents end `done` or `unknown`, with one the probe decides
/// (SQLite; without a probe on PostgreSQL too). Never a second award.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_dispatcher_kills_never_award_a_payment_twice() {
    for probe in [false, true] {
        battery(Keyless::new(lite().await, 12).await, probe).await;
    }
    battery(Keyless::new(pg().await, 12).await, false).await;
}

async fn battery<B: Backend>(w: Keyless<B>, probe: bool) {
    w.abort_at(probe, "effect.after_http_success_before_record", false)
        .await;
    // The first request of a fresh run reaches the point: the battery crashed for real.
    assert!(
        w.crashes() >= 1,
        "the dispatcher never aborted at its crash point"
    );
    w.kill_after_progress(probe).await;
    w.abort_at(probe, "effect.before_http@2", false).await;
    w.abort_at(probe, "effect.after_http_success_before_record@2", false)
        .await;
    w.kill_after_progress(probe).await;
    w.settle(probe, false).await;
    w.assert_at_most_once().await;
    if probe {
        assert_eq!(
            w.client
                .scalar("SELECT count(*) FROM idem_effect_intents WHERE status = 'done'")
                .await,
            12,
            "with a probe every intent is settled as done"
        );
    }
}
