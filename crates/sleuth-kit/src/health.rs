//! Readiness: a service reports NOT_SERVING on gRPC health until every
//! dependency it needs answers, and goes back to NOT_SERVING when one stops
//! answering. Kubernetes readiness probes and load balancers read this.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// One dependency check (Redis answers PING, the database answers a query,
/// an upstream service is SERVING, the libtorch device works).
pub trait Probe: Send + Sync + 'static {
    /// Short name shown in logs, e.g. "redis" or "policy-server".
    fn name(&self) -> String;
    /// Ok when the dependency is usable; Err says why not.
    fn check(&self) -> BoxFuture<'_, Result<(), String>>;
}

/// A probe from a name and an async closure, for checks that need no type of their own.
pub fn probe_fn<F>(name: impl Into<String>, check: F) -> Arc<dyn Probe>
where
    F: Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync + 'static,
{
    struct FnProbe<F> {
        name: String,
        check: F,
    }
    impl<F> Probe for FnProbe<F>
    where
        F: Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync + 'static,
    {
        fn name(&self) -> String {
            self.name.clone()
        }
        fn check(&self) -> BoxFuture<'_, Result<(), String>> {
            (self.check)()
        }
    }
    Arc::new(FnProbe { name: name.into(), check })
}

/// How often dependencies are checked while the service is not ready (fast, so
/// it becomes ready soon after its dependencies) and while it is.
const RETRY_WHILE_NOT_READY: Duration = Duration::from_millis(250);
const RECHECK_WHILE_READY: Duration = Duration::from_secs(5);
/// A probe that takes longer than this counts as failed.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Checks `probes` forever, keeping `service_name` and the server-wide status
/// ("") in `reporter` in line with them. Logs each change of readiness once.
pub async fn watch_readiness(reporter: HealthReporter, service_name: &'static str, probes: Vec<Arc<dyn Probe>>) {
    let mut ready = None;
    loop {
        let mut failures = Vec::new();
        for probe in &probes {
            let outcome = tokio::time::timeout(PROBE_TIMEOUT, probe.check())
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {PROBE_TIMEOUT:?}")));
            if let Err(reason) = outcome {
                failures.push(format!("{}: {reason}", probe.name()));
            }
        }
        let now_ready = failures.is_empty();
        if ready != Some(now_ready) {
            let status = if now_ready { ServingStatus::Serving } else { ServingStatus::NotServing };
            reporter.set_service_status(service_name, status).await;
            reporter.set_service_status("", status).await;
            if now_ready {
                tracing::info!(service = service_name, "dependencies ready, serving");
            } else {
                tracing::warn!(service = service_name, waiting_for = %failures.join("; "), "not serving until dependencies are ready");
            }
            ready = Some(now_ready);
        }
        tokio::time::sleep(if now_ready { RECHECK_WHILE_READY } else { RETRY_WHILE_NOT_READY }).await;
    }
}
