//! The learner: consumes trajectory groups from Redis, runs sharded
//! GRPO-family updates or trajectory SFT, writes checkpoints and publishes
//! new weights to the policy servers.
//!
//! Status: the service starts and reports SERVING once Redis answers and
//! libtorch computes on the configured device; `GetStatus` and
//! `ListCheckpoints` answer `Unimplemented` until the learner work lands.

pub mod advantage;
pub mod batch;
pub mod collective;
pub mod loss;
pub mod shard;
pub mod trainer;

use std::future::Future;
use std::net::SocketAddr;

use sleuth_kit::{ErrorKind, GrpcService, KitError, ServeArgs, ServiceError, TelemetryArgs};
use sleuth_proto::learner::v1::learner_server::{Learner, LearnerServer};
use sleuth_store::{RedisArgs, RedisStore};
use sleuth_torch::DeviceSpec;
use tokio::net::TcpListener;

/// Configuration, from flags or `SLEUTH_*` environment variables.
#[derive(clap::Parser, Debug, Clone)]
#[command(
    name = "learner",
    version,
    about = "Trains the policy from trajectory groups (GRPO family, trajectory SFT) and publishes weights."
)]
pub struct Config {
    /// Address to listen on for gRPC.
    #[arg(long, env = "SLEUTH_LISTEN", default_value = "0.0.0.0:50056")]
    pub listen: SocketAddr,

    #[command(flatten)]
    pub redis: RedisArgs,

    /// Device to train on: auto (CUDA when present), cpu, cuda or cuda:N.
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
    Store(#[from] sleuth_store::StoreError),
    #[error(transparent)]
    Torch(#[from] sleuth_torch::TorchError),
}

impl ServiceError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Kit(error) => error.kind(),
            Error::Store(error) => error.kind(),
            Error::Torch(error) => error.kind(),
        }
    }
}

/// The RPC handlers. RPCs not overridden here answer `Unimplemented`.
#[derive(Debug, Clone, Default)]
pub struct Handlers;

#[tonic::async_trait]
impl Learner for Handlers {}

/// Serves the learner on `listener` until `shutdown` resolves.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let redis = RedisStore::open(&config.redis.redis_url)?;
    let device = config.device.resolve()?;
    let service = GrpcService::new(LearnerServer::new(Handlers))
        .with_probe(redis.probe())
        .with_probe(sleuth_torch::device_probe(device));
    sleuth_kit::serve(service, &config.serve, listener, shutdown).await?;
    Ok(())
}
