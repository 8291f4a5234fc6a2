//! Choosing among a run's validated versions: by the held-out mean of the
//! reward's headline metric (nDCG@10 for rankings, answer F1 for answers,
//! see `Reward::headline`), never by training reward (policies trained with
//! RL over-optimise late in a run).

use sleuth_proto::rollout::v1::{RunSpec, Validation};

/// The metric versions are chosen by: every evaluation records the mean of
/// its reward's headline metric under this name.
pub const CHOSEN_BY: &str = "score";

/// What validations recorded before they carried [`CHOSEN_BY`] were chosen
/// by (every run then was scored by nDCG@10).
const CHOSEN_BY_BEFORE: &str = "ndcg@10";

/// What `validation` is chosen by: its [`CHOSEN_BY`] score, or for one
/// recorded before scores its nDCG@10.
pub fn score(validation: &Validation) -> Option<f64> {
    validation.metrics.get(CHOSEN_BY).or_else(|| validation.metrics.get(CHOSEN_BY_BEFORE)).copied()
}

/// Validated versions, best first: the highest score, the earliest of
/// equals first (a later version must do better to be preferred).
pub fn ranked_versions(validations: &[Validation]) -> Vec<u64> {
    let score = |v: &Validation| score(v).filter(|s| s.is_finite()).unwrap_or(f64::MIN);
    let mut ranked: Vec<&Validation> = validations.iter().collect();
    ranked.sort_by(|a, b| score(b).total_cmp(&score(a)).then(a.version.cmp(&b.version)));
    ranked.into_iter().map(|v| v.version).collect()
}

/// The first version a run samples with: 1 when it has a start model of
/// its own (a model, or another run's policy), which its learner publishes
/// before any step; else 0, the model the policy servers started with.
pub fn first_version(spec: &RunSpec) -> u64 {
    u64::from(spec.policy.as_ref().is_some_and(|p| !p.model_uri.is_empty() || !p.from_run.is_empty()))
}

/// Which versions a run validates during training: its first version (the
/// untrained start) and each version that enters a new multiple of
/// `training.eval_every`. The orchestrator validates by it and the learner
/// takes no step past a due version until that version is validated, so a
/// validation measures exactly the weights it is labelled with (and that
/// version's checkpoint is what a run starting from it gets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// Validate whenever the version enters a new multiple of this (at least 1).
    pub every: u64,
    /// The run's first version ([`first_version`]).
    pub first: u64,
}

impl Schedule {
    /// The schedule of `spec`'s run; `None` when it does not validate (no
    /// `validation` set, or `training.eval_every` 0).
    pub fn of(spec: &RunSpec) -> Option<Self> {
        let every = spec.training.as_ref().map_or(0, |t| u64::from(t.eval_every));
        (spec.validation.is_some() && every > 0).then(|| Self { every, first: first_version(spec) })
    }

    /// Whether `version` is to be validated when `last` is the newest
    /// version validated so far (`None`: none yet).
    pub fn due(&self, version: u64, last: Option<u64>) -> bool {
        let every = self.every.max(1);
        version >= self.first && last.is_none_or(|last| version / every > last / every)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sleuth_proto::rollout::v1::{PolicySpec, TaskSet, TrainingSpec};

    #[test]
    fn the_start_and_each_new_multiple_of_eval_every_are_due() {
        let mut spec = RunSpec {
            validation: Some(TaskSet::default()),
            training: Some(TrainingSpec { eval_every: 5, ..Default::default() }),
            ..Default::default()
        };
        let schedule = Schedule::of(&spec).expect("validates");
        assert_eq!(schedule, Schedule { every: 5, first: 0 });
        assert!(schedule.due(0, None), "the untrained start");
        assert!(!schedule.due(4, Some(0)));
        assert!(schedule.due(5, Some(0)));
        assert!(schedule.due(7, Some(4)), "a version that skipped past the multiple (a renumbered resume)");
        assert!(!schedule.due(5, Some(5)), "validated already");
        spec.policy = Some(PolicySpec { from_run: "sft".into(), ..Default::default() });
        let from_run = Schedule::of(&spec).expect("validates");
        assert!(!from_run.due(0, None) && from_run.due(1, None), "version 0 is not the run's model");
        spec.training = Some(TrainingSpec::default());
        assert_eq!(Schedule::of(&spec), None, "eval_every 0 validates nothing");
    }

    fn validation(version: u64, ndcg: f64) -> Validation {
        Validation { version, metrics: [(CHOSEN_BY.to_owned(), ndcg)].into(), ..Default::default() }
    }

    #[test]
    fn the_best_score_comes_first_and_ties_go_to_the_earliest() {
        let validations = [validation(0, 0.1), validation(2, 0.4), validation(4, 0.4), validation(6, 0.3)];
        assert_eq!(ranked_versions(&validations), [2, 4, 6, 0]);
        assert_eq!(ranked_versions(&[]), Vec::<u64>::new());
        let before = Validation { version: 8, metrics: [("ndcg@10".to_owned(), 0.5)].into(), ..Default::default() };
        assert_eq!(ranked_versions(&[validation(2, 0.4), before]), [8, 2], "recorded before scores: by nDCG@10");
    }
}
