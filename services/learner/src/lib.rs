//! The learner: consumes trajectory groups from Redis, runs sharded
//! GRPO-family updates or trajectory SFT, writes checkpoints and publishes
//! new weights to the policy servers.
//!
//! - [`advantage`] (shared with the orchestrator, from `sleuth-metrics`), [`loss`]: the maths of a step;
//! - [`batch`]: trajectory groups to samples;
//! - [`shard`], [`trainer`]: sharded training across ranks (collectives through c10d: `sleuth-c10d`);
//! - [`checkpoint`], [`publish`], [`records`]: what a step leaves behind;
//! - [`learn`]: the loop that ties them to the stream;
//! - [`torch_thread`]: the one thread every tensor operation runs on.

pub use sleuth_metrics::advantage;
pub mod batch;
pub mod checkpoint;
pub mod config;
pub mod copying;
mod fence;
pub mod fresh;
pub mod handlers;
pub mod imprint;
pub mod intake;
pub mod learn;
pub mod lineage;
pub mod loss;
pub mod publish;
pub mod records;
pub mod reply;
pub mod run_spec;
pub mod shard;
pub mod torch_thread;
pub mod trainer;

use std::future::Future;

use sleuth_kit::{ErrorKind, GrpcService, KitError, ServiceError};
use sleuth_proto::learner::v1::learner_server::LearnerServer;
use sleuth_store::{Database, RedisStore};
use tokio::net::TcpListener;

pub use crate::config::{Config, Mode};
pub use crate::handlers::{Handlers, Starting};
use crate::learn::{Plan, SharedProgress, Sources};
use crate::loss::{LossConfig, PolicyLoss};
use crate::shard::AdamW;
use crate::trainer::{Objective, Trainer, TrainerConfig};
use sleuth_c10d::{Collective, ProcessGroup, Rendezvous, Single};

/// Errors that stop the service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    Train(String),
    #[error(transparent)]
    Kit(#[from] KitError),
    #[error(transparent)]
    Store(#[from] sleuth_store::StoreError),
    #[error(transparent)]
    Discovery(#[from] sleuth_discovery::DiscoveryError),
    #[error(transparent)]
    Torch(#[from] sleuth_torch::TorchError),
    #[error(transparent)]
    Model(#[from] sleuth_model::ModelError),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error(transparent)]
    Collective(#[from] sleuth_c10d::CollectiveError),
}

impl From<trainer::TrainError> for Error {
    fn from(error: trainer::TrainError) -> Self {
        match error {
            trainer::TrainError::Collective(e) => Error::Collective(e),
            other => Error::Train(other.to_string()),
        }
    }
}

impl ServiceError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::Kit(error) => error.kind(),
            Error::Store(error) => error.kind(),
            Error::Discovery(error) => error.kind(),
            Error::Torch(error) => error.kind(),
            Error::Collective(_) => ErrorKind::Unavailable,
            Error::Train(_) | Error::Model(_) | Error::Checkpoint(_) => ErrorKind::Internal,
        }
    }
}

fn objective(config: &Config) -> Result<Objective, Error> {
    let invalid = |m: String| Error::InvalidArgument(m);
    Ok(match config.mode {
        Mode::Sft => Objective::Sft(config.loss_aggregation),
        Mode::Rl => Objective::Rl(LossConfig {
            policy: config.loss.parse::<PolicyLoss>().map_err(invalid)?,
            aggregation: config.loss_aggregation,
            tis_cap: (config.tis_cap > 0.0).then_some(config.tis_cap),
            kl_coef: config.kl_coef,
        }),
    })
}

/// Loads the policy (and, with a KL term, a frozen reference copy) on `device`.
fn load_trainer(config: &Config, device: tch::Device, collective: Box<dyn Collective>) -> Result<Trainer, Error> {
    let dir = config.model.directory();
    let model_config = sleuth_model::Config::from_file(&dir.join("config.json"))?;
    let dtype = config.model.compute_dtype(device);
    let load = || -> Result<_, Error> {
        let mut vars = tch::nn::VarStore::new(device);
        let model = sleuth_model::Model::new(&vars.root(), &model_config);
        sleuth_model::load_weights(&mut vars, &dir)?;
        vars.set_kind(dtype.kind);
        Ok((vars, model))
    };
    let (vars, model) = load()?;
    let reference = if config.kl_coef > 0.0 && config.mode == Mode::Rl {
        let (mut vars, model) = load()?;
        vars.freeze();
        Some((vars, model))
    } else {
        None
    };
    let trainer_config = TrainerConfig {
        objective: objective(config)?,
        optimizer: AdamW { lr: config.learning_rate, weight_decay: config.weight_decay, ..AdamW::default() },
        max_grad_norm: config.max_grad_norm,
        micro_batch: config.micro_batch as usize,
    };
    Ok(Trainer::new(vars, model, reference, trainer_config, collective))
}

/// The local directory of the start model at `uri`: the path itself, or a
/// scratch copy of an `s3://` prefix (returned too, so it outlives its use).
async fn start_model_dir(
    uri: &str,
    s3: &sleuth_store::S3Args,
) -> Result<(std::path::PathBuf, Option<tempfile::TempDir>), Error> {
    let invalid = |message: String| Error::InvalidArgument(format!("spec.policy.model_uri {uri:?}: {message}"));
    if !uri.starts_with("s3://") {
        let dir = std::path::PathBuf::from(uri.strip_prefix("file://").unwrap_or(uri));
        if !dir.join("config.json").is_file() {
            return Err(invalid("no config.json there (an HF model directory is expected)".into()));
        }
        return Ok((dir, None));
    }
    let scratch = tempfile::tempdir().map_err(|e| Error::Train(format!("scratch directory: {e}")))?;
    tracing::info!(uri, "fetching the run's start model");
    // Unbounded: the run's spec, which only the admin scope creates, names it.
    sleuth_store::object::fetch_model_dir(uri, s3, scratch.path(), None).await.map_err(|e| invalid(e.to_string()))?;
    Ok((scratch.path().to_owned(), Some(scratch)))
}

/// Serves the learner on `listener` from the start (NOT_SERVING while it
/// starts, see [`Starting`]) and trains until `max_steps` or `shutdown`.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    // Before any client is made: every mesh call of this process uses it.
    sleuth_kit::tls::install(&config.serve.tls)?;
    sleuth_kit::names::check_name("run_id", &config.run_id)?;
    let redis = RedisStore::from_args(&config.redis)?;
    redis.warn_unless_durable();
    let database = Database::open(&config.database.database_url)?;
    let device = config.model.device.resolve()?;
    let starting = Starting::new(match &config.orchestrator {
        Some(orchestrator) => format!("waiting for run {} on the orchestrator at {orchestrator}", config.run_id),
        None => format!("loading the model for run {}", config.run_id),
    });
    let service = GrpcService::new(sleuth_kit::sized!(LearnerServer::new(starting.clone())))
        .with_probe(starting.probe())
        .with_probe(redis.probe())
        .with_probe(database.probe())
        .with_probe(sleuth_torch::device_probe(device));
    let (served_tx, served_rx) = tokio::sync::oneshot::channel::<()>();
    let serve = config.serve.clone();
    let server = tokio::spawn(async move {
        sleuth_kit::serve(service, &serve, listener, async {
            let _ = served_rx.await;
        })
        .await
    });
    let trained = start_and_train(config, redis, database, device, &starting, shutdown).await;
    let _ = served_tx.send(());
    server.await.map_err(|e| Error::Train(e.to_string()))??;
    trained
}

/// Everything between serving and the end of training, each step told to
/// `starting`; returns early (Ok) when `shutdown` comes while it waits for
/// its run.
async fn start_and_train(
    mut config: Config,
    redis: RedisStore,
    database: Database,
    device: tch::Device,
    starting: &Starting,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let mut shutdown = std::pin::pin!(shutdown);
    if let Some(orchestrator) = config.orchestrator.clone() {
        let token = config.serve.bearer_token()?;
        let spec = tokio::select! {
            spec = run_spec::fetch(&orchestrator, token.as_ref(), &config.run_id) => spec?,
            () = &mut shutdown => return Ok(()), // stopped while waiting for its run
        };
        run_spec::apply(&mut config, &spec)?;
        if let Some(source) = config.start_from_run.clone() {
            starting.step(format!("exporting the final policy of run {source}, which this run starts from"));
            let source = run_spec::fetch_run(&orchestrator, token.as_ref(), &source).await?;
            let store = lineage::run_store(&config.checkpoint_uri, &source.run_id, &config.s3).await?;
            config.start_model_uri = Some(lineage::final_export(&source, &store).await?);
        }
    }
    // The spec's start model, fetched when it is in S3; the copy lives as long as the learner.
    let _start_model = match config.start_model_uri.clone() {
        Some(uri) => {
            starting.step(format!("fetching the start model {uri}"));
            let (dir, fetched) = start_model_dir(&uri, &config.s3).await?;
            config.model.dir = Some(dir);
            fetched
        }
        None => None,
    };
    let estimator = config.advantage.parse().map_err(Error::InvalidArgument)?;
    objective(&config)?;
    let threads = config.torch_threads;
    torch_thread::run(move || sleuth_torch::set_intra_op_threads(threads)).await?;
    let checkpoints = lineage::run_store(&config.checkpoint_uri, &config.run_id, &config.s3).await?;
    let token = config.serve.bearer_token()?;
    let collective: Box<dyn Collective> = match &Rendezvous::from_env()? {
        Some(r) if r.world_size > 1 => {
            starting.step(format!(
                "rank {} of {}: meeting the other ranks at {}:{}",
                r.rank, r.world_size, r.master_addr, r.master_port
            ));
            let r = r.clone();
            Box::new(
                tokio::task::spawn_blocking(move || ProcessGroup::connect(&r, device))
                    .await
                    .map_err(|e| Error::Train(e.to_string()))??,
            )
        }
        _ => Box::new(Single),
    };
    let (rank, world) = (collective.rank(), collective.world());
    let model_dir = config.model.directory();
    let model_config: serde_json::Value = std::fs::read_to_string(model_dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .ok_or_else(|| Error::InvalidArgument(format!("model {} has no readable config.json", model_dir.display())))?;
    starting.step(format!("loading the policy {} onto {device:?}", model_dir.display()));
    let trainer_settings = config.clone();
    let trainer = torch_thread::run(move || load_trainer(&trainer_settings, device, collective)).await??;
    let progress = SharedProgress::default();

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let training = if rank == 0 {
        let plan = Plan {
            run_id: config.run_id.clone(),
            sft: config.mode == Mode::Sft,
            sft_min_reward: config.sft_min_reward,
            rehearsal: match &config.rehearsal {
                Some(spec) => Some(std::sync::Arc::new(copying::Rehearsal::new(&model_dir, spec)?)),
                None => None,
            },
            learning_rate: config.learning_rate,
            lr_schedule: config.lr_schedule,
            estimator,
            global_batch_size: config.global_batch_size as usize,
            max_staleness: config.max_staleness,
            checkpoint_every: config.checkpoint_every,
            max_steps: config.max_steps,
            start_model_uri: config.start_model_uri.clone(),
            validation: config.validation,
        };
        let publisher = publish::Publisher::new(
            &config.policy_servers,
            config.publish.token()?.or(token.clone()).as_ref(),
            config.publish_timeout,
        )?;
        // Pods of a `kube://` Service join (and leave) as they become ready.
        publisher.follow(sleuth_discovery::discover("policy_servers", &config.policy_servers).await?);
        let sources = Sources {
            redis: redis.clone(),
            patience: config.fault_patience,
            lease_ttl: config.lease_ttl,
            checkpoints: checkpoints.clone(),
            keep_checkpoints: config.keep_checkpoints,
            database: database.clone(),
            publisher,
            model_dir,
            model_config,
            run: match &config.orchestrator {
                Some(address) => Some(run_spec::RunRecord::new(address, token.as_ref(), &config.run_id)?),
                None => None,
            },
        };
        tokio::spawn(learn::lead(trainer, plan, sources, progress.clone(), stopped))
    } else {
        tokio::spawn(learn::follow(trainer, checkpoints.clone()))
    };

    starting.ready(Handlers {
        run_id: config.run_id.clone(),
        mode: config.mode,
        rank,
        world,
        progress,
        checkpoints,
        redis: redis.clone(),
    });
    // Training ends at max_steps (or on error); shutdown stops it between
    // steps, after a final checkpoint of the steps trained since the last one.
    let mut training = training;
    let trained = tokio::select! {
        trained = &mut training => trained,
        () = &mut shutdown => {
            let _ = stop.send(true);
            training.await
        }
    };
    trained.map_err(|e| Error::Train(format!("training task failed: {e}")))?
}
