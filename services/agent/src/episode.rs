//! One episode of the search agent: ask the model, run its tool calls, feed
//! the observations back, until it submits its answer (a ranking, or words
//! with citations) or a budget ends it.
//! History is never truncated; the outcome says what ended the episode.

use sleuth_chat::observation::SEARCH_HITS;
use sleuth_chat::tools::{BM25_SEARCH, SEARCH_TOOLS};
use sleuth_kit::client::{MeshChannel, within};
use sleuth_proto::agent::v1::{AgentConfig, RunEpisodeRequest};
use sleuth_proto::common::v1::{
    ChatMessage, Episode, EpisodeOutcome, SamplingParams, SegmentKind, Task, ToolCall, ToolSpec,
};
use sleuth_proto::inference::v1 as inference;
use sleuth_proto::inference::v1::inference_gateway_client::InferenceGatewayClient;
use sleuth_proto::tools::v1 as tools;
use sleuth_proto::tools::v1::tool_gateway_client::ToolGatewayClient;
use tonic::Code;
use tracing::Instrument as _;

use crate::budget::Budget;
use crate::calls::{Found, run_tools};
use crate::model_teacher::{ModelTeacher, TeacherEndpoint};
use crate::prompt::{ANSWER_TOOLS, Answer, FOLLOW_LEAD, SUBMIT_ANSWER, SUBMIT_TOOL, SYSTEM_PROMPT, agent_tool};

/// The observation after a tool call the gateway could not parse.
pub const MALFORMED_CALL: &str = "Error: the tool call could not be parsed. Call tools as \
<tool_call>[{\"name\": \"<tool>\", \"arguments\": {...}}]</tool_call> with valid JSON.";

#[derive(Clone)]
pub struct Clients {
    /// The inference gateway: one call per turn.
    pub model: InferenceGatewayClient<MeshChannel>,
    /// The tool gateway: the collection's tools and each call of one.
    pub tools: ToolGatewayClient<MeshChannel>,
    /// Deadline of each tool call.
    pub tool_timeout: std::time::Duration,
    /// Deadline of each turn.
    pub model_timeout: std::time::Duration,
    /// Where `model:<name>` teachers are asked; none without `SLEUTH_TEACHER_URL`.
    pub teacher: Option<TeacherEndpoint>,
}

/// Who replies in the policy's place, when a config names a teacher.
enum Teacher {
    Scripted(crate::teacher::Teacher),
    Model(ModelTeacher),
}

/// How the loop ended.
pub(crate) struct End {
    pub outcome: EpisodeOutcome,
    pub detail: String,
    pub ranking: Vec<String>,
    pub answer: Option<Answer>,
}

impl End {
    pub(crate) fn new(outcome: EpisodeOutcome, detail: impl Into<String>) -> Self {
        Self { outcome, detail: detail.into(), ranking: Vec::new(), answer: None }
    }
}

/// Checks the request, naming the bad field.
pub fn validate(request: &RunEpisodeRequest) -> Result<(), String> {
    if request.episode_id.trim().is_empty() {
        return Err("episode_id must not be empty".into());
    }
    let task = request.task.as_ref().ok_or("task is required")?;
    if task.question.trim().is_empty() {
        return Err(format!("task.question of task {:?} must not be empty", task.task_id));
    }
    if task.collection.trim().is_empty() {
        return Err(format!("task.collection of task {:?} must name a tool-gateway collection", task.task_id));
    }
    crate::teacher::TeacherSpec::parse(&request.config.as_ref().map(|c| c.teacher.clone()).unwrap_or_default())
        .map_err(|e| format!("config.{e}"))?;
    check_opening_search(&request.config.clone().unwrap_or_default()).map_err(|e| format!("config.{e}"))?;
    let budget = request.config.as_ref().and_then(|c| c.budget).unwrap_or_default();
    if budget.max_turns > 256 {
        return Err(format!("config.budget.max_turns must be at most 256, got {}", budget.max_turns));
    }
    let most = sleuth_kit::limits::MAX_EPISODE_TOKENS;
    if budget.max_episode_tokens > most {
        return Err(format!(
            "config.budget.max_episode_tokens must be at most {most} (what one message may carry back), got {}",
            budget.max_episode_tokens
        ));
    }
    Ok(())
}

/// Checks `opening_search` (an error names it as `opening_search`): empty, or
/// a search tool that `tools` (when it names any) offers.
pub fn check_opening_search(config: &AgentConfig) -> Result<(), String> {
    let tool = config.opening_search.as_str();
    if tool.is_empty() {
        return Ok(());
    }
    if !SEARCH_TOOLS.contains(&tool) {
        return Err(format!("opening_search {tool:?} is not a search tool ({})", SEARCH_TOOLS.join(", ")));
    }
    if !config.tools.is_empty() && !config.tools.iter().any(|t| t == tool) {
        return Err(format!("opening_search {tool:?} is not among the offered tools {:?}", config.tools));
    }
    Ok(())
}

/// Runs the episode to its end. Errors of the model or the tools end the
/// episode with the matching outcome; they are never returned as errors, so
/// the orchestrator always gets the trace of what happened.
pub async fn run(clients: &Clients, request: &RunEpisodeRequest) -> Episode {
    let task = request.task.clone().unwrap_or_default();
    let config = request.config.clone().unwrap_or_default();
    let budget = Budget::of(config.budget);
    let (max_turns, turn_tokens, episode_tokens) = (budget.max_turns, budget.turn_tokens, budget.episode_tokens);
    let system = if config.system_prompt.is_empty() { SYSTEM_PROMPT.to_owned() } else { config.system_prompt.clone() };
    let mut messages = vec![
        ChatMessage { role: "system".into(), content: system, ..Default::default() },
        ChatMessage { role: "user".into(), content: task.question.clone(), ..Default::default() },
    ];
    let mut turns = 0u32;
    let mut found = Found::new(&task.question, false, false);
    let end = match offered_tools(clients, &task.collection, &config).await {
        Err(end) => end,
        Ok(tool_specs) => 'episode: {
            let mut teacher = match teacher_for(clients, &config, request, &task, &tool_specs) {
                Ok(teacher) => teacher,
                Err(why) => break 'episode End::new(EpisodeOutcome::ToolError, why),
            };
            let mut used_tokens = 0u32;
            // A scripted teacher ranks bridges by the collection's statistics.
            let scripted = matches!(teacher, Some(Teacher::Scripted(_)));
            found = Found::new(&task.question, scripted, tool_specs.iter().any(|t| t.name == FOLLOW_LEAD));
            if !config.opening_search.is_empty() {
                let cap = budget.observation_char_cap;
                let opened =
                    open(clients, request, &config.opening_search, &tool_specs, cap, &mut messages, &mut found);
                if let Some(end) = opened.await {
                    break 'episode end;
                }
            }
            loop {
                if turns >= max_turns {
                    break End::new(EpisodeOutcome::TurnLimit, format!("no answer after max_turns {max_turns}"));
                }
                let left = episode_tokens.saturating_sub(used_tokens);
                if left == 0 {
                    break End::new(EpisodeOutcome::TokenBudget, format!("max_episode_tokens {episode_tokens} used"));
                }
                let mut sampling = SamplingParams {
                    max_new_tokens: turn_tokens.min(left),
                    ..config.sampling.clone().unwrap_or_default()
                };
                // One seed per turn: the same seed every turn would replay
                // the same random draws at every position of every turn.
                sampling.seed = sampling.seed.map(|seed| sleuth_kit::seed::derive(seed, &format!("turn {turns}")));
                let teacher_reply = match teacher.as_mut() {
                    None => String::new(),
                    Some(Teacher::Scripted(teacher)) => {
                        let observation = messages.last().filter(|m| m.role == "tool").map(|m| m.content.as_str());
                        let stats = found.word_stats.get_or_insert_default();
                        teacher.reply(observation, stats, max_turns - turns)
                    }
                    Some(Teacher::Model(teacher)) => {
                        let asked = teacher.reply(&messages, &tool_specs, &sampling);
                        match asked.instrument(tracing::info_span!("teacher_turn", turn = turns)).await {
                            Ok(reply) => reply,
                            Err(why) => break End::new(EpisodeOutcome::ModelError, why),
                        }
                    }
                };
                let chat = inference::ChatRequest {
                    episode_id: request.episode_id.clone(),
                    run_id: request.run_id.clone(),
                    messages: messages.clone(),
                    tools: tool_specs.clone(),
                    sampling: Some(sampling),
                    teacher_reply,
                    turns_before: Some(turns),
                    ticket: request.ticket.clone(),
                    ..Default::default()
                };
                let response = match within(clients.model_timeout, chat, async |r| clients.model.clone().chat(r).await)
                    .instrument(tracing::info_span!("policy_turn", turn = turns))
                    .await
                {
                    Ok(response) => response.into_inner(),
                    Err(status) if status.code() == Code::InvalidArgument && status.message().contains("context") => {
                        break End::new(EpisodeOutcome::TokenBudget, status.message());
                    }
                    Err(status) => break End::new(EpisodeOutcome::ModelError, status.message()),
                };
                turns += 1;
                let usage = response.usage.unwrap_or_default();
                used_tokens = usage.prompt_tokens + usage.completion_tokens;
                let reply = response.message.unwrap_or_default();
                messages.push(reply.clone());
                if response.malformed_tool_call && response.finish_reason != "length" {
                    // The model's own mistake, like a bad argument: it sees an
                    // error and may retry within its turn budget. Ending here
                    // scored a broken call as a completed, empty answer.
                    messages.push(ChatMessage {
                        role: "tool".into(),
                        content: MALFORMED_CALL.into(),
                        ..Default::default()
                    });
                    continue;
                }
                if reply.tool_calls.is_empty() {
                    if response.finish_reason == "length" {
                        break End::new(EpisodeOutcome::TokenBudget, format!("turn {turns} hit max_new_tokens"));
                    }
                    break End::new(EpisodeOutcome::Completed, "answered without calling an answer tool");
                }
                if used_tokens >= episode_tokens {
                    break End::new(EpisodeOutcome::TokenBudget, format!("max_episode_tokens {episode_tokens} used"));
                }
                if let Some(end) = run_tools(
                    clients,
                    &request.episode_id,
                    &task.collection,
                    &reply,
                    budget.observation_char_cap,
                    &mut messages,
                    &mut found,
                )
                .instrument(tracing::info_span!("tool_calls", turn = turns))
                .await
                {
                    break end;
                }
            }
        }
    };
    finish(clients, request, task.task_id, messages, turns, end, found.shown).await
}

/// Runs `tool` on the question as if the model had called it: an assistant
/// message with the call, then its results. The model's first turn starts
/// from them, so a small policy never has to copy the question, and its
/// choices are the ones that matter: follow a bridge, or submit.
async fn open(
    clients: &Clients,
    request: &RunEpisodeRequest,
    tool: &str,
    offered: &[ToolSpec],
    cap: u32,
    messages: &mut Vec<ChatMessage>,
    found: &mut Found,
) -> Option<End> {
    if !offered.iter().any(|t| t.name == tool) {
        let why = format!("config.opening_search {tool:?} is not among the tools offered to this episode");
        return Some(End::new(EpisodeOutcome::ToolError, why));
    }
    let task = request.task.as_ref()?;
    let call = ToolCall {
        id: "opening".into(),
        name: tool.to_owned(),
        arguments_json: serde_json::json!({"query": task.question, "k": SEARCH_HITS}).to_string(),
    };
    let opening = ChatMessage { role: "assistant".into(), tool_calls: vec![call], ..Default::default() };
    messages.push(opening.clone());
    run_tools(clients, &request.episode_id, &task.collection, &opening, cap, messages, found)
        .instrument(tracing::info_span!("opening_search"))
        .await
}

/// The teacher replying in this episode, if the config names one: a model
/// at the agent's teacher endpoint, or a script (a mixture's strategy is
/// dealt out by the episode's group and its index there).
fn teacher_for(
    clients: &Clients,
    config: &AgentConfig,
    request: &RunEpisodeRequest,
    task: &Task,
    offered: &[ToolSpec],
) -> Result<Option<Teacher>, String> {
    let spec = match crate::teacher::TeacherSpec::parse(&config.teacher)? {
        None => return Ok(None),
        Some(crate::teacher::TeacherSpec::Model(model)) => {
            let episode_id = &request.episode_id;
            return ModelTeacher::new(clients.teacher.as_ref(), &model, episode_id).map(|t| Some(Teacher::Model(t)));
        }
        Some(scripted) => scripted,
    };
    let opened = !config.opening_search.is_empty();
    let answering = crate::teacher::Answering {
        in_words: offered.iter().any(|t| t.name == SUBMIT_ANSWER),
        follow: offered.iter().any(|t| t.name == FOLLOW_LEAD),
    };
    let strategy = spec.choose(&request.group_id, request.sample_index, offered)?;
    Ok(Some(Teacher::Scripted(crate::teacher::Teacher::new(strategy, &task.question, opened, answering))))
}

/// The collection's tools (those `config.tools` names, or all), then the
/// agent's own: [`FOLLOW_LEAD`] when named (it searches with the
/// collection's `bm25_search`), and the answer tools named
/// ([`ANSWER_TOOLS`]; `submit_ranking` when none is).
async fn offered_tools(clients: &Clients, collection: &str, config: &AgentConfig) -> Result<Vec<ToolSpec>, End> {
    let listing = tools::ListToolsRequest { collection: collection.to_owned() };
    let listed = within(clients.tool_timeout, listing, async |r| clients.tools.clone().list_tools(r).await)
        .await
        .map_err(|status| End::new(EpisodeOutcome::ToolError, format!("listing tools: {}", status.message())))?
        .into_inner();
    let named = |name: &str| config.tools.iter().any(|n| n == name);
    let follow = named(FOLLOW_LEAD);
    if follow && !listed.tools.iter().any(|t| t.name == BM25_SEARCH) {
        let why = format!(
            "config.tools names {FOLLOW_LEAD}, which searches with {BM25_SEARCH}, not offered by collection {collection:?}"
        );
        return Err(End::new(EpisodeOutcome::ToolError, why));
    }
    let mut offered: Vec<ToolSpec> =
        listed.tools.into_iter().filter(|t| config.tools.is_empty() || named(&t.name)).collect();
    let own = |name: &&String| ANSWER_TOOLS.contains(&name.as_str()) || *name == FOLLOW_LEAD;
    if let Some(unknown) = config.tools.iter().find(|n| !own(n) && !offered.iter().any(|t| &t.name == *n)) {
        return Err(End::new(EpisodeOutcome::ToolError, format!("config.tools names unknown tool {unknown:?}")));
    }
    if follow {
        offered.push(agent_tool(FOLLOW_LEAD));
    }
    let answers: Vec<&str> = ANSWER_TOOLS.into_iter().filter(|name| named(name)).collect();
    match answers.is_empty() {
        true => offered.push(agent_tool(SUBMIT_TOOL)),
        false => offered.extend(answers.into_iter().map(agent_tool)),
    }
    Ok(offered)
}

/// Fetches the final trace and assembles the episode.
async fn finish(
    clients: &Clients,
    request: &RunEpisodeRequest,
    task_id: String,
    messages: Vec<ChatMessage>,
    turns: u32,
    mut end: End,
    shown_doc_ids: Vec<String>,
) -> Episode {
    let trace = if turns == 0 {
        None
    } else {
        let finished = clients
            .model
            .clone()
            .finish_episode(inference::FinishEpisodeRequest {
                episode_id: request.episode_id.clone(),
                ticket: request.ticket.clone(),
            })
            .await;
        match finished {
            Ok(trace) => Some(trace.into_inner()),
            Err(status) => {
                end = End::new(EpisodeOutcome::ModelError, format!("trace: {}", status.message()));
                None
            }
        }
    };
    let segments = trace.as_ref().map(|t| t.segments.as_slice()).unwrap_or_default();
    let total_tokens = segments.iter().map(|s| s.token_ids.len() as u32).sum();
    let policy = || segments.iter().filter(|s| s.kind == SegmentKind::Policy as i32);
    Episode {
        episode_id: request.episode_id.clone(),
        task_id,
        sample_index: request.sample_index,
        outcome: end.outcome as i32,
        outcome_detail: end.detail,
        messages,
        ranking: end.ranking,
        turns,
        total_tokens,
        generated_tokens: policy().map(|s| s.token_ids.len() as u32).sum(),
        min_policy_version: policy().map(|s| s.policy_version).min().unwrap_or_default(),
        max_policy_version: policy().map(|s| s.policy_version).max().unwrap_or_default(),
        trace,
        trace_id: sleuth_kit::trace_context::current_trace_id().unwrap_or_default(),
        answer: end.answer.as_ref().map(|a| a.answer.clone()).unwrap_or_default(),
        citations: end.answer.map(|a| a.citations).unwrap_or_default(),
        shown_doc_ids,
        ..Default::default()
    }
}
