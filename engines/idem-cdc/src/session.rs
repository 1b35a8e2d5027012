//! The replication plane: one `START_REPLICATION` session on the slot, through
//! `pgwire-replication`, with the session settings the decoder relies on.

use std::path::PathBuf;
use std::time::Duration;

use pgwire_replication::{FeedbackObserver, Lsn, ReplicationClient, ReplicationConfig, TlsConfig};

use crate::error::CdcError;
use crate::slot::Name;

/// The startup options of every session: text values print as the decoder parses them
/// (ISO timestamps in UTC), whatever the server's or the role's defaults.
pub const SESSION_OPTIONS: &str = "-c datestyle=ISO,YMD -c timezone=UTC -c extra_float_digits=3";

/// How often an acknowledged position reaches the server: a restarted relay resends at most
/// what was acknowledged in the last interval, and the slot releases WAL this soon.
pub const STATUS_INTERVAL: Duration = Duration::from_secs(1);

/// The replication settings for `url` (a `postgres://user:password@host:port/db` URL, read as
/// every pool reads it: [`idem_sql::postgres::PgUrl`]), reading `slot` through `publication`. Streaming
/// starts at the slot's confirmed position (`0/0` asks the server for it), and nothing is
/// acknowledged before the relay says so. The session's TLS is the URL's: the walsender is
/// encrypted and verified exactly as the relay's pool is.
pub fn replication_config(
    url: &str,
    slot: &Name,
    publication: &Name,
) -> Result<ReplicationConfig, CdcError> {
    let target =
        idem_sql::postgres::PgUrl::parse(url).map_err(|e| CdcError::Config(e.to_string()))?;
    Ok(ReplicationConfig::new(
        target.host.clone(),
        target.user.clone(),
        target.password().unwrap_or_default(),
        target.database.clone(),
        slot.as_str(),
        publication.as_str(),
    )
    .with_port(target.port)
    .with_tls(tls_config(&target))
    .with_start_lsn(Lsn::ZERO)
    .with_options(SESSION_OPTIONS)
    .with_application_name(format!("idem-cdc-{slot}"))
    .with_status_interval(STATUS_INTERVAL)
    .with_wakeup_interval(Duration::from_secs(5))
    // With an observer the client can tell whether a confirmed position is still unsent
    // (`feedback_pending_since`): a graceful stop waits for it (see `stop`).
    .with_feedback_observer(FeedbackObserver::new(|_| {})))
}

/// The replication client's TLS settings for `target`'s. Two translations keep the meaning of
/// the pool's settings: a host given as an IP address is verified against the certificate's
/// IP names (the client refuses `verify-full` to an IP unless the name to check is given), and
/// without `sslrootcert` the system's CA bundle is trusted, as the pools trust the system's
/// roots (the client would otherwise trust a compiled-in list).
fn tls_config(target: &idem_sql::postgres::PgUrl) -> TlsConfig {
    use idem_sql::postgres::SslMode as M;
    let roots = target.tls.root_cert.clone().or_else(|| {
        target
            .tls
            .mode
            .verifies_chain()
            .then(system_ca_bundle)
            .flatten()
    });
    let mut tls = match target.tls.mode {
        M::Disable => return TlsConfig::disabled(),
        M::Prefer => TlsConfig {
            mode: pgwire_replication::SslMode::Prefer,
            ..TlsConfig::default()
        },
        M::Require => TlsConfig::require(),
        M::VerifyCa => TlsConfig::verify_ca(roots),
        M::VerifyFull => TlsConfig::verify_full(roots),
    };
    if target.host.parse::<std::net::IpAddr>().is_ok() {
        tls = tls.with_sni_hostname(target.host.clone());
    }
    if let (Some(c), Some(k)) = (&target.tls.client_cert, &target.tls.client_key) {
        tls = tls.with_client_cert(c, k);
    }
    tls
}

/// The system's CA bundle: `SSL_CERT_FILE`, else the first of the usual places that exists.
fn system_ca_bundle() -> Option<PathBuf> {
    let candidates = [
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/pki/tls/certs/ca-bundle.crt",
        "/etc/ssl/ca-bundle.pem",
        "/etc/ssl/cert.pem",
    ];
    std::env::var_os("SSL_CERT_FILE")
        .map(PathBuf::from)
        .into_iter()
        .chain(candidates.iter().map(PathBuf::from))
        .find(|p| p.is_file())
}

/// Ends the session gracefully: waits (at most twice the status interval) until the last
/// confirmed position reached the server, then stops. Without the wait, a relay stopped right
/// after confirming would find the slot behind and publish the last batch again.
pub async fn stop(client: &mut ReplicationClient) {
    let deadline = tokio::time::Instant::now() + STATUS_INTERVAL * 2;
    while client.feedback_pending_since().is_some() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Err(e) = client.shutdown().await {
        tracing::debug!(error = %e, "replication session shutdown");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> (Name, Name) {
        (
            Name::new("slot", "s").unwrap_or_else(|e| panic!("{e}")),
            Name::new("publication", "p").unwrap_or_else(|e| panic!("{e}")),
        )
    }

    #[test]
    fn a_url_becomes_a_session_that_starts_at_the_slot_s_position() {
        let (s, p) = names();
        let c = replication_config("postgres://app:p%40s+s@db.local:6543/orders", &s, &p)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (
                c.host.as_str(),
                c.port,
                c.user.as_str(),
                c.password.as_str()
            ),
            ("db.local", 6543, "app", "p@s+s")
        );
        assert_eq!(c.database, "orders");
        assert_eq!(c.start_lsn, Lsn::ZERO);
        assert_eq!(c.ack_lsn, None);
        assert_eq!(c.slot, "s");
    }

    #[test]
    fn other_schemes_and_non_urls_are_refused() {
        let (s, p) = names();
        assert!(replication_config("sqlite://x.db", &s, &p).is_err());
        assert!(replication_config("not a url", &s, &p).is_err());
    }

    #[test]
    fn the_session_s_tls_is_the_url_s() {
        let (s, p) = names();
        let tls = |url: &str| {
            replication_config(url, &s, &p)
                .unwrap_or_else(|e| panic!("{e}"))
                .tls
        };
        let dir = std::env::temp_dir();
        let ca = dir.join(format!("idem-session-ca-{}.pem", std::process::id()));
        std::fs::write(&ca, "not read here").unwrap_or_else(|e| panic!("{e}"));
        let t = tls(&format!(
            "postgres://u@127.0.0.1/d?sslmode=verify-full&sslrootcert={}",
            ca.display()
        ));
        assert_eq!(t.mode, pgwire_replication::SslMode::VerifyFull);
        assert_eq!(t.ca_pem_path.as_deref(), Some(ca.as_path()));
        assert_eq!(
            t.sni_hostname.as_deref(),
            Some("127.0.0.1"),
            "an IP is checked as an IP"
        );
        let t = tls(&format!(
            "postgres://u@db.local/d?sslmode=require&sslrootcert={}",
            ca.display()
        ));
        assert_eq!(
            t.mode,
            pgwire_replication::SslMode::VerifyCa,
            "require with a CA, as libpq"
        );
        assert_eq!(t.sni_hostname, None);
        assert_eq!(
            tls("postgres://u@h/d").mode,
            pgwire_replication::SslMode::Prefer
        );
        assert_eq!(
            tls("postgres://u@h/d?sslmode=disable").mode,
            pgwire_replication::SslMode::Disable
        );
        let _ = std::fs::remove_file(&ca);
    }
}
