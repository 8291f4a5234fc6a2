//! Everything the model is told, in one place, so a team can adapt the agent
//! to its own domain: the system prompt, the answer tool and its format.

use sleuth_chat::tools::ToolSchema;
use sleuth_proto::common::v1::ToolSpec;

/// The tool the agent answers with.
pub use sleuth_chat::tools::SUBMIT_RANKING as SUBMIT_TOOL;

/// The built-in system prompt of the search agent (in `sleuth_chat`, so a
/// fresh policy's copy pre-training shows the same context).
pub use sleuth_chat::SYSTEM_PROMPT;

/// The answer tool: a ranked list of document ids (which may be left out,
/// see [`parse_submission`]).
pub fn submit_tool() -> ToolSpec {
    let schema = ToolSchema::named(SUBMIT_TOOL).expect("the answer tool has a schema");
    ToolSpec {
        name: schema.name.to_owned(),
        description: schema.description.to_owned(),
        parameters_json: schema.parameters.to_string(),
    }
}

/// The ranking in a `submit_ranking` call's arguments (`None`: no `doc_ids`,
/// submit what the searches found), or why it is unusable.
///
/// Submitting without ids spares a policy copying ids it was shown: a small
/// one searches well long before it copies arbitrary ids exactly, and a
/// wrong digit scores as a miss.
pub fn parse_submission(arguments_json: &str) -> Result<Option<Vec<String>>, String> {
    let arguments: serde_json::Value =
        serde_json::from_str(arguments_json).map_err(|e| format!("arguments are not JSON: {e}"))?;
    let ids = match arguments.get("doc_ids") {
        None | Some(serde_json::Value::Null) if arguments.is_object() => return Ok(None),
        ids => ids.and_then(|v| v.as_array()).ok_or("\"doc_ids\" must be a list of ids (or left out)")?,
    };
    ids.iter()
        .map(|id| match id {
            serde_json::Value::String(s) => Ok(s.clone()),
            serde_json::Value::Number(n) => Ok(n.to_string()),
            other => Err(format!("doc_ids entries must be strings, got {other}")),
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submissions_parse_and_bad_ones_say_why() {
        assert_eq!(parse_submission(r#"{"doc_ids": ["d1", 42]}"#), Ok(Some(vec!["d1".to_owned(), "42".to_owned()])));
        assert_eq!(parse_submission(r#"{"doc_ids": []}"#), Ok(Some(Vec::new())));
        assert_eq!(parse_submission("{}"), Ok(None), "no ids: what the searches found");
        assert!(parse_submission(r#"{"doc_ids": "d1"}"#).unwrap_err().contains("doc_ids"));
        assert!(parse_submission("[]").unwrap_err().contains("doc_ids"));
        assert!(parse_submission("nope").unwrap_err().contains("not JSON"));
    }
}
