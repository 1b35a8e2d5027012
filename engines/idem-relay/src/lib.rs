#![doc = include_str!("../README.md")]

mod cycle;
mod message;
mod metrics;
mod outcome;
pub mod unwritable;

use std::future::Future;
use std::sync::atomic::AtomicI64;
use std::time::{Duration, Instant};

use idem_core::backoff::Backoff;
use idem_core::health::Health;
use idem_core::outbox::{Claim, PrunePolicy};
use idem_core::publish::Publisher;
use idem_core::store::OutboxStore;
use idem_core::{Error, Result};
use unwritable::Unwritable;

pub use idem_core::wire::{DEFAULT_TOPIC_PREFIX, TopicNaming};
pub use metrics::RelayMetrics;

/// Relay settings. [`RelayConfig::default`] is what `idem relay` uses.
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// Shown in `claimed_by`; unique per process by default.
    pub relay_id: String,
    /// Rows per claim.
    pub batch_size: u32,
    /// How long a claim is exclusive. Longer than the producer's message timeout, so a live
    /// relay always finishes before its lease ends.
    pub lease: Duration,
    /// First idle poll interval; doubles while the outbox stays empty.
    pub idle_poll_min: Duration,
    /// Longest idle poll interval: the worst added latency when idle.
    pub idle_poll_max: Duration,
    /// Permanent failures (too large, invalid topic, …) before a row is parked. Transient
    /// failures never park a row.
    pub max_attempts: i32,
    /// Backoff after the first failed attempt; doubles per attempt.
    pub retry_backoff: Duration,
    /// Longest backoff.
    pub retry_backoff_max: Duration,
    /// How long messages to a topic may fail without a success before the relay asks the
    /// cluster about the topic; when it answers that the topic does not exist or may not be
    /// written, its rows are parked at once with the reason ([`unwritable`]). `None`: such rows
    /// are retried for ever, holding back their aggregates.
    pub unwritable_topic_grace: Option<Duration>,
    /// Topic naming.
    pub topics: TopicNaming,
    /// `ce_source`; `None` means `/idem/<aggregate_type>`.
    pub source: Option<String>,
    /// Prune published rows every `.0` with policy `.1`; `None` disables pruning.
    pub prune: Option<(Duration, PrunePolicy)>,
    /// How often the pending/parked gauges are refreshed.
    pub status_interval: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            relay_id: default_relay_id(),
            batch_size: 500,
            lease: Duration::from_secs(60),
            idle_poll_min: Duration::from_millis(1),
            idle_poll_max: Duration::from_millis(20),
            max_attempts: 5,
            retry_backoff: Duration::from_millis(500),
            retry_backoff_max: Duration::from_secs(60),
            unwritable_topic_grace: Some(Duration::from_secs(60)),
            topics: TopicNaming::default(),
            source: None,
            prune: Some((Duration::from_secs(60), PrunePolicy::default())),
            status_interval: Duration::from_secs(10),
        }
    }
}

/// `relay-<pid>-<random>`.
pub fn default_relay_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("relay-{}-{:08x}", std::process::id(), nanos)
}

/// What one claim–publish–mark cycle did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CycleReport {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows acknowledged by the broker and marked published.
    pub published: u64,
    /// Of those, rows that had been attempted before (republishes).
    pub republished: u64,
    /// Rows released for a later attempt.
    pub retried: u64,
    /// Rows parked.
    pub parked: u64,
    /// Rows whose lease had been taken over by another relay: left untouched.
    pub fenced: u64,
}

/// The relay: claims outbox rows, publishes them, waits for every delivery report, marks them.
pub struct Relay<S, P> {
    store: S,
    publisher: Unwritable<P>,
    config: RelayConfig,
    metrics: RelayMetrics,
    /// Highest id marked published (used only by the `id-watermark` negative control).
    watermark: AtomicI64,
    /// The database's and the publishing's state, for `/readyz` and the outage log.
    health: Health,
}

impl<S, P> std::fmt::Debug for Relay<S, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("store", &std::any::type_name::<S>())
            .field("publisher", &std::any::type_name::<P>())
            .field("config", &self.config)
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Relay`]: [`RelayConfig::default`] unless [`RelayBuilder::config`] says otherwise,
/// and metrics registered only when a registry is given ([`RelayBuilder::registry`]).
pub struct RelayBuilder<S, P> {
    store: S,
    publisher: P,
    config: RelayConfig,
    registry: Option<prometheus::Registry>,
    metrics: Option<RelayMetrics>,
    health: Health,
}

impl<S, P> std::fmt::Debug for RelayBuilder<S, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayBuilder")
            .field("config", &self.config)
            .field("registry", &self.registry.is_some())
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

impl<S: OutboxStore, P: Publisher> RelayBuilder<S, P> {
    /// The settings.
    pub fn config(mut self, config: RelayConfig) -> Self {
        self.config = config;
        self
    }

    /// Creates the relay's metrics and registers them in `registry` (at [`RelayBuilder::build`]).
    pub fn registry(mut self, registry: &prometheus::Registry) -> Self {
        self.registry = Some(registry.clone());
        self
    }

    /// Counts into `metrics`, created (and registered) by the caller; wins over
    /// [`RelayBuilder::registry`].
    pub fn metrics(mut self, metrics: RelayMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Reports the database's and the publishing's state into `health` ([`DATABASE`],
    /// [`PUBLISHING`]), read by `/readyz`; their outages are logged there, once and then at a
    /// bounded rate.
    pub fn health(mut self, health: Health) -> Self {
        self.health = health;
        self
    }

    /// The relay. Without a registry or metrics it counts into metrics nothing exports.
    /// Fails when the registry holds the relay's metric names already.
    pub fn build(self) -> Result<Relay<S, P>> {
        let metrics = match (self.metrics, &self.registry) {
            (Some(m), _) => m,
            (None, Some(registry)) => RelayMetrics::new(registry)?,
            (None, None) => RelayMetrics::unregistered()?,
        };
        let mut relay = Relay::new(self.store, self.publisher, self.config, metrics);
        relay.health = self.health;
        Ok(relay)
    }
}

/// The wait after a cycle that failed (the database or the broker down): 200 ms, doubling
/// while it fails, at most 10 s.
const ERROR_BACKOFF: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));

impl<S: OutboxStore, P: Publisher> Relay<S, P> {
    /// A relay over `store` and `publisher`.
    pub fn new(store: S, publisher: P, config: RelayConfig, metrics: RelayMetrics) -> Self {
        Relay {
            store,
            publisher: Unwritable::new(publisher, config.unwritable_topic_grace),
            config,
            metrics,
            watermark: AtomicI64::new(0),
            health: Health::new(),
        }
    }

    /// A builder of a relay over `store` and `publisher`, metrics optional.
    pub fn builder(store: S, publisher: P) -> RelayBuilder<S, P> {
        RelayBuilder {
            store,
            publisher,
            config: RelayConfig::default(),
            registry: None,
            metrics: None,
            health: Health::new(),
        }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The metrics.
    pub fn metrics(&self) -> &RelayMetrics {
        &self.metrics
    }

    /// Refreshes the pending, parked and oldest-pending-age gauges (per aggregate type) with
    /// one [`OutboxStore::backlog`] query, which reads only pending and parked rows.
    pub async fn refresh_status(&self) -> Result<()> {
        let backlog = self.store.backlog().await?;
        self.metrics.set_backlog(&backlog);
        Ok(())
    }

    /// Runs until `shutdown` resolves. An in-flight batch is always finished (published and
    /// marked, or released) before it returns, so nothing is left half-marked.
    ///
    /// Idle latency: when a claim finds nothing the relay sleeps `idle_poll_min`, doubling up
    /// to `idle_poll_max`; any claimed row resets the interval. No trigger or `NOTIFY` runs in
    /// the writers' transactions.
    ///
    /// The status gauges and pruning run beside the claim loop, not in it: the status query
    /// scans the outbox (about 65 ms for 300 000 rows here) and a prune deletes up to a batch of
    /// rows, and either would otherwise hold up every event waiting to be claimed.
    ///
    /// Database and broker errors are logged and retried with backoff; a crash point fired in
    /// error mode ends the loop with [`Error::CrashPoint`].
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        tokio::select! {
            r = self.claim_loop(shutdown) => r,
            never = self.housekeeping() => match never {},
        }
    }

    /// Refreshes the gauges every `status_interval` and prunes every prune interval, forever.
    async fn housekeeping(&self) -> std::convert::Infallible {
        let mut last_status: Option<Instant> = None;
        let mut last_prune = Instant::now();
        loop {
            if last_status.is_none_or(|t| t.elapsed() >= self.config.status_interval) {
                if let Err(e) = self.refresh_status().await {
                    tracing::warn!(error = %e, "could not refresh outbox status");
                }
                last_status = Some(Instant::now());
            }
            if let Some((every, policy)) = &self.config.prune
                && last_prune.elapsed() >= *every
            {
                match self.store.prune(policy).await {
                    Ok(n) => self.metrics.pruned.inc_by(n),
                    Err(e) => tracing::warn!(error = %e, "pruning failed"),
                }
                last_prune = Instant::now();
            }
            let next_prune = self
                .config
                .prune
                .as_ref()
                .map_or(self.config.status_interval, |(every, _)| {
                    every.saturating_sub(last_prune.elapsed())
                });
            let pause = self.config.status_interval.min(next_prune);
            tokio::time::sleep(pause.max(Duration::from_millis(1))).await;
        }
    }

    async fn claim_loop(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        tokio::pin!(shutdown);
        let mut idle = self.config.idle_poll_min;
        let mut error_backoff = ERROR_BACKOFF.first;
        // A batch claimed while the previous one was produced, not yet published.
        let mut held: Option<(Instant, Claim)> = None;
        loop {
            let (result, next) = self.cycle(held.take()).await;
            held = next;
            if let Ok(r) = &result {
                self.health.ok(DATABASE);
                if r.published > 0 {
                    self.health.ok(PUBLISHING);
                }
            }
            let wait = match result {
                Ok(r) if r.claimed > 0 => {
                    idle = self.config.idle_poll_min;
                    error_backoff = ERROR_BACKOFF.first;
                    if u32::try_from(r.claimed).unwrap_or(u32::MAX) >= self.config.batch_size {
                        Duration::ZERO
                    } else {
                        idle
                    }
                }
                Ok(_) => {
                    let w = idle;
                    idle = Backoff::new(self.config.idle_poll_min, self.config.idle_poll_max)
                        .next(idle);
                    w
                }
                Err(Error::CrashPoint(name)) => return Err(Error::CrashPoint(name)),
                Err(e) => {
                    // Logged by the health, once per outage and then at a bounded rate.
                    self.health.failed(dependency_of(&e), &e);
                    self.metrics.errors.inc();
                    let w = error_backoff;
                    error_backoff = ERROR_BACKOFF.next(error_backoff);
                    w
                }
            };
            if held.is_some() {
                // Its lease is running: publish it now. Shutdown waits for it (an in-flight
                // batch is always finished).
                continue;
            }
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One turn of the loop: processes `held` (or a batch claimed now) and, when that batch was
    /// full, claims the next one on another connection while it is produced (at most two
    /// batches in flight). Returns the report and the next batch, if one was claimed.
    ///
    /// Per-aggregate order holds across the two: a claim never takes a row of an aggregate whose
    /// head (its earliest pending row) is leased, and the first batch's rows stay leased until
    /// they are marked, released (a failed row stays pending, so a later row of its aggregate is
    /// not a head) or their lease expires. A parked row returned by `idem outbox retry` while
    /// later rows of its aggregate are in flight is the one exception (docs/operating/relay.md).
    /// Every delivery report of a batch is awaited before it is marked.
    async fn cycle(
        &self,
        held: Option<(Instant, Claim)>,
    ) -> (Result<CycleReport>, Option<(Instant, Claim)>) {
        let (started, claim) = match held {
            Some(h) => h,
            None => match self.claim_batch().await {
                Ok(c) => c,
                Err(e) => return (Err(e), None),
            },
        };
        let size = claim.records.len() + claim.corrupt.len();
        if size < usize::try_from(self.config.batch_size).unwrap_or(usize::MAX) {
            return (self.process(started, claim).await, None);
        }
        let (report, next) = tokio::join!(self.process(started, claim), self.claim_batch());
        let next = match next {
            Ok((_, c)) if c.records.is_empty() && c.corrupt.is_empty() => None,
            Ok(c) => Some(c),
            Err(e) => {
                self.health.failed(dependency_of(&e), &e);
                self.metrics.errors.inc();
                None
            }
        };
        (report, next)
    }
}

/// The dependency names the relay reports ([`RelayBuilder::health`]): its database (every
/// claim cycle) and its publishing (a batch that went out, a row that must be sent again).
/// Whether the broker answers at all, even while nothing is to be sent, is the command's to
/// watch (`idem relay` asks for the cluster's metadata).
pub const DATABASE: &str = "database";
/// See [`DATABASE`].
pub const PUBLISHING: &str = "publishing";

/// Which dependency a failed cycle points at.
fn dependency_of(e: &Error) -> &'static str {
    match e {
        Error::Broker { .. } => PUBLISHING,
        _ => DATABASE,
    }
}

#[cfg(test)]
mod tests;

/// A claimed row of aggregate `aggregate_type`/`aggregate_id`, first attempt, for unit tests.
#[cfg(test)]
fn test_row(id: i64, aggregate_type: &str, aggregate_id: &str) -> idem_core::store::OutboxRecord {
    idem_core::store::OutboxRecord {
        id,
        event_id: idem_core::EventId::new(),
        aggregate_type: aggregate_type.into(),
        aggregate_id: aggregate_id.into(),
        aggregate_seq: id,
        event_type: "order.paid".into(),
        payload: "{}".into(),
        headers: std::collections::BTreeMap::new(),
        topic: None,
        traceparent: None,
        occurred_at: chrono::Utc::now(),
        created_at: chrono::Utc::now(),
        attempt: 1,
        permanent_failures: 0,
    }
}
