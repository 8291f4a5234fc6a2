//! FSDP-style sharding: each rank owns 1/N of every parameter (a contiguous
//! slice of its flattened elements), plus the gradient and AdamW state of
//! that slice. Before the forward pass the shards are all-gathered into the
//! full model; after the backward pass the gradients are reduce-scattered so
//! each rank updates only its slice.
//!
//! Parameters are gathered for the whole model at once (so they are held in
//! full during the step, as ZeRO-2 does; gathering layer by layer would need
//! forward hooks in the model crate). Gradients are accumulated in f64 so
//! the sum does not depend on how micro-batches are split across ranks.

use std::ops::Range;

use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::collective::{Collective, CollectiveError, bytes_f32, bytes_f64, f32_bytes, f64_bytes};

/// One parameter's place in the flattened model.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub shape: Vec<i64>,
    pub numel: usize,
    /// Offset of the parameter in the flattened full model.
    pub offset: usize,
}

/// Which elements of every parameter each rank owns.
#[derive(Debug, Clone)]
pub struct Layout {
    pub entries: Vec<Entry>,
    pub world: usize,
    pub total: usize,
}

impl Layout {
    /// Parameters in name order (the same on every rank).
    pub fn new(vars: &VarStore, world: usize) -> Self {
        let mut named: Vec<(String, Tensor)> = vars.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let mut offset = 0;
        let entries = named
            .into_iter()
            .map(|(name, tensor)| {
                let numel = tensor.numel();
                let entry = Entry { name, shape: tensor.size(), numel, offset };
                offset += numel;
                entry
            })
            .collect();
        Self { entries, world, total: offset }
    }

    /// The elements of `entry` that `rank` owns.
    pub fn owned(&self, entry: &Entry, rank: usize) -> Range<usize> {
        let chunk = entry.numel.div_ceil(self.world);
        let start = (rank * chunk).min(entry.numel);
        start..((rank + 1) * chunk).min(entry.numel)
    }

    pub fn shard_len(&self, rank: usize) -> usize {
        self.entries.iter().map(|e| self.owned(e, rank).len()).sum()
    }

    /// `rank`'s slice of a flattened full-model vector.
    pub fn slice<T: Copy>(&self, full: &[T], rank: usize) -> Vec<T> {
        let mut shard = Vec::with_capacity(self.shard_len(rank));
        for entry in &self.entries {
            let owned = self.owned(entry, rank);
            shard.extend_from_slice(&full[entry.offset + owned.start..entry.offset + owned.end]);
        }
        shard
    }

    /// Writes `rank`'s `shard` into its places in a flattened full-model vector.
    pub fn place<T: Copy>(&self, shard: &[T], rank: usize, full: &mut [T]) {
        let mut at = 0;
        for entry in &self.entries {
            let owned = self.owned(entry, rank);
            full[entry.offset + owned.start..entry.offset + owned.end].copy_from_slice(&shard[at..at + owned.len()]);
            at += owned.len();
        }
    }
}

/// The whole model flattened to f32, in layout order.
pub fn flatten(vars: &VarStore, layout: &Layout) -> Vec<f32> {
    let variables = vars.variables();
    let mut full = Vec::with_capacity(layout.total);
    for entry in &layout.entries {
        let tensor = variables[&entry.name].to_kind(Kind::Float).flatten(0, -1);
        full.extend(Vec::<f32>::try_from(&tensor).expect("f32 parameter"));
    }
    full
}

/// Writes a flattened full model into the variables.
pub fn unflatten(vars: &VarStore, layout: &Layout, full: &[f32]) {
    let mut variables = vars.variables();
    tch::no_grad(|| {
        for entry in &layout.entries {
            let values =
                Tensor::from_slice(&full[entry.offset..entry.offset + entry.numel]).view(entry.shape.as_slice());
            let var = variables.get_mut(&entry.name).expect("layout built from these variables");
            var.copy_(&values.to_kind(var.kind()).to_device(var.device()));
        }
    });
}

/// Adds the variables' gradients into `accumulator` (f64, layout order) and clears them.
pub fn accumulate_grads(vars: &VarStore, layout: &Layout, accumulator: &mut [f64]) {
    let variables = vars.variables();
    for entry in &layout.entries {
        let var = &variables[&entry.name];
        let grad = var.grad();
        if !grad.defined() {
            continue;
        }
        let grad = Vec::<f32>::try_from(&grad.to_kind(Kind::Float).flatten(0, -1)).expect("f32 gradient");
        for (sum, g) in accumulator[entry.offset..entry.offset + entry.numel].iter_mut().zip(grad) {
            *sum += f64::from(g);
        }
    }
    for (_, mut var) in variables {
        var.zero_grad();
    }
}

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        Self { lr: 1e-6, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

/// This rank's slice of the parameters and its optimizer state.
#[derive(Debug, Clone, PartialEq)]
pub struct Shard {
    pub params: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
    /// Optimizer steps taken.
    pub step: u64,
}

impl Shard {
    pub fn new(params: Vec<f32>) -> Self {
        let n = params.len();
        Self { params, exp_avg: vec![0.0; n], exp_avg_sq: vec![0.0; n], step: 0 }
    }

    /// Bytes of optimizer state this rank holds.
    pub fn optimizer_bytes(&self) -> usize {
        (self.exp_avg.len() + self.exp_avg_sq.len()) * std::mem::size_of::<f32>()
    }

    /// One AdamW step (decoupled weight decay, bias-corrected, as torch.optim.AdamW).
    pub fn adamw(&mut self, grad: &[f64], scale: f64, hp: &AdamW) {
        self.step += 1;
        let t = self.step as i32;
        let (c1, c2) = (1.0 - hp.beta1.powi(t), 1.0 - hp.beta2.powi(t));
        for (i, &g) in grad.iter().enumerate().take(self.params.len()) {
            let g = g * scale;
            let p = f64::from(self.params[i]) * (1.0 - hp.lr * hp.weight_decay);
            let m = hp.beta1 * f64::from(self.exp_avg[i]) + (1.0 - hp.beta1) * g;
            let v = hp.beta2 * f64::from(self.exp_avg_sq[i]) + (1.0 - hp.beta2) * g * g;
            self.exp_avg[i] = m as f32;
            self.exp_avg_sq[i] = v as f32;
            let update = (m / c1) / ((v / c2).sqrt() + hp.eps);
            self.params[i] = (p - hp.lr * update) as f32;
        }
    }
}

/// Every rank's shard gathered into the full flattened model.
pub fn all_gather_params(
    collective: &mut dyn Collective,
    layout: &Layout,
    shard: &[f32],
) -> Result<Vec<f32>, CollectiveError> {
    let parts = collective.all_gather(f32_bytes(shard))?;
    let mut full = vec![0f32; layout.total];
    for (rank, bytes) in parts.iter().enumerate() {
        let values: Vec<f32> = bytes_f32(bytes).collect();
        layout.place(&values, rank, &mut full);
    }
    Ok(full)
}

/// The sum over ranks of `full` (each rank's accumulated gradient), sliced to this rank.
pub fn reduce_scatter_grads(
    collective: &mut dyn Collective,
    layout: &Layout,
    full: &[f64],
) -> Result<Vec<f64>, CollectiveError> {
    let rank = collective.rank();
    // Each rank sends every other rank's slice; all_gather keeps it simple
    // on the hub backend (a ring backend would send each slice once).
    let parts = collective.all_gather(f64_bytes(full))?;
    let mut sum = vec![0f64; layout.shard_len(rank)];
    for bytes in &parts {
        let values: Vec<f64> = bytes_f64(bytes).collect();
        for (s, v) in sum.iter_mut().zip(layout.slice(&values, rank)) {
            *s += v;
        }
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_element_once() {
        let vars = VarStore::new(tch::Device::Cpu);
        let root = vars.root();
        let _a = root.zeros("a", &[7]);
        let _b = root.zeros("b", &[2, 3]);
        for world in 1..=4 {
            let layout = Layout::new(&vars, world);
            let full: Vec<u32> = (0..layout.total as u32).collect();
            let mut rebuilt = vec![u32::MAX; layout.total];
            for rank in 0..world {
                layout.place(&layout.slice(&full, rank), rank, &mut rebuilt);
            }
            assert_eq!(rebuilt, full, "world {world}");
            let lens: usize = (0..world).map(|r| layout.shard_len(r)).sum();
            assert_eq!(lens, layout.total);
        }
    }

    #[test]
    fn adamw_matches_torch_first_step() {
        // First step: m = 0.1 g, v = 0.001 g^2, bias-corrected update = sign(g) (eps aside).
        let mut shard = Shard::new(vec![1.0, -2.0]);
        let hp = AdamW { lr: 0.1, weight_decay: 0.01, ..AdamW::default() };
        shard.adamw(&[0.5, -3.0], 1.0, &hp);
        // p * (1 - lr * wd) - lr * sign(g)
        assert!((shard.params[0] - (1.0 * 0.999 - 0.1) as f32).abs() < 1e-6);
        assert!((shard.params[1] - (-2.0 * 0.999 + 0.1) as f32).abs() < 1e-6);
    }
}
