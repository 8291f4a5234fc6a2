//! Key/value caches: one shared by a batch decoded together ([`KvCache`]),
//! and one row per sequence for continuous batching ([`BatchCache`]).

use tch::{Device, Kind, Tensor};

use crate::config::Config;

/// Keys and values of one layer for the positions seen so far: [batch, kv_heads, positions, head_dim].
#[derive(Debug, Default)]
pub(crate) struct LayerCache {
    kv: Option<(Tensor, Tensor)>,
}

impl LayerCache {
    pub(crate) fn append(&mut self, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        let (k, v) = match self.kv.take() {
            Some((past_k, past_v)) => (Tensor::cat(&[past_k, k], 2), Tensor::cat(&[past_v, v], 2)),
            None => (k, v),
        };
        self.kv = Some((k.shallow_clone(), v.shallow_clone()));
        (k, v)
    }
}

/// Where a layer's new keys and values go.
pub(crate) enum KvWrite<'a> {
    /// Nowhere: a whole sequence in one pass.
    None,
    /// Appended to one cache shared by the batch.
    Append(&'a mut LayerCache),
    /// One new position per row, written at each row's own length.
    Rows(&'a mut RowLayer, &'a [i64]),
}

/// One layer of a [`BatchCache`]: [slots, kv_heads, capacity, head_dim] each.
#[derive(Debug)]
pub(crate) struct RowLayer {
    k: Tensor,
    v: Tensor,
}

impl RowLayer {
    /// Writes one new key/value per active row at its length and returns the
    /// active rows' keys and values up to the longest row.
    pub(crate) fn write(&mut self, k: Tensor, v: Tensor, lengths: &[i64]) -> (Tensor, Tensor) {
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
    pub(crate) layers: Vec<RowLayer>,
    pub(crate) lengths: Vec<i64>,
    slots: i64,
    capacity: i64,
}

/// Capacity grows in steps of this many positions (reallocating all rows).
const CAPACITY_STEP: i64 = 256;

impl BatchCache {
    /// An empty batch of `slots` rows, each with room for one capacity step of positions to
    /// start (it grows a step at a time).
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

    /// Rows the batch holds at most.
    pub fn slots(&self) -> usize {
        self.slots as usize
    }

    /// Cached positions of each active row.
    pub fn lengths(&self) -> &[i64] {
        &self.lengths
    }

    /// Makes room for `positions` per row.
    pub(crate) fn reserve(&mut self, positions: i64) {
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
    pub(crate) layers: Vec<LayerCache>,
    pub(crate) length: i64,
}

impl KvCache {
    /// An empty cache, one (empty) entry per layer of `config`.
    pub fn new(config: &Config) -> Self {
        Self { layers: (0..config.num_hidden_layers).map(|_| LayerCache::default()).collect(), length: 0 }
    }

    /// Positions cached so far.
    pub fn len(&self) -> i64 {
        self.length
    }

    /// Whether nothing is cached yet.
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
