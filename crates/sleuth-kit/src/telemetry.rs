//! Logging and OpenTelemetry trace export.
//!
//! Logs go to stderr as text or JSON. When an OTLP endpoint is configured,
//! `tracing` spans are also exported over OTLP/gRPC in batches; otherwise no
//! exporter is built and tracing costs nothing extra.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::{LogFormat, TelemetryArgs};
use crate::error::KitError;

/// Keeps trace export alive; dropping it flushes the spans still buffered.
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Exports every finished span now; used before exiting and by tests.
    pub fn flush(&self) -> Result<(), KitError> {
        match &self.provider {
            Some(provider) => provider.force_flush().map_err(|error| KitError::Telemetry(error.to_string())),
            None => Ok(()),
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("trace export did not shut down cleanly: {error}");
        }
    }
}

/// Installs the global `tracing` subscriber for a process. Must be called
/// inside a Tokio runtime when an OTLP endpoint is configured (the exporter
/// is a tonic client).
pub fn init(service_name: &'static str, args: &TelemetryArgs) -> Result<TelemetryGuard, KitError> {
    let filter = EnvFilter::try_new(&args.log).map_err(|error| KitError::Config {
        field: "log",
        message: format!("{:?} is not a log filter: {error}", args.log),
    })?;
    let provider = args.otlp_endpoint.as_deref().map(|endpoint| tracer_provider(service_name, endpoint)).transpose()?;
    let export =
        provider.as_ref().map(|provider| tracing_opentelemetry::layer().with_tracer(provider.tracer(service_name)));
    let logs = match args.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer().json().with_writer(std::io::stderr).boxed(),
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(logs)
        .with(export)
        .try_init()
        .map_err(|error| KitError::Telemetry(error.to_string()))?;
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    Ok(TelemetryGuard { provider })
}

fn tracer_provider(service_name: &'static str, endpoint: &str) -> Result<SdkTracerProvider, KitError> {
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(KitError::Config {
            field: "otlp_endpoint",
            message: format!("{endpoint:?} must start with http:// or https://"),
        });
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|error| KitError::Telemetry(format!("OTLP exporter for {endpoint}: {error}")))?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(service_name).build())
        .build())
}
