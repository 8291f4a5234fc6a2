//! Sleuth's own services inside a test process: started from their `Config`
//! and `run` on a loopback port, stopped when the handle drops.

use std::time::{Duration, Instant};

use anyhow::Result;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

pub use clap;

/// Starts a service crate's server (`$krate::Config` parsed from `$args`,
/// then `$krate::run`) and returns `(address, Running)`.
#[macro_export]
macro_rules! start_service {
    ($krate:ident, $args:expr) => {{
        use $crate::service::clap::Parser as _;
        let mut config = $krate::Config::try_parse_from($args)?;
        // Tests serve on loopback; without a token a service needs --insecure.
        config.serve.insecure = true;
        let listener = ::tokio::net::TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?.to_string();
        let (stop, stopped) = ::tokio::sync::oneshot::channel::<()>();
        let server = ::tokio::spawn($krate::run(config, listener, async {
            let _ = stopped.await;
        }));
        (addr, $crate::service::Running::new(stop, server))
    }};
}

/// A server started by [`start_service!`]: dropping it stops the server;
/// [`Running::stop`] also waits until it has.
pub struct Running<E> {
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<Result<(), E>>,
}

impl<E: std::fmt::Display> Running<E> {
    pub fn new(stop: tokio::sync::oneshot::Sender<()>, server: tokio::task::JoinHandle<Result<(), E>>) -> Self {
        Self { stop, server }
    }

    /// Waits up to `within` for the server to end on its own, without asking
    /// it to stop, and returns how it ended.
    pub async fn ended(self, within: Duration) -> Result<Result<(), E>> {
        let Self { stop, server } = self;
        let ended = tokio::time::timeout(within, server)
            .await
            .map_err(|_| anyhow::anyhow!("the server still runs after {within:?}"))??;
        drop(stop);
        Ok(ended)
    }

    pub async fn stop(self) -> Result<()> {
        drop(self.stop);
        match tokio::time::timeout(Duration::from_secs(30), self.server).await?? {
            Ok(()) => Ok(()),
            Err(error) => anyhow::bail!("server failed: {error}"),
        }
    }
}

/// A policy server's command line for tests: `model` on the CPU in f32, gRPC
/// on a free loopback port, plus `extra` flags.
pub fn policy_server_args(model: &str, extra: &[&str]) -> Vec<String> {
    ["policy-server", "--listen", "127.0.0.1:0", "--device", "cpu", "--dtype", "f32", "--model", model]
        .iter()
        .chain(extra)
        .map(|a| a.to_string())
        .collect()
}

/// An inference gateway's command line with gRPC on a free loopback port:
/// its model, Redis, policy replicas (comma separated), HTTP address, plus `extra` flags.
pub fn inference_gateway_args(
    model: &str,
    redis_url: &str,
    policy_servers: &str,
    http: &str,
    extra: &[&str],
) -> Vec<String> {
    let mut args: Vec<String> = ["inference-gateway", "--listen", "127.0.0.1:0", "--http-listen", http]
        .into_iter()
        .chain(["--model", model, "--redis-url", redis_url, "--policy-servers", policy_servers])
        .map(str::to_owned)
        .collect();
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// Waits (up to two minutes) until `service` at `addr` reports SERVING.
pub async fn wait_serving(addr: &str, service: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?;
        if let Ok(channel) = endpoint.connect().await {
            let status = HealthClient::new(channel).check(HealthCheckRequest { service: service.into() }).await;
            if status.is_ok_and(|s| s.into_inner().status() == ServingStatus::Serving) {
                return Ok(());
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "{service} at {addr} never became SERVING");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
