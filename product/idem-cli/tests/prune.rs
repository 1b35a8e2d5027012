//! `idem prune` refuses a window shorter than the redelivery horizon, and prunes only what is
//! older than the window, on both databases; `--outbox-counters` deletes the counters of
//! aggregates with nothing pending or parked.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

use idem_conformance::backend::{Backend, Lite, Pg};

const OLD: &str = "0190b6a4-0000-7000-8000-000000000001";
const YOUNG: &str = "0190b6a4-0000-7000-8000-000000000002";

fn prune(url: &str, extra: &[&str]) -> Output {
    let mut args = vec!["--redelivery-horizon", "7d"];
    args.extend_from_slice(extra);
    prune_without_horizon(url, &args)
}

fn prune_without_horizon(url: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["prune", "--db", url])
        .args(extra)
        .output()
        .unwrap()
}

/// The standard output of a run that must have succeeded.
fn succeeded(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn check<B: Backend>(b: &B, url: &str) {
    for id in [OLD, YOUNG] {
        b.exec(&format!(
            "INSERT INTO idem_inbox (consumer_group, event_id, event_type, aggregate_type, aggregate_id, payload_hash) \
             VALUES ('settlement', '{id}', 'order.paid', 'order', 'o-1', 'h')"
        ))
        .await
        .unwrap();
    }
    b.exec(&format!(
        "UPDATE idem_inbox SET processed_at = '2020-01-01T00:00:00.000Z', last_delivered_at = '2020-01-01T00:00:00.000Z' WHERE event_id = '{OLD}'"
    ))
    .await
    .unwrap();

    let out = prune(url, &["--inbox-older-than", "1d"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a 1-day window under a 7-day horizon ran: {err}"
    );
    assert!(
        err.contains("refusing to prune inbox rows younger than the redelivery horizon"),
        "{err}"
    );
    assert_eq!(
        b.scalar("SELECT count(*) FROM idem_inbox").await,
        2,
        "nothing deleted"
    );

    let out = prune(
        url,
        &["--inbox-older-than", "8d", "--intents-older-than", "7d"],
    );
    let text = succeeded(&out);
    assert!(text.contains("pruned 1 inbox rows"), "{text}");
    assert!(text.contains("pruned 0 done effect intents"), "{text}");
    assert_eq!(
        b.scalar(&format!(
            "SELECT count(*) FROM idem_inbox WHERE event_id = '{YOUNG}'"
        ))
        .await,
        1
    );
    assert_eq!(b.scalar("SELECT count(*) FROM idem_inbox").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_refuses_a_short_window_and_prunes_old_rows_on_sqlite() {
    let lite = Lite::new().await;
    let url = format!("sqlite://{}", lite.path().display());
    check(&lite, &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_refuses_a_short_window_and_prunes_old_rows_on_postgres() {
    let pg = Pg::new().await;
    let url = pg.url().to_owned();
    check(&pg, &url).await;
}

/// `--outbox-counters` with one aggregate fully published and one still pending: `expected`
/// counters pruned (PostgreSQL 1, SQLite none, it keeps no counters).
async fn check_counters<B: Backend>(b: &B, url: &str, expected: u64) {
    for (id, agg) in [(OLD, "o-done"), (YOUNG, "o-busy")] {
        b.exec(&format!(
            "INSERT INTO idem_outbox (event_id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('{id}', 'order', '{agg}', 'order.paid', '{{}}')"
        ))
        .await
        .unwrap();
    }
    b.exec(&format!(
        "UPDATE idem_outbox SET status = 'published' WHERE event_id = '{OLD}'"
    ))
    .await
    .unwrap();
    let text = succeeded(&prune_without_horizon(url, &["--outbox-counters"]));
    assert!(
        text.contains(&format!("pruned {expected} outbox aggregate counters")),
        "{text}"
    );
    let out = prune_without_horizon(url, &["--inbox-older-than", "8d"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a window without a horizon ran");
    assert!(
        err.contains("redelivery horizon must be above zero"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_outbox_counters_deletes_idle_aggregates_counters_on_postgres() {
    let pg = Pg::new().await;
    let url = pg.url().to_owned();
    check_counters(&pg, &url, 1).await;
    assert_eq!(
        pg.scalar("SELECT count(*) FROM idem_outbox_aggregates WHERE aggregate_id = 'o-busy'")
            .await,
        1,
        "the pending aggregate keeps its counter"
    );
    assert_eq!(
        pg.scalar("SELECT count(*) FROM idem_outbox_aggregates")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_outbox_counters_has_nothing_to_do_on_sqlite() {
    let lite = Lite::new().await;
    let url = format!("sqlite://{}", lite.path().display());
    check_counters(&lite, &url, 0).await;
}
