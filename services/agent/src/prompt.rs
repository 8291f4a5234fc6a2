//! Everything the model is told, in one place, so a team can adapt the agent
//! to its own domain: the system prompt, the answer tool and its format.

use serde_json::json;
use sleuth_proto::common::v1::ToolSpec;

/// The tool the agent answers with.
pub const SUBMIT_TOOL: &str = "submit_ranking";

/// The built-in system prompt of the search agent.
pub const SYSTEM_PROMPT: &str = "You are a search agent. Find the documents that answer the user's question \
in the document collection, using the search tools as many times as you need. Read promising documents \
when their snippets are not enough. When you are done, call submit_ranking with the ids of the relevant \
documents, most relevant first.";

/// The answer tool: a ranked list of document ids.
pub fn submit_tool() -> ToolSpec {
    ToolSpec {
        name: SUBMIT_TOOL.to_owned(),
        description: "Submit your final answer: the ids of the documents that answer the question, most relevant first. \
                      This ends the search."
            .to_owned(),
        parameters_json: json!({
            "type": "object",
            "properties": {"doc_ids": {"type": "array", "items": {"type": "string"}, "description": "document ids, best first"}},
            "required": ["doc_ids"]
        })
        .to_string(),
    }
}

/// The ranking in a `submit_ranking` call's arguments, or why it is unusable.
pub fn parse_submission(arguments_json: &str) -> Result<Vec<String>, String> {
    let arguments: serde_json::Value =
        serde_json::from_str(arguments_json).map_err(|e| format!("arguments are not JSON: {e}"))?;
    let ids = arguments.get("doc_ids").and_then(|v| v.as_array()).ok_or("arguments need \"doc_ids\": a list of ids")?;
    ids.iter()
        .map(|id| match id {
            serde_json::Value::String(s) => Ok(s.clone()),
            serde_json::Value::Number(n) => Ok(n.to_string()),
            other => Err(format!("doc_ids entries must be strings, got {other}")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submissions_parse_and_bad_ones_say_why() {
        assert_eq!(parse_submission(r#"{"doc_ids": ["d1", 42]}"#), Ok(vec!["d1".to_owned(), "42".to_owned()]));
        assert!(parse_submission(r#"{"ids": []}"#).unwrap_err().contains("doc_ids"));
        assert!(parse_submission("nope").unwrap_err().contains("not JSON"));
    }
}
