//! FSDP-style sharding: the model's parameters, flattened in name order and
//! padded to a multiple of the world size, are cut into one contiguous chunk
//! per rank (FSDP's flat parameter). Each rank owns its chunk of the
//! parameters and of their gradients and AdamW state.
//!
//! Parameters are gathered for the whole model at once: every rank holds the
//! full model during and between steps (gathering layer by layer would need
//! forward and backward hooks in the model crate). Gradients accumulate in
//! the parameters' own dtype over a rank's micro-batches and are
//! reduce-scattered in f32, so each rank receives only the sum of its chunk.

use tch::nn::VarStore;
use tch::{Kind, Tensor};

use sleuth_c10d::{Collective, CollectiveError};

/// One parameter's place in the flattened model.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub shape: Vec<i64>,
    pub numel: usize,
    /// Offset of the parameter in the flattened full model.
    pub offset: usize,
}

/// Which elements of the flattened model each rank owns.
#[derive(Debug, Clone)]
pub struct Layout {
    pub entries: Vec<Entry>,
    pub world: usize,
    /// Elements of the model.
    pub total: usize,
    /// Elements each rank owns: `total` divided by the world, rounded up
    /// (the last chunk ends in zeros that no parameter uses).
    pub chunk: usize,
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
        Self { entries, world, total: offset, chunk: offset.div_ceil(world.max(1)) }
    }

    /// Elements of the padded flat model: `chunk` x world.
    pub fn padded(&self) -> usize {
        self.chunk * self.world
    }

    /// `rank`'s chunk of a flattened full-model tensor (`total` elements or padded).
    pub fn slice_tensor(&self, full: &Tensor, rank: usize) -> Tensor {
        let padded = pad(full, self.padded());
        padded.narrow(0, (rank * self.chunk) as i64, self.chunk as i64).copy()
    }
}

/// `flat` followed by zeros up to `len` elements.
fn pad(flat: &Tensor, len: usize) -> Tensor {
    let missing = len as i64 - flat.numel() as i64;
    if missing <= 0 {
        return flat.shallow_clone();
    }
    Tensor::cat(&[flat, &Tensor::zeros([missing], (flat.kind(), flat.device()))], 0)
}

/// The whole model flattened to one f32 tensor, in layout order.
pub fn flatten(vars: &VarStore, layout: &Layout) -> Tensor {
    let variables = vars.variables();
    let parts: Vec<Tensor> =
        layout.entries.iter().map(|e| variables[&e.name].detach().to_kind(Kind::Float).flatten(0, -1)).collect();
    Tensor::cat(&parts, 0)
}

/// Writes a flattened full model (padded or not) into the variables.
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

/// The variables' accumulated gradients as one padded f32 tensor in layout
/// order (zeros where a variable has none), and the gradients cleared.
pub fn take_grads(vars: &VarStore, layout: &Layout) -> Tensor {
    let variables = vars.variables();
    let device = vars.device();
    let flat = tch::no_grad(|| {
        let mut parts: Vec<Tensor> = layout
            .entries
            .iter()
            .map(|entry| {
                let grad = variables[&entry.name].grad();
                if grad.defined() {
                    grad.flatten(0, -1).to_kind(Kind::Float)
                } else {
                    Tensor::zeros([entry.numel as i64], (Kind::Float, device))
                }
            })
            .collect();
        if layout.padded() > layout.total {
            parts.push(Tensor::zeros([(layout.padded() - layout.total) as i64], (Kind::Float, device)));
        }
        Tensor::cat(&parts, 0)
    });
    for (_, mut var) in variables {
        var.zero_grad();
    }
    flat
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

    /// One AdamW step on `grad` times `scale`, as torch.optim.AdamW
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

/// Every rank's chunk gathered into the padded flattened model.
pub fn all_gather_params(
    collective: &mut dyn Collective,
    layout: &Layout,
    shard: &Tensor,
) -> Result<Tensor, CollectiveError> {
    let full = Tensor::zeros([layout.padded() as i64], (Kind::Float, shard.device()));
    collective.all_gather(&full, shard)?;
    Ok(full)
}

/// This rank's chunk of the sum over ranks of `flat` (each rank's padded
/// f32 gradient, from [`take_grads`]).
pub fn reduce_scatter_grads(
    collective: &mut dyn Collective,
    layout: &Layout,
    flat: &Tensor,
) -> Result<Tensor, CollectiveError> {
    let chunk = Tensor::zeros([layout.chunk as i64], (Kind::Float, flat.device()));
    collective.reduce_scatter_sum(&chunk, flat)?;
    Ok(chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_element_once_and_pad_the_last() {
        let vars = VarStore::new(tch::Device::Cpu);
        let root = vars.root();
        let _a = root.zeros("a", &[7]);
        let _b = root.zeros("b", &[2, 3]);
        for world in 1..=4 {
            let layout = Layout::new(&vars, world);
            assert_eq!(layout.total, 13);
            let full = Tensor::arange(13, (Kind::Float, tch::Device::Cpu));
            let chunks: Vec<Tensor> = (0..world).map(|rank| layout.slice_tensor(&full, rank)).collect();
            assert!(chunks.iter().all(|c| c.numel() == layout.chunk), "world {world}");
            let rebuilt = Vec::<f32>::try_from(&Tensor::cat(&chunks, 0)).unwrap();
            let expected: Vec<f32> = (0..layout.padded()).map(|i| if i < 13 { i as f32 } else { 0.0 }).collect();
            assert_eq!(rebuilt, expected, "world {world}");
        }
    }

    #[test]
    fn adamw_matches_torch_first_step() {
        // First step: m = 0.1 g, v = 0.001 g^2, bias-corrected update = sign(g) (eps aside).
        let mut shard = Shard::new(Tensor::from_slice(&[1.0f32, -2.0]));
        let hp = AdamW { lr: 0.1, weight_decay: 0.01, ..AdamW::default() };
        shard.adamw(&Tensor::from_slice(&[0.5f32, -3.0]), 1.0, &hp);
        // p * (1 - lr * wd) - lr * sign(g)
        let params = Vec::<f32>::try_from(&shard.params).unwrap();
        assert!((params[0] - (1.0 * 0.999 - 0.1) as f32).abs() < 1e-6);
        assert!((params[1] - (-2.0 * 0.999 + 0.1) as f32).abs() < 1e-6);
    }
}
