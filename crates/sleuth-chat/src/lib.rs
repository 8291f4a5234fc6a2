//! The text side of the policy: rendering conversations with the model's own
//! HF chat template, tokenising, and finding tool calls in generated text.
//!
//! Templates render exactly as `transformers`' `apply_chat_template` does
//! (Jinja with `trim_blocks` and `lstrip_blocks`, Python string methods,
//! `tojson`, `raise_exception`), so the gateway's token ids match what the
//! model was trained with.

pub mod observation;
pub mod template;
pub mod tool_calls;
pub mod tool_format;

pub use template::ChatTemplate;
pub use tool_calls::{ParsedReply, parse_reply};
pub use tool_format::tool_calls_text;

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{path}: {message}")]
    Config { path: String, message: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}
