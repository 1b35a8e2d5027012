//! Pure decisions of the dispatcher: what an answer (or its absence) means for an intent, how
//! long to wait, whether a lease still allows a request. No I/O here; the dispatcher
//! ([`crate::Dispatcher`]) does the sending and recording around these functions.

use std::time::Duration;

use idem_core::backoff::Backoff;
use idem_core::idempotency::{ClaimedIntent, IntentOutcome};

use crate::DispatcherConfig;
use crate::remote::{EffectPolicy, Probe};
use crate::tls::TlsFailure;

/// Why an intent was parked for a person.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParkKind {
    /// 422: the remote says the key was used with a different request (an idempotency
    /// conflict, counted by `idem_idempotency_conflict_total`).
    Conflict,
    /// Another 4xx: the remote refused the request.
    Refused,
    /// The remote kept answering 409 or 429 until the last allowed attempt
    /// ([`DispatcherConfig::busy_attempts`]).
    Busy,
    /// The TLS handshake failed ([`TlsFailure`]): the remote's certificate is not trusted,
    /// expired or for another name, the remote wants a client certificate, or it does not
    /// speak TLS. Retrying cannot help until a person changes the certificates; the remote did
    /// not process the request.
    Tls(TlsFailure),
}

/// How an attempt ended, as the dispatcher classified it: an [`IntentOutcome`] that also says
/// why a parked intent was parked. Stored as the [`IntentOutcome`] it converts into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// 2xx (or a probe found the effect applied): done; keep the response.
    Done {
        /// HTTP status.
        status: u16,
        /// Response body (text).
        body: String,
    },
    /// Try again after `after`, with the same key.
    Retry {
        /// Wait this long.
        after: Duration,
        /// Why.
        reason: String,
    },
    /// Stop: a person must look.
    Park {
        /// Why it was parked, as a type.
        kind: ParkKind,
        /// Why, for the person.
        reason: String,
    },
    /// Nobody can tell whether the effect happened (a remote without keys, no probe answer).
    Unknown {
        /// Why.
        reason: String,
    },
}

impl From<Verdict> for IntentOutcome {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Done { status, body } => IntentOutcome::Done { status, body },
            Verdict::Retry { after, reason } => IntentOutcome::Retry { after, reason },
            Verdict::Park { reason, .. } => IntentOutcome::Park { reason },
            Verdict::Unknown { reason } => IntentOutcome::Unknown { reason },
        }
    }
}

/// What came back from sending one request: an answer, or a failure before any answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The remote answered.
    Answered {
        /// HTTP status.
        status: u16,
        /// Response body (text; empty when it could not be read).
        body: String,
        /// The `Retry-After` the remote sent, in seconds form.
        retry_after: Option<Duration>,
    },
    /// No answer.
    Failed {
        /// The request timed out (it may have been applied).
        timed_out: bool,
        /// The connection was refused (the request never reached the remote).
        connect: bool,
        /// The client's error, for the reason.
        error: String,
    },
    /// The TLS handshake failed in a way only a person can fix (decided by
    /// [`crate::tls_failure`]): the remote did not process the request.
    Tls(TlsFailure),
}

/// What a status probe found, as the `result` label of `idem_effect_probe_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeResult {
    /// [`Probe::Applied`].
    Applied,
    /// [`Probe::NotApplied`].
    NotApplied,
    /// [`Probe::Unknown`].
    Unknown,
    /// [`Probe::Unavailable`].
    Unavailable,
}

impl ProbeResult {
    /// The metric label (`applied`, `not_applied`, `unknown`, `unavailable`).
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeResult::Applied => "applied",
            ProbeResult::NotApplied => "not_applied",
            ProbeResult::Unknown => "unknown",
            ProbeResult::Unavailable => "unavailable",
        }
    }
}

fn first_200(body: &str) -> String {
    body.chars().take(200).collect()
}

/// Maps an HTTP status to a verdict (body and `Retry-After` supplied by the caller).
pub fn classify(
    status: u16,
    body: String,
    retry_after: Option<Duration>,
    backoff: Duration,
) -> Verdict {
    match status {
        200..=299 => Verdict::Done { status, body },
        // A refusal backs off exponentially even when the remote asks for less (`Retry-After:
        // 1` from a key still locked by a request that died): the attempt bound of
        // `bound_busy` then spans minutes, longer than a remote's key lock.
        409 => Verdict::Retry {
            after: retry_after
                .unwrap_or(Duration::ZERO)
                .max(backoff)
                .max(Duration::from_secs(1)),
            reason: "409: the remote is still processing this key".to_owned(),
        },
        429 => Verdict::Retry {
            after: retry_after.unwrap_or(Duration::ZERO).max(backoff),
            reason: format!("429: {}", first_200(&body)),
        },
        500..=599 => Verdict::Retry {
            after: retry_after.unwrap_or(backoff),
            reason: format!("{status}: {}", first_200(&body)),
        },
        422 => Verdict::Park {
            kind: ParkKind::Conflict,
            reason: format!(
                "422: the remote says this key was used with a different request: {}",
                first_200(&body)
            ),
        },
        _ => Verdict::Park {
            kind: ParkKind::Refused,
            reason: format!("{status}: {}", first_200(&body)),
        },
    }
}

/// Bounds the retries of a remote that keeps refusing: a 409 or 429 on attempt `attempt` or
/// later (`busy_attempts`) parks the intent for a person, with the reason.
pub fn bound_busy(verdict: Verdict, status: u16, attempt: i32, busy_attempts: i32) -> Verdict {
    match verdict {
        Verdict::Retry { reason, .. }
            if matches!(status, 409 | 429) && attempt >= busy_attempts =>
        {
            Verdict::Park {
                kind: ParkKind::Busy,
                reason: format!(
                    "{reason} (answered {status} on attempt {attempt}, the last one allowed): \
                     check the remote, then `idem effects retry --id` sends it again with the same key"
                ),
            }
        }
        verdict => verdict,
    }
}

/// The verdict of one request of attempt `attempt` and whether it is ambiguous (the remote may
/// have applied it: a 5xx, a timeout, a connection lost after it was made).
pub fn classify_reply(reply: Reply, attempt: i32, config: &DispatcherConfig) -> (Verdict, bool) {
    let backoff = backoff_after(config, attempt);
    match reply {
        Reply::Answered {
            status,
            body,
            retry_after,
        } => {
            let verdict = classify(status, body, retry_after, backoff);
            // A 5xx may come after the remote applied the effect; a 429 is a refusal.
            (
                bound_busy(verdict, status, attempt, config.busy_attempts),
                status >= 500,
            )
        }
        Reply::Failed {
            timed_out,
            connect,
            error,
        } => (
            Verdict::Retry {
                after: backoff,
                reason: if timed_out {
                    "timed out: the effect may have happened; retrying with the same key".to_owned()
                } else {
                    format!("request failed: {error}")
                },
            },
            // A refused connection never reached the remote.
            !connect,
        ),
        // Parking is safe: `tls_failure` reports only failures before the request was written
        // (the handshake did not complete) and the TLS 1.3 refusal of a client certificate,
        // which the remote's TLS layer decides before it reads the request. Retrying is
        // useless: the same certificates meet the same refusal, after every backoff.
        Reply::Tls(failure) => (
            Verdict::Park {
                reason: failure.reason(),
                kind: ParkKind::Tls(failure),
            },
            false,
        ),
    }
}

/// An ambiguous retry to a remote that ignores keys is never re-sent blindly: with a probe the
/// next attempt asks it first (after `settle`), without one the intent becomes unknown.
pub fn guard_keyless(verdict: Verdict, ambiguous: bool, policy: Option<&EffectPolicy>) -> Verdict {
    match (verdict, policy) {
        (Verdict::Retry { after, reason }, Some(p)) if ambiguous && p.remote_ignores_keys => {
            if p.probe.is_some() {
                Verdict::Retry {
                    after: after.max(p.settle),
                    reason: format!(
                        "{reason}; the remote ignores keys: the next attempt asks the status probe first"
                    ),
                }
            } else {
                Verdict::Unknown {
                    reason: format!(
                        "{reason}; the remote ignores keys and no status probe is configured, so \
                         re-sending could apply the effect twice: check the remote, then \
                         `idem effects resolve`"
                    ),
                }
            }
        }
        (verdict, _) => verdict,
    }
}

/// What a probe's finding means for the attempt: `Some` ends it without sending (`retry_wait`
/// is the wait when the probe was unavailable).
pub fn probe_verdict(found: Probe, retry_wait: Duration) -> (ProbeResult, Option<Verdict>) {
    match found {
        Probe::Applied { status, body } => {
            (ProbeResult::Applied, Some(Verdict::Done { status, body }))
        }
        Probe::NotApplied => (ProbeResult::NotApplied, None),
        Probe::Unknown { reason } => (
            ProbeResult::Unknown,
            Some(Verdict::Unknown {
                reason: format!(
                    "the status probe cannot tell whether the effect happened: {reason}"
                ),
            }),
        ),
        Probe::Unavailable { reason } => (
            ProbeResult::Unavailable,
            Some(Verdict::Retry {
                after: retry_wait,
                reason: format!("not sent: the status probe is unavailable: {reason}"),
            }),
        ),
    }
}

/// The wait after a failed attempt `attempt`: `retry_backoff` doubling per attempt, at most
/// `retry_backoff_max`.
pub fn backoff_after(config: &DispatcherConfig, attempt: i32) -> Duration {
    Backoff::new(config.retry_backoff, config.retry_backoff_max)
        .after(u32::try_from(attempt).unwrap_or(0))
}

/// Is there enough lease left (`left`) to start a request that may take `timeout`?
pub fn lease_allows_send(left: Duration, timeout: Duration, margin: Duration) -> bool {
    left >= timeout.saturating_add(margin)
}

/// `None` when a request that may take `timeout` can start with `left` of the lease; otherwise
/// the verdict that gives the intent back for a later claim.
pub fn lease_verdict(left: Duration, timeout: Duration, margin: Duration) -> Option<Verdict> {
    if lease_allows_send(left, timeout, margin) {
        return None;
    }
    Some(Verdict::Retry {
        after: Duration::ZERO,
        reason: format!(
            "not sent: {left:?} of the lease was left, less than the timeout plus the margin"
        ),
    })
}

/// What a re-attempt to a remote that ignores keys must do before anything is sent, decided
/// from the stored intent alone: `Some(unknown)` when an earlier attempt was sent, its outcome
/// never recorded, and no probe can tell whether it was applied.
pub fn predecessor_outcome(c: &ClaimedIntent, policy: Option<&EffectPolicy>) -> Option<Verdict> {
    if !policy.is_some_and(|p| p.remote_ignores_keys && p.probe.is_none()) {
        return None;
    }
    let sent = c.unrecorded_send?;
    Some(Verdict::Unknown {
        reason: format!(
            "attempt {sent} was sent to a remote that ignores keys and its outcome was never \
             recorded (the dispatcher died or lost its lease); no status probe is configured, so \
             re-sending could apply the effect twice: check the remote, then `idem effects resolve`"
        ),
    })
}

/// The wait before the next claim of [`crate::Dispatcher::run`] and the idle wait after it:
/// none after a claim that found intents, otherwise the idle wait doubled up to `max`.
pub fn next_wait(
    claimed: usize,
    idle: Duration,
    min: Duration,
    max: Duration,
) -> (Duration, Duration) {
    if claimed > 0 {
        (Duration::ZERO, min)
    } else {
        let idle = Backoff::new(min, max).next(idle);
        (idle, idle)
    }
}

/// The `host:port` label of a target URL (`invalid` when it is not one).
pub fn host(target: &str) -> String {
    reqwest::Url::parse(target)
        .ok()
        .and_then(|u| {
            u.host_str()
                .map(|h| format!("{h}:{}", u.port_or_known_default().unwrap_or(0)))
        })
        .unwrap_or_else(|| "invalid".to_owned())
}

/// The `Retry-After` header value in seconds, at most an hour (dates are ignored).
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    value
        .trim()
        .parse::<u64>()
        .ok()
        .map(|s| Duration::from_secs(s.min(3600)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_by_status() {
        let b = Duration::from_millis(200);
        assert!(matches!(
            classify(201, "{}".into(), None, b),
            Verdict::Done { status: 201, .. }
        ));
        assert_eq!(
            classify(409, String::new(), None, b),
            Verdict::Retry {
                after: Duration::from_secs(1),
                reason: "409: the remote is still processing this key".into()
            }
        );
        assert!(
            matches!(classify(503, String::new(), Some(Duration::from_secs(7)), b), Verdict::Retry { after, .. } if after == Duration::from_secs(7))
        );
        assert!(
            matches!(classify(429, String::new(), None, b), Verdict::Retry { after, .. } if after == b)
        );
        let long = Duration::from_secs(8);
        assert!(
            matches!(classify(409, String::new(), Some(Duration::from_secs(1)), long), Verdict::Retry { after, .. } if after == long),
            "a short Retry-After does not cut the backoff of a refusal"
        );
        assert!(
            matches!(classify(422, String::new(), None, b), Verdict::Park { kind: ParkKind::Conflict, reason } if reason.starts_with("422"))
        );
        assert!(matches!(
            classify(404, String::new(), None, b),
            Verdict::Park {
                kind: ParkKind::Refused,
                ..
            }
        ));
    }

    #[test]
    fn refusals_are_bounded_and_leases_checked() {
        let retry = || classify(409, String::new(), None, Duration::ZERO);
        assert!(matches!(
            bound_busy(retry(), 409, 19, 20),
            Verdict::Retry { .. }
        ));
        assert!(
            matches!(bound_busy(retry(), 409, 20, 20), Verdict::Park { kind: ParkKind::Busy, reason } if reason.starts_with("409"))
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
        assert_eq!(lease_verdict(Duration::from_secs(11), t, m), None);
        assert!(matches!(
            lease_verdict(Duration::from_secs(1), t, m),
            Some(Verdict::Retry {
                after: Duration::ZERO,
                ..
            })
        ));
    }

    #[test]
    fn replies_are_ambiguous_unless_refused_before_reaching_the_remote() {
        let config = DispatcherConfig::default();
        let answered = |status| Reply::Answered {
            status,
            body: String::new(),
            retry_after: None,
        };
        assert!(!classify_reply(answered(200), 1, &config).1);
        assert!(!classify_reply(answered(429), 1, &config).1, "a refusal");
        assert!(classify_reply(answered(503), 1, &config).1);
        let failed = |timed_out, connect| Reply::Failed {
            timed_out,
            connect,
            error: "boom".into(),
        };
        let (v, ambiguous) = classify_reply(failed(true, false), 3, &config);
        assert!(ambiguous);
        assert_eq!(
            v,
            Verdict::Retry {
                after: backoff_after(&config, 3),
                reason: "timed out: the effect may have happened; retrying with the same key"
                    .into()
            }
        );
        let (v, ambiguous) = classify_reply(failed(false, true), 1, &config);
        assert!(!ambiguous, "a refused connection never reached the remote");
        assert!(matches!(v, Verdict::Retry { reason, .. } if reason == "request failed: boom"));
        let (v, _) = classify_reply(answered(409), config.busy_attempts, &config);
        assert!(matches!(
            v,
            Verdict::Park {
                kind: ParkKind::Busy,
                ..
            }
        ));
    }

    #[test]
    fn a_tls_failure_parks_at_once_and_is_not_ambiguous() {
        let config = DispatcherConfig::default();
        let failure = TlsFailure::UnknownIssuer;
        let (v, ambiguous) = classify_reply(Reply::Tls(failure.clone()), 1, &config);
        assert!(!ambiguous, "the remote did not process the request");
        assert_eq!(
            v,
            Verdict::Park {
                reason: failure.reason(),
                kind: ParkKind::Tls(failure),
            }
        );
        let keyless = EffectPolicy {
            remote_ignores_keys: true,
            ..EffectPolicy::default()
        };
        assert!(
            matches!(
                guard_keyless(v, ambiguous, Some(&keyless)),
                Verdict::Park { .. }
            ),
            "a keyless remote's TLS park stays a park"
        );
    }

    #[test]
    fn keyless_remotes_are_never_re_sent_blindly() {
        let retry = || Verdict::Retry {
            after: Duration::from_millis(1),
            reason: "503: x".into(),
        };
        let keyless = EffectPolicy {
            remote_ignores_keys: true,
            ..EffectPolicy::default()
        };
        assert_eq!(
            guard_keyless(retry(), true, None),
            retry(),
            "keys are honoured"
        );
        assert_eq!(guard_keyless(retry(), false, Some(&keyless)), retry());
        assert!(matches!(
            guard_keyless(retry(), true, Some(&keyless)),
            Verdict::Unknown { .. }
        ));
        struct Never;
        impl crate::StatusProbe for Never {
            fn probe<'a>(
                &'a self,
                _: &'a reqwest::Client,
                _: &'a ClaimedIntent,
            ) -> crate::remote::BoxFuture<'a, Probe> {
                Box::pin(async { Probe::NotApplied })
            }
        }
        let probed = EffectPolicy {
            probe: Some(std::sync::Arc::new(Never)),
            settle: Duration::from_secs(3),
            ..keyless
        };
        assert!(matches!(
            guard_keyless(retry(), true, Some(&probed)),
            Verdict::Retry { after, .. } if after == Duration::from_secs(3)
        ));
    }

    #[test]
    fn probe_findings_end_or_allow_the_attempt() {
        let w = Duration::from_secs(2);
        assert_eq!(
            probe_verdict(Probe::NotApplied, w),
            (ProbeResult::NotApplied, None)
        );
        assert!(matches!(
            probe_verdict(
                Probe::Applied {
                    status: 201,
                    body: "{}".into()
                },
                w
            ),
            (
                ProbeResult::Applied,
                Some(Verdict::Done { status: 201, .. })
            )
        ));
        assert!(matches!(
            probe_verdict(Probe::Unknown { reason: "?".into() }, w),
            (ProbeResult::Unknown, Some(Verdict::Unknown { .. }))
        ));
        assert!(matches!(
            probe_verdict(Probe::Unavailable { reason: "down".into() }, w),
            (ProbeResult::Unavailable, Some(Verdict::Retry { after, .. })) if after == w
        ));
        assert_eq!(ProbeResult::NotApplied.as_str(), "not_applied");
    }

    #[test]
    fn idle_waits_double_and_reset() {
        let (min, max) = (Duration::from_millis(5), Duration::from_millis(200));
        assert_eq!(
            next_wait(3, Duration::from_millis(80), min, max),
            (Duration::ZERO, min)
        );
        let ten = Duration::from_millis(10);
        assert_eq!(next_wait(0, min, min, max), (ten, ten));
        assert_eq!(next_wait(0, max, min, max), (max, max));
    }

    #[test]
    fn labels_and_headers_parse() {
        assert_eq!(host("http://127.0.0.1:8088/awards"), "127.0.0.1:8088");
        assert_eq!(host("https://example.invalid/x"), "example.invalid:443");
        assert_eq!(host("not a url"), "invalid");
        assert_eq!(parse_retry_after(" 7 "), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("99999"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
    }

    #[test]
    fn verdicts_are_stored_as_outcomes() {
        let park = Verdict::Park {
            kind: ParkKind::Conflict,
            reason: "422: x".into(),
        };
        assert_eq!(
            IntentOutcome::from(park),
            IntentOutcome::Park {
                reason: "422: x".into()
            }
        );
    }
}
