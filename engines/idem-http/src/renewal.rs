//! A claim this request holds: its lock renewed while the handler runs, and its completion or
//! release fenced by its token.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_core::idempotency::{ClaimToken, IdempotencyKey, IdempotencyStore, StoredResponse};

use crate::IdempotencyConfig;
use crate::metrics::Counters;

/// A claim this request holds.
pub(crate) struct Held<S> {
    pub(crate) store: S,
    pub(crate) scope: String,
    pub(crate) key: IdempotencyKey,
    pub(crate) token: ClaimToken,
    pub(crate) config: IdempotencyConfig,
    pub(crate) counters: Counters,
    /// Set once the claim was found lost (counted once per claim).
    pub(crate) lost: AtomicBool,
}

impl<S: IdempotencyStore> Held<S> {
    /// Runs `work` while renewing the claim's lock.
    pub(crate) async fn while_renewing<T>(&self, work: impl Future<Output = T>) -> T {
        let work = std::pin::pin!(work);
        let mut work = work;
        tokio::select! {
            biased;
            out = &mut work => out,
            () = self.heartbeat() => work.await,
        }
    }

    /// Renews the lock every third of it; returns only when the claim is lost.
    async fn heartbeat(&self) {
        if idem_core::crash::broken(idem_core::crash::Mechanism::KeyLockRenewal) {
            return std::future::pending().await;
        }
        let every =
            (self.config.lock / 3).clamp(Duration::from_millis(1), Duration::from_secs(3600));
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let renewed = self
                .store
                .renew(&self.scope, &self.key, &self.token, self.config.lock)
                .await;
            match renewed {
                Ok(true) => {}
                Ok(false) => return self.lost("renewing its lock"),
                Err(e) => {
                    self.counters.renewal_failed();
                    tracing::warn!(error = %e, "renewing the lock of an idempotency key failed; trying again");
                }
            }
        }
    }

    /// Counts (once) and logs the claim found lost while `doing`.
    fn lost(&self, doing: &str) {
        if !self.lost.swap(true, Ordering::Relaxed) {
            self.counters.claim_lost();
        }
        tracing::error!(
            key = self.key.as_str(),
            "the idempotency key's claim was lost (its lock ran out and a retry took it over, or it was swept) when {doing}: a retry may have executed beside this request; nothing was changed"
        );
    }

    /// Stores the response, fenced by the claim's token.
    pub(crate) async fn complete(&self, stored: &StoredResponse) {
        match self
            .store
            .complete(&self.scope, &self.key, &self.token, stored)
            .await
        {
            Ok(true) => {}
            Ok(false) => self.lost("storing its response"),
            // The effect happened; a retry will see the key in flight until the lock expires,
            // then execute again. Logged so an operator can see the window.
            Err(e) => tracing::error!(error = %e, "storing an idempotent response failed"),
        }
    }

    /// Releases the key, fenced by the claim's token, so that a retry executes again.
    pub(crate) async fn release(&self) {
        match self
            .store
            .release(&self.scope, &self.key, &self.token)
            .await
        {
            Ok(true) => {}
            Ok(false) => self.lost("releasing it"),
            Err(e) => {
                tracing::warn!(error = %e, "releasing an idempotency key after a server error")
            }
        }
    }
}
