//! The handle to the policy's scheduler (the `scheduler` module) and what
//! passes between them: jobs, their events, weight updates and limits.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use sleuth_model::Config;
use sleuth_model::sampling::{Sampled, Sampling};
use tch::{Device, Kind};
use tokenizers::Tokenizer;
use tokio::sync::{mpsc, oneshot};

use crate::error::Error;
use crate::scheduler::Scheduler;
pub use crate::stop::StopStrings;

/// A validated generation request.
#[derive(Debug, Clone)]
pub struct Job {
    /// Turns of one episode share a session so their common prefix is reused; empty = none.
    pub session: String,
    pub prompt: Vec<i64>,
    pub sampling: Sampling,
    pub seed: u64,
    pub max_new_tokens: usize,
    pub stop_tokens: Vec<u32>,
    pub stop_strings: Option<StopStrings>,
    /// The oldest weights version that may sample this job (a training run's
    /// current version); refused with [`Error::Behind`] while older ones are served.
    pub min_version: u64,
    /// The run whose weights must sample this job (empty: any); see
    /// [`ModelFacts::may_sample`].
    pub run: String,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

/// What a generation streams back.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token { sampled: Sampled, version: u64 },
    Done { finish: Finish, prompt_tokens: usize, cached_prompt_tokens: usize },
}

/// Facts about the served model.
#[derive(Debug, Clone)]
pub struct ModelFacts {
    pub model_id: String,
    pub architecture: String,
    pub num_parameters: u64,
    pub kind: Kind,
    pub device: Device,
    pub vocab_size: u32,
    pub max_position_embeddings: u32,
    pub eos_token_ids: Vec<u32>,
    /// The served weights' version: 0 for the model the server started with.
    pub version: u64,
    /// The run whose weights are served (empty: the model the server started
    /// with, or weights of no run).
    pub run: String,
    pub kv_budget_tokens: u64,
    /// Every parameter's name and shape: what `UpdateWeights` may stream.
    pub parameters: std::sync::Arc<crate::weights::Parameters>,
}

impl ModelFacts {
    /// Whether the served weights may sample `job`: its run's weights at
    /// `min_version` or newer, or, while its run has published nothing
    /// (`min_version` 0), also weights of no run. Version numbers count each
    /// run's own steps, so another run's version says nothing of this one's.
    /// The one rule for a job's admission and for jobs a weight update catches.
    pub fn may_sample(&self, job: &Job) -> Result<(), Error> {
        let same_run = job.run.is_empty() || job.run == self.run;
        let serves = if job.min_version == 0 {
            same_run || self.run.is_empty()
        } else {
            same_run && self.version >= job.min_version
        };
        if serves {
            return Ok(());
        }
        let serving = match (self.run.as_str(), self.version) {
            ("", 0) => "the model it started with".to_owned(),
            ("", version) => format!("policy version {version} of no run"),
            (run, version) => format!("run {run:?}'s policy version {version}"),
        };
        let needed = match (job.run.as_str(), job.min_version) {
            ("", version) => format!("at least version {version}"),
            (run, 0) => format!("run {run:?}'s weights or the model the server started with"),
            (run, version) => format!("run {run:?}'s weights at version {version} or newer"),
        };
        Err(Error::Behind { serving, needed })
    }

    /// Whether weights of `run` at `version` may replace the served ones: a
    /// run's versions only go forward; another run's weights (or the model
    /// the server started with) are replaced whatever their number.
    pub fn may_take(&self, run: &str, version: u64) -> Result<(), Error> {
        if version == 0 || (run == self.run && version <= self.version) {
            return Err(Error::StaleVersion { offered: version, served: self.version });
        }
        Ok(())
    }
}

/// New weights: named tensors (HF names) or a checkpoint directory.
pub enum Weights {
    Tensors(Vec<RawTensor>),
    Checkpoint(PathBuf),
}

/// A tensor as received, still bytes: it becomes a libtorch tensor on the
/// scheduler thread (see [`Engine::start`] for why no other thread runs
/// libtorch operations).
pub struct RawTensor {
    pub name: String,
    pub kind: Kind,
    pub shape: Vec<i64>,
    /// Little-endian, row-major, `shape.product() * kind.elt_size_in_bytes()` bytes.
    pub data: Vec<u8>,
}

pub(crate) enum Command {
    Generate { job: Job, events: mpsc::UnboundedSender<Result<Event, Error>> },
    Update { run: String, version: u64, weights: Weights, reply: oneshot::Sender<Result<u64, Error>> },
    Facts { reply: oneshot::Sender<ModelFacts> },
}

/// Limits of the scheduler.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Sequences decoded together.
    pub max_batch: usize,
    /// Tokens (prompt + max new) reserved across running sequences.
    pub kv_budget_tokens: usize,
    /// Requests waiting beyond the batch.
    pub max_queue: usize,
    /// Tokens of finished sequences kept for prefix reuse (0 disables it).
    pub prefix_cache_tokens: usize,
    /// libtorch intra-op threads; 0: `OMP_NUM_THREADS` when set, else the
    /// CPUs this process may use.
    pub torch_threads: usize,
}

/// Handle to the scheduler; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    commands: mpsc::UnboundedSender<Command>,
    /// Why the scheduler thread stopped, once it has (a libtorch or device
    /// error panicked it): health reports NOT_SERVING with it, and every call
    /// fails UNAVAILABLE so callers go to another replica.
    down: Arc<OnceLock<String>>,
    pub config: Config,
    pub limits: Limits,
    /// The model directory's tokenizer, when it has one (for stop strings).
    pub tokenizer: Option<Arc<Tokenizer>>,
}

impl Engine {
    /// Starts the scheduler thread, which loads the HF model in `dir`; returns
    /// once the model is loaded.
    ///
    /// Every libtorch operation of the server runs on that one thread, loading
    /// included. libtorch's OpenMP keeps a thread team per calling thread, and
    /// once the process has more team threads than cores libgomp throttles its
    /// spin-waits: a second team (from loading on the caller's thread) made each
    /// decode step 1.6-1.8x slower on 2 cores (measured).
    pub fn start(dir: PathBuf, device: Device, kind: Kind, limits: Limits) -> Result<Self, Error> {
        let config = Config::from_file(&dir.join("config.json"))?;
        let tokenizer_file = dir.join("tokenizer.json");
        let tokenizer = tokenizer_file
            .is_file()
            .then(|| Tokenizer::from_file(&tokenizer_file))
            .transpose()
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", tokenizer_file.display())))?
            .map(Arc::new);
        let (commands, receiver) = mpsc::unbounded_channel();
        let (loaded, ready) = std::sync::mpsc::sync_channel(1);
        let thread_config = config.clone();
        let down = Arc::new(OnceLock::new());
        let stopped = down.clone();
        std::thread::Builder::new()
            .name("policy-scheduler".to_owned())
            .spawn(move || {
                let scheduler = match Scheduler::load(&dir, thread_config, device, kind, limits) {
                    Ok(scheduler) => scheduler,
                    Err(error) => {
                        let _ = loaded.send(Err(error));
                        return;
                    }
                };
                let _ = loaded.send(Ok(()));
                // A panic (tch turns every libtorch error into one) ends the
                // thread; the reason is kept before the command channel closes,
                // so nobody sees the channel closed without it.
                let run = std::panic::AssertUnwindSafe(|| tch::no_grad(|| scheduler.run(receiver)));
                if let Err(panic) = std::panic::catch_unwind(run) {
                    let reason = panic
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| panic.downcast_ref::<&str>().copied())
                        .unwrap_or("a panic without a message");
                    tracing::error!(%reason, "the scheduler thread died: this replica serves nothing until restarted");
                    let _ = stopped.set(format!("the scheduler thread died: {reason}"));
                }
            })
            .map_err(|e| Error::Internal(format!("cannot start the scheduler thread: {e}")))?;
        ready.recv().map_err(|_| Error::Internal("the scheduler thread died loading the model".into()))??;
        Ok(Self { commands, down, config, limits, tokenizer })
    }

    /// Why the scheduler stopped, if it has.
    pub fn down(&self) -> Option<&str> {
        self.down.get().map(String::as_str)
    }

    /// The error for a call the scheduler can no longer answer.
    pub fn stopped(&self) -> Error {
        Error::SchedulerDown(self.down().unwrap_or("the scheduler stopped").to_owned())
    }

    /// Starts a generation; tokens arrive on the returned channel as they are sampled.
    pub fn generate(&self, job: Job) -> Result<mpsc::UnboundedReceiver<Result<Event, Error>>, Error> {
        let (events, receiver) = mpsc::unbounded_channel();
        self.send(Command::Generate { job, events })?;
        Ok(receiver)
    }

    /// Replaces the weights with `run`'s `version` between two decode steps
    /// (see [`ModelFacts::may_take`]); returns the version now served.
    pub async fn update(&self, run: String, version: u64, weights: Weights) -> Result<u64, Error> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Update { run, version, weights, reply })?;
        answer.await.map_err(|_| self.stopped())?
    }

    pub async fn facts(&self) -> Result<ModelFacts, Error> {
        let (reply, answer) = oneshot::channel();
        self.send(Command::Facts { reply })?;
        answer.await.map_err(|_| self.stopped())
    }

    fn send(&self, command: Command) -> Result<(), Error> {
        self.commands.send(command).map_err(|_| self.stopped())
    }
}
