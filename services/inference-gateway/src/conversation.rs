//! Token-in/token-out prompts: the next turn's prompt is the episode's
//! recorded tokens plus the tokens of the new messages only, never a
//! re-tokenised history.
//!
//! A turn renders and tokenises only what is new: the policy's last reply
//! (to check it re-renders to the tokens the policy sampled) and the messages
//! after it, behind a constant stand-in context (the system message and a
//! placeholder user turn). So a turn costs the same at turn 50 as at turn 2,
//! however long the episode's observations; the history before the reply is
//! checked by its digest ([`crate::episode::HistoryDigest`]), not re-rendered.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// Tokens produced by tokenising renders since start: what a turn's
    /// rendering costs, observable by tests.
    tokenised: AtomicU64,
}

/// What the next turn adds to the recorded tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextPrompt {
    /// Tokens to append to the recorded ones: the template's glue after the
    /// policy's reply and the new messages, through the generation prompt.
    pub new_tokens: Vec<u32>,
    /// The policy's last reply, as the caller sent it back, no longer renders
    /// to the tokens the policy sampled.
    pub drift: bool,
}

/// The policy's previous turn, as the next turn must continue it.
#[derive(Debug, Clone, Copy)]
pub struct LastReply<'a> {
    /// The reply message as the caller sent it back.
    pub message: &'a Json,
    /// The tokens the policy sampled for it (the trace's last policy segments).
    pub sampled: &'a [u32],
}

/// The constant context a reply is rendered after: the conversation's system
/// message (templates may render the tools into it) and a placeholder user turn.
fn stand_in(system: Option<&Json>) -> Vec<Json> {
    system.cloned().into_iter().chain([json!({"role": "user", "content": "x"})]).collect()
}

impl Renderer {
    pub fn load(dir: &Path) -> Result<Self, Error> {
        let template = ChatTemplate::from_dir(dir)?;
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| Error::Internal(format!("{}: {e}", dir.join("tokenizer.json").display())))?;
        let end_of_turn = tokenizer.token_to_id(&template.eos_token);
        Ok(Self { template, tokenizer, end_of_turn, tokenised: AtomicU64::new(0) })
    }

    /// Tokens produced by rendering since the renderer was loaded.
    pub fn tokenised(&self) -> u64 {
        self.tokenised.load(Ordering::Relaxed)
    }

    fn render_ids(&self, messages: &[Json], tools: &[Json], generation: bool) -> Result<Vec<u32>, Error> {
        let text = self.template.render(messages, tools, generation)?;
        let encoding =
            self.tokenizer.encode(text.as_str(), false).map_err(|e| Error::Internal(format!("tokenizer: {e}")))?;
        self.tokenised.fetch_add(encoding.len() as u64, Ordering::Relaxed);
        Ok(encoding.get_ids().to_vec())
    }

    /// `reply`'s rendering after `context`: the tokens after the generation
    /// prompt, through the end of the rendered conversation (so including the
    /// reply's end-of-turn token and any glue after it), and the whole
    /// rendering those tokens end.
    fn rendered_reply(
        &self,
        context: &mut Vec<Json>,
        reply: &Json,
        tools: &[Json],
    ) -> Result<(usize, Vec<u32>), Error> {
        let prompt = self.render_ids(context, tools, true)?;
        context.push(reply.clone());
        let full = self.render_ids(context, tools, false)?;
        if !full.starts_with(&prompt) {
            return Err(Error::InvalidArgument(
                "the chat template does not render an assistant reply after its generation prompt".to_owned(),
            ));
        }
        Ok((prompt.len(), full))
    }

    /// Where the reply in `rendered` writes its end-of-turn token, if it does.
    fn end_of_turn_at(&self, rendered: &[u32]) -> Option<usize> {
        self.end_of_turn.and_then(|eot| rendered.iter().position(|&t| t == eot))
    }

    /// The tokens a policy samples to write `reply` (after a conversation
    /// with `system` as its system message): the template's rendering of an
    /// assistant message with that content, up to and including its
    /// end-of-turn token (where the policy stops).
    pub fn reply_tokens(&self, system: Option<&Json>, tools: &[Json], reply: &str) -> Result<Vec<u32>, Error> {
        let mut context = stand_in(system);
        let (start, full) =
            self.rendered_reply(&mut context, &json!({"role": "assistant", "content": reply}), tools)?;
        let rest = &full[start..];
        Ok(rest[..self.end_of_turn_at(rest).map_or(rest.len(), |i| i + 1)].to_vec())
    }

    /// Text of generated tokens, special tokens dropped.
    pub fn decode(&self, tokens: &[u32]) -> Result<String, Error> {
        self.tokenizer.decode(tokens, true).map_err(|e| Error::Internal(format!("tokenizer: {e}")))
    }

    /// The tokens the next turn appends to the recorded ones: `new` are the
    /// messages after the policy's `last` reply (every message on an
    /// episode's first turn, when there is no reply yet); `system` is the
    /// conversation's system message, if any.
    pub fn next_prompt(
        &self,
        system: Option<&Json>,
        last: Option<LastReply<'_>>,
        new: &[Json],
        tools: &[Json],
    ) -> Result<NextPrompt, Error> {
        let Some(last) = last else {
            return Ok(NextPrompt { new_tokens: self.render_ids(new, tools, true)?, drift: false });
        };
        let mut context = stand_in(system);
        let (start, before) = self.rendered_reply(&mut context, last.message, tools)?;
        context.extend_from_slice(new);
        let after = self.render_ids(&context, tools, true)?;
        let Some(added) = after.strip_prefix(before.as_slice()) else {
            return Err(Error::Internal("the chat template does not extend a conversation by appending".to_owned()));
        };
        // The reply as rendered: its tokens, end-of-turn and the glue to the next message.
        let rendered = &before[start..];
        let (rest, drift) = if rendered.starts_with(last.sampled) {
            // What the policy sampled is the reply's rendering (or the start of
            // it, when sampling stopped at its token limit): the rest follows.
            (&rendered[last.sampled.len()..], false)
        } else {
            // The reply re-renders differently from what the policy saw (an
            // edited reply, or text that re-tokenises differently): keep the
            // recorded tokens and add only the glue after the reply's
            // end-of-turn token (and the token itself when the policy did
            // not sample one).
            let ended = last.sampled.last().is_some_and(|&t| Some(t) == self.end_of_turn);
            let glue = match self.end_of_turn_at(rendered) {
                Some(at) if ended => at + 1,
                Some(at) => at,
                None => rendered.len(),
            };
            (&rendered[glue..], true)
        };
        Ok(NextPrompt { new_tokens: rest.iter().chain(added).copied().collect(), drift })
    }
}
