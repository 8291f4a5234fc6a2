//! Driving runs: for every epoch and task, a group of G episodes on the agent
//! workers, scored and published once to the run's stream.
//!
//! - Concurrency: never more than `rollout_max_concurrency` episodes at once
//!   (one semaphore permit per running episode).
//! - Staleness: group number g (in start order) is trained at learner step
//!   g / global_batch_size; it starts only while that step is at most
//!   `max_staleness` ahead of the learner's version (read from Redis), so no
//!   group is trained on more than `max_staleness` versions after its policy.
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
use sleuth_metrics::reward::{NdcgReward, Reward};
use sleuth_proto::agent::v1::RunEpisodeRequest;
use sleuth_proto::common::v1::{Episode, Task, TrajectoryGroup};
use sleuth_proto::rollout::v1::{EpisodeSummary, RunProgress, RunSpec, RunStatus};
use sleuth_store::RedisStore;
use sleuth_store::trajectories;
use tokio::sync::{Semaphore, watch};

use crate::state::State;
use crate::workers::{Failure, Workers};

/// How often a gated run looks at the learner's version again.
const GATE_POLL: Duration = Duration::from_millis(200);
/// How long an episode keeps looking for a live worker before the run fails.
const NO_WORKER_PATIENCE: Duration = Duration::from_secs(120);

/// A run being driven by this orchestrator.
pub struct Live {
    pub progress: RunProgress,
    pub status: RunStatus,
    cancel: watch::Sender<bool>,
    /// Finished episodes, for WatchRun subscribers.
    pub episodes: tokio::sync::broadcast::Sender<EpisodeSummary>,
}

#[derive(Clone)]
pub struct Runner {
    pub state: State,
    pub redis: RedisStore,
    pub workers: Workers,
    pub live: Arc<Mutex<BTreeMap<String, Live>>>,
    /// Distinguishes this orchestrator process in episode ids: after a
    /// restart, a rerun episode must not reuse the trace of one that was
    /// still running when the previous process died.
    pub incarnation: String,
}

impl Runner {
    pub fn progress(&self, run_id: &str) -> Option<(RunProgress, RunStatus)> {
        self.live.lock().expect("live").get(run_id).map(|l| (l.progress, l.status))
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
            f(&mut live.progress);
        }
    }

    /// Starts driving `run_id` in the background.
    pub fn start(&self, run_id: String, spec: RunSpec) {
        let (cancel, cancelled) = watch::channel(false);
        let (episodes, _) = tokio::sync::broadcast::channel(256);
        self.live.lock().expect("live").insert(
            run_id.clone(),
            Live { progress: RunProgress::default(), status: RunStatus::Running, cancel, episodes },
        );
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
            // A cancelled run's status was recorded by CancelRun, with its reason.
            if status != RunStatus::Cancelled
                && let Err(error) = runner.state.set_status(&run_id, status, &detail).await
            {
                tracing::error!(run = %run_id, %error, "cannot record the run's end");
            }
            if let Some(live) = runner.live.lock().expect("live").get_mut(&run_id) {
                live.status = status;
            }
            tracing::info!(run = %run_id, ?status, "run ended");
        });
    }

    async fn drive(&self, run_id: &str, spec: &RunSpec, mut cancelled: watch::Receiver<bool>) -> Result<(), String> {
        let train = spec.train.as_ref().ok_or("spec.train is required")?;
        let tasks = crate::tasks::load(train, "spec.train")?;
        let reward = NdcgReward::with_penalties(
            &spec.reward.as_ref().map(|r| r.outcome_penalties.clone().into_iter().collect()).unwrap_or_default(),
        )?;
        let epochs = spec.max_epochs.max(1) as usize;
        let batch = spec.global_batch_size.max(1) as usize;
        let slots = Arc::new(Semaphore::new(spec.rollout_max_concurrency.max(1) as usize));
        let known: HashSet<String> =
            self.state.published_groups(run_id).await.map_err(|e| e.to_string())?.into_iter().collect();
        self.update(run_id, |p| {
            p.groups_total = (tasks.len() * epochs) as u64;
            p.groups_published = known.len() as u64;
        });
        let mut groups = tokio::task::JoinSet::new();
        'outer: for epoch in 0..epochs {
            for (index, task) in tasks.iter().enumerate() {
                let number = epoch * tasks.len() + index;
                let group_id = format!("e{epoch}-{}", task.task_id);
                if known.contains(&group_id) {
                    continue;
                }
                if trajectories::is_published(&self.redis, run_id, &group_id).await.map_err(|e| e.to_string())? {
                    // Published before a crash, not yet recorded: record, never republish.
                    self.state.record_group(run_id, &group_id, "", 0.0, 0).await.map_err(|e| e.to_string())?;
                    self.update(run_id, |p| p.groups_published += 1);
                    continue;
                }
                let version = loop {
                    let learner =
                        trajectories::learner_version(&self.redis, run_id).await.map_err(|e| e.to_string())?;
                    self.update(run_id, |p| {
                        p.step = learner;
                        p.policy_version = learner;
                        p.epoch = epoch as u32;
                    });
                    if (number / batch) as u64 <= learner + u64::from(spec.max_staleness) {
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
                let (run_id, spec, task, slots, reward) =
                    (run_id.to_owned(), spec.clone(), task.clone(), slots.clone(), reward.clone());
                let cancel = cancelled.clone();
                groups.spawn(async move {
                    runner.group(&run_id, &spec, &task, epoch, group_id, version, slots, &reward, cancel).await
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
        reward: &NdcgReward,
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
                    config: spec.agent.clone(),
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
            let scored = reward.score(task, episode);
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
            };
            self.state.record_episode(run_id, &group_id, &summary).await.map_err(|e| e.to_string())?;
            if let Some(live) = self.live.lock().expect("live").get_mut(run_id) {
                live.progress.episodes_finished += 1;
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
        let published = trajectories::publish_once(&self.redis, run_id, &group_id, &group.encode_to_vec())
            .await
            .map_err(|e| e.to_string())?;
        let stream_id = published.map(|id| id.to_string()).unwrap_or_default();
        self.state
            .record_group(run_id, &group_id, &stream_id, reward_mean, version)
            .await
            .map_err(|e| e.to_string())?;
        self.update(run_id, |p| p.groups_published += 1);
        tracing::info!(run = %run_id, group = %group_id, reward_mean, "group published");
        Ok(())
    }

    /// One episode, rerun on another worker when its worker fails.
    async fn episode(
        &self,
        run_id: &str,
        group_id: &str,
        sample: u32,
        request: RunEpisodeRequest,
    ) -> Result<Episode, String> {
        let started = std::time::Instant::now();
        let mut round = 0usize;
        loop {
            let attempt = |i: usize| format!("{run_id}-{group_id}-{sample}-{}-{}", self.incarnation, round * 16 + i);
            match self.workers.run_episode(request.clone(), attempt).await {
                Ok(response) => return response.episode.ok_or_else(|| "agent returned no episode".to_owned()),
                Err(Failure::Rejected(why)) => return Err(format!("agent rejected the episode: {why}")),
                Err(Failure::NoWorker(why)) if started.elapsed() > NO_WORKER_PATIENCE => {
                    return Err(format!("no agent worker could run the episode for {NO_WORKER_PATIENCE:?}: {why}"));
                }
                Err(Failure::NoWorker(_)) => {
                    round += 1;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }
}
