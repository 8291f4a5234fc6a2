//! Writing models as HF-format directories (config.json, model.safetensors,
//! tokenizer files) that the policy server and `transformers` both load:
//! the learner's merged checkpoints, and tiny random policies for tests and
//! benchmarks of the machinery around the model.

use std::path::Path;

use serde_json::{Value as Json, json};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::{Config, Model, ModelError};

/// Files besides config and weights that make a directory a usable model.
const TOKENIZER_FILES: [&str; 4] =
    ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"];

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io { path: path.display().to_string(), source }
}

/// Writes `tensors` (HF names) as `dir/model.safetensors`, then `config` as
/// `dir/config.json`, and copies the tokenizer files of `tokenizer_dir`.
/// The weights are written to a temporary name and renamed, so a crash never
/// leaves a truncated file under the real name.
pub fn save_hf_dir(
    tensors: &[(String, Tensor)],
    config: &Json,
    tokenizer_dir: &Path,
    dir: &Path,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let partial = dir.join("model.safetensors.partial");
    let named: Vec<(&str, Tensor)> =
        tensors.iter().map(|(name, t)| (name.as_str(), t.to_device(Device::Cpu).contiguous())).collect();
    Tensor::write_safetensors(&named, &partial)?;
    let weights = dir.join("model.safetensors");
    std::fs::rename(&partial, &weights).map_err(io(&weights))?;
    let config_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(config).map_err(|e| ModelError::Weights(e.to_string()))?;
    std::fs::write(&config_path, text).map_err(io(&config_path))?;
    for file in TOKENIZER_FILES {
        let source = tokenizer_dir.join(file);
        if source.is_file() {
            let target = dir.join(file);
            std::fs::copy(&source, &target).map_err(io(&target))?;
        }
    }
    Ok(())
}

/// The shape of a tiny random Llama.
#[derive(Debug, Clone, Copy)]
pub struct TinyShape {
    pub hidden_size: i64,
    pub layers: i64,
    pub heads: i64,
    pub kv_heads: i64,
    pub intermediate_size: i64,
}

impl Default for TinyShape {
    fn default() -> Self {
        Self { hidden_size: 64, layers: 2, heads: 4, kv_heads: 2, intermediate_size: 128 }
    }
}

/// Writes a randomly initialised Llama of `shape` that uses the tokenizer and
/// chat template of the model in `tokenizer_dir` (so the whole mesh runs on
/// it) to `dir`. Weights are N(0, 0.02) as HF initialises them, norms 1,
/// reproducible from `seed`.
pub fn write_random_llama(tokenizer_dir: &Path, dir: &Path, shape: TinyShape, seed: i64) -> Result<(), ModelError> {
    let base_path = tokenizer_dir.join("config.json");
    let base: Json = serde_json::from_str(&std::fs::read_to_string(&base_path).map_err(io(&base_path))?)
        .map_err(|e| ModelError::Config { path: base_path.display().to_string(), message: e.to_string() })?;
    let token = |name: &str| base[name].as_u64().and_then(|id| u32::try_from(id).ok());
    let vocab_size = base["vocab_size"].as_u64().ok_or_else(|| ModelError::Config {
        path: base_path.display().to_string(),
        message: "no vocab_size".to_owned(),
    })? as usize;
    let config_json =
        llama_config(shape, vocab_size, [token("bos_token_id"), token("eos_token_id"), token("pad_token_id")]);
    write_random(&config_json, tokenizer_dir, dir, seed)
}

/// The HF config of a Llama of `shape` over a vocabulary of `vocab_size`
/// tokens, with `[bos, eos, pad]` token ids, tied embeddings and f32 weights.
pub fn llama_config(shape: TinyShape, vocab_size: usize, [bos, eos, pad]: [Option<u32>; 3]) -> Json {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden_size / shape.heads,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        // Tied: a tiny model's output layer is most of it, and copying a
        // name from its context writes the embedding it read.
        "tie_word_embeddings": true,
        "attention_bias": false,
        "mlp_bias": false,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "float32",
    })
}

/// Writes a randomly initialised model of HF config `config_json` to `dir`
/// (weights N(0, 0.02), norms 1, reproducible from `seed`), with the
/// tokenizer files of `tokenizer_dir` when it has them.
pub fn write_random(config_json: &Json, tokenizer_dir: &Path, dir: &Path, seed: i64) -> Result<(), ModelError> {
    let config: Config = serde_json::from_value(config_json.clone())
        .map_err(|e| ModelError::Config { path: "config".into(), message: e.to_string() })?;
    let vars = VarStore::new(Device::Cpu);
    let _model = Model::new(&vars.root(), &config);
    let mut names: Vec<(String, Vec<i64>)> = vars.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
    // Draw in name order, so the weights depend only on the seed.
    names.sort();
    tch::manual_seed(seed);
    let tensors: Vec<(String, Tensor)> = tch::no_grad(|| {
        names
            .into_iter()
            .map(|(name, size)| {
                let value = if name.ends_with("norm.weight") {
                    Tensor::ones(size.as_slice(), (Kind::Float, Device::Cpu))
                } else {
                    Tensor::randn(size.as_slice(), (Kind::Float, Device::Cpu)) * 0.02
                };
                (name, value)
            })
            .collect()
    });
    save_hf_dir(&tensors, config_json, tokenizer_dir, dir)
}
