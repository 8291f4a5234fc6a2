//! Stop strings: a generation ends once its decoded text contains one of them
//! (OpenAI's `stop`). The policy server checks them, not the gateway, so no
//! token is generated past the stop; the token that completes a stop string
//! is the last one returned, and the gateway cuts the string from the text.

use std::sync::Arc;

use tokenizers::Tokenizer;

/// At most this many stop strings per request, each at most `MAX_STOP_BYTES`.
const MAX_STOPS: usize = 16;
const MAX_STOP_BYTES: usize = 256;

#[derive(Clone)]
pub struct StopStrings {
    strings: Vec<String>,
    tokenizer: Arc<Tokenizer>,
    /// Trailing tokens decoded per check: enough to spell the longest string.
    window: usize,
}

impl std::fmt::Debug for StopStrings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopStrings").field("strings", &self.strings).finish()
    }
}

impl StopStrings {
    /// None when `strings` is empty; an error names the bad entry.
    pub fn new(strings: &[String], tokenizer: Option<&Arc<Tokenizer>>) -> Result<Option<Self>, String> {
        if strings.is_empty() {
            return Ok(None);
        }
        if strings.len() > MAX_STOPS {
            return Err(format!("stop has {} strings; at most {MAX_STOPS}", strings.len()));
        }
        for (i, string) in strings.iter().enumerate() {
            if string.is_empty() || string.len() > MAX_STOP_BYTES {
                return Err(format!("stop[{i}] {string:?} must be 1 to {MAX_STOP_BYTES} bytes"));
            }
        }
        let tokenizer = tokenizer
            .ok_or("stop strings need the model directory's tokenizer.json, which the served model has none of")?;
        // A token spells at least one byte (a partial character at worst), so
        // the longest string's bytes + 1 tokens always cover a fresh match.
        let window = strings.iter().map(String::len).max().unwrap_or(0) + 1;
        Ok(Some(Self { strings: strings.to_vec(), tokenizer: tokenizer.clone(), window }))
    }

    /// Whether the text of `generated` now contains a stop string. Checked
    /// after every token, so only a match ending in the newest token is new.
    pub fn reached(&self, generated: &[i64]) -> bool {
        let tail: Vec<u32> =
            generated[generated.len().saturating_sub(self.window)..].iter().map(|&t| t as u32).collect();
        let text = self.tokenizer.decode(&tail, true).unwrap_or_default();
        self.strings.iter().any(|s| text.contains(s.as_str()))
    }
}
