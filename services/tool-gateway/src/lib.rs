//! The tool gateway: the agents' search environment. It will serve BM25 and
//! vector search and document reads over indexed BEIR collections, with tool
//! schemas in OpenAI function format.
//!
//! Status: the service starts, reports health and answers reflection; every
//! RPC of `sleuth.tools.v1.ToolGateway` answers `Unimplemented` until the
//! tool-gateway work lands.

use std::future::Future;
use std::net::SocketAddr;

use sleuth_kit::{ErrorKind, GrpcService, KitError, ServeArgs, ServiceError, TelemetryArgs};
use sleuth_proto::tools::v1::tool_gateway_server::{ToolGateway, ToolGatewayServer};
use tokio::net::TcpListener;

/// Configuration, from flags or `SLEUTH_*` environment variables.
#[derive(clap::Parser, Debug, Clone)]
#[command(
    name = "tool-gateway",
    version,
    about = "Search tools (BM25, vector search, read document) over indexed collections, for agents."
)]
pub struct Config {
    /// Address to listen on for gRPC.
    #[arg(long, env = "SLEUTH_LISTEN", default_value = "0.0.0.0:50053")]
    pub listen: SocketAddr,

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
impl ToolGateway for Handlers {}

/// Serves the tool-gateway on `listener` until `shutdown` resolves.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let service = GrpcService::new(ToolGatewayServer::new(Handlers));
    sleuth_kit::serve(service, &config.serve, listener, shutdown).await?;
    Ok(())
}
