//! A BERT encoder in libtorch, written after HF `BertModel`: parameter paths
//! mirror the checkpoint keys (`encoder.layer.0.attention.self.query.weight`)
//! so `model.safetensors` loads straight into the `VarStore`.

use serde::Deserialize;
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// The fields of HF `config.json` a BERT encoder needs.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub intermediate_size: i64,
    pub max_position_embeddings: i64,
    pub type_vocab_size: i64,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default = "default_act")]
    pub hidden_act: String,
}

fn default_eps() -> f64 {
    1e-12
}

fn default_act() -> String {
    "gelu".to_owned()
}

fn layer_norm(path: nn::Path, config: &Config) -> nn::LayerNorm {
    let options = nn::LayerNormConfig { eps: config.layer_norm_eps, ..Default::default() };
    nn::layer_norm(path, vec![config.hidden_size], options)
}

struct Embeddings {
    word: nn::Embedding,
    position: nn::Embedding,
    token_type: nn::Embedding,
    norm: nn::LayerNorm,
}

impl Embeddings {
    fn new(path: nn::Path, config: &Config) -> Self {
        let embedding =
            |name: &str, size: i64| nn::embedding(&path / name, size, config.hidden_size, Default::default());
        Self {
            word: embedding("word_embeddings", config.vocab_size),
            position: embedding("position_embeddings", config.max_position_embeddings),
            token_type: embedding("token_type_embeddings", config.type_vocab_size),
            norm: layer_norm(&path / "LayerNorm", config),
        }
    }

    fn forward(&self, input_ids: &Tensor) -> Tensor {
        let length = input_ids.size()[1];
        let positions = Tensor::arange(length, (Kind::Int64, input_ids.device())).unsqueeze(0);
        // Sentence embeddings use a single segment: token type 0 everywhere.
        let token_types = input_ids.zeros_like();
        let sum =
            self.word.forward(input_ids) + self.position.forward(&positions) + self.token_type.forward(&token_types);
        self.norm.forward(&sum)
    }
}

struct Layer {
    query: nn::Linear,
    key: nn::Linear,
    value: nn::Linear,
    attention_output: nn::Linear,
    attention_norm: nn::LayerNorm,
    intermediate: nn::Linear,
    output: nn::Linear,
    output_norm: nn::LayerNorm,
    heads: i64,
    head_dim: i64,
}

impl Layer {
    fn new(path: nn::Path, config: &Config) -> Self {
        let linear = |path: nn::Path, input: i64, output: i64| nn::linear(path, input, output, Default::default());
        let h = config.hidden_size;
        let attention = &path / "attention";
        Self {
            query: linear(&attention / "self" / "query", h, h),
            key: linear(&attention / "self" / "key", h, h),
            value: linear(&attention / "self" / "value", h, h),
            attention_output: linear(&attention / "output" / "dense", h, h),
            attention_norm: layer_norm(&attention / "output" / "LayerNorm", config),
            intermediate: linear(&path / "intermediate" / "dense", h, config.intermediate_size),
            output: linear(&path / "output" / "dense", config.intermediate_size, h),
            output_norm: layer_norm(&path / "output" / "LayerNorm", config),
            heads: config.num_attention_heads,
            head_dim: h / config.num_attention_heads,
        }
    }

    /// `mask_bias`: [batch, 1, 1, length], 0 where attended and a large negative
    /// where padded; None when nothing is padded (lets libtorch pick its fastest kernel).
    fn forward(&self, hidden: &Tensor, mask_bias: Option<&Tensor>) -> Tensor {
        let (batch, length, _) = hidden.size3().expect("hidden is [batch, length, hidden]");
        let split = |t: Tensor| t.view([batch, length, self.heads, self.head_dim]).transpose(1, 2);
        let q = split(self.query.forward(hidden));
        let k = split(self.key.forward(hidden));
        let v = split(self.value.forward(hidden));
        // libtorch's fused attention (the kernel sentence-transformers uses too); the
        // additive mask keeps padding out.
        let context = Tensor::scaled_dot_product_attention(&q, &k, &v, mask_bias, 0.0, false, None, false)
            .transpose(1, 2)
            .contiguous()
            .view([batch, length, self.heads * self.head_dim]);
        let attended = self.attention_norm.forward(&(self.attention_output.forward(&context) + hidden));
        let intermediate = self.intermediate.forward(&attended).gelu("none");
        self.output_norm.forward(&(self.output.forward(&intermediate) + attended))
    }
}

/// BERT without its pooler (sentence embeddings pool the token states themselves).
pub struct BertModel {
    embeddings: Embeddings,
    layers: Vec<Layer>,
}

impl BertModel {
    pub fn new(path: nn::Path, config: &Config) -> Self {
        let embeddings = Embeddings::new(&path / "embeddings", config);
        let layers =
            (0..config.num_hidden_layers).map(|i| Layer::new(&path / "encoder" / "layer" / i, config)).collect();
        Self { embeddings, layers }
    }

    /// Token states [batch, length, hidden] for `input_ids` and `attention_mask` ([batch, length], 1 = token).
    pub fn forward(&self, input_ids: &Tensor, attention_mask: &Tensor) -> Tensor {
        let padded = attention_mask.min().int64_value(&[]) == 0;
        let mask_bias: Option<Tensor> =
            padded.then(|| (attention_mask.to_kind(Kind::Float) - 1.0).unsqueeze(1).unsqueeze(1) * 1e9);
        let mut hidden = self.embeddings.forward(input_ids);
        for layer in &self.layers {
            hidden = layer.forward(&hidden, mask_bias.as_ref());
        }
        hidden
    }
}

/// Mean of the token states over real tokens, L2-normalised (sentence-transformers' pooling).
pub fn mean_pool_normalized(hidden: &Tensor, attention_mask: &Tensor) -> Tensor {
    let mask = attention_mask.to_kind(Kind::Float).unsqueeze(-1);
    let summed = (hidden * &mask).sum_dim_intlist(1, false, Kind::Float);
    let counts = mask.sum_dim_intlist(1, false, Kind::Float).clamp_min(1e-9);
    let mean = summed / counts;
    let norm = mean.norm_scalaropt_dim(2, [1], true).clamp_min(1e-12);
    mean / norm
}
