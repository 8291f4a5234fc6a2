//! The validation gate: the learner takes no step past a version its run's
//! schedule says is due for validation until the orchestrator has validated
//! it (`trajectories::validated`), so the weights a validation measures are
//! exactly the version it is labelled with, and that version's checkpoint
//! is what a run starting from the best one gets. (A step landing
//! mid-validation once gave a label two versions' answers; a run started
//! from it got a policy that failed most questions the label had passed.)

use sleuth_store::{patiently, trajectories};

use super::{Plan, Sources};
use crate::Error;
use crate::trainer::Trainer;

/// How often the waiting learner looks whether the run has ended (no
/// validator is left to validate a cancelled run).
const STATUS: std::time::Duration = std::time::Duration::from_secs(5);

/// Waits while `version` is due for validation by `schedule` and not yet
/// validated; returns at once when the run does not validate or has no
/// orchestrator, and when it ends or `stop` comes. Policy
/// servers that fall behind meanwhile are brought to `version`, which the
/// validation needs them to serve.
pub(super) async fn await_validation(
    mut trainer: Trainer,
    plan: &Plan,
    sources: &Sources,
    version: u64,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> Result<Trainer, Error> {
    let (Some(schedule), Some(run)) = (plan.validation, &sources.run) else { return Ok(trainer) };
    let run_id = plan.run_id.as_str();
    let now = std::time::Instant::now();
    let (mut looked, mut reconciled, mut said) = (now, now, false);
    loop {
        let validated = patiently("reading the validated version", sources.patience, || {
            trajectories::validated(&sources.redis, run_id)
        })
        .await?;
        if !schedule.due(version, validated) || *stop.borrow() {
            break;
        }
        if looked.elapsed() >= STATUS {
            looked = std::time::Instant::now();
            if run.ended().await == Some(true) {
                tracing::warn!(version, "the run ended before this version was validated; stepping on");
                break;
            }
        }
        if reconciled.elapsed() >= super::RECONCILE {
            trainer = crate::publish::reconcile(trainer, sources, run_id, version).await?;
            reconciled = std::time::Instant::now();
        }
        if !said {
            tracing::info!(version, "waiting for the orchestrator to validate this version before the next step");
            said = true;
        }
        tokio::select! {
            () = tokio::time::sleep(super::POLL) => {}
            _ = stop.changed() => {}
        }
    }
    Ok(trainer)
}
