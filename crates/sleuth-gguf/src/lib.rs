//! GGUF, llama.cpp's model format, read in Rust: metadata, tensor directory
//! and dequantisation of the common block formats (Q4_0 .. Q8_0, the K-quants,
//! F16/BF16), and an importer that writes the HF directory (`config.json`,
//! `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`, chat
//! template) that `sleuth-model` and `sleuth-chat` load.
//!
//! Users have GGUF files; this lets them bring one to Sleuth without Python.
//! The importer reproduces what `transformers` does when it loads a GGUF
//! (the tests compare the two tensor by tensor and token by token).

mod dequant;
mod file;
mod import;
mod safetensors;
mod tokenizer;

pub use dequant::GgmlType;
pub use file::{GgufFile, TensorInfo, Value};
pub use import::{ImportSummary, OutputDtype, import_hf_dir};

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: not a GGUF file ({reason})")]
    Format { path: String, reason: String },
    #[error("{path}: tensor {tensor}: {reason}")]
    Tensor { path: String, tensor: String, reason: String },
    #[error("{path}: metadata {key}: {reason}")]
    Metadata { path: String, key: String, reason: String },
}
