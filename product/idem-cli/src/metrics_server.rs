//! Serves a Prometheus registry as text on `GET /metrics`, and the probes an orchestrator
//! reads: `GET /healthz` (200 while the process serves: liveness) and `GET /readyz` (200 when
//! every dependency of the [`Health`] is usable, else 503; both with the checks as JSON).

use std::net::SocketAddr;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use idem_core::health::Health;
use prometheus::{Encoder, Registry, TextEncoder};

#[derive(Clone)]
struct Served {
    registry: Registry,
    health: Health,
}

async fn metrics(State(served): State<Served>) -> impl IntoResponse {
    let mut buf = Vec::new();
    let encoder = TextEncoder::new();
    match encoder.encode(&served.registry.gather(), &mut buf) {
        Ok(()) => ([(CONTENT_TYPE, encoder.format_type().to_owned())], buf).into_response(),
        Err(e) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn healthz() -> impl IntoResponse {
    axum::Json(serde_json::json!({"alive": true}))
}

async fn readyz(State(served): State<Served>) -> impl IntoResponse {
    let report = served.health.report();
    let status = if report.ready {
        axum::http::StatusCode::OK
    } else {
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(report))
}

/// Binds `addr` and serves `registry` in the background, with a process that has no
/// dependency to report (always ready); returns the bound address.
pub async fn serve(addr: SocketAddr, registry: Registry) -> anyhow::Result<SocketAddr> {
    serve_with(addr, registry, Health::new()).await
}

/// Binds `addr` and serves `registry` and `health`'s probes in the background; returns the
/// bound address.
pub async fn serve_with(
    addr: SocketAddr,
    registry: Registry,
    health: Health,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics address {addr}"))?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Served { registry, health });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    Ok(bound)
}
