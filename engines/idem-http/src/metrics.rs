//! What the layer counts: [`LayerStats`] in the process, and [`HttpMetrics`] for Prometheus.
//! Names are stable; the one label, `reason`, takes a fixed set of values.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::response::{IntoResponse, Response};
use idem_core::{Error, Result};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

use crate::rejection::{IdempotencyRejection, REASONS};

/// What the layer counts (each also logged): read them with
/// [`Idempotency::stats`](crate::Idempotency::stats). The same events are exported by
/// [`HttpMetrics`] when the layer has them.
#[derive(Debug, Default)]
pub struct LayerStats {
    /// Claims this layer found taken over or gone when it renewed, completed or released them:
    /// a request ran longer than its lock without renewing it. A retry may have executed beside
    /// it. Never normal.
    pub claims_lost: AtomicU64,
    /// Lock renewals that failed (the key store was unreachable) and were tried again.
    pub renewal_failures: AtomicU64,
    /// Responses stored without their body (too large to store, or the body stream failed).
    pub bodies_omitted: AtomicU64,
}

/// The layer's Prometheus metrics (`idem_http_*`), registered with
/// [`Idempotency::registry`](crate::Idempotency::registry) or created here and shared by several
/// layers with [`Idempotency::shared_metrics`](crate::Idempotency::shared_metrics).
#[derive(Clone)]
pub struct HttpMetrics {
    /// `idem_http_claims_lost_total`: claims found taken over or gone when the layer renewed,
    /// completed or released them (a retry may have executed beside the request).
    pub claims_lost: IntCounter,
    /// `idem_http_renewal_failures_total`: lock renewals that failed and were tried again.
    pub renewal_failures: IntCounter,
    /// `idem_http_bodies_omitted_total`: responses stored as their status alone.
    pub bodies_omitted: IntCounter,
    /// `idem_http_replays_total`: stored responses replayed to a retry.
    pub replays: IntCounter,
    /// `idem_http_conflicts_total`: requests answered 409 because a request with their key was
    /// still executing (each also counts in `idem_http_rejections_total{reason="in_flight"}`).
    pub conflicts: IntCounter,
    /// `idem_http_rejections_total{reason}`: problem+json answers of the layer, by
    /// [`IdempotencyRejection::reason`] (`bad_key`, `no_client`, `no_scope`, `too_large`,
    /// `in_flight`, `mismatch`, `store`, `not_committed`, `claim_not_held`).
    pub rejections: IntCounterVec,
}

impl HttpMetrics {
    /// Creates the metrics and registers them in `registry`; fails when one of the names is
    /// registered there already.
    pub fn new(registry: &Registry) -> Result<Self> {
        let m = Self::unregistered()?;
        m.register(registry)?;
        Ok(m)
    }

    /// Creates the metrics without registering them anywhere. Every `reason` of
    /// `idem_http_rejections_total` has its series from the start, at 0.
    pub fn unregistered() -> Result<Self> {
        let counter = |name: &str, help: &str| IntCounter::new(name, help).map_err(reg_err);
        let rejections = IntCounterVec::new(
            Opts::new(
                "idem_http_rejections_total",
                "Requests the Idempotency-Key layer answered with a problem+json document instead of the route, by reason.",
            ),
            &["reason"],
        )
        .map_err(reg_err)?;
        for reason in REASONS {
            rejections.with_label_values(&[reason]);
        }
        Ok(HttpMetrics {
            claims_lost: counter(
                "idem_http_claims_lost_total",
                "Idempotency-Key claims found taken over or gone when the layer renewed, completed or released them.",
            )?,
            renewal_failures: counter(
                "idem_http_renewal_failures_total",
                "Idempotency-Key lock renewals that failed and were tried again.",
            )?,
            bodies_omitted: counter(
                "idem_http_bodies_omitted_total",
                "Responses stored without their body (too large, or a failed body stream).",
            )?,
            replays: counter(
                "idem_http_replays_total",
                "Stored responses replayed to a request with a completed Idempotency-Key.",
            )?,
            conflicts: counter(
                "idem_http_conflicts_total",
                "Requests answered 409 because a request with their Idempotency-Key was still executing.",
            )?,
            rejections,
        })
    }

    /// Registers every metric in `registry`; fails when one of the names is registered there
    /// already (by another layer's metrics, for instance).
    pub fn register(&self, registry: &Registry) -> Result<()> {
        for c in self.counters() {
            registry.register(Box::new(c.clone())).map_err(reg_err)?;
        }
        registry
            .register(Box::new(self.rejections.clone()))
            .map_err(reg_err)
    }

    fn counters(&self) -> [&IntCounter; 5] {
        [
            &self.claims_lost,
            &self.renewal_failures,
            &self.bodies_omitted,
            &self.replays,
            &self.conflicts,
        ]
    }
}

impl std::fmt::Debug for HttpMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpMetrics")
            .field("claims_lost", &self.claims_lost.get())
            .field("renewal_failures", &self.renewal_failures.get())
            .field("bodies_omitted", &self.bodies_omitted.get())
            .field("replays", &self.replays.get())
            .field("conflicts", &self.conflicts.get())
            .finish_non_exhaustive()
    }
}

fn reg_err(e: prometheus::Error) -> Error {
    Error::setup("registering http metrics", e)
}

/// Where the layer counts: its [`LayerStats`] always, its [`HttpMetrics`] when it has them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Counters {
    pub(crate) stats: Arc<LayerStats>,
    pub(crate) metrics: Option<HttpMetrics>,
}

impl Counters {
    fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// A claim found taken over or gone.
    pub(crate) fn claim_lost(&self) {
        Self::count(&self.stats.claims_lost);
        if let Some(m) = &self.metrics {
            m.claims_lost.inc();
        }
    }

    /// A lock renewal that failed.
    pub(crate) fn renewal_failed(&self) {
        Self::count(&self.stats.renewal_failures);
        if let Some(m) = &self.metrics {
            m.renewal_failures.inc();
        }
    }

    /// A response stored without its body.
    pub(crate) fn body_omitted(&self) {
        Self::count(&self.stats.bodies_omitted);
        if let Some(m) = &self.metrics {
            m.bodies_omitted.inc();
        }
    }

    /// A stored response replayed.
    pub(crate) fn replayed(&self) {
        if let Some(m) = &self.metrics {
            m.replays.inc();
        }
    }

    /// Counts `rejection` and answers it.
    pub(crate) fn reject(&self, rejection: IdempotencyRejection) -> Response {
        if let Some(m) = &self.metrics {
            if matches!(rejection, IdempotencyRejection::InFlight) {
                m.conflicts.inc();
            }
            m.rejections.with_label_values(&[rejection.reason()]).inc();
        }
        rejection.into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(registry: &Registry, name: &str, reason: Option<&str>) -> Option<f64> {
        registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric().to_vec())
            .find(|m| reason.is_none_or(|r| m.get_label().iter().any(|l| l.value() == r)))
            .map(|m| m.get_counter().get_value())
    }

    #[test]
    fn metrics_are_registered_once_and_every_reason_starts_at_zero() {
        let registry = Registry::new();
        let m = HttpMetrics::new(&registry).unwrap();
        assert!(HttpMetrics::new(&registry).is_err(), "registered twice");
        for reason in REASONS {
            assert_eq!(
                value(&registry, "idem_http_rejections_total", Some(reason)),
                Some(0.0),
                "{reason}"
            );
        }
        let counters = Counters {
            stats: Arc::default(),
            metrics: Some(m),
        };
        counters.claim_lost();
        let _ = counters.reject(IdempotencyRejection::InFlight);
        assert_eq!(
            value(&registry, "idem_http_claims_lost_total", None),
            Some(1.0)
        );
        assert_eq!(
            value(&registry, "idem_http_conflicts_total", None),
            Some(1.0)
        );
        assert_eq!(
            value(&registry, "idem_http_rejections_total", Some("in_flight")),
            Some(1.0)
        );
        assert_eq!(counters.stats.claims_lost.load(Ordering::Relaxed), 1);
    }
}
