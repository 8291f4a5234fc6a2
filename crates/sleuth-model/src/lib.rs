//! Decoder-only transformers of the Llama family in libtorch, written the
//! candle way: a serde [`Config`] matching HF `config.json`, then the blocks,
//! then [`Model`]. Module paths mirror the HF checkpoint keys
//! (`model.layers.0.self_attn.q_proj.weight`), so HF safetensors (single file
//! or sharded) load straight into the `VarStore`.
//!
//! Covered: Llama (SmolLM2 included), Qwen2 (q/k/v bias) and Qwen3 (q/k
//! RMSNorm): RoPE, grouped-query attention, SwiGLU MLP, RMSNorm, tied or
//! untied embeddings; any dtype libtorch has (f32, bf16) on CPU or CUDA.
//! [`Model::forward`] serves training (full sequences, causal, right-padded
//! batches); [`Model::forward_with_cache`] serves inference with a KV cache.

pub mod cache;
pub mod config;
pub mod export;
mod layers;
pub mod load;
pub mod model;
pub mod sampling;

pub use cache::{BatchCache, KvCache};
pub use config::{Architecture, Config};
pub use load::load_weights;
pub use model::Model;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {message}")]
    Config { path: String, message: String },
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("weights: {0}")]
    Weights(String),
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}
