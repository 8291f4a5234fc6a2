//! Rewards of finished episodes. A reward sees the whole episode (messages
//! with tool observations, trace, ranking, outcome) and its task, so rewards
//! that check citations against what the tools actually returned can plug in
//! beside the default nDCG reward.

use std::collections::BTreeMap;

use sleuth_proto::common::v1::Episode;
use sleuth_proto::common::v1::{EpisodeOutcome, Task};

use crate::{Judgements, ndcg_at};

/// A reward and the named parts or metrics behind it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Scored {
    pub reward: f64,
    pub metrics: BTreeMap<String, f64>,
}

/// Scores episodes; implementations must be cheap and deterministic.
pub trait Reward: Send + Sync {
    fn name(&self) -> &str;
    fn score(&self, task: &Task, episode: &Episode) -> Scored;
}

/// The outcome's lower-case name, as penalties and reports key it.
pub fn outcome_name(outcome: EpisodeOutcome) -> &'static str {
    match outcome {
        EpisodeOutcome::Unspecified => "unspecified",
        EpisodeOutcome::Completed => "completed",
        EpisodeOutcome::TurnLimit => "turn_limit",
        EpisodeOutcome::TokenBudget => "token_budget",
        EpisodeOutcome::ToolError => "tool_error",
        EpisodeOutcome::ModelError => "model_error",
        EpisodeOutcome::Cancelled => "cancelled",
    }
}

/// The key prefix of a failure rate by outcome in a metrics map
/// (`failure_rate:turn_limit`: the share of episodes that ended so).
pub const FAILURE_RATE: &str = "failure_rate:";

/// The share of episodes that did not complete: the sum of a metrics map's
/// [`FAILURE_RATE`] entries.
pub fn failure_rate<'a>(metrics: impl IntoIterator<Item = (&'a String, &'a f64)>) -> f64 {
    // A fold from +0.0: an empty f64 sum is -0.0, which prints as "-0".
    metrics.into_iter().filter(|(name, _)| name.starts_with(FAILURE_RATE)).fold(0.0, |sum, (_, rate)| sum + rate)
}

/// nDCG@k of the submitted ranking against the task's judgements (trec_eval's
/// definition). An episode that did not complete gets its outcome's penalty
/// when one is set (default: -1 for turn_limit and token_budget, as in the
/// reference setup) and 0 otherwise; its `ndcg@k` metric is 0 either way, so
/// evaluations count failed episodes as 0.
#[derive(Debug, Clone)]
pub struct NdcgReward {
    pub k: usize,
    pub penalties: BTreeMap<String, f64>,
}

impl Default for NdcgReward {
    fn default() -> Self {
        let penalties = [("turn_limit".to_owned(), -1.0), ("token_budget".to_owned(), -1.0)].into();
        Self { k: 10, penalties }
    }
}

impl NdcgReward {
    /// The default reward with `overrides` replacing or adding penalties;
    /// an unknown outcome name is an error naming it.
    pub fn with_penalties(overrides: &BTreeMap<String, f64>) -> Result<Self, String> {
        let mut reward = Self::default();
        const OUTCOMES: [&str; 5] = ["turn_limit", "token_budget", "tool_error", "model_error", "cancelled"];
        for (name, penalty) in overrides {
            if !OUTCOMES.contains(&name.as_str()) {
                return Err(format!("outcome_penalties has unknown outcome {name:?} (one of {})", OUTCOMES.join(", ")));
            }
            if !penalty.is_finite() {
                return Err(format!("outcome_penalties[{name}] must be finite, got {penalty}"));
            }
            reward.penalties.insert(name.clone(), *penalty);
        }
        Ok(reward)
    }
}

impl Reward for NdcgReward {
    fn name(&self) -> &str {
        "ndcg@10"
    }

    fn score(&self, task: &Task, episode: &Episode) -> Scored {
        let judgements: Judgements = task.qrels.iter().map(|(d, r)| (d.clone(), *r)).collect();
        let metric = format!("ndcg@{}", self.k);
        let completed = episode.outcome() == EpisodeOutcome::Completed;
        let ndcg = if completed { ndcg_at(&episode.ranking, &judgements, self.k) } else { 0.0 };
        let reward =
            if completed { ndcg } else { self.penalties.get(outcome_name(episode.outcome())).copied().unwrap_or(0.0) };
        Scored { reward, metrics: [(metric, ndcg)].into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task() -> Task {
        Task { task_id: "q".into(), qrels: [("a".to_owned(), 1), ("b".to_owned(), 2)].into(), ..Default::default() }
    }

    fn episode(outcome: EpisodeOutcome, ranking: &[&str]) -> Episode {
        Episode {
            outcome: outcome as i32,
            ranking: ranking.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn completed_episodes_score_their_ndcg() {
        let scored = NdcgReward::default().score(&task(), &episode(EpisodeOutcome::Completed, &["b", "a"]));
        assert!((scored.reward - 1.0).abs() < 1e-12);
        // a then b, trec_eval's linear gains: (1 + 2/log2(3)) / (2 + 1/log2(3))
        let scored = NdcgReward::default().score(&task(), &episode(EpisodeOutcome::Completed, &["a", "b"]));
        let expected = (1.0 + 2.0 / 3f64.log2()) / (2.0 + 1.0 / 3f64.log2());
        assert!((scored.reward - expected).abs() < 1e-12);
        assert_eq!(scored.metrics["ndcg@10"], scored.reward);
    }

    #[test]
    fn budget_outcomes_are_penalised_and_failures_score_zero_ndcg() {
        let reward = NdcgReward::default();
        let turn_limit = reward.score(&task(), &episode(EpisodeOutcome::TurnLimit, &["b"]));
        assert_eq!((turn_limit.reward, turn_limit.metrics["ndcg@10"]), (-1.0, 0.0));
        let tool_error = reward.score(&task(), &episode(EpisodeOutcome::ToolError, &[]));
        assert_eq!(tool_error.reward, 0.0);
        let custom = NdcgReward::with_penalties(&[("tool_error".to_owned(), -0.5)].into()).unwrap();
        assert_eq!(custom.score(&task(), &episode(EpisodeOutcome::ToolError, &[])).reward, -0.5);
        assert!(
            NdcgReward::with_penalties(&[("timeout".to_owned(), -1.0)].into()).unwrap_err().contains("\"timeout\"")
        );
    }
}
