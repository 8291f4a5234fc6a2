//! The text side of the policy: rendering conversations with the model's own
//! HF chat template, tokenising, and finding tool calls in generated text.
//!
//! Templates render exactly as `transformers`' `apply_chat_template` does
//! (Jinja with `trim_blocks` and `lstrip_blocks`, Python string methods,
//! `tojson`, `raise_exception`), so the gateway's token ids match what the
//! model was trained with.

pub mod bridge;
pub mod observation;
pub mod template;
pub mod tool_calls;
pub mod tool_format;
pub mod tools;

pub use template::ChatTemplate;
pub use tool_calls::{ParsedReply, parse_reply};
pub use tool_format::tool_calls_text;

/// The built-in system prompt of the search agent: what a policy is shown
/// before the question, in its episodes and in copy pre-training alike. A
/// team adapting the agent to its domain overrides it per run
/// (`agent.system_prompt`).
pub const SYSTEM_PROMPT: &str = "You are a search agent. Find the documents that answer the user's question \
in the document collection, using the search tools as many times as you need. Read promising documents \
when their snippets are not enough. When you are done, call submit_ranking with the ids of the relevant \
documents, most relevant first.";

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{path}: {message}")]
    Config { path: String, message: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}
