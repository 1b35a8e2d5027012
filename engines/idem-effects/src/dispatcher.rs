//! The dispatcher: claims due intents, sends each once, records the outcomes. The decisions
//! are in [`crate::classify`]; this file is the I/O around them.

use std::future::Future;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use idem_core::Result;
use idem_core::health::Health;
use idem_core::idempotency::{
    ClaimedIntent, FinishedAttempt, IntentOutcome, IntentStore, Resolution,
};
use prometheus::Registry;

use crate::classify::{
    ParkKind, Reply, Verdict, backoff_after, classify_reply, guard_keyless, host, lease_verdict,
    next_wait, parse_retry_after, predecessor_outcome, probe_verdict,
};
use crate::metrics::EffectMetrics;
use crate::pipeline::{Buffered, OutcomeBuffer, claim_size, may_claim, store_backoff};
use crate::remote::{CompensationError, EffectPolicy, Policies};
use crate::tls::{HttpTls, LoadedTls, answered_not_http, diagnose, tls_failure};
use idem_core::idempotency::IntentStatus;

/// Dispatcher settings. Its `Debug` never shows the `authorization` value.
#[derive(Clone)]
pub struct DispatcherConfig {
    /// Intents per claim.
    pub batch_size: u32,
    /// How long a claim is exclusive; longer than `timeout`.
    pub lease: Duration,
    /// Per-request timeout.
    pub timeout: Duration,
    /// First backoff after a retryable failure; doubles per attempt.
    pub retry_backoff: Duration,
    /// Longest backoff.
    pub retry_backoff_max: Duration,
    /// `Authorization` header sent with every request (the remote scopes keys per client).
    pub authorization: Option<String>,
    /// Requests in flight at once. A claim takes at most the free slots (and at most `batch`),
    /// so that every request of a claim starts right after it; [`Dispatcher::run`] claims again
    /// as soon as half the slots are free, whatever the other requests are doing.
    pub concurrency: usize,
    /// Lease that must be left, on top of `timeout`, when a request starts (clock drift, the
    /// sending mark's round trip): an intent with less is not sent by this claim.
    pub lease_margin: Duration,
    /// Attempts after which an intent the remote keeps answering 409 (still processing the
    /// key) or 429 (rate limited) is parked for a person instead of being retried again.
    pub busy_attempts: i32,
    /// [`Dispatcher::run`]: the first wait after a claim that found nothing; it doubles per
    /// empty claim up to `idle_poll_max` and starts again after a claim that found intents.
    pub idle_poll_min: Duration,
    /// [`Dispatcher::run`]: the longest wait between empty claims.
    pub idle_poll_max: Duration,
    /// [`Dispatcher::run`]: outcomes recorded in one write once this many wait.
    pub outcome_batch: usize,
    /// [`Dispatcher::run`]: the longest an outcome waits for others before it is written. A
    /// kill loses at most the outcomes waiting; their intents are sent again, with the same key,
    /// after the lease.
    pub outcome_delay: Duration,
    /// HTTPS: the CA bundle trusted besides (or instead of) the system's roots, and the client
    /// certificate presented for mutual TLS. Read and checked when the dispatcher is built.
    pub tls: HttpTls,
}

impl std::fmt::Debug for DispatcherConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatcherConfig")
            .field("batch_size", &self.batch_size)
            .field("lease", &self.lease)
            .field("timeout", &self.timeout)
            .field("retry_backoff", &self.retry_backoff)
            .field("retry_backoff_max", &self.retry_backoff_max)
            .field(
                "authorization",
                &self.authorization.as_ref().map(|_| "<redacted>"),
            )
            .field("concurrency", &self.concurrency)
            .field("lease_margin", &self.lease_margin)
            .field("busy_attempts", &self.busy_attempts)
            .field("idle_poll_min", &self.idle_poll_min)
            .field("idle_poll_max", &self.idle_poll_max)
            .field("outcome_batch", &self.outcome_batch)
            .field("outcome_delay", &self.outcome_delay)
            .field("tls", &self.tls)
            .finish()
    }
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        DispatcherConfig {
            batch_size: 50,
            lease: Duration::from_secs(30),
            timeout: Duration::from_secs(10),
            retry_backoff: Duration::from_millis(200),
            retry_backoff_max: Duration::from_secs(60),
            authorization: None,
            concurrency: 8,
            lease_margin: Duration::from_millis(500),
            busy_attempts: 20,
            idle_poll_min: Duration::from_millis(5),
            idle_poll_max: Duration::from_millis(200),
            outcome_batch: 64,
            outcome_delay: Duration::from_millis(5),
            tls: HttpTls::default(),
        }
    }
}

/// Why [`Dispatcher::compensate`] did not compensate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CompensateError {
    /// No intent has this id.
    #[error("no effect intent has id {0}")]
    NotFound(i64),
    /// Only unknown and parked intents are compensated.
    #[error("effect intent {id} is {status}; only unknown and parked intents can be compensated")]
    NotStuck {
        /// The intent.
        id: i64,
        /// Its status.
        status: IntentStatus,
    },
    /// The intent left the parked or unknown state while its compensation ran (another process
    /// settled it); the compensation ran, the intent was not changed by this call.
    #[error(
        "effect intent {id} changed while compensating; only unknown and parked intents can be \
         compensated: see `idem effects stuck`"
    )]
    Changed {
        /// The intent.
        id: i64,
    },
    /// The effect has no compensation configured.
    #[error("effect {0:?} has no compensation configured")]
    NoCompensation(String),
    /// The compensation ran and failed; the intent is unchanged.
    #[error("the compensation of intent {id} failed: {source}")]
    Failed {
        /// The intent.
        id: i64,
        /// What the compensation said.
        #[source]
        source: CompensationError,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] idem_core::Error),
}

/// The dependency name of the dispatcher's database ([`Dispatcher::with_health`]).
pub const DATABASE: &str = "database";

/// Sends claimed intents and records their outcomes.
pub struct Dispatcher<S> {
    store: S,
    client: reqwest::Client,
    /// The client's TLS configuration, for the handshake diagnosis of unexplained failures.
    tls: LoadedTls,
    config: DispatcherConfig,
    metrics: EffectMetrics,
    policies: Policies,
    /// Where the database's state is reported.
    health: Health,
}

impl<S> std::fmt::Debug for Dispatcher<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("config", &self.config)
            .field("policies", &self.policies)
            .field("metrics", &self.metrics)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Dispatcher`]: settings, per-effect policies and metrics are all optional.
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct DispatcherBuilder<S> {
    store: S,
    config: DispatcherConfig,
    metrics: MetricsChoice,
    policies: Policies,
    health: Option<Health>,
}

#[derive(Debug)]
enum MetricsChoice {
    None,
    Register(Registry),
    Shared(EffectMetrics),
}

impl<S: IntentStore> DispatcherBuilder<S> {
    /// The settings (default: [`DispatcherConfig::default`]).
    pub fn config(mut self, config: DispatcherConfig) -> Self {
        self.config = config;
        self
    }

    /// Registers the dispatcher's metrics into `registry` (without it they are counted but not
    /// registered anywhere).
    pub fn metrics(mut self, registry: &Registry) -> Self {
        self.metrics = MetricsChoice::Register(registry.clone());
        self
    }

    /// Counts into metrics created (and registered) earlier, for example by a dispatcher this
    /// one replaces after a restart.
    pub fn shared_metrics(mut self, metrics: EffectMetrics) -> Self {
        self.metrics = MetricsChoice::Shared(metrics);
        self
    }

    /// Sets how `effect`'s remote is treated (keys ignored, status probe, compensation).
    pub fn policy(mut self, effect: impl Into<String>, policy: EffectPolicy) -> Self {
        self.policies.insert(effect.into(), policy);
        self
    }

    /// Reports the database's state into `health` ([`Dispatcher::with_health`]).
    pub fn health(mut self, health: Health) -> Self {
        self.health = Some(health);
        self
    }

    /// The dispatcher. Refuses a lease too short for a probe and a request
    /// (`lease >= 2 × timeout + lease_margin`) and metrics that cannot be registered.
    pub fn build(self) -> Result<Dispatcher<S>> {
        let metrics = match self.metrics {
            MetricsChoice::None => EffectMetrics::unregistered()?,
            MetricsChoice::Register(r) => EffectMetrics::new(&r)?,
            MetricsChoice::Shared(m) => m,
        };
        let mut d = Dispatcher::new(self.store, self.config, metrics)?;
        d.policies = self.policies;
        Ok(match self.health {
            Some(h) => d.with_health(h),
            None => d,
        })
    }
}

impl<S: IntentStore> Dispatcher<S> {
    /// A builder over `store`.
    pub fn builder(store: S) -> DispatcherBuilder<S> {
        DispatcherBuilder {
            store,
            config: DispatcherConfig::default(),
            metrics: MetricsChoice::None,
            policies: Policies::new(),
            health: None,
        }
    }

    /// A dispatcher over `store`. Refuses a lease too short for a probe and a request
    /// (`lease >= 2 × timeout + lease_margin`) and TLS settings whose files are missing, not
    /// PEM, or a client key that does not match its certificate ([`HttpTls::load`]).
    pub fn new(store: S, config: DispatcherConfig, metrics: EffectMetrics) -> Result<Self> {
        let needed = config
            .timeout
            .saturating_mul(2)
            .saturating_add(config.lease_margin);
        if config.lease < needed {
            return Err(idem_core::Error::Config(format!(
                "the dispatcher's lease ({:?}) must be at least twice the request timeout plus the \
                 margin ({needed:?}): a probe and a request must fit in it",
                config.lease
            )));
        }
        let tls = config
            .tls
            .load()
            .map_err(|e| idem_core::Error::Config(e.to_string()))?;
        let client = tls
            .apply(reqwest::Client::builder().timeout(config.timeout))
            .build()
            .map_err(|e| idem_core::Error::setup("building the HTTP client", e))?;
        Ok(Dispatcher {
            store,
            client,
            tls,
            config,
            metrics,
            policies: Policies::new(),
            health: Health::new(),
        })
    }

    /// Reports the database into `health` as [`DATABASE`]: not ready until a claim answers,
    /// then as each claim and write of [`Dispatcher::run`] ends (a claim is made at least every
    /// [`DispatcherConfig::idle_poll_max`] while nothing fails). The database is all the dispatcher
    /// needs to be ready: a remote that fails is an intent's outcome, not the dispatcher's.
    pub fn with_health(mut self, health: Health) -> Self {
        health.expect(DATABASE);
        self.health = health;
        self
    }

    /// Sets how `effect`'s remote is treated (keys ignored, status probe, compensation).
    pub fn with_policy(mut self, effect: impl Into<String>, policy: EffectPolicy) -> Self {
        self.policies.insert(effect.into(), policy);
        self
    }

    /// The metrics.
    pub fn metrics(&self) -> &EffectMetrics {
        &self.metrics
    }

    /// Dispatches until `shutdown` completes. Claims whenever half of the `concurrency` slots
    /// are free, counting those a claim in progress will fill (claims may overlap; a slow
    /// request holds its slot, never the others), again at once after a
    /// claim that found intents, otherwise after an idle wait that doubles from
    /// [`DispatcherConfig::idle_poll_min`] to [`DispatcherConfig::idle_poll_max`]. Outcomes are recorded
    /// in batches ([`DispatcherConfig::outcome_batch`], [`DispatcherConfig::outcome_delay`]).
    /// On shutdown nothing more is claimed, the requests in flight end (each within `timeout`)
    /// and every outcome is recorded before `run` returns.
    ///
    /// A store error (the database unreachable) does not stop it: it is reported as
    /// [`DATABASE`] ([`Dispatcher::with_health`], logged once per outage), a failed claim is
    /// made again and the outcomes of a failed write are kept and written again, after a wait
    /// from 200 ms doubling to 10 s ([`store_backoff`]); an intent whose sending mark fails is
    /// not sent (it is claimed again after its lease). A shutdown during an outage does not
    /// wait for the claims in progress (their intents, if any were leased, are claimed again
    /// after the lease), and a write that fails while stopping is given up: its outcomes are
    /// lost as by a kill, and their intents sent again after the lease with the same key; that
    /// error is returned. A crash point fired in error mode stops the claims like a shutdown,
    /// and is returned once everything in flight is recorded.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        tokio::pin!(shutdown);
        let mut p = Pipeline::new(self.config.idle_poll_min);
        loop {
            // One instant for the decision to claim and for the timer of the next claim: with
            // two, a claim due between them was neither started nor waited for, and a
            // dispatcher with nothing in flight would wait forever.
            let now = Instant::now();
            self.start_work(&mut p, now);
            self.observe(&p);
            if p.done() {
                return p.error.map_or(Ok(()), Err);
            }
            let (flush_at, claim_at) = (p.flush_at(&self.config), p.claim_at(now));
            tokio::select! {
                biased;
                () = &mut shutdown, if !p.stopping => p.stop(),
                r = slot(&mut p.writing) => {
                    p.writing = None;
                    match r {
                        Ok(()) => self.store_answered(&mut p),
                        Err((e, kept)) => self.write_failed(&mut p, e, kept),
                    }
                }
                Some((c, r)) = p.in_flight.next() => match r {
                    Err(e) if !matches!(e, idem_core::Error::CrashPoint(_)) => {
                        self.not_sent(&c, &e);
                    }
                    r => match self.ended(c, r) {
                        Ok(Some(b)) => p.buffer.push(b, Instant::now()),
                        Ok(None) => {}
                        Err(e) => p.fail(e),
                    },
                },
                Some((size, r)) = p.claiming.next() => {
                    p.reserved = p.reserved.saturating_sub(size);
                    self.claimed(&mut p, r);
                }
                () = at(flush_at) => {}
                () = at(claim_at) => {}
            }
        }
    }

    /// Starts a claim when one is due and slots are free, and a write when the buffered
    /// outcomes are due (at once when stopping).
    fn start_work<'d>(&'d self, p: &mut Pipeline<'d>, now: Instant) {
        // The slots that claims in progress may fill count as taken: claims may overlap, but
        // together they never take more than the free slots.
        let taken = p.in_flight.len() + p.reserved;
        if !p.stopping
            && now >= p.next_claim
            && may_claim(p.buffer.len(), self.config.outcome_batch)
            && let Some(size) = claim_size(taken, self.config.concurrency, self.config.batch_size)
        {
            let slots = usize::try_from(size).unwrap_or(usize::MAX);
            p.reserved += slots;
            self.metrics.claims.inc();
            let claim = self.claim(size);
            p.claiming
                .push(Box::pin(async move { (slots, claim.await) }));
        }
        let due = p
            .write_at(&self.config)
            .is_some_and(|d| p.stopping || d <= now);
        if p.writing.is_none() && due {
            p.writing = Some(Box::pin(self.write_or_keep(p.buffer.take())));
        }
    }

    /// The pipeline's state as gauges: what a dispatcher that stopped claiming is waiting on.
    fn observe(&self, p: &Pipeline<'_>) {
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.metrics.in_flight.set(gauge(p.in_flight.len()));
        self.metrics.reserved.set(gauge(p.reserved));
        self.metrics.buffered.set(gauge(p.buffer.len()));
    }

    /// Sends the intents of a claim, and sets when to claim next: after a failed claim, when
    /// the store's backoff ends.
    fn claimed<'d>(&'d self, p: &mut Pipeline<'d>, r: Result<Claimed>) {
        match r {
            Ok((claimed, lease_end)) => {
                self.store_answered(p);
                let (min, max) = (self.config.idle_poll_min, self.config.idle_poll_max);
                let (wait, idle) = next_wait(claimed.len(), p.idle, min, max);
                p.idle = idle;
                p.next_claim = Instant::now() + wait;
                for c in claimed {
                    p.in_flight.push(Box::pin(self.attempt_owned(c, lease_end)));
                }
            }
            Err(e @ idem_core::Error::CrashPoint(_)) => p.fail(e),
            Err(e) => {
                let wait = self.store_failed(p, &e);
                p.next_claim = Instant::now() + wait;
            }
        }
    }

    /// A claim or write was answered: the database is usable, the store's backoff over.
    fn store_answered(&self, p: &mut Pipeline<'_>) {
        p.failing = None;
        p.write_after = None;
        self.health.ok(DATABASE);
    }

    /// A claim or write failed with `e`: reported (logged once per outage by the health); the
    /// wait before the store is used again.
    fn store_failed(&self, p: &mut Pipeline<'_>, e: &idem_core::Error) -> Duration {
        self.health.failed(DATABASE, e);
        let wait = store_backoff(p.failing);
        p.failing = Some(wait);
        wait
    }

    /// A write failed with `e`: its outcomes `kept` are written again after the store's
    /// backoff, unless stopping (given up: their intents are claimed again after the lease) or
    /// a crash point fired.
    fn write_failed(&self, p: &mut Pipeline<'_>, e: idem_core::Error, kept: Vec<Buffered>) {
        if p.stopping || matches!(e, idem_core::Error::CrashPoint(_)) {
            if !kept.is_empty() {
                tracing::warn!(
                    outcomes = kept.len(),
                    "outcomes not recorded; their intents are claimed again after the lease and sent with the same key"
                );
            }
            p.fail(e);
            return;
        }
        let wait = self.store_failed(p, &e);
        let now = Instant::now();
        p.buffer.restore(kept, now);
        p.write_after = Some(now + wait);
    }

    /// An attempt whose store operation (the sending mark) failed with `e`: nothing was sent;
    /// the intent is claimed again after its lease.
    fn not_sent(&self, c: &ClaimedIntent, e: &idem_core::Error) {
        self.health.failed(DATABASE, e);
        tracing::warn!(
            intent = c.id,
            attempt = c.attempt,
            error = %e,
            "not sent: marking the intent as sending failed; it is claimed again after its lease"
        );
    }

    /// Claims due intents (at most `concurrency`, so that every request starts right after the
    /// claim), sends each once, records their outcomes in one write; returns how many were
    /// claimed. An error in one send is returned after the others have ended and been
    /// recorded: a request in flight is never dropped unrecorded.
    pub async fn run_once(&self) -> Result<usize> {
        let concurrency = self.config.concurrency.max(1);
        let size = claim_size(0, concurrency, self.config.batch_size).unwrap_or(1);
        let (claimed, lease_end) = self.claim(size).await?;
        let n = claimed.len();
        // Each intent is independent (its own key); several are in flight at once.
        let sends = claimed
            .into_iter()
            .map(|c| self.attempt_owned(c, lease_end));
        let mut sends = futures::stream::iter(sends).buffer_unordered(concurrency);
        let (mut first_error, mut ended) = (None, Vec::with_capacity(n));
        while let Some((c, r)) = sends.next().await {
            match self.ended(c, r) {
                Ok(Some(b)) => ended.push(b),
                Ok(None) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Err(e) = self.write(ended).await {
            first_error.get_or_insert(e);
        }
        first_error.map_or(Ok(n), Err)
    }

    /// Leases up to `size` intents; the lease end by this clock.
    async fn claim(&self, size: u32) -> Result<Claimed> {
        // The lease runs from before the claim by this clock: never later than the store's.
        let lease_end = Instant::now() + self.config.lease;
        let claimed = self.store.claim(size, self.config.lease).await?;
        Ok((claimed, lease_end))
    }

    /// Records `batch` in one write; counts and logs the attempts fenced by a takeover.
    async fn write(&self, batch: Vec<Buffered>) -> Result<()> {
        self.write_or_keep(batch).await.map_err(|(e, _)| e)
    }

    /// [`Self::write`], giving the batch back with the error when the write fails.
    async fn write_or_keep(&self, batch: Vec<Buffered>) -> Written {
        if batch.is_empty() {
            return Ok(());
        }
        let (finished, labels): (Vec<FinishedAttempt>, Vec<[String; 2]>) =
            batch.into_iter().map(|b| (b.finished, b.labels)).unzip();
        let recorded = match self.store.finish_all(&finished).await {
            Ok(recorded) => recorded,
            Err(e) => {
                let kept = finished
                    .into_iter()
                    .zip(labels)
                    .map(|(finished, labels)| Buffered { finished, labels })
                    .collect();
                return Err((e, kept));
            }
        };
        if recorded.len() == finished.len() {
            return Ok(());
        }
        let recorded: std::collections::HashSet<i64> = recorded.into_iter().collect();
        for (f, [effect, target]) in finished.iter().zip(&labels) {
            if !recorded.contains(&f.id) {
                self.metrics
                    .fenced
                    .with_label_values(&[effect.as_str(), target.as_str()])
                    .inc();
                tracing::warn!(
                    intent = f.id,
                    attempt = f.attempt,
                    "the intent's lease was taken over; outcome not recorded"
                );
            }
        }
        Ok(())
    }

    /// Runs the compensation of unknown or parked intent `id`, then settles it: sent again with
    /// the same key when `then_retry`, otherwise parked with the compensation's note for review.
    /// Returns the note.
    pub async fn compensate(
        &self,
        id: i64,
        then_retry: bool,
    ) -> std::result::Result<String, CompensateError> {
        let (intent, status) = self
            .store
            .get(id)
            .await?
            .ok_or(CompensateError::NotFound(id))?;
        if !status.is_stuck() {
            return Err(CompensateError::NotStuck { id, status });
        }
        let effect = intent.intent.effect.clone();
        let compensation = self
            .policies
            .get(&effect)
            .and_then(|p| p.compensation.clone())
            .ok_or_else(|| CompensateError::NoCompensation(effect.clone()))?;
        let target = host(&intent.intent.target);
        let result = compensation.compensate(&self.client, &intent).await;
        let label = if result.is_ok() { "ok" } else { "failed" };
        self.metrics
            .compensations
            .with_label_values(&[effect.as_str(), &target, label])
            .inc();
        let note = result.map_err(|source| CompensateError::Failed { id, source })?;
        let (resolution, note) = if then_retry {
            (Resolution::Pending, format!("{note}; sent again"))
        } else {
            (
                Resolution::Parked,
                format!("{note}; `idem effects retry --id {id}` sends it again"),
            )
        };
        if !self.store.resolve(id, resolution, &note).await? {
            return Err(CompensateError::Changed { id });
        }
        Ok(note)
    }

    /// One attempt of one claimed intent, with the intent (for [`Self::ended`]).
    fn attempt_owned(&self, c: ClaimedIntent, lease_end: Instant) -> BoxFuture<'_, Attempted> {
        Box::pin(async move {
            let r = self.attempt(&c, lease_end).await;
            (c, r)
        })
    }

    /// The outcome to record for an ended attempt (`None`: nothing was sent).
    fn ended(&self, c: ClaimedIntent, r: Result<Option<Verdict>>) -> Result<Option<Buffered>> {
        let Some(verdict) = r? else {
            tracing::warn!(
                intent = c.id,
                attempt = c.attempt,
                "not sent: the lease was lost or too short to mark the intent as sending"
            );
            return Ok(None);
        };
        let labels = [c.intent.effect, host(&c.intent.target)];
        Ok(Some(Buffered {
            finished: FinishedAttempt {
                id: c.id,
                attempt: c.attempt,
                outcome: IntentOutcome::from(verdict),
            },
            labels,
        }))
    }

    /// The verdict of one attempt, or `None` when nothing was sent and nothing is to be
    /// recorded (the lease is lost).
    async fn attempt(&self, c: &ClaimedIntent, lease_end: Instant) -> Result<Option<Verdict>> {
        let target = host(&c.intent.target);
        let labels = [c.intent.effect.as_str(), target.as_str()];
        let policy = self.policies.get(&c.intent.effect);
        if let Some(verdict) = self.before_send(c, policy, lease_end, labels).await {
            return Ok(Some(self.count(verdict, labels)));
        }
        idem_core::crash::crash_point(idem_core::crash::CrashPoint::EffectBeforeHttp)?;
        if !self.mark_sending(c, policy).await? {
            return Ok(None);
        }
        self.request(c, policy, labels).await.map(Some)
    }

    /// What ends an attempt before anything is sent: an unrecorded earlier send to a keyless
    /// remote, too little lease (checked again after the probe), or the probe's finding.
    async fn before_send(
        &self,
        c: &ClaimedIntent,
        policy: Option<&EffectPolicy>,
        lease_end: Instant,
        labels: [&str; 2],
    ) -> Option<Verdict> {
        if let Some(verdict) = predecessor_outcome(c, policy) {
            return Some(verdict);
        }
        if let Some(verdict) = self.lease_check(lease_end, labels) {
            return Some(verdict);
        }
        if let Some(policy) = policy
            && let Some(verdict) = self.probe_first(c, policy, labels).await
        {
            return Some(verdict);
        }
        self.lease_check(lease_end, labels)
    }

    /// `None` when a request that may take `timeout` can start now under a lease ending at
    /// `lease_end`; otherwise the verdict that gives the intent back for a later claim.
    fn lease_check(&self, lease_end: Instant, labels: [&str; 2]) -> Option<Verdict> {
        let left = lease_end.saturating_duration_since(Instant::now());
        let verdict = lease_verdict(left, self.config.timeout, self.config.lease_margin)?;
        self.metrics.lease_skips.with_label_values(&labels).inc();
        Some(verdict)
    }

    /// Asks the probe, before a re-attempt, whether the effect already happened: `Some` ends the
    /// attempt without sending.
    async fn probe_first(
        &self,
        c: &ClaimedIntent,
        policy: &EffectPolicy,
        labels: [&str; 2],
    ) -> Option<Verdict> {
        let probe = policy.probe.as_ref()?;
        if c.attempt <= 1 {
            return None;
        }
        let found = probe.probe(&self.client, c).await;
        let wait = backoff_after(&self.config, c.attempt).max(policy.settle);
        let (result, verdict) = probe_verdict(found, wait);
        self.metrics
            .probes
            .with_label_values(&[labels[0], labels[1], result.as_str()])
            .inc();
        verdict
    }

    /// Marks a keyless remote's intent as sending (committed before the request); false: the
    /// lease is lost or too short, do not send.
    async fn mark_sending(&self, c: &ClaimedIntent, policy: Option<&EffectPolicy>) -> Result<bool> {
        if !policy.is_some_and(|p| p.remote_ignores_keys)
            || idem_core::crash::broken(idem_core::crash::Mechanism::SkipSendingMark)
        {
            return Ok(true);
        }
        let left = self.config.timeout.saturating_add(self.config.lease_margin);
        let settle = policy.map_or(Duration::ZERO, |p| p.settle);
        self.store.mark_sending(c.id, c.attempt, left, settle).await
    }

    /// Sends the request of one attempt and classifies its outcome.
    async fn request(
        &self,
        c: &ClaimedIntent,
        policy: Option<&EffectPolicy>,
        labels: [&str; 2],
    ) -> Result<Verdict> {
        self.metrics.attempts.with_label_values(&labels).inc();
        let reply = self.post(c).await;
        let (verdict, ambiguous) = classify_reply(reply, c.attempt, &self.config);
        let verdict = guard_keyless(verdict, ambiguous, policy);
        if matches!(verdict, Verdict::Done { .. }) {
            self.metrics.successes.with_label_values(&labels).inc();
            idem_core::crash::crash_point(
                idem_core::crash::CrashPoint::EffectAfterHttpSuccessBeforeRecord,
            )?;
            return Ok(verdict);
        }
        Ok(self.count(verdict, labels))
    }

    /// POSTs the intent's body with its stored key (and trace context, authorization).
    async fn post(&self, c: &ClaimedIntent) -> Reply {
        let key = if idem_core::crash::broken(idem_core::crash::Mechanism::NewKeyPerRetry)
            && c.attempt > 1
        {
            // Negative control: a new key per retry (what idem never does).
            format!("\"{}-retry-{}\"", c.key.as_str(), c.attempt)
        } else {
            c.key.header_value()
        };
        let mut req = self
            .client
            .post(&c.intent.target)
            .header(idem_core::idempotency::IDEMPOTENCY_KEY_HEADER, key)
            .json(&c.intent.body);
        if let Some(tp) = &c.intent.traceparent {
            req = req.header("traceparent", tp);
        }
        if let Some(auth) = &self.config.authorization {
            req = req.header("authorization", auth);
        }
        match req.send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let retry_after = resp
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_retry_after);
                let body = resp.text().await.unwrap_or_default();
                Reply::Answered {
                    status,
                    body,
                    retry_after,
                }
            }
            Err(e) => self.failed(&c.intent.target, &e).await,
        }
    }

    /// What a request that got no answer means: a TLS failure when its error says so, or when
    /// a handshake without a request shows the remote refusing this client (only after a
    /// failure other than a timeout, to an `https://` target), or shows that an `http://`
    /// target's remote, which answered with no HTTP response at all, speaks TLS (a TLS server
    /// reads no request from plain text); otherwise an ordinary failure.
    ///
    /// The diagnosis may park an attempt whose own error was ambiguous (a connection reset
    /// after the request was written): it is safe because the remote refuses the handshake of
    /// this client with these certificates, and a refused handshake never carries a request;
    /// the failed attempt used the same certificates (a remote whose TLS settings changed in
    /// between is the one case it cannot rule out).
    async fn failed(&self, target: &str, e: &reqwest::Error) -> Reply {
        let gave = self.tls.has_client_certificate();
        let mut failure = tls_failure(e, e.is_connect(), gave);
        let plain = reqwest::Url::parse(target).is_ok_and(|u| u.scheme() == "http");
        if failure.is_none() && !e.is_timeout() && (!plain || answered_not_http(e)) {
            let within = self.config.timeout.min(Duration::from_secs(2));
            failure = diagnose(self.tls.client_config(), target, within, gave).await;
        }
        match failure {
            Some(failure) => Reply::Tls(failure),
            None => Reply::Failed {
                timed_out: e.is_timeout(),
                connect: e.is_connect(),
                error: e.to_string(),
            },
        }
    }

    /// Counts a non-success verdict (and a success found by the probe).
    fn count(&self, verdict: Verdict, labels: [&str; 2]) -> Verdict {
        let m = &self.metrics;
        match &verdict {
            Verdict::Done { .. } => m.successes.with_label_values(&labels).inc(),
            Verdict::Retry { .. } => m.retries.with_label_values(&labels).inc(),
            Verdict::Park { kind, .. } => {
                match kind {
                    ParkKind::Conflict => m.conflicts.with_label_values(&labels).inc(),
                    ParkKind::Tls(failure) => m
                        .tls_failures
                        .with_label_values(&[labels[0], labels[1], failure.label()])
                        .inc(),
                    _ => {}
                }
                m.parked.with_label_values(&labels).inc();
            }
            Verdict::Unknown { .. } => m.unknown.with_label_values(&labels).inc(),
        }
        verdict
    }
}

/// A claim's intents and the end of their lease by this clock.
type Claimed = (Vec<ClaimedIntent>, Instant);

/// A write of outcomes: done, or failed with the error and the outcomes to write again.
type Written = std::result::Result<(), (idem_core::Error, Vec<Buffered>)>;

/// An ended attempt: the intent and its verdict (`None`: nothing was sent).
type Attempted = (ClaimedIntent, Result<Option<Verdict>>);

/// The state of [`Dispatcher::run`]'s loop: the claim, requests and write in progress, and the
/// outcomes waiting to be written.
struct Pipeline<'d> {
    /// Claims in progress, each with the slots it may fill.
    claiming: FuturesUnordered<BoxFuture<'d, (usize, Result<Claimed>)>>,
    /// The slots the claims in progress may fill.
    reserved: usize,
    in_flight: FuturesUnordered<BoxFuture<'d, Attempted>>,
    writing: Option<BoxFuture<'d, Written>>,
    buffer: OutcomeBuffer,
    /// The first error; set together with `stopping`.
    error: Option<idem_core::Error>,
    /// No more claims: shutdown, or an error.
    stopping: bool,
    next_claim: Instant,
    idle: Duration,
    /// The wait after the store's last failure, while it fails (`None`: it answered).
    failing: Option<Duration>,
    /// No write before this, after a failed one.
    write_after: Option<Instant>,
}

impl Pipeline<'_> {
    fn new(idle: Duration) -> Self {
        Pipeline {
            claiming: FuturesUnordered::new(),
            reserved: 0,
            in_flight: FuturesUnordered::new(),
            writing: None,
            buffer: OutcomeBuffer::default(),
            error: None,
            stopping: false,
            next_claim: Instant::now(),
            idle,
            failing: None,
            write_after: None,
        }
    }

    /// Shutdown: no more claims. During an outage the claims in progress are dropped, not
    /// waited for: the database may not answer them for as long as its pool waits. Dropping a
    /// claim sends nothing; intents it leased are claimed again after the lease.
    fn stop(&mut self) {
        self.stopping = true;
        if self.failing.is_some() {
            self.claiming.clear();
            self.reserved = 0;
        }
    }

    /// Keeps the first error and stops claiming.
    fn fail(&mut self, e: idem_core::Error) {
        if matches!(e, idem_core::Error::CrashPoint(_)) {
            // A lab's crash point, fired on purpose: its supervisor restarts the dispatcher.
            tracing::info!(error = %e, "effect dispatcher: stopping at a crash point");
        } else {
            tracing::error!(error = %e, "effect dispatcher: stopping after an error");
        }
        self.error.get_or_insert(e);
        self.stopping = true;
    }

    /// Stopping, and nothing left in flight or unrecorded.
    fn done(&self) -> bool {
        self.stopping
            && self.claiming.is_empty()
            && self.in_flight.is_empty()
            && self.writing.is_none()
            && self.buffer.is_empty()
    }

    /// When the buffered outcomes are due, unless a write is running.
    fn flush_at(&self, config: &DispatcherConfig) -> Option<Instant> {
        if self.writing.is_some() {
            return None;
        }
        self.write_at(config)
    }

    /// When the buffered outcomes are due: by the buffer's deadline, and not before the
    /// store's backoff after a failed write ends.
    fn write_at(&self, config: &DispatcherConfig) -> Option<Instant> {
        let due = self
            .buffer
            .deadline(config.outcome_batch, config.outcome_delay)?;
        Some(self.write_after.map_or(due, |after| due.max(after)))
    }

    /// When the next claim may start (`None`: none is waiting on time).
    fn claim_at(&self, now: Instant) -> Option<Instant> {
        claim_timer(self.stopping, self.next_claim, now)
    }
}

/// When to wake for the next claim, decided at `now`, the instant the claim was not started
/// at: at `next_claim` when it is still to come then; `None` when it has come (a claim was
/// started, or slots or the buffer held it back, and their ending wakes the loop) or when
/// stopping.
fn claim_timer(stopping: bool, next_claim: Instant, now: Instant) -> Option<Instant> {
    (!stopping && next_claim > now).then_some(next_claim)
}

/// The output of the future in `slot`; never ready when there is none.
async fn slot<T>(slot: &mut Option<BoxFuture<'_, T>>) -> T {
    match slot {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// Ready at `t`; never when `None`.
async fn at(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_settings_debug_output_never_shows_the_authorization() {
        let config = DispatcherConfig {
            authorization: Some("Bearer s3cr3t-token".into()),
            ..DispatcherConfig::default()
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert!(
            shown.contains("authorization: Some(\"<redacted>\")"),
            "{shown}"
        );
    }

    /// At one instant, a claim is either due (started, or held back by slots or the buffer,
    /// whose ending wakes the loop) or waited for: never neither. Before, the timer read the
    /// clock again after the decision, and a claim falling due in between was neither.
    #[test]
    fn a_claim_not_due_at_the_decision_is_always_waited_for() {
        let now = Instant::now();
        for offset_us in [0_u64, 1, 2, 50, 5_000, 200_000] {
            let next = now + Duration::from_micros(offset_us);
            let due = now >= next;
            assert!(
                due || claim_timer(false, next, now) == Some(next),
                "{offset_us} µs"
            );
            assert_eq!(
                claim_timer(true, next, now),
                None,
                "no claim while stopping"
            );
        }
        let past = now.checked_sub(Duration::from_millis(1)).unwrap_or(now);
        assert_eq!(
            claim_timer(false, past, now),
            None,
            "due: claimed, no timer"
        );
    }
}
