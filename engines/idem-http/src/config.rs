//! The layer's settings and where a key's scope comes from.

use std::time::Duration;

/// The client a request belongs to, as set by an authentication layer in the request extensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientScope(pub String);

/// Where the layer takes the scope of a key from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ScopeSource {
    /// Only the [`ClientScope`] an authentication layer set; a request without one is refused.
    #[default]
    ClientScope,
    /// The [`ClientScope`], else a hash of the raw `Authorization` header. Opt-in: keys are then
    /// per credential, so a client's retry after a token refresh or rotation executes again.
    ClientScopeOrCredential,
}

/// Layer settings.
#[derive(Clone, Debug)]
pub struct IdempotencyConfig {
    /// How long an in-flight claim is exclusive without renewal (then a retry of the same
    /// request may take it). The layer renews it every third of this while the handler runs.
    pub lock: Duration,
    /// How long a completed key is kept and replayed.
    pub retention: Duration,
    /// Largest request body buffered, and largest response body stored, in bytes.
    pub max_body: usize,
    /// Where the key's scope comes from.
    pub scope: ScopeSource,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        IdempotencyConfig {
            lock: Duration::from_secs(30),
            retention: Duration::from_secs(24 * 3600),
            max_body: 1 << 20,
            scope: ScopeSource::ClientScope,
        }
    }
}
