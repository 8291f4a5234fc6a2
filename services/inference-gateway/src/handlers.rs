//! gRPC handlers: one assistant turn at a time, recorded token for token.

use serde_json::{Value as Json, json};
use sleuth_proto::common::v1::{ChatMessage, SegmentKind, ToolCall, ToolSpec, Trace};
use sleuth_proto::inference::v1 as pb;
use sleuth_proto::inference::v1::inference_gateway_server::InferenceGateway;
use sleuth_proto::policy::v1::{FinishReason, GenerateRequest};
use tonic::{Request, Response, Status};

use crate::conversation::{LastReply, Renderer};
use crate::episode::{HistoryDigest, TraceStore};
use crate::error::Error;
use crate::metrics::METRICS;
use crate::tickets::{Act, Holder, Tickets};
use sleuth_kit::ServiceError;
use tracing::Instrument as _;

/// What to do when the conversation no longer matches the recorded tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnDrift {
    /// Count it, keep the recorded tokens and append the new messages.
    Keep,
    /// Fail the turn with FAILED_PRECONDITION.
    Fail,
}

/// Tokens generated per turn when the request sets no limit.
const DEFAULT_MAX_NEW_TOKENS: u32 = 1024;

pub struct Handlers {
    /// The served model's chat template and tokenizer.
    pub renderer: Renderer,
    /// Every episode's token trace.
    pub traces: TraceStore,
    /// The policy-server replicas turns are routed to.
    pub policy: crate::routing::Replicas,
    /// Where each training run's current learner version is read: a run's
    /// turns are sampled by weights no older than it.
    pub runs: sleuth_store::RedisStore,
    /// What a turn does when the conversation drifted from the trace.
    pub on_drift: OnDrift,
    /// Who may act on which episode.
    pub tickets: Tickets,
}

fn message_json(message: &ChatMessage) -> Json {
    let mut value = json!({"role": message.role, "content": message.content});
    if !message.tool_calls.is_empty() {
        value["tool_calls"] = message
            .tool_calls
            .iter()
            .map(|call| {
                let arguments = serde_json::from_str::<Json>(&call.arguments_json)
                    .unwrap_or(Json::String(call.arguments_json.clone()));
                json!({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}})
            })
            .collect();
    }
    if !message.tool_call_id.is_empty() {
        value["tool_call_id"] = json!(message.tool_call_id);
    }
    if !message.name.is_empty() {
        value["name"] = json!(message.name);
    }
    value
}

fn tool_json(tool: &ToolSpec) -> Result<Json, Error> {
    let parameters: Json = serde_json::from_str(&tool.parameters_json)
        .map_err(|e| Error::InvalidArgument(format!("tools[{}].parameters_json is not JSON: {e}", tool.name)))?;
    Ok(
        json!({"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": parameters}}),
    )
}

/// A teacher's reply as if the policy had sampled it: its tokens (cut at
/// `max_new_tokens`, as sampling would stop there), logprobs 0, version 0.
fn taught(mut tokens: Vec<u32>, max_new_tokens: u32) -> sleuth_proto::policy::v1::GenerateResponse {
    let finish = if tokens.len() > max_new_tokens as usize {
        tokens.truncate(max_new_tokens as usize);
        FinishReason::Length
    } else {
        FinishReason::Stop
    };
    sleuth_proto::policy::v1::GenerateResponse {
        logprobs: vec![0.0; tokens.len()],
        policy_versions: vec![0; tokens.len()],
        token_ids: tokens,
        finish_reason: finish as i32,
        ..Default::default()
    }
}

#[tonic::async_trait]
impl InferenceGateway for Handlers {
    async fn chat(&self, request: Request<pb::ChatRequest>) -> Result<Response<pb::ChatResponse>, Status> {
        let authorization = authorization(&request);
        Ok(Response::new(self.turn("grpc", authorization.as_deref(), request.into_inner()).await?))
    }

    async fn get_trace(&self, request: Request<pb::GetTraceRequest>) -> Result<Response<Trace>, Status> {
        let authorization = authorization(&request);
        let pb::GetTraceRequest { episode_id, ticket } = request.into_inner();
        Ok(Response::new(self.read_trace(authorization.as_deref(), &episode_id, &ticket).await?))
    }

    async fn finish_episode(&self, request: Request<pb::FinishEpisodeRequest>) -> Result<Response<Trace>, Status> {
        // The trace stays readable until its TTL; the policy server's cached prefix ages out on its own.
        let authorization = authorization(&request);
        let pb::FinishEpisodeRequest { episode_id, ticket } = request.into_inner();
        Ok(Response::new(self.read_trace(authorization.as_deref(), &episode_id, &ticket).await?))
    }
}

/// The call's `authorization` header, for the admin token's reach over tickets.
fn authorization<T>(request: &Request<T>) -> Option<String> {
    request.metadata().get("authorization").and_then(|value| value.to_str().ok()).map(str::to_owned)
}

impl Handlers {
    /// An episode's whole trace, for a caller its ticket (or the admin token) admits.
    async fn read_trace(&self, authorization: Option<&str>, episode: &str, ticket: &str) -> Result<Trace, Error> {
        let holder = self.tickets.holder(authorization, episode, ticket)?;
        let mut record = self
            .traces
            .get(episode)
            .await?
            .ok_or_else(|| Error::NotFound(format!("no trace for episode {episode:?}")))?;
        Tickets::check(holder, episode, &record, Act::Read)?;
        Ok(std::mem::take(record.trace_mut()))
    }

    /// One assistant turn: what both front doors (gRPC Chat, OpenAI HTTP)
    /// run, for a caller with the `authorization` header `authorization`.
    pub async fn turn(
        &self,
        front_door: &str,
        authorization: Option<&str>,
        request: pb::ChatRequest,
    ) -> Result<pb::ChatResponse, Error> {
        let started = std::time::Instant::now();
        let span = tracing::info_span!(
            "gateway_turn",
            run_id = %request.run_id,
            episode_id = %request.episode_id,
            turn = tracing::field::Empty,
            policy_version = tracing::field::Empty,
            teacher = !request.teacher_reply.is_empty(),
        );
        let result = self.recorded_turn(authorization, request).instrument(span).await;
        let outcome = match &result {
            Ok((response, policy_wait)) => {
                METRICS.overhead_seconds.observe(started.elapsed().saturating_sub(*policy_wait).as_secs_f64());
                let usage = response.usage.unwrap_or_default();
                METRICS.prompt_tokens.inc_by(u64::from(usage.prompt_tokens));
                METRICS.completion_tokens.inc_by(u64::from(usage.completion_tokens));
                "ok"
            }
            Err(error) => error.kind().name(),
        };
        METRICS.turns.with_label_values(&[front_door, outcome]).inc();
        result.map(|(response, _)| response)
    }

    /// A turn, and how long it waited on the policy server.
    async fn recorded_turn(
        &self,
        authorization: Option<&str>,
        request: pb::ChatRequest,
    ) -> Result<(pb::ChatResponse, std::time::Duration), Error> {
        let episode = request.episode_id.trim().to_owned();
        if episode.is_empty() {
            return Err(Error::InvalidArgument("episode_id must not be empty".to_owned()));
        }
        let holder = self.tickets.holder(authorization, &episode, &request.ticket)?;
        if request.messages.is_empty() {
            return Err(Error::InvalidArgument("messages must not be empty".to_owned()));
        }
        let tools = request.tools.iter().map(tool_json).collect::<Result<Vec<_>, _>>()?;

        // A teacher's turn sends no prompt to a policy: it reads only how many tokens there are.
        let teacher = !request.teacher_reply.is_empty();
        let mut loaded = self.traces.load(&episode, !teacher).await?;
        Tickets::check(holder, &episode, &loaded.record, Act::Turn { run: request.run_id.trim(), teacher })?;
        loaded.record.ticketed |= matches!(holder, Holder::Ticket(_));
        let turn = loaded.record.turns;
        tracing::Span::current().record("turn", turn);
        match request.turns_before {
            Some(turns_before) if turns_before > 0 && loaded.revision == 0 => return Err(Error::TraceGone { episode }),
            Some(turns_before) if turns_before != turn => {
                return Err(Error::TurnsDisagree { episode, turns_before, recorded: turn });
            }
            _ => {}
        }
        let seen = loaded.record.messages_seen as usize;
        if request.messages.len() < seen {
            return Err(Error::InvalidArgument(format!(
                "messages has {} entries but episode {episode} already covers {seen}: history is never truncated",
                request.messages.len()
            )));
        }
        // Only what is new is rendered: the policy's last reply (messages[seen - 1])
        // and the messages after it. The history before the reply is checked by digest.
        let (history, returned) = request.messages[..seen].split_at(seen.saturating_sub(1));
        let mut digest = HistoryDigest::new(&request.tools);
        digest.extend(history);
        let history_drift = !loaded.record.history_digest.is_empty() && digest.value() != loaded.record.history_digest;
        digest.extend(&request.messages[history.len()..]);
        let system = request.messages.first().filter(|m| m.role == "system").map(message_json);
        let returned = returned.first().map(message_json);
        let sampled = loaded.last_reply();
        let last = returned.as_ref().map(|message| LastReply { message, sampled: &sampled });
        let new: Vec<Json> = request.messages[seen..].iter().map(message_json).collect();
        let mut next = self.renderer.next_prompt(system.as_ref(), last, &new, &tools)?;
        next.drift |= history_drift;
        if next.drift {
            loaded.record.trace_mut().drift_events += 1;
            METRICS.drift_events.inc();
            tracing::warn!(episode = %episode, "conversation drifted from the recorded tokens");
            if self.on_drift == OnDrift::Fail {
                self.traces.save(&episode, &loaded).await?;
                return Err(Error::Drift {
                    episode,
                    message: "the conversation no longer matches the recorded tokens".into(),
                });
            }
        }
        let prompt: Vec<u32> = if teacher {
            Vec::new()
        } else {
            loaded.recorded_tokens()?.iter().chain(&next.new_tokens).copied().collect()
        };
        let prompt_tokens = loaded.recorded_len() + next.new_tokens.len();

        let mut sampling = request.sampling.clone().unwrap_or_default();
        let stop = sampling.stop.clone();
        if sampling.max_new_tokens == 0 {
            sampling.max_new_tokens = DEFAULT_MAX_NEW_TOKENS;
        }
        // A ticket's episode stays within its run's token budget, whoever writes its turns.
        if let Holder::Ticket(admission) = holder {
            let budget = admission.max_tokens as usize;
            if prompt_tokens >= budget {
                return Err(Error::InvalidArgument(format!(
                    "episode {episode}: its trace would hold {prompt_tokens} tokens before this turn's reply, \
                     past its ticket's max_episode_tokens {budget}: no context is left for a reply"
                )));
            }
            sampling.max_new_tokens = sampling.max_new_tokens.min((budget - prompt_tokens) as u32);
        }
        // The temperature the policy server samples at (its default, 1, when
        // unset), recorded with the tokens; a teacher's reply is not sampled.
        let temperature = if teacher { 0.0 } else { sampling.temperature.unwrap_or(1.0).max(0.0) };
        let run_id = request.run_id.trim();
        let min_policy_version = match run_id {
            "" => 0,
            run => sleuth_store::trajectories::learner_version(&self.runs, run).await?,
        };
        let generate = GenerateRequest {
            request_id: String::new(),
            session_id: episode.clone(),
            prompt_token_ids: prompt,
            sampling: Some(sampling),
            return_model_logprobs: false,
            min_policy_version,
            run_id: run_id.to_owned(),
        };
        let policy_started = std::time::Instant::now();
        let (replica, generated) = if !teacher {
            self.policy.generate(&episode, generate).await?
        } else {
            let written = self.renderer.reply_tokens(system.as_ref(), &tools, &request.teacher_reply)?;
            ("teacher".to_owned(), taught(written, generate.sampling.as_ref().map_or(0, |s| s.max_new_tokens)))
        };
        let policy_wait = policy_started.elapsed();
        tracing::debug!(episode = %episode, %replica, tokens = generated.token_ids.len(), "turn generated");

        let observed = request.messages[seen..].iter().any(|m| m.role == "tool");
        let kind = if observed { SegmentKind::Observation } else { SegmentKind::Prompt };
        let version = generated.policy_versions.first().copied().unwrap_or_default();
        tracing::Span::current().record("policy_version", version);
        loaded.push_context(turn, kind, &next.new_tokens, version);
        loaded.push_sampled(turn, &generated.token_ids, &generated.logprobs, &generated.policy_versions, temperature);
        // The policy server ends at the token completing a stop string; the
        // reply's text ends before the string (OpenAI's `stop`). The trace keeps
        // every token the policy generated.
        let text = self.renderer.decode(&generated.token_ids)?;
        let cut = stop.iter().filter_map(|s| text.find(s.as_str())).min().unwrap_or(text.len());
        let reply = sleuth_chat::parse_reply(&text[..cut]);
        if reply.malformed {
            loaded.record.trace_mut().malformed_tool_calls += 1;
            METRICS.malformed_tool_calls.inc();
        }
        loaded.record.messages_seen = request.messages.len() as u32 + 1;
        loaded.record.history_digest = digest.value();
        self.traces.save(&episode, &loaded).await?;

        let finish_reason = if !reply.tool_calls.is_empty() {
            "tool_calls"
        } else if generated.finish_reason == FinishReason::Length as i32 {
            "length"
        } else {
            "stop"
        };
        let tool_calls = reply
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, call)| ToolCall {
                id: format!("call_{turn}_{i}"),
                name: call.name.clone(),
                arguments_json: call.arguments_json.clone(),
            })
            .collect();
        let response = pb::ChatResponse {
            message: Some(ChatMessage {
                role: "assistant".into(),
                content: reply.content,
                tool_calls,
                ..Default::default()
            }),
            finish_reason: finish_reason.to_owned(),
            usage: Some(pb::Usage {
                prompt_tokens: prompt_tokens as u32,
                completion_tokens: generated.token_ids.len() as u32,
                cached_prompt_tokens: generated.cached_prompt_tokens,
            }),
            policy_version: generated.policy_versions.last().copied().unwrap_or_default(),
            malformed_tool_call: reply.malformed,
            drift: next.drift,
            token_ids: if request.logprobs { generated.token_ids } else { Vec::new() },
            logprobs: if request.logprobs { generated.logprobs } else { Vec::new() },
        };
        Ok((response, policy_wait))
    }
}
