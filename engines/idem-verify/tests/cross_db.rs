//! Source and target in different engines (PostgreSQL and SQLite): both sides must stream in
//! the same byte order, whatever the keys, or the merge would report phantom gaps.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_conformance::backend::{Backend, Lite, Pg};
use idem_verify::{Check, Options, Side, VerifyConfig, verify};

const KEYS: &[&str] = &[
    "a", "B", "é", "pay-10", "pay-9", "Z", "ß", "日本", "a b", "A", "_", "0", "~",
];

fn side(db: &str, table: &str) -> Side {
    Side {
        db: db.to_owned(),
        query: format!("SELECT k, amount FROM {table}"),
        key: "k".to_owned(),
        amount: Some("amount".to_owned()),
        event_type_column: None,
        aggregate_id: None,
    }
}

fn config(source: &str, target: &str) -> VerifyConfig {
    VerifyConfig {
        checks: vec![Check {
            name: "cross".to_owned(),
            event_type: None,
            source: side(source, "facts"),
            target: side(target, "effects"),
            locate: None,
        }],
        unique: vec![],
        empty: vec![],
        tables: Default::default(),
        currencies: vec![],
    }
}

async fn fill<B: Backend>(b: &B, table: &str, keys: &[&str]) {
    b.exec(&format!(
        "CREATE TABLE {table} (k text NOT NULL, amount bigint NOT NULL)"
    ))
    .await
    .unwrap();
    for (i, k) in keys.iter().enumerate() {
        b.exec(&format!("INSERT INTO {table} VALUES ('{k}', {i})"))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_and_sqlite_sides_merge_in_one_byte_order() {
    let (pg, lite) = (Pg::new().await, Lite::new().await);
    let lite_url = format!("sqlite://{}", lite.path().display());
    fill(&pg, "facts", KEYS).await;
    fill(&lite, "effects", KEYS).await;
    let report = verify(&config(pg.url(), &lite_url), &Options::default())
        .await
        .unwrap();
    assert!(report.clean, "{}", report.table());
    assert_eq!(report.checks[0].total().target_rows, KEYS.len() as u64);

    // And the other way round, with one key missing and one extra.
    fill(&lite, "facts", KEYS).await;
    let mut fewer: Vec<&str> = KEYS.iter().copied().filter(|k| *k != "é").collect();
    fewer.push("zz-extra");
    fill(&pg, "effects", &fewer).await;
    let report = verify(&config(&lite_url, pg.url()), &Options::default())
        .await
        .unwrap();
    let t = report.checks[0].total();
    assert_eq!((t.missing, t.unexpected), (1, 1), "{}", report.table());
    assert_eq!(report.checks[0].unexpected, vec!["zz-extra".to_owned()]);
}
