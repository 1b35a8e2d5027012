//! Why the layer answers instead of the route, as `application/problem+json` documents.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::idempotency::KeyError;

/// Why the layer answered instead of the route: each is a problem+json response.
#[derive(Debug)]
#[non_exhaustive]
pub enum IdempotencyRejection {
    /// The key is missing or malformed (400).
    BadKey(KeyError),
    /// The request carries no credentials, so no client could be identified (401).
    NoClient,
    /// The request carries credentials but no authentication layer set a
    /// [`ClientScope`](crate::ClientScope), and scoping by credential is not enabled (500: the
    /// server's configuration, not the client).
    NoScope,
    /// The body is larger than the layer buffers (413).
    TooLarge,
    /// A request with this key is still executing (409).
    InFlight,
    /// The key was used with a different request (422).
    Mismatch,
    /// The key store failed (503).
    Store(idem_core::Error),
    /// Under [`Idempotency::transactional_layer`](crate::Idempotency::transactional_layer): the
    /// request's commit failed; its writes and the key were rolled back or, when the connection
    /// broke during the commit, may have committed: a retry with the same key replays or
    /// executes, never both (503).
    NotCommitted(idem_core::Error),
    /// Under [`Idempotency::transactional_layer`](crate::Idempotency::transactional_layer): the
    /// claim was not held when the response was stored (never expected: the open transaction
    /// holds it); everything was rolled back (503).
    ClaimNotHeld,
}

/// Every value of [`IdempotencyRejection::reason`]: the bounded label set of
/// `idem_http_rejections_total`.
pub(crate) const REASONS: [&str; 9] = [
    "bad_key",
    "no_client",
    "no_scope",
    "too_large",
    "in_flight",
    "mismatch",
    "store",
    "not_committed",
    "claim_not_held",
];

impl IdempotencyRejection {
    /// The rejection's name: the `reason` label of `idem_http_rejections_total`, one of a fixed
    /// set (never taken from the request).
    pub fn reason(&self) -> &'static str {
        match self {
            IdempotencyRejection::BadKey(_) => "bad_key",
            IdempotencyRejection::NoClient => "no_client",
            IdempotencyRejection::NoScope => "no_scope",
            IdempotencyRejection::TooLarge => "too_large",
            IdempotencyRejection::InFlight => "in_flight",
            IdempotencyRejection::Mismatch => "mismatch",
            IdempotencyRejection::Store(_) => "store",
            IdempotencyRejection::NotCommitted(_) => "not_committed",
            IdempotencyRejection::ClaimNotHeld => "claim_not_held",
        }
    }

    fn parts(&self) -> (StatusCode, &'static str, String) {
        match self {
            IdempotencyRejection::BadKey(e) => (StatusCode::BAD_REQUEST, "Invalid Idempotency-Key", e.to_string()),
            IdempotencyRejection::NoClient => (
                StatusCode::UNAUTHORIZED,
                "Client required",
                "Idempotency-Key is scoped per client: send credentials".to_owned(),
            ),
            IdempotencyRejection::NoScope => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "Client not identified",
                "the server did not identify the client (no ClientScope from an authentication layer), so it cannot scope the Idempotency-Key; nothing was executed".to_owned(),
            ),
            IdempotencyRejection::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "Body too large",
                "the body is larger than the idempotency layer buffers".to_owned(),
            ),
            IdempotencyRejection::InFlight => (
                StatusCode::CONFLICT,
                "Request in progress",
                "a request with this Idempotency-Key is still being processed; retry later with the same key".to_owned(),
            ),
            IdempotencyRejection::Mismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "Idempotency-Key reused",
                "this Idempotency-Key was used with a different request; use a new key for a new request".to_owned(),
            ),
            IdempotencyRejection::Store(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "Try again", "the idempotency key store is unavailable".to_owned())
            }
            IdempotencyRejection::NotCommitted(_) | IdempotencyRejection::ClaimNotHeld => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Try again",
                "the request's writes were not committed; retry with the same Idempotency-Key".to_owned(),
            ),
        }
    }

    /// Logs the rejections that are the server's fault.
    fn log(&self) {
        match self {
            IdempotencyRejection::Store(e) => {
                tracing::error!(error = %e, "idempotency key store failed");
            }
            IdempotencyRejection::NotCommitted(e) => {
                tracing::error!(error = %e, "an idempotent request's transaction did not commit");
            }
            IdempotencyRejection::ClaimNotHeld => tracing::error!(
                "the idempotency key's claim was not held when its response was stored; the request's transaction was rolled back"
            ),
            IdempotencyRejection::NoScope => tracing::error!(
                "a request with an Idempotency-Key reached the layer without a ClientScope: add an authentication layer that inserts idem_http::ClientScope (or opt in to ScopeSource::ClientScopeOrCredential)"
            ),
            _ => {}
        }
    }

    /// Whether the answer carries `Retry-After: 1` (a retry with the same key may succeed).
    fn retry_after(&self) -> bool {
        matches!(
            self,
            IdempotencyRejection::InFlight
                | IdempotencyRejection::Store(_)
                | IdempotencyRejection::NotCommitted(_)
                | IdempotencyRejection::ClaimNotHeld
        )
    }
}

impl IntoResponse for IdempotencyRejection {
    fn into_response(self) -> Response {
        self.log();
        let (status, title, detail) = self.parts();
        let mut resp = problem(status, title, &detail);
        if self.retry_after() {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

/// An `application/problem+json` response.
pub(crate) fn problem(status: StatusCode, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_rejection() -> Vec<IdempotencyRejection> {
        let store = || idem_core::Error::Config("unreachable".to_owned());
        vec![
            IdempotencyRejection::BadKey(KeyError::Missing),
            IdempotencyRejection::NoClient,
            IdempotencyRejection::NoScope,
            IdempotencyRejection::TooLarge,
            IdempotencyRejection::InFlight,
            IdempotencyRejection::Mismatch,
            IdempotencyRejection::Store(store()),
            IdempotencyRejection::NotCommitted(store()),
            IdempotencyRejection::ClaimNotHeld,
        ]
    }

    #[test]
    fn every_rejection_has_its_own_reason_from_the_fixed_set() {
        let reasons: Vec<&str> = every_rejection().iter().map(|r| r.reason()).collect();
        assert_eq!(reasons, REASONS);
    }

    #[test]
    fn the_retryable_rejections_say_retry_after() {
        for r in every_rejection() {
            let retry = r.retry_after();
            let resp = r.into_response();
            assert_eq!(
                resp.headers().get(header::RETRY_AFTER).is_some(),
                retry,
                "{}",
                resp.status()
            );
            assert_eq!(
                resp.headers()[header::CONTENT_TYPE],
                "application/problem+json"
            );
        }
    }
}
