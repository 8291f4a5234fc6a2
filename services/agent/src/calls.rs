//! Running the model's tool calls: each on the tool gateway, its
//! observation appended as a tool message, and what the searches found
//! kept for the submission without ids and for citations; the answer tools
//! end the episode.

use sleuth_chat::bridge::WordStats;
use sleuth_chat::observation::{SUBMITTED, Searched, ranking};
use sleuth_kit::client::within;
use sleuth_proto::common::v1::{ChatMessage, EpisodeOutcome};
use sleuth_proto::tools::v1 as tools;
use tonic::Code;

use crate::episode::{Clients, End};
use crate::prompt::{SUBMIT_ANSWER, SUBMIT_TOOL, parse_answer, parse_submission};

/// What an episode's searches found: each search's hit ids, in order (what
/// a submission without ids ranks), every document a tool showed (what a
/// citation may count for), and, for a teacher, the collection's
/// statistics of every word they showed (`None` asks the gateway for none).
pub(crate) struct Found {
    pub searches: Vec<Searched>,
    pub shown: Vec<String>,
    pub word_stats: Option<WordStats>,
}

impl Found {
    fn show(&mut self, id: &str) {
        if !self.shown.iter().any(|seen| seen == id) {
            self.shown.push(id.to_owned());
        }
    }
}

/// Runs the reply's tool calls in order, appending one tool message each
/// and what each search found to `found`. Returns how the episode ends
/// when it does (an answer, or a dead gateway).
pub(crate) async fn run_tools(
    clients: &Clients,
    episode_id: &str,
    collection: &str,
    reply: &ChatMessage,
    cap: u32,
    messages: &mut Vec<ChatMessage>,
    found: &mut Found,
) -> Option<End> {
    for call in &reply.tool_calls {
        if call.name == SUBMIT_TOOL {
            return Some(match parse_submission(&call.arguments_json) {
                Ok(ids) => End {
                    ranking: ids.unwrap_or_else(|| ranking(&found.searches, SUBMITTED)),
                    ..End::new(EpisodeOutcome::Completed, "")
                },
                // An unreadable answer is still the answer: it ranks nothing.
                Err(why) => End::new(EpisodeOutcome::Completed, format!("unusable submission: {why}")),
            });
        }
        if call.name == SUBMIT_ANSWER {
            match parse_answer(&call.arguments_json) {
                Ok(answer) => return Some(End { answer: Some(answer), ..End::new(EpisodeOutcome::Completed, "") }),
                // Like a malformed tool call: the model sees why and may answer again.
                Err(why) => {
                    messages.push(ChatMessage {
                        role: "tool".into(),
                        content: format!("Error: {SUBMIT_ANSWER}: {why}"),
                        tool_call_id: call.id.clone(),
                        name: call.name.clone(),
                        ..Default::default()
                    });
                    continue;
                }
            }
        }
        let request = tools::CallToolRequest {
            collection: collection.to_owned(),
            name: call.name.clone(),
            arguments_json: call.arguments_json.clone(),
            observation_char_cap: cap,
            episode_id: episode_id.to_owned(),
            // A submission without ids ranks to the depth the metric scores.
            ranking_depth: SUBMITTED as u32,
            word_stats: found.word_stats.is_some(),
        };
        let observation =
            match within(clients.tool_timeout, request, async |r| clients.tools.clone().call_tool(r).await).await {
                Ok(response) => {
                    let response = response.into_inner();
                    if !response.hits.is_empty() {
                        // A gateway that ranks no deeper than it shows leaves `hits_shown` 0.
                        let shown = match response.hits_shown as usize {
                            0 => response.hits.len(),
                            shown => shown,
                        };
                        let ids: Vec<String> = response.hits.into_iter().map(|hit| hit.doc_id).collect();
                        // A hit cut off by the observation cap was never shown.
                        let visible = |id: &&String| {
                            !response.truncated || response.observation.contains(&format!("doc_id: {id}"))
                        };
                        ids.iter().take(shown).filter(visible).for_each(|id| found.show(id));
                        found.searches.push(Searched { ids, shown });
                    }
                    if let Some(document) = &response.document {
                        found.show(&document.doc_id);
                    }
                    if let Some(stats) = found.word_stats.as_mut() {
                        stats.df.extend(response.word_df);
                        stats.documents = response.documents;
                    }
                    response.observation
                }
                // The model's mistake (bad arguments, unknown tool or document): it sees the error and can recover.
                Err(status) if matches!(status.code(), Code::InvalidArgument | Code::NotFound) => {
                    format!("Error: {}", status.message())
                }
                Err(status) => {
                    return Some(End::new(EpisodeOutcome::ToolError, format!("{}: {}", call.name, status.message())));
                }
            };
        messages.push(ChatMessage {
            role: "tool".into(),
            content: observation,
            tool_call_id: call.id.clone(),
            name: call.name.clone(),
            ..Default::default()
        });
    }
    None
}
