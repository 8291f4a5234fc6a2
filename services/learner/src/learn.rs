//! The learner's loop. Rank 0 reads groups from the run's stream, forms each
//! step (in stream order: `global_batch_size` trainable groups, stale groups
//! dropped, flat groups filtered, corrupt ones rejected, all counted) and
//! broadcasts it; every rank trains its share; rank 0 publishes the weights,
//! records the step and, every `checkpoint_every` steps, seals a checkpoint
//! and only then acknowledges the stream entries the steps used.
//!
//! After a crash, the learner resumes from the newest complete checkpoint:
//! entries up to the checkpoint's stream position are acknowledged (they are
//! in it), the rest are reclaimed and replayed in order, so the resumed run
//! forms the same steps from the same groups and ends where an uninterrupted
//! run would have, unless policy servers had been sent versions the
//! checkpoint does not hold (see [`crate::publish::republish`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use sleuth_store::trajectories::{self, Entry, EntryId, GroupConsumer};
use sleuth_store::{Database, ObjectStore, RedisStore, patiently};

use crate::Error;
use crate::advantage::Estimator;
use crate::batch;
use crate::checkpoint::{self, Meta};
use crate::intake::{FlatStreak, Tally, announce, commit_trained, read_fresh, take_group};
use crate::publish::Publisher;
use crate::records::Disposition;
use crate::trainer::{StepStats, Trainer};

mod command;
mod schedule;
mod validated;

use command::Command;
use schedule::steps_planned;

/// How often an idle learner looks for new groups.
const POLL: std::time::Duration = std::time::Duration::from_millis(200);
/// How often an idle learner checks that every policy server serves its
/// current weights (see [`crate::publish::reconcile`]).
const RECONCILE: std::time::Duration = std::time::Duration::from_secs(2);

/// How steps are formed and when the loop stops.
#[derive(Debug, Clone)]
pub struct Plan {
    pub run_id: String,
    pub sft: bool,
    /// Trajectory SFT trains on the episodes rewarded at least this much.
    pub sft_min_reward: f64,
    /// Copy pre-training's conversations added to every step (trajectory SFT).
    pub rehearsal: Option<Arc<crate::copying::Rehearsal>>,
    /// The peak learning rate and how it moves over the run's steps.
    pub learning_rate: f64,
    pub lr_schedule: sleuth_metrics::schedule::LrSchedule,
    pub estimator: Estimator,
    pub global_batch_size: usize,
    pub max_staleness: u64,
    pub checkpoint_every: u64,
    /// Stop after this many of the run's own steps (0 = run until shut down).
    pub max_steps: u64,
    /// The spec's start model, published as the run's first version (see
    /// [`crate::publish::republish`]); `None`: the servers' own model is version 0.
    pub start_model_uri: Option<String>,
    /// The versions the run's orchestrator validates; the learner steps past
    /// none before it is validated (`None`: the run does not validate).
    pub validation: Option<sleuth_metrics::validation::Schedule>,
}

/// The learner's progress, served by `GetStatus`.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    pub meta: Meta,
    pub last: Option<StepStats>,
    pub last_checkpoint_step: u64,
    pub finished: bool,
}

pub type SharedProgress = Arc<Mutex<Progress>>;

/// Runs `f` on the trainer on the libtorch thread (libtorch and the
/// collectives block) and hands the trainer back.
pub(crate) async fn blocking<T: Send + 'static>(
    trainer: Trainer,
    f: impl FnOnce(&mut Trainer) -> T + Send + 'static,
) -> Result<(Trainer, T), Error> {
    crate::torch_thread::run(move || {
        let mut trainer = trainer;
        let out = f(&mut trainer);
        (trainer, out)
    })
    .await
}

/// Everything rank 0 talks to.
pub struct Sources {
    /// The run's stream and the learner's announcements (version, groups taken).
    pub redis: RedisStore,
    /// How long Redis may be unreachable before the learner stops with an error.
    pub patience: std::time::Duration,
    /// How long the run's learner lease lasts unless renewed.
    pub lease_ttl: std::time::Duration,
    pub checkpoints: ObjectStore,
    /// Checkpoints kept besides the best by validation (0: all; see [`checkpoint::prune`]).
    pub keep_checkpoints: usize,
    pub database: Database,
    pub publisher: Publisher,
    /// The model directory, for the tokenizer files of the HF export.
    pub model_dir: std::path::PathBuf,
    pub model_config: serde_json::Value,
    /// The run's orchestrator, asked whether the run is over and which
    /// checkpoint validation chose (`None`: train until `max_steps` or
    /// shutdown, keep the newest checkpoints only).
    pub run: Option<crate::run_spec::RunRecord>,
}

/// Resumes from the newest complete checkpoint whose shards every rank can
/// load, if any; returns its meta. A damaged checkpoint (a shard unreadable,
/// missing or not the one sealed) is passed over for the one before it, on
/// every rank alike: the ranks agree on each candidate before restoring.
pub async fn resume(trainer: Trainer, checkpoints: &ObjectStore) -> Result<(Trainer, Meta), Error> {
    let (rank, world, device) = (trainer.collective.rank(), trainer.collective.world(), trainer.vars.device());
    let steps = checkpoint::complete_steps(checkpoints).await?;
    let mut trainer = trainer;
    for &step in steps.iter().rev() {
        // Decoding the shard makes tensors: on the libtorch thread too.
        let store = checkpoints.clone();
        let runtime = tokio::runtime::Handle::current();
        let loaded =
            crate::torch_thread::run(move || runtime.block_on(checkpoint::load(&store, step, rank, world, device)))
                .await?;
        let loaded = match loaded {
            Err(error) if !error.is_damage() => return Err(error.into()),
            loaded => loaded,
        };
        let loadable = loaded.is_ok();
        let (t, verdicts) = blocking(trainer, move |t| t.collective.all_gather_bytes(vec![u8::from(loadable)])).await?;
        trainer = t;
        let everyone = verdicts?.iter().all(|verdict| verdict == &[1]);
        match loaded {
            Ok((meta, shard)) if everyone => {
                tracing::info!(step = meta.step, rank, "resuming from checkpoint");
                let (trainer, restored) = blocking(trainer, move |t| t.restore(shard)).await?;
                restored?;
                return Ok((trainer, meta));
            }
            Ok(_) => tracing::warn!(step, rank, "another rank cannot load this checkpoint; trying the one before"),
            Err(error) => tracing::warn!(step, rank, %error, "checkpoint is damaged; trying the one before"),
        }
    }
    if let Some(newest) = steps.last() {
        return Err(checkpoint::CheckpointError::Corrupt {
            key: format!("{}/{}", checkpoints.uri(), checkpoint::step_dir(*newest)),
            message: format!(
                "none of the {} complete checkpoints loads on every rank (see the warnings); move them aside to start afresh",
                steps.len()
            ),
        }
        .into());
    }
    Ok((trainer, Meta { world_size: world, ..Meta::default() }))
}

/// Rank 0's loop (see the module docs).
pub async fn lead(
    mut trainer: Trainer,
    plan: Plan,
    sources: Sources,
    progress: SharedProgress,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), Error> {
    // One learner per run: wait for the lease before touching the run.
    let Some(lease) = crate::fence::take(&sources, &plan.run_id, &mut stop).await? else {
        return stop_ranks(trainer).await;
    };
    let _renewing = lease.keep_alive();
    let (resumed, mut meta) = resume(trainer, &sources.checkpoints).await?;
    trainer = resumed;
    let patience = sources.patience;
    // Every SQL write is idempotent (an upsert, a delete): retried while the database is away.
    patiently("migrating the database", patience, || sources.database.migrate()).await?;
    // Steps after the checkpoint are trained again from the replayed entries.
    patiently("forgetting steps after the checkpoint", patience, || {
        crate::records::forget_after(&sources.database, &plan.run_id, meta.step)
    })
    .await?;
    let consumer = patiently("joining the run's stream", patience, || {
        GroupConsumer::open(sources.redis.clone(), &plan.run_id, "learner-0")
    })
    .await?;
    let checkpointed_at_start = meta.step;
    let position: EntryId = meta.stream_position.parse().unwrap_or_default();
    let (done, mut replay): (Vec<Entry>, Vec<Entry>) =
        patiently("reclaiming pending entries", patience, || consumer.reclaim_pending())
            .await?
            .into_iter()
            .partition(|e| e.id <= position);
    // Already inside the checkpoint: acknowledge, never retrain.
    let done: Vec<EntryId> = done.iter().map(|e| e.id).collect();
    patiently("acknowledging checkpointed entries", patience, || consumer.commit(&done)).await?;
    replay.sort_by_key(|e| e.id);
    let mut queue: VecDeque<Entry> = replay.into();
    tracing::info!(step = meta.step, replay = queue.len(), "learner leading");
    let mut uncommitted: Vec<EntryId> = queue.iter().map(|e| e.id).collect();
    trainer = crate::publish::republish(trainer, &sources, &plan, &mut meta).await?;
    progress.lock().expect("progress").meta = meta.clone();
    announce(&sources, &plan.run_id, meta.step, meta.groups_taken()).await?;
    let mut last_reconcile = std::time::Instant::now();
    let mut run_over = false;
    let mut planned = None;
    let mut flat_streak = FlatStreak::default();

    while plan.max_steps == 0 || meta.steps_trained() < plan.max_steps {
        trainer = validated::await_validation(trainer, &plan, &sources, meta.step, &mut stop).await?;
        // Form the next step.
        let mut samples = Vec::new();
        let mut tally = Tally::default();
        while tally.trained() < plan.global_batch_size as u64 {
            if *stop.borrow() {
                break;
            }
            let entry = match queue.pop_front() {
                Some(entry) => entry,
                None => {
                    // Only the lease's holder takes groups off the stream.
                    crate::fence::hold(&lease, patience).await?;
                    let fresh = read_fresh(&consumer, plan.global_batch_size, &uncommitted, patience).await?;
                    if fresh.is_empty() {
                        if last_reconcile.elapsed() >= RECONCILE {
                            trainer = crate::publish::reconcile(trainer, &sources, &plan.run_id, meta.step).await?;
                            last_reconcile = std::time::Instant::now();
                            if let Some(run) = &sources.run
                                && let Some(published) = run.groups_published().await
                                && meta.groups_taken() + tally.groups() >= published
                            {
                                tracing::info!(published, "the run is over and every group taken: final step");
                                run_over = true;
                                break;
                            }
                        }
                        tokio::select! {
                            () = tokio::time::sleep(POLL) => {}
                            _ = stop.changed() => {}
                        }
                    }
                    uncommitted.extend(fresh.iter().map(|e| e.id));
                    queue.extend(fresh);
                    continue;
                }
            };
            tally.last = Some(entry.id);
            let (group_samples, record) = take_group(&entry, &plan, meta.step);
            if record.disposition == Disposition::Rejected {
                tracing::error!(entry = %entry.id, error = %record.detail, "group rejected");
            }
            if let Some(groups) = flat_streak.observe(record.disposition) {
                tracing::warn!(
                    groups,
                    "the last {groups} groups were flat (every episode of each got one reward): the policy no \
                     longer varies its episodes, so there is nothing to learn from and no step is taken; a \
                     step that collapsed it (too high a learning rate) or a sampling temperature near 0 does this"
                );
            }
            samples.extend(group_samples);
            tally.groups.push(record);
            // A dropped group frees its place in the orchestrator's staleness
            // window at once: otherwise groups that never train would hold the
            // window shut for good. A trained one frees it when its step's
            // weights are out (below): a group started earlier would sample
            // the weights this step replaces and be stale when it is taken.
            let taken = meta.groups_taken() + tally.groups() - tally.trained();
            patiently("announcing the groups taken", patience, || {
                trajectories::set_groups_taken(&sources.redis, &plan.run_id, taken)
            })
            .await?;
        }
        if tally.trained() < plan.global_batch_size as u64 && !run_over {
            break; // shutting down: the partial step's entries stay pending and are replayed
        }
        if tally.trained() == 0 {
            // The run ended with only dropped groups left: recorded against
            // the last step, inside a checkpoint of it, so none is lost.
            if tally.groups() > 0 {
                for group in &mut tally.groups {
                    group.step = meta.step;
                }
                let taken = tally.apply(&mut meta);
                patiently("recording the groups taken", patience, || {
                    crate::records::record_groups(&sources.database, &plan.run_id, &taken)
                })
                .await?;
                crate::fence::hold(&lease, patience).await?;
                trainer = save_checkpoint(trainer, &sources, &meta).await?;
                crate::fence::hold(&lease, patience).await?;
                commit_trained(&consumer, &mut uncommitted, &meta, patience).await?;
                let mut p = progress.lock().expect("progress");
                p.meta = meta.clone();
                p.last_checkpoint_step = meta.step;
            }
            break;
        }
        // A full step, or the run's last (smaller) one.
        let groups = tally.trained();
        if let Some(rehearsal) = &plan.rehearsal {
            samples.extend(rehearsal.samples(meta.step + 1)?);
        }
        if plan.sft {
            let fraction = batch::check_sft_mask(&samples).map_err(Error::InvalidArgument)?;
            tracing::info!(step = meta.step + 1, trainable_fraction = fraction, "trajectory SFT batch");
        }
        let lr = plan.learning_rate
            * plan.lr_schedule.scale(meta.steps_trained(), steps_planned(&mut planned, &plan, &sources).await?);
        let command = Command::Step { samples: samples.clone(), lr };
        let (t, stats) = blocking(trainer, move |t| -> Result<StepStats, Error> {
            t.collective.broadcast_bytes(command.encode())?;
            t.config.optimizer.lr = lr;
            Ok(t.step(&samples)?)
        })
        .await?;
        trainer = t;
        let mut stats = stats?;
        // The run's step number is the version its weights are published as.
        // It runs ahead of the optimizer's own count once a crash lost
        // published versions (see `publish::republish`).
        meta.step += 1;
        stats.step = meta.step;
        let taken = tally.apply(&mut meta);
        let step = stats.step;
        let wire = match sources.publisher.is_empty() {
            true => None,
            false => Some(sources.publisher.wire_dtype().await),
        };
        let run = plan.run_id.clone();
        let (t, update) = blocking(trainer, move |t| {
            wire.map(|wire| crate::publish::update_requests(&run, step, &t.named_tensors(), wire))
        })
        .await?;
        trainer = t;
        crate::fence::hold(&lease, patience).await?;
        let published = crate::publish::publish_step(update, &sources, stats.step).await;
        announce(&sources, &plan.run_id, stats.step, meta.groups_taken()).await?;
        let extra = serde_json::json!({
            "groups": groups,
            "groups_dropped_stale": meta.groups_dropped_stale,
            "groups_filtered": meta.groups_filtered,
            "groups_rejected": meta.groups_rejected,
            "publish_seconds": published.elapsed.as_secs_f64(),
            "publish_bytes": published.bytes,
        });
        patiently("recording the step", patience, || {
            crate::records::record(&sources.database, &plan.run_id, &stats, &extra)
        })
        .await?;
        patiently("recording the step's groups", patience, || {
            crate::records::record_groups(&sources.database, &plan.run_id, &taken)
        })
        .await?;
        tracing::info!(
            step = stats.step,
            loss = stats.loss,
            grad_norm = stats.grad_norm,
            tokens_per_s = stats.tokens_per_second,
            "step"
        );
        {
            let mut p = progress.lock().expect("progress");
            p.meta = meta.clone();
            p.last = Some(stats.clone());
        }
        let last = run_over || (plan.max_steps != 0 && meta.steps_trained() >= plan.max_steps);
        if meta.step % plan.checkpoint_every.max(1) == 0 || last {
            crate::fence::hold(&lease, patience).await?;
            trainer = save_checkpoint(trainer, &sources, &meta).await?;
            crate::fence::hold(&lease, patience).await?;
            commit_trained(&consumer, &mut uncommitted, &meta, patience).await?;
            progress.lock().expect("progress").last_checkpoint_step = meta.step;
        }
        if run_over {
            break;
        }
    }
    // Stopped early: keep the steps trained since the last checkpoint.
    if meta.step > progress.lock().expect("progress").last_checkpoint_step.max(checkpointed_at_start) {
        crate::fence::hold(&lease, patience).await?;
        trainer = save_checkpoint(trainer, &sources, &meta).await?;
        crate::fence::hold(&lease, patience).await?;
        commit_trained(&consumer, &mut uncommitted, &meta, patience).await?;
        progress.lock().expect("progress").last_checkpoint_step = meta.step;
    }
    stop_ranks(trainer).await?;
    if let Err(error) = lease.release().await {
        tracing::warn!(%error, "the run's lease was not released; the next learner waits for it to expire");
    }
    progress.lock().expect("progress").finished = true;
    Ok(())
}

/// Tells the other ranks to stop and waits until each has the word: the
/// word travels through the store rank 0 hosts, which ends with rank 0.
async fn stop_ranks(trainer: Trainer) -> Result<(), Error> {
    let (_trainer, stopped) = blocking(trainer, |t| {
        t.collective.broadcast_bytes(Command::Stop.encode())?;
        t.collective.barrier()
    })
    .await?;
    Ok(stopped?)
}

/// The other ranks: follow rank 0's commands.
pub async fn follow(trainer: Trainer, checkpoints: ObjectStore) -> Result<(), Error> {
    let (mut trainer, _meta) = resume(trainer, &checkpoints).await?;
    loop {
        let (t, command) = blocking(trainer, |t| t.collective.broadcast_bytes(Vec::new())).await?;
        trainer = t;
        match Command::decode(&command?)? {
            Command::Step { samples, lr } => {
                let (t, stats) = blocking(trainer, move |t| {
                    t.config.optimizer.lr = lr;
                    t.step(&samples)
                })
                .await?;
                trainer = t;
                stats?;
            }
            Command::Checkpoint(step) => {
                let (rank, world) = (trainer.collective.rank(), trainer.collective.world());
                let (t, bytes) = blocking(trainer, |t| checkpoint::shard_bytes(&t.shard)).await?;
                trainer = t;
                let digest = checkpoint::save_shard(&checkpoints, step, rank, world, bytes?).await?;
                // Rank 0 seals the step with every rank's digest once all are saved.
                let (t, arrived) =
                    blocking(trainer, move |t| t.collective.all_gather_bytes(digest.into_bytes())).await?;
                trainer = t;
                arrived?;
            }
            Command::Stop => {
                let (_trainer, stopped) = blocking(trainer, |t| t.collective.barrier()).await?;
                return Ok(stopped?);
            }
        }
    }
}

/// Every rank's shard, the merged HF export, then the seal.
pub(crate) async fn save_checkpoint(trainer: Trainer, sources: &Sources, meta: &Meta) -> Result<Trainer, Error> {
    let step = meta.step;
    let (t, told) =
        blocking(trainer, move |t| t.collective.broadcast_bytes(Command::Checkpoint(step).encode())).await?;
    told?;
    let (rank, world) = (t.collective.rank(), t.collective.world());
    let export = tempfile::tempdir().map_err(|e| Error::Train(e.to_string()))?;
    let (export_dir, model_config, model_dir) =
        (export.path().to_owned(), sources.model_config.clone(), sources.model_dir.clone());
    let (t, written) = blocking(t, move |t| -> Result<Vec<u8>, Error> {
        let bytes = checkpoint::shard_bytes(&t.shard)?;
        sleuth_model::export::save_hf_dir(&t.named_tensors(), &model_config, &model_dir, &export_dir)
            .map_err(|e| Error::Train(format!("HF export: {e}")))?;
        Ok(bytes)
    })
    .await?;
    let digest = checkpoint::save_shard(&sources.checkpoints, step, rank, world, written?).await?;
    checkpoint::save_export(&sources.checkpoints, step, export.path()).await?;
    // Every rank's shard is saved once every rank has sent its digest.
    let (t, digests) = blocking(t, move |t| t.collective.all_gather_bytes(digest.into_bytes())).await?;
    let mut meta = meta.clone();
    meta.shard_sha256 = digests?.into_iter().map(|d| String::from_utf8_lossy(&d).into_owned()).collect();
    meta.world_size = world;
    meta.shard_layout = checkpoint::SHARD_LAYOUT.to_owned();
    meta.created_unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    checkpoint::seal(&sources.checkpoints, &meta).await?;
    tracing::info!(step, "checkpoint sealed");
    let best = match &sources.run {
        Some(run) => run.best_version().await,
        None => None,
    };
    let deleted = checkpoint::prune(&sources.checkpoints, sources.keep_checkpoints, best).await?;
    if !deleted.is_empty() {
        tracing::info!(?deleted, kept = sources.keep_checkpoints, ?best, "older checkpoints deleted");
    }
    Ok(t)
}
