//! Driving runs: for every epoch and task, a group of G episodes on the agent
//! workers, scored and published once to the run's stream.
//!
//! - Concurrency: never more than `rollout_max_concurrency` episodes at once
//!   (one semaphore permit per running episode).
//! - Staleness: group number g (in start order) starts only while fewer than
//!   `(max_staleness + 1) x global_batch_size` groups are ahead of those the
//!   learner has taken off the stream, trained or dropped (see
//!   [`within_window`]); the learner drops groups whose tokens are more than
//!   `max_staleness` versions old.
//! - Exactly once: a group is published with its marker in one atomic step
//!   (`publish_once`) and recorded in SQL; a restarted orchestrator skips
//!   groups either place knows, and reruns only unpublished ones.
//! - Faults: an episode whose worker dies is rerun on another worker, with a
//!   fresh episode id (and trace); ids also carry the orchestrator's
//!   incarnation, so reruns after a restart never collide with old traces.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message;
use sleuth_proto::agent::v1::{AgentConfig, RunEpisodeRequest};
use sleuth_proto::common::v1::{Episode, Task, TrajectoryGroup};
use sleuth_proto::rollout::v1::{EpisodeSummary, Run, RunProgress, RunSpec, RunStatus};
use sleuth_store::trajectories;
use sleuth_store::{RedisStore, StoreError};
use tokio::sync::{Semaphore, watch};

use crate::state::State;
use crate::workers::Workers;

/// How often a gated run looks at the learner's version again.
const GATE_POLL: Duration = Duration::from_millis(200);
/// How long a finished run's published-group markers stay once it has ended for good.
pub const MARKER_GRACE: Duration = Duration::from_secs(3600);

/// Whether group number `number` (start order) may start: at most
/// `max_staleness + 1` steps' worth of groups may be ahead of the groups the
/// learner is done with: trained in a step whose weights are published, or
/// dropped (stale, flat, corrupt; counted at once, so dropped groups never
/// hold the window shut). Then the step that trains a group is at most
/// `max_staleness` versions after the weights it starts on: with
/// `max_staleness: 0` the next step's groups start only on the new weights.
/// The bound on the tokens' own staleness is the learner's: it drops groups
/// sampled too many versions ago (a lagging policy server, a long episode).
fn within_window(number: u64, taken: u64, batch: u64, max_staleness: u64) -> bool {
    number < taken + (max_staleness + 1) * batch
}

/// The agent config of one episode: the spec's, with a sampling seed of its
/// own derived from the spec's seed (when set), so the episodes of a group
/// differ and a rerun of the same episode samples the same way.
fn episode_config(spec: &RunSpec, group_id: &str, sample: u32) -> Option<AgentConfig> {
    let mut config = spec.agent.clone()?;
    if let Some(seed) = config.sampling.as_mut().and_then(|s| s.seed.as_mut()) {
        *seed = sleuth_kit::seed::derive(*seed, &format!("{group_id}/{sample}"));
    }
    Some(config)
}

/// A run being driven by this orchestrator: what this process is doing for
/// it now. The run's status, the reason for it and its counts are in its
/// record (`State`), never here, so that no reader mixes the two.
pub struct Live {
    /// The epoch being started, the learner's version and the episodes in
    /// flight (the record's counters are left at zero here).
    pub activity: RunProgress,
    cancel: watch::Sender<bool>,
    /// Finished episodes, for WatchRun subscribers.
    pub episodes: tokio::sync::broadcast::Sender<EpisodeSummary>,
}

#[derive(Clone)]
pub struct Runner {
    pub state: State,
    pub redis: RedisStore,
    /// Runs the validations during training (the evaluation harness).
    pub evaluator: crate::evaluate::Evaluator,
    pub workers: Workers,
    pub live: Arc<Mutex<BTreeMap<String, Live>>>,
    /// Distinguishes this orchestrator process in episode ids: after a
    /// restart, a rerun episode must not reuse the trace of one that was
    /// still running when the previous process died.
    pub incarnation: String,
    /// How long Redis or the database may be unreachable before a run fails.
    pub patience: Duration,
}

impl Runner {
    /// A runner driving no run yet; `patience` bounds how long a store may be away.
    pub fn new(
        state: State,
        redis: RedisStore,
        workers: Workers,
        evaluator: crate::evaluate::Evaluator,
        patience: Duration,
    ) -> Self {
        let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        Self { state, redis, evaluator, workers, live: Arc::default(), incarnation: format!("{started:x}"), patience }
    }

    /// Runs the store operation `op` until it succeeds, retrying with backoff
    /// for up to the configured patience (a store restarting must not end a
    /// run); every operation it wraps is idempotent.
    async fn durable<T, E: std::fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
        &self,
        what: &str,
        op: impl FnMut() -> F,
    ) -> Result<T, String> {
        sleuth_store::patiently(what, self.patience, op)
            .await
            .map_err(|error| format!("{what}: {error} (retried for {:?})", self.patience))
    }

    /// Adds what this process is doing for `run` (epoch, learner version,
    /// episodes in flight) to the progress its record holds; a run this
    /// process does not drive keeps its record's.
    pub fn add_activity(&self, run: &mut Run) {
        if let Some(live) = self.live.lock().expect("live").get(&run.run_id) {
            let progress = run.progress.get_or_insert_with(RunProgress::default);
            progress.epoch = live.activity.epoch;
            progress.step = live.activity.step;
            progress.policy_version = live.activity.policy_version;
            progress.episodes_in_flight = live.activity.episodes_in_flight;
        }
    }

    /// The run as GetRun answers it: its record (status, reason and counts
    /// read together), validations with the best version, training
    /// statistics per version and what this process is doing for it; None
    /// when there is no such run.
    pub async fn describe(&self, run_id: &str) -> Result<Option<Run>, StoreError> {
        let Some(mut run) = self.state.run(run_id).await? else { return Ok(None) };
        sleuth_kit::pause::point("orchestrator.run-read").await;
        run.validations = self.state.validations(run_id).await?;
        run.best_version = crate::validate::best(&run.validations).unwrap_or_default();
        run.training = self.state.training_stats(run_id).await?;
        self.add_activity(&mut run);
        Ok(Some(run))
    }

    pub fn subscribe(&self, run_id: &str) -> Option<tokio::sync::broadcast::Receiver<EpisodeSummary>> {
        self.live.lock().expect("live").get(run_id).map(|l| l.episodes.subscribe())
    }

    /// Asks a live run to stop starting episodes; in-flight ones are dropped.
    pub fn cancel(&self, run_id: &str) -> bool {
        self.live.lock().expect("live").get(run_id).is_some_and(|l| l.cancel.send(true).is_ok())
    }

    fn update(&self, run_id: &str, f: impl FnOnce(&mut RunProgress)) {
        if let Some(live) = self.live.lock().expect("live").get_mut(run_id) {
            f(&mut live.activity);
        }
    }

    /// Starts driving `run_id` in the background; when it ends for good,
    /// its published-group markers expire after [`MARKER_GRACE`].
    pub fn start(&self, run_id: String, spec: RunSpec) {
        let (cancel, cancelled) = watch::channel(false);
        let (episodes, _) = tokio::sync::broadcast::channel(256);
        self.live
            .lock()
            .expect("live")
            .insert(run_id.clone(), Live { activity: RunProgress::default(), cancel, episodes });
        let runner = self.clone();
        tokio::spawn(async move {
            let result = runner.drive(&run_id, &spec, cancelled.clone()).await;
            let (status, detail) = match result {
                Ok(()) if *cancelled.borrow() => (RunStatus::Cancelled, String::new()),
                Ok(()) => (RunStatus::Succeeded, String::new()),
                Err(error) => {
                    tracing::error!(run = %run_id, %error, "run failed");
                    (RunStatus::Failed, error)
                }
            };
            // Nothing is in flight any more. Forgotten before the end is
            // recorded: a resume (which needs the end recorded) then starts
            // with a new entry that this one can no longer remove.
            runner.live.lock().expect("live").remove(&run_id);
            // A cancelled run's status was recorded by CancelRun, with its
            // reason; the update only moves a running run, so an end racing
            // a cancel records one of them, never both.
            if status != RunStatus::Cancelled {
                let end = || runner.state.transition(&run_id, RunStatus::Running, status, &detail);
                if let Err(error) = runner.durable("recording the run's end", end).await {
                    tracing::error!(run = %run_id, %error, "cannot record the run's end");
                }
            }
            // Only a failed run resumes; into one that ended for good nothing
            // is published again, so its markers go (after a grace).
            if matches!(status, RunStatus::Succeeded | RunStatus::Cancelled) {
                match trajectories::expire_published(&runner.redis, &run_id, MARKER_GRACE).await {
                    Ok(markers) => tracing::debug!(run = %run_id, markers, "published-group markers expire"),
                    Err(error) => tracing::warn!(run = %run_id, %error, "the run's markers were not given a deadline"),
                }
            }
            sleuth_kit::pause::point("orchestrator.run-ended").await;
            tracing::info!(run = %run_id, ?status, "run ended");
        });
    }

    async fn drive(&self, run_id: &str, spec: &RunSpec, mut cancelled: watch::Receiver<bool>) -> Result<(), String> {
        let train = spec.train.as_ref().ok_or("spec.train is required")?;
        let tasks =
            crate::tasks::load_off_runtime(train.clone(), "spec.train", self.evaluator.task_roots.clone()).await?;
        let scorer = self.evaluator.scorer(spec.reward.as_ref()).map_err(|e| format!("spec.reward.{e}"))?;
        let epochs = spec.max_epochs.max(1) as usize;
        let batch = spec.global_batch_size.max(1) as usize;
        let groups_total = (tasks.len() * epochs) as u64;
        let slots = Arc::new(Semaphore::new(spec.rollout_max_concurrency.max(1) as usize));
        let known: HashSet<String> = self
            .durable("reading the run's groups", || self.state.published_groups(run_id))
            .await?
            .into_iter()
            .collect();
        self.durable("recording the run's size", || self.state.set_groups_total(run_id, groups_total)).await?;
        // A run with a start model of its own (a model, or another run's
        // policy) samples nothing before the learner has published it
        // (version 1): version 0 is whatever model the policy servers started with.
        let first_version = sleuth_metrics::validation::first_version(spec);
        let validator = crate::validate::Validator::new(run_id, spec, groups_total, self).await?;
        let held = validator.as_ref().map(|v| v.held.clone()).unwrap_or_default();
        let (trained, training_over) = watch::channel(false);
        // In a JoinSet, so that a drive ending early (a group's error) aborts
        // the validator with it instead of leaving it polling for a run
        // that is over.
        let mut validation = tokio::task::JoinSet::new();
        if let Some(validator) = validator {
            validation.spawn(validator.run(training_over));
        }
        let mut groups = tokio::task::JoinSet::new();
        'outer: for epoch in 0..epochs {
            for (index, task) in tasks.iter().enumerate() {
                let number = epoch * tasks.len() + index;
                let group_id = format!("e{epoch}-{}", task.task_id);
                if known.contains(&group_id) {
                    continue;
                }
                if self
                    .durable("checking a group's marker", || trajectories::is_published(&self.redis, run_id, &group_id))
                    .await?
                {
                    // Published before a crash, not yet recorded: record, never republish.
                    self.durable("recording a group", || self.state.record_group(run_id, &group_id, "", 0.0, 0, None))
                        .await?;
                    continue;
                }
                let version = loop {
                    let learner = self
                        .durable("reading the learner's version", || trajectories::learner_version(&self.redis, run_id))
                        .await?;
                    let taken = self
                        .durable("reading the learner's progress", || trajectories::groups_taken(&self.redis, run_id))
                        .await?;
                    self.update(run_id, |p| {
                        p.step = learner;
                        p.policy_version = learner;
                        p.epoch = epoch as u32;
                    });
                    if within_window(number as u64, taken, batch as u64, u64::from(spec.max_staleness))
                        && learner >= first_version
                        && !held.load(std::sync::atomic::Ordering::SeqCst)
                    {
                        break learner;
                    }
                    tokio::select! {
                        () = tokio::time::sleep(GATE_POLL) => {}
                        _ = cancelled.changed() => {}
                    }
                    if *cancelled.borrow() {
                        break 'outer;
                    }
                };
                if *cancelled.borrow() {
                    break 'outer;
                }
                let runner = self.clone();
                let (run_id, spec, task, slots, scorer) =
                    (run_id.to_owned(), spec.clone(), task.clone(), slots.clone(), scorer.clone());
                let cancel = cancelled.clone();
                groups.spawn(async move {
                    runner.group(&run_id, &spec, &task, epoch, group_id, version, slots, &scorer, cancel).await
                });
                // Surface failures early instead of after the whole epoch.
                while let Some(done) = groups.try_join_next() {
                    done.map_err(|e| e.to_string())??;
                }
            }
        }
        while let Some(done) = groups.join_next().await {
            done.map_err(|e| e.to_string())??;
        }
        // Every group is out: a validation under way finishes, then the
        // learner's last version is validated; cancelling stops either.
        let _ = trained.send(true);
        tokio::select! {
            _ = async { while validation.join_next().await.is_some() {} } => {}
            _ = cancelled.wait_for(|&c| c) => {}
        }
        Ok(())
    }

    /// Runs, scores and publishes one group.
    #[allow(clippy::too_many_arguments)]
    async fn group(
        &self,
        run_id: &str,
        spec: &RunSpec,
        task: &Task,
        epoch: usize,
        group_id: String,
        version: u64,
        slots: Arc<Semaphore>,
        scorer: &crate::scoring::Scorer,
        mut cancelled: watch::Receiver<bool>,
    ) -> Result<(), String> {
        let size = spec.group_size.max(1);
        let episodes = futures::future::join_all((0..size).map(|sample| {
            let slots = slots.clone();
            let group_id = group_id.clone();
            let mut cancelled = cancelled.clone();
            async move {
                let _slot = slots.acquire_owned().await.map_err(|e| e.to_string())?;
                self.update(run_id, |p| p.episodes_in_flight += 1);
                let request = RunEpisodeRequest {
                    run_id: run_id.to_owned(),
                    episode_id: String::new(),
                    sample_index: sample,
                    task: Some(task.clone()),
                    config: episode_config(spec, &group_id, sample),
                    // Issued per attempt (see `workers::Workers::run_episode`).
                    ticket: String::new(),
                    group_id: group_id.clone(),
                };
                let result = tokio::select! {
                    result = self.episode(run_id, &group_id, sample, request) => result,
                    _ = cancelled.wait_for(|&c| c) => Err("cancelled".to_owned()),
                };
                self.update(run_id, |p| p.episodes_in_flight -= 1);
                result
            }
        }))
        .await
        .into_iter()
        .collect::<Result<Vec<Episode>, String>>();
        if *cancelled.borrow_and_update() {
            return Ok(());
        }
        let mut episodes = episodes?;
        episodes.sort_by_key(|e| e.sample_index);
        for episode in &mut episodes {
            let scored = scorer.score(task, episode).await?;
            episode.reward = scored.reward;
            episode.metrics = scored.metrics.into_iter().collect();
            let summary = EpisodeSummary {
                episode_id: episode.episode_id.clone(),
                task_id: task.task_id.clone(),
                outcome: episode.outcome,
                reward: episode.reward,
                metrics: episode.metrics.clone(),
                turns: episode.turns,
                total_tokens: episode.total_tokens,
                policy_version: episode.max_policy_version,
                trace_id: episode.trace_id.clone(),
            };
            self.durable("recording an episode", || self.state.record_episode(run_id, &group_id, &summary)).await?;
            if let Some(live) = self.live.lock().expect("live").get(run_id) {
                let _ = live.episodes.send(summary);
            }
        }
        let reward_mean = episodes.iter().map(|e| e.reward).sum::<f64>() / episodes.len() as f64;
        let group = TrajectoryGroup {
            run_id: run_id.to_owned(),
            group_id: group_id.clone(),
            task: Some(task.clone()),
            epoch: epoch as u32,
            episodes,
            policy_version: version,
        };
        // Retried safely: the marker makes a repeated publication a no-op, the insert ignores a repeat.
        let encoded = group.encode_to_vec();
        let published = self
            .durable("publishing a group", || trajectories::publish_once(&self.redis, run_id, &group_id, &encoded))
            .await?;
        let stream_id = published.map(|id| id.to_string()).unwrap_or_default();
        self.durable("recording a group", || {
            self.state.record_group(run_id, &group_id, &stream_id, reward_mean, version, Some(&encoded))
        })
        .await?;
        tracing::info!(run = %run_id, group = %group_id, reward_mean, "group published");
        Ok(())
    }

    /// One episode, rerun on another worker when its worker fails and
    /// whenever it ends outside the policy (see [`Workers::run_to_policy_outcome`]).
    async fn episode(
        &self,
        run_id: &str,
        group_id: &str,
        sample: u32,
        request: RunEpisodeRequest,
    ) -> Result<Episode, String> {
        let attempt = |n: usize| format!("{run_id}-{group_id}-{sample}-{}-{n}", self.incarnation);
        self.workers.run_to_policy_outcome(request, attempt).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_matches_the_step_rule_without_drops() {
        // Batch 2, staleness 1, learner at step 3 (6 groups taken): groups 0..10 may start.
        assert!(within_window(9, 6, 2, 1));
        assert!(!within_window(10, 6, 2, 1));
        for number in 0..40 {
            for step in 0..10 {
                assert_eq!(within_window(number, step * 4, 4, 2), number / 4 <= step + 2);
            }
        }
    }

    #[test]
    fn each_episode_gets_its_own_seed_and_reruns_keep_it() {
        use sleuth_proto::common::v1::SamplingParams;
        let mut spec = RunSpec {
            agent: Some(AgentConfig {
                sampling: Some(SamplingParams { seed: Some(42), temperature: Some(1.0), ..Default::default() }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let seed = |group: &str, sample| episode_config(&spec, group, sample).unwrap().sampling.unwrap().seed.unwrap();
        let seeds: std::collections::HashSet<u64> = (0..8).flat_map(|s| [seed("e0-q1", s), seed("e1-q1", s)]).collect();
        assert_eq!(seeds.len(), 16, "every episode of every group samples differently");
        assert_eq!(seed("e0-q1", 3), seed("e0-q1", 3), "a rerun samples as the first attempt did");
        spec.agent.as_mut().unwrap().sampling.as_mut().unwrap().seed = None;
        assert_eq!(episode_config(&spec, "e0-q1", 0).unwrap().sampling.unwrap().seed, None, "no seed stays random");
    }

    #[test]
    fn dropped_groups_open_the_window() {
        // Batch 4, staleness 0: 4 groups published, all flat and dropped, the
        // learner is still at version 0 but has taken them: the next 4 may start.
        assert!(!within_window(4, 0, 4, 0));
        assert!(within_window(7, 4, 4, 0));
    }
}
