//! Trace context across the spans of a job or a broker message: the
//! validated `traceparent` it carries becomes the parent of lazaret's span,
//! and what lazaret hands on (an HTTP delivery, a republished message)
//! carries the trace on.
//!
//! Shared by the guard and the server (which depends on this crate). Without
//! the `otlp` feature these only read the `traceparent` and pass it on as
//! it came; with it, and an OpenTelemetry layer installed by the binary
//! (`tracing-opentelemetry`), the span's parent is set from the
//! `traceparent` through the W3C propagator, so the exported spans share the
//! caller's trace id, and what goes on names lazaret's span as the parent.
//!
//! Cheap when unused: a disabled span (no subscriber wants it) returns
//! before anything is parsed or allocated.

use lazaret_core::TraceParent;

/// The header (HTTP and broker) and field name.
pub const TRACEPARENT: &str = "traceparent";

/// Makes `span` a child of the trace `traceparent` names. Call it right
/// after creating the span, before entering it. A no-op without a
/// traceparent, for a disabled span, or without the `otlp` feature.
#[inline]
pub fn follow(span: &tracing::Span, traceparent: Option<&TraceParent>) {
    let Some(tp) = traceparent else { return };
    if span.is_disabled() {
        return;
    }
    otel::set_parent(span, tp);
}

/// The `traceparent` to hand on from `span`: lazaret's span as the parent
/// when it is exported (`otlp`), else the one the job or message came with.
pub fn outgoing(span: &tracing::Span, traceparent: Option<&TraceParent>) -> Option<String> {
    if !span.is_disabled() {
        if let Some(own) = otel::current(span) {
            return Some(own);
        }
    }
    traceparent.map(|t| t.as_str().to_owned())
}

/// A `traceparent` taken from a broker message's header value: validated,
/// and an invalid one dropped (logged at debug, counted by the caller's
/// metric if it keeps one), never trusted.
pub fn from_header(value: Option<&str>, source: &str) -> Option<TraceParent> {
    let value = value?;
    match TraceParent::parse(value) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::debug!(source, error = %e, "dropping a broker message's invalid traceparent");
            None
        }
    }
}

#[cfg(feature = "otlp")]
mod otel {
    use std::collections::HashMap;

    use lazaret_core::TraceParent;
    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    pub(super) fn set_parent(span: &tracing::Span, tp: &TraceParent) {
        let carrier = HashMap::from([(super::TRACEPARENT.to_owned(), tp.as_str().to_owned())]);
        let cx = TraceContextPropagator::new().extract(&carrier);
        // Without the OpenTelemetry layer (OTLP not configured) there is
        // nothing to set: the error says so and is not one.
        let _ = span.set_parent(cx);
    }

    pub(super) fn current(span: &tracing::Span) -> Option<String> {
        let cx = span.context();
        if !cx.span().span_context().is_valid() {
            return None;
        }
        let mut carrier: HashMap<String, String> = HashMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut carrier);
        carrier.remove(super::TRACEPARENT)
    }
}

#[cfg(not(feature = "otlp"))]
mod otel {
    use lazaret_core::TraceParent;

    #[inline]
    pub(super) fn set_parent(_: &tracing::Span, _: &TraceParent) {}

    #[inline]
    pub(super) fn current(_: &tracing::Span) -> Option<String> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invalid_header_is_dropped_and_a_valid_one_kept() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            from_header(Some(good), "s").map(|t| t.as_str().to_owned()),
            Some(good.to_owned())
        );
        assert_eq!(from_header(Some("00-nope"), "s"), None);
        assert_eq!(from_header(None, "s"), None);
    }

    #[test]
    fn without_a_subscriber_what_came_goes_on() {
        let tp =
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        let span = tracing::info_span!("t");
        follow(&span, Some(&tp));
        assert_eq!(outgoing(&span, Some(&tp)).as_deref(), Some(tp.as_str()));
        assert_eq!(outgoing(&span, None), None);
    }
}
