//! What the learner's process tests share: a tiny model, the run's stream
//! entries, and learner processes on real Redis, SQLite and a checkpoint folder.

#![allow(dead_code)] // each test file uses its own part

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use prost::Message;
use sleuth_proto::common::v1::{Episode, SegmentKind, Trace, TraceSegment, TrajectoryGroup};
use tch::Tensor;

/// Steps of a whole run, and groups per step.
pub const STEPS: u64 = 6;
pub const BATCH: usize = 2;

pub fn tiny_model(dir: &Path) -> Result<()> {
    let config = serde_json::json!({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": true, "eos_token_id": 63
    });
    sleuth_model::export::write_random(&config, dir, dir, 9)?;
    Ok(())
}

/// Group `index`: 4 episodes of varied lengths and rewards (or all equal when `flat`).
pub fn group(index: usize, flat: bool) -> TrajectoryGroup {
    let episodes = (0..4)
        .map(|e| {
            let sampled: Vec<u32> =
                (0..3 + (index + e) % 5).map(|t| ((index * 7 + e * 3 + t * 11) % 60) as u32).collect();
            Episode {
                episode_id: format!("g{index}-e{e}"),
                reward: if flat { 0.5 } else { (e % 2) as f64 + 0.1 * index as f64 },
                trace: Some(Trace {
                    segments: vec![
                        TraceSegment {
                            kind: SegmentKind::Prompt as i32,
                            token_ids: vec![1, 2 + index as u32 % 50, 3],
                            loss_mask: vec![0; 3],
                            ..Default::default()
                        },
                        TraceSegment {
                            kind: SegmentKind::Policy as i32,
                            loss_mask: vec![1; sampled.len()],
                            logprobs: vec![-4.1; sampled.len()],
                            token_ids: sampled,
                            ..Default::default()
                        },
                    ],
                    ..Default::default()
                }),
                ..Default::default()
            }
        })
        .collect();
    TrajectoryGroup { run_id: "r".into(), group_id: format!("g{index}"), episodes, ..Default::default() }
}

/// The stream entries of the whole run, in order: 12 trainable groups plus
/// a corrupt entry and a flat group early on.
pub fn entries() -> Vec<Vec<u8>> {
    let mut entries: Vec<Vec<u8>> = (0..BATCH * STEPS as usize).map(|i| group(i, false).encode_to_vec()).collect();
    entries.insert(1, b"not a group".to_vec());
    entries.insert(3, group(99, true).encode_to_vec());
    entries
}

pub struct Env {
    pub redis_url: String,
    pub database: String,
    pub model: PathBuf,
}

impl Env {
    /// Redis, a SQLite database and a tiny model under `scratch`; the server
    /// runs until the returned handle is dropped.
    pub fn start(scratch: &Path) -> Result<(Self, sleuth_testkit::TestServer)> {
        let redis_server = sleuth_testkit::redis()?;
        let env = Env {
            redis_url: sleuth_testkit::redis_url(&redis_server),
            database: format!("sqlite://{}", scratch.join("runs.db").display()),
            model: scratch.join("model"),
        };
        tiny_model(&env.model)?;
        Ok((env, redis_server))
    }
}

pub fn learner(env: &Env, run: &str, checkpoints: &Path) -> Result<Child> {
    learner_until(env, run, checkpoints, STEPS)
}

pub fn learner_until(env: &Env, run: &str, checkpoints: &Path, max_steps: u64) -> Result<Child> {
    Ok(learner_command(env, run, checkpoints, max_steps)?.spawn()?)
}

/// A learner process for `run`, whose checkpoints go to the folder
/// `checkpoints` (named after the run: its parent is the checkpoint store).
pub fn learner_command(env: &Env, run: &str, checkpoints: &Path, max_steps: u64) -> Result<Command> {
    anyhow::ensure!(checkpoints.ends_with(run), "{} is not the folder of run {run}", checkpoints.display());
    let port = sleuth_testkit::free_port()?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_learner"));
    command
        .args(["--listen", &format!("127.0.0.1:{port}"), "--run-id", run, "--device", "cpu", "--dtype", "f32"])
        .args(["--redis-url", &env.redis_url, "--database-url", &env.database])
        .arg("--model")
        .arg(&env.model)
        .arg("--checkpoint-uri")
        .arg(checkpoints.parent().context("a checkpoint store")?)
        .args(["--global-batch-size", "2", "--checkpoint-every", "2", "--max-steps", &max_steps.to_string()])
        .args(["--learning-rate", "0.01", "--max-staleness", "100", "--micro-batch", "2", "--torch-threads", "1"])
        .env("SLEUTH_LOG", "warn")
        .env("SLEUTH_INSECURE", "true");
    Ok(command)
}

pub fn wait_exit(child: &mut Child, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            ensure!(status.success(), "learner exited with {status}");
            return Ok(());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("learner did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The steps recorded in SQL for `run`.
pub async fn recorded_steps(database: &str, run: &str) -> Result<Vec<u64>> {
    let db = sleuth_store::Database::open(database)?;
    db.migrate().await?;
    Ok(learner::records::steps(&db, run).await?.into_iter().map(|(step, _)| step).collect())
}

/// Waits (up to two minutes) until `child`, a learner of `run`, has recorded `step`; fails if it exits first.
pub async fn until_step(env: &Env, run: &str, step: u64, child: &mut Child) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !recorded_steps(&env.database, run).await?.contains(&step) {
        ensure!(Instant::now() < deadline, "learner of {run} never reached step {step}");
        ensure!(child.try_wait()?.is_none(), "learner of {run} exited before step {step}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

pub fn final_params(checkpoints: &Path) -> Result<Vec<(String, Tensor)>> {
    let path = checkpoints.join(format!("step-{STEPS:08}/hf/model.safetensors"));
    let mut tensors = Tensor::read_safetensors(&path).with_context(|| path.display().to_string())?;
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(tensors)
}

/// The `world` ranks of one learner of `run`, as the chart's StatefulSet
/// starts them (the same command, torchrun's variables); their standard
/// error is kept for the test to read.
pub fn learner_ranks(env: &Env, run: &str, checkpoints: &Path, world: usize) -> Result<Vec<Child>> {
    let port = sleuth_testkit::free_port()?.to_string();
    (0..world)
        .map(|rank| {
            let mut command = learner_command(env, run, checkpoints, STEPS)?;
            command
                .env("WORLD_SIZE", world.to_string())
                .env("RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stderr(std::process::Stdio::piped());
            Ok(command.spawn()?)
        })
        .collect()
}

/// Everything `child` wrote to its standard error, once it has exited
/// (within `limit`), with its exit status.
pub fn exit_and_stderr(mut child: Child, limit: Duration) -> Result<(std::process::ExitStatus, String)> {
    use std::io::Read as _;
    let mut stderr = child.stderr.take().context("standard error was piped")?;
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("learner did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok((status, reader.join().map_err(|_| anyhow::anyhow!("reader panicked"))?))
}
