//! The effect dispatcher and the points API as real processes: the dispatcher is aborted after
//! the API applied the award and before the outcome was recorded; restarted, it sends the same
//! key, the API replays, and there is one award.
#![cfg(feature = "failpoints")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::Duration;

use idem_conformance::backend::{Backend, Lite, OpenTx};
use idem_conformance::process::{Proc, eventually};
use idem_core::EventId;
use idem_core::idempotency::EffectIntent;

fn idem(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(args)
        .env("RUST_LOG", "info")
        .env_remove("IDEM_CRASH_POINTS");
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_killed_after_the_award_resends_the_same_key_and_the_api_replays() {
    let (client, server) = (Lite::new().await, Lite::new().await);
    let server_url = format!("sqlite://{}", server.path().display());
    let client_url = format!("sqlite://{}", client.path().display());
    let api = Proc::spawn(
        "points-api",
        idem(&["points-api", "--db", &server_url, "--listen", "127.0.0.1:0"]),
    );
    let line = api.wait_for_line("listening on http://", Duration::from_secs(30));
    let target = format!("{}/awards", line.rsplit(' ').next().unwrap());

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
        let mut cmd = idem(&[
            "effects",
            "dispatch",
            "--db",
            &client_url,
            "--authorization",
            "Bearer settlement",
            "--timeout",
            "2s",
        ]);
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
    assert_eq!(
        server.scalar(awards).await,
        1,
        "one award: the retry was replayed"
    );
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
