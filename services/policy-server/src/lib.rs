//! The policy server: LLM inference in libtorch with per-token behaviour and
//! model logprobs, continuous batching and versioned weight updates.
//!
//! - [`engine`] is the handle to the scheduler: jobs, events, weight updates;
//!   the scheduler thread itself (`scheduler`, see its docs for the batching
//!   policy) owns the model, with the prefix cache in `sessions`;
//! - [`handlers`] is the gRPC surface: `Generate`, `GenerateStream`,
//!   `UpdateWeights`, `GetModelInfo`.
//!
//! - [`metrics`] are served at `/metrics` on the gRPC port.

pub mod engine;
pub mod error;
pub mod handlers;
pub mod metrics;
mod scheduler;
mod sessions;
pub mod stop;
pub mod weights;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::FutureExt;
use sleuth_kit::{GrpcService, ServeArgs, TelemetryArgs};
use sleuth_proto::policy::v1::policy_server_server::PolicyServerServer;
use tokio::net::TcpListener;

pub use error::Error;

use crate::engine::{Engine, Limits};

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

    /// The model served, where, and in which dtype (parameters and compute).
    #[command(flatten)]
    pub model: sleuth_torch::ModelArgs,

    /// libtorch intra-op threads (0: OMP_NUM_THREADS when set, else the CPUs
    /// this process may use, a pod's CPU limit included).
    #[arg(long, env = "SLEUTH_TORCH_THREADS", default_value_t = 0)]
    pub torch_threads: u32,

    /// Sequences decoded together.
    #[arg(long, env = "SLEUTH_MAX_BATCH", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_batch: u32,

    /// KV-cache budget in tokens (prompt + max_new_tokens of every running sequence).
    #[arg(long, env = "SLEUTH_KV_BUDGET_TOKENS", default_value_t = 65536)]
    pub kv_budget_tokens: u32,

    /// Requests allowed to wait for the batch; more are refused with ResourceExhausted.
    #[arg(long, env = "SLEUTH_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: u32,

    /// Tokens of finished turns kept for prefix reuse by session (least recently used
    /// evicted first; 0 disables reuse).
    #[arg(long, env = "SLEUTH_PREFIX_CACHE_TOKENS", default_value_t = 65536)]
    pub prefix_cache_tokens: u32,

    /// Where `s3://` checkpoints named in UpdateWeights are read from.
    #[command(flatten)]
    pub s3: sleuth_store::S3Args,

    /// Directories a local `checkpoint_uri` in UpdateWeights may lie in
    /// (comma separated). Unset: local checkpoints are refused, so a caller
    /// can never make the server read an arbitrary directory of its disk.
    #[arg(long, env = "SLEUTH_CHECKPOINT_ROOTS", value_delimiter = ',')]
    pub checkpoint_roots: Vec<PathBuf>,

    /// The token that alone opens `UpdateWeights` (see `sleuth_kit::auth`).
    #[command(flatten)]
    pub publish: sleuth_kit::PublishTokenArgs,

    #[command(flatten)]
    pub serve: ServeArgs,

    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// The model directory configured, or the one `make setup` imports.
pub fn model_dir(config: &Config) -> Result<PathBuf, Error> {
    if let Some(dir) = &config.model.dir {
        return Ok(dir.clone());
    }
    let default = sleuth_kit::config::default_model_dir();
    if default.join("config.json").is_file() {
        Ok(default)
    } else {
        Err(Error::InvalidArgument(format!(
            "no model: set --model (SLEUTH_MODEL); {} does not exist",
            default.display()
        )))
    }
}

/// Serves the policy server on `listener` until `shutdown` resolves. The
/// model loads in the background; the server reports NOT_SERVING until it has.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    // Before any client is made: every mesh call of this process uses it.
    sleuth_kit::tls::install(&config.serve.tls)?;
    let device = config.model.device.resolve()?;
    let dir = model_dir(&config)?;
    let dtype = config.model.compute_dtype(device);
    let kind = dtype.kind;
    let limits = Limits {
        max_batch: config.max_batch as usize,
        kv_budget_tokens: config.kv_budget_tokens as usize,
        max_queue: config.max_queue as usize,
        prefix_cache_tokens: config.prefix_cache_tokens as usize,
        torch_threads: config.torch_threads as usize,
    };
    let engine: Arc<OnceLock<Result<Engine, String>>> = Arc::default();
    let loading = engine.clone();
    tokio::task::spawn_blocking(move || {
        let started = std::time::Instant::now();
        let result = Engine::start(dir.clone(), device, kind, limits).map_err(|e| e.to_string());
        match &result {
            Ok(_) => tracing::info!(model = %dir.display(), seconds = started.elapsed().as_secs_f64(), "model loaded"),
            Err(error) => tracing::error!(model = %dir.display(), %error, "cannot load the model"),
        }
        let _ = loading.set(result);
    });
    let ready = engine.clone();
    let probe = sleuth_kit::health::probe_fn("model", move || {
        let state = match ready.get() {
            None => Err("loading the model".to_owned()),
            Some(Ok(engine)) => engine.down().map_or(Ok(()), |reason| Err(reason.to_owned())),
            Some(Err(error)) => Err(error.clone()),
        };
        async move { state }.boxed()
    });
    let watched = engine.clone();
    let service = GrpcService::new(sleuth_kit::sized!(PolicyServerServer::new(handlers::Handlers {
        engine,
        s3: config.s3.clone(),
        checkpoint_roots: sleuth_store::LocalRoots {
            roots: config.checkpoint_roots.clone(),
            setting: "SLEUTH_CHECKPOINT_ROOTS",
        },
    })))
    .with_probe(sleuth_torch::device_probe(device))
    .with_probe(probe)
    .with_scope(&["UpdateWeights"], config.publish.token()?, sleuth_kit::PublishTokenArgs::SETTING);
    let down = move || match watched.get() {
        Some(Ok(engine)) => engine.down().map(str::to_owned),
        _ => None,
    };
    let died = {
        let down = down.clone();
        async move {
            while down().is_none() {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            // Health already reports NOT_SERVING and calls fail UNAVAILABLE:
            // give load balancers time to move callers away, then exit so the
            // supervisor (kubelet, systemd) restarts the process with a new scheduler.
            tokio::time::sleep(DRAIN_BEFORE_EXIT).await;
        }
    };
    let shutdown = async move {
        tokio::select! {
            () = shutdown => {}
            () = died => {}
        }
    };
    sleuth_kit::serve(service, &config.serve, listener, shutdown).await?;
    match down() {
        Some(reason) => Err(Error::SchedulerDown(reason)),
        None => Ok(()),
    }
}

/// How long a policy server whose scheduler died keeps answering (NOT_SERVING,
/// UNAVAILABLE) before it exits.
const DRAIN_BEFORE_EXIT: Duration = Duration::from_secs(15);
