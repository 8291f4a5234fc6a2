//! The inference gateway: the agents' model endpoint. It will render chat
//! templates, route to policy-server replicas and record each episode's exact
//! tokens, logprobs and policy versions in Redis.
//!
//! Status: the service starts and reports SERVING once Redis and every
//! configured policy server are up; every RPC of
//! `sleuth.inference.v1.InferenceGateway` answers `Unimplemented` until the
//! inference-gateway work lands.

use std::future::Future;
use std::net::SocketAddr;

use sleuth_kit::{ErrorKind, GrpcService, KitError, ServeArgs, ServiceError, TelemetryArgs};
use sleuth_proto::inference::v1::inference_gateway_server::{InferenceGateway, InferenceGatewayServer};
use sleuth_store::{RedisArgs, RedisStore};
use tokio::net::TcpListener;

/// Configuration, from flags or `SLEUTH_*` environment variables.
#[derive(clap::Parser, Debug, Clone)]
#[command(
    name = "inference-gateway",
    version,
    about = "The agents' model endpoint: chat templates, routing and exact token traces."
)]
pub struct Config {
    /// Address to listen on for gRPC.
    #[arg(long, env = "SLEUTH_LISTEN", default_value = "0.0.0.0:50054")]
    pub listen: SocketAddr,

    #[command(flatten)]
    pub redis: RedisArgs,

    /// Policy-server replicas (host:port), comma separated.
    #[arg(long, env = "SLEUTH_POLICY_SERVERS", value_delimiter = ',', default_value = "127.0.0.1:50055")]
    pub policy_servers: Vec<String>,

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
    Store(#[from] sleuth_store::StoreError),
}

impl ServiceError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Kit(error) => error.kind(),
            Error::Store(error) => error.kind(),
        }
    }
}

/// The RPC handlers. RPCs not overridden here answer `Unimplemented`.
#[derive(Debug, Clone, Default)]
pub struct Handlers;

#[tonic::async_trait]
impl InferenceGateway for Handlers {}

/// Serves the inference-gateway on `listener` until `shutdown` resolves.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let token = config.serve.bearer_token()?;
    let redis = RedisStore::open(&config.redis.redis_url)?;
    let mut service = GrpcService::new(InferenceGatewayServer::new(Handlers)).with_probe(redis.probe());
    for address in &config.policy_servers {
        service = service.with_probe(sleuth_kit::client::upstream_probe(
            "policy-server",
            address,
            sleuth_proto::policy::v1::policy_server_server::SERVICE_NAME,
            token.as_ref(),
        )?);
    }
    sleuth_kit::serve(service, &config.serve, listener, shutdown).await?;
    Ok(())
}
