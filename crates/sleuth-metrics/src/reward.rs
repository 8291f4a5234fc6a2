//! Rewards of finished episodes. A reward sees the whole episode (messages
//! with tool observations, trace, ranking or answer, the documents the tools
//! showed, outcome) and its task. [`named`] makes the reward a run's
//! `reward.name` selects: nDCG@10 of a ranking (the default) or one of the
//! answer rewards (docs/rewards.md has each formula).

use std::collections::BTreeMap;
use std::sync::Arc;

use sleuth_proto::common::v1::Episode;
use sleuth_proto::common::v1::{EpisodeOutcome, Task};
use sleuth_proto::rollout::v1::RewardSpec;

use crate::{Judgements, answer, ndcg_at};

/// A reward and the named parts or metrics behind it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Scored {
    pub reward: f64,
    pub metrics: BTreeMap<String, f64>,
}

/// Scores episodes; implementations must be cheap and deterministic.
pub trait Reward: Send + Sync {
    /// The name a run's spec selects it by (`reward.name`).
    fn name(&self) -> &str;
    /// The metric of [`Scored::metrics`] that says how good an episode was
    /// without its outcome penalties: what validations choose checkpoints
    /// by and evaluations pair tasks on.
    fn headline(&self) -> &str;
    /// The episode's reward and metrics.
    fn score(&self, task: &Task, episode: &Episode) -> Scored;
    /// Whether an episode needs a judge's verdict (its [`JUDGE`] metric)
    /// before it is scored.
    fn needs_judge(&self) -> bool {
        false
    }
    /// Whether `task` can be scored at all (an answer reward needs its
    /// reference answers); the error says what it lacks.
    fn check(&self, task: &Task) -> Result<(), String> {
        let _ = task;
        Ok(())
    }
}

/// The reward `spec` selects ([`named`]; none: nDCG@10 with the default
/// penalties); an error names the field under `reward.`.
pub fn of_spec(spec: Option<&RewardSpec>) -> Result<Arc<dyn Reward>, String> {
    let spec = spec.cloned().unwrap_or_default();
    named(&spec.name, &spec.outcome_penalties.into_iter().collect())
}

/// Checks every task against `reward` ([`Reward::check`]); an error names
/// the first task it cannot score and how many more there are.
pub fn check_tasks(reward: &dyn Reward, tasks: &[Task]) -> Result<(), String> {
    let mut failing = tasks.iter().filter_map(|task| reward.check(task).err().map(|why| (task, why)));
    match failing.next() {
        None => Ok(()),
        Some((task, why)) => Err(format!(
            "reward {} cannot score task {:?}: {why} ({} more tasks alike)",
            reward.name(),
            task.task_id,
            failing.count()
        )),
    }
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

/// The outcomes a penalty can be set for.
const PENALISED: [&str; 5] = ["turn_limit", "token_budget", "tool_error", "model_error", "cancelled"];

/// The reward of episodes that did not complete, by outcome name: -1 for
/// turn_limit and token_budget by default (as in the reference setup), 0
/// for outcomes without a penalty.
#[derive(Debug, Clone, PartialEq)]
pub struct Penalties(BTreeMap<String, f64>);

impl Default for Penalties {
    fn default() -> Self {
        Self([("turn_limit".to_owned(), -1.0), ("token_budget".to_owned(), -1.0)].into())
    }
}

impl Penalties {
    /// The defaults with `overrides` replacing or adding penalties; an
    /// unknown outcome or a value that is not finite is an error naming it
    /// (as `outcome_penalties[...]`).
    pub fn with_overrides(overrides: &BTreeMap<String, f64>) -> Result<Self, String> {
        let mut penalties = Self::default();
        for (name, penalty) in overrides {
            if !PENALISED.contains(&name.as_str()) {
                return Err(format!(
                    "outcome_penalties has unknown outcome {name:?} (one of {})",
                    PENALISED.join(", ")
                ));
            }
            if !penalty.is_finite() {
                return Err(format!("outcome_penalties[{name}] must be finite, got {penalty}"));
            }
            penalties.0.insert(name.clone(), *penalty);
        }
        Ok(penalties)
    }

    /// The reward of an episode that ended with `outcome` (not completed).
    pub fn of(&self, outcome: EpisodeOutcome) -> f64 {
        self.0.get(outcome_name(outcome)).copied().unwrap_or(0.0)
    }
}

/// The registered reward names, the default first.
pub const REWARDS: [&str; 6] = [NDCG, ANSWER_F1, ANSWER_EM, CITATIONS, ANSWER_WITH_CITATIONS, JUDGE];
/// nDCG@10 of the submitted ranking (the default).
pub const NDCG: &str = "ndcg@10";
/// Token F1 of the submitted answer against the best reference answer.
pub const ANSWER_F1: &str = "answer_f1";
/// Exact match of the submitted answer with any reference answer.
pub const ANSWER_EM: &str = "answer_em";
/// F1 of the answer's citations (only documents a tool showed count).
pub const CITATIONS: &str = "citations";
/// Answer F1 times citation F1: right in words and in sources.
pub const ANSWER_WITH_CITATIONS: &str = "answer+citations";
/// An LLM judge's verdict on the answer against the references, in [0, 1].
/// The orchestrator asks the judge and sets the verdict as the episode's
/// [`JUDGE`] metric before scoring (`Reward::needs_judge`).
pub const JUDGE: &str = "judge";

/// The reward `name` names (empty: [`NDCG`]) with `overrides` of the
/// outcome penalties; an error names the bad field (`name`,
/// `outcome_penalties`).
pub fn named(name: &str, overrides: &BTreeMap<String, f64>) -> Result<Arc<dyn Reward>, String> {
    let penalties = Penalties::with_overrides(overrides)?;
    Ok(match name {
        "" | NDCG => Arc::new(NdcgReward { penalties, ..NdcgReward::default() }),
        ANSWER_F1 => Arc::new(AnswerReward { scored: AnswerScore::F1, penalties }),
        ANSWER_EM => Arc::new(AnswerReward { scored: AnswerScore::ExactMatch, penalties }),
        CITATIONS => Arc::new(AnswerReward { scored: AnswerScore::Citations, penalties }),
        ANSWER_WITH_CITATIONS => Arc::new(AnswerReward { scored: AnswerScore::WithCitations, penalties }),
        JUDGE => Arc::new(AnswerReward { scored: AnswerScore::Judge, penalties }),
        other => return Err(format!("name {other:?} is not a registered reward ({})", REWARDS.join(", "))),
    })
}

/// nDCG@k of the submitted ranking against the task's judgements (trec_eval's
/// definition). An episode that did not complete gets its outcome's penalty;
/// its `ndcg@k` metric is 0 either way, so evaluations count failed
/// episodes as 0.
#[derive(Debug, Clone)]
pub struct NdcgReward {
    pub k: usize,
    pub penalties: Penalties,
}

impl Default for NdcgReward {
    fn default() -> Self {
        Self { k: 10, penalties: Penalties::default() }
    }
}

impl Reward for NdcgReward {
    fn name(&self) -> &str {
        NDCG
    }

    fn headline(&self) -> &str {
        NDCG
    }

    fn score(&self, task: &Task, episode: &Episode) -> Scored {
        let judgements: Judgements = task.qrels.iter().map(|(d, r)| (d.clone(), *r)).collect();
        let metric = format!("ndcg@{}", self.k);
        let completed = episode.outcome() == EpisodeOutcome::Completed;
        let ndcg = if completed { ndcg_at(&episode.ranking, &judgements, self.k) } else { 0.0 };
        let reward = if completed { ndcg } else { self.penalties.of(episode.outcome()) };
        Scored { reward, metrics: [(metric, ndcg)].into() }
    }
}

/// Which of an answer's scores is the reward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AnswerScore {
    F1,
    ExactMatch,
    Citations,
    WithCitations,
    Judge,
}

/// Rewards of answers in words with citations ([`crate::answer`]). Every
/// one records all the answer metrics (`answer_f1`, `answer_em`,
/// `citation_precision`, `citation_recall`, `citation_f1`,
/// `citations_unseen`, `answer+citations`, and `judge` for the judge
/// reward), all 0 for an episode that did not complete, which gets its
/// outcome's penalty as reward.
#[derive(Debug, Clone)]
pub struct AnswerReward {
    scored: AnswerScore,
    penalties: Penalties,
}

impl Reward for AnswerReward {
    fn name(&self) -> &str {
        match self.scored {
            AnswerScore::F1 => ANSWER_F1,
            AnswerScore::ExactMatch => ANSWER_EM,
            AnswerScore::Citations => CITATIONS,
            AnswerScore::WithCitations => ANSWER_WITH_CITATIONS,
            AnswerScore::Judge => JUDGE,
        }
    }

    fn needs_judge(&self) -> bool {
        self.scored == AnswerScore::Judge
    }

    fn headline(&self) -> &str {
        match self.scored {
            AnswerScore::Citations => "citation_f1",
            _ => self.name(),
        }
    }

    fn check(&self, task: &Task) -> Result<(), String> {
        match self.scored {
            AnswerScore::Citations if !task.qrels.values().any(|&grade| grade >= 1) => {
                Err("it has no relevant document to cite".into())
            }
            AnswerScore::F1 | AnswerScore::ExactMatch | AnswerScore::WithCitations | AnswerScore::Judge
                if task.answers.is_empty() =>
            {
                Err("it has no reference answer (metadata.answers in queries.jsonl)".into())
            }
            _ => Ok(()),
        }
    }

    fn score(&self, task: &Task, episode: &Episode) -> Scored {
        let completed = episode.outcome() == EpisodeOutcome::Completed;
        let judgements: Judgements = task.qrels.iter().map(|(d, r)| (d.clone(), *r)).collect();
        let (f1, em, cited) = if completed {
            (
                answer::best_over(&task.answers, &episode.answer, answer::token_f1),
                answer::best_over(&task.answers, &episode.answer, answer::exact_match),
                answer::citations(&episode.citations, &episode.shown_doc_ids, &judgements),
            )
        } else {
            (0.0, 0.0, answer::CitationScore::default())
        };
        let combined = f1 * cited.f1;
        // The judge's verdict, which the orchestrator set before scoring; an
        // episode that did not complete, or did not answer, was not judged.
        let verdict = match self.scored {
            AnswerScore::Judge if completed => episode.metrics.get(JUDGE).copied().unwrap_or(0.0),
            _ => 0.0,
        };
        let mut metrics: BTreeMap<String, f64> = [
            (ANSWER_F1, f1),
            (ANSWER_EM, em),
            ("citation_precision", cited.precision),
            ("citation_recall", cited.recall),
            ("citation_f1", cited.f1),
            ("citations_unseen", cited.unseen as f64),
            (ANSWER_WITH_CITATIONS, combined),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value))
        .collect();
        if self.needs_judge() {
            metrics.insert(JUDGE.to_owned(), verdict);
        }
        let reward = if completed { metrics[self.headline()] } else { self.penalties.of(episode.outcome()) };
        Scored { reward, metrics }
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
        let scored =
            named(NDCG, &BTreeMap::new()).unwrap().score(&task(), &episode(EpisodeOutcome::Completed, &["b", "a"]));
        assert!((scored.reward - 1.0).abs() < 1e-12);
        // a then b, trec_eval's linear gains: (1 + 2/log2(3)) / (2 + 1/log2(3))
        let scored =
            named(NDCG, &BTreeMap::new()).unwrap().score(&task(), &episode(EpisodeOutcome::Completed, &["a", "b"]));
        let expected = (1.0 + 2.0 / 3f64.log2()) / (2.0 + 1.0 / 3f64.log2());
        assert!((scored.reward - expected).abs() < 1e-12);
        assert_eq!(scored.metrics["ndcg@10"], scored.reward);
    }

    #[test]
    fn budget_outcomes_are_penalised_and_failures_score_zero_ndcg() {
        let reward = named("", &BTreeMap::new()).unwrap();
        let turn_limit = reward.score(&task(), &episode(EpisodeOutcome::TurnLimit, &["b"]));
        assert_eq!((turn_limit.reward, turn_limit.metrics["ndcg@10"]), (-1.0, 0.0));
        let tool_error = reward.score(&task(), &episode(EpisodeOutcome::ToolError, &[]));
        assert_eq!(tool_error.reward, 0.0);
        let custom = named(NDCG, &[("tool_error".to_owned(), -0.5)].into()).unwrap();
        assert_eq!(custom.score(&task(), &episode(EpisodeOutcome::ToolError, &[])).reward, -0.5);
        let unknown = named(NDCG, &[("timeout".to_owned(), -1.0)].into()).err().unwrap();
        assert!(unknown.contains("\"timeout\""), "{unknown}");
        let unnamed = named("bleu", &BTreeMap::new()).err().unwrap();
        assert!(unnamed.contains("\"bleu\"") && unnamed.contains("answer+citations"), "{unnamed}");
    }
}
