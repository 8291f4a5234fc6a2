//! The policy server's metrics (served at `/metrics`). Rates such as tokens/s
//! and the prefix hit rate come from these counters in Prometheus:
//! `rate(sleuth_policy_generated_tokens_total[1m])`,
//! `rate(sleuth_policy_cached_prompt_tokens_total[5m]) / rate(sleuth_policy_prompt_tokens_total[5m])`.

use std::sync::LazyLock;

use sleuth_kit::metrics::{Histogram, IntCounter, IntGauge, counter, gauge, histogram};

pub struct Metrics {
    pub generated_tokens: IntCounter,
    pub prompt_tokens: IntCounter,
    pub cached_prompt_tokens: IntCounter,
    pub refused_requests: IntCounter,
    pub batch_size: IntGauge,
    pub queue_depth: IntGauge,
    pub kv_reserved_tokens: IntGauge,
    pub prefix_cache_tokens: IntGauge,
    pub policy_version: IntGauge,
    pub decode_step_seconds: Histogram,
}

pub static METRICS: LazyLock<Metrics> = LazyLock::new(|| Metrics {
    generated_tokens: counter("sleuth_policy_generated_tokens_total", "Tokens sampled."),
    prompt_tokens: counter("sleuth_policy_prompt_tokens_total", "Prompt tokens of admitted requests."),
    cached_prompt_tokens: counter(
        "sleuth_policy_cached_prompt_tokens_total",
        "Prompt tokens served from a session's cached prefix instead of prefilled.",
    ),
    refused_requests: counter("sleuth_policy_refused_requests_total", "Requests refused because the queue was full."),
    batch_size: gauge("sleuth_policy_batch_size", "Sequences in the running batch."),
    queue_depth: gauge("sleuth_policy_queue_depth", "Requests waiting for the batch."),
    kv_reserved_tokens: gauge("sleuth_policy_kv_reserved_tokens", "KV-cache tokens reserved by running sequences."),
    prefix_cache_tokens: gauge("sleuth_policy_prefix_cache_tokens", "Tokens held by session prefix caches."),
    policy_version: gauge("sleuth_policy_version", "Weights version served."),
    decode_step_seconds: histogram(
        "sleuth_policy_decode_step_seconds",
        "Duration of one decode step of the whole batch.",
        vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5],
    ),
});
