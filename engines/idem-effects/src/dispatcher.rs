//! The dispatcher: claims due intents, sends each once, records the outcomes. The decisions
//! are in [`crate::classify`]; this file is the I/O around them.

use std::future::Future;
use std::time::{Duration, Instant};

use futures::StreamExt;
use idem_core::Result;
use idem_core::idempotency::{ClaimedIntent, IntentOutcome, IntentStore, Resolution};
use prometheus::Registry;

use crate::classify::{
    ParkKind, Reply, Verdict, backoff_after, classify_reply, guard_keyless, host, lease_verdict,
    next_wait, parse_retry_after, predecessor_outcome, probe_verdict,
};
use crate::metrics::EffectMetrics;
use crate::remote::{CompensationError, EffectPolicy, Policies};
use crate::status::{IntentStatus, UnknownStatus};

/// Dispatcher settings.
#[derive(Clone, Debug)]
pub struct DispatcherConfig {
    /// Intents per claim.
    pub batch: u32,
    /// How long a claim is exclusive; longer than `timeout`.
    pub lease: Duration,
    /// Per-request timeout.
    pub timeout: Duration,
    /// First backoff after a retryable failure; doubles per attempt.
    pub backoff: Duration,
    /// Longest backoff.
    pub backoff_max: Duration,
    /// `Authorization` header sent with every request (the remote scopes keys per client).
    pub authorization: Option<String>,
    /// Requests of one claimed batch in flight at once. A claim takes at most this many
    /// intents (and at most `batch`), so that every request of a claim starts right after it.
    pub concurrency: usize,
    /// Lease that must be left, on top of `timeout`, when a request starts (clock drift, the
    /// sending mark's round trip): an intent with less is not sent by this claim.
    pub lease_margin: Duration,
    /// Attempts after which an intent the remote keeps answering 409 (still processing the
    /// key) or 429 (rate limited) is parked for a person instead of being retried again.
    pub busy_attempts: i32,
    /// [`Dispatcher::run`]: the first wait after a claim that found nothing; it doubles per
    /// empty claim up to `idle_max` and starts again after a claim that found intents.
    pub idle_min: Duration,
    /// [`Dispatcher::run`]: the longest wait between empty claims.
    pub idle_max: Duration,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        DispatcherConfig {
            batch: 50,
            lease: Duration::from_secs(30),
            timeout: Duration::from_secs(10),
            backoff: Duration::from_millis(200),
            backoff_max: Duration::from_secs(60),
            authorization: None,
            concurrency: 8,
            lease_margin: Duration::from_millis(500),
            busy_attempts: 20,
            idle_min: Duration::from_millis(5),
            idle_max: Duration::from_millis(200),
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
    /// The store holds a status this dispatcher does not know.
    #[error("effect intent {id}: {source}")]
    Status {
        /// The intent.
        id: i64,
        /// The status text.
        #[source]
        source: UnknownStatus,
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

/// Sends claimed intents and records their outcomes.
pub struct Dispatcher<S> {
    store: S,
    client: reqwest::Client,
    config: DispatcherConfig,
    metrics: EffectMetrics,
    policies: Policies,
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
        Ok(d)
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
        }
    }

    /// A dispatcher over `store`. Refuses a lease too short for a probe and a request
    /// (`lease >= 2 × timeout + lease_margin`).
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
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .build()
            .map_err(|e| idem_core::Error::Config(format!("building the HTTP client: {e}")))?;
        Ok(Dispatcher {
            store,
            client,
            config,
            metrics,
            policies: Policies::new(),
        })
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

    /// Dispatches until `shutdown` completes: claims, sends and records ([`Self::run_once`])
    /// again at once after a claim that found intents, otherwise after an idle wait that
    /// doubles from [`DispatcherConfig::idle_min`] to [`DispatcherConfig::idle_max`]. A claim
    /// in progress is finished (its requests recorded) before `shutdown` is looked at.
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> Result<()> {
        tokio::pin!(shutdown);
        let (min, max) = (self.config.idle_min, self.config.idle_max);
        let mut idle = min;
        loop {
            let claimed = self.run_once().await?;
            let (wait, next_idle) = next_wait(claimed, idle, min, max);
            idle = next_idle;
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Claims due intents (at most `concurrency`, so that every request starts right after the
    /// claim), sends each once, records the outcomes; returns how many were claimed. An error in
    /// one send is returned after the others have ended and been recorded: a request in flight
    /// is never dropped unrecorded.
    pub async fn run_once(&self) -> Result<usize> {
        let concurrency = self.config.concurrency.max(1);
        let size = u32::try_from(concurrency)
            .unwrap_or(u32::MAX)
            .min(self.config.batch);
        // The lease runs from before the claim by this clock: never later than the store's.
        let lease_end = Instant::now() + self.config.lease;
        let claimed = self.store.claim(size, self.config.lease).await?;
        // Each intent is independent (its own key); several are in flight at once.
        let sends: Vec<_> = claimed.iter().map(|c| self.send(c, lease_end)).collect();
        let mut sends = futures::stream::iter(sends).buffer_unordered(concurrency);
        let mut first_error = None;
        while let Some(r) = sends.next().await {
            if let Err(e) = r {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(claimed.len()), Err)
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
        let status: IntentStatus = status
            .parse()
            .map_err(|source| CompensateError::Status { id, source })?;
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

    /// One attempt of one claimed intent, and its recorded outcome.
    async fn send(&self, c: &ClaimedIntent, lease_end: Instant) -> Result<()> {
        let Some(verdict) = self.attempt(c, lease_end).await? else {
            tracing::warn!(
                intent = c.id,
                attempt = c.attempt,
                "not sent: the lease was lost or too short to mark the intent as sending"
            );
            return Ok(());
        };
        let outcome = IntentOutcome::from(verdict);
        if !self.store.finish(c.id, c.attempt, &outcome).await? {
            tracing::warn!(
                intent = c.id,
                attempt = c.attempt,
                "the intent's lease was taken over; outcome not recorded"
            );
        }
        Ok(())
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
        idem_core::crash::crash_point(idem_core::crash::EFFECT_BEFORE_HTTP)?;
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
            || idem_core::crash::broken(idem_core::crash::BREAK_SKIP_SENDING_MARK)
        {
            return Ok(true);
        }
        let left = self.config.timeout.saturating_add(self.config.lease_margin);
        self.store.mark_sending(c.id, c.attempt, left).await
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
                idem_core::crash::EFFECT_AFTER_HTTP_SUCCESS_BEFORE_RECORD,
            )?;
            return Ok(verdict);
        }
        Ok(self.count(verdict, labels))
    }

    /// POSTs the intent's body with its stored key (and trace context, authorization).
    async fn post(&self, c: &ClaimedIntent) -> Reply {
        let key = if idem_core::crash::broken(idem_core::crash::BREAK_NEW_KEY_PER_RETRY)
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
            .header("idempotency-key", key)
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
            Err(e) => Reply::Failed {
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
                if *kind == ParkKind::Conflict {
                    m.conflicts.with_label_values(&labels).inc();
                }
                m.parked.with_label_values(&labels).inc();
            }
            Verdict::Unknown { .. } => m.unknown.with_label_values(&labels).inc(),
        }
        verdict
    }
}
