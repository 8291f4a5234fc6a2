//! A model's chat template, from `chat_template.jinja` (newer transformers)
//! or `tokenizer_config.json`'s `chat_template`.

use std::path::Path;

use minijinja::{Environment, ErrorKind, Value};
use serde_json::Value as Json;

use crate::ChatError;

/// A compiled chat template and the special tokens it refers to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template reads `tools` / `tool_calls` itself; otherwise
    /// [`crate::tool_format`] writes them into the messages.
    renders_tools: bool,
    renders_tool_calls: bool,
    pub bos_token: String,
    pub eos_token: String,
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Reads the template of the HF model or tokenizer directory `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, ChatError> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Json = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| ChatError::Config { path: config_path.display().to_string(), message: e.to_string() })?,
            Err(_) => Json::Null,
        };
        let source = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(source) => source,
            Err(_) => template_from_config(&config).ok_or_else(|| ChatError::Config {
                path: dir.display().to_string(),
                message: "no chat_template.jinja and no chat_template in tokenizer_config.json".to_owned(),
            })?,
        };
        Self::new(source, special_token(&config, "bos_token"), special_token(&config, "eos_token"))
    }

    /// Compiles `source` the way transformers does.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // transformers' tojson is Python's json.dumps: ", " and ": " separators,
        // non-ASCII kept, optional indent. minijinja's own is compact.
        env.add_filter("tojson", python_tojson);
        env.add_function("raise_exception", |message: String| -> Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        let renders_tools = source.contains("tools");
        let renders_tool_calls = source.contains("tool_calls");
        env.add_template_owned(NAME, source).map_err(|e| ChatError::Template(e.to_string()))?;
        Ok(Self { env, renders_tools, renders_tool_calls, bos_token, eos_token })
    }

    /// Renders `messages` (OpenAI chat format) with `tools` (OpenAI function
    /// specs; empty = none) and, when asked, the assistant turn's opening.
    pub fn render(&self, messages: &[Json], tools: &[Json], add_generation_prompt: bool) -> Result<String, ChatError> {
        let template = self.env.get_template(NAME).map_err(|e| ChatError::Template(e.to_string()))?;
        let mut messages = std::borrow::Cow::Borrowed(messages);
        if !self.renders_tool_calls {
            messages = crate::tool_format::with_tool_calls_in_content(&messages).into();
        }
        if !self.renders_tools && !tools.is_empty() {
            messages = crate::tool_format::with_tools_in_system_prompt(&messages, tools).into();
        }
        let tools = if tools.is_empty() { Value::from(()) } else { Value::from_serialize(tools) };
        template
            .render(minijinja::context! {
                messages => Value::from_serialize(&*messages),
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone(),
                eos_token => self.eos_token.clone(),
            })
            .map_err(|e| ChatError::Template(format!("{e:#}")))
    }
}

/// The `tojson` filter as transformers defines it for chat templates.
fn python_tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// `json.dumps(value, ensure_ascii=False, indent=indent)` as Python writes it.
pub(crate) fn write_python_json(value: &Json, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    // Python uses "," between items when indenting (each item on its own line), ", " otherwise.
    let separator = if indent.is_some() { "," } else { ", " };
    match value {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(key.clone()).to_string());
                out.push_str(": ");
                write_python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// `chat_template` is a string, or a list of named templates (the "default" one is used).
fn template_from_config(config: &Json) -> Option<String> {
    match config.get("chat_template")? {
        Json::String(source) => Some(source.clone()),
        Json::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    }
}

/// A special token given as a string or as `{"content": ...}`.
fn special_token(config: &Json, key: &str) -> String {
    match config.get(key) {
        Some(Json::String(token)) => token.clone(),
        Some(Json::Object(token)) => token.get("content").and_then(Json::as_str).unwrap_or_default().to_owned(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps(value: Json, indent: Option<usize>) -> String {
        let mut out = String::new();
        write_python_json(&value, indent, 0, &mut out);
        out
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let value = serde_json::json!({"b": [1, 2.5, null], "a": {"é": "x\"y"}, "e": [], "f": {}});
        // python: json.dumps(v, ensure_ascii=False)
        assert_eq!(dumps(value.clone(), None), r#"{"b": [1, 2.5, null], "a": {"é": "x\"y"}, "e": [], "f": {}}"#);
        // python: json.dumps(v, ensure_ascii=False, indent=2)
        assert_eq!(
            dumps(value, Some(2)),
            "{\n  \"b\": [\n    1,\n    2.5,\n    null\n  ],\n  \"a\": {\n    \"é\": \"x\\\"y\"\n  },\n  \"e\": [],\n  \"f\": {}\n}"
        );
    }
}
