//! The YAML form of a run spec (`sleuth run create -f spec.yaml`): the same
//! fields as `sleuth.rollout.v1.RunSpec`, snake_case; an unknown or
//! misspelled field is an error naming it, never silently ignored. `split`
//! is required (there is no default split to train on by accident). The
//! learner takes `global_batch_size`, `max_staleness`, `training` and the
//! start model (`policy.model_uri`, e.g. an SFT export, or `policy.from_run`,
//! another run whose final policy it starts from) from the spec.
//!
//! ```yaml
//! name: scifact-grpo
//! train: {source_uri: data/scifact, collection: scifact, split: train}
//! agent:
//!   budget: {max_turns: 8, max_new_tokens_per_turn: 512, max_episode_tokens: 8192, observation_char_cap: 2000}
//!   sampling: {temperature: 1.0}
//! group_size: 8
//! global_batch_size: 16
//! max_epochs: 1
//! rollout_max_concurrency: 64
//! max_staleness: 1
//! reward: {name: ndcg@10, outcome_penalties: {turn_limit: -1, token_budget: -1}}
//! training: {advantage: grpo, loss: ppo, learning_rate: 1.0e-6, checkpoint_every: 10}
//! ```
//!
//! Answers in words with citations instead of a ranking (docs/rewards.md):
//! `agent: {tools: [bm25_search, submit_answer]}` and
//! `reward: {name: answer+citations}`.

use std::collections::BTreeMap;

use serde::Deserialize;
use sleuth_proto::agent::v1::AgentConfig;
use sleuth_proto::common::v1::{AgentBudget, SamplingParams};
use sleuth_proto::rollout::v1 as pb;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSpec {
    #[serde(default)]
    name: String,
    #[serde(default)]
    policy: Option<Policy>,
    train: TaskSet,
    #[serde(default)]
    validation: Option<TaskSet>,
    #[serde(default)]
    agent: Option<Agent>,
    group_size: u32,
    global_batch_size: u32,
    #[serde(default = "one")]
    max_epochs: u32,
    rollout_max_concurrency: u32,
    #[serde(default = "one")]
    max_staleness: u32,
    #[serde(default)]
    reward: Option<Reward>,
    #[serde(default)]
    training: Option<Training>,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Policy {
    /// The model the run starts from: an HF directory (absolute path) or
    /// s3:// prefix with the served model's architecture and tokenizer.
    #[serde(default)]
    model_uri: String,
    /// Or the run whose policy it starts from (the policy that run ended
    /// with), e.g. an SFT run before GRPO.
    #[serde(default)]
    from_run: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSet {
    source_uri: String,
    collection: String,
    #[serde(default)]
    split: String,
    #[serde(default)]
    limit: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Agent {
    #[serde(default)]
    budget: Option<Budget>,
    #[serde(default)]
    sampling: Option<Sampling>,
    #[serde(default)]
    tools: Vec<String>,
    #[serde(default)]
    system_prompt: String,
    /// A teacher instead of the policy (SFT data): bm25:<hops>, vector:<hops>, mixture, or
    /// model:<name> (a model at the agent workers' SLEUTH_TEACHER_URL).
    #[serde(default)]
    teacher: String,
    /// A search tool the agent runs on the question before the first turn.
    #[serde(default)]
    opening_search: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Budget {
    #[serde(default)]
    max_turns: u32,
    #[serde(default)]
    max_new_tokens_per_turn: u32,
    #[serde(default)]
    max_episode_tokens: u32,
    #[serde(default)]
    observation_char_cap: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Sampling {
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: u32,
    #[serde(default)]
    seed: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Reward {
    #[serde(default)]
    name: String,
    #[serde(default)]
    outcome_penalties: BTreeMap<String, f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Training {
    #[serde(default)]
    advantage: String,
    #[serde(default)]
    loss: String,
    #[serde(default)]
    learning_rate: f64,
    #[serde(default)]
    kl_coef: f64,
    #[serde(default)]
    checkpoint_every: u32,
    #[serde(default)]
    eval_every: u32,
    #[serde(default)]
    sft_min_reward: f64,
    #[serde(default)]
    copy_rehearsal: u32,
    #[serde(default)]
    lr_schedule: String,
}

impl TaskSet {
    pub fn into_proto(self) -> pb::TaskSet {
        pb::TaskSet { source_uri: self.source_uri, collection: self.collection, split: self.split, limit: self.limit }
    }
}

/// Parses the YAML text of a run spec into the proto.
pub fn parse(text: &str) -> Result<pb::RunSpec, String> {
    let spec: RunSpec = serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
    let agent = spec.agent.map(|a| AgentConfig {
        budget: a.budget.map(|b| AgentBudget {
            max_turns: b.max_turns,
            max_new_tokens_per_turn: b.max_new_tokens_per_turn,
            max_episode_tokens: b.max_episode_tokens,
            observation_char_cap: b.observation_char_cap,
        }),
        sampling: a.sampling.map(|s| SamplingParams {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            seed: s.seed,
            ..Default::default()
        }),
        tools: a.tools,
        system_prompt: a.system_prompt,
        teacher: a.teacher,
        opening_search: a.opening_search,
    });
    Ok(pb::RunSpec {
        name: spec.name,
        policy: spec.policy.map(|p| pb::PolicySpec { model_uri: p.model_uri, from_run: p.from_run }),
        train: Some(spec.train.into_proto()),
        validation: spec.validation.map(TaskSet::into_proto),
        agent,
        group_size: spec.group_size,
        global_batch_size: spec.global_batch_size,
        max_epochs: spec.max_epochs,
        rollout_max_concurrency: spec.rollout_max_concurrency,
        max_staleness: spec.max_staleness,
        reward: spec
            .reward
            .map(|r| pb::RewardSpec { name: r.name, outcome_penalties: r.outcome_penalties.into_iter().collect() }),
        training: spec.training.map(|t| pb::TrainingSpec {
            advantage: t.advantage,
            loss: t.loss,
            learning_rate: t.learning_rate,
            kl_coef: t.kl_coef,
            checkpoint_every: t.checkpoint_every,
            eval_every: t.eval_every,
            sft_min_reward: t.sft_min_reward,
            copy_rehearsal: t.copy_rehearsal,
            lr_schedule: t.lr_schedule,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = "name: t\ntrain: {source_uri: d, collection: c, split: test}\ngroup_size: 4\nglobal_batch_size: 2\nrollout_max_concurrency: 8\nreward: {outcome_penalties: {turn_limit: -0.5}}\n";

    #[test]
    fn a_spec_parses_into_the_proto() {
        let spec = parse(SPEC).unwrap();
        assert_eq!((spec.group_size, spec.max_epochs, spec.max_staleness), (4, 1, 1));
        assert_eq!(spec.train.unwrap().collection, "c");
        assert_eq!(spec.reward.unwrap().outcome_penalties["turn_limit"], -0.5);
    }

    #[test]
    fn unknown_fields_are_named() {
        let error = parse(&format!("{SPEC}group_sise: 3\n")).unwrap_err();
        assert!(error.contains("group_sise"), "{error}");
        let error = parse(&SPEC.replace("split: test", "splt: test")).unwrap_err();
        assert!(error.contains("splt"), "{error}");
    }
}
