//! The replication plane: one `START_REPLICATION` session on the slot, through
//! `pgwire-replication`, with the session settings the decoder relies on.

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

/// The replication settings for `url` (a `postgres://user:password@host:port/db` URL), reading
/// `slot` through `publication`. Streaming starts at the slot's confirmed position (`0/0`
/// asks the server for it), and nothing is acknowledged before the relay says so.
pub fn replication_config(
    url: &str,
    slot: &Name,
    publication: &Name,
) -> Result<ReplicationConfig, CdcError> {
    let parsed = url::Url::parse(url).map_err(|e| {
        CdcError::Config(format!(
            "the database URL is not a URL ({e}): use postgres://user:password@host:port/db"
        ))
    })?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return Err(CdcError::Config(format!(
            "the CDC relay reads PostgreSQL only, not a {}: URL",
            parsed.scheme()
        )));
    }
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let host = parsed.host_str().unwrap_or("localhost").to_owned();
    let user = match parsed.username() {
        "" => "postgres".to_owned(),
        u => decode(u),
    };
    let password = parsed.password().map(decode).unwrap_or_default();
    let database = parsed.path().trim_start_matches('/');
    let database = if database.is_empty() {
        user.clone()
    } else {
        decode(database)
    };
    Ok(ReplicationConfig::new(
        host,
        user,
        password,
        database,
        slot.as_str(),
        publication.as_str(),
    )
    .with_port(parsed.port().unwrap_or(5432))
    .with_tls(TlsConfig::disabled())
    .with_start_lsn(Lsn::ZERO)
    .with_options(SESSION_OPTIONS)
    .with_application_name(format!("idem-cdc-{slot}"))
    .with_status_interval(STATUS_INTERVAL)
    .with_wakeup_interval(Duration::from_secs(5))
    // With an observer the client can tell whether a confirmed position is still unsent
    // (`feedback_pending_since`): a graceful stop waits for it (see `stop`).
    .with_feedback_observer(FeedbackObserver::new(|_| {})))
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
}
