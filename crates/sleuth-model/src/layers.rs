//! The decoder's blocks: RMSNorm, rotary embeddings, grouped-query
//! attention, SwiGLU, and a decoder layer that chains them.

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

use crate::cache::KvWrite;
use crate::config::Config;

/// `x / rms(x) * weight`, computed in f32 whatever the model dtype (as HF does).
#[derive(Debug)]
pub(crate) struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub(crate) fn new(path: nn::Path, size: i64, eps: f64) -> Self {
        Self { weight: path.ones("weight", &[size]), eps }
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let x = x.to_kind(Kind::Float);
        let variance = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = x * (variance + self.eps).rsqrt();
        &self.weight * normed.to_kind(kind)
    }
}

/// Rotary position embeddings in HF's "rotate half" layout.
#[derive(Debug)]
pub(crate) struct Rope {
    inv_freq: Tensor,
}

impl Rope {
    pub(crate) fn new(config: &Config, device: Device) -> Self {
        let dim = config.head_dim();
        let exponents = Tensor::arange_start_step(0, dim, 2, (Kind::Float, device)) / dim as f64;
        let inv_freq = Tensor::from(config.rope_theta()).to_device(device).pow(&exponents).reciprocal();
        Self { inv_freq }
    }

    /// cos and sin for absolute positions `start..start + length`, shaped [1, 1, length, head_dim].
    pub(crate) fn cos_sin(&self, start: i64, length: i64, kind: Kind) -> (Tensor, Tensor) {
        let positions = Tensor::arange_start(start, start + length, (Kind::Float, self.inv_freq.device()));
        let freqs = positions.unsqueeze(1) * self.inv_freq.unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], -1).unsqueeze(0).unsqueeze(0);
        (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
    }

    /// cos and sin for one new token per row at `positions` ([rows]), shaped [rows, 1, 1, head_dim].
    pub(crate) fn cos_sin_at(&self, positions: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let freqs = positions.to_kind(Kind::Float).unsqueeze(1) * self.inv_freq.unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], -1).unsqueeze(1).unsqueeze(1);
        (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
    }

    fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let half = x.size()[3] / 2;
        let rotated = Tensor::cat(&[&x.narrow(3, half, half).neg(), &x.narrow(3, 0, half)], 3);
        x * cos + rotated * sin
    }
}

#[derive(Debug)]
pub(crate) struct Attention {
    q_proj: nn::Linear,
    k_proj: nn::Linear,
    v_proj: nn::Linear,
    o_proj: nn::Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(path: nn::Path, config: &Config) -> Self {
        let (h, d) = (config.hidden_size, config.head_dim());
        let (heads, kv_heads) = (config.num_attention_heads, config.kv_heads());
        let linear = |name: &str, input: i64, output: i64, bias: bool| {
            nn::linear(&path / name, input, output, nn::LinearConfig { bias, ..Default::default() })
        };
        let norm = |name: &str| config.qk_norm().then(|| RmsNorm::new(&path / name, d, config.rms_norm_eps));
        Self {
            q_proj: linear("q_proj", h, heads * d, config.qkv_bias()),
            k_proj: linear("k_proj", h, kv_heads * d, config.qkv_bias()),
            v_proj: linear("v_proj", h, kv_heads * d, config.qkv_bias()),
            o_proj: linear("o_proj", heads * d, h, config.o_bias()),
            q_norm: norm("q_norm"),
            k_norm: norm("k_norm"),
            heads,
            kv_heads,
            head_dim: d,
        }
    }

    fn forward(&self, x: &Tensor, rope: (&Tensor, &Tensor), cache: KvWrite<'_>, attend: Attend<'_>) -> Tensor {
        let (batch, length, _) = x.size3().expect("[batch, length, hidden]");
        let heads = |t: Tensor, n: i64, norm: &Option<RmsNorm>| {
            let t = t.view([batch, length, n, self.head_dim]);
            let t = match norm {
                Some(norm) => norm.forward(&t),
                None => t,
            };
            t.transpose(1, 2)
        };
        let q = heads(self.q_proj.forward(x), self.heads, &self.q_norm);
        let k = heads(self.k_proj.forward(x), self.kv_heads, &self.k_norm);
        let v = heads(self.v_proj.forward(x), self.kv_heads, &None);
        let (cos, sin) = rope;
        let q = Rope::apply(&q, cos, sin);
        let k = Rope::apply(&k, cos, sin);
        let (k, v) = match cache {
            KvWrite::None => (k, v),
            KvWrite::Append(cache) => cache.append(k, v),
            KvWrite::Rows(rows, lengths) => rows.write(k, v, lengths),
        };
        let gqa = self.kv_heads != self.heads;
        let attended = match attend {
            Attend::Causal => Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, gqa),
            Attend::Masked(mask) => Tensor::scaled_dot_product_attention(&q, &k, &v, Some(mask), 0.0, false, None, gqa),
            Attend::OneQuery(mask) => self.attend_one_query(&q, &k, &v, mask),
        };
        self.o_proj.forward(&attended.transpose(1, 2).contiguous().view([batch, length, self.heads * self.head_dim]))
    }
}

impl Attention {
    /// Attention of one query per row over that row's keys, as two grouped
    /// matmuls: each kv head's queries ([groups, head_dim]) against its keys.
    /// libtorch's CPU attention kernels are slow for a single query: 10x
    /// slower than this in bf16 and no faster in f32 (measured, 2 cores, 32
    /// rows x 300 keys). The softmax runs in f32 whatever the model's dtype.
    fn attend_one_query(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Tensor {
        let (batch, _, _, _) = q.size4().expect("[batch, heads, 1, head_dim]");
        let groups = self.heads / self.kv_heads;
        let q = q.reshape([batch, self.kv_heads, groups, self.head_dim]) * (1.0 / (self.head_dim as f64).sqrt());
        let scores = q.matmul(&k.transpose(-1, -2));
        let scores = match mask {
            Some(mask) => scores + mask,
            None => scores,
        };
        let probs = scores.softmax(-1, Kind::Float).to_kind(v.kind());
        probs.matmul(v).reshape([batch, self.heads, 1, self.head_dim])
    }
}

#[derive(Debug)]
pub(crate) struct Mlp {
    gate_proj: nn::Linear,
    up_proj: nn::Linear,
    down_proj: nn::Linear,
}

impl Mlp {
    fn new(path: nn::Path, config: &Config) -> Self {
        let no_bias = nn::LinearConfig { bias: false, ..Default::default() };
        let (h, i) = (config.hidden_size, config.intermediate_size);
        Self {
            gate_proj: nn::linear(&path / "gate_proj", h, i, no_bias),
            up_proj: nn::linear(&path / "up_proj", h, i, no_bias),
            down_proj: nn::linear(&path / "down_proj", i, h, no_bias),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        self.down_proj.forward(&(self.gate_proj.forward(x).silu() * self.up_proj.forward(x)))
    }
}

#[derive(Debug)]
pub(crate) struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    pub(crate) fn new(path: nn::Path, config: &Config) -> Self {
        Self {
            input_layernorm: RmsNorm::new(&path / "input_layernorm", config.hidden_size, config.rms_norm_eps),
            self_attn: Attention::new(&path / "self_attn", config),
            post_attention_layernorm: RmsNorm::new(
                &path / "post_attention_layernorm",
                config.hidden_size,
                config.rms_norm_eps,
            ),
            mlp: Mlp::new(&path / "mlp", config),
        }
    }

    pub(crate) fn forward(
        &self,
        x: &Tensor,
        rope: (&Tensor, &Tensor),
        cache: KvWrite<'_>,
        attend: Attend<'_>,
    ) -> Tensor {
        let x = x + self.self_attn.forward(&self.input_layernorm.forward(x), rope, cache, attend);
        &x + self.mlp.forward(&self.post_attention_layernorm.forward(&x))
    }
}

/// Which keys each query attends to. Passing no mask where none is needed
/// lets libtorch use its fastest attention kernels.
#[derive(Clone, Copy)]
pub(crate) enum Attend<'a> {
    /// Query i sees keys 0..=i (a whole sequence, nothing cached).
    Causal,
    /// An additive mask [batch or 1, 1, queries, keys].
    Masked(&'a Tensor),
    /// One new token per row over its cache: every key, or those an additive
    /// mask [batch, 1, 1, keys] allows.
    OneQuery(Option<&'a Tensor>),
}

impl<'a> Attend<'a> {
    pub(crate) fn causal_unless(mask: Option<&'a Tensor>) -> Self {
        mask.map_or(Attend::Causal, Attend::Masked)
    }
}
