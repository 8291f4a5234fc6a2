//! W3C trace context across the mesh, so that one episode is one trace: the
//! orchestrator's episode span, the agent's turns, the inference gateway,
//! the policy server and the tool gateway all hang under it.
//!
//! Outgoing calls carry the current span's context as `traceparent` (and
//! `tracestate`) metadata ([`inject`], called by every mesh channel's
//! interceptor); incoming calls run inside a server span whose parent is the
//! caller's context ([`server_span`], mounted by the kit's stack on gRPC and
//! by services on their HTTP routes). Without an OTLP endpoint no
//! OpenTelemetry layer is installed: contexts are empty and nothing is sent.

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt as _;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// Reads the propagation headers of an incoming request (gRPC metadata
/// travels as HTTP/2 headers).
struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// Writes the propagation headers onto an outgoing gRPC call.
struct Metadata<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for Metadata<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The propagator writes only `traceparent` and `tracestate`, both
        // valid ASCII keys; a value it could not encode is left off rather
        // than failing the call.
        if let (Ok(key), Ok(value)) =
            (tonic::metadata::MetadataKey::from_bytes(key.as_bytes()), tonic::metadata::MetadataValue::try_from(value))
        {
            self.0.insert(key, value);
        }
    }
}

/// Puts the current span's trace context on an outgoing call's metadata.
pub fn inject(metadata: &mut tonic::metadata::MetadataMap) {
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut Metadata(metadata));
    });
}

/// The trace id (32 hex digits) of the current span, when it is traced:
/// where an episode records which trace to look for.
pub fn current_trace_id() -> Option<String> {
    let context = tracing::Span::current().context();
    let span = context.span();
    let span_context = span.span_context();
    span_context.is_valid().then(|| span_context.trace_id().to_string())
}

/// axum middleware: the request runs in a server span named after its path
/// (a gRPC method, `/sleuth.agent.v1.Agent/RunEpisode`), child of the
/// caller's trace.
pub async fn server_span(request: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    let path = request.uri().path().to_owned();
    traced(path, request, next).await
}

/// [`server_span`] for an HTTP route whose paths carry ids: the span is
/// named after the route (its state), so ids stay out of span names.
pub async fn route_span(
    axum::extract::State(route): axum::extract::State<&'static str>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    traced(route.to_owned(), request, next).await
}

async fn traced(
    name: String,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let parent =
        opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&Headers(request.headers())));
    let span = tracing::info_span!("rpc", otel.name = %name, otel.kind = "server", rpc.path = %name);
    // Fails only when no OpenTelemetry layer is installed (no OTLP
    // endpoint), where there is no trace to join.
    let _ = span.set_parent(parent);
    next.run(request).instrument(span).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_header_is_read_back() {
        let mut headers = http::HeaderMap::new();
        headers.insert("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".parse().unwrap());
        let propagator = opentelemetry_sdk::propagation::TraceContextPropagator::new();
        let context = opentelemetry::propagation::TextMapPropagator::extract(&propagator, &Headers(&headers));
        assert_eq!(context.span().span_context().trace_id().to_string(), "0af7651916cd43dd8448eb211c80319c");
        let mut metadata = tonic::metadata::MetadataMap::new();
        opentelemetry::propagation::TextMapPropagator::inject_context(
            &propagator,
            &context,
            &mut Metadata(&mut metadata),
        );
        assert_eq!(
            metadata.get("traceparent").unwrap(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "the context goes out as it came in"
        );
    }
}
