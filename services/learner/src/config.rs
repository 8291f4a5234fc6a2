//! The learner's configuration, from flags or `SLEUTH_*` environment
//! variables: infrastructure (addresses, rank, storage, device) and, for a
//! learner without an orchestrator, the training settings a run's spec
//! otherwise gives (see `run_spec`).

use std::net::SocketAddr;

use sleuth_kit::{ServeArgs, TelemetryArgs};
use sleuth_store::{DatabaseArgs, RedisArgs, S3Args};

use crate::loss::Aggregation;

/// What the learner trains with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Policy gradient from group advantages.
    Rl,
    /// Cross-entropy on teacher trajectories (assistant tokens only).
    Sft,
}

/// Configuration, from flags or `SLEUTH_*` environment variables. Ranks
/// come from `WORLD_SIZE`, `RANK`, `MASTER_ADDR`, `MASTER_PORT` (one rank when unset).
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

    /// The run whose trajectory stream to train on.
    #[arg(long, env = "SLEUTH_RUN_ID")]
    pub run_id: String,

    /// The rollout orchestrator that owns the run (host:port). When set, the
    /// learner reads the run's spec from it at start and takes every training
    /// setting from there (see `run_spec`); the flags below that the spec
    /// covers may then not be set.
    #[arg(long, env = "SLEUTH_ORCHESTRATOR")]
    pub orchestrator: Option<String>,

    #[command(flatten)]
    pub redis: RedisArgs,

    /// How long the learner rides out Redis being unreachable (a restart, a
    /// failover) before it stops with an error; it resumes from its last
    /// checkpoint when started again.
    #[arg(long, env = "SLEUTH_FAULT_PATIENCE", default_value = "2m", value_parser = humantime::parse_duration)]
    pub fault_patience: std::time::Duration,

    /// How long the run's learner lease lasts unless renewed (every quarter
    /// of it). One learner trains a run at a time: another waits for the
    /// lease; a learner that was stuck longer than this finds its lease
    /// taken and stops.
    #[arg(long, env = "SLEUTH_LEASE_TTL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub lease_ttl: std::time::Duration,

    #[command(flatten)]
    pub database: DatabaseArgs,

    /// The initial policy (unless the run's spec names one), and where and in
    /// which dtype to train it.
    #[command(flatten)]
    pub model: sleuth_torch::ModelArgs,

    /// rl or sft. With an orchestrator the spec decides: a run whose agent
    /// has a teacher is trajectory SFT.
    #[arg(long, env = "SLEUTH_MODE", value_enum, conflicts_with = "orchestrator", default_value = "rl")]
    pub mode: Mode,

    /// Trajectory SFT trains on the episodes whose reward is at least this
    /// (the spec's `training.sft_min_reward` with an orchestrator).
    #[arg(long, env = "SLEUTH_SFT_MIN_REWARD", conflicts_with = "orchestrator", default_value_t = f64::NEG_INFINITY, allow_negative_numbers = true)]
    pub sft_min_reward: f64,

    /// grpo, dr_grpo, rloo, grpo_pass_at_k[:K].
    #[arg(long, env = "SLEUTH_ADVANTAGE", conflicts_with = "orchestrator", default_value = "grpo")]
    pub advantage: String,

    /// ppo, cispo, importance_sampling.
    #[arg(long, env = "SLEUTH_LOSS", conflicts_with = "orchestrator", default_value = "ppo")]
    pub loss: String,

    #[arg(long, env = "SLEUTH_LOSS_AGGREGATION", value_enum, default_value = "token-mean")]
    pub loss_aggregation: Aggregation,

    /// Truncated importance-sampling cap for train/inference mismatch; 0 = off.
    #[arg(long, env = "SLEUTH_TIS_CAP", default_value_t = 2.0)]
    pub tis_cap: f64,

    /// KL coefficient to the initial (frozen) policy; 0 = off (no reference copy is held).
    #[arg(long, env = "SLEUTH_KL_COEF", conflicts_with = "orchestrator", default_value_t = 0.0)]
    pub kl_coef: f64,

    #[arg(long, env = "SLEUTH_LEARNING_RATE", conflicts_with = "orchestrator", default_value_t = 1e-6)]
    pub learning_rate: f64,

    #[arg(long, env = "SLEUTH_WEIGHT_DECAY", default_value_t = 0.0)]
    pub weight_decay: f64,

    /// Global gradient-norm clip; 0 = off.
    #[arg(long, env = "SLEUTH_MAX_GRAD_NORM", default_value_t = 1.0)]
    pub max_grad_norm: f64,

    /// Episodes per forward/backward pass (gradient accumulation over the rest).
    #[arg(long, env = "SLEUTH_MICRO_BATCH", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub micro_batch: u32,

    /// Trainable groups (prompts) per optimizer step.
    #[arg(long, env = "SLEUTH_GLOBAL_BATCH_SIZE", conflicts_with = "orchestrator", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub global_batch_size: u32,

    /// Groups produced by a policy more than this many versions old are dropped.
    #[arg(long, env = "SLEUTH_MAX_STALENESS", conflicts_with = "orchestrator", default_value_t = 1)]
    pub max_staleness: u64,

    /// Checkpoint every this many steps (and at max_steps).
    #[arg(long, env = "SLEUTH_CHECKPOINT_EVERY", conflicts_with = "orchestrator", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_every: u64,

    /// Checkpoints kept: the newest this many, plus the best by validation
    /// when the run has an orchestrator; older ones are deleted after each
    /// new one is sealed. 0 keeps every checkpoint.
    #[arg(long, env = "SLEUTH_KEEP_CHECKPOINTS", default_value_t = 3)]
    pub keep_checkpoints: usize,

    /// Where checkpoints go: a directory or s3://bucket/prefix.
    #[arg(long, env = "SLEUTH_CHECKPOINT_URI", default_value = "checkpoints")]
    pub checkpoint_uri: String,

    #[command(flatten)]
    pub s3: S3Args,

    /// The run's start model (the spec's `policy.model_uri`: a directory or
    /// s3:// prefix), never a flag: the learner starts from it instead of
    /// `model` and publishes it as the run's first version, so no episode
    /// of the run is sampled by the model the policy servers started with.
    #[arg(skip)]
    pub start_model_uri: Option<String>,

    /// The spec's `policy.from_run`: the run whose policy this one starts
    /// from (resolved into `start_model_uri`, see [`crate::lineage`]).
    #[arg(skip)]
    pub start_from_run: Option<String>,

    /// The versions the run's orchestrator validates (the spec's
    /// `validation` and `training.eval_every`); the learner steps past none
    /// before it is validated.
    #[arg(skip)]
    pub validation: Option<sleuth_metrics::validation::Schedule>,

    /// Copy pre-training's conversations added to every trajectory SFT step
    /// (the spec's `training.copy_rehearsal`, see [`crate::copying::Rehearsal`]).
    #[arg(skip)]
    pub rehearsal: Option<crate::copying::RehearsalSpec>,

    /// How the learning rate moves over the run's steps (the spec's
    /// `training.lr_schedule`; without an orchestrator, constant).
    #[arg(skip)]
    pub lr_schedule: sleuth_metrics::schedule::LrSchedule,

    /// Stop after this many optimizer steps of this run (versions published
    /// without training, and earlier runs' versions, do not count); 0 =
    /// train until shut down.
    #[arg(long, env = "SLEUTH_MAX_STEPS", default_value_t = 0)]
    pub max_steps: u64,

    /// Policy servers to publish each step's weights to, comma separated:
    /// `host:port`, or `kube://SERVICE[.NAMESPACE]:PORT` for a Kubernetes
    /// Service's ready pods (one that joins is brought to the current version).
    #[arg(long, env = "SLEUTH_POLICY_SERVERS", value_delimiter = ',')]
    pub policy_servers: Vec<String>,

    /// Deadline of one policy server's UpdateWeights (weights of the whole
    /// model streamed, or a checkpoint loaded).
    #[arg(long, env = "SLEUTH_PUBLISH_TIMEOUT", default_value = "10m", value_parser = humantime::parse_duration)]
    pub publish_timeout: std::time::Duration,

    /// libtorch intra-op threads (0: OMP_NUM_THREADS when set, else the CPUs
    /// this process may use, a pod's CPU limit included).
    #[arg(long, env = "SLEUTH_TORCH_THREADS", default_value_t = 0)]
    pub torch_threads: usize,

    /// The token sent on `UpdateWeights` when publication has its own scope
    /// (see `sleuth_kit::auth`); unset: the mesh token.
    #[command(flatten)]
    pub publish: sleuth_kit::PublishTokenArgs,

    #[command(flatten)]
    pub serve: ServeArgs,

    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}
