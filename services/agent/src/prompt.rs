//! Everything the model is told, in one place, so a team can adapt the agent
//! to its own domain: the system prompt, the answer tools and their formats.

use sleuth_chat::tools::ToolSchema;
use sleuth_proto::common::v1::ToolSpec;

/// Both answer tools.
pub use sleuth_chat::tools::ANSWER_TOOLS;
/// The tool that searches a lead the latest results list, by its number.
pub use sleuth_chat::tools::FOLLOW_LEAD;
/// The tool the agent answers with in words, citing documents.
pub use sleuth_chat::tools::SUBMIT_ANSWER;
/// The tool the agent answers with a ranking (the default answer tool).
pub use sleuth_chat::tools::SUBMIT_RANKING as SUBMIT_TOOL;

/// The built-in system prompt of the search agent (in `sleuth_chat`, so a
/// fresh policy's copy pre-training shows the same context).
pub use sleuth_chat::SYSTEM_PROMPT;

/// A tool the agent runs itself rather than the tool gateway: an answer
/// tool ([`ANSWER_TOOLS`]: `submit_ranking`, a ranked list of document ids,
/// which may be left out, see [`parse_submission`], or `submit_answer`,
/// words and citations, [`parse_answer`]), or [`FOLLOW_LEAD`].
pub fn agent_tool(name: &str) -> ToolSpec {
    let schema = ToolSchema::named(name).expect("every agent tool has a schema");
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

/// Longest answer kept, in characters: an answer is a few words, and a
/// longer one only pads (the answer rewards' F1 already scores padding
/// down; this bounds what a trace and the episode record carry).
pub const MAX_ANSWER_CHARS: usize = 1000;
/// Most citations kept.
pub const MAX_CITATIONS: usize = 50;

/// An answer in words and the ids of the documents cited for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub answer: String,
    pub citations: Vec<String>,
}

/// The answer in a `submit_answer` call's arguments, or what is wrong with
/// it, written for the model to read and correct.
pub fn parse_answer(arguments_json: &str) -> Result<Answer, String> {
    let arguments: serde_json::Value =
        serde_json::from_str(arguments_json).map_err(|e| format!("arguments are not JSON: {e}"))?;
    let answer = match arguments.get("answer") {
        Some(serde_json::Value::String(answer)) if !answer.trim().is_empty() => answer.trim(),
        Some(serde_json::Value::String(_)) => return Err("\"answer\" must not be empty".into()),
        _ => return Err("\"answer\" must be a string with the answer in words".into()),
    };
    if answer.chars().count() > MAX_ANSWER_CHARS {
        return Err(format!("\"answer\" must be at most {MAX_ANSWER_CHARS} characters; answer in a few words"));
    }
    let citations = match arguments.get("citations") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(ids)) => ids
            .iter()
            .map(|id| match id {
                serde_json::Value::String(s) => Ok(s.clone()),
                serde_json::Value::Number(n) => Ok(n.to_string()),
                other => Err(format!("citations entries must be document ids, got {other}")),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err("\"citations\" must be a list of document ids".into()),
    };
    if citations.len() > MAX_CITATIONS {
        return Err(format!("\"citations\" must hold at most {MAX_CITATIONS} ids"));
    }
    Ok(Answer { answer: answer.to_owned(), citations })
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

    #[test]
    fn answers_parse_and_bad_ones_say_why() {
        let answer = parse_answer(r#"{"answer": " Toubal ", "citations": ["c1", 7]}"#).unwrap();
        assert_eq!(answer, Answer { answer: "Toubal".into(), citations: vec!["c1".into(), "7".into()] });
        assert_eq!(parse_answer(r#"{"answer": "Toubal"}"#).unwrap().citations, Vec::<String>::new());
        for (bad, says) in [
            (r#"{"citations": []}"#, "\"answer\" must be a string"),
            (r#"{"answer": "  "}"#, "must not be empty"),
            (r#"{"answer": ["Toubal"]}"#, "\"answer\" must be a string"),
            (r#"{"answer": "x", "citations": "c1"}"#, "\"citations\" must be a list"),
            (r#"{"answer": "x", "citations": [{"id": 1}]}"#, "citations entries"),
            ("{", "not JSON"),
        ] {
            let error = parse_answer(bad).unwrap_err();
            assert!(error.contains(says), "{bad}: {error}");
        }
        let long = serde_json::json!({"answer": "word ".repeat(MAX_ANSWER_CHARS)}).to_string();
        assert!(parse_answer(&long).unwrap_err().contains("at most"));
    }
}
