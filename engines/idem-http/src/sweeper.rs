//! Deleting expired keys.

use std::time::Duration;

use idem_core::idempotency::IdempotencyStore;

/// Deletes expired keys every `every`, until the runtime shuts down.
pub fn spawn_sweeper<S: IdempotencyStore>(
    store: S,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            match store.sweep().await {
                Ok(n) if n > 0 => tracing::info!(deleted = n, "swept expired idempotency keys"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "sweeping idempotency keys"),
            }
        }
    })
}
