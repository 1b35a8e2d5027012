//! Why a connection to PostgreSQL failed, said so that a person can act on it: the TLS and
//! authentication refusals of the driver and the server, each with what to change.

use std::error::Error as StdError;

use rustls::{AlertDescription, CertificateError};

use super::url::{PgUrl, SslMode};

/// What to do about `e`, a failure to connect to `url`, when it is a refusal idem recognises:
/// an untrusted or misnamed server certificate, a client certificate the server refused, a
/// server without TLS, a role allowed only over TLS, a wrong password.
pub(crate) fn advice(e: &sqlx::Error, url: &PgUrl) -> Option<String> {
    if let Some(t) = rustls_error(e) {
        return tls_advice(t, url);
    }
    match e {
        sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => Some(format!(
            "nothing accepts connections at {}:{}: check the host and port, and that the server \
             runs",
            url.host, url.port
        )),
        sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => Some(format!(
            "{}:{} does not answer: check the host, the port and the network between",
            url.host, url.port
        )),
        sqlx::Error::Tls(inner) if inner.to_string().contains("does not support TLS") => {
            Some(format!(
                "the server does not offer TLS, and sslmode={} requires it: enable ssl on the \
                 server, or connect to the server that has it",
                url.tls.mode
            ))
        }
        sqlx::Error::Database(db) => server_advice(db.code().as_deref(), db.message(), url),
        _ => None,
    }
}

/// The rustls error inside a driver error, wherever sqlx put it.
fn rustls_error(e: &sqlx::Error) -> Option<&rustls::Error> {
    let mut source: Option<&(dyn StdError + 'static)> = match e {
        sqlx::Error::Io(io) => io.get_ref().map(|i| i as &(dyn StdError + 'static)),
        sqlx::Error::Tls(t) => Some(t.as_ref()),
        _ => None,
    };
    while let Some(s) = source {
        if let Some(t) = s.downcast_ref::<rustls::Error>() {
            return Some(t);
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>()
            && let Some(t) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>())
        {
            return Some(t);
        }
        source = s.source();
    }
    None
}

/// Advice for a TLS failure seen by this client (its own check of the server) or told by the
/// server (an alert: the server refused this client's certificate).
pub(crate) fn tls_advice(t: &rustls::Error, url: &PgUrl) -> Option<String> {
    let trust = match &url.tls.root_cert {
        Some(p) => format!("the CA certificates in sslrootcert ({})", p.display()),
        None => "the system's root certificates (no sslrootcert is set)".to_owned(),
    };
    match t {
        rustls::Error::InvalidCertificate(c) => Some(match c {
            CertificateError::UnknownIssuer | CertificateError::BadSignature => format!(
                "the server's certificate is not signed by {trust}: set sslrootcert=<file> to \
                 the PEM file of the CA that signed the server's certificate"
            ),
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                // sqlx's and pgwire-replication's verify-ca verifiers skip the name check only
                // for rustls' older `NotValidForName`; rustls 0.23 reports the name error with
                // its context, so verify-ca checks the name as verify-full does.
                let why = match url.tls.mode {
                    SslMode::VerifyCa => {
                        "sslmode=verify-ca checks it too in this build: its TLS \
                                          verifier cannot skip the name"
                    }
                    _ => "sslmode=verify-full checks it",
                };
                format!(
                    "the server's certificate does not name the host {:?} ({why}): connect by a \
                     host name the certificate holds",
                    url.host
                )
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "the server's certificate has expired: renew it on the server".to_owned()
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "the server's certificate is not valid yet: check the clocks of both machines"
                    .to_owned()
            }
            other => format!("the server's certificate is refused ({other:?}): check it"),
        }),
        rustls::Error::AlertReceived(alert) => Some(alert_advice(*alert, url)),
        _ => None,
    }
}

fn alert_advice(alert: AlertDescription, url: &PgUrl) -> String {
    let cert = match &url.tls.client_cert {
        Some(p) => format!("the client certificate sslcert={}", p.display()),
        None => "no client certificate (sslcert is not set)".to_owned(),
    };
    match alert {
        AlertDescription::CertificateExpired => {
            format!("the server refused {cert}: it has expired; renew it (sslcert, sslkey)")
        }
        AlertDescription::UnknownCA
        | AlertDescription::BadCertificate
        | AlertDescription::CertificateUnknown
        | AlertDescription::CertificateRevoked
        | AlertDescription::CertificateRequired
        | AlertDescription::AccessDenied => format!(
            "the server refused {cert} ({alert:?}): give a certificate signed by the CA the \
             server trusts (its ssl_ca_file), with sslcert and sslkey"
        ),
        other => format!("the server ended the TLS handshake ({other:?})"),
    }
}

/// Advice for the server's own refusal, by SQLSTATE and text.
fn server_advice(code: Option<&str>, message: &str, url: &PgUrl) -> Option<String> {
    match code {
        Some("28000") if message.contains("no encryption") => Some(format!(
            "the server accepts {:?} only over TLS, and sslmode={} sent the connection in clear: \
             use sslmode=verify-full (with sslrootcert=<CA file>)",
            url.user, url.tls.mode
        )),
        Some("28000") if message.contains("certificate") => Some(
            "the server authenticates this role by certificate: give the client certificate and \
             its key with sslcert=<file>&sslkey=<file>, signed by the CA the server trusts"
                .to_owned(),
        ),
        Some("28P01") => Some(format!(
            "the server refused the password of {:?}: check the password (in the URL, \
             PGPASSWORD or the password file)",
            url.user
        )),
        _ => None,
    }
}
