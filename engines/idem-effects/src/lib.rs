//! The effect dispatcher: delivers effect intents (recorded by handlers in their own
//! transactions) to external HTTP APIs.
//!
//! # Delivery semantics
//!
//! At least once *attempted*; converging to once *applied* where the remote honours
//! `Idempotency-Key`. Every attempt of an intent carries the key stored with it
//! (`event-<event id>-<effect>`) — after a retry, a crash or a restart alike; the dispatcher never
//! mints a key. Outcomes:
//!
//! | response | outcome |
//! |---|---|
//! | 2xx | done; the response is stored |
//! | timeout, connection error, 5xx | retried with backoff (or the `Retry-After` the remote sent), same key |
//! | 409 (the remote is still processing the key), 429 | retried with exponential backoff (never shorter than the remote's `Retry-After`), same key, until [`DispatcherConfig::busy_attempts`]; then parked for a person |
//! | 422 (the key was used with a different body) | parked for a person; `idem_idempotency_conflict_total` |
//! | other 4xx | parked with the reason |
//!
//! Duplicate windows: a crash after the remote applied the effect and before the outcome is
//! recorded (`effect.after_http_success_before_record`) leads to a new attempt with the same
//! key, which the remote answers from its stored response. A remote that ignores keys would
//! apply it twice: declare it with an [`EffectPolicy`] (`remote_ignores_keys`). The dispatcher
//! then commits a sending mark before every request ([`IntentStore::mark_sending`]); an attempt
//! that finds an earlier attempt's mark with no recorded outcome (the dispatcher died or lost
//! its lease after sending) and every ambiguous failure go to the [`StatusProbe`], or, without
//! one, to the *unknown* state instead of a re-send; a [`Compensation`] settles unknown intents.
//! The [`remote`] module documents the window that remains.
//!
//! A claim takes at most `concurrency` intents, and no probe or request starts unless its
//! intent's lease ends after `now + timeout + lease_margin` ([`lease_allows_send`]).

pub mod remote;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use idem_core::Result;
use idem_core::idempotency::{ClaimedIntent, IntentOutcome, IntentStore, Resolution};
use prometheus::{IntCounterVec, Opts, Registry};

pub use remote::{
    AppliedWhen, Compensation, EffectPolicy, HttpCompensation, HttpStatusProbe, Probe, StatusProbe,
};

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
        }
    }
}

/// Dispatcher metrics, labelled by effect and target host (bounded).
#[derive(Clone)]
pub struct EffectMetrics {
    /// `idem_effect_attempts_total`.
    pub attempts: IntCounterVec,
    /// `idem_effect_success_total`.
    pub successes: IntCounterVec,
    /// `idem_effect_retry_total`.
    pub retries: IntCounterVec,
    /// `idem_idempotency_conflict_total` (client side: 422 from the remote).
    pub conflicts: IntCounterVec,
    /// `idem_effect_parked_total`.
    pub parked: IntCounterVec,
    /// `idem_effect_unknown_total`: intents whose outcome cannot be known (a remote without keys).
    pub unknown: IntCounterVec,
    /// `idem_effect_probe_total{result}`: status probes by what they found.
    pub probes: IntCounterVec,
    /// `idem_effect_compensation_total{result}`: compensations run, `ok` or `failed`.
    pub compensations: IntCounterVec,
    /// `idem_effect_lease_skip_total`: claimed intents not sent because too little of their
    /// lease was left for the request (sent by a later claim).
    pub lease_skips: IntCounterVec,
}

impl EffectMetrics {
    /// Creates and registers the metrics.
    pub fn new(registry: &Registry) -> Result<Self> {
        let v = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["effect", "target"])
                .map_err(|e| idem_core::Error::Config(format!("registering effect metrics: {e}")))
        };
        let with_result = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["effect", "target", "result"])
                .map_err(|e| idem_core::Error::Config(format!("registering effect metrics: {e}")))
        };
        let m = EffectMetrics {
            attempts: v(
                "idem_effect_attempts_total",
                "HTTP attempts of effect intents.",
            )?,
            successes: v(
                "idem_effect_success_total",
                "Effect intents completed with a 2xx.",
            )?,
            retries: v(
                "idem_effect_retry_total",
                "Attempts that will be retried with the same key.",
            )?,
            conflicts: v(
                "idem_idempotency_conflict_total",
                "Idempotency conflicts: the remote says the key was used with a different request (422).",
            )?,
            parked: v(
                "idem_effect_parked_total",
                "Effect intents parked for a person.",
            )?,
            unknown: v(
                "idem_effect_unknown_total",
                "Effect intents whose outcome cannot be known (the remote ignores keys and no probe could tell).",
            )?,
            probes: with_result(
                "idem_effect_probe_total",
                "Status probes asked before re-attempts, by result (applied, not_applied, unknown, unavailable).",
            )?,
            compensations: with_result(
                "idem_effect_compensation_total",
                "Compensations run on unknown or parked intents, by result (ok, failed).",
            )?,
            lease_skips: v(
                "idem_effect_lease_skip_total",
                "Claimed intents not sent because too little of their lease was left for the request.",
            )?,
        };
        for c in [
            &m.attempts,
            &m.successes,
            &m.retries,
            &m.conflicts,
            &m.parked,
            &m.unknown,
            &m.probes,
            &m.compensations,
            &m.lease_skips,
        ] {
            registry.register(Box::new(c.clone())).map_err(|e| {
                idem_core::Error::Config(format!("registering effect metrics: {e}"))
            })?;
        }
        Ok(m)
    }
}

/// Sends claimed intents and records their outcomes.
pub struct Dispatcher<S> {
    store: S,
    client: reqwest::Client,
    config: DispatcherConfig,
    metrics: EffectMetrics,
    policies: remote::Policies,
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
        status: String,
    },
    /// The effect has no compensation configured.
    #[error("effect {0:?} has no compensation configured")]
    NoCompensation(String),
    /// The compensation ran and failed; the intent is unchanged.
    #[error("the compensation of intent {id} failed: {reason}")]
    Failed {
        /// The intent.
        id: i64,
        /// What the compensation said.
        reason: String,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] idem_core::Error),
}

fn host(target: &str) -> String {
    reqwest::Url::parse(target)
        .ok()
        .and_then(|u| {
            u.host_str()
                .map(|h| format!("{h}:{}", u.port_or_known_default().unwrap_or(0)))
        })
        .unwrap_or_else(|| "invalid".to_owned())
}

fn retry_after(resp: &reqwest::Response) -> Option<Duration> {
    resp.headers()
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(|s| Duration::from_secs(s.min(3600)))
}

/// Maps an HTTP status to an outcome (body and `Retry-After` supplied by the caller).
pub fn classify(
    status: u16,
    body: String,
    retry_after: Option<Duration>,
    backoff: Duration,
) -> IntentOutcome {
    match status {
        200..=299 => IntentOutcome::Done { status, body },
        // A refusal backs off exponentially even when the remote asks for less (`Retry-After:
        // 1` from a key still locked by a request that died): the attempt bound of
        // `bound_busy` then spans minutes, longer than a remote's key lock.
        409 => IntentOutcome::Retry {
            after: retry_after
                .unwrap_or(Duration::ZERO)
                .max(backoff)
                .max(Duration::from_secs(1)),
            reason: "409: the remote is still processing this key".to_owned(),
        },
        429 => IntentOutcome::Retry {
            after: retry_after.unwrap_or(Duration::ZERO).max(backoff),
            reason: format!("429: {}", body.chars().take(200).collect::<String>()),
        },
        500..=599 => IntentOutcome::Retry {
            after: retry_after.unwrap_or(backoff),
            reason: format!("{status}: {}", body.chars().take(200).collect::<String>()),
        },
        422 => IntentOutcome::Park {
            reason: format!(
                "422: the remote says this key was used with a different request: {}",
                body.chars().take(200).collect::<String>()
            ),
        },
        _ => IntentOutcome::Park {
            reason: format!("{status}: {}", body.chars().take(200).collect::<String>()),
        },
    }
}

/// Bounds the retries of a remote that keeps refusing: a 409 or 429 on attempt `attempt` or
/// later (`busy_attempts`) parks the intent for a person, with the reason.
pub fn bound_busy(
    outcome: IntentOutcome,
    status: u16,
    attempt: i32,
    busy_attempts: i32,
) -> IntentOutcome {
    match outcome {
        IntentOutcome::Retry { reason, .. }
            if matches!(status, 409 | 429) && attempt >= busy_attempts =>
        {
            IntentOutcome::Park {
                reason: format!(
                    "{reason} (answered {status} on attempt {attempt}, the last one allowed): \
                     check the remote, then `idem effects retry --id` sends it again with the same key"
                ),
            }
        }
        outcome => outcome,
    }
}

/// The wait after a failed attempt `attempt`: `backoff` doubling per attempt, at most
/// `backoff_max`.
pub fn backoff_after(config: &DispatcherConfig, attempt: i32) -> Duration {
    let exp = u32::try_from(attempt.saturating_sub(1))
        .unwrap_or(0)
        .min(20);
    config
        .backoff
        .saturating_mul(1 << exp)
        .min(config.backoff_max)
}

/// Is there enough lease left (`left`) to start a request that may take `timeout`?
pub fn lease_allows_send(left: Duration, timeout: Duration, margin: Duration) -> bool {
    left >= timeout.saturating_add(margin)
}

/// What a re-attempt to a remote that ignores keys must do before anything is sent, decided
/// from the stored intent alone: `Some(unknown)` when an earlier attempt was sent, its outcome
/// never recorded, and no probe can tell whether it was applied.
pub fn predecessor_outcome(
    c: &ClaimedIntent,
    policy: Option<&EffectPolicy>,
) -> Option<IntentOutcome> {
    if !policy.is_some_and(|p| p.remote_ignores_keys && p.probe.is_none()) {
        return None;
    }
    let sent = c.unrecorded_send?;
    Some(IntentOutcome::Unknown {
        reason: format!(
            "attempt {sent} was sent to a remote that ignores keys and its outcome was never \
             recorded (the dispatcher died or lost its lease); no status probe is configured, so \
             re-sending could apply the effect twice: check the remote, then `idem effects resolve`"
        ),
    })
}

impl<S: IntentStore> Dispatcher<S> {
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
            policies: HashMap::new(),
        })
    }

    /// Sets how `effect`'s remote is treated (keys ignored, status probe, compensation).
    pub fn with_policy(mut self, effect: impl Into<String>, policy: EffectPolicy) -> Self {
        self.policies.insert(effect.into(), policy);
        self
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
        if status != "unknown" && status != "parked" {
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
        let note = result.map_err(|reason| CompensateError::Failed { id, reason })?;
        let resolution = if then_retry {
            Resolution::Pending
        } else {
            Resolution::Parked
        };
        let note = if then_retry {
            format!("{note}; sent again")
        } else {
            format!("{note}; `idem effects retry --id {id}` sends it again")
        };
        if !self.store.resolve(id, resolution, &note).await? {
            return Err(CompensateError::NotStuck {
                id,
                status: "changed while compensating".to_owned(),
            });
        }
        Ok(note)
    }

    /// The metrics.
    pub fn metrics(&self) -> &EffectMetrics {
        &self.metrics
    }

    fn backoff(&self, attempt: i32) -> Duration {
        backoff_after(&self.config, attempt)
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

    /// `None` when a request that may take `timeout` can start now under a lease ending at
    /// `lease_end`; otherwise the outcome that gives the intent back for a later claim.
    fn lease_check(&self, lease_end: Instant, labels: [&str; 2]) -> Option<IntentOutcome> {
        let left = lease_end.saturating_duration_since(Instant::now());
        if lease_allows_send(left, self.config.timeout, self.config.lease_margin) {
            return None;
        }
        self.metrics.lease_skips.with_label_values(&labels).inc();
        Some(IntentOutcome::Retry {
            after: Duration::ZERO,
            reason: format!(
                "not sent: {left:?} of the lease was left, less than the timeout plus the margin"
            ),
        })
    }

    /// Asks the probe, before a re-attempt, whether the effect already happened: `Some` ends the
    /// attempt without sending.
    async fn probe_first(
        &self,
        c: &ClaimedIntent,
        policy: &EffectPolicy,
        labels: [&str; 2],
    ) -> Option<IntentOutcome> {
        let probe = policy.probe.as_ref()?;
        if c.attempt <= 1 {
            return None;
        }
        let found = probe.probe(&self.client, c).await;
        let (result, outcome) = match found {
            Probe::Applied { status, body } => {
                ("applied", Some(IntentOutcome::Done { status, body }))
            }
            Probe::NotApplied => ("not_applied", None),
            Probe::Unknown { reason } => (
                "unknown",
                Some(IntentOutcome::Unknown {
                    reason: format!(
                        "the status probe cannot tell whether the effect happened: {reason}"
                    ),
                }),
            ),
            Probe::Unavailable { reason } => (
                "unavailable",
                Some(IntentOutcome::Retry {
                    after: self.backoff(c.attempt).max(policy.settle),
                    reason: format!("not sent: the status probe is unavailable: {reason}"),
                }),
            ),
        };
        self.metrics
            .probes
            .with_label_values(&[labels[0], labels[1], result])
            .inc();
        outcome
    }

    /// One attempt of one claimed intent, and its recorded outcome.
    async fn send(&self, c: &ClaimedIntent, lease_end: Instant) -> Result<()> {
        let Some(outcome) = self.attempt(c, lease_end).await? else {
            tracing::warn!(
                intent = c.id,
                attempt = c.attempt,
                "not sent: the lease was lost or too short to mark the intent as sending"
            );
            return Ok(());
        };
        if !self.store.finish(c.id, c.attempt, &outcome).await? {
            tracing::warn!(
                intent = c.id,
                attempt = c.attempt,
                "the intent's lease was taken over; outcome not recorded"
            );
        }
        Ok(())
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

    /// The outcome of one attempt, or `None` when nothing was sent and nothing is to be
    /// recorded (the lease is lost).
    async fn attempt(
        &self,
        c: &ClaimedIntent,
        lease_end: Instant,
    ) -> Result<Option<IntentOutcome>> {
        let target = host(&c.intent.target);
        let labels = [c.intent.effect.as_str(), target.as_str()];
        let policy = self.policies.get(&c.intent.effect);
        if let Some(outcome) = predecessor_outcome(c, policy) {
            return Ok(Some(self.count(outcome, labels)));
        }
        if let Some(outcome) = self.lease_check(lease_end, labels) {
            return Ok(Some(self.count(outcome, labels)));
        }
        if let Some(policy) = policy
            && let Some(outcome) = self.probe_first(c, policy, labels).await
        {
            return Ok(Some(self.count(outcome, labels)));
        }
        if let Some(outcome) = self.lease_check(lease_end, labels) {
            return Ok(Some(self.count(outcome, labels)));
        }
        idem_core::crash::crash_point(idem_core::crash::EFFECT_BEFORE_HTTP)?;
        if !self.mark_sending(c, policy).await? {
            return Ok(None);
        }
        self.request(c, policy, labels).await.map(Some)
    }

    /// Sends the request of one attempt and classifies its outcome.
    async fn request(
        &self,
        c: &ClaimedIntent,
        policy: Option<&EffectPolicy>,
        labels: [&str; 2],
    ) -> Result<IntentOutcome> {
        self.metrics.attempts.with_label_values(&labels).inc();
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
        let (outcome, ambiguous) = match req.send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let after = retry_after(&resp);
                let body = resp.text().await.unwrap_or_default();
                // A 5xx may come after the remote applied the effect; a 429 is a refusal.
                let ambiguous = status >= 500;
                let outcome = classify(status, body, after, self.backoff(c.attempt));
                (
                    bound_busy(outcome, status, c.attempt, self.config.busy_attempts),
                    ambiguous,
                )
            }
            Err(e) => (
                IntentOutcome::Retry {
                    after: self.backoff(c.attempt),
                    reason: if e.is_timeout() {
                        "timed out: the effect may have happened; retrying with the same key"
                            .to_owned()
                    } else {
                        format!("request failed: {e}")
                    },
                },
                // A refused connection never reached the remote.
                !e.is_connect(),
            ),
        };
        let outcome = match (outcome, policy) {
            (IntentOutcome::Retry { after, reason }, Some(p))
                if ambiguous && p.remote_ignores_keys =>
            {
                if p.probe.is_some() {
                    IntentOutcome::Retry {
                        after: after.max(p.settle),
                        reason: format!(
                            "{reason}; the remote ignores keys: the next attempt asks the status probe first"
                        ),
                    }
                } else {
                    IntentOutcome::Unknown {
                        reason: format!(
                            "{reason}; the remote ignores keys and no status probe is configured, so \
                             re-sending could apply the effect twice: check the remote, then \
                             `idem effects resolve`"
                        ),
                    }
                }
            }
            (outcome, _) => outcome,
        };
        if matches!(outcome, IntentOutcome::Done { .. }) {
            self.metrics.successes.with_label_values(&labels).inc();
            idem_core::crash::crash_point(
                idem_core::crash::EFFECT_AFTER_HTTP_SUCCESS_BEFORE_RECORD,
            )?;
            return Ok(outcome);
        }
        Ok(self.count(outcome, labels))
    }

    /// Counts a non-success outcome (and a success found by the probe).
    fn count(&self, outcome: IntentOutcome, labels: [&str; 2]) -> IntentOutcome {
        match &outcome {
            IntentOutcome::Done { .. } => self.metrics.successes.with_label_values(&labels).inc(),
            IntentOutcome::Retry { .. } => self.metrics.retries.with_label_values(&labels).inc(),
            IntentOutcome::Park { reason } => {
                if reason.starts_with("422") {
                    self.metrics.conflicts.with_label_values(&labels).inc();
                }
                self.metrics.parked.with_label_values(&labels).inc();
            }
            IntentOutcome::Unknown { .. } => self.metrics.unknown.with_label_values(&labels).inc(),
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_by_status() {
        let b = Duration::from_millis(200);
        assert!(matches!(
            classify(201, "{}".into(), None, b),
            IntentOutcome::Done { status: 201, .. }
        ));
        assert_eq!(
            classify(409, String::new(), None, b),
            IntentOutcome::Retry {
                after: Duration::from_secs(1),
                reason: "409: the remote is still processing this key".into()
            }
        );
        assert!(
            matches!(classify(503, String::new(), Some(Duration::from_secs(7)), b), IntentOutcome::Retry { after, .. } if after == Duration::from_secs(7))
        );
        assert!(
            matches!(classify(429, String::new(), None, b), IntentOutcome::Retry { after, .. } if after == b)
        );
        let long = Duration::from_secs(8);
        assert!(
            matches!(classify(409, String::new(), Some(Duration::from_secs(1)), long), IntentOutcome::Retry { after, .. } if after == long),
            "a short Retry-After does not cut the backoff of a refusal"
        );
        assert!(
            matches!(classify(422, String::new(), None, b), IntentOutcome::Park { reason } if reason.starts_with("422"))
        );
        assert!(matches!(
            classify(404, String::new(), None, b),
            IntentOutcome::Park { .. }
        ));
    }

    #[test]
    fn refusals_are_bounded_and_leases_checked() {
        let retry = || classify(409, String::new(), None, Duration::ZERO);
        assert!(matches!(
            bound_busy(retry(), 409, 19, 20),
            IntentOutcome::Retry { .. }
        ));
        assert!(
            matches!(bound_busy(retry(), 409, 20, 20), IntentOutcome::Park { reason } if reason.starts_with("409"))
        );
        let unavailable = classify(503, String::new(), None, Duration::ZERO);
        assert_eq!(bound_busy(unavailable.clone(), 503, 99, 20), unavailable);
        // With the defaults the refusals of a key locked by a request that died (idem-http: 30 s)
        // end long before the bound parks the intent.
        let config = DispatcherConfig::default();
        let waited: Duration = (1..config.busy_attempts)
            .map(|a| backoff_after(&config, a))
            .sum();
        assert!(waited > Duration::from_secs(600), "{waited:?}");
        let (t, m) = (Duration::from_secs(10), Duration::from_secs(1));
        assert!(lease_allows_send(Duration::from_secs(11), t, m));
        assert!(!lease_allows_send(Duration::from_millis(10_999), t, m));
    }
}
