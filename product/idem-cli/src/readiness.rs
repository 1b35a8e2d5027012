//! What a command's `/readyz` watches beyond what its engine reports: whether the broker
//! answers at all, also while there is nothing to send or receive.

use std::time::Duration;

use idem_core::health::Health;
use idem_kafka::ClientConfig;

/// The dependency name of the broker.
pub const BROKER: &str = "broker";

/// How often the broker is asked for the cluster's metadata, and how long it may take.
const EVERY: Duration = Duration::from_secs(5);
const TIMEOUT: Duration = Duration::from_secs(5);

/// Marks the broker expected in `health` and asks it for the cluster's metadata every few
/// seconds in the background (a client of `client`'s connection and security settings, a
/// producer's or a consumer's), recording whether it answered.
pub fn watch_broker(client: &ClientConfig, health: &Health) {
    health.expect(BROKER);
    let conn = idem_kafka::admin::connection_of(client);
    let health = health.clone();
    tokio::spawn(async move {
        loop {
            let c = conn.clone();
            let answer =
                tokio::task::spawn_blocking(move || idem_kafka::admin::broker_ids(&c, TIMEOUT))
                    .await;
            match answer {
                Ok(Ok(ids)) if !ids.is_empty() => health.ok(BROKER),
                Ok(Ok(_)) => health.failed(BROKER, &"the cluster reports no broker"),
                Ok(Err(e)) => health.failed(BROKER, &e),
                Err(e) => health.failed(BROKER, &e),
            }
            tokio::time::sleep(EVERY).await;
        }
    });
}
