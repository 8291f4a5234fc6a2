//! The model: token embeddings, the decoder layers and the output
//! projection, run over whole sequences (training) or over a KV cache
//! (inference).

use tch::nn::{self, Module};
use tch::{Kind, Tensor};

use crate::cache::{BatchCache, KvCache, KvWrite};
use crate::config::Config;
use crate::layers::{Attend, DecoderLayer, RmsNorm, Rope};

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
