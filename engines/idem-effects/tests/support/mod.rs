//! Test support shared by the dispatcher's test files: an intent store that runs a hook before
//! every `finish_all` (to fail it, or to let another dispatcher take an intent over first).

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use idem_core::idempotency::{
    ClaimedIntent, EffectIntent, FinishedAttempt, IntentStore, Resolution, StuckIntent,
};

/// What runs before a batch of outcomes is written; an error fails the write.
pub(crate) type FinishHook =
    Arc<dyn Fn(Vec<FinishedAttempt>) -> BoxFuture<'static, idem_core::Result<()>> + Send + Sync>;

/// `inner`, with `hook` run before every `finish_all`.
#[derive(Clone)]
pub(crate) struct HookedFinish<S: IntentStore> {
    pub inner: S,
    pub hook: FinishHook,
}

impl<S: IntentStore> IntentStore for HookedFinish<S> {
    type Conn = S::Conn;
    async fn record(&self, c: &mut Self::Conn, i: &EffectIntent) -> idem_core::Result<bool> {
        self.inner.record(c, i).await
    }
    async fn claim(&self, batch: u32, lease: Duration) -> idem_core::Result<Vec<ClaimedIntent>> {
        self.inner.claim(batch, lease).await
    }
    async fn mark_sending(
        &self,
        id: i64,
        attempt: i32,
        left: Duration,
        settle: Duration,
    ) -> idem_core::Result<bool> {
        self.inner.mark_sending(id, attempt, left, settle).await
    }
    async fn finish_all(&self, finished: &[FinishedAttempt]) -> idem_core::Result<Vec<i64>> {
        (self.hook)(finished.to_vec()).await?;
        self.inner.finish_all(finished).await
    }
    async fn stuck(&self, limit: u32) -> idem_core::Result<Vec<StuckIntent>> {
        self.inner.stuck(limit).await
    }
    async fn retry_stuck(&self, ids: Option<&[i64]>) -> idem_core::Result<u64> {
        self.inner.retry_stuck(ids).await
    }
    async fn get(
        &self,
        id: i64,
    ) -> idem_core::Result<Option<(ClaimedIntent, idem_effects::IntentStatus)>> {
        self.inner.get(id).await
    }
    async fn resolve(&self, id: i64, r: Resolution, note: &str) -> idem_core::Result<bool> {
        self.inner.resolve(id, r, note).await
    }
}
