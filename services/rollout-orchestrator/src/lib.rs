//! The rollout orchestrator: owns training runs and evaluation jobs, fans
//! tasks out as groups of episodes to agent workers, scores them and publishes
//! finished groups to the run's Redis stream; run state lives in SQL.
//!
//! Status: the service starts and reports SERVING once its database and Redis
//! answer; every RPC of `sleuth.rollout.v1.RolloutOrchestrator` answers
//! `Unimplemented` until the rollouts work lands.

use std::future::Future;
use std::net::SocketAddr;

use sleuth_kit::{ErrorKind, GrpcService, KitError, ServeArgs, ServiceError, TelemetryArgs};
use sleuth_proto::rollout::v1::rollout_orchestrator_server::{RolloutOrchestrator, RolloutOrchestratorServer};
use sleuth_store::{Database, DatabaseArgs, RedisArgs, RedisStore};
use tokio::net::TcpListener;

/// Configuration, from flags or `SLEUTH_*` environment variables.
#[derive(clap::Parser, Debug, Clone)]
#[command(
    name = "rollout-orchestrator",
    version,
    about = "Owns training runs: fans episodes out to agents, scores them and publishes trajectory groups."
)]
pub struct Config {
    /// Address to listen on for gRPC.
    #[arg(long, env = "SLEUTH_LISTEN", default_value = "0.0.0.0:50051")]
    pub listen: SocketAddr,

    #[command(flatten)]
    pub database: DatabaseArgs,

    #[command(flatten)]
    pub redis: RedisArgs,

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
impl RolloutOrchestrator for Handlers {}

/// Serves the rollout-orchestrator on `listener` until `shutdown` resolves.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let database = Database::open(&config.database.database_url)?;
    let redis = RedisStore::open(&config.redis.redis_url)?;
    let service = GrpcService::new(RolloutOrchestratorServer::new(Handlers))
        .with_probe(database.probe())
        .with_probe(redis.probe());
    sleuth_kit::serve(service, &config.serve, listener, shutdown).await?;
    Ok(())
}
