//! The learning rate of each step: the spec's peak, moved by its schedule
//! over the run's planned steps.

use sleuth_metrics::schedule::LrSchedule;

use super::{Plan, Sources};
use crate::Error;

/// The steps a scheduled learning rate decays over, asked once and kept in
/// `planned`: `max_steps` when set, else the run's planned steps from its
/// orchestrator (waited for while it has not counted its tasks yet, as long
/// as Redis may be away). A constant rate needs none.
pub(super) async fn steps_planned(planned: &mut Option<u64>, plan: &Plan, sources: &Sources) -> Result<u64, Error> {
    if plan.lr_schedule == LrSchedule::Constant {
        return Ok(1);
    }
    if let Some(steps) = *planned {
        return Ok(steps);
    }
    let started = std::time::Instant::now();
    let steps = loop {
        let asked = match &sources.run {
            _ if plan.max_steps > 0 => Some(plan.max_steps),
            Some(run) => run.steps_planned(plan.global_batch_size).await,
            None => None,
        };
        match asked {
            Some(steps) => break steps,
            None if sources.run.is_some() && started.elapsed() < sources.patience => {
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            None => {
                return Err(Error::InvalidArgument(format!(
                    "training.lr_schedule {:?} needs the run's planned steps, and neither max_steps nor the orchestrator gave them",
                    plan.lr_schedule
                )));
            }
        }
    };
    tracing::info!(steps, schedule = ?plan.lr_schedule, "the learning rate follows its schedule over the run's steps");
    *planned = Some(steps);
    Ok(steps)
}
