//! Retention ([`RetentionStore`], idem-sql's `postgres/retention.rs` and `sqlite/retention.rs`),
//! run on both stores by their retention test binaries: old processed inbox rows and old done
//! intents go, young ones, recently redelivered ones, dead letters and unfinished intents stay,
//! in batches.

use std::future::Future;
use std::time::Duration;

use idem_core::retention::{Prunable, RetentionStore, RetentionWindow};

use crate::backend::Backend;

scenarios! {
    retention_scenarios;
    retention_prunes_old_rows_and_keeps_young_ones,
}

const DAY: Duration = Duration::from_secs(86_400);
/// Far older than any window below, in a text form both engines read.
const LONG_AGO: &str = "2020-01-01T00:00:00.000Z";

fn uuid(n: u32) -> String {
    format!("0190b6a4-0000-7000-8000-{n:012}")
}

async fn inbox_row<B: Backend>(b: &B, group: &str, n: u32, status: &str) {
    let sql = format!(
        "INSERT INTO {} (consumer_group, event_id, event_type, aggregate_type, aggregate_id, payload_hash, status) \
         VALUES ('{group}', '{}', 'order.paid', 'order', 'o-{n}', 'h', '{status}')",
        b.tables().qualified("inbox"),
        uuid(n)
    );
    b.exec(&sql).await.unwrap();
}

async fn intent_row<B: Backend>(b: &B, n: u32, status: &str) {
    let sql = format!(
        "INSERT INTO {} (idem_key, effect, target, event_id, body, status) \
         VALUES ('key-{n}', 'points.award', 'http://127.0.0.1:1/awards', '{}', '{{}}', '{status}')",
        b.tables().qualified("effect_intents"),
        uuid(n)
    );
    b.exec(&sql).await.unwrap();
}

/// Calls `prune` until it deletes nothing; returns the total and the number of calls that
/// deleted something.
async fn drain<F, Fut>(mut prune: F) -> (u64, u32)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = idem_core::Result<u64>>,
{
    let (mut total, mut calls) = (0, 0);
    loop {
        let n = prune().await.unwrap();
        if n == 0 {
            return (total, calls);
        }
        total += n;
        calls += 1;
    }
}

pub async fn retention_prunes_old_rows_and_keeps_young_ones<B: Backend>(b: &B)
where
    B::Store: RetentionStore,
{
    let inbox = b.tables().qualified("inbox");
    let intents = b.tables().qualified("effect_intents");
    inbox_row(b, "settlement", 1, "processed").await; // old: goes
    inbox_row(b, "audit", 2, "processed").await; // old, other group: goes
    inbox_row(b, "settlement", 3, "processed").await; // young: stays
    inbox_row(b, "settlement", 4, "processed").await; // old, redelivered today: stays
    inbox_row(b, "settlement", 5, "dead_lettered").await; // old dead letter: stays
    for n in [1, 2, 4, 5] {
        let aged = if n == 4 {
            format!("processed_at = '{LONG_AGO}'")
        } else {
            format!("processed_at = '{LONG_AGO}', last_delivered_at = '{LONG_AGO}'")
        };
        b.exec(&format!(
            "UPDATE {inbox} SET {aged} WHERE event_id = '{}'",
            uuid(n)
        ))
        .await
        .unwrap();
    }
    for (n, status) in [
        (11, "done"),
        (12, "done"),
        (13, "done"),
        (14, "pending"),
        (15, "parked"),
        (16, "unknown"),
    ] {
        intent_row(b, n, status).await;
        if n != 13 {
            b.exec(&format!(
                "UPDATE {intents} SET updated_at = '{LONG_AGO}' WHERE idem_key = 'key-{n}'"
            ))
            .await
            .unwrap();
        }
    }

    let window = RetentionWindow::new(Prunable::Inbox, 7 * DAY, 7 * DAY).unwrap();
    let store = b.store();
    assert_eq!(
        drain(|| store.prune_older(Prunable::Inbox, &window, 1)).await,
        (2, 2),
        "two old processed rows, one per batch of 1"
    );
    let left: Vec<i64> = {
        let mut v = Vec::new();
        for n in 1..=5 {
            v.push(
                b.scalar(&format!(
                    "SELECT count(*) FROM {inbox} WHERE event_id = '{}'",
                    uuid(n)
                ))
                .await,
            );
        }
        v
    };
    assert_eq!(left, vec![0, 0, 1, 1, 1], "inbox rows 1..=5 left");

    assert_eq!(
        drain(|| store.prune_older(Prunable::DoneIntents, &window, 10)).await,
        (2, 1)
    );
    let keys = b
        .scalar(&format!(
            "SELECT count(*) FROM {intents} WHERE idem_key IN ('key-13', 'key-14', 'key-15', 'key-16')"
        ))
        .await;
    assert_eq!(
        keys, 4,
        "young done, pending, parked and unknown intents stay"
    );
    assert_eq!(
        b.scalar(&format!("SELECT count(*) FROM {intents}")).await,
        4
    );
}
