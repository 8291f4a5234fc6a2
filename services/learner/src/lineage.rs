//! Where a run's checkpoints live, and which policy a run starts from.
//!
//! Every run's checkpoints go under `<checkpoint_uri>/<run_id>`: learners of
//! different runs may share one store (one PVC or bucket in a cluster)
//! without a new run ever resuming from another run's checkpoint. A run whose
//! spec names `policy.from_run` (e.g. GRPO after trajectory SFT) starts from
//! the policy that run ended with, found in the same store: its newest
//! complete checkpoint. RL continues where SFT ended, not from its best
//! validated version: greedy validation can prefer an early version that
//! submits at once (a strong opening search), and GRPO sampling such a
//! policy finds every episode of a group alike and has nothing to learn
//! from. The best validated version is what a run is evaluated and served
//! with (`learner best-policy`). The user copies nothing.

use sleuth_kit::BearerToken;
use sleuth_proto::rollout::v1::{Run, RunStatus};
use sleuth_store::{ObjectStore, S3Args};

use crate::Error;
use crate::checkpoint::{self, complete_steps};

/// The store of `run`'s checkpoints under `base`. Checkpoints at the top of
/// `base` (the layout before runs had folders) are refused with what to do,
/// rather than silently ignored or taken for this run's.
pub async fn run_store(base: &str, run: &str, s3: &S3Args) -> Result<ObjectStore, Error> {
    let base = base.trim_end_matches('/');
    let store = ObjectStore::open(&format!("{base}/{run}"), s3)?;
    if complete_steps(&store).await?.is_empty() {
        let legacy = complete_steps(&ObjectStore::open(base, s3)?).await?;
        if !legacy.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "checkpoint_uri {base} holds checkpoints at its top level (steps {legacy:?}), where learners \
                 wrote them before each run had its own folder: move those of run {run:?} into {base}/{run} \
                 to resume it, or the others elsewhere"
            )));
        }
    }
    Ok(store)
}

/// The HF export of the policy `source` (a run, as its orchestrator records
/// it) ended with, which a run naming it in `policy.from_run` starts from;
/// `store` holds its checkpoints.
pub async fn final_export(source: &Run, store: &ObjectStore) -> Result<String, Error> {
    let (_, newest) = ended_checkpoints(source, store).await?;
    let export = export_of(store, newest);
    tracing::info!(run = %source.run_id, version = newest, %export, "starting from the policy another run ended with");
    Ok(export)
}

/// The HF export of `source`'s best version by validation that still has a
/// complete checkpoint (validation chooses, never training reward), else of
/// its newest: the policy to evaluate or serve; `store` holds its checkpoints.
pub async fn best_export(source: &Run, store: &ObjectStore) -> Result<String, Error> {
    let (complete, newest) = ended_checkpoints(source, store).await?;
    let ranked = sleuth_metrics::validation::ranked_versions(&source.validations);
    let version = match ranked.iter().find(|v| complete.contains(v)) {
        Some(&kept) => {
            if ranked.first() != Some(&kept) {
                tracing::warn!(run = %source.run_id, best = ?ranked.first(), kept, "the best validated version has no checkpoint; taking the best that has one");
            }
            kept
        }
        None => newest,
    };
    Ok(export_of(store, version))
}

/// The complete checkpoints of `source`, oldest first, and its newest,
/// refusing a run that is still training or wrote none.
async fn ended_checkpoints(source: &Run, store: &ObjectStore) -> Result<(Vec<u64>, u64), Error> {
    let name = &source.run_id;
    let refused = |why: String| Error::InvalidArgument(format!("run {name:?}: {why}"));
    if matches!(RunStatus::try_from(source.status), Ok(RunStatus::Pending | RunStatus::Running)) {
        return Err(refused("it is still training; start from it or evaluate it once it has ended".into()));
    }
    let complete = complete_steps(store).await?;
    let Some(&newest) = complete.last() else {
        return Err(refused(format!(
            "no complete checkpoint in {} (its learner wrote none, or to another SLEUTH_CHECKPOINT_URI)",
            store.uri()
        )));
    };
    Ok((complete, newest))
}

/// Where the HF export of checkpoint `version` is in `store`.
fn export_of(store: &ObjectStore, version: u64) -> String {
    format!("{}/{}/hf", store.uri(), checkpoint::step_dir(version))
}

/// `learner best-policy RUN`: where an ended run's best validated policy is
/// (its best validated version with a checkpoint): to evaluate or serve it.
#[derive(clap::Args, Debug)]
pub struct BestPolicyArgs {
    /// The ended run.
    pub run_id: String,
    /// The rollout orchestrator that owns the run (host:port).
    #[arg(long, env = "SLEUTH_ORCHESTRATOR")]
    pub orchestrator: String,
    /// Where the learners write checkpoints: a directory or s3://bucket/prefix.
    #[arg(long, env = "SLEUTH_CHECKPOINT_URI")]
    pub checkpoint_uri: String,
    #[command(flatten)]
    pub s3: S3Args,
    /// The mesh's bearer token, when it has one.
    #[arg(long, env = "SLEUTH_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<BearerToken>,
}

/// The HF export [`BestPolicyArgs`] names (a directory or an s3:// prefix).
pub async fn best_policy(args: &BestPolicyArgs) -> Result<String, Error> {
    let run = crate::run_spec::fetch_run(&args.orchestrator, args.auth_token.as_ref(), &args.run_id).await?;
    let store = run_store(&args.checkpoint_uri, &run.run_id, &args.s3).await?;
    best_export(&run, &store).await
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use sleuth_proto::rollout::v1::Validation;

    use super::*;
    use crate::checkpoint::Meta;

    /// An ended run whose version 2 validated best, with checkpoints of
    /// versions 2 and 5 in `store`.
    async fn ended_run(store: &ObjectStore, status: RunStatus) -> Run {
        for step in [2, 5] {
            checkpoint::seal(store, &Meta { step, world_size: 1, ..Meta::default() }).await.unwrap();
        }
        let validation = |version, score| Validation {
            version,
            metrics: HashMap::from([("score".to_owned(), score)]),
            ..Default::default()
        };
        Run {
            run_id: "sft".into(),
            status: status as i32,
            validations: vec![validation(0, 0.0), validation(2, 0.6), validation(5, 0.5)],
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_run_starts_from_where_its_source_ended_and_is_served_at_its_best() {
        let scratch = tempfile::tempdir().unwrap();
        let store = ObjectStore::Local { root: scratch.path().to_owned() };
        let sft = ended_run(&store, RunStatus::Succeeded).await;
        let export = |step| format!("{}/{}/hf", store.uri(), checkpoint::step_dir(step));
        assert_eq!(final_export(&sft, &store).await.unwrap(), export(5), "GRPO continues where SFT ended");
        assert_eq!(best_export(&sft, &store).await.unwrap(), export(2), "SFT is evaluated at its best validation");
    }

    #[tokio::test]
    async fn a_run_still_training_or_without_checkpoints_is_refused_by_name() {
        let scratch = tempfile::tempdir().unwrap();
        let store = ObjectStore::Local { root: scratch.path().to_owned() };
        let running = ended_run(&store, RunStatus::Running).await;
        let error = final_export(&running, &store).await.unwrap_err().to_string();
        assert!(error.contains("run \"sft\"") && error.contains("still training"), "{error}");
        let empty = ObjectStore::Local { root: scratch.path().join("none") };
        let ended = Run { status: RunStatus::Succeeded as i32, ..running };
        let error = best_export(&ended, &empty).await.unwrap_err().to_string();
        assert!(error.contains("no complete checkpoint"), "{error}");
    }
}
