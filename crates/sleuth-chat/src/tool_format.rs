//! Tool calling for chat templates that know nothing about tools (SmolLM2's
//! renders only `role` and `content`). Without this, the tool schemas a
//! request carries would silently vanish from the prompt, and an assistant
//! turn that called a tool would re-render as an empty message, which the
//! gateway would then count as drift on every tool-using episode.
//!
//! The convention is the one SmolLM2 was tuned on and the one
//! [`crate::parse_reply`] reads: tool schemas inside `<tools>` in the system
//! prompt, calls as a JSON list inside `<tool_call>` tags.

use serde_json::{Value as Json, json};

use crate::template::write_python_json;

/// Instructions put before the tool schemas in the system prompt.
const TOOLS_PREAMBLE: &str = "You can call the following tools. To call tools, reply with only \
<tool_call>[{\"name\": \"tool_name\", \"arguments\": {\"argument\": \"value\"}}]</tool_call>, \
one list entry per call.\n<tools>";

/// `messages` with the tool schemas in the system prompt (a system message
/// is added when there is none).
pub(crate) fn with_tools_in_system_prompt(messages: &[Json], tools: &[Json]) -> Vec<Json> {
    let functions: Vec<Json> = tools.iter().map(|tool| tool.get("function").unwrap_or(tool).clone()).collect();
    let mut block = String::from(TOOLS_PREAMBLE);
    write_python_json(&Json::Array(functions), None, 0, &mut block);
    block.push_str("</tools>");
    let mut out = messages.to_vec();
    match out.first_mut() {
        Some(first) if first["role"] == "system" => {
            let content = first["content"].as_str().unwrap_or_default();
            first["content"] = json!(format!("{content}\n\n{block}"));
        }
        _ => out.insert(0, json!({"role": "system", "content": block})),
    }
    out
}

/// `messages` with each assistant message's `tool_calls` written into its
/// content the way the model generates them.
pub(crate) fn with_tool_calls_in_content(messages: &[Json]) -> Vec<Json> {
    messages
        .iter()
        .map(|message| {
            let Some(calls) = message.get("tool_calls").and_then(Json::as_array).filter(|c| !c.is_empty()) else {
                return message.clone();
            };
            let mut text = message["content"].as_str().unwrap_or_default().to_owned();
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&tool_calls_text(calls));
            let mut message = message.clone();
            message["content"] = json!(text);
            message
        })
        .collect()
}

/// `<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`, name first
/// (as generated), JSON spaced as Python writes it.
pub fn tool_calls_text(calls: &[Json]) -> String {
    let mut text = String::from("<tool_call>[");
    for (i, call) in calls.iter().enumerate() {
        let function = call.get("function").unwrap_or(call);
        if i > 0 {
            text.push_str(", ");
        }
        text.push_str("{\"name\": ");
        write_python_json(&function["name"], None, 0, &mut text);
        text.push_str(", \"arguments\": ");
        // OpenAI clients send arguments as a JSON string.
        let arguments = match &function["arguments"] {
            Json::String(s) => serde_json::from_str(s).unwrap_or_else(|_| Json::String(s.clone())),
            other => other.clone(),
        };
        write_python_json(&arguments, None, 0, &mut text);
        text.push('}');
    }
    text.push_str("]</tool_call>");
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_written_as_the_model_generates_them() {
        let calls = [json!({"id": "c0", "type": "function",
            "function": {"name": "search", "arguments": "{\"query\": \"black holes\", \"k\": 3}"}})];
        let text = tool_calls_text(&calls);
        assert!(text.starts_with("<tool_call>[{\"name\": \"search\", \"arguments\": {"), "{text}");
        let parsed = crate::parse_reply(&text);
        assert!(!parsed.malformed);
        assert_eq!(parsed.tool_calls[0].name, "search");
        let arguments: Json = serde_json::from_str(&parsed.tool_calls[0].arguments_json).unwrap();
        assert_eq!(arguments, json!({"query": "black holes", "k": 3}));
    }

    #[test]
    fn tools_join_the_system_prompt_or_make_one() {
        let tools = [json!({"type": "function", "function": {"name": "search", "parameters": {}}})];
        let user = json!({"role": "user", "content": "hi"});
        let added = with_tools_in_system_prompt(std::slice::from_ref(&user), &tools);
        assert_eq!(added.len(), 2);
        assert!(added[0]["content"].as_str().unwrap().contains("<tools>[{\"name\": \"search\""));
        let system = json!({"role": "system", "content": "Be brief."});
        let joined = with_tools_in_system_prompt(&[system, user], &tools);
        assert_eq!(joined.len(), 2);
        assert!(joined[0]["content"].as_str().unwrap().starts_with("Be brief.\n\nYou can call"));
    }
}
