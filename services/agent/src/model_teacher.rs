//! A model teacher (`teacher: model:<name>`): a model outside the policy
//! plays the episode, behind any OpenAI-compatible chat endpoint (an
//! inference gateway's HTTP door in front of a policy-server pool serving a
//! larger model, or a hosted one: the agent's `SLEUTH_TEACHER_URL`). Each
//! turn it is shown the conversation so far and the offered tools; its
//! reply goes to the inference gateway as `teacher_reply`, so it is traced
//! as the tokens the policy would sample in its own chat template. This is
//! how a team with GPUs distils a large model into the policy: trajectory
//! SFT keeps the teacher's best episodes, as it does a scripted teacher's.

use serde_json::{Value, json};
use sleuth_kit::chat_endpoint::{ChatEndpoint, attempts};
use sleuth_proto::common::v1::{ChatMessage, SamplingParams, ToolSpec};

/// Where model teachers are asked, from the agent's configuration.
#[derive(Clone)]
pub struct TeacherEndpoint {
    /// The endpoint; requests name the spec's model.
    pub chat: ChatEndpoint,
    /// Calls per turn before the episode ends as a model error (1 s, 2 s,
    /// 4 s, ... apart).
    pub attempts: u32,
}

/// The model teacher of one episode.
pub struct ModelTeacher {
    endpoint: TeacherEndpoint,
    /// The episode at the teacher's endpoint: `teacher-<episode id>`, so a
    /// Sleuth gateway there traces the teacher's side of it as one episode.
    episode: String,
}

impl ModelTeacher {
    /// The teacher `model` (the `<name>` of `model:<name>`) for `episode_id`,
    /// or why there is none: the agent was started without a teacher URL.
    pub fn new(endpoint: Option<&TeacherEndpoint>, model: &str, episode_id: &str) -> Result<Self, String> {
        let endpoint = endpoint.ok_or_else(|| {
            format!(
                "config.teacher \"model:{model}\" needs a teacher endpoint: this agent worker was started \
                 without SLEUTH_TEACHER_URL"
            )
        })?;
        let mut endpoint = endpoint.clone();
        endpoint.chat = endpoint.chat.for_model(model);
        Ok(Self { endpoint, episode: format!("teacher-{episode_id}") })
    }

    /// The teacher's reply to `messages` with `tools` offered, as the text
    /// the policy would have generated; `sampling` gives its temperature,
    /// nucleus, seed and length. A call that fails is made again (the
    /// endpoint's pod may be restarting); an error says why the last failed.
    pub async fn reply(
        &self,
        messages: &[ChatMessage],
        tools: &[ToolSpec],
        sampling: &SamplingParams,
    ) -> Result<String, String> {
        let mut body = json!({"messages": openai_messages(messages), "tools": openai_tools(tools)?});
        if let Some(temperature) = sampling.temperature {
            body["temperature"] = json!(temperature);
        }
        if let Some(top_p) = sampling.top_p {
            body["top_p"] = json!(top_p);
        }
        if let Some(seed) = sampling.seed {
            body["seed"] = json!(seed);
        }
        if sampling.max_new_tokens > 0 {
            body["max_tokens"] = json!(sampling.max_new_tokens);
        }
        attempts(self.endpoint.attempts, "teacher call", |_| async {
            reply_text(&self.endpoint.chat.complete(&self.episode, body.clone()).await?)
        })
        .await
        .map_err(|last| format!("teacher: no reply after {} attempts: {last}", self.endpoint.attempts))
    }
}

/// The conversation as OpenAI chat messages: assistant tool calls with
/// their ids and arguments, tool results with the id of their call.
pub fn openai_messages(messages: &[ChatMessage]) -> Value {
    messages
        .iter()
        .map(|message| {
            let mut out = json!({"role": message.role, "content": message.content});
            if !message.tool_calls.is_empty() {
                let calls: Vec<Value> = message
                    .tool_calls
                    .iter()
                    .map(|call| {
                        json!({"id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments_json}})
                    })
                    .collect();
                out["tool_calls"] = Value::Array(calls);
            }
            if !message.tool_call_id.is_empty() {
                out["tool_call_id"] = json!(message.tool_call_id);
            }
            if !message.name.is_empty() {
                out["name"] = json!(message.name);
            }
            out
        })
        .collect()
}

/// The offered tools as OpenAI function tools; an error names a tool whose
/// parameters are not a JSON schema.
pub fn openai_tools(tools: &[ToolSpec]) -> Result<Value, String> {
    tools
        .iter()
        .map(|tool| {
            let parameters: Value = serde_json::from_str(&tool.parameters_json)
                .map_err(|e| format!("tool {:?}: parameters_json is not JSON: {e}", tool.name))?;
            Ok(json!({"type": "function",
                      "function": {"name": tool.name, "description": tool.description, "parameters": parameters}}))
        })
        .collect()
}

/// The text the policy would have generated for the teacher's `message`:
/// its tool calls in the policy's format (`sleuth_chat::tool_calls_text`),
/// or its content when it calls none. Prose beside calls is dropped: the
/// policy learns the calls, and a reasoning model's prose would spend the
/// episode's token budget. A reply with neither is an error, because an
/// empty `teacher_reply` would let the policy answer in the teacher's place.
pub fn reply_text(message: &Value) -> Result<String, String> {
    match message.get("tool_calls").and_then(Value::as_array).filter(|calls| !calls.is_empty()) {
        Some(calls) => {
            if let Some(bad) = calls.iter().find(|call| !call["function"]["name"].is_string()) {
                return Err(format!("the teacher's tool call {bad} has no function.name"));
            }
            Ok(sleuth_chat::tool_calls_text(calls))
        }
        None => match message["content"].as_str().map(str::trim) {
            Some(content) if !content.is_empty() => Ok(content.to_owned()),
            _ => Err("the teacher replied with neither content nor tool calls".into()),
        },
    }
}

#[cfg(test)]
mod tests {
    use sleuth_proto::common::v1::ToolCall;

    use super::*;

    #[test]
    fn a_conversation_becomes_openai_messages_with_its_call_ids() {
        let messages = [
            ChatMessage { role: "user".into(), content: "why rain".into(), ..Default::default() },
            ChatMessage {
                role: "assistant".into(),
                tool_calls: vec![ToolCall {
                    id: "opening".into(),
                    name: "bm25_search".into(),
                    arguments_json: r#"{"query": "why rain"}"#.into(),
                }],
                ..Default::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: "1. rain".into(),
                tool_call_id: "opening".into(),
                name: "bm25_search".into(),
                ..Default::default()
            },
        ];
        assert_eq!(
            openai_messages(&messages),
            json!([
                {"role": "user", "content": "why rain"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "opening", "type": "function",
                    "function": {"name": "bm25_search", "arguments": "{\"query\": \"why rain\"}"}}]},
                {"role": "tool", "content": "1. rain", "tool_call_id": "opening", "name": "bm25_search"},
            ])
        );
    }

    #[test]
    fn tools_keep_their_schema_and_a_bad_one_is_named() {
        let tool = ToolSpec {
            name: "bm25_search".into(),
            description: "BM25".into(),
            parameters_json: r#"{"type": "object"}"#.into(),
        };
        assert_eq!(
            openai_tools(std::slice::from_ref(&tool)),
            Ok(json!([{"type": "function",
                "function": {"name": "bm25_search", "description": "BM25", "parameters": {"type": "object"}}}]))
        );
        let bad = ToolSpec { parameters_json: "{".into(), ..tool };
        assert!(openai_tools(&[bad]).unwrap_err().starts_with("tool \"bm25_search\": parameters_json is not JSON"));
    }

    #[test]
    fn replies_become_the_policys_text_and_an_empty_one_is_refused() {
        let calls = json!({"role": "assistant", "content": "Let me search.", "tool_calls": [{"id": "c1",
            "type": "function", "function": {"name": "submit_ranking", "arguments": "{\"doc_ids\": [\"rain\"]}"}}]});
        assert_eq!(
            reply_text(&calls),
            Ok("<tool_call>[{\"name\": \"submit_ranking\", \"arguments\": {\"doc_ids\": [\"rain\"]}}]</tool_call>"
                .into())
        );
        assert_eq!(reply_text(&json!({"content": " It rains. "})), Ok("It rains.".into()));
        for empty in [json!({"content": null}), json!({"content": "  ", "tool_calls": []}), json!({})] {
            assert_eq!(reply_text(&empty), Err("the teacher replied with neither content nor tool calls".into()));
        }
        let nameless = json!({"tool_calls": [{"function": {"arguments": "{}"}}]});
        assert!(reply_text(&nameless).unwrap_err().contains("has no function.name"), "named");
    }
}
