//! The dispatcher's Prometheus metrics, labelled by effect and target host (bounded).

use idem_core::Result;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

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
    /// `idem_effect_tls_failure_total{failure}`: intents parked because the TLS handshake
    /// failed, by [`crate::TlsFailure::label`] (`unknown_issuer`, `expired`, `wrong_name`,
    /// `client_certificate_required`, …); each is also counted in `idem_effect_parked_total`.
    pub tls_failures: IntCounterVec,
    /// `idem_effect_unknown_total`: intents whose outcome cannot be known (a remote without keys).
    pub unknown: IntCounterVec,
    /// `idem_effect_probe_total{result}`: status probes by what they found.
    pub probes: IntCounterVec,
    /// `idem_effect_compensation_total{result}`: compensations run, `ok` or `failed`.
    pub compensations: IntCounterVec,
    /// `idem_effect_lease_skip_total`: claimed intents not sent because too little of their
    /// lease was left for the request (sent by a later claim).
    pub lease_skips: IntCounterVec,
    /// `idem_effect_fenced_total`: outcomes not recorded because the attempt was fenced (its
    /// lease expired and the intent was claimed again, or it left `pending`): the outcome
    /// changed nothing.
    pub fenced: IntCounterVec,
    /// `idem_effect_in_flight`: requests in flight in [`crate::Dispatcher::run`].
    pub in_flight: IntGauge,
    /// `idem_effect_claim_slots_reserved`: request slots that claims in progress may fill.
    pub reserved: IntGauge,
    /// `idem_effect_outcomes_buffered`: outcomes waiting to be written.
    pub buffered: IntGauge,
    /// `idem_effect_claims_total`: claims of due intents issued by [`crate::Dispatcher::run`].
    pub claims: IntCounter,
}

fn config_error(e: prometheus::Error) -> idem_core::Error {
    idem_core::Error::setup("registering effect metrics", e)
}

impl EffectMetrics {
    /// Creates and registers the metrics.
    pub fn new(registry: &Registry) -> Result<Self> {
        let m = Self::unregistered()?;
        for c in m.all() {
            registry
                .register(Box::new(c.clone()))
                .map_err(config_error)?;
        }
        for g in [&m.in_flight, &m.reserved, &m.buffered] {
            registry
                .register(Box::new(g.clone()))
                .map_err(config_error)?;
        }
        registry
            .register(Box::new(m.claims.clone()))
            .map_err(config_error)?;
        Ok(m)
    }

    /// Creates the metrics without registering them anywhere (a dispatcher built without a
    /// registry counts into these, and nobody scrapes them).
    pub fn unregistered() -> Result<Self> {
        let gauge = |name: &str, help: &str| IntGauge::new(name, help).map_err(config_error);
        let v = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["effect", "target"]).map_err(config_error)
        };
        let with_result = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["effect", "target", "result"])
                .map_err(config_error)
        };
        let with_failure = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["effect", "target", "failure"])
                .map_err(config_error)
        };
        Ok(EffectMetrics {
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
            tls_failures: with_failure(
                "idem_effect_tls_failure_total",
                "Effect intents parked because the TLS handshake failed, by failure (unknown_issuer, expired, wrong_name, client_certificate_required, ...).",
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
            fenced: v(
                "idem_effect_fenced_total",
                "Outcomes not recorded because the attempt was fenced (its lease was taken over).",
            )?,
            in_flight: gauge("idem_effect_in_flight", "Effect requests in flight.")?,
            reserved: gauge(
                "idem_effect_claim_slots_reserved",
                "Request slots that the claims in progress may fill.",
            )?,
            buffered: gauge(
                "idem_effect_outcomes_buffered",
                "Attempt outcomes waiting to be written.",
            )?,
            claims: IntCounter::new(
                "idem_effect_claims_total",
                "Claims of due effect intents issued by the dispatcher.",
            )
            .map_err(config_error)?,
        })
    }

    fn all(&self) -> [&IntCounterVec; 11] {
        [
            &self.attempts,
            &self.successes,
            &self.retries,
            &self.conflicts,
            &self.parked,
            &self.tls_failures,
            &self.unknown,
            &self.probes,
            &self.compensations,
            &self.lease_skips,
            &self.fenced,
        ]
    }
}

impl std::fmt::Debug for EffectMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self
            .all()
            .iter()
            .filter_map(|c| {
                prometheus::core::Collector::desc(*c)
                    .first()
                    .map(|d| d.fq_name.clone())
            })
            .collect();
        f.debug_struct("EffectMetrics")
            .field("metrics", &names)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_registered_only_into_a_given_registry() {
        let registry = Registry::new();
        let m = EffectMetrics::new(&registry).unwrap();
        m.attempts.with_label_values(&["points.award", "h:1"]).inc();
        assert!(
            registry
                .gather()
                .iter()
                .any(|f| f.name() == "idem_effect_attempts_total")
        );
        assert!(EffectMetrics::new(&registry).is_err(), "registered twice");
        let loose = EffectMetrics::unregistered().unwrap();
        assert!(format!("{loose:?}").contains("idem_effect_lease_skip_total"));
    }
}
