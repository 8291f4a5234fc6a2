//! Where a run's checkpoints live, and which policy a run starts from.
//!
//! Every run's checkpoints go under `<checkpoint_uri>/<run_id>`: learners of
//! different runs may share one store (one PVC or bucket in a cluster)
//! without a new run ever resuming from another run's checkpoint. A run whose
//! spec names `policy.from_run` (e.g. GRPO after trajectory SFT) starts from
//! that run's policy, found in the same store: its best version by
//! validation that still has a complete checkpoint (validation chooses, never
//! training reward), else its newest checkpoint. The user copies nothing.

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

/// The HF export of `source` (a run, as its orchestrator records it) that a
/// run naming it in `policy.from_run` starts from; `store` holds its checkpoints.
pub async fn source_export(source: &Run, store: &ObjectStore) -> Result<String, Error> {
    let name = &source.run_id;
    let refused = |why: String| Error::InvalidArgument(format!("policy.from_run {name:?}: {why}"));
    if matches!(RunStatus::try_from(source.status), Ok(RunStatus::Pending | RunStatus::Running)) {
        return Err(refused("the run is still training; start from it once it has ended".into()));
    }
    let complete = complete_steps(store).await?;
    let Some(&newest) = complete.last() else {
        return Err(refused(format!(
            "no complete checkpoint in {} (its learner wrote none, or to another SLEUTH_CHECKPOINT_URI)",
            store.uri()
        )));
    };
    let ranked = sleuth_metrics::validation::ranked_versions(&source.validations);
    let version = match ranked.iter().find(|v| complete.contains(v)) {
        Some(&kept) => {
            if ranked.first() != Some(&kept) {
                tracing::warn!(run = %name, best = ?ranked.first(), kept, "the best validated version has no checkpoint; starting from the best that has one");
            }
            kept
        }
        None => newest,
    };
    let export = format!("{}/{}/hf", store.uri(), checkpoint::step_dir(version));
    tracing::info!(run = %name, version, %export, by_validation = !ranked.is_empty(), "starting from another run's policy");
    Ok(export)
}

/// `learner best-policy RUN`: where the policy a run ended with is, as a
/// run naming it in `policy.from_run` would start from it (its best
/// validated version with a checkpoint): to evaluate or serve it.
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
    source_export(&run, &store).await
}
