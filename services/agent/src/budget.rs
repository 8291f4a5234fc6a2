//! An episode's budgets with the defaults applied, and the wall-clock
//! deadline they imply. The agent owns what a budget means; the orchestrator
//! asks it for an episode's deadline instead of guessing one (a generic 120 s
//! request timeout used to cut long episodes and report them as dead workers).

use std::time::Duration;

use sleuth_proto::common::v1::AgentBudget;

/// Budgets when the request leaves them at 0.
pub const DEFAULT_MAX_TURNS: u32 = 8;
pub const DEFAULT_TURN_TOKENS: u32 = 512;
pub const DEFAULT_EPISODE_TOKENS: u32 = 8192;

/// Wall-clock allowance of one turn in an episode's deadline: the inference
/// gateway's default per-turn policy timeout (`SLEUTH_POLICY_TIMEOUT`, 5
/// minutes, queueing included) and a minute for the turn's tool calls.
const TURN_ALLOWANCE: Duration = Duration::from_secs(6 * 60);
/// Listing tools, fetching the trace.
const EPISODE_OVERHEAD: Duration = Duration::from_secs(60);

/// The limits one episode runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Assistant turns before the episode ends as `turn_limit`.
    pub max_turns: u32,
    /// Tokens one turn may generate before it ends as `token_budget`.
    pub turn_tokens: u32,
    /// Tokens of the whole episode (prompt, generated, observations).
    pub episode_tokens: u32,
    /// Characters of one tool observation the model sees (0 = no cap).
    pub observation_char_cap: u32,
}

impl Budget {
    /// `budget` with its unset (0) fields at the defaults.
    pub fn of(budget: Option<AgentBudget>) -> Self {
        let budget = budget.unwrap_or_default();
        let or = |value: u32, default: u32| if value == 0 { default } else { value };
        Self {
            max_turns: or(budget.max_turns, DEFAULT_MAX_TURNS),
            turn_tokens: or(budget.max_new_tokens_per_turn, DEFAULT_TURN_TOKENS),
            episode_tokens: or(budget.max_episode_tokens, DEFAULT_EPISODE_TOKENS),
            observation_char_cap: budget.observation_char_cap,
        }
    }

    /// How long an episode under this budget may take before its caller
    /// gives up on the worker: every turn at its allowance, plus overhead.
    pub fn deadline(&self) -> Duration {
        EPISODE_OVERHEAD + TURN_ALLOWANCE * self.max_turns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_fields_take_the_defaults() {
        let budget = Budget::of(Some(AgentBudget { max_turns: 3, observation_char_cap: 100, ..Default::default() }));
        assert_eq!(budget, Budget { max_turns: 3, turn_tokens: 512, episode_tokens: 8192, observation_char_cap: 100 });
        assert_eq!(Budget::of(None).max_turns, DEFAULT_MAX_TURNS);
    }

    #[test]
    fn deadlines_grow_with_the_turns_far_past_a_generic_request_timeout() {
        let short = Budget::of(Some(AgentBudget { max_turns: 1, ..Default::default() })).deadline();
        let long = Budget::of(Some(AgentBudget { max_turns: 30, ..Default::default() })).deadline();
        assert!(short > Duration::from_secs(120), "{short:?}");
        assert_eq!(long - short, TURN_ALLOWANCE * 29);
    }
}
