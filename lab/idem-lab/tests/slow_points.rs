//! The harness's "points API slower than its key lock" on the real
//! `idem-lab points-api` process: awards wait 800 ms, the key lock is 200 ms, and concurrent requests
//! with one key, each retried on 409, execute once — and with the layer's lock renewal broken
//! on purpose (`IDEM_BREAK=key-lock-renewal`, the negative control) they execute side by side.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use idem_conformance::backend::Lite;
use idem_conformance::process::Proc;

const KEY: &str = "\"event-01936f5e-4c1a-7d55-9a51-0cc0f0d4a7e2-points.award\"";

fn points_api(db: &str, broken: bool) -> (Proc, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem-lab"))
        .args(["setup", "--db", db])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args([
        "points-api",
        "--db",
        db,
        "--listen",
        "127.0.0.1:0",
        "--award-delay",
        "800ms",
        "--key-lock",
        "200ms",
    ])
    .env("RUST_LOG", "info")
    .env_remove("IDEM_CRASH_POINTS")
    .env_remove("IDEM_BREAK");
    if broken {
        cmd.env("IDEM_BREAK", "key-lock-renewal");
    }
    let api = Proc::spawn("points-api", cmd);
    let line = api.wait_for_line("listening on http://", Duration::from_secs(30));
    let base = line.rsplit(' ').next().unwrap().to_owned();
    (api, base)
}

/// POSTs the award until the answer is not 409, as a client honouring `Retry-After` does.
async fn award_until_done(client: reqwest::Client, base: String) -> u16 {
    loop {
        let resp = client
            .post(format!("{base}/awards"))
            .header("authorization", "Bearer settlement")
            .header("idempotency-key", KEY)
            .json(&serde_json::json!({"order_id": "order-1", "payment_id": "pay-1", "points": 12}))
            .send()
            .await
            .unwrap();
        if resp.status() != 409 {
            return resp.status().as_u16();
        }
        // The client's own backoff between retries.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Four concurrent clients with one key; returns (statuses, executions, overlapping).
async fn run(broken: bool) -> (Vec<u16>, u64, u64) {
    let lite = Lite::new().await;
    let db = format!("sqlite://{}", lite.path().display());
    let (_api, base) = points_api(&db, broken);
    let client = reqwest::Client::new();
    let tasks: Vec<_> = (0..4)
        .map(|_| tokio::spawn(award_until_done(client.clone(), base.clone())))
        .collect();
    let mut statuses = vec![];
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    let counts: serde_json::Value = client
        .get(format!("{base}/lab/award-executions"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    (
        statuses,
        counts["executions"].as_u64().unwrap(),
        counts["overlapping"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_points_api_slower_than_its_key_lock_executes_each_key_once() {
    let (statuses, executions, overlapping) = run(false).await;
    assert_eq!(statuses, [201; 4], "one award, replayed to the others");
    assert_eq!((executions, overlapping), (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_lock_renewal_a_slow_award_is_taken_over_and_executes_twice() {
    let (_, executions, overlapping) = run(true).await;
    assert!(
        executions > 1 && overlapping > 0,
        "the negative control went unnoticed: {executions} executions, {overlapping} overlapping"
    );
}
