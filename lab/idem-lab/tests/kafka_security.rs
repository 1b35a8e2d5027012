//! idem over a secured Apache Kafka broker, as real OS processes: `idem relay`, `idem topic` and
//! `idem-lab settlement` against a broker with a SASL_SSL listener (PLAIN, SCRAM-SHA-256,
//! SCRAM-SHA-512) or a TLS listener that requires a client certificate, each with a PKI and
//! passwords made for the run (`idem_conformance::kafka::secured`, `scripts/kafka --security`).
//! The refusals — a wrong SCRAM password, a CA that did not sign the broker's certificate, an
//! expired client certificate, a plaintext client at the TLS listener — each stop the command
//! at start, within a time bound, with what is wrong and what to do.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use idem_conformance::backend::{Backend, Pg};
use idem_conformance::kafka::{self, SecuredKafka, Security, secured};
use idem_conformance::process::{Proc, eventually};

/// How long a refused command may take to stop: librdkafka's first handshake or login, plus
/// the process start.
const REFUSAL_BOUND: Duration = Duration::from_secs(20);

fn idem(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-lab"));
    cmd.args(args)
        .env("RUST_LOG", "info")
        .env_remove("IDEM_CRASH_POINTS");
    for (k, _) in std::env::vars() {
        if k.starts_with("IDEM_KAFKA_") {
            cmd.env_remove(k);
        }
    }
    cmd
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

/// The SCRAM-SHA-512 login as environment variables, the password in a file.
fn scram_env(cmd: &mut Command, k: &SecuredKafka, password_file: &std::path::Path) {
    let (user, password) = k.user("SCRAM-SHA-512");
    std::fs::write(password_file, format!("{password}\n")).unwrap();
    cmd.env("IDEM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
        .env("IDEM_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
        .env("IDEM_KAFKA_SASL_USERNAME", user)
        .env("IDEM_KAFKA_SASL_PASSWORD_FILE", password_file)
        .env("IDEM_KAFKA_SSL_CA", k.pki("ca.pem"));
}

/// The client certificate as flags.
fn mtls_flags(k: &SecuredKafka, cert: &str, key: &str, ca: &str) -> Vec<String> {
    vec![
        "--kafka-security-protocol".into(),
        "SSL".into(),
        "--kafka-ssl-ca".into(),
        k.pki(ca).display().to_string(),
        "--kafka-ssl-cert".into(),
        k.pki(cert).display().to_string(),
        "--kafka-ssl-key".into(),
        k.pki(key).display().to_string(),
    ]
}

fn write_orders(db: &str, count: u64) {
    setup(db);
    let out = idem(&["orders", "--db", db, "--count", &count.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `cmd` until it exits (at most [`REFUSAL_BOUND`]); returns its standard error, having
/// asserted that it failed in time.
fn refused(name: &str, cmd: Command) -> String {
    Proc::refused(name, cmd, REFUSAL_BOUND)
}

fn assert_no_secret(log: &str, secret: &str) {
    assert!(!log.contains(secret), "a secret reached the output:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_publishes_over_sasl_ssl_with_scram_sha_512_and_a_consumer_settles_it() {
    let k = secured(Security::SaslSsl);
    let (orders, settle) = (Pg::new().await, Pg::new().await);
    idem_reference::ensure_schema_postgres(settle.pool())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("scram-password");
    let (user, password) = k.user("SCRAM-SHA-512");
    let prefix = format!("{}.", kafka::unique("secure"));
    let topic = format!("{prefix}order");
    let group = kafka::unique("secure-settlement");

    let mut create = idem(&[
        "topic",
        "create",
        "--brokers",
        k.brokers(),
        "--topic",
        &topic,
        "--partitions",
        "2",
    ]);
    scram_env(&mut create, k, &password_file);
    let out = create.output().unwrap();
    let create_log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{create_log}");
    assert_no_secret(&create_log, &password);

    write_orders(orders.url(), 20);
    let mut relay = idem(&[
        "relay",
        "--db",
        orders.url(),
        "--brokers",
        k.brokers(),
        "--topic-prefix",
        &prefix,
        "--no-prune",
    ]);
    scram_env(&mut relay, k, &password_file);
    let relay = Proc::spawn("relay", relay);
    let mut consumer = idem(&[
        "settlement",
        "--db",
        settle.url(),
        "--brokers",
        k.brokers(),
        "--group",
        &group,
        "--topic",
        &topic,
    ]);
    scram_env(&mut consumer, k, &password_file);
    let consumer = Proc::spawn("settlement", consumer);

    eventually(
        "20 settlements over SASL_SSL",
        Duration::from_secs(60),
        || async { (settle.scalar("SELECT count(*) FROM settlements").await == 20).then_some(()) },
    )
    .await;
    let principal = format!("User:{user}");
    assert!(
        k.authorized(&principal, "Produce") > 0,
        "the broker logged no Produce of {principal}:\n{}",
        k.broker_log()
    );
    assert!(
        k.authorized(&principal, "Fetch") > 0,
        "the broker logged no Fetch of {principal}"
    );
    assert_no_secret(&relay.log().join("\n"), &password);
    assert_no_secret(&consumer.log().join("\n"), &password);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_publishes_over_mutual_tls_and_the_records_read_back() {
    let k = secured(Security::Ssl);
    let orders = Pg::new().await;
    let prefix = format!("{}.", kafka::unique("mtls"));
    let topic = format!("{prefix}order");
    write_orders(orders.url(), 20);
    let mut args: Vec<String> = [
        "relay",
        "--db",
        orders.url(),
        "--brokers",
        k.brokers(),
        "--topic-prefix",
        &prefix,
        "--no-prune",
        // The broker creates no topic on first use.
        "--create-topics",
        "1",
        "--replication-factor",
        "1",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend(mtls_flags(k, "client.pem", "client.key", "ca.pem"));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let _relay = Proc::spawn("relay", idem(&refs));

    let conn = k.connection().client_config();
    eventually(
        "20 records over mutual TLS",
        Duration::from_secs(60),
        || {
            let (conn, topic) = (conn.clone(), topic.clone());
            async move {
                tokio::task::spawn_blocking(move || {
                    idem_kafka::inspect::read_all_with(&conn, &topic, Duration::from_secs(10))
                })
                .await
                .unwrap()
                .ok()
                .filter(|r| r.len() == 20)
            }
        },
    )
    .await;
    assert!(
        k.authorized("User:CN=idem-client", "Produce") > 0,
        "the broker logged no Produce of the client certificate's principal:\n{}",
        k.broker_log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_ssl_refusals_stop_the_command_at_start_with_what_to_do() {
    let k = secured(Security::SaslSsl);
    let orders = Pg::new().await;
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("wrong-password");
    std::fs::write(&wrong, "not-the-password\n").unwrap();
    let (user, _) = k.user("SCRAM-SHA-512");

    // A wrong SCRAM password: the relay stops before its first batch.
    let mut relay = idem(&["relay", "--db", orders.url(), "--brokers", k.brokers()]);
    scram_env(&mut relay, k, &dir.path().join("right-password"));
    relay.env("IDEM_KAFKA_SASL_PASSWORD_FILE", &wrong);
    let log = refused("relay", relay);
    let expected = format!(
        "idem relay cannot use the Kafka cluster: the Kafka broker refused the SCRAM-SHA-512 login of user {user}: Authentication failed during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512; check --kafka-sasl-username (IDEM_KAFKA_SASL_USERNAME) and --kafka-sasl-password-file (IDEM_KAFKA_SASL_PASSWORD or IDEM_KAFKA_SASL_PASSWORD_FILE) and that the user exists for SCRAM-SHA-512 on the cluster"
    );
    assert!(log.contains(&expected), "{log}");
    assert_no_secret(&log, "not-the-password");

    // A plaintext client at the SASL_SSL listener.
    let log = refused(
        "topic-plaintext",
        idem(&["topic", "create", "--brokers", k.brokers(), "--topic", "t"]),
    );
    let expected = format!(
        "idem topic create cannot use the Kafka cluster: the Kafka broker at {} closed every connection during the first request: its listener most likely expects TLS or SASL while the security protocol is PLAINTEXT; set --kafka-security-protocol (IDEM_KAFKA_SECURITY_PROTOCOL) to SSL or SASL_SSL as the listener requires",
        k.brokers()
    );
    assert!(log.contains(&expected), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_refusals_stop_the_command_at_start_with_what_to_do() {
    let k = secured(Security::Ssl);
    let topic_dump_at = |brokers: &str, flags: Vec<String>| {
        let mut args: Vec<String> = ["topic", "dump", "--brokers", brokers, "--topic", "t"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        args.extend(flags);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        idem(&refs)
    };
    let topic_dump = |flags: Vec<String>| topic_dump_at(k.brokers(), flags);

    // The client trusts another CA than the one that signed the broker's certificate.
    let log = refused(
        "wrong-ca",
        topic_dump(mtls_flags(k, "client.pem", "client.key", "other-ca.pem")),
    );
    let expected = format!(
        "idem topic dump cannot use the Kafka cluster: this client does not trust the Kafka broker's TLS certificate (SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified, verify that ssl.ca.location is correctly configured or root CA certificates are installed (install ca-certificates package)): OpenSSL does not say which check failed, so check both: the certificate must be signed by a CA in --kafka-ssl-ca (IDEM_KAFKA_SSL_CA), now {}, and it must name the host this client connects to (in --brokers and the broker's advertised listeners): connect by a host name the certificate names",
        k.pki("other-ca.pem").display()
    );
    assert!(log.contains(&expected), "{log}");

    // The right CA, but a host name the broker's certificate does not name (it names only
    // IP:127.0.0.1; `localhost` reaches the same listener).
    let port = k.brokers().rsplit(':').next().unwrap();
    let log = refused(
        "wrong-host-name",
        topic_dump_at(
            &format!("localhost:{port}"),
            mtls_flags(k, "client.pem", "client.key", "ca.pem"),
        ),
    );
    let expected = "idem topic dump cannot use the Kafka cluster: this client does not trust the Kafka broker's TLS certificate (";
    assert!(log.contains(expected), "{log}");
    assert!(
        log.contains("connect by a host name the certificate names"),
        "{log}"
    );

    // An expired client certificate, signed by the right CA: the broker refuses it.
    let log = refused(
        "expired",
        topic_dump(mtls_flags(k, "expired.pem", "expired.key", "ca.pem")),
    );
    let expected = format!(
        "idem topic dump cannot use the Kafka cluster: the Kafka broker refused this client's TLS certificate (Receive failed: error:0A000416:SSL routines::ssl/tls alert certificate unknown: SSL alert number 46): give --kafka-ssl-cert (IDEM_KAFKA_SSL_CERT) and --kafka-ssl-key (IDEM_KAFKA_SSL_KEY) a certificate that is valid now (not expired) and signed by a CA the broker trusts (certificate: {})",
        k.pki("expired.pem").display()
    );
    assert!(log.contains(&expected), "{log}");

    // A plaintext client at the TLS listener.
    let log = refused("plaintext", topic_dump(vec![]));
    let expected = format!(
        "idem topic dump cannot use the Kafka cluster: the Kafka broker at {} closed every connection during the first request: its listener most likely expects TLS or SASL while the security protocol is PLAINTEXT; set --kafka-security-protocol (IDEM_KAFKA_SECURITY_PROTOCOL) to SSL or SASL_SSL as the listener requires",
        k.brokers()
    );
    assert!(log.contains(&expected), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_and_scram_sha_256_log_in_and_settings_given_as_overrides_are_checked_too() {
    let k = secured(Security::SaslSsl);
    let dir = tempfile::tempdir().unwrap();
    let topic = kafka::unique("secure-mechanisms");
    for mechanism in ["PLAIN", "SCRAM-SHA-256"] {
        let (user, password) = k.user(mechanism);
        let file = dir.path().join(mechanism);
        std::fs::write(&file, &password).unwrap();
        let out = idem(&[
            "topic",
            "create",
            "--brokers",
            k.brokers(),
            "--topic",
            &topic,
        ])
        .env("IDEM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
        .env("IDEM_KAFKA_SASL_MECHANISM", mechanism)
        .env("IDEM_KAFKA_SASL_USERNAME", &user)
        .env("IDEM_KAFKA_SASL_PASSWORD_FILE", &file)
        .env("IDEM_KAFKA_SSL_CA", k.pki("ca.pem"))
        .output()
        .unwrap();
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{mechanism}: {log}");
        assert_no_secret(&log, &password);
        assert!(
            k.authorized(&format!("User:{user}"), "CreateTopics") > 0,
            "the broker logged no CreateTopics of {user} ({mechanism})"
        );
    }

    // The same login given as librdkafka settings (--producer-config), with a wrong password:
    // refused with the same diagnosis, and the value never printed.
    let orders = Pg::new().await;
    let (user, _) = k.user("SCRAM-SHA-512");
    let ca = format!("ssl.ca.location={}", k.pki("ca.pem").display());
    let username = format!("sasl.username={user}");
    let mut args = vec!["relay", "--db", orders.url(), "--brokers", k.brokers()];
    for setting in [
        "security.protocol=SASL_SSL",
        "sasl.mechanism=SCRAM-SHA-512",
        &username,
        "sasl.password=wrong-override-secret",
        &ca,
    ] {
        args.extend(["--producer-config", setting]);
    }
    let log = refused("relay-overrides", idem(&args));
    assert!(
        log.contains(&format!(
            "idem relay cannot use the Kafka cluster: the Kafka broker refused the SCRAM-SHA-512 login of user {user}: Authentication failed during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512"
        )),
        "{log}"
    );
    assert_no_secret(&log, "wrong-override-secret");
}

#[test]
fn incoherent_flags_are_refused_before_connecting_and_help_hides_secret_values() {
    let out = idem(&[
        "topic",
        "create",
        "--brokers",
        "127.0.0.1:1",
        "--topic",
        "t",
        "--kafka-sasl-mechanism",
        "SCRAM-SHA-512",
    ])
    .output()
    .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        log.contains("SASL mechanism SCRAM-SHA-512 is set but the security protocol is PLAINTEXT, which does not log in with SASL: set --kafka-security-protocol (IDEM_KAFKA_SECURITY_PROTOCOL) to SASL_SSL, or drop --kafka-sasl-mechanism (IDEM_KAFKA_SASL_MECHANISM)"),
        "{log}"
    );

    let out = idem(&["relay", "--help"])
        .env("IDEM_KAFKA_SASL_PASSWORD", "help-must-not-show-this")
        .env("IDEM_KAFKA_OAUTH_CLIENT_SECRET", "nor-this")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("IDEM_KAFKA_SASL_PASSWORD"), "{help}");
    assert!(help.contains("--kafka-sasl-password-file"), "{help}");
    assert!(!help.contains("help-must-not-show-this"), "{help}");
    assert!(!help.contains("nor-this"), "{help}");
}

/// A topic an ACL denies the relay's principal (SCRAM over SASL_SSL): the cluster's metadata
/// says the relay may not write it, and the relay parks its rows with that reason while the
/// rows of other topics are published.
#[tokio::test(flavor = "multi_thread")]
async fn a_topic_an_acl_denies_is_parked_with_why_and_the_others_flow() {
    use idem_core::publish::{Publisher, TopicState};
    let k = secured(Security::SaslSsl);
    let (user, _) = k.user("SCRAM-SHA-512");
    let (allowed, denied) = (kafka::unique("acl-allowed"), kafka::unique("acl-denied"));
    k.deny(&format!("User:{user}"), &denied);
    let settings = [("message.timeout.ms".to_owned(), "2000".to_owned())];
    let producer = k.connection().producer_config(&settings).unwrap();
    let creator = idem_kafka::KafkaPublisher::new(producer.clone())
        .unwrap()
        .with_topic_creation(1, Some(1));
    let first = idem_core::publish::Message {
        topic: allowed.clone(),
        key: "setup".to_owned(),
        payload: "{}".to_owned(),
        headers: vec![],
    };
    assert!(creator.publish(&[first]).await.iter().all(Result::is_ok));
    let publisher = idem_kafka::KafkaPublisher::new(producer).unwrap();
    assert_eq!(
        publisher.topic_state(&denied).await,
        TopicState::NotAuthorized
    );
    assert_eq!(publisher.topic_state(&allowed).await, TopicState::Writable);

    let pg = Pg::new().await;
    let event = |aggregate_type: &str, id: &str| {
        idem_core::Event::builder(aggregate_type, id, "x.happened")
            .payload(&serde_json::json!({ "id": id }))
            .build()
            .unwrap()
    };
    let mut tx = pg.begin().await;
    idem_conformance::backend::OpenTx::enqueue(
        &mut tx,
        &[
            event("order", "o-1"),
            event("invoice", "i-1"),
            event("order", "o-2"),
        ],
    )
    .await
    .unwrap();
    idem_conformance::backend::OpenTx::commit(tx).await;
    let mut topics = idem_relay::TopicNaming::default();
    topics.overrides.insert("order".to_owned(), allowed);
    topics
        .overrides
        .insert("invoice".to_owned(), denied.clone());
    let config = idem_relay::RelayConfig {
        retry_backoff: Duration::from_millis(100),
        retry_backoff_max: Duration::from_millis(500),
        unwritable_topic_grace: Some(Duration::from_secs(2)),
        topics,
        prune: None,
        ..idem_relay::RelayConfig::default()
    };
    let relay = idem_relay::Relay::builder(pg.store().clone(), publisher)
        .config(config)
        .build()
        .unwrap();
    let rows = "SELECT aggregate_id, status, COALESCE(last_error, '') FROM idem_outbox ORDER BY id";
    let settled = eventually(
        "the invoice parked, the orders published",
        Duration::from_secs(60),
        || async {
            relay.run_once().await.unwrap();
            let now: Vec<(String, String, String)> =
                sqlx::query_as(rows).fetch_all(pg.pool()).await.unwrap();
            now.iter()
                .all(|(a, status, _)| status == if a == "i-1" { "parked" } else { "published" })
                .then_some(now)
        },
    )
    .await;
    let why = &settled.iter().find(|(a, _, _)| a == "i-1").unwrap().2;
    assert!(
        why.contains(&format!("may not write topic {denied}")),
        "{why}"
    );
}
