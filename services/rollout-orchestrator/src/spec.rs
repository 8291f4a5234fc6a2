//! Checking a run spec at `CreateRun`: every bad field named, and fields no
//! service acts on yet refused rather than accepted and ignored.

use sleuth_proto::rollout::v1 as pb;

use crate::tasks;

/// Refuses the spec fields no service acts on yet, instead of accepting and
/// ignoring them: the policy servers and the learner load the model they are
/// configured with, and no validation runs during training, so a spec that
/// sets these would promise what the run does not do.
fn reject_unhonoured(spec: &pb::RunSpec) -> Result<(), String> {
    let unhonoured =
        |field: &str, why: &str| Err(format!("{field} is not supported yet: {why}; remove it from the spec"));
    if spec.policy.as_ref().is_some_and(|p| !p.model_uri.is_empty()) {
        return unhonoured(
            "spec.policy.model_uri",
            "the policy servers and the learner load the model they are configured with (SLEUTH_MODEL)",
        );
    }
    if spec.training.as_ref().is_some_and(|t| t.eval_every > 0) {
        return unhonoured("spec.training.eval_every", "no evaluation runs during training; run `sleuth eval`");
    }
    if spec.validation.is_some() {
        return unhonoured("spec.validation", "no evaluation runs during training; run `sleuth eval` on a checkpoint");
    }
    Ok(())
}

/// The training settings the learner takes from the spec (see the learner's
/// `run_spec`), checked here so a bad one fails `CreateRun`, not the learner.
fn validate_training(training: &pb::TrainingSpec) -> Result<(), String> {
    use sleuth_metrics::advantage::Estimator;
    use sleuth_metrics::policy_loss::PolicyLoss;
    training.advantage.parse::<Estimator>().map_err(|e| format!("spec.training.{e}"))?;
    training.loss.parse::<PolicyLoss>().map_err(|e| format!("spec.training.{e}"))?;
    for (field, value) in [("learning_rate", training.learning_rate), ("kl_coef", training.kl_coef)] {
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!("spec.training.{field} must be a finite number >= 0, got {value}"));
        }
    }
    Ok(())
}

/// Checks a run spec, naming the first bad field.
pub fn validate(spec: &pb::RunSpec) -> Result<(), String> {
    if !(1..=64).contains(&spec.group_size) {
        return Err(format!("spec.group_size must be 1..=64, got {}", spec.group_size));
    }
    if spec.global_batch_size == 0 {
        return Err("spec.global_batch_size must be at least 1".into());
    }
    if spec.rollout_max_concurrency == 0 {
        return Err("spec.rollout_max_concurrency must be at least 1".into());
    }
    let train = spec.train.as_ref().ok_or("spec.train is required")?;
    tasks::load(train, "spec.train")?;
    reject_unhonoured(spec)?;
    if let Some(training) = &spec.training {
        validate_training(training)?;
    }
    if let Some(reward) = &spec.reward {
        if !reward.name.is_empty() && reward.name != "ndcg@10" {
            return Err(format!("spec.reward.name {:?} is not a registered reward (ndcg@10)", reward.name));
        }
        sleuth_metrics::reward::NdcgReward::with_penalties(&reward.outcome_penalties.clone().into_iter().collect())
            .map_err(|e| format!("spec.reward.{e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_nothing_honours_are_rejected_by_name() {
        let policy = pb::RunSpec { policy: Some(pb::PolicySpec { model_uri: "m".into() }), ..Default::default() };
        assert!(reject_unhonoured(&policy).unwrap_err().contains("spec.policy.model_uri"));
        let eval_every = pb::RunSpec {
            training: Some(pb::TrainingSpec { eval_every: 5, ..Default::default() }),
            ..Default::default()
        };
        assert!(reject_unhonoured(&eval_every).unwrap_err().contains("spec.training.eval_every"));
        let validation = pb::RunSpec { validation: Some(pb::TaskSet::default()), ..Default::default() };
        assert!(reject_unhonoured(&validation).unwrap_err().contains("spec.validation"));
        assert_eq!(reject_unhonoured(&pb::RunSpec::default()), Ok(()));
    }

    #[test]
    fn bad_training_settings_are_named() {
        let training = |edit: fn(&mut pb::TrainingSpec)| {
            let mut training = pb::TrainingSpec::default();
            edit(&mut training);
            validate_training(&training)
        };
        assert_eq!(training(|_| {}), Ok(()));
        assert!(training(|t| t.loss = "ppo2".into()).unwrap_err().contains("spec.training.loss \"ppo2\""));
        assert!(training(|t| t.advantage = "gae".into()).unwrap_err().contains("spec.training.advantage \"gae\""));
        assert!(training(|t| t.learning_rate = -1.0).unwrap_err().contains("spec.training.learning_rate"));
        assert!(training(|t| t.kl_coef = f64::NAN).unwrap_err().contains("spec.training.kl_coef"));
    }
}
