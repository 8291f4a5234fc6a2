//! Validation during training: at the run's first version (the untrained
//! start), whenever the learner's version enters a new multiple of
//! `training.eval_every` (`sleuth_metrics::validation::Schedule`) and at its
//! last (once the learner has taken every group: the weights the run ends
//! with are a candidate too, however many steps the run made), the run
//! evaluates the served policy on its validation set with the evaluation
//! harness (greedy, no teacher: the policy itself), and records nDCG@10,
//! reward, failure rates, turns and tokens per version.
//!
//! The learner takes no step past a due version until the validator has
//! recorded it in Redis (`trajectories::validated`), so a validation measures
//! exactly the weights it is labelled with: a step landing mid-validation
//! (as groups in flight once allowed) mixed two versions under one label,
//! and a run starting from the best label got the other one's weights. New
//! training groups wait while it runs too, leaving the policy servers to it.
//! Its turns are served by the run's current weights or newer (never by a
//! server still on older ones), and its metrics record the oldest and newest
//! version that sampled its tokens (`served_version_oldest`/`_newest`). The
//! best version is the one with the highest validation nDCG@10, never the
//! highest training reward: policies trained this way over-optimise late in a run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::scoring::Scorer;
use sleuth_metrics::validation::Schedule;
use sleuth_proto::common::v1::{SamplingParams, Task};
use sleuth_proto::rollout::v1::{EvaluateRequest, Evaluation, RunSpec, Validation};
use sleuth_store::trajectories;
use tokio::sync::watch;

use crate::evaluate::{Contender, Evaluator, SERVED_NEWEST, SERVED_OLDEST};
use crate::state::State;

/// How often the validator looks at the learner's version.
const POLL: Duration = Duration::from_millis(500);

/// Validations of one version that may fail before the validator gives up
/// on it and lets the learner step on (the next due version is validated).
const ATTEMPTS: u32 = 3;

/// The validated version with the highest score (the earliest of equals).
pub fn best(validations: &[Validation]) -> Option<u64> {
    sleuth_metrics::validation::ranked_versions(validations).first().copied()
}

/// Validates one run's policy as it trains.
pub struct Validator {
    run_id: String,
    tasks: Vec<Task>,
    request: EvaluateRequest,
    scorer: Scorer,
    schedule: Schedule,
    /// The groups the run publishes in all: the learner has made its last
    /// step once it has taken them all.
    groups: u64,
    /// Set while a validation runs: the run starts no training group.
    pub held: Arc<AtomicBool>,
    state: State,
    /// How long the database may be away before a validation's record fails.
    patience: std::time::Duration,
    redis: sleuth_store::RedisStore,
    evaluator: Evaluator,
}

impl Validator {
    /// The validator of `spec`'s run, or `None` when it names no validation;
    /// it records through `runner`'s stores, with its patience.
    pub async fn new(
        run_id: &str,
        spec: &RunSpec,
        groups: u64,
        runner: &crate::runs::Runner,
    ) -> Result<Option<Self>, String> {
        let (state, patience, redis, evaluator) =
            (runner.state.clone(), runner.patience, runner.redis.clone(), runner.evaluator.clone());
        let (Some(schedule), Some(set)) = (Schedule::of(spec), spec.validation.clone()) else { return Ok(None) };
        let tasks =
            crate::tasks::load_off_runtime(set.clone(), "spec.validation", evaluator.task_roots.clone()).await?;
        let mut agent = spec.agent.clone().unwrap_or_default();
        agent.teacher.clear(); // the policy is judged, not the teacher that wrote its data
        agent.sampling = Some(SamplingParams { temperature: Some(0.0), ..agent.sampling.unwrap_or_default() });
        let request = EvaluateRequest {
            policy: None,
            tasks: Some(set),
            agent: Some(agent),
            samples_per_task: 1,
            reward: spec.reward.clone(),
        };
        let scorer = evaluator.scorer(spec.reward.as_ref()).map_err(|e| format!("spec.reward.{e}"))?;
        sleuth_metrics::reward::check_tasks(scorer.reward(), &tasks).map_err(|e| format!("spec.validation: {e}"))?;
        Ok(Some(Self {
            run_id: run_id.to_owned(),
            tasks,
            request,
            scorer,
            schedule,
            groups,
            held: Arc::default(),
            state,
            patience,
            redis,
            evaluator,
        }))
    }

    /// Validates each due version (the learner waits for each) until every
    /// group is out and the learner has taken them all (its last, smaller
    /// step included), then the version it ended on unless validated
    /// already. The wait ends only with the run: a learner that restarts
    /// finishes the run's steps, and cancelling the run aborts it. A failed
    /// validation is logged and tried again, [`ATTEMPTS`] times in all; it
    /// never fails the run.
    pub async fn run(self, mut done: watch::Receiver<bool>) {
        let mut last = match self.state.validations(&self.run_id).await {
            Ok(validations) => validations.last().map(|v| v.version),
            Err(error) => {
                tracing::warn!(run = %self.run_id, %error, "cannot read earlier validations");
                None
            }
        };
        let (mut failures, mut waited) = (0, std::time::Instant::now());
        loop {
            // Said on every look: a restarted Redis or orchestrator must not leave the learner waiting.
            if let Err(error) = trajectories::set_validated(&self.redis, &self.run_id, last).await {
                tracing::warn!(run = %self.run_id, %error, "cannot record the validated version for the learner");
            }
            match trajectories::learner_version(&self.redis, &self.run_id).await {
                Ok(version) if self.schedule.due(version, last) => {
                    match self.validate(version).await {
                        Ok(()) => (last, failures) = (Some(version), 0),
                        Err(error) => {
                            failures += 1;
                            tracing::error!(run = %self.run_id, version, %error, failures, "validation failed");
                            if failures == ATTEMPTS {
                                tracing::error!(run = %self.run_id, version, "giving up validating this version; the learner steps on");
                                (last, failures) = (Some(version), 0);
                            }
                        }
                    }
                    continue;
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(run = %self.run_id, %error, "cannot read the learner's version"),
            }
            if *done.borrow() {
                match trajectories::groups_taken(&self.redis, &self.run_id).await {
                    Ok(taken) if taken >= self.groups => break,
                    Ok(taken) if waited.elapsed() >= Duration::from_secs(60) => {
                        tracing::info!(run = %self.run_id, taken, groups = self.groups, "waiting for the learner's last step to validate it");
                        waited = std::time::Instant::now();
                    }
                    Ok(_) => {}
                    Err(error) => tracing::warn!(run = %self.run_id, %error, "cannot read the learner's progress"),
                }
                tokio::time::sleep(POLL).await;
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep(POLL) => {}
                changed = done.changed() => if changed.is_err() {
                    return; // the run ended before its groups were all out: no last version
                }
            }
        }
        match trajectories::learner_version(&self.redis, &self.run_id).await {
            Ok(version) if version >= self.schedule.first && last.is_none_or(|last| version > last) => {
                if let Err(error) = self.validate(version).await {
                    tracing::error!(run = %self.run_id, version, %error, "validating the last version failed");
                }
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(run = %self.run_id, %error, "cannot read the learner's last version"),
        }
    }

    /// Validates `version`, holding new training groups meanwhile.
    async fn validate(&self, version: u64) -> Result<(), String> {
        self.held.store(true, Ordering::SeqCst);
        let validated = self.evaluate(version).await;
        self.held.store(false, Ordering::SeqCst);
        validated
    }

    async fn evaluate(&self, version: u64) -> Result<(), String> {
        let id = format!("{}-validation-v{version}", self.run_id);
        tracing::info!(run = %self.run_id, version, tasks = self.tasks.len(), "validating");
        let outcome = self
            .evaluator
            .run(&id, Contender::Policy, self.tasks.clone(), &self.request, &self.scorer, Some(&self.run_id))
            .await?;
        let metrics = outcome.metrics.clone();
        let tasks = self.tasks.len() as u64;
        let mut job =
            Evaluation { evaluation_id: id.clone(), tasks_done: tasks, tasks_total: tasks, ..Default::default() };
        outcome.succeeded(&mut job);
        self.evaluator.jobs.keep(job);
        let score = metrics.get(sleuth_metrics::validation::CHOSEN_BY).copied().unwrap_or_default();
        tracing::info!(run = %self.run_id, version, score, headline = self.scorer.reward().headline(), "validated");
        // Turns are served by the run's current weights or newer, so the
        // label is the oldest; steps that land meanwhile show as newer ones.
        let served = |key| metrics.get(key).map(|&v| v as u64);
        if let (Some(oldest), Some(newest)) = (served(SERVED_OLDEST), served(SERVED_NEWEST))
            && (oldest, newest) != (version, version)
        {
            tracing::warn!(
                run = %self.run_id,
                version,
                oldest,
                newest,
                "the validation was served by other versions than the one it is labelled with (see its served_version metrics)"
            );
        }
        let validation = Validation { version, metrics, evaluation_id: id };
        // An upsert: retried while the database is away.
        sleuth_store::patiently("recording a validation", self.patience, || {
            self.state.record_validation(&self.run_id, &validation)
        })
        .await
        .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_version_has_the_highest_validation_ndcg() {
        let at = |version, ndcg| Validation {
            version,
            metrics: [("ndcg@10".to_owned(), ndcg)].into(),
            evaluation_id: String::new(),
        };
        assert_eq!(best(&[]), None);
        assert_eq!(best(&[at(0, 0.2), at(4, 0.5), at(8, 0.4), at(12, 0.5)]), Some(4), "the earliest of equals");
    }
}
