//! Agent workers: run the multi-turn search-agent loop for one episode at a
//! time (many concurrently) against the inference gateway and the tool gateway.
//!
//! Status: the service starts and reports SERVING once the inference gateway
//! and the tool gateway are SERVING; `RunEpisode` answers `Unimplemented`
//! until the rollouts work lands.

use std::future::Future;
use std::net::SocketAddr;

use sleuth_kit::{ErrorKind, GrpcService, KitError, ServeArgs, ServiceError, TelemetryArgs};
use sleuth_proto::agent::v1::agent_server::{Agent, AgentServer};
use tokio::net::TcpListener;

/// Configuration, from flags or `SLEUTH_*` environment variables.
#[derive(clap::Parser, Debug, Clone)]
#[command(name = "agent", version, about = "Agent worker: runs multi-turn search-agent episodes.")]
pub struct Config {
    /// Address to listen on for gRPC.
    #[arg(long, env = "SLEUTH_LISTEN", default_value = "0.0.0.0:50052")]
    pub listen: SocketAddr,

    /// Inference gateway the agent's model calls go to (host:port).
    #[arg(long, env = "SLEUTH_INFERENCE_GATEWAY", default_value = "127.0.0.1:50054")]
    pub inference_gateway: String,

    /// Tool gateway the agent's tool calls go to (host:port).
    #[arg(long, env = "SLEUTH_TOOL_GATEWAY", default_value = "127.0.0.1:50053")]
    pub tool_gateway: String,

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
}

impl ServiceError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Kit(error) => error.kind(),
        }
    }
}

/// The RPC handlers. RPCs not overridden here answer `Unimplemented`.
#[derive(Debug, Clone, Default)]
pub struct Handlers;

#[tonic::async_trait]
impl Agent for Handlers {}

/// Serves the agent on `listener` until `shutdown` resolves.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let token = config.serve.bearer_token()?;
    let mut service = GrpcService::new(AgentServer::new(Handlers));
    service = service.with_probe(sleuth_kit::client::upstream_probe(
        "inference-gateway",
        &config.inference_gateway,
        sleuth_proto::inference::v1::inference_gateway_server::SERVICE_NAME,
        token.as_ref(),
    )?);
    service = service.with_probe(sleuth_kit::client::upstream_probe(
        "tool-gateway",
        &config.tool_gateway,
        sleuth_proto::tools::v1::tool_gateway_server::SERVICE_NAME,
        token.as_ref(),
    )?);
    sleuth_kit::serve(service, &config.serve, listener, shutdown).await?;
    Ok(())
}
