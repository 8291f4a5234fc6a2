//! Scoring an episode: the reward a spec names, with the judge's verdict
//! fetched first when the reward needs one. Runs, validations and
//! evaluations all score through a [`Scorer`], so a reward means the same
//! everywhere.

use std::sync::Arc;

use sleuth_metrics::reward::{JUDGE, Reward, Scored};
use sleuth_proto::common::v1::{Episode, EpisodeOutcome, Task};
use sleuth_proto::rollout::v1::RewardSpec;

use crate::judge::Judge;

/// A reward and, for the judge reward, the judge.
#[derive(Clone)]
pub struct Scorer {
    reward: Arc<dyn Reward>,
    judge: Option<Arc<Judge>>,
}

impl Scorer {
    /// The scorer of `spec` (none: nDCG@10); an error names the field under
    /// `reward.`, and the judge reward without a configured judge is one.
    pub fn of_spec(spec: Option<&RewardSpec>, judge: Option<&Arc<Judge>>) -> Result<Self, String> {
        let reward = sleuth_metrics::reward::of_spec(spec)?;
        if reward.needs_judge() && judge.is_none() {
            return Err(format!(
                "name {:?} needs the orchestrator's judge: set SLEUTH_JUDGE_URL (docs/rewards.md)",
                reward.name()
            ));
        }
        let judge = judge.cloned().filter(|_| reward.needs_judge());
        Ok(Self { reward, judge })
    }

    /// The reward.
    pub fn reward(&self) -> &dyn Reward {
        self.reward.as_ref()
    }

    /// Scores `episode`; a judge that gives no verdict is an error, never a
    /// score. The verdict is left in the episode's `judge` metric.
    pub async fn score(&self, task: &Task, episode: &mut Episode) -> Result<Scored, String> {
        if let Some(judge) = &self.judge
            && episode.outcome() == EpisodeOutcome::Completed
            && !episode.answer.is_empty()
        {
            let verdict = judge.verdict(task, &episode.answer).await?;
            episode.metrics.insert(JUDGE.to_owned(), verdict);
        }
        Ok(self.reward.score(task, episode))
    }
}
