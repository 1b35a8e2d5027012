//! The start-up connection check against addresses where nothing listens: an unreachable
//! cluster is told apart from a refusal, and quickly (a relay restarted while its broker is
//! down still starts). The refusals themselves need a real secured broker: they are in
//! lab/idem-lab/tests/kafka_security.rs.
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::{Duration, Instant};

use idem_kafka::{ConnectError, Connection};

#[tokio::test]
async fn a_closed_port_is_unreachable_not_refused_and_said_at_once() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let brokers = format!("127.0.0.1:{port}");
    let started = Instant::now();
    let result = Connection::plaintext(&brokers)
        .check(Duration::from_secs(30))
        .await;
    let took = started.elapsed();
    match result {
        Err(e @ ConnectError::Unreachable(_)) => {
            assert!(!e.is_refusal());
            let text = e.to_string();
            assert!(
                text.starts_with(&format!(
                    "nothing listens at {brokers} (connection refused) (last report: "
                )),
                "{text}"
            );
        }
        other => panic!("expected Unreachable, got {other:?}"),
    }
    assert!(took < Duration::from_secs(10), "took {took:?}");
}
