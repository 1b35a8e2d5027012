//! Pools over TLS against the suite's real PostgreSQL server (`ssl = on`, certificates made for
//! the run by `scripts/test`): `verify-full` connects encrypted, `prefer` encrypts when the
//! server offers TLS, and every refusal — an untrusted CA, a certificate for another host, a
//! role allowed only over TLS reached in clear, an expired or missing client certificate, a
//! wrong password — fails at once with what to change, never with the password in it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use idem_conformance::pg::{PgTlsMaterial, TestDb};
use idem_core::TableNames;
use sqlx::PgPool;

/// A refusal must come well before any pool or statement timeout.
const REFUSED_WITHIN: Duration = Duration::from_secs(10);

async fn connect(url: &str) -> idem_core::Result<PgPool> {
    tokio::time::timeout(Duration::from_secs(30), idem_sql::postgres::connect(url, 2))
        .await
        .unwrap_or_else(|_| panic!("connecting to {} hung", idem_sql::redact(url)))
}

/// Connects to `url`, which must be refused; returns the message (checked for the password).
async fn refusal(url: &str, tls: &PgTlsMaterial) -> String {
    let start = Instant::now();
    let message = match connect(url).await {
        Ok(_) => panic!("{} connected", idem_sql::redact(url)),
        Err(e) => e.to_string(),
    };
    assert!(
        start.elapsed() < REFUSED_WITHIN,
        "refused only after {:?}: {message}",
        start.elapsed()
    );
    assert!(
        !message.contains(&tls.password()),
        "the password is in the message: {message}"
    );
    eprintln!("refused: {message}");
    message
}

/// Whether this pool's own backend is encrypted, and with which protocol.
async fn ssl_of(pool: &PgPool) -> (bool, Option<String>) {
    sqlx::query_as("SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn verify_full_with_the_run_s_ca_connects_encrypted_and_the_store_works() {
    let tls = PgTlsMaterial::get();
    let db = TestDb::create_owned_by("idem_tls").await;
    let pool = connect(&tls.verify_full_url(db.name()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (ssl, version) = ssl_of(&pool).await;
    assert!(ssl, "not encrypted");
    assert!(version.is_some_and(|v| v.starts_with("TLSv1.")));
    idem_sql::migrate(&pool, &TableNames::default())
        .await
        .unwrap_or_else(|e| panic!("migrating over TLS: {e}"));
    let user: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(user, "idem_tls");
}

#[tokio::test]
async fn prefer_the_default_encrypts_when_the_server_offers_tls_and_disable_does_not() {
    let db = TestDb::create().await;
    let pool = connect(db.url()).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        ssl_of(&pool).await.0,
        "sslmode=prefer (the default) went in clear"
    );
    let pool = connect(&format!("{}?sslmode=disable", db.url()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!ssl_of(&pool).await.0, "sslmode=disable was encrypted");
}

#[tokio::test]
async fn a_plain_text_connection_of_a_tls_only_role_is_refused_with_what_to_do() {
    let tls = PgTlsMaterial::get();
    let db = TestDb::create_owned_by("idem_tls").await;
    let m = refusal(
        &tls.tls_url("127.0.0.1", db.name(), "sslmode=disable"),
        &tls,
    )
    .await;
    assert!(
        m.contains(
            "the server accepts \"idem_tls\" only over TLS, and sslmode=disable sent the \
             connection in clear: use sslmode=verify-full (with sslrootcert=<CA file>)"
        ),
        "{m}"
    );
    assert!(m.contains("idem_tls:***@127.0.0.1"), "{m}");
}

#[tokio::test]
async fn a_server_certificate_from_an_untrusted_ca_is_refused() {
    let tls = PgTlsMaterial::get();
    let db = TestDb::create_owned_by("idem_tls").await;
    let other = tls.file("other-ca.pem");
    let url = tls.tls_url(
        "127.0.0.1",
        db.name(),
        &format!("sslmode=verify-full&sslrootcert={other}"),
    );
    let m = refusal(&url, &tls).await;
    assert!(
        m.contains(&format!(
            "the server's certificate is not signed by the CA certificates in sslrootcert \
             ({other}): set sslrootcert=<file> to the PEM file of the CA that signed the \
             server's certificate"
        )),
        "{m}"
    );
}

#[tokio::test]
async fn a_certificate_for_another_host_is_refused_under_verify_full_and_verify_ca() {
    let tls = PgTlsMaterial::get();
    let db = TestDb::create_owned_by("idem_tls").await;
    let ca = tls.ca();
    // The server's certificate names IP 127.0.0.1 only; "localhost" reaches the same server.
    let url = tls.tls_url(
        "localhost",
        db.name(),
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    let m = refusal(&url, &tls).await;
    assert!(
        m.contains(
            "the server's certificate does not name the host \"localhost\" (sslmode=verify-full \
             checks it): connect by a host name the certificate holds"
        ),
        "{m}"
    );
    // verify-ca checks the name too (stricter than libpq's verify-ca, never weaker), and says so.
    let url = tls.tls_url(
        "localhost",
        db.name(),
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
    );
    let m = refusal(&url, &tls).await;
    assert!(
        m.contains("(sslmode=verify-ca checks it too in this build"),
        "{m}"
    );
    let url = tls.tls_url(
        "127.0.0.1",
        db.name(),
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
    );
    let pool = connect(&url).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(ssl_of(&pool).await.0);
}

#[tokio::test]
async fn a_client_certificate_authenticates_and_an_expired_or_missing_one_is_refused() {
    let tls = PgTlsMaterial::get();
    let db = TestDb::create_owned_by("idem_cert").await;
    let pool = connect(&tls.cert_url(db.name(), "idem_cert"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let user: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(user, "idem_cert");
    assert!(ssl_of(&pool).await.0);

    let expired = tls.file("idem_cert-expired.pem");
    let m = refusal(&tls.cert_url(db.name(), "idem_cert-expired"), &tls).await;
    assert!(
        m.contains(&format!(
            "the server refused the client certificate sslcert={expired}: it has expired; renew \
             it (sslcert, sslkey)"
        )),
        "{m}"
    );

    let url = format!(
        "postgres://idem_cert@127.0.0.1:5432/{}?sslmode=verify-full&sslrootcert={}",
        db.name(),
        tls.ca()
    );
    let m = refusal(&url, &tls).await;
    assert!(
        m.contains(
            "the server authenticates this role by certificate: give the client certificate and \
             its key with sslcert=<file>&sslkey=<file>"
        ),
        "{m}"
    );
}

#[tokio::test]
async fn a_wrong_password_is_refused_by_name_without_the_password() {
    let tls = PgTlsMaterial::get();
    let db = TestDb::create_owned_by("idem_tls").await;
    let url = format!(
        "postgres://idem_tls:not-the-password@127.0.0.1:5432/{}?sslmode=verify-full&sslrootcert={}",
        db.name(),
        tls.ca()
    );
    let m = refusal(&url, &tls).await;
    assert!(
        m.contains("the server refused the password of \"idem_tls\""),
        "{m}"
    );
    assert!(!m.contains("not-the-password"), "{m}");
}
