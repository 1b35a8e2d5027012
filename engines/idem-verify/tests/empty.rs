//! An `[[empty]]` check is an invariant: every row its query returns is a violation, named by
//! its key in the report and counted in the gauge.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_conformance::backend::{Backend, Lite, Pg};
use idem_verify::{Options, VerifyConfig, gap_values, verify};

async fn check_empty<B: Backend>(b: &B, url: &str) {
    for sql in [
        "CREATE TABLE key_overlaps (idem_key text NOT NULL)",
        "CREATE TABLE accounts (id text NOT NULL, balance bigint NOT NULL)",
        "INSERT INTO accounts VALUES ('a-1', 10), ('a-2', 0)",
    ] {
        b.exec(sql).await.unwrap();
    }
    let config = VerifyConfig::from_toml(&format!(
        r#"
        [[empty]]
        name = "overlapping executions"
        db = "{url}"
        query = "SELECT idem_key FROM key_overlaps"
        key = "idem_key"

        [[empty]]
        name = "negative balances"
        db = "{url}"
        query = "SELECT id FROM accounts WHERE balance < 0"
        key = "id"
        "#
    ))
    .unwrap();
    let report = verify(&config, &Options::default()).await.unwrap();
    assert!(report.clean, "{}", report.table());
    assert_eq!(report.invariant_violations(), 0);

    b.exec("INSERT INTO key_overlaps VALUES ('k-7'), ('k-7'), ('k-9')")
        .await
        .unwrap();
    b.exec("UPDATE accounts SET balance = -5 WHERE id = 'a-2'")
        .await
        .unwrap();
    let report = verify(&config, &Options::default()).await.unwrap();
    assert!(!report.clean, "rows in an [[empty]] check passed");
    assert_eq!(report.invariant_violations(), 4, "{}", report.table());
    assert_eq!(report.empty[0].keys, ["k-7", "k-9"]);
    assert_eq!(report.empty[1].keys, ["a-2"]);
    let table = report.table();
    assert!(
        table.contains("NOT EMPTY \"negative balances\": row a-2"),
        "{table}"
    );
    let gaps = gap_values(&report);
    let rows = |name: &str| gaps[&[name.to_owned(), String::new(), "rows".to_owned()]];
    assert_eq!(
        (rows("overlapping executions"), rows("negative balances")),
        (3, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_an_empty_check_are_violations_on_postgres() {
    let pg = Pg::new().await;
    let url = pg.url().to_owned();
    check_empty(&pg, &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_an_empty_check_are_violations_on_sqlite() {
    let lite = Lite::new().await;
    let url = format!("sqlite://{}", lite.path().display());
    check_empty(&lite, &url).await;
}
