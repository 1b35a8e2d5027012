//! W3C trace context capture.
//!
//! At enqueue time idem records the `traceparent` of the OpenTelemetry context that is current
//! (see [`opentelemetry::Context::current`]); the relay forwards it as a Kafka header so the
//! consumer's span can continue the same trace ([`remote_context`]), and the effect stage sends
//! it on the outbound HTTP request.

use opentelemetry::Context;
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};

use crate::error::{Error, Result};

/// The `traceparent` of the current OpenTelemetry context, if it holds a valid span context.
pub fn current_traceparent() -> Option<String> {
    traceparent_of(&Context::current())
}

/// The `traceparent` of `cx`, if it holds a valid span context.
pub fn traceparent_of(cx: &Context) -> Option<String> {
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    Some(format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    ))
}

/// A context whose span is the remote parent named by `traceparent` (as a consumer receives it
/// in a Kafka header), to start a child span under; `None` if it is not a valid W3C
/// `traceparent`.
pub fn remote_context(traceparent: &str) -> Option<Context> {
    validate_traceparent(traceparent).ok()?;
    let mut parts = traceparent.split('-').skip(1);
    let trace_id = TraceId::from_hex(parts.next()?).ok()?;
    let span_id = SpanId::from_hex(parts.next()?).ok()?;
    let flags = u8::from_str_radix(parts.next()?, 16).ok()?;
    let sc = SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    Some(Context::new().with_remote_span_context(sc))
}

/// Checks the W3C form `00-<32 hex>-<16 hex>-<2 hex>` with non-zero ids.
pub fn validate_traceparent(tp: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::InvalidEvent {
            field: "traceparent",
            reason: format!(
                "{tp:?} {why}; expected 00-<32 hex trace id>-<16 hex span id>-<2 hex flags>"
            ),
        })
    };
    let parts: Vec<&str> = tp.split('-').collect();
    if parts.len() != 4 {
        return bad("does not have four dash-separated parts");
    }
    let lower_hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if parts[0] != "00" {
        return bad("has an unsupported version");
    }
    if !lower_hex(parts[1], 32) || parts[1].bytes().all(|b| b == b'0') {
        return bad("has an invalid trace id");
    }
    if !lower_hex(parts[2], 16) || parts[2].bytes().all(|b| b == b'0') {
        return bad("has an invalid span id");
    }
    if !lower_hex(parts[3], 2) {
        return bad("has invalid flags");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    #[test]
    fn no_context_no_traceparent() {
        assert_eq!(current_traceparent(), None);
    }

    #[test]
    fn captures_the_current_span_context() {
        let sc = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let cx = opentelemetry::Context::current().with_remote_span_context(sc);
        let _guard = cx.attach();
        assert_eq!(
            current_traceparent().as_deref(),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
    }

    #[test]
    fn a_received_traceparent_becomes_a_remote_parent() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = remote_context(tp).unwrap();
        assert!(cx.span().span_context().is_remote());
        assert_eq!(traceparent_of(&cx).as_deref(), Some(tp));
        assert!(remote_context("00-nonsense").is_none());
    }

    #[test]
    fn validates_the_w3c_form() {
        assert!(
            validate_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").is_ok()
        );
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert!(validate_traceparent(bad).is_err(), "{bad:?} accepted");
        }
    }
}
