//! A check with `[[currency]]` compares the currency as well as the amount: 500 EUR settled as
//! 500 USD is not the same money.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_conformance::backend::{Backend, Lite, Pg};
use idem_verify::{Options, VerifyConfig, verify};

async fn reference_tables<B: Backend>(b: &B, settled_currency: &str) {
    for sql in [
        "CREATE TABLE orders (order_id text NOT NULL, payment_id text NOT NULL, amount_minor bigint NOT NULL, currency text NOT NULL)".to_owned(),
        "CREATE TABLE settlements (payment_id text NOT NULL, order_id text NOT NULL, amount_minor bigint NOT NULL, currency text NOT NULL)".to_owned(),
        "CREATE TABLE settlement_applications (event_id text NOT NULL)".to_owned(),
        "INSERT INTO orders VALUES ('order-1', 'pay-1', 500, 'EUR'), ('order-2', 'pay-2', 700, 'EUR')".to_owned(),
        format!("INSERT INTO settlements VALUES ('pay-1', 'order-1', 500, 'EUR'), ('pay-2', 'order-2', 700, '{settled_currency}')"),
        "INSERT INTO settlement_applications VALUES ('e-1'), ('e-2')".to_owned(),
    ] {
        b.exec(&sql).await.unwrap();
    }
}

async fn check_currency<B: Backend>(b: &B, url: &str) {
    reference_tables(b, "USD").await;
    let config = VerifyConfig::from_toml(&format!(
        r#"
        [[check]]
        name = "settlements"
        source = {{ db = "{url}", query = "SELECT payment_id, amount_minor, currency FROM orders", key = "payment_id", amount = "amount_minor" }}
        target = {{ db = "{url}", query = "SELECT payment_id, amount_minor, currency FROM settlements", key = "payment_id", amount = "amount_minor" }}
        [[currency]]
        check = "settlements"
        source = "currency"
        target = "currency"
        "#
    ))
    .unwrap();
    let report = verify(&config, &Options::default()).await.unwrap();
    assert!(
        !report.clean,
        "a settlement in the wrong currency passed: {}",
        report.table()
    );
    let t = report.checks[0].total();
    assert_eq!(
        (t.missing, t.amount_mismatches, t.currency_mismatches),
        (0, 0, 1),
        "{}",
        report.table()
    );
    assert_eq!(report.checks[0].currency_mismatches[0].key, "pay-2");
    assert!(report.table().contains("CURRENCY"), "{}", report.table());

    b.exec("UPDATE settlements SET currency = 'EUR'")
        .await
        .unwrap();
    let report = verify(&config, &Options::default()).await.unwrap();
    assert!(report.clean, "{}", report.table());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_in_another_currency_is_a_violation_on_postgres() {
    let pg = Pg::new().await;
    let url = pg.url().to_owned();
    check_currency(&pg, &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_in_another_currency_is_a_violation_on_sqlite() {
    let lite = Lite::new().await;
    let url = format!("sqlite://{}", lite.path().display());
    check_currency(&lite, &url).await;
}
