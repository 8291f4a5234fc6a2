//! The ticket an episode runs under at the inference gateway (see
//! [`sleuth_kit::ticket`]): the orchestrator issues it with each attempt,
//! from what the agent will do with the episode.

use sleuth_kit::ticket::{Grant, TicketKey};
use sleuth_proto::agent::v1::RunEpisodeRequest;

use crate::budget::Budget;

/// `request`'s ticket under `key`: the teacher grant when a teacher
/// (scripted or a model) plays it (its replies are recorded as the policy's tokens), and
/// the trace bounded by the episode's token budget.
pub fn issue(key: &TicketKey, request: &RunEpisodeRequest) -> String {
    let config = request.config.as_ref();
    let grant = match config.is_some_and(|c| !c.teacher.is_empty()) {
        true => Grant::Teacher,
        false => Grant::Policy,
    };
    key.issue(&request.episode_id, grant, Budget::of(config.and_then(|c| c.budget)).episode_tokens)
}
