//! The whole reference pipeline over TLS, as real OS processes: the order writer, the polling
//! relay, then the CDC relay, the settlement consumer and the effect dispatcher reach
//! PostgreSQL as `idem_tls` (a role the suite's server refuses in clear) under
//! `sslmode=verify-full`, Kafka over SASL_SSL with SCRAM-SHA-512 (a broker of the test's own with
//! a PKI made for the run), and the points API over HTTPS. Every PostgreSQL backend of the run —
//! pools and the walsender — is encrypted, the broker logs the SCRAM principal, `idem verify`
//! finds every order settled and awarded once, and no process printed a password.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use idem_conformance::backend::Pg;
use idem_conformance::kafka::{self, SecuredKafka, Security, secured};
use idem_conformance::pg::PgTlsMaterial;
use idem_conformance::process::{Proc, eventually};

fn lab(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args(args)
        .env("RUST_LOG", "info")
        .env_remove("IDEM_CRASH_POINTS");
    for (k, _) in std::env::vars() {
        if k.starts_with("IDEM_") && !k.starts_with("IDEM_TEST_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// `idem-lab setup`: idem's tables and the reference tables in `db` (the reference services
/// create none).
fn setup(db: &str) {
    let out = lab(&["setup", "--db", db]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The broker's SCRAM-SHA-512 login and CA, as the environment (the password in a file).
fn scram(cmd: &mut Command, k: &SecuredKafka, password_file: &std::path::Path) {
    let (user, _) = k.user("SCRAM-SHA-512");
    cmd.env("IDEM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
        .env("IDEM_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
        .env("IDEM_KAFKA_SASL_USERNAME", user)
        .env("IDEM_KAFKA_SASL_PASSWORD_FILE", password_file)
        .env("IDEM_KAFKA_SSL_CA", k.pki("ca.pem"));
}

/// Hands `pg`'s database and its tables to `idem_tls`; returns the database's name.
async fn give_to_idem_tls(pg: &Pg) -> String {
    sqlx::raw_sql(
        "DO $$ DECLARE r record; BEGIN \
           EXECUTE format('ALTER DATABASE %I OWNER TO idem_tls', current_database()); \
           FOR r IN SELECT tablename FROM pg_tables WHERE schemaname = 'public' LOOP \
             EXECUTE format('ALTER TABLE public.%I OWNER TO idem_tls', r.tablename); \
           END LOOP; \
           FOR r IN SELECT sequencename FROM pg_sequences WHERE schemaname = 'public' LOOP \
             EXECUTE format('ALTER SEQUENCE public.%I OWNER TO idem_tls', r.sequencename); \
           END LOOP; END $$",
    )
    .execute(pg.pool())
    .await
    .unwrap();
    sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(pg.pool())
        .await
        .unwrap()
}

fn run_ok(mut cmd: Command, what: &str) -> String {
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what}: {text}");
    text
}

async fn published(orders: &Pg) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idem_outbox WHERE status = 'published'")
        .fetch_one(orders.pool())
        .await
        .unwrap()
}

/// `(user, backend type, ssl)` of every backend of `idem_tls`.
async fn idem_tls_backends(pg: &Pg) -> Vec<(String, String, bool)> {
    sqlx::query_as(
        "SELECT coalesce(a.datname, '')::text, a.backend_type, s.ssl \
         FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) WHERE a.usename = 'idem_tls'",
    )
    .fetch_all(pg.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines)] // one scripted run of the whole pipeline
async fn the_reference_pipeline_runs_over_tls_scram_and_https() {
    let tls = PgTlsMaterial::get();
    let k = secured(Security::SaslSsl);
    let dir = tempfile::tempdir().unwrap();
    let (_, kafka_password) = k.user("SCRAM-SHA-512");
    let password_file = dir.path().join("kafka-password");
    std::fs::write(&password_file, format!("{kafka_password}\n")).unwrap();

    let (orders, settle) = (Pg::new().await, Pg::new().await);
    idem_reference::ensure_schema_postgres(settle.pool())
        .await
        .unwrap();
    let orders_url = tls.verify_full_url(&give_to_idem_tls(&orders).await);
    setup(&orders_url);
    let settle_url = tls.verify_full_url(&give_to_idem_tls(&settle).await);
    let prefix = format!("{}.", kafka::unique("tls-e2e"));
    let (topic, group, slot) = (
        format!("{prefix}order"),
        kafka::unique("tls-settlement"),
        kafka::unique("tls_cdc").replace('-', "_"),
    );

    // The points API over HTTPS, with the broker's certificate (same CA, SAN IP:127.0.0.1).
    let points_db = format!("sqlite://{}", dir.path().join("points.db").display());
    setup(&points_db);
    let (cert, key) = (k.pki("broker.pem"), k.pki("broker.key"));
    let points = Proc::spawn(
        "points-api",
        lab(&[
            "points-api",
            "--db",
            &points_db,
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ]),
    );
    let line = points.wait_for_line("listening on https://", Duration::from_secs(30));
    let addr = line
        .split("https://")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .to_owned();

    // First half through the polling relay.
    run_ok(
        lab(&["orders", "--db", &orders_url, "--count", "30"]),
        "orders",
    );
    let mut cmd = lab(&[
        "relay",
        "--db",
        &orders_url,
        "--brokers",
        k.brokers(),
        "--topic-prefix",
        &prefix,
        "--create-topics",
        "1",
        "--replication-factor",
        "1",
        "--no-prune",
    ]);
    scram(&mut cmd, k, &password_file);
    let mut relay = Proc::spawn("relay", cmd);
    eventually(
        "the polling relay published 30",
        Duration::from_secs(90),
        || async { (published(&orders).await == 30).then_some(()) },
    )
    .await;
    relay.signal(15);
    assert!(relay.wait_exit(Duration::from_secs(30)).success());

    // Second half through the CDC relay.
    let mut cmd = lab(&[
        "cdc",
        "relay",
        "--db",
        &orders_url,
        "--brokers",
        k.brokers(),
        "--topic-prefix",
        &prefix,
        "--slot",
        &slot,
        "--create-topics",
        "1",
        "--replication-factor",
        "1",
    ]);
    scram(&mut cmd, k, &password_file);
    let mut cdc = Proc::spawn("cdc-relay", cmd);
    cdc.wait_for_line("CDC session started", Duration::from_secs(60));
    run_ok(
        lab(&[
            "orders",
            "--db",
            &orders_url,
            "--count",
            "30",
            "--start",
            "31",
        ]),
        "orders",
    );
    eventually(
        "the CDC relay published 30 more",
        Duration::from_secs(90),
        || async { (published(&orders).await == 60).then_some(()) },
    )
    .await;

    // The consumer and the dispatcher.
    let mut cmd = lab(&[
        "settlement",
        "--db",
        &settle_url,
        "--brokers",
        k.brokers(),
        "--group",
        &group,
        "--topic",
        &topic,
        "--points-url",
        &format!("https://{addr}/awards"),
    ]);
    scram(&mut cmd, k, &password_file);
    let mut settlement = Proc::spawn("settlement", cmd);
    let ca = k.pki("ca.pem");
    let mut dispatcher = Proc::spawn(
        "dispatcher",
        lab(&[
            "effects",
            "dispatch",
            "--db",
            &settle_url,
            "--ca-bundle",
            ca.to_str().unwrap(),
            "--authorization",
            "Bearer settlement",
        ]),
    );
    eventually(
        "60 points awards done",
        Duration::from_secs(120),
        || async {
            let done: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM idem_effect_intents WHERE status = 'done'",
            )
            .fetch_one(settle.pool())
            .await
            .unwrap_or(0);
            (done == 60).then_some(())
        },
    )
    .await;

    // Every backend of idem_tls — the order writer is gone; the CDC relay's pool and walsender,
    // the consumer's and the dispatcher's pools remain — is encrypted.
    let backends = idem_tls_backends(&orders).await;
    assert!(
        backends.iter().any(|(_, t, _)| t == "walsender"),
        "{backends:?}"
    );
    assert!(
        backends
            .iter()
            .filter(|(_, t, _)| t == "client backend")
            .count()
            >= 2,
        "{backends:?}"
    );
    assert!(
        backends.iter().all(|(_, _, ssl)| *ssl),
        "a backend in clear: {backends:?}"
    );
    eprintln!("idem_tls backends: {backends:?}");

    // The broker authenticated the SCRAM user.
    let (user, _) = k.user("SCRAM-SHA-512");
    assert!(
        k.broker_log().contains(&format!("User:{user}")),
        "the broker's log does not name the SCRAM principal User:{user}"
    );

    let config = dir.path().join("verify.toml");
    let config = config.to_str().unwrap();
    run_ok(
        lab(&[
            "verify-config",
            "--orders-db",
            &orders_url,
            "--settlement-db",
            &settle_url,
            "--points-db",
            &points_db,
            "--out",
            config,
        ]),
        "verify-config",
    );
    let report = run_ok(lab(&["verify", "--config", config]), "verify");
    assert!(report.contains("idem verify: CLEAN"), "{report}");
    for check in ["settlements", "points"] {
        let row: Vec<&str> = report
            .lines()
            .find(|l| l.starts_with(check))
            .map(|l| l.split_whitespace().collect())
            .unwrap_or_default();
        assert_eq!(
            (row.get(2), row.get(4)),
            (Some(&"60"), Some(&"60")),
            "{check}: 60 orders, 60 effects: {report}"
        );
    }

    for p in [&mut cdc, &mut settlement, &mut dispatcher] {
        p.signal(15);
        assert!(p.wait_exit(Duration::from_secs(30)).success());
    }
    drop(points);
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&slot)
        .execute(orders.pool())
        .await
        .unwrap();

    // No process printed a password: the SCRAM password, idem_tls's, none.
    let pg_password = tls.password();
    for p in [&relay, &cdc, &settlement, &dispatcher] {
        for line in p.log() {
            assert!(
                !line.contains(&kafka_password) && !line.contains(&pg_password),
                "a password in the log: {line}"
            );
        }
    }
}
