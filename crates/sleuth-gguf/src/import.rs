//! GGUF -> HF directory for the decoders `sleuth-model` implements (Llama
//! incl. SmolLM2, Qwen2, Qwen3): config from the metadata, tensors renamed to
//! the HF checkpoint keys and dequantised, Llama's q/k rows un-permuted, and
//! the tokenizer files.
//!
//! The directory is written under `<out>.partial` and renamed into place at
//! the end, so an interrupted import never leaves a directory that looks
//! complete.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::file::{GgufFile, TensorInfo};
use crate::safetensors::{Dtype, Writer};
use crate::{GgufError, tokenizer};

pub use crate::safetensors::Dtype as OutputDtype;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    fn parse(file: &GgufFile) -> Result<(Self, &str), GgufError> {
        let name = file.require_str("general.architecture")?;
        let arch = match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => {
                return Err(file.metadata_error(
                    "general.architecture",
                    format!("{other:?} is not supported (llama, qwen2, qwen3)"),
                ));
            }
        };
        Ok((arch, name))
    }

    fn hf_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
        }
    }
}

#[derive(Debug, Clone)]
pub struct ImportSummary {
    pub architecture: String,
    pub tensors: usize,
    pub parameters: u64,
    /// Source tensor types and how many tensors of each.
    pub source_types: BTreeMap<&'static str, usize>,
    pub vocab_size: usize,
    pub out: PathBuf,
}

/// Imports `gguf` into the HF directory `out` (which must not exist yet).
/// `progress(done, total, tensor)` is called after each tensor is written.
pub fn import_hf_dir(
    gguf: &Path,
    out: &Path,
    dtype: OutputDtype,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<ImportSummary, GgufError> {
    if out.exists() {
        let reason = "already exists; remove it or choose another directory";
        return Err(GgufError::Io { path: out.display().to_string(), source: std::io::Error::other(reason) });
    }
    let file = GgufFile::open(gguf)?;
    let (arch, arch_name) = Arch::parse(&file)?;
    let key = |name: &str| format!("{arch_name}.{name}");

    if file.get(&key("rope.scaling.type")).is_some() {
        return Err(file.metadata_error(&key("rope.scaling.type"), "rope scaling is not supported yet".into()));
    }
    let heads = file.require_u64(&key("attention.head_count"))?;
    let hidden = file.require_u64(&key("embedding_length"))?;
    let kv_heads = file.optional_u64(&key("attention.head_count_kv"))?.unwrap_or(heads);
    let head_dim = file.optional_u64(&key("attention.key_length"))?.unwrap_or(hidden / heads.max(1));
    let context_length = file.require_u64(&key("context_length"))?;
    let rope_theta = file.optional_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0);
    let tokenizer = tokenizer::build(&file, context_length)?;

    let plan = file
        .tensors
        .iter()
        .map(|tensor| Ok((tensor, hf_name(&file, tensor)?)))
        .collect::<Result<Vec<_>, GgufError>>()?;
    let tied = file.tensor("output.weight").is_none();
    let vocab_size = match file.optional_u64(&key("vocab_size"))? {
        Some(size) => size,
        None => file.tensor("token_embd.weight").map(|t| t.shape()[0]).ok_or_else(|| {
            file.metadata_error(&key("vocab_size"), "missing, and there is no token_embd.weight".into())
        })?,
    };

    let mut config = json!({
        "architectures": [arch.hf_class()],
        "model_type": arch_name,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": file.require_u64(&key("feed_forward_length"))?,
        "num_hidden_layers": file.require_u64(&key("block_count"))?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context_length,
        "rms_norm_eps": file.optional_f64(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
        // Both spellings: transformers < 5 reads the first, >= 5 the second.
        "rope_theta": rope_theta,
        "rope_parameters": { "rope_theta": rope_theta, "rope_type": "default" },
        "tie_word_embeddings": tied,
        "attention_bias": arch == Arch::Qwen2,
        "torch_dtype": match dtype { Dtype::F32 => "float32", Dtype::Bf16 => "bfloat16" },
    });
    for (name, meta) in [
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(id) = file.optional_u64(meta)? {
            config[name] = json!(id);
        }
    }

    let partial =
        out.with_file_name(format!("{}.partial", out.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()));
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| GgufError::Io { path: path.clone(), source }
    };
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(io(&partial))?;
    }
    std::fs::create_dir_all(&partial).map_err(io(&partial))?;
    let write_json = |name: &str, value: &Value| {
        let path = partial.join(name);
        let text = serde_json::to_string_pretty(value).expect("JSON values serialise");
        std::fs::write(&path, text).map_err(io(&path))
    };
    write_json("config.json", &config)?;
    write_json("tokenizer.json", &tokenizer.tokenizer_json)?;
    write_json("tokenizer_config.json", &tokenizer.tokenizer_config)?;
    if let Some(template) = &tokenizer.chat_template {
        let path = partial.join("chat_template.jinja");
        std::fs::write(&path, template).map_err(io(&path))?;
    }

    let weights = partial.join("model.safetensors");
    let declared: Vec<(String, Vec<u64>)> = plan.iter().map(|(t, name)| (name.clone(), t.shape())).collect();
    let mut writer = Writer::create(&weights, dtype, &declared).map_err(io(&weights))?;
    let mut source_types = BTreeMap::new();
    let mut parameters = 0;
    for (done, (tensor, name)) in plan.iter().enumerate() {
        let mut values = file.read_f32(tensor)?;
        if arch == Arch::Llama {
            // llama.cpp's converter interleaves the rotary halves of each
            // Llama query/key head; HF keeps them split.
            if tensor.name.contains(".attn_q.") {
                values = unpermute_rows(&file, tensor, values, heads)?;
            } else if tensor.name.contains(".attn_k.") {
                values = unpermute_rows(&file, tensor, values, kv_heads)?;
            }
        }
        writer.write(name, &values).map_err(io(&weights))?;
        *source_types.entry(tensor.ggml_type.name()).or_insert(0) += 1;
        parameters += tensor.elements();
        progress(done + 1, plan.len(), name);
    }
    writer.finish().map_err(io(&weights))?;
    std::fs::rename(&partial, out).map_err(io(out))?;

    Ok(ImportSummary {
        architecture: arch_name.to_owned(),
        tensors: plan.len(),
        parameters,
        source_types,
        vocab_size: tokenizer.vocab_size,
        out: out.to_owned(),
    })
}

/// The HF checkpoint key of a GGUF tensor; a tensor with none is an error
/// (silently dropping weights would load a different model).
fn hf_name(file: &GgufFile, tensor: &TensorInfo) -> Result<String, GgufError> {
    let top = match tensor.name.as_str() {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = top {
        return Ok(name.to_owned());
    }
    let unknown = || file.tensor_error(tensor, "has no counterpart in the HF Llama/Qwen2/Qwen3 checkpoint".into());
    let rest = tensor.name.strip_prefix("blk.").ok_or_else(unknown)?;
    let (layer, rest) = rest.split_once('.').ok_or_else(unknown)?;
    let layer: u64 = layer.parse().map_err(|_| unknown())?;
    let (module, param) = rest.rsplit_once('.').ok_or_else(unknown)?;
    let hf_module = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return Err(unknown()),
    };
    if !matches!(param, "weight" | "bias") {
        return Err(unknown());
    }
    Ok(format!("model.layers.{layer}.{hf_module}.{param}"))
}

/// Undoes llama.cpp's permutation of a query/key projection: within each
/// head, output row `i * half + j` is input row `j * 2 + i` (i in 0..2).
fn unpermute_rows(file: &GgufFile, tensor: &TensorInfo, values: Vec<f32>, heads: u64) -> Result<Vec<f32>, GgufError> {
    let shape = tensor.shape();
    let rows = shape[0] as usize;
    let heads = heads as usize;
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(file.tensor_error(tensor, format!("{rows} rows do not split into {heads} heads of even size")));
    }
    let width = values.len() / rows;
    let half = rows / heads / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..2 {
            for j in 0..half {
                let to = h * 2 * half + i * half + j;
                let from = h * 2 * half + j * 2 + i;
                out[to * width..(to + 1) * width].copy_from_slice(&values[from * width..(from + 1) * width]);
            }
        }
    }
    Ok(out)
}
