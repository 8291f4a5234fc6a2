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

impl Layout {
    /// `rank`'s slice of a flattened full-model tensor.
    pub fn slice_tensor(&self, full: &Tensor, rank: usize) -> Tensor {
        let parts: Vec<Tensor> = self
            .entries
            .iter()
            .map(|e| {
                let owned = self.owned(e, rank);
                full.narrow(0, (e.offset + owned.start) as i64, owned.len() as i64)
            })
            .collect();
        Tensor::cat(&parts, 0)
    }
}

/// The whole model flattened to one f32 tensor, in layout order.
pub fn flatten(vars: &VarStore, layout: &Layout) -> Tensor {
    let variables = vars.variables();
    let parts: Vec<Tensor> =
        layout.entries.iter().map(|e| variables[&e.name].detach().to_kind(Kind::Float).flatten(0, -1)).collect();
    Tensor::cat(&parts, 0)
}

/// Writes a flattened full model into the variables.
pub fn unflatten(vars: &VarStore, layout: &Layout, full: &Tensor) {
    let mut variables = vars.variables();
    tch::no_grad(|| {
        for entry in &layout.entries {
            let values = full.narrow(0, entry.offset as i64, entry.numel as i64).view(entry.shape.as_slice());
            let var = variables.get_mut(&entry.name).expect("layout built from these variables");
            var.copy_(&values.to_kind(var.kind()).to_device(var.device()));
        }
    });
}

/// Adds the variables' gradients into `accumulator` (f64, layout order) and clears them.
pub fn accumulate_grads(vars: &VarStore, layout: &Layout, accumulator: &mut Tensor) {
    let variables = vars.variables();
    tch::no_grad(|| {
        for entry in &layout.entries {
            let var = &variables[&entry.name];
            let grad = var.grad();
            if grad.defined() {
                let _ = accumulator
                    .narrow(0, entry.offset as i64, entry.numel as i64)
                    .g_add_(&grad.flatten(0, -1).to_kind(Kind::Double));
            }
        }
    });
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

/// This rank's slice of the parameters and its optimizer state (1-D f32
/// tensors on the training device).
#[derive(Debug)]
pub struct Shard {
    pub params: Tensor,
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    /// Optimizer steps taken.
    pub step: u64,
}

impl Shard {
    pub fn new(params: Tensor) -> Self {
        Self { exp_avg: params.zeros_like(), exp_avg_sq: params.zeros_like(), params, step: 0 }
    }

    pub fn len(&self) -> usize {
        self.params.numel()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of optimizer state this rank holds.
    pub fn optimizer_bytes(&self) -> usize {
        (self.exp_avg.numel() + self.exp_avg_sq.numel()) * self.exp_avg.kind().elt_size_in_bytes()
    }

    /// One AdamW step on `grad` (f64) times `scale`, as torch.optim.AdamW
    /// computes it (decoupled weight decay, bias correction, f32 state).
    /// Element-wise only, so every rank computes its slice exactly as a
    /// single rank would.
    pub fn adamw(&mut self, grad: &Tensor, scale: f64, hp: &AdamW) {
        self.step += 1;
        let t = self.step as i32;
        let (c1, c2) = (1.0 - hp.beta1.powi(t), 1.0 - hp.beta2.powi(t));
        // In place, two temporaries: this runs over every parameter each step.
        tch::no_grad(|| {
            let mut g = grad.to_kind(Kind::Float);
            if scale != 1.0 {
                let _ = g.g_mul_scalar_(scale);
            }
            if hp.weight_decay != 0.0 {
                let _ = self.params.g_mul_scalar_(1.0 - hp.lr * hp.weight_decay);
            }
            // m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
            let _ = self.exp_avg.lerp_(&g, 1.0 - hp.beta1);
            let _ = g.square_();
            let _ = self.exp_avg_sq.lerp_(&g, 1.0 - hp.beta2);
            // p -= lr / c1 * m / (sqrt(v) / sqrt(c2) + eps)
            let mut step = self.exp_avg_sq.sqrt();
            let _ = step.g_div_scalar_(c2.sqrt());
            let _ = step.g_add_scalar_(hp.eps);
            let _ = step.reciprocal_();
            let _ = step.g_mul_(&self.exp_avg);
            let _ = step.g_mul_scalar_(-hp.lr / c1);
            let _ = self.params.g_add_(&step);
        });
    }
}

fn to_vec<T: tch::kind::Element>(tensor: &Tensor) -> Vec<T> {
    let cpu = tensor.to_device(tch::Device::Cpu).to_kind(T::KIND).contiguous();
    let n = cpu.numel();
    let mut out = vec![T::ZERO; n];
    cpu.copy_data(&mut out, n);
    out
}

/// Every rank's shard gathered into the full flattened model.
pub fn all_gather_params(
    collective: &mut dyn Collective,
    layout: &Layout,
    shard: &Tensor,
) -> Result<Tensor, CollectiveError> {
    if collective.world() == 1 {
        return Ok(shard.shallow_clone());
    }
    let parts = collective.all_gather(f32_bytes(&to_vec::<f32>(shard)))?;
    let mut full = vec![0f32; layout.total];
    for (rank, bytes) in parts.iter().enumerate() {
        let values: Vec<f32> = bytes_f32(bytes).collect();
        layout.place(&values, rank, &mut full);
    }
    Ok(Tensor::from_slice(&full).to_device(shard.device()))
}

/// The sum over ranks of `full` (each rank's accumulated f64 gradient), sliced to this rank.
pub fn reduce_scatter_grads(
    collective: &mut dyn Collective,
    layout: &Layout,
    full: Tensor,
) -> Result<Tensor, CollectiveError> {
    if collective.world() == 1 {
        return Ok(full);
    }
    let rank = collective.rank();
    // Each rank sends its whole gradient; the hub backend keeps it simple
    // (a ring backend would send each slice once).
    let parts = collective.all_gather(f64_bytes(&to_vec::<f64>(&full)))?;
    let mut sum = vec![0f64; layout.shard_len(rank)];
    for bytes in &parts {
        let values: Vec<f64> = bytes_f64(bytes).collect();
        for (s, v) in sum.iter_mut().zip(layout.slice(&values, rank)) {
            *s += v;
        }
    }
    Ok(Tensor::from_slice(&sum).to_device(full.device()))
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
        let mut shard = Shard::new(Tensor::from_slice(&[1.0f32, -2.0]));
        let hp = AdamW { lr: 0.1, weight_decay: 0.01, ..AdamW::default() };
        shard.adamw(&Tensor::from_slice(&[0.5f64, -3.0]), 1.0, &hp);
        // p * (1 - lr * wd) - lr * sign(g)
        let params = to_vec::<f32>(&shard.params);
        assert!((params[0] - (1.0 * 0.999 - 0.1) as f32).abs() < 1e-6);
        assert!((params[1] - (-2.0 * 0.999 + 0.1) as f32).abs() < 1e-6);
    }
}
