//! The layer's pure decisions: a request's key and scope, its fingerprint, what a claim's
//! result answers, and what to do with the handler's response.

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::Response;
use idem_core::idempotency::{ClaimToken, IdempotencyKey, KeyClaim, StoredResponse, TxClaim};
use sha2::{Digest, Sha256};

use crate::metrics::Counters;
use crate::{
    ClientScope, IDEMPOTENCY_KEY, IDEMPOTENT_BODY_OMITTED, IDEMPOTENT_REPLAYED,
    IdempotencyRejection, ScopeSource,
};

/// The request's key: exactly one valid `Idempotency-Key` field.
pub(crate) fn key_of(headers: &HeaderMap) -> Result<IdempotencyKey, IdempotencyRejection> {
    let values: Vec<&[u8]> = headers
        .get_all(IDEMPOTENCY_KEY)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    IdempotencyKey::from_header_values(&values).map_err(IdempotencyRejection::BadKey)
}

/// The scope of a request's key: a pure decision over what the request carries.
pub(crate) fn scope(
    client: Option<&ClientScope>,
    authorization: Option<&HeaderValue>,
    source: ScopeSource,
) -> Result<String, IdempotencyRejection> {
    match (client, authorization, source) {
        (Some(ClientScope(s)), _, _) => Ok(format!("client:{s}")),
        (None, None, _) => Err(IdempotencyRejection::NoClient),
        (None, Some(v), ScopeSource::ClientScopeOrCredential) => {
            Ok(format!("credential:{}", hex(&Sha256::digest(v.as_bytes()))))
        }
        (None, Some(_), ScopeSource::ClientScope) => Err(IdempotencyRejection::NoScope),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of the method, the path and query, and the body.
pub(crate) fn fingerprint(method: &str, uri: &str, body: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(method.as_bytes());
    h.update([0]);
    h.update(uri.as_bytes());
    h.update([0]);
    h.update(body);
    hex(&h.finalize())
}

/// A claim this request did not get: what it answers instead of executing.
pub(crate) enum Refused {
    /// The key is completed: replay its response.
    Replay(StoredResponse),
    /// The key is in flight or was used with another request.
    Rejected(IdempotencyRejection),
}

impl Refused {
    /// The answer, with a replay counted.
    pub(crate) fn answer(self, counters: &Counters) -> Result<Response, IdempotencyRejection> {
        match self {
            Refused::Replay(stored) => {
                counters.replayed();
                Ok(replay(stored))
            }
            Refused::Rejected(rejection) => Err(rejection),
        }
    }
}

/// The claim's token when this request holds the key.
pub(crate) fn claimed(claim: KeyClaim) -> Result<ClaimToken, Refused> {
    match claim {
        KeyClaim::New(token) => Ok(token),
        KeyClaim::InFlight => Err(Refused::Rejected(IdempotencyRejection::InFlight)),
        KeyClaim::Mismatch => Err(Refused::Rejected(IdempotencyRejection::Mismatch)),
        KeyClaim::Completed(stored) => Err(Refused::Replay(stored)),
    }
}

/// The open transaction and the claim's token when this request holds the key.
pub(crate) fn claimed_in_transaction<T>(claim: TxClaim<T>) -> Result<(T, ClaimToken), Refused> {
    match claim {
        TxClaim::New { tx, token } => Ok((tx, token)),
        TxClaim::InFlight => Err(Refused::Rejected(IdempotencyRejection::InFlight)),
        TxClaim::Mismatch => Err(Refused::Rejected(IdempotencyRejection::Mismatch)),
        TxClaim::Completed(stored) => Err(Refused::Replay(stored)),
    }
}

/// The response headers stored and replayed.
const REPLAYED_HEADERS: &[HeaderName] = &[header::CONTENT_TYPE, header::LOCATION];

fn response_of(stored: StoredResponse) -> Response {
    let mut resp = Response::new(Body::from(stored.body));
    *resp.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers: &mut HeaderMap = resp.headers_mut();
    for (k, v) in stored.headers {
        if let (Ok(k), Ok(v)) = (HeaderName::try_from(k), HeaderValue::try_from(v)) {
            headers.append(k, v);
        }
    }
    resp
}

/// A stored response, marked `Idempotent-Replayed: true`.
pub(crate) fn replay(stored: StoredResponse) -> Response {
    let mut resp = response_of(stored);
    resp.headers_mut().insert(
        HeaderName::from_static(IDEMPOTENT_REPLAYED),
        HeaderValue::from_static("true"),
    );
    resp
}

/// What to do with the handler's response: a pure decision.
pub(crate) enum Decision {
    /// A 5xx: release the key and answer this.
    Release(Response),
    /// The effect happened: store `stored` and answer `answer` (`omitted`: why the body is not
    /// stored, in which case the answer has no body either, like the replays).
    Store {
        stored: StoredResponse,
        answer: Response,
        omitted: Option<axum::Error>,
    },
}

/// A [`Decision`] once an omitted body is counted.
pub(crate) enum Noted {
    /// Release the key and answer this.
    Release(Response),
    /// Store the response and answer the second.
    Store(StoredResponse, Response),
}

impl Decision {
    /// What to do, with an omitted body counted and logged.
    pub(crate) fn noted(self, counters: &Counters) -> Noted {
        match self {
            Decision::Release(resp) => Noted::Release(resp),
            Decision::Store {
                stored,
                answer,
                omitted,
            } => {
                note_omitted(counters, omitted, stored.status);
                Noted::Store(stored, answer)
            }
        }
    }
}

/// Counts and logs a response stored without its body.
fn note_omitted(counters: &Counters, omitted: Option<axum::Error>, status: u16) {
    if let Some(e) = omitted {
        counters.body_omitted();
        tracing::error!(error = %e, status, "the response body could not be stored; the status is stored and replayed with an empty body");
    }
}

/// What to do with the handler's response head `parts` and buffered `body`.
pub(crate) fn decide(
    mut parts: axum::http::response::Parts,
    body: Result<Bytes, axum::Error>,
) -> Decision {
    if parts.status.is_server_error() {
        let body = body.unwrap_or_default();
        return Decision::Release(Response::from_parts(parts, Body::from(body)));
    }
    let (body, omitted) = match body {
        Ok(body) => (body, None),
        Err(e) => {
            mark_omitted(&mut parts.headers);
            (Bytes::new(), Some(e))
        }
    };
    let kept = |h: &HeaderName| {
        parts
            .headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .map(|v| (h.as_str().to_owned(), v.to_owned()))
    };
    let mut headers: Vec<(String, String)> = REPLAYED_HEADERS.iter().filter_map(kept).collect();
    if omitted.is_some() {
        headers.push((IDEMPOTENT_BODY_OMITTED.to_owned(), "true".to_owned()));
    }
    let stored = StoredResponse {
        status: parts.status.as_u16(),
        headers,
        body: body.to_vec(),
    };
    Decision::Store {
        stored,
        answer: Response::from_parts(parts, Body::from(body)),
        omitted,
    }
}

/// Drops the body's headers and says why the body is empty.
fn mark_omitted(headers: &mut HeaderMap) {
    for h in [
        header::CONTENT_TYPE,
        header::CONTENT_LENGTH,
        header::TRANSFER_ENCODING,
    ] {
        headers.remove(h);
    }
    headers.insert(
        HeaderName::from_static(IDEMPOTENT_BODY_OMITTED),
        HeaderValue::from_static("true"),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(status: u16) -> axum::http::response::Parts {
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .header("x-request-id", "r-1")
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn a_success_is_stored_and_answered_with_all_its_headers() {
        let Decision::Store {
            stored,
            answer,
            omitted,
        } = decide(parts(201), Ok(Bytes::from_static(b"{}")))
        else {
            panic!("a 201 must be stored");
        };
        assert!(omitted.is_none());
        assert_eq!(stored.body, b"{}");
        assert_eq!(
            stored.headers,
            [("content-type".to_owned(), "application/json".to_owned())]
        );
        assert_eq!(
            answer.headers()["x-request-id"],
            "r-1",
            "the first answer is whole"
        );
    }

    #[test]
    fn a_success_whose_body_failed_is_stored_as_its_status_with_the_marker() {
        let Decision::Store {
            stored,
            answer,
            omitted,
        } = decide(parts(200), Err(axum::Error::new("length limit exceeded")))
        else {
            panic!("a 200 must be stored, never released");
        };
        assert!(omitted.is_some());
        assert_eq!((stored.status, stored.body.len()), (200, 0));
        assert_eq!(
            stored.headers,
            [(IDEMPOTENT_BODY_OMITTED.to_owned(), "true".to_owned())]
        );
        assert_eq!(answer.headers()[IDEMPOTENT_BODY_OMITTED], "true");
        assert!(answer.headers().get(header::CONTENT_TYPE).is_none());
    }

    #[test]
    fn only_a_server_error_releases_the_key() {
        assert!(matches!(
            decide(parts(503), Ok(Bytes::new())),
            Decision::Release(_)
        ));
        assert!(matches!(
            decide(parts(500), Err(axum::Error::new("stream failed"))),
            Decision::Release(_)
        ));
        for status in [200, 201, 301, 404, 409, 422, 429] {
            assert!(
                matches!(
                    decide(parts(status), Ok(Bytes::new())),
                    Decision::Store { .. }
                ),
                "{status}"
            );
        }
    }

    #[test]
    fn the_scope_is_the_client_and_the_credential_only_on_opt_in() {
        let auth = HeaderValue::from_static("Bearer t");
        let client = ClientScope("a".to_owned());
        let src = ScopeSource::ClientScope;
        assert_eq!(scope(Some(&client), Some(&auth), src).unwrap(), "client:a");
        assert!(matches!(
            scope(None, Some(&auth), src),
            Err(IdempotencyRejection::NoScope)
        ));
        assert!(matches!(
            scope(None, None, src),
            Err(IdempotencyRejection::NoClient)
        ));
        let opt_in = ScopeSource::ClientScopeOrCredential;
        assert!(
            scope(None, Some(&auth), opt_in)
                .unwrap()
                .starts_with("credential:")
        );
    }

    #[test]
    fn a_claim_executes_only_when_new_and_a_completed_one_replays() {
        let stored = StoredResponse {
            status: 201,
            headers: vec![],
            body: b"{}".to_vec(),
        };
        assert!(claimed(KeyClaim::InFlight).is_err());
        assert!(matches!(
            claimed(KeyClaim::Mismatch),
            Err(Refused::Rejected(IdempotencyRejection::Mismatch))
        ));
        let Err(refused) = claimed(KeyClaim::Completed(stored)) else {
            panic!("a completed key is not executed again");
        };
        let counters = Counters::default();
        let answer = refused.answer(&counters).unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED);
        assert_eq!(answer.headers()[IDEMPOTENT_REPLAYED], "true");
    }
}
