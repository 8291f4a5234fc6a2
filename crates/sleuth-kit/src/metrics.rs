//! Prometheus metrics: every service registers its own in the process-wide
//! registry and the kit serves them as text at `GET /metrics` on the gRPC
//! port (HTTP/1.1 is accepted for that), beside health and outside auth.

pub use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts};

/// Registers a metric built by `make` in the process-wide registry. Metrics
/// are process-wide: keep the result in a `LazyLock` so several servers in
/// one process (tests) share it instead of registering twice.
pub fn register<M>(metric: M) -> M
where
    M: prometheus::core::Collector + Clone + 'static,
{
    if let Err(error) = prometheus::default_registry().register(Box::new(metric.clone())) {
        tracing::warn!(%error, "metric not registered");
    }
    metric
}

/// A counter `name` with `help`, registered.
pub fn counter(name: &str, help: &str) -> IntCounter {
    register(IntCounter::new(name, help).expect("valid metric name"))
}

/// A gauge `name` with `help`, registered.
pub fn gauge(name: &str, help: &str) -> IntGauge {
    register(IntGauge::new(name, help).expect("valid metric name"))
}

/// A counter `name` with one series per value of `labels`, registered.
pub fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    register(IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric name"))
}

/// A gauge `name` with one series per value of `labels`, registered.
pub fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    register(IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric name"))
}

/// A histogram `name` with `help` and bucket upper bounds, registered.
pub fn histogram(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    register(Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)).expect("valid metric name"))
}

/// Every registered metric in the Prometheus text format.
pub fn render() -> String {
    use prometheus::Encoder;
    let mut text = Vec::new();
    if let Err(error) = prometheus::TextEncoder::new().encode(&prometheus::default_registry().gather(), &mut text) {
        tracing::warn!(%error, "cannot encode metrics");
    }
    String::from_utf8(text).unwrap_or_default()
}

/// The `/metrics` handler.
pub async fn scrape() -> String {
    render()
}
