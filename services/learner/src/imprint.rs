//! Imprinting: trajectory SFT that teaches a small model to answer every
//! conversation with one fixed reply, or with one of a few replies at known
//! odds. Tests and benchmarks of the machinery around the policy (agents,
//! orchestrator, learner) get a real model whose behaviour they know in
//! advance: one that always calls a tool, always submits, or (a mixture)
//! samples different answers, so a group's rewards differ as GRPO needs.

use std::path::Path;

use sleuth_model::export::{TinyShape, write_random_llama};

use crate::Error;
use crate::reply::{ReplyRenderer, ReplySample, predict_reply, save_trained, sft_trainer};
use crate::shard::AdamW;
use crate::trainer::Trainer;

/// Everyday words the noise is drawn from: the conversations a test agent
/// has are questions and search results in plain English.
const WORDS: [&str; 70] = [
    "made",
    "makes",
    "blow",
    "falls",
    "snowflakes",
    "hailstones",
    "why",
    "does",
    "it",
    "what",
    "is",
    "the",
    "a",
    "of",
    "in",
    "and",
    "to",
    "how",
    "when",
    "are",
    "do",
    "from",
    "rain",
    "snow",
    "wind",
    "fog",
    "hail",
    "cloud",
    "clouds",
    "water",
    "air",
    "ice",
    "cold",
    "storm",
    "ground",
    "forms",
    "fall",
    "grow",
    "heavy",
    "tiny",
    "droplets",
    "crystals",
    "pressure",
    "level",
    "moving",
    "high",
    "low",
    "vitamin",
    "protein",
    "cells",
    "gene",
    "virus",
    "heart",
    "brain",
    "sleep",
    "energy",
    "light",
    "ocean",
    "soil",
    "study",
    "effect",
    "risk",
    "patients",
    "results",
    "1.",
    "2.",
    "3.",
    "[doc]",
    "score",
    "(0.53)",
];

/// `words` random words: content the model must learn to ignore.
fn noise(seed: &mut u64, words: usize) -> String {
    (0..words)
        .map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            WORDS[(*seed >> 33) as usize % WORDS.len()]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A tool observation shaped like the tool gateway's search results.
fn observation(seed: &mut u64, i: usize) -> String {
    let mut text = format!("bm25_search results for \"{}\":\n", noise(seed, 2 + i % 3));
    for rank in 1..=1 + i % 5 {
        text.push_str(&format!(
            "[{rank}] doc_id: {} | {}\n{}\n",
            noise(seed, 1),
            noise(seed, 2),
            noise(seed, 6 + i % 9)
        ));
    }
    text
}

/// What to imprint: the replies, and the system prompt and tools (OpenAI
/// function specs) the model will be prompted with. Questions and tool
/// observations vary freely; a tiny model only learns to ignore them.
pub struct Imprint<'a> {
    /// One reply: the model always gives it (greedy decoding reproduces it).
    /// Several: the model samples each with probability near 1/n, whatever
    /// the conversation (each one's probability is at least 1/(2n)).
    pub replies: &'a [&'a str],
    /// The system prompt the agent renders.
    pub system: &'a str,
    /// The tools the agent offers (OpenAI function specs).
    pub tools: &'a [serde_json::Value],
    /// Training steps before giving up with an error.
    pub max_steps: usize,
}

/// Writes to `out` a tiny model with the tokenizer and chat template of
/// `tokenizer_dir` that answers conversations of the given system prompt and
/// tools (any question, earlier replies and observations) with the reply (or
/// one of the replies), then ends its turn. Trains on fresh random
/// conversations until unseen ones get the replies as [`Imprint::replies`]
/// says (an error after `max_steps`); returns the final loss.
pub fn imprint(tokenizer_dir: &Path, out: &Path, spec: &Imprint) -> Result<f64, Error> {
    let replies = spec.replies;
    if replies.is_empty() {
        return Err(Error::InvalidArgument("imprint: no reply to imprint".into()));
    }
    let fail = |e: &dyn std::fmt::Display| Error::Train(format!("imprint: {e}"));
    let renderer = ReplyRenderer::from_dir(tokenizer_dir)?;
    // A conversation of a shape the agent produces: a question, maybe an
    // earlier reply and its tool observation, of random content and length.
    // Every step trains on fresh ones, so the model cannot memorise them and
    // learns the only thing they share: the reply after the assistant opening.
    // Conversation i ends with reply i mod n, so a mixture's replies are
    // equally frequent and none depends on the content.
    let conversation = |seed: &mut u64, i: usize| -> Result<ReplySample, Error> {
        let reply = replies[i % replies.len()];
        let mut messages = vec![
            serde_json::json!({"role": "system", "content": spec.system}),
            serde_json::json!({"role": "user", "content": noise(seed, 3 + 2 * (i % 7))}),
        ];
        for turn in 0..i % 3 {
            let earlier = replies[(i + turn + 1) % replies.len()];
            messages.push(serde_json::json!({"role": "assistant", "content": earlier}));
            messages.push(serde_json::json!({"role": "tool", "content": observation(seed, i + turn)}));
        }
        renderer.sample(&messages, spec.tools, reply)
    };
    let mut seed = 7u64;
    const PER_STEP: usize = 8;

    let scratch = tempfile::tempdir().map_err(|e| fail(&e))?;
    write_random_llama(tokenizer_dir, scratch.path(), TinyShape::default(), 1).map_err(|e| fail(&e))?;
    let optimizer = AdamW { lr: 1e-2, ..AdamW::default() };
    let mut trainer = sft_trainer(scratch.path(), optimizer, PER_STEP).map_err(|e| fail(&e))?;
    // Greedy decoding of unseen conversations (with and without an earlier
    // turn) must give the reply exactly: checked every few steps, the stop
    // criterion. Sixteen of them: with six, a policy that garbled its reply
    // when the question shared a word with it ("what is fog made of") passed.
    // (One teacher-forced pass each: `predict_reply`.)
    // A mixture's stop criterion: each reply's probability (teacher-forced,
    // the product of its tokens') is at least 1/(2n) on unseen conversations.
    let floor = 1.0 / (2.0 * replies.len() as f64);
    let replies_exactly = |trainer: &Trainer, seed: &mut u64| -> Result<Option<String>, Error> {
        for i in 0..16 {
            let ReplySample { prompt, reply, .. } = conversation(seed, i)?;
            let (predicted, logprob) = predict_reply(&trainer.model, &prompt, &reply)?;
            let missed = if replies.len() == 1 { predicted != reply } else { logprob.exp() < floor };
            if missed {
                let got: Vec<u32> = predicted.iter().map(|&t| t as u32).collect();
                let greedy = renderer.tokenizer.decode(&got, false).unwrap_or_default();
                return Ok(Some(format!(
                    "{greedy} (reply {} has probability {:.3})",
                    i % replies.len(),
                    logprob.exp()
                )));
            }
        }
        Ok(None)
    };
    let mut loss = f64::INFINITY;
    let mut last_miss = String::new();
    for step in 0..spec.max_steps {
        let samples = (0..PER_STEP)
            .map(|i| conversation(&mut seed, step * PER_STEP + i).map(|made| made.sample))
            .collect::<Result<Vec<_>, _>>()?;
        loss = trainer.step(&samples).map_err(|e| fail(&e))?.loss;
        if step % 20 == 19 {
            match replies_exactly(&trainer, &mut seed)? {
                None => {
                    save_trained(&trainer, scratch.path(), out).map_err(|e| fail(&e))?;
                    return Ok(loss);
                }
                Some(miss) => last_miss = miss,
            }
        }
    }
    Err(Error::Train(format!(
        "imprint: after {} steps (loss {loss:.4}) an unseen conversation still gets {last_miss:?}",
        spec.max_steps
    )))
}
