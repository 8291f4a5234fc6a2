//! The decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU,
//! and the model with its KV cache.

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

use crate::config::Config;

/// `x / rms(x) * weight`, computed in f32 whatever the model dtype (as HF does).
#[derive(Debug)]
struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn new(path: nn::Path, size: i64, eps: f64) -> Self {
        Self { weight: path.ones("weight", &[size]), eps }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let x = x.to_kind(Kind::Float);
        let variance = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = x * (variance + self.eps).rsqrt();
        &self.weight * normed.to_kind(kind)
    }
}

/// Rotary position embeddings in HF's "rotate half" layout.
#[derive(Debug)]
struct Rope {
    inv_freq: Tensor,
}

impl Rope {
    fn new(config: &Config, device: Device) -> Self {
        let dim = config.head_dim();
        let exponents = Tensor::arange_start_step(0, dim, 2, (Kind::Float, device)) / dim as f64;
        let inv_freq = Tensor::from(config.rope_theta()).to_device(device).pow(&exponents).reciprocal();
        Self { inv_freq }
    }

    /// cos and sin for absolute positions `start..start + length`, shaped [1, 1, length, head_dim].
    fn cos_sin(&self, start: i64, length: i64, kind: Kind) -> (Tensor, Tensor) {
        let positions = Tensor::arange_start(start, start + length, (Kind::Float, self.inv_freq.device()));
        let freqs = positions.unsqueeze(1) * self.inv_freq.unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], -1).unsqueeze(0).unsqueeze(0);
        (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
    }

    /// cos and sin for one new token per row at `positions` ([rows]), shaped [rows, 1, 1, head_dim].
    fn cos_sin_at(&self, positions: &Tensor, kind: Kind) -> (Tensor, Tensor) {
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
struct Attention {
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
struct Mlp {
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
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn new(path: nn::Path, config: &Config) -> Self {
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

    fn forward(&self, x: &Tensor, rope: (&Tensor, &Tensor), cache: KvWrite<'_>, attend: Attend<'_>) -> Tensor {
        let x = x + self.self_attn.forward(&self.input_layernorm.forward(x), rope, cache, attend);
        &x + self.mlp.forward(&self.post_attention_layernorm.forward(&x))
    }
}

/// Keys and values of one layer for the positions seen so far: [batch, kv_heads, positions, head_dim].
#[derive(Debug, Default)]
struct LayerCache {
    kv: Option<(Tensor, Tensor)>,
}

impl LayerCache {
    fn append(&mut self, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        let (k, v) = match self.kv.take() {
            Some((past_k, past_v)) => (Tensor::cat(&[past_k, k], 2), Tensor::cat(&[past_v, v], 2)),
            None => (k, v),
        };
        self.kv = Some((k.shallow_clone(), v.shallow_clone()));
        (k, v)
    }
}

/// Which keys each query attends to. Passing no mask where none is needed
/// lets libtorch use its fastest attention kernels.
#[derive(Clone, Copy)]
enum Attend<'a> {
    /// Query i sees keys 0..=i (a whole sequence, nothing cached).
    Causal,
    /// An additive mask [batch or 1, 1, queries, keys].
    Masked(&'a Tensor),
    /// One new token per row over its cache: every key, or those an additive
    /// mask [batch, 1, 1, keys] allows.
    OneQuery(Option<&'a Tensor>),
}

impl<'a> Attend<'a> {
    fn causal_unless(mask: Option<&'a Tensor>) -> Self {
        mask.map_or(Attend::Causal, Attend::Masked)
    }
}

/// Where a layer's new keys and values go.
enum KvWrite<'a> {
    /// Nowhere: a whole sequence in one pass.
    None,
    /// Appended to one cache shared by the batch.
    Append(&'a mut LayerCache),
    /// One new position per row, written at each row's own length.
    Rows(&'a mut RowLayer, &'a [i64]),
}

/// One layer of a [`BatchCache`]: [slots, kv_heads, capacity, head_dim] each.
#[derive(Debug)]
struct RowLayer {
    k: Tensor,
    v: Tensor,
}

impl RowLayer {
    /// Writes one new key/value per active row at its length and returns the
    /// active rows' keys and values up to the longest row.
    fn write(&mut self, k: Tensor, v: Tensor, lengths: &[i64]) -> (Tensor, Tensor) {
        // One scatter per tensor: row r's new position goes to index lengths[r].
        let device = self.k.device();
        let rows = Tensor::arange(lengths.len() as i64, (Kind::Int64, device));
        let positions = Tensor::from_slice(lengths).to_device(device);
        let index = [Some(rows), None, Some(positions)];
        let _ = self.k.index_put_(&index, &k.squeeze_dim(2), false);
        let _ = self.v.index_put_(&index, &v.squeeze_dim(2), false);
        let active = lengths.len() as i64;
        let keys = lengths.iter().max().map_or(0, |l| l + 1);
        (self.k.narrow(0, 0, active).narrow(2, 0, keys), self.v.narrow(0, 0, active).narrow(2, 0, keys))
    }
}

/// KV cache for continuous batching: up to `slots` sequences, each in its own
/// row with its own length, decoded one token per step together. Active
/// sequences occupy rows `0..active()`; removing one moves the last row into
/// its place, so a step never copies the cache.
#[derive(Debug)]
pub struct BatchCache {
    layers: Vec<RowLayer>,
    lengths: Vec<i64>,
    slots: i64,
    capacity: i64,
}

/// Capacity grows in steps of this many positions (reallocating all rows).
const CAPACITY_STEP: i64 = 256;

impl BatchCache {
    pub fn new(config: &Config, slots: usize, kind: Kind, device: Device) -> Self {
        let slots = slots as i64;
        let shape = [slots, config.kv_heads(), CAPACITY_STEP, config.head_dim()];
        let layers = (0..config.num_hidden_layers)
            .map(|_| RowLayer { k: Tensor::zeros(shape, (kind, device)), v: Tensor::zeros(shape, (kind, device)) })
            .collect();
        Self { layers, lengths: Vec::new(), slots, capacity: CAPACITY_STEP }
    }

    /// Sequences in the batch.
    pub fn active(&self) -> usize {
        self.lengths.len()
    }

    pub fn slots(&self) -> usize {
        self.slots as usize
    }

    /// Cached positions of each active row.
    pub fn lengths(&self) -> &[i64] {
        &self.lengths
    }

    /// Makes room for `positions` per row.
    fn reserve(&mut self, positions: i64) {
        if positions <= self.capacity {
            return;
        }
        let capacity = (positions + CAPACITY_STEP - 1) / CAPACITY_STEP * CAPACITY_STEP;
        for layer in &mut self.layers {
            let grow = |t: &Tensor| {
                let mut size = t.size();
                size[2] = capacity - size[2];
                Tensor::cat(&[t, &Tensor::zeros(size.as_slice(), (t.kind(), t.device()))], 2)
            };
            layer.k = grow(&layer.k);
            layer.v = grow(&layer.v);
        }
        self.capacity = capacity;
    }

    /// Adds a prefilled sequence (a one-row [`KvCache`]) as the last active row; returns its row.
    pub fn insert(&mut self, sequence: &KvCache) -> Result<usize, String> {
        if self.active() as i64 >= self.slots {
            return Err(format!("batch is full ({} sequences)", self.slots));
        }
        let row = self.active() as i64;
        self.reserve(sequence.length + 1);
        for (layer, cached) in self.layers.iter_mut().zip(&sequence.layers) {
            if let Some((k, v)) = &cached.kv {
                layer.k.get(row).narrow(1, 0, sequence.length).copy_(&k.get(0));
                layer.v.get(row).narrow(1, 0, sequence.length).copy_(&v.get(0));
            }
        }
        self.lengths.push(sequence.length);
        Ok(row as usize)
    }

    /// A copy of `row`'s keys and values as a one-sequence cache, to keep
    /// after the sequence leaves the batch (prefix reuse).
    pub fn extract(&self, row: usize) -> KvCache {
        let length = self.lengths[row];
        let layers = self
            .layers
            .iter()
            .map(|layer| LayerCache {
                kv: Some((
                    layer.k.get(row as i64).narrow(1, 0, length).unsqueeze(0).copy(),
                    layer.v.get(row as i64).narrow(1, 0, length).unsqueeze(0).copy(),
                )),
            })
            .collect();
        KvCache { layers, length }
    }

    /// Removes `row`, moving the last active row into its place (the caller
    /// renumbers that sequence to `row`).
    pub fn remove(&mut self, row: usize) {
        let last = self.active() - 1;
        if row != last {
            let length = self.lengths[last];
            for layer in &mut self.layers {
                let moved_k = layer.k.get(last as i64).narrow(1, 0, length).copy();
                let moved_v = layer.v.get(last as i64).narrow(1, 0, length).copy();
                layer.k.get(row as i64).narrow(1, 0, length).copy_(&moved_k);
                layer.v.get(row as i64).narrow(1, 0, length).copy_(&moved_v);
            }
            self.lengths[row] = length;
        }
        self.lengths.pop();
    }
}

/// The KV cache of a batch of sequences decoded together.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    length: i64,
}

impl KvCache {
    pub fn new(config: &Config) -> Self {
        Self { layers: (0..config.num_hidden_layers).map(|_| LayerCache::default()).collect(), length: 0 }
    }

    /// Positions cached so far.
    pub fn len(&self) -> i64 {
        self.length
    }

    pub fn is_empty(&self) -> bool {
        self.length == 0
    }

    /// Row `row` of a batched prefill, as a one-sequence cache of its first `length` positions.
    pub fn row(&self, row: usize, length: i64) -> KvCache {
        let layers = self
            .layers
            .iter()
            .map(|layer| LayerCache {
                kv: layer.kv.as_ref().map(|(k, v)| {
                    (
                        k.narrow(0, row as i64, 1).narrow(2, 0, length).copy(),
                        v.narrow(0, row as i64, 1).narrow(2, 0, length).copy(),
                    )
                }),
            })
            .collect();
        KvCache { layers, length }
    }

    /// Keeps only the first `length` positions (a shorter shared prefix).
    pub fn truncate(&mut self, length: i64) {
        if length >= self.length {
            return;
        }
        for layer in &mut self.layers {
            if let Some((k, v)) = layer.kv.take() {
                layer.kv = Some((k.narrow(2, 0, length), v.narrow(2, 0, length)));
            }
        }
        self.length = length;
    }
}

/// A decoder-only language model.
#[derive(Debug)]
pub struct Model {
    embed_tokens: nn::Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// None when the output projection is tied to the token embeddings.
    lm_head: Option<nn::Linear>,
    rope: Rope,
    pub config: Config,
}

impl Model {
    /// Declares the parameters under `root` with the HF names (`model.*`, `lm_head`).
    pub fn new(root: &nn::Path, config: &Config) -> Self {
        let model = root / "model";
        let embed_tokens =
            nn::embedding(&model / "embed_tokens", config.vocab_size, config.hidden_size, Default::default());
        let layers = (0..config.num_hidden_layers).map(|i| DecoderLayer::new(&model / "layers" / i, config)).collect();
        let norm = RmsNorm::new(&model / "norm", config.hidden_size, config.rms_norm_eps);
        let lm_head = (!config.tie_word_embeddings).then(|| {
            nn::linear(
                root / "lm_head",
                config.hidden_size,
                config.vocab_size,
                nn::LinearConfig { bias: false, ..Default::default() },
            )
        });
        let rope = Rope::new(config, root.device());
        Self { embed_tokens, layers, norm, lm_head, rope, config: config.clone() }
    }

    fn logits(&self, hidden: &Tensor) -> Tensor {
        self.project(&self.norm.forward(hidden))
    }

    /// The output projection of final (normed) hidden states [..., hidden] to logits [..., vocab].
    pub fn project(&self, hidden: &Tensor) -> Tensor {
        match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => hidden.matmul(&self.embed_tokens.ws.tr()),
        }
    }

    /// Logits [batch, length, vocab] for whole sequences (training, scoring).
    /// `attention_mask` ([batch, length], 1 = token, 0 = right padding) keeps
    /// padding out of every real token's attention.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Tensor {
        self.project(&self.hidden_states(input_ids, attention_mask))
    }

    /// Final normed hidden states [batch, length, hidden], before the output
    /// projection: training projects only the positions it scores (a
    /// [length, vocab] logits tensor dominates the memory of a long trace).
    pub fn hidden_states(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Tensor {
        let mask = attention_mask.map(|padding| self.padding_mask(padding));
        let rope = self.rope.cos_sin(0, input_ids.size()[1], self.kind());
        let mut hidden = self.embed_tokens.forward(input_ids);
        for layer in &self.layers {
            hidden = layer.forward(&hidden, (&rope.0, &rope.1), KvWrite::None, Attend::causal_unless(mask.as_ref()));
        }
        self.norm.forward(&hidden)
    }

    /// Prefills right-padded prompts together ([batch, length], `lengths[row]`
    /// real tokens each) and returns the logits of each row's last real token
    /// ([batch, vocab]) and a cache holding every row (see [`KvCache::row`]).
    /// Only the rows' last positions go through the output projection: a long
    /// prompt never materialises [length, vocab] logits.
    pub fn prefill(&self, input_ids: &Tensor, lengths: &[i64]) -> (Tensor, KvCache) {
        let (batch, length) = input_ids.size2().expect("[batch, length]");
        let device = input_ids.device();
        let real = Tensor::arange(length, (Kind::Int64, device))
            .unsqueeze(0)
            .lt_tensor(&Tensor::from_slice(lengths).to_device(device).unsqueeze(1));
        let padded = lengths.iter().any(|&l| l < length);
        let mask = padded.then(|| self.padding_mask(&real));
        let rope = self.rope.cos_sin(0, length, self.kind());
        let mut cache = KvCache::new(&self.config);
        let mut hidden = self.embed_tokens.forward(input_ids);
        for (layer, layer_cache) in self.layers.iter().zip(cache.layers.iter_mut()) {
            hidden = layer.forward(
                &hidden,
                (&rope.0, &rope.1),
                KvWrite::Append(layer_cache),
                Attend::causal_unless(mask.as_ref()),
            );
        }
        cache.length = length;
        let last = Tensor::from_slice(&lengths.iter().map(|l| l - 1).collect::<Vec<_>>()).to_device(device);
        let last_hidden = hidden.index_select(1, &last).diagonal(0, 0, 1).transpose(0, 1).reshape([batch, 1, -1]);
        (self.logits(&last_hidden).squeeze_dim(1), cache)
    }

    /// Causal attention over real tokens only, for right-padded batches.
    fn padding_mask(&self, real: &Tensor) -> Tensor {
        let length = real.size()[1];
        let causal = Tensor::ones([length, length], (Kind::Bool, real.device())).tril(0);
        let keys = real.to_kind(Kind::Bool).unsqueeze(1).unsqueeze(1);
        additive(&causal.unsqueeze(0).unsqueeze(0).logical_and(&keys), self.kind())
    }

    fn kind(&self) -> Kind {
        self.embed_tokens.ws.kind()
    }

    /// Logits of the last new token ([batch, vocab]) for `input_ids` continuing
    /// the sequences in `cache`; the others' logits are never computed.
    pub fn extend(&self, input_ids: &Tensor, cache: &mut KvCache) -> Tensor {
        let hidden = self.hidden_with_cache(input_ids, cache);
        self.logits(&hidden.narrow(1, hidden.size()[1] - 1, 1)).squeeze_dim(1)
    }

    /// Logits [batch, length, vocab] for `input_ids` continuing the sequences
    /// in `cache` (empty for a prompt), appending their keys and values.
    pub fn forward_with_cache(&self, input_ids: &Tensor, cache: &mut KvCache) -> Tensor {
        let hidden = self.hidden_with_cache(input_ids, cache);
        self.logits(&hidden)
    }

    fn hidden_with_cache(&self, input_ids: &Tensor, cache: &mut KvCache) -> Tensor {
        let length = input_ids.size()[1];
        let past = cache.length;
        let kind = self.embed_tokens.ws.kind();
        let rope = self.rope.cos_sin(past, length, kind);
        // New token i (absolute position past + i) sees keys 0..=past + i.
        let mask = (past > 0 && length > 1).then(|| {
            let device = input_ids.device();
            let keys = Tensor::arange(past + length, (Kind::Int64, device)).unsqueeze(0);
            let queries = Tensor::arange_start(past, past + length, (Kind::Int64, device)).unsqueeze(1);
            additive(&keys.le_tensor(&queries).unsqueeze(0).unsqueeze(0), kind)
        });
        let attend = match (past, length, &mask) {
            (0, _, _) => Attend::Causal,
            (_, 1, _) => Attend::OneQuery(None),
            (_, _, Some(mask)) => Attend::Masked(mask),
            (_, _, None) => unreachable!("a mask is built for several tokens over a cached prefix"),
        };
        let mut hidden = self.embed_tokens.forward(input_ids);
        for (layer, layer_cache) in self.layers.iter().zip(cache.layers.iter_mut()) {
            hidden = layer.forward(&hidden, (&rope.0, &rope.1), KvWrite::Append(layer_cache), attend);
        }
        cache.length += length;
        hidden
    }
}

impl Model {
    /// One decoding step for every active sequence of `cache`: `tokens[row]` is
    /// row `row`'s newest token. Returns logits [active, vocab] and advances
    /// each row by one position.
    pub fn decode_step(&self, tokens: &[i64], cache: &mut BatchCache) -> Tensor {
        assert_eq!(tokens.len(), cache.active(), "one token per active sequence");
        let device = self.embed_tokens.ws.device();
        let kind = self.embed_tokens.ws.kind();
        let lengths = cache.lengths.clone();
        let longest = lengths.iter().copied().max().unwrap_or(0);
        cache.reserve(longest + 1);
        let positions = Tensor::from_slice(&lengths).to_device(device);
        let (cos, sin) = self.rope.cos_sin_at(&positions, kind);
        // Row r sees its own positions 0..=lengths[r] and none of the padding beyond.
        let keys = Tensor::arange(longest + 1, (Kind::Int64, device)).unsqueeze(0);
        let mask = additive(&keys.le_tensor(&positions.unsqueeze(1)).unsqueeze(1).unsqueeze(1), kind);
        let input = Tensor::from_slice(tokens).to_device(device).unsqueeze(1);
        let mut hidden = self.embed_tokens.forward(&input);
        for (layer, rows) in self.layers.iter().zip(cache.layers.iter_mut()) {
            hidden = layer.forward(&hidden, (&cos, &sin), KvWrite::Rows(rows, &lengths), Attend::OneQuery(Some(&mask)));
        }
        for length in &mut cache.lengths {
            *length += 1;
        }
        self.logits(&hidden).squeeze_dim(1)
    }
}

/// A boolean "may attend" mask as an additive mask of the model's dtype.
fn additive(allowed: &Tensor, kind: Kind) -> Tensor {
    let zeros = Tensor::zeros(allowed.size(), (kind, allowed.device()));
    zeros.masked_fill(&allowed.logical_not(), f64::NEG_INFINITY)
}
