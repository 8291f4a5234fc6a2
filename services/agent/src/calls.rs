//! Running the model's tool calls: each on the tool gateway, its
//! observation appended as a tool message, and what the searches found
//! kept for the submission without ids and for citations; the answer tools
//! end the episode. Where the policy is offered `follow_lead`, every
//! search's observation ends with its leads, and a `follow_lead` call is
//! run as `bm25_search` of the lead it numbers.

use serde_json::json;
use sleuth_chat::bridge::{WordStats, read_in};
use sleuth_chat::observation::{
    LEADS, ListedHit, SEARCH_HITS, SUBMITTED, Searched, parse_search_results, ranking, shows, with_leads,
};
use sleuth_chat::tools::{BM25_SEARCH, FOLLOW_LEAD, SEARCH_TOOLS};
use sleuth_kit::client::within;
use sleuth_proto::common::v1::{ChatMessage, EpisodeOutcome, ToolCall};
use sleuth_proto::tools::v1 as tools;
use tonic::Code;

use crate::episode::{Clients, End};
use crate::prompt::{SUBMIT_ANSWER, SUBMIT_TOOL, parse_answer, parse_submission};

/// What an episode's searches found: each search's hit ids, in order (what
/// a submission without ids ranks), every document a tool showed (what a
/// citation may count for), and, for a teacher, the collection's
/// statistics of every word they showed (`None` asks the gateway for
/// none), the leads `follow_lead` follows, where it is offered, and the
/// latest search's hits (where the next query may have been read).
pub(crate) struct Found {
    pub searches: Vec<Searched>,
    pub shown: Vec<String>,
    pub word_stats: Option<WordStats>,
    pub leads: Option<Leads>,
    latest: Vec<ListedHit>,
}

/// The leads of an episode whose policy is offered `follow_lead`.
pub(crate) struct Leads {
    /// The question and every query searched: what no lead repeats.
    known: Vec<String>,
    /// The leads listed under the latest search's results, most salient first.
    listed: Vec<String>,
}

impl Found {
    /// Nothing found yet for `question`; `statistics`: ask the gateway for
    /// the statistics of the words shown (a scripted teacher ranks bridges
    /// by them); `follow`: `follow_lead` is offered, so searches list leads
    /// (which are ranked by the same statistics).
    pub fn new(question: &str, statistics: bool, follow: bool) -> Self {
        let leads = follow.then(|| Leads { known: vec![question.to_owned()], listed: Vec::new() });
        let word_stats = (statistics || follow).then(WordStats::default);
        Self { searches: Vec::new(), shown: Vec::new(), word_stats, leads, latest: Vec::new() }
    }

    fn show(&mut self, id: &str) {
        if !self.shown.iter().any(|seen| seen == id) {
            self.shown.push(id.to_owned());
        }
    }

    /// Keeps a search for `query` that ranked `ids` (the first `shown` of
    /// them shown), linked to the latest search's hit the query was read in:
    /// a lead followed, or a name the model read and searched.
    fn searched(&mut self, query: Option<&str>, ids: Vec<String>, shown: usize) {
        let link = query.and_then(|query| read_in(&self.latest, query)).map(|hit| hit.id.clone());
        self.searches.push(Searched { ids, shown, link });
    }

    /// `observation` of a search for `query`, with the leads its results
    /// offer where `follow_lead` is (which become the ones it numbers).
    fn list_leads(&mut self, observation: String, query: Option<&str>) -> String {
        self.latest = parse_search_results(&observation);
        let (Some(leads), Some(stats)) = (self.leads.as_mut(), self.word_stats.as_ref()) else {
            return observation;
        };
        leads.known.extend(query.map(str::to_owned));
        leads.listed = sleuth_chat::bridge::leads(&self.latest, &leads.known, stats);
        with_leads(&observation, &leads.listed)
    }
}

impl Leads {
    /// The `bm25_search` call a `follow_lead` call's arguments ask for, or
    /// why there is none (for the model to read and correct).
    fn follow(&self, arguments_json: &str) -> Result<String, String> {
        let listed = &self.listed;
        let arguments: serde_json::Value =
            serde_json::from_str(arguments_json).map_err(|e| format!("arguments are not JSON: {e}"))?;
        let n = arguments
            .get("n")
            .and_then(|n| n.as_u64())
            .ok_or(format!("\"n\" must be a lead's number, 1 to {LEADS}"))?;
        let lead = match n.checked_sub(1).and_then(|i| listed.get(i as usize)) {
            Some(lead) => lead,
            None if listed.is_empty() => return Err("the latest search listed no leads".into()),
            None => return Err(format!("no lead {n}: the latest search listed {}", listed.len())),
        };
        Ok(json!({"query": lead, "k": SEARCH_HITS}).to_string())
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
                    messages.push(observed(call, format!("Error: {SUBMIT_ANSWER}: {why}")));
                    continue;
                }
            }
        }
        // A lead is followed as the policy would search it by name.
        let leads = found.leads.as_ref().filter(|_| call.name == FOLLOW_LEAD);
        let (name, arguments_json) = match leads.map(|leads| leads.follow(&call.arguments_json)) {
            Some(Ok(arguments)) => (BM25_SEARCH.to_owned(), arguments),
            Some(Err(why)) => {
                messages.push(observed(call, format!("Error: {FOLLOW_LEAD}: {why}")));
                continue;
            }
            None => (call.name.clone(), call.arguments_json.clone()),
        };
        let search = SEARCH_TOOLS.contains(&name.as_str());
        let arguments: serde_json::Value = serde_json::from_str(&arguments_json).unwrap_or_default();
        let query = arguments.get("query").and_then(|q| q.as_str()).filter(|_| search);
        let request = tools::CallToolRequest {
            collection: collection.to_owned(),
            name: name.clone(),
            arguments_json: arguments_json.clone(),
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
                        let visible = |id: &&String| shows(&response.observation, response.truncated, id);
                        ids.iter().take(shown).filter(visible).for_each(|id| found.show(id));
                        found.searched(query, ids, shown);
                    }
                    if let Some(document) = &response.document {
                        found.show(&document.doc_id);
                    }
                    if let Some(stats) = found.word_stats.as_mut() {
                        stats.df.extend(response.word_df);
                        stats.documents = response.documents;
                    }
                    match search {
                        true => found.list_leads(response.observation, query),
                        false => response.observation,
                    }
                }
                // The model's mistake (bad arguments, unknown tool or document): it sees the error and can recover.
                Err(status) if matches!(status.code(), Code::InvalidArgument | Code::NotFound) => {
                    format!("Error: {}", status.message())
                }
                Err(status) => {
                    return Some(End::new(EpisodeOutcome::ToolError, format!("{name}: {}", status.message())));
                }
            };
        messages.push(observed(call, observation));
    }
    None
}

/// The tool message answering `call`.
fn observed(call: &ToolCall, content: String) -> ChatMessage {
    ChatMessage {
        role: "tool".into(),
        content,
        tool_call_id: call.id.clone(),
        name: call.name.clone(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn follow(found: &Found, arguments_json: &str) -> Result<String, String> {
        found.leads.as_ref().expect("follow_lead is offered").follow(arguments_json)
    }

    #[test]
    fn leads_are_listed_under_searches_and_followed_by_number() {
        let mut found = Found::new("Who founded Klabou Atelier?", false, true);
        let stats = found.word_stats.as_mut().unwrap();
        stats.documents = 100;
        stats.df.extend([("ada".to_owned(), 4), ("varnok".to_owned(), 3), ("started".to_owned(), 40)]);
        assert_eq!(follow(&found, r#"{"n": 1}"#).unwrap_err(), "the latest search listed no leads");
        let observation = "bm25_search results for \"q\":\n[1] doc_id: o3 | Klabou Atelier\nKlabou Atelier was started by Ada Varnok.\n";
        let listed = found.list_leads(observation.to_owned(), Some("Who founded Klabou Atelier?"));
        assert!(listed.ends_with("Leads to follow: 1. Ada Varnok; 2. started\n"), "{listed}");
        let followed: serde_json::Value = serde_json::from_str(&follow(&found, r#"{"n": 1}"#).unwrap()).unwrap();
        assert_eq!(followed, json!({"query": "Ada Varnok", "k": SEARCH_HITS}));
        assert_eq!(follow(&found, r#"{"n": 3}"#).unwrap_err(), "no lead 3: the latest search listed 2");
        for bad in [r#"{"n": 0}"#, r#"{"n": "1"}"#, "{}"] {
            assert!(follow(&found, bad).is_err(), "{bad}");
        }
        assert!(follow(&found, "nope").unwrap_err().contains("not JSON"));
        // A lead searched is known: the next search lists none that repeat it.
        let person = "bm25_search results for \"Ada Varnok\":\n[1] doc_id: p3 | Ada Varnok\nAda Varnok started.\n";
        let next = found.list_leads(person.to_owned(), Some("Ada Varnok"));
        assert!(next.ends_with("Leads to follow: 1. started\n"), "{next}");
    }

    #[test]
    fn a_search_for_a_name_the_latest_results_show_links_the_hit_it_was_read_in() {
        let mut found = Found::new("Who founded Klabou Atelier?", false, false);
        found.searched(Some("Who founded Klabou Atelier?"), vec!["o3".into()], 1);
        let observation = "bm25_search results for \"q\":\n[1] doc_id: o3 | Klabou Atelier\nKlabou Atelier was started by Ada Varnok.\n";
        assert_eq!(found.list_leads(observation.to_owned(), Some("Who founded Klabou Atelier?")), observation);
        found.searched(Some("ada varnok"), vec!["p3".into()], 1);
        found.searched(Some("Bouzal"), vec!["t1".into()], 1);
        let links: Vec<Option<&str>> = found.searches.iter().map(|s| s.link.as_deref()).collect();
        assert_eq!(links, [None, Some("o3"), None], "the opening search and an unread name link nothing");
    }
}
