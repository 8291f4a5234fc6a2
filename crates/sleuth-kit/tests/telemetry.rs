//! Spans reach a real OpenTelemetry collector over OTLP/gRPC.

use std::time::Duration;

use sleuth_kit::TelemetryArgs;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_to_the_otlp_collector() -> anyhow::Result<()> {
    let collector = sleuth_testkit::otlp_collector()?;
    let args = TelemetryArgs {
        otlp_endpoint: Some(sleuth_testkit::otlp_endpoint(&collector)),
        log: "info".to_owned(),
        ..TelemetryArgs::default()
    };
    let guard = sleuth_kit::telemetry::init("telemetry-test", &args)?;
    {
        let span = tracing::info_span!("sleuth_otlp_probe_span", episode_id = "ep-42");
        let _entered = span.enter();
        tracing::info!("inside the probe span");
    }
    tokio::task::spawn_blocking(move || guard.flush()).await??;
    let log = sleuth_testkit::wait_for_log(&collector, Duration::from_secs(20), |log| {
        log.contains("sleuth_otlp_probe_span")
    })?;
    assert!(log.contains("ep-42"), "span attribute missing from collector output:\n{log}");
    assert!(log.contains("telemetry-test"), "service name missing from collector output:\n{log}");
    Ok(())
}

#[test]
fn otlp_endpoint_without_scheme_is_rejected_by_name() {
    let args = TelemetryArgs {
        otlp_endpoint: Some("collector:4317".to_owned()),
        log: "info".to_owned(),
        ..TelemetryArgs::default()
    };
    let error = sleuth_kit::telemetry::init("telemetry-test", &args).err().unwrap().to_string();
    assert!(error.contains("otlp_endpoint") && error.contains("collector:4317"), "{error}");
}
