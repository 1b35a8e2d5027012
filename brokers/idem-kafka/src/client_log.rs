//! librdkafka's log lines and global errors, routed to `tracing` with a broker outage kept out
//! of the warnings.
//!
//! While a broker is down librdkafka reports every reconnection attempt of every client, once
//! as a log line and again as a global error: several lines a second that repeat one fact.
//! idem reports that fact itself, by its cause, once and then at a bounded rate (the
//! `idem_core::health` checks behind `/readyz`, and the engines' own warnings), so these
//! reports go to `debug`. Everything else librdkafka says keeps its level.

use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;

/// The context of idem's Kafka clients: librdkafka's reports through [`log_line`] and
/// [`global_error`].
#[derive(Debug, Default, Clone, Copy)]
pub struct Reported;

impl rdkafka::consumer::ConsumerContext for Reported {}

impl ClientContext for Reported {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        log_line(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        global_error(&error, reason);
    }
}

/// How loud a report is: an outage report is `debug` whatever librdkafka's level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loudness {
    Error,
    Warn,
    Info,
    Debug,
}

/// The loudness of a librdkafka log line.
pub(crate) fn line_loudness(level: RDKafkaLogLevel, message: &str) -> Loudness {
    if is_outage(message) {
        return Loudness::Debug;
    }
    match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => Loudness::Error,
        RDKafkaLogLevel::Warning => Loudness::Warn,
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => Loudness::Info,
        RDKafkaLogLevel::Debug => Loudness::Debug,
    }
}

/// The loudness of a librdkafka global error.
pub(crate) fn error_loudness(error: &KafkaError, reason: &str) -> Loudness {
    use rdkafka::types::RDKafkaErrorCode as Code;
    let transport = matches!(
        error.rdkafka_error_code(),
        Some(Code::BrokerTransportFailure | Code::AllBrokersDown)
    );
    if transport || is_outage(reason) {
        Loudness::Debug
    } else {
        Loudness::Error
    }
}

/// Whether `text` reports a broker that cannot be reached or dropped the connection: what a
/// broker that is down, restarting or unreachable makes every client say on every attempt.
/// A refused login or certificate is not among them: those stay loud.
fn is_outage(text: &str) -> bool {
    const OUTAGE: [&str; 7] = [
        "Connection refused",
        "Broker transport failure",
        "brokers are down",
        "connection reset by peer",
        "connection closed by peer",
        "Disconnected (after",
        "Connect to ipv",
    ];
    OUTAGE.iter().any(|m| text.contains(m))
}

/// Logs a librdkafka log line at its loudness: an outage report at `debug`, the rest at its
/// own level.
pub fn log_line(level: RDKafkaLogLevel, fac: &str, message: &str) {
    match line_loudness(level, message) {
        Loudness::Error => tracing::error!(target: "librdkafka", "librdkafka: {fac} {message}"),
        Loudness::Warn => tracing::warn!(target: "librdkafka", "librdkafka: {fac} {message}"),
        Loudness::Info => tracing::info!(target: "librdkafka", "librdkafka: {fac} {message}"),
        Loudness::Debug => tracing::debug!(target: "librdkafka", "librdkafka: {fac} {message}"),
    }
}

/// Logs a librdkafka global error: a broker outage at `debug`, the rest at `error`.
pub fn global_error(error: &KafkaError, reason: &str) {
    match error_loudness(error, reason) {
        Loudness::Debug => tracing::debug!(target: "librdkafka", "librdkafka: {error}: {reason}"),
        _ => tracing::error!(target: "librdkafka", "librdkafka: {error}: {reason}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::types::RDKafkaErrorCode;

    /// Lines librdkafka 2.x writes while the broker of a run is SIGKILLed and restarted.
    #[test]
    fn a_broker_outage_is_debug_and_the_rest_keeps_its_level() {
        let refused = "127.0.0.1:32355/1: Connect to ipv4#127.0.0.1:32355 failed: Connection \
                       refused (after 0ms in state CONNECT)";
        let reset = "127.0.0.1:32355/1: Disconnected: connection reset by peer (after 12156ms \
                     in state UP)";
        assert_eq!(
            line_loudness(RDKafkaLogLevel::Error, refused),
            Loudness::Debug
        );
        assert_eq!(
            line_loudness(RDKafkaLogLevel::Warning, reset),
            Loudness::Debug
        );
        let transport = KafkaError::Global(RDKafkaErrorCode::BrokerTransportFailure);
        assert_eq!(error_loudness(&transport, refused), Loudness::Debug);
        let down = KafkaError::Global(RDKafkaErrorCode::AllBrokersDown);
        assert_eq!(
            error_loudness(&down, "1/1 brokers are down"),
            Loudness::Debug
        );

        let pid = "Failed to acquire idempotence PID from broker 127.0.0.1:32355/1: Broker: \
                   Coordinator load in progress: retrying";
        assert_eq!(line_loudness(RDKafkaLogLevel::Warning, pid), Loudness::Warn);
        let login = "SASL authentication error: Authentication failed during authentication \
                     due to invalid credentials with SASL mechanism SCRAM-SHA-512";
        let auth = KafkaError::Global(RDKafkaErrorCode::Authentication);
        assert_eq!(error_loudness(&auth, login), Loudness::Error);
        assert_eq!(
            line_loudness(RDKafkaLogLevel::Error, login),
            Loudness::Error
        );
        let tls = "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed";
        assert_eq!(line_loudness(RDKafkaLogLevel::Error, tls), Loudness::Error);
    }
}
