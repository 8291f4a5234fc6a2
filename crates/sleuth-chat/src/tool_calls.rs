//! Tool calls in generated text, in the Hermes/Qwen format the gateway's
//! templates use: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
//! (one object, or an array of them, per tag; several tags allowed).
//!
//! A model can generate anything: text that looks like a tool call but does
//! not parse is returned as plain content with `malformed` set, never an error.

use serde_json::Value;

/// The tags around a reply's tool calls.
pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";

/// One tool call: the function name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments_json: String,
}

/// A generated reply split into text and tool calls.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedReply {
    /// Text outside tool-call tags (trimmed); the whole reply when malformed.
    pub content: String,
    pub tool_calls: Vec<ParsedCall>,
    /// The reply tried to call a tool but the call could not be parsed.
    pub malformed: bool,
}

/// Splits `text` into content and tool calls.
pub fn parse_reply(text: &str) -> ParsedReply {
    if !text.contains(OPEN) {
        return ParsedReply { content: text.trim().to_owned(), ..ParsedReply::default() };
    }
    let malformed = || ParsedReply { content: text.trim().to_owned(), tool_calls: Vec::new(), malformed: true };
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        content.push_str(&rest[..start]);
        let after = &rest[start + OPEN.len()..];
        let Some(end) = after.find(CLOSE) else { return malformed() };
        let Ok(value) = serde_json::from_str::<Value>(after[..end].trim()) else { return malformed() };
        let objects = match value {
            Value::Array(items) => items,
            object => vec![object],
        };
        for object in objects {
            let Some(call) = call_from(&object) else { return malformed() };
            calls.push(call);
        }
        rest = &after[end + CLOSE.len()..];
    }
    content.push_str(rest);
    ParsedReply { content: content.trim().to_owned(), tool_calls: calls, malformed: false }
}

fn call_from(object: &Value) -> Option<ParsedCall> {
    let name = object.get("name")?.as_str()?.to_owned();
    let arguments = match object.get("arguments") {
        None | Some(Value::Null) => "{}".to_owned(),
        // Some models double-encode the arguments as a JSON string.
        Some(Value::String(text)) => text.clone(),
        Some(other) => other.to_string(),
    };
    Some(ParsedCall { name, arguments_json: arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_content() {
        let reply = parse_reply("  The capital of France is Paris.  ");
        assert_eq!(reply, ParsedReply { content: "The capital of France is Paris.".into(), ..Default::default() });
    }

    #[test]
    fn one_and_several_calls_with_surrounding_text() {
        let reply = parse_reply(
            "Let me search.\n<tool_call>\n{\"name\": \"bm25_search\", \"arguments\": {\"query\": \"rain\", \"k\": 3}}\n</tool_call>\n\
             <tool_call>[{\"name\": \"read_document\", \"arguments\": {\"doc_id\": \"d1\"}}]</tool_call>",
        );
        assert!(!reply.malformed);
        assert_eq!(reply.content, "Let me search.");
        assert_eq!(reply.tool_calls.len(), 2);
        assert_eq!(reply.tool_calls[0].name, "bm25_search");
        let arguments: Value = serde_json::from_str(&reply.tool_calls[0].arguments_json).unwrap();
        assert_eq!(arguments["k"], 3);
        assert_eq!(reply.tool_calls[1].arguments_json, "{\"doc_id\":\"d1\"}");
    }

    #[test]
    fn broken_calls_come_back_as_flagged_content() {
        for text in [
            "<tool_call>{\"name\": \"bm25_search\", \"arguments\": {\"query\": </tool_call>",
            "<tool_call>{\"name\": \"bm25_search\"",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>42</tool_call>",
        ] {
            let reply = parse_reply(text);
            assert!(reply.malformed, "{text}");
            assert!(reply.tool_calls.is_empty());
            assert_eq!(reply.content, text.trim());
        }
    }

    #[test]
    fn string_encoded_arguments_are_kept_as_text() {
        let reply = parse_reply("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>");
        assert_eq!(reply.tool_calls[0].arguments_json, "{\"x\": 1}");
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        /// Text that never opens a tool call by accident.
        fn prose() -> impl Strategy<Value = String> {
            "[a-zA-Z0-9 .,!?\\n]{0,40}"
        }

        /// Fragments a model might emit: tags, JSON pieces, words.
        fn fragment() -> impl Strategy<Value = String> {
            prop_oneof![
                Just(OPEN.to_owned()),
                Just(CLOSE.to_owned()),
                Just("{\"name\": \"bm25_search\", \"arguments\": {\"query\": \"x\"}}".to_owned()),
                Just("[".to_owned()),
                Just("]".to_owned()),
                Just("{".to_owned()),
                Just("\"".to_owned()),
                "\\PC{0,12}",
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

            /// Any text parses without a panic: malformed replies keep all
            /// their text as content; well-formed ones leave no tag in the
            /// content and give calls whose arguments are JSON.
            #[test]
            fn any_reply_parses_into_content_and_calls(parts in proptest::collection::vec(fragment(), 0..12)) {
                let text: String = parts.concat();
                let reply = parse_reply(&text);
                if reply.malformed {
                    prop_assert_eq!(&reply.content, text.trim());
                    prop_assert!(reply.tool_calls.is_empty());
                } else {
                    prop_assert!(!reply.content.contains(OPEN));
                    for call in &reply.tool_calls {
                        let _: Value = serde_json::from_str(&call.arguments_json)
                            .map_err(|e| TestCaseError::fail(format!("{:?}: {e}", call.arguments_json)))?;
                    }
                }
            }

            /// Calls written in the template's format come back as written,
            /// with the prose around them as content.
            #[test]
            fn written_calls_come_back(
                before in prose(),
                calls in proptest::collection::vec(("[a-z_]{1,12}", proptest::collection::btree_map("[a-z]{1,6}", "[a-z0-9 ]{0,8}", 0..3)), 1..4),
                after in prose(),
            ) {
                let mut text = before.clone();
                for (name, arguments) in &calls {
                    text.push_str(&format!("{OPEN}{}{CLOSE}", serde_json::json!({"name": name, "arguments": arguments})));
                }
                text.push_str(&after);
                let reply = parse_reply(&text);
                prop_assert!(!reply.malformed);
                prop_assert_eq!(reply.content, format!("{before}{after}").trim().to_owned());
                prop_assert_eq!(reply.tool_calls.len(), calls.len());
                for (call, (name, arguments)) in reply.tool_calls.iter().zip(&calls) {
                    prop_assert_eq!(&call.name, name);
                    let parsed: std::collections::BTreeMap<String, String> = serde_json::from_str(&call.arguments_json).unwrap();
                    prop_assert_eq!(&parsed, arguments);
                }
            }
        }
    }
}
