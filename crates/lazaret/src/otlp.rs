//! OpenTelemetry export of lazaret's spans over OTLP/HTTP (the `otlp`
//! cargo feature), configured by the standard environment variables:
//!
//! - `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (the full URL) or
//!   `OTEL_EXPORTER_OTLP_ENDPOINT` (`/v1/traces` is appended): export is
//!   on only when one is set;
//! - `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL`:
//!   `http/protobuf` (the default) or `http/json` (`grpc` is refused: this
//!   build has no gRPC client);
//! - `OTEL_SERVICE_NAME` (default `lazaret`), `OTEL_RESOURCE_ATTRIBUTES`,
//!   `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`,
//!   `OTEL_BSP_SCHEDULE_DELAY` and the other batch settings, read by the
//!   OpenTelemetry SDK;
//! - `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off.
//!
//! The layer sees lazaret's per-job spans (`lazaret.admission`,
//! `lazaret.lease`, `lazaret.outcome`, `lazaret.dead_letter`,
//! `lazaret.redrive`, `lazaret.delivery`; debug level, so the log at its
//! default `info` does not print them) and lazaret's info spans, whatever
//! `LAZARET_LOG` says: the log and the export filter apart. A span whose
//! job carries a `traceparent` is its child (`lazaret_guard::trace`).

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Subscriber;
use tracing_subscriber::Layer;
use tracing_subscriber::registry::LookupSpan;

/// What the export filter lets through: lazaret's crates at debug (the
/// per-job spans), everything else at info.
const EXPORT_FILTER: &str =
    "info,lazaret=debug,lazaret_server=debug,lazaret_guard=debug,lazaret_store=debug";

/// The running export; dropping it flushes the spans still batched.
#[derive(Debug)]
pub struct Export {
    provider: SdkTracerProvider,
}

impl Drop for Export {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!("flushing the OTLP span export at exit failed: {e}");
        }
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Whether the environment asks for an export.
fn wanted() -> bool {
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return false;
    }
    if var("OTEL_TRACES_EXPORTER").is_some_and(|v| !v.split(',').any(|e| e.trim() == "otlp")) {
        return false;
    }
    var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
        || var("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
}

fn protocol() -> anyhow::Result<Protocol> {
    let (name, value) = match var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") {
        Some(v) => ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", v),
        None => match var("OTEL_EXPORTER_OTLP_PROTOCOL") {
            Some(v) => ("OTEL_EXPORTER_OTLP_PROTOCOL", v),
            None => return Ok(Protocol::HttpBinary),
        },
    };
    match value.trim() {
        "http/protobuf" => Ok(Protocol::HttpBinary),
        "http/json" => Ok(Protocol::HttpJson),
        other => anyhow::bail!(
            "{name}={other:?}: this build exports spans over HTTP only; set http/protobuf (the default) or http/json"
        ),
    }
}

/// The OpenTelemetry layer and its export, when the environment asks for
/// one; an endpoint or protocol it cannot use is an error at start.
pub fn layer<S>() -> anyhow::Result<Option<(impl Layer<S> + Send + Sync + 'static, Export)>>
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    if !wanted() {
        return Ok(None);
    }
    let exporter = SpanExporter::builder()
        .with_http()
        .with_protocol(protocol()?)
        .build()
        .context("cannot set up the OTLP span export (OTEL_EXPORTER_OTLP_* variables)")?;
    let service = var("OTEL_SERVICE_NAME").unwrap_or_else(|| "lazaret".to_owned());
    let provider = SdkTracerProvider::builder()
        .with_resource(Resource::builder().with_service_name(service).build())
        .with_batch_exporter(exporter)
        .build();
    let tracer = provider.tracer("lazaret");
    let filter = tracing_subscriber::EnvFilter::builder()
        .parse(EXPORT_FILTER)
        .context("the export filter")?;
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(filter);
    Ok(Some((layer, Export { provider })))
}
