//! The gateway's metrics (served at `/metrics` on the gRPC port). The latency
//! the gateway adds is measured per turn as the turn's wall time minus the
//! time spent waiting on the policy server, so it covers templating,
//! tokenising, Redis and parsing, and nothing the policy does.

use std::sync::LazyLock;

use sleuth_kit::metrics::{
    Histogram, IntCounter, IntCounterVec, IntGaugeVec, counter, counter_vec, gauge_vec, histogram,
};

pub struct Metrics {
    /// Turns by front door (grpc, http) and result (ok or the error kind).
    pub turns: IntCounterVec,
    pub prompt_tokens: IntCounter,
    pub completion_tokens: IntCounter,
    pub overhead_seconds: Histogram,
    pub drift_events: IntCounter,
    pub malformed_tool_calls: IntCounter,
    /// Generate calls in flight per policy-server replica.
    pub replica_in_flight: IntGaugeVec,
    /// Generate calls that failed over away from a replica.
    pub replica_failures: IntCounterVec,
    /// Times a turn waited because every replica was behind its run's weights.
    pub behind_waits: IntCounter,
}

pub static METRICS: LazyLock<Metrics> = LazyLock::new(|| Metrics {
    turns: counter_vec("sleuth_gateway_turns_total", "Assistant turns served.", &["front_door", "result"]),
    prompt_tokens: counter("sleuth_gateway_prompt_tokens_total", "Prompt tokens sent to the policy."),
    completion_tokens: counter("sleuth_gateway_completion_tokens_total", "Tokens the policy generated."),
    overhead_seconds: histogram(
        "sleuth_gateway_overhead_seconds",
        "Time a turn spent in the gateway itself (wall time minus the policy call).",
        vec![0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1],
    ),
    drift_events: counter(
        "sleuth_gateway_drift_events_total",
        "Turns whose re-rendered history disagreed with the recorded tokens.",
    ),
    malformed_tool_calls: counter(
        "sleuth_gateway_malformed_tool_calls_total",
        "Replies that tried to call a tool but could not be parsed.",
    ),
    replica_in_flight: gauge_vec(
        "sleuth_gateway_replica_in_flight",
        "Generate calls in flight per policy-server replica.",
        &["replica"],
    ),
    replica_failures: counter_vec(
        "sleuth_gateway_replica_failures_total",
        "Generate calls a replica could not serve (the turn failed over).",
        &["replica"],
    ),
    behind_waits: counter(
        "sleuth_gateway_behind_waits_total",
        "Polls of a turn waiting because every replica served weights older than its run's.",
    ),
});
