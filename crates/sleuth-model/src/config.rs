//! The fields of an HF `config.json` a Llama-family decoder needs.

use std::path::Path;

use serde::Deserialize;

use crate::ModelError;

/// Which variant of the block the checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama and Llama-shaped models (SmolLM2, Mistral-style without sliding window).
    Llama,
    /// Qwen2/Qwen2.5: bias on the q, k and v projections.
    Qwen2,
    /// Qwen3: RMSNorm on queries and keys per head, no projection bias.
    Qwen3,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub model_type: String,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    #[serde(default)]
    pub num_key_value_heads: Option<i64>,
    #[serde(default)]
    pub head_dim: Option<i64>,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// transformers < 5 writes `rope_theta` at the top level ...
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// ... transformers >= 5 inside `rope_parameters`.
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    pub max_position_embeddings: i64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub bos_token_id: Option<TokenIds>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_type: Option<String>,
}

/// One token id or several (HF allows both for `eos_token_id`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}

impl Config {
    /// Reads and checks `config.json`; unsupported features are errors, not silent differences.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ModelError::Io { path: path.display().to_string(), source })?;
        let config: Config = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config { path: path.display().to_string(), message: e.to_string() })?;
        config.validate().map_err(|message| ModelError::Config { path: path.display().to_string(), message })?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        self.architecture()?;
        if let Some(act) = &self.hidden_act
            && act != "silu"
        {
            return Err(format!("hidden_act {act:?} is not supported (silu only)"));
        }
        let rope_type = self.rope_parameters.as_ref().and_then(|p| p.rope_type.as_deref()).unwrap_or("default");
        let scaled = self.rope_scaling.as_ref().is_some_and(|s| !s.is_null()) || rope_type != "default";
        if scaled {
            return Err(format!("rope scaling ({rope_type}) is not supported yet"));
        }
        if self.num_attention_heads % self.kv_heads() != 0 {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        Ok(())
    }

    pub fn architecture(&self) -> Result<Architecture, String> {
        match self.model_type.as_str() {
            "llama" | "mistral" => Ok(Architecture::Llama),
            "qwen2" => Ok(Architecture::Qwen2),
            "qwen3" => Ok(Architecture::Qwen3),
            other => Err(format!("model_type {other:?} is not supported (llama, qwen2, qwen3)")),
        }
    }

    fn arch(&self) -> Architecture {
        self.architecture().expect("validated in from_file")
    }

    pub fn head_dim(&self) -> i64 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    pub fn kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters.as_ref().and_then(|p| p.rope_theta).or(self.rope_theta).unwrap_or(10_000.0)
    }

    /// Bias on the q, k and v projections.
    pub fn qkv_bias(&self) -> bool {
        match self.arch() {
            Architecture::Qwen2 => true,
            _ => self.attention_bias.unwrap_or(false),
        }
    }

    /// Bias on the output projection (Llama's `attention_bias` covers it too).
    pub fn o_bias(&self) -> bool {
        self.arch() == Architecture::Llama && self.attention_bias.unwrap_or(false)
    }

    /// Per-head RMSNorm of queries and keys.
    pub fn qk_norm(&self) -> bool {
        self.arch() == Architecture::Qwen3
    }

    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id.as_ref().map(TokenIds::to_vec).unwrap_or_default()
    }
}
