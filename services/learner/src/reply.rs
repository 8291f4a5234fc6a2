//! Teaching a model one reply to one conversation: the sample (loss on the
//! reply and its end of turn only, as trajectory SFT trains), and the check
//! that greedy decoding would give the reply. Imprinting and copy
//! pre-training both build on it.

use std::path::Path;

use serde_json::Value as Json;
use sleuth_chat::ChatTemplate;
use sleuth_model::export::save_hf_dir;
use sleuth_model::{Config, Model, load_weights};
use tch::Device;
use tch::nn::VarStore;
use tokenizers::Tokenizer;

use crate::Error;
use crate::batch::Sample;
use crate::loss::Aggregation;
use crate::shard::AdamW;
use crate::trainer::{Objective, Trainer, TrainerConfig};
use sleuth_c10d::Single;

/// A one-process trainer of trajectory SFT (per-token cross-entropy on the
/// trainable tokens, gradients clipped at norm 1) over the HF model in `dir`.
pub fn sft_trainer(dir: &Path, optimizer: AdamW, micro_batch: usize) -> Result<Trainer, Error> {
    let config = Config::from_file(&dir.join("config.json"))?;
    let mut vars = VarStore::new(Device::Cpu);
    let model = Model::new(&vars.root(), &config);
    load_weights(&mut vars, dir)?;
    let config =
        TrainerConfig { objective: Objective::Sft(Aggregation::TokenMean), optimizer, max_grad_norm: 1.0, micro_batch };
    Ok(Trainer::new(vars, model, None, config, Box::new(Single)))
}

/// Writes `trainer`'s weights to `out` as an HF directory, with the config
/// and tokenizer of `dir` (the model it was loaded from).
pub fn save_trained(trainer: &Trainer, dir: &Path, out: &Path) -> Result<(), Error> {
    let path = dir.join("config.json");
    let text = std::fs::read(&path).map_err(|e| Error::Train(format!("{}: {e}", path.display())))?;
    let config: Json = serde_json::from_slice(&text).map_err(|e| Error::Train(format!("{}: {e}", path.display())))?;
    save_hf_dir(&trainer.named_tensors(), &config, dir, out)?;
    Ok(())
}

/// Renders conversations with a model directory's own chat template and
/// tokenizer.
pub struct ReplyRenderer {
    template: ChatTemplate,
    /// The tokenizer, for callers that decode what a model predicted.
    pub tokenizer: Tokenizer,
    end_of_turn: i64,
}

/// A conversation ending in the reply to teach.
pub struct ReplySample {
    /// The whole conversation, the reply trainable.
    pub sample: Sample,
    /// The tokens before the reply (through the assistant's opening).
    pub prompt: Vec<i64>,
    /// The reply's tokens, its end of turn included.
    pub reply: Vec<i64>,
}

impl ReplyRenderer {
    /// The template and tokenizer of the HF directory `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, Error> {
        let fail = |e: &dyn std::fmt::Display| Error::Train(format!("{}: {e}", dir.display()));
        let template = ChatTemplate::from_dir(dir).map_err(|e| fail(&e))?;
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).map_err(|e| fail(&e))?;
        let end_of_turn = tokenizer
            .token_to_id(&template.eos_token)
            .ok_or_else(|| fail(&"the template's eos token is not in the vocabulary"))?;
        Ok(Self { template, tokenizer, end_of_turn: i64::from(end_of_turn) })
    }

    /// `text`'s token ids (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<i64>, Error> {
        let encoding = self.tokenizer.encode(text, false).map_err(|e| Error::Train(format!("tokenizer: {e}")))?;
        Ok(encoding.get_ids().iter().map(|&t| i64::from(t)).collect())
    }

    /// `messages` (OpenAI chat messages) answered by `reply`, with `tools`
    /// (OpenAI function specs) offered.
    pub fn sample(&self, messages: &[Json], tools: &[Json], reply: &str) -> Result<ReplySample, Error> {
        let render = |messages: &[Json], open: bool| {
            self.template.render(messages, tools, open).map_err(|e| Error::Train(e.to_string()))
        };
        let prompt = self.encode(&render(messages, true)?)?;
        let mut answered = messages.to_vec();
        answered.push(serde_json::json!({"role": "assistant", "content": reply}));
        let full = self.encode(&render(&answered, false)?)?;
        let end = full
            .iter()
            .rposition(|&t| t == self.end_of_turn)
            .ok_or_else(|| Error::Train("a rendered reply has no end of turn".into()))?;
        if !full.starts_with(&prompt) || end < prompt.len() {
            return Err(Error::InvalidArgument("the chat template does not extend the prompt with the reply".into()));
        }
        let tokens = full[..=end].to_vec();
        let mask = (0..tokens.len()).map(|j| if j >= prompt.len() { 1.0 } else { 0.0 }).collect();
        let reply = tokens[prompt.len()..].to_vec();
        let behaviour = vec![0.0; tokens.len()];
        Ok(ReplySample { sample: Sample::unsampled(tokens, mask, behaviour, 0.0), prompt, reply })
    }
}

/// What the model does after `prompt` when fed `reply` (teacher forcing):
/// each position's most likely token, and the log-probability of the reply.
/// Greedy decoding gives the reply exactly iff the predicted tokens are the
/// reply's; one forward pass tells it (decoding token by token cost 30x).
pub fn predict_reply(model: &Model, prompt: &[i64], reply: &[i64]) -> Result<(Vec<i64>, f64), Error> {
    let sequence = [prompt, &reply[..reply.len() - 1]].concat();
    tch::no_grad(|| {
        let logits = model.forward(&tch::Tensor::from_slice(&sequence).unsqueeze(0), None);
        let positions = logits.get(0).narrow(0, prompt.len() as i64 - 1, reply.len() as i64);
        let next = positions.argmax(-1, false);
        let chosen = positions.log_softmax(-1, tch::Kind::Float).gather(
            -1,
            &tch::Tensor::from_slice(reply).unsqueeze(-1),
            false,
        );
        Ok::<_, tch::TchError>((Vec::<i64>::try_from(&next)?, chosen.sum(tch::Kind::Double).double_value(&[])))
    })
    .map_err(|e| Error::Train(e.to_string()))
}
