//! idem over SASL_SSL with OAUTHBEARER and the OIDC client-credentials flow, as real OS
//! processes: `idem topic create` and `idem relay` fetch their token from an identity provider
//! on loopback (`idem_conformance::oidc`, ES256 JWTs) and log in with it to an Apache Kafka
//! broker that validates it with Kafka's own `OAuthBearerValidatorCallbackHandler` against the
//! provider's JWKS URL, audience and issuer (`scripts/kafka --security sasl_ssl_oauth`). The
//! broker's principal is the token's `sub`. A wrong client secret, and a token for another
//! audience, each stop the command at start with what is wrong and what to do; no secret
//! reaches a log or `--help`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use idem_conformance::backend::Pg;
use idem_conformance::kafka::{self, SecuredKafka, Security, secured};
use idem_conformance::oidc::{Grant, OidcClient};
use idem_conformance::process::{Proc, eventually};

/// How long a refused command may take to stop: the token request, librdkafka's first
/// handshake and login, plus the process start.
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

/// The OAUTHBEARER login of `client` at `k`'s identity provider: the flags on the command
/// line, the client secret in a file named by its environment variable.
fn oauth(cmd: &mut Command, k: &SecuredKafka, client: &OidcClient, secret_file: &Path) {
    std::fs::write(secret_file, format!("{}\n", client.secret)).unwrap();
    cmd.args([
        "--kafka-security-protocol",
        "SASL_SSL",
        "--kafka-sasl-mechanism",
        "OAUTHBEARER",
        "--kafka-oauth-token-endpoint",
        &k.identity_provider().token_endpoint(),
        "--kafka-oauth-client-id",
        &client.id,
        "--kafka-oauth-scope",
        "kafka:produce",
    ])
    .arg("--kafka-ssl-ca")
    .arg(k.pki("ca.pem"))
    .env("IDEM_KAFKA_OAUTH_CLIENT_SECRET_FILE", secret_file);
}

/// Runs `cmd` until it exits (at most [`REFUSAL_BOUND`]); returns its standard error, having
/// asserted that it failed in time.
fn refused(name: &str, cmd: Command) -> String {
    Proc::refused(name, cmd, REFUSAL_BOUND)
}

fn assert_no_secret(what: &str, log: &str, secret: &str) {
    assert!(!log.contains(secret), "a secret reached the {what}:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_publishes_over_sasl_ssl_with_an_oidc_token_and_the_broker_logs_its_subject() {
    let k = secured(Security::SaslSslOAuth);
    let idp = k.identity_provider();
    let client = idp.new_client("idem-relay");
    let orders = Pg::new().await;
    setup(orders.url());
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("oauth-client-secret");
    let prefix = format!("{}.", kafka::unique("oauth"));
    let topic = format!("{prefix}order");

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
    oauth(&mut create, k, &client, &secret_file);
    let out = create.output().unwrap();
    let create_log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{create_log}");
    assert_no_secret("topic create's output", &create_log, &client.secret);

    let out = idem(&["orders", "--db", orders.url(), "--count", "20"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    oauth(&mut relay, k, &client, &secret_file);
    let relay = Proc::spawn("relay", relay);

    // Read back with the broker's SCRAM login: another principal than the relay's.
    let conn = k.connection().client_config();
    eventually(
        "20 records published with an OIDC token",
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

    let principal = format!("User:{}", client.subject);
    assert!(
        k.authorized(&principal, "CreateTopics") > 0,
        "the broker logged no CreateTopics of {principal}:\n{}",
        k.broker_log()
    );
    assert!(
        k.authorized(&principal, "Produce") > 0,
        "the broker logged no Produce of {principal}:\n{}",
        k.broker_log()
    );
    let grants = idp.grants();
    assert!(
        grants
            .iter()
            .filter(|g| **g == Grant::Issued(client.id.clone()))
            .count()
            >= 2,
        "the identity provider issued fewer than two tokens (topic create, relay): {grants:?}"
    );
    assert_no_secret("relay's log", &relay.log().join("\n"), &client.secret);
    assert_no_secret("broker's log", &k.broker_log(), &client.secret);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oidc_refusals_stop_the_command_at_start_with_what_to_do() {
    let k = secured(Security::SaslSslOAuth);
    let idp = k.identity_provider();
    let client = idp.new_client("idem-relay");
    let orders = Pg::new().await;
    let dir = tempfile::tempdir().unwrap();
    let endpoint = idp.token_endpoint();

    // A wrong client secret: the token endpoint refuses it, and the relay stops before its
    // first batch.
    let wrong = OidcClient {
        secret: "not-the-client-secret".to_owned(),
        ..client.clone()
    };
    let mut relay = idem(&["relay", "--db", orders.url(), "--brokers", k.brokers()]);
    oauth(&mut relay, k, &wrong, &dir.path().join("wrong-secret"));
    let log = refused("relay-wrong-secret", relay);
    let expected = format!(
        "idem relay cannot use the Kafka cluster: the OIDC token endpoint {endpoint} gave client idem-relay no token ({{\"error\":\"invalid_client\",\"error_description\":\"client authentication failed\"}}): check the client id --kafka-oauth-client-id (IDEM_KAFKA_OAUTH_CLIENT_ID) and the client secret --kafka-oauth-client-secret-file (IDEM_KAFKA_OAUTH_CLIENT_SECRET or IDEM_KAFKA_OAUTH_CLIENT_SECRET_FILE) with the identity provider, and that --kafka-oauth-token-endpoint (IDEM_KAFKA_OAUTH_TOKEN_ENDPOINT) is its token URL"
    );
    assert!(log.contains(&expected), "{log}");
    assert_no_secret("relay's log", &log, "not-the-client-secret");
    assert_no_secret("relay's log", &log, &client.secret);
    assert!(
        idp.grants().contains(&Grant::Refused("invalid_client")),
        "the token endpoint refused nothing: {:?}",
        idp.grants()
    );

    // The right secret, but the provider issues this client's tokens for another audience:
    // the broker refuses the token.
    let other = OidcClient {
        id: "idem-other-audience".to_owned(),
        secret: format!("secret-{}", uuid::Uuid::new_v4().simple()),
        subject: "service-account-idem-other-audience".to_owned(),
        audience: Some("another-api".to_owned()),
    };
    idp.add_client(other.clone());
    let mut create = idem(&["topic", "create", "--brokers", k.brokers(), "--topic", "t"]);
    oauth(&mut create, k, &other, &dir.path().join("other-secret"));
    let log = refused("topic-other-audience", create);
    let expected = format!(
        "idem topic create cannot use the Kafka cluster: the Kafka broker refused the OAUTHBEARER token that {endpoint} issued to client idem-other-audience ("
    );
    assert!(log.contains(&expected), "{log}");
    assert!(
        log.contains("check that the identity provider gives this client tokens with the audience and issuer the broker expects"),
        "{log}"
    );
    assert_no_secret("topic create's log", &log, &other.secret);
    assert!(
        k.broker_log().contains(
            "Audience (aud) claim [another-api] doesn't contain an acceptable identifier"
        ),
        "the broker's log does not name the audience:\n{}",
        k.broker_log()
    );
    assert!(
        idp.grants().contains(&Grant::Issued(other.id.clone())),
        "no token was issued to {}: {:?}",
        other.id,
        idp.grants()
    );

    // The secret given in the environment is never shown by --help.
    let out = idem(&["relay", "--help"])
        .env("IDEM_KAFKA_OAUTH_CLIENT_SECRET", &client.secret)
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("IDEM_KAFKA_OAUTH_CLIENT_SECRET"), "{help}");
    assert_no_secret("--help", &help, &client.secret);
}
