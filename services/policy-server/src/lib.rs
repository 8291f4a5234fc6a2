//! The policy server: LLM inference in libtorch with per-token logprobs,
//! continuous batching, prefix reuse and versioned weight updates.
//!
//! Status: the service starts, checks that libtorch computes on the configured
//! device before it reports SERVING, and answers reflection; every RPC of
//! `sleuth.policy.v1.PolicyServer` answers `Unimplemented` until the
//! policy-server work lands.

use std::future::Future;
use std::net::SocketAddr;

use sleuth_kit::{ErrorKind, GrpcService, KitError, ServeArgs, ServiceError, TelemetryArgs};
use sleuth_proto::policy::v1::policy_server_server::{PolicyServer, PolicyServerServer};
use sleuth_torch::DeviceSpec;
use tokio::net::TcpListener;

/// Configuration, from flags or `SLEUTH_*` environment variables.
#[derive(clap::Parser, Debug, Clone)]
#[command(
    name = "policy-server",
    version,
    about = "LLM inference in libtorch with logprobs and versioned hot weight updates."
)]
pub struct Config {
    /// Address to listen on for gRPC.
    #[arg(long, env = "SLEUTH_LISTEN", default_value = "0.0.0.0:50055")]
    pub listen: SocketAddr,

    /// Device to run the model on: auto (CUDA when present), cpu, cuda or cuda:N.
    #[arg(long, env = "SLEUTH_DEVICE", default_value = "auto")]
    pub device: DeviceSpec,

    #[command(flatten)]
    pub serve: ServeArgs,

    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// Errors that stop the service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Kit(#[from] KitError),
    #[error(transparent)]
    Torch(#[from] sleuth_torch::TorchError),
}

impl ServiceError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Kit(error) => error.kind(),
            Error::Torch(error) => error.kind(),
        }
    }
}

/// The RPC handlers. RPCs not overridden here answer `Unimplemented`.
#[derive(Debug, Clone, Default)]
pub struct Handlers;

#[tonic::async_trait]
impl PolicyServer for Handlers {}

/// Serves the policy-server on `listener` until `shutdown` resolves.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let device = config.device.resolve()?;
    let service = GrpcService::new(PolicyServerServer::new(Handlers)).with_probe(sleuth_torch::device_probe(device));
    sleuth_kit::serve(service, &config.serve, listener, shutdown).await?;
    Ok(())
}
