//! A learner attached to an orchestrator (`SLEUTH_ORCHESTRATOR`) trains its
//! run as the run's spec says: it reads the run through `GetRun` when it
//! starts and takes every training setting from it (batch size, staleness,
//! advantage, loss, learning rate, KL, checkpoint interval). Its own
//! configuration then keeps only infrastructure (addresses, rank, storage,
//! device), so the orchestrator's staleness window and the learner's steps
//! are sized by the same numbers. The spec's `policy.model_uri`, when set,
//! is the model the learner starts from (see `publish::republish`); its
//! `policy.from_run` names a run whose policy it starts from (see [`crate::lineage`]). Setting one of those flags as well is an
//! error (clap's `conflicts_with`), never a silent override.

use std::time::{Duration, Instant};

use sleuth_proto::rollout::v1::rollout_orchestrator_client::RolloutOrchestratorClient;
use sleuth_proto::rollout::v1::{GetRunRequest, RunProgress, RunSpec, RunStatus};
use tonic::Code;

use crate::{Config, Error};

/// How often the learner asks again while it waits, and logs that it does.
const RETRY: Duration = Duration::from_secs(2);
const REPORT: Duration = Duration::from_secs(30);

/// The spec of `run_id`, from the orchestrator at `address`. Waits, saying so,
/// while the orchestrator is unreachable or the run not created yet: on
/// Kubernetes the learner pod usually starts before `sleuth run create`.
pub async fn fetch(address: &str, token: Option<&sleuth_kit::BearerToken>, run_id: &str) -> Result<RunSpec, Error> {
    fetch_run(address, token, run_id)
        .await?
        .spec
        .ok_or_else(|| Error::InvalidArgument(format!("run {run_id:?} on orchestrator {address} has no spec")))
}

/// The run `run_id` as the orchestrator at `address` records it, waiting as [`fetch`] does.
pub async fn fetch_run(
    address: &str,
    token: Option<&sleuth_kit::BearerToken>,
    run_id: &str,
) -> Result<sleuth_proto::rollout::v1::Run, Error> {
    let mut client =
        sleuth_kit::sized!(RolloutOrchestratorClient::new(sleuth_kit::client::connect_lazy(address, token)?));
    let mut reported: Option<Instant> = None;
    loop {
        let status = match client.get_run(GetRunRequest { run_id: run_id.to_owned() }).await {
            Ok(run) => return Ok(run.into_inner()),
            Err(status) if matches!(status.code(), Code::Unauthenticated | Code::PermissionDenied) => {
                return Err(Error::InvalidArgument(format!(
                    "orchestrator {address} refused GetRun: {} (check SLEUTH_AUTH_TOKEN)",
                    status.message()
                )));
            }
            Err(status) => status,
        };
        if reported.is_none_or(|at| at.elapsed() >= REPORT) {
            if status.code() == Code::NotFound {
                tracing::info!(run = run_id, orchestrator = %address, "waiting for the run to be created (sleuth run create)");
            } else {
                tracing::warn!(orchestrator = %address, code = ?status.code(), message = status.message(), "waiting for the orchestrator");
            }
            reported = Some(Instant::now());
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// The run as its orchestrator records it, asked two things: whether the run
/// is over (once it has published its last group and the learner has taken
/// them all, the learner trains what is left as a final step, seals its last
/// checkpoint and exits), and which version validation chose (its checkpoint
/// is kept).
#[derive(Clone)]
pub struct RunRecord {
    client: RolloutOrchestratorClient<sleuth_kit::client::MeshChannel>,
    run_id: String,
    address: String,
}

impl RunRecord {
    pub fn new(address: &str, token: Option<&sleuth_kit::BearerToken>, run_id: &str) -> Result<Self, Error> {
        let client =
            sleuth_kit::sized!(RolloutOrchestratorClient::new(sleuth_kit::client::connect_lazy(address, token)?));
        Ok(Self { client, run_id: run_id.to_owned(), address: address.to_owned() })
    }

    /// The run, or `None` (logged) when the orchestrator cannot be asked.
    async fn get(&self, asking: &str) -> Option<sleuth_proto::rollout::v1::Run> {
        match self.client.clone().get_run(GetRunRequest { run_id: self.run_id.clone() }).await {
            Ok(run) => Some(run.into_inner()),
            Err(status) => {
                tracing::warn!(orchestrator = %self.address, code = ?status.code(), message = status.message(), "cannot ask {asking}");
                None
            }
        }
    }

    /// The number of groups the run published, once they are all it will
    /// publish: it succeeded, it was cancelled (it publishes nothing more;
    /// the learner trains what it did publish and exits), or it runs with
    /// every group out (it then waits for the learner's last step to
    /// validate it); `None` while groups are still to come, after a failure
    /// (the run may be resumed) or when the orchestrator cannot be asked
    /// (the learner asks again).
    pub async fn groups_published(&self) -> Option<u64> {
        let run = self.get("whether the run is over").await?;
        let progress = run.progress.unwrap_or_default();
        over(RunStatus::try_from(run.status).unwrap_or_default(), &progress).then_some(progress.groups_published)
    }

    /// The steps the run takes if every group it publishes trains: its
    /// groups (tasks x epochs) in batches of `global_batch_size`; `None`
    /// until the orchestrator has counted its tasks, or when it cannot be asked.
    pub async fn steps_planned(&self, global_batch_size: usize) -> Option<u64> {
        let groups = self.get("how many groups the run publishes").await?.progress?.groups_total;
        (groups > 0).then(|| groups.div_ceil(global_batch_size.max(1) as u64))
    }

    /// Whether the run has ended for good (succeeded or cancelled: it
    /// validates nothing more; a failed run may be resumed); `None` when the
    /// orchestrator cannot be asked.
    pub async fn ended(&self) -> Option<bool> {
        let run = self.get("whether the run has ended").await?;
        Some(matches!(RunStatus::try_from(run.status), Ok(RunStatus::Succeeded | RunStatus::Cancelled)))
    }

    /// The version with the best validation score so far, if the run
    /// validates and has validated one.
    pub async fn best_version(&self) -> Option<u64> {
        Some(self.get("which version validation chose").await?.best_version).filter(|version| *version > 0)
    }
}

/// Whether a run in `status` with `progress` publishes no more groups.
fn over(status: RunStatus, progress: &RunProgress) -> bool {
    let all_out = progress.groups_total > 0 && progress.groups_published >= progress.groups_total;
    match status {
        RunStatus::Succeeded | RunStatus::Cancelled => true,
        RunStatus::Running => all_out,
        RunStatus::Unspecified | RunStatus::Pending | RunStatus::Failed => false,
    }
}

/// Takes the training settings of `spec` into `config`; fields the spec
/// leaves at zero or empty keep the learner's defaults.
pub fn apply(config: &mut Config, spec: &RunSpec) -> Result<(), Error> {
    let invalid = |message: String| Error::InvalidArgument(message);
    config.global_batch_size = spec.global_batch_size;
    config.max_staleness = u64::from(spec.max_staleness);
    if let Some(training) = &spec.training {
        if !training.advantage.is_empty() {
            config.advantage = training.advantage.clone();
        }
        if !training.loss.is_empty() {
            config.loss = training.loss.clone();
        }
        if training.learning_rate > 0.0 {
            config.learning_rate = training.learning_rate;
        }
        config.kl_coef = training.kl_coef;
        config.lr_schedule = training.lr_schedule.parse().map_err(|e| invalid(format!("spec.training.{e}")))?;
        if training.checkpoint_every > 0 {
            config.checkpoint_every = u64::from(training.checkpoint_every);
        }
    }
    if config.global_batch_size == 0 {
        return Err(invalid("spec.global_batch_size must be at least 1, got 0".into()));
    }
    config.start_model_uri = spec.policy.as_ref().map(|p| p.model_uri.trim().to_owned()).filter(|u| !u.is_empty());
    config.start_from_run = spec.policy.as_ref().map(|p| p.from_run.trim().to_owned()).filter(|r| !r.is_empty());
    config.validation = sleuth_metrics::validation::Schedule::of(spec);
    // A teacher writes the run's episodes: the learner imitates them.
    if spec.agent.as_ref().is_some_and(|a| !a.teacher.trim().is_empty()) {
        config.mode = crate::config::Mode::Sft;
        config.sft_min_reward = spec.training.as_ref().map_or(f64::NEG_INFINITY, |t| t.sft_min_reward);
    }
    let per_step = spec.training.as_ref().map_or(0, |t| t.copy_rehearsal) as usize;
    config.rehearsal = match (per_step, &spec.train) {
        (0, _) => None,
        _ if config.mode != crate::config::Mode::Sft => {
            return Err(invalid(format!(
                "spec.training.copy_rehearsal {per_step} applies to trajectory SFT: set spec.agent.teacher or remove it"
            )));
        }
        (_, None) => return Err(invalid("spec.training.copy_rehearsal needs spec.train".into())),
        (_, Some(train)) => Some(crate::copying::RehearsalSpec {
            per_step,
            collection: train.source_uri.clone().into(),
            split: train.split.clone(),
            tools: spec.agent.as_ref().map(|a| a.tools.clone()).unwrap_or_default(),
            seed: sleuth_kit::seed::derive(0, &config.run_id),
        }),
    };
    tracing::info!(
        global_batch_size = config.global_batch_size,
        max_staleness = config.max_staleness,
        advantage = %config.advantage,
        loss = %config.loss,
        learning_rate = config.learning_rate,
        lr_schedule = ?config.lr_schedule,
        kl_coef = config.kl_coef,
        checkpoint_every = config.checkpoint_every,
        start_model = config.start_model_uri.as_deref().unwrap_or("SLEUTH_MODEL"),
        from_run = config.start_from_run.as_deref().unwrap_or(""),
        mode = ?config.mode,
        sft_min_reward = config.sft_min_reward,
        copy_rehearsal = per_step,
        "training settings from the run's spec"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use sleuth_proto::rollout::v1::TrainingSpec;

    use super::*;

    fn config(extra: &[&str]) -> Result<Config, clap::Error> {
        Config::try_parse_from([&["learner", "--run-id", "r", "--orchestrator", "127.0.0.1:50051"], extra].concat())
    }

    #[test]
    fn a_run_is_over_once_it_publishes_nothing_more() {
        let out = RunProgress { groups_total: 4, groups_published: 4, ..Default::default() };
        let coming = RunProgress { groups_total: 4, groups_published: 2, ..Default::default() };
        assert!(over(RunStatus::Succeeded, &out) && over(RunStatus::Running, &out));
        assert!(over(RunStatus::Cancelled, &coming), "a cancelled run publishes nothing more");
        assert!(!over(RunStatus::Running, &coming) && !over(RunStatus::Pending, &coming));
        assert!(!over(RunStatus::Failed, &coming), "a failed run may be resumed");
        assert!(!over(RunStatus::Running, &RunProgress::default()), "not counted yet");
    }

    #[test]
    fn the_spec_sets_every_training_setting() {
        let mut config = config(&[]).unwrap();
        let spec = RunSpec {
            global_batch_size: 3,
            max_staleness: 2,
            training: Some(TrainingSpec {
                advantage: "rloo".into(),
                loss: "cispo".into(),
                learning_rate: 3e-5,
                kl_coef: 0.01,
                checkpoint_every: 7,
                eval_every: 0,
                sft_min_reward: 0.5,
                copy_rehearsal: 0,
                lr_schedule: "cosine".into(),
            }),
            ..Default::default()
        };
        apply(&mut config, &spec).unwrap();
        assert_eq!((config.global_batch_size, config.max_staleness, config.checkpoint_every), (3, 2, 7));
        assert_eq!((config.advantage.as_str(), config.loss.as_str()), ("rloo", "cispo"));
        assert_eq!((config.learning_rate, config.kl_coef), (3e-5, 0.01));
        assert_eq!(config.lr_schedule, sleuth_metrics::schedule::LrSchedule::Cosine);
        assert_eq!(config.mode, crate::config::Mode::Rl, "no teacher: reinforcement learning");

        let taught = RunSpec {
            agent: Some(sleuth_proto::agent::v1::AgentConfig { teacher: "mixture".into(), ..Default::default() }),
            ..spec
        };
        apply(&mut config, &taught).unwrap();
        assert_eq!((config.mode, config.sft_min_reward), (crate::config::Mode::Sft, 0.5), "a teacher's run is SFT");
        assert_eq!(config.rehearsal, None);

        // Copy rehearsal reads the run's own training collection.
        let rehearse = |teacher: &str| RunSpec {
            agent: Some(sleuth_proto::agent::v1::AgentConfig {
                teacher: teacher.into(),
                tools: vec!["bm25_search".into()],
                ..Default::default()
            }),
            train: Some(sleuth_proto::rollout::v1::TaskSet {
                source_uri: "/data/synth".into(),
                split: "train".into(),
                ..Default::default()
            }),
            training: Some(TrainingSpec { copy_rehearsal: 16, ..taught.training.clone().unwrap() }),
            ..taught.clone()
        };
        let mut config = self::tests::config(&[]).unwrap();
        apply(&mut config, &rehearse("mixture")).unwrap();
        let rehearsal = config.rehearsal.unwrap();
        assert_eq!((rehearsal.per_step, rehearsal.split.as_str()), (16, "train"));
        assert_eq!(
            (rehearsal.collection.to_str(), rehearsal.tools),
            (Some("/data/synth"), vec!["bm25_search".to_owned()])
        );
        let mut config = self::tests::config(&[]).unwrap();
        let error = apply(&mut config, &rehearse("")).unwrap_err().to_string();
        assert!(error.contains("spec.training.copy_rehearsal 16 applies to trajectory SFT"), "{error}");
    }

    #[test]
    fn a_training_flag_beside_an_orchestrator_is_an_error() {
        for flag in [
            "--global-batch-size",
            "--max-staleness",
            "--advantage",
            "--loss",
            "--learning-rate",
            "--kl-coef",
            "--checkpoint-every",
            "--sft-min-reward",
        ] {
            let error = config(&[flag, "2"]).unwrap_err().to_string();
            assert!(error.contains(flag) && error.contains("--orchestrator"), "{flag}: {error}");
        }
    }
}
