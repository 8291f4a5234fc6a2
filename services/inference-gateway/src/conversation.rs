//! Token-in/token-out prompts: the next turn's prompt is the episode's
//! recorded tokens plus the tokens of the new messages only, never a
//! re-tokenised history.

use std::path::Path;

use serde_json::{Value as Json, json};
use sleuth_chat::ChatTemplate;
use tokenizers::Tokenizer;

use crate::error::Error;

/// The model's chat template and tokenizer.
pub struct Renderer {
    template: ChatTemplate,
    tokenizer: Tokenizer,
    /// The end-of-turn token the policy samples to finish a reply.
    end_of_turn: Option<u32>,
}

/// What the next turn adds to the recorded tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextPrompt {
    pub new_tokens: Vec<u32>,
    /// Re-rendering the whole conversation disagreed with the recorded tokens.
    pub drift: bool,
}

impl Renderer {
    pub fn load(dir: &Path) -> Result<Self, Error> {
        let template = ChatTemplate::from_dir(dir)?;
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| Error::Internal(format!("{}: {e}", dir.join("tokenizer.json").display())))?;
        let end_of_turn = tokenizer.token_to_id(&template.eos_token);
        Ok(Self { template, tokenizer, end_of_turn })
    }

    fn render_ids(&self, messages: &[Json], tools: &[Json], generation: bool) -> Result<Vec<u32>, Error> {
        let text = self.template.render(messages, tools, generation)?;
        let encoding =
            self.tokenizer.encode(text.as_str(), false).map_err(|e| Error::Internal(format!("tokenizer: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The tokens a policy samples to write `reply` after `messages`: the
    /// template's rendering of an assistant message with that content, up to
    /// and including its end-of-turn token (where the policy stops).
    pub fn reply_tokens(&self, messages: &[Json], tools: &[Json], reply: &str) -> Result<Vec<u32>, Error> {
        let prompt = self.render_ids(messages, tools, true)?;
        let mut with_reply = messages.to_vec();
        with_reply.push(json!({"role": "assistant", "content": reply}));
        let full = self.render_ids(&with_reply, tools, false)?;
        let Some(rest) = full.strip_prefix(prompt.as_slice()) else {
            return Err(Error::InvalidArgument(
                "teacher_reply: the chat template does not render the reply after the prompt".to_owned(),
            ));
        };
        let end = self.end_of_turn.and_then(|eot| rest.iter().position(|&t| t == eot)).map_or(rest.len(), |i| i + 1);
        Ok(rest[..end].to_vec())
    }

    /// Text of generated tokens, special tokens dropped.
    pub fn decode(&self, tokens: &[u32]) -> Result<String, Error> {
        self.tokenizer.decode(tokens, true).map_err(|e| Error::Internal(format!("tokenizer: {e}")))
    }

    /// The tokens the next turn appends to `recorded`, which covers the first
    /// `seen` messages (the last of them the policy's own reply).
    pub fn next_prompt(
        &self,
        recorded: &[u32],
        seen: usize,
        messages: &[Json],
        tools: &[Json],
    ) -> Result<NextPrompt, Error> {
        let full = self.render_ids(messages, tools, true)?;
        if recorded.is_empty() {
            return Ok(NextPrompt { new_tokens: full, drift: false });
        }
        if full.starts_with(recorded) {
            return Ok(NextPrompt { new_tokens: full[recorded.len()..].to_vec(), drift: false });
        }
        // The history re-renders differently from what the policy saw (e.g. the
        // reply re-tokenises differently): keep the recorded tokens and add the
        // new messages' tokens, rendered after a stand-in conversation so the
        // template's glue between turns is right.
        let base = [
            json!({"role": "system", "content": "x"}),
            json!({"role": "user", "content": "x"}),
            json!({"role": "assistant", "content": "x"}),
        ];
        let before = self.render_ids(&base, tools, false)?;
        let with_new: Vec<Json> = base.iter().cloned().chain(messages[seen..].iter().cloned()).collect();
        let after = self.render_ids(&with_new, tools, true)?;
        if !after.starts_with(&before) {
            return Err(Error::Internal("the chat template does not extend a conversation by appending".to_owned()));
        }
        // Glue after the stand-in reply's end-of-turn token (included when the policy did not sample one).
        let end = self.end_of_turn.and_then(|eot| before.iter().rposition(|&t| t == eot)).unwrap_or(before.len());
        let recorded_ended = recorded.last().copied() == self.end_of_turn;
        let glue = if recorded_ended { &before[(end + 1).min(before.len())..] } else { &before[end..] };
        let new_tokens = glue.iter().chain(&after[before.len()..]).copied().collect();
        Ok(NextPrompt { new_tokens, drift: true })
    }
}
