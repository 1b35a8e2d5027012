//! Remotes that do not honour `Idempotency-Key`: the status probe, the unknown-outcome state and
//! the compensation hook.
//!
//! Sending the same key twice is safe only when the remote stores keys. For a remote that
//! ignores them, a second request after an ambiguous first one (a timeout, a reset connection, a
//! 5xx) may apply the effect twice. The dispatcher therefore never blindly re-sends to such a
//! remote:
//!
//! * With a [`StatusProbe`], every attempt after the first asks the remote whether the effect
//!   already happened ([`Probe::Applied`] → done, nothing sent; [`Probe::NotApplied`] → sent;
//!   [`Probe::Unknown`] → the intent enters the *unknown* state; [`Probe::Unavailable`] →
//!   asked again later). The first re-attempt waits [`EffectPolicy::settle`] so that a request
//!   still being processed by the remote has finished before the probe looks: after a
//!   recorded ambiguous outcome, and after a send whose dispatcher died (the sending mark
//!   keeps every attempt from claiming the intent before `settle` from the send, however soon
//!   the lease ends).
//! * Without a probe, an ambiguous failure puts the intent in the *unknown* state at once:
//!   `idem effects stuck` lists it, and a person (or a [`Compensation`]) settles it.
//! * Every request is preceded by a committed sending mark; an attempt that died after it (a
//!   crash, a lost lease) leaves it, and the next attempt treats it like an ambiguous failure:
//!   the probe decides, or the intent becomes *unknown*. Nothing is re-sent blindly.
//! * A [`Compensation`] undoes whatever an unknown attempt may have done (it must itself be
//!   safe to run when nothing happened — "reverse the award of payment P if there is one").
//!   After it succeeds the intent is parked for review, or sent again on request.
//!
//! **The window that remains**: a probe can only see what the remote has finished. A request
//! that the remote keeps processing for longer than `settle` (or a probe answered from a stale
//! replica) can be reported as not applied and then be applied next to the re-sent one. Choose
//! `settle` above the remote's longest processing time; reconciliation (`idem verify`) is the
//! backstop that finds what slips through.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use idem_core::idempotency::{ClaimedIntent, IdempotencyKey, KeyError};

/// A boxed future (the probe and compensation traits are used as trait objects).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a status probe found out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The effect already happened: the intent is done with this response.
    Applied {
        /// Status to record.
        status: u16,
        /// Body to record.
        body: String,
    },
    /// The effect did not happen: sending it is safe.
    NotApplied,
    /// The remote answered but cannot tell: the intent enters the unknown state.
    Unknown {
        /// Why.
        reason: String,
    },
    /// The probe could not reach the remote: ask again later.
    Unavailable {
        /// Why.
        reason: String,
    },
}

/// Asks the remote whether an intent's effect already happened.
pub trait StatusProbe: Send + Sync + 'static {
    /// Probes for `intent`.
    fn probe<'a>(
        &'a self,
        client: &'a reqwest::Client,
        intent: &'a ClaimedIntent,
    ) -> BoxFuture<'a, Probe>;
}

/// Undoes whatever an intent's unknown attempts may have done. It must be safe to run when the
/// effect never happened, and safe to run twice.
pub trait Compensation: Send + Sync + 'static {
    /// Compensates `intent`: `Ok` carries a note for the intent's reason, `Err` why it could
    /// not.
    fn compensate<'a>(
        &'a self,
        client: &'a reqwest::Client,
        intent: &'a ClaimedIntent,
    ) -> BoxFuture<'a, Result<String, CompensationError>>;
}

/// Why a URL template could not be filled from an intent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TemplateError {
    /// A `{` without its `}`.
    #[error("unclosed '{{' in URL template {template:?}")]
    Unclosed {
        /// The template.
        template: String,
    },
    /// The body has no string or number field of that name.
    #[error("the intent body has no string or number field {field:?} for the URL template")]
    MissingField {
        /// The field the template names.
        field: String,
    },
}

/// Why a [`Compensation`] could not compensate; the intent is left as it was.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CompensationError {
    /// Its URL could not be built.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// Its key could not be built (an effect name too long for a key).
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The request got no answer.
    #[error("compensation {url}: {source}")]
    Request {
        /// Where it was sent.
        url: String,
        /// The client's error.
        #[source]
        source: reqwest::Error,
    },
    /// The remote answered with a status that does not mean compensated.
    #[error("compensation {url} answered {status}: {body}")]
    Refused {
        /// Where it was sent.
        url: String,
        /// The status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// A compensation of one's own failed for this reason.
    #[error("{0}")]
    Other(String),
}

/// How the dispatcher treats one effect's remote.
#[derive(Clone, Default)]
pub struct EffectPolicy {
    /// The remote does not store `Idempotency-Key`: an ambiguous failure is never blindly
    /// re-sent.
    pub remote_ignores_keys: bool,
    /// Asked before every attempt after the first.
    pub probe: Option<Arc<dyn StatusProbe>>,
    /// Run by [`crate::Dispatcher::compensate`] on an unknown or parked intent.
    pub compensation: Option<Arc<dyn Compensation>>,
    /// Shortest wait between an ambiguous attempt, or a send whose outcome was never recorded,
    /// and the probe that follows it.
    pub settle: Duration,
}

impl std::fmt::Debug for EffectPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EffectPolicy")
            .field("remote_ignores_keys", &self.remote_ignores_keys)
            .field("probe", &self.probe.is_some())
            .field("compensation", &self.compensation.is_some())
            .field("settle", &self.settle)
            .finish()
    }
}

/// Policies by effect name.
pub(crate) type Policies = HashMap<String, EffectPolicy>;

/// Fills a URL template: `{key}`, `{event_id}`, `{effect}` and `{field}` for a top-level string
/// or number field of the intent's body (percent-encoded). The error names the missing field.
pub fn fill_template(template: &str, intent: &ClaimedIntent) -> Result<String, TemplateError> {
    let mut out = String::with_capacity(template.len() + 32);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let close = after.find('}').ok_or_else(|| TemplateError::Unclosed {
            template: template.to_owned(),
        })?;
        let name = &after[..close];
        let value = match name {
            "key" => intent.key.as_str().to_owned(),
            "event_id" => intent.intent.event_id.to_string(),
            "effect" => intent.intent.effect.clone(),
            field => match intent.intent.body.get(field) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Number(n)) => n.to_string(),
                _ => {
                    return Err(TemplateError::MissingField {
                        field: field.to_owned(),
                    });
                }
            },
        };
        out.push_str(&percent_encode(&value));
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// When a `200` answer of an [`HttpStatusProbe`] means "applied". Anything the condition does
/// not name is [`Probe::Unknown`] (the intent enters the unknown state), never applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AppliedWhen {
    /// The body is a JSON array: non-empty → applied, `[]` → not applied (the reference points
    /// API's `GET /awards/by-payment/{payment_id}`). Any other body → unknown.
    NonEmptyArray,
    /// The value at this JSON pointer (RFC 6901, e.g. `/awards` or `/applied`): `[]`, `{}`,
    /// `null`, `false`, `0` or `""` → not applied; any other value → applied; no value there →
    /// unknown.
    Pointer(String),
}

/// Judges a `200` probe body by `rule`.
pub fn judge_probe_body(body: &str, rule: &AppliedWhen) -> Result<bool, String> {
    let value: serde_json::Value =
        serde_json::from_str(body).map_err(|e| format!("the answer is not JSON ({e})"))?;
    match rule {
        AppliedWhen::NonEmptyArray => match value {
            serde_json::Value::Array(a) => Ok(!a.is_empty()),
            _ => Err("the answer is not a JSON array (configure the applied condition with a JSON pointer)".to_owned()),
        },
        AppliedWhen::Pointer(p) => {
            let v = value
                .pointer(p)
                .ok_or_else(|| format!("the answer has no value at {p:?}"))?;
            Ok(!is_empty_value(v))
        }
    }
}

fn is_empty_value(v: &serde_json::Value) -> bool {
    use serde_json::Value;
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::Bool(true) => false,
    }
}

/// A probe that GETs a URL built from a template ([`fill_template`]): `200` whose body meets
/// the [`AppliedWhen`] condition → applied, fails it explicitly → not applied, anything else →
/// unknown; `404` → not applied; another 4xx → unknown; 5xx, 429 or no answer → unavailable.
#[derive(Clone)]
pub struct HttpStatusProbe {
    template: String,
    authorization: Option<String>,
    applied_when: AppliedWhen,
}

impl std::fmt::Debug for HttpStatusProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpStatusProbe")
            .field("template", &self.template)
            .field(
                "authorization",
                &self.authorization.as_ref().map(|_| "<redacted>"),
            )
            .field("applied_when", &self.applied_when)
            .finish()
    }
}

impl HttpStatusProbe {
    /// A probe of `template`, for example
    /// `http://127.0.0.1:8088/awards/by-payment/{payment_id}`, whose answer is a JSON array
    /// ([`AppliedWhen::NonEmptyArray`]).
    pub fn new(template: impl Into<String>, authorization: Option<String>) -> Self {
        HttpStatusProbe {
            template: template.into(),
            authorization,
            applied_when: AppliedWhen::NonEmptyArray,
        }
    }

    /// The same probe with another applied condition.
    pub fn applied_when(mut self, rule: AppliedWhen) -> Self {
        self.applied_when = rule;
        self
    }
}

impl StatusProbe for HttpStatusProbe {
    fn probe<'a>(
        &'a self,
        client: &'a reqwest::Client,
        intent: &'a ClaimedIntent,
    ) -> BoxFuture<'a, Probe> {
        Box::pin(async move {
            let url = match fill_template(&self.template, intent) {
                Ok(u) => u,
                Err(e) => {
                    return Probe::Unknown {
                        reason: e.to_string(),
                    };
                }
            };
            let mut req = client.get(&url);
            if let Some(a) = &self.authorization {
                req = req.header("authorization", a);
            }
            let resp = match req.send().await {
                Ok(r) => r,
                // A failed handshake fails again on every attempt: the probe cannot tell, and a
                // person must fix the certificates (not an endless retry).
                Err(e) if crate::tls::tls_failure(&e, e.is_connect(), false).is_some() => {
                    let failure = crate::tls::tls_failure(&e, e.is_connect(), false);
                    return Probe::Unknown {
                        reason: format!(
                            "status probe {url}: its TLS handshake failed ({}): fix the \
                             certificates (see docs/integrating/https-remotes.md)",
                            failure.map_or("tls", |f| f.label())
                        ),
                    };
                }
                Err(e) => {
                    return Probe::Unavailable {
                        reason: format!("status probe {url}: {e}"),
                    };
                }
            };
            let status = resp.status().as_u16();
            let body = resp.text().await.unwrap_or_default();
            match status {
                404 => Probe::NotApplied,
                200 => match judge_probe_body(&body, &self.applied_when) {
                    Ok(true) => Probe::Applied { status, body },
                    Ok(false) => Probe::NotApplied,
                    Err(why) => Probe::Unknown {
                        reason: format!("status probe {url} answered 200 but {why}"),
                    },
                },
                429 | 500..=599 => Probe::Unavailable {
                    reason: format!("status probe {url} answered {status}"),
                },
                _ => Probe::Unknown {
                    reason: format!(
                        "status probe {url} answered {status}: {}",
                        body.chars().take(200).collect::<String>()
                    ),
                },
            }
        })
    }
}

/// A compensation that POSTs the intent's body to a URL template ([`fill_template`]) with its
/// own stable key, `event-<event id>-<effect>.compensate`: a 2xx (or a 404, nothing to undo)
/// means compensated.
#[derive(Clone)]
pub struct HttpCompensation {
    template: String,
    authorization: Option<String>,
}

impl std::fmt::Debug for HttpCompensation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpCompensation")
            .field("template", &self.template)
            .field(
                "authorization",
                &self.authorization.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl HttpCompensation {
    /// A compensation posting to `template`, for example
    /// `http://127.0.0.1:8088/awards/by-payment/{payment_id}/reversal`.
    pub fn new(template: impl Into<String>, authorization: Option<String>) -> Self {
        HttpCompensation {
            template: template.into(),
            authorization,
        }
    }
}

/// The key of an intent's compensation: `event-<event id>-<effect>.compensate`.
pub fn compensation_key(intent: &ClaimedIntent) -> Result<IdempotencyKey, KeyError> {
    let effect = format!("{}.compensate", intent.intent.effect);
    IdempotencyKey::for_effect(intent.intent.event_id, &effect)
}

impl Compensation for HttpCompensation {
    fn compensate<'a>(
        &'a self,
        client: &'a reqwest::Client,
        intent: &'a ClaimedIntent,
    ) -> BoxFuture<'a, Result<String, CompensationError>> {
        Box::pin(async move {
            let url = fill_template(&self.template, intent)?;
            let key = compensation_key(intent)?;
            let mut req = client
                .post(&url)
                .header(
                    idem_core::idempotency::IDEMPOTENCY_KEY_HEADER,
                    key.header_value(),
                )
                .json(&intent.intent.body);
            if let Some(a) = &self.authorization {
                req = req.header("authorization", a);
            }
            let resp = match req.send().await {
                Ok(resp) => resp,
                Err(source) => return Err(CompensationError::Request { url, source }),
            };
            let status = resp.status().as_u16();
            let body = resp.text().await.unwrap_or_default();
            let body: String = body.chars().take(200).collect();
            match status {
                200..=299 => Ok(format!("compensated by {url}: {status} {body}")),
                404 => Ok(format!("nothing to compensate at {url}: 404 {body}")),
                _ => Err(CompensationError::Refused { url, status, body }),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::EventId;
    use idem_core::idempotency::EffectIntent;

    fn claimed() -> ClaimedIntent {
        let event_id: EventId = "7f1d0c7e-0000-7000-8000-000000010042".parse().unwrap();
        let intent = EffectIntent {
            event_id,
            effect: "points.award".into(),
            target: "http://127.0.0.1:1/awards".into(),
            body: serde_json::json!({"payment_id": "pay 1/2", "points": 12, "nested": {}}),
            traceparent: None,
        };
        ClaimedIntent {
            id: 1,
            key: intent.key().unwrap(),
            intent,
            attempt: 2,
            unrecorded_send: None,
        }
    }

    #[test]
    fn probe_bodies_are_applied_only_by_the_explicit_condition() {
        let arr = AppliedWhen::NonEmptyArray;
        assert_eq!(judge_probe_body(r#"[{"award_id":1}]"#, &arr), Ok(true));
        assert_eq!(judge_probe_body("[]", &arr), Ok(false));
        assert!(
            judge_probe_body(r#"{"awards":[]}"#, &arr).is_err(),
            "an object says nothing"
        );
        assert!(judge_probe_body("not json", &arr).is_err());
        let ptr = AppliedWhen::Pointer("/awards".into());
        assert_eq!(judge_probe_body(r#"{"awards":[1]}"#, &ptr), Ok(true));
        for empty in [
            r#"{"awards":[]}"#,
            r#"{"awards":null}"#,
            r#"{"awards":0}"#,
            r#"{"awards":false}"#,
        ] {
            assert_eq!(judge_probe_body(empty, &ptr), Ok(false), "{empty}");
        }
        assert!(
            judge_probe_body(r#"{"other":1}"#, &ptr).is_err(),
            "no value there"
        );
    }

    #[test]
    fn templates_fill_fields_and_encode_them() {
        let c = claimed();
        assert_eq!(
            fill_template("http://h/awards/by-payment/{payment_id}?p={points}", &c).unwrap(),
            "http://h/awards/by-payment/pay%201%2F2?p=12"
        );
        assert_eq!(
            fill_template("http://h/{key}", &c).unwrap(),
            "http://h/event-7f1d0c7e-0000-7000-8000-000000010042-points.award"
        );
        assert!(
            fill_template("http://h/{nested}", &c)
                .unwrap_err()
                .to_string()
                .contains("nested")
        );
        assert!(fill_template("http://h/{oops", &c).is_err());
        assert_eq!(
            compensation_key(&c).unwrap().as_str(),
            "event-7f1d0c7e-0000-7000-8000-000000010042-points.award.compensate"
        );
    }
}
