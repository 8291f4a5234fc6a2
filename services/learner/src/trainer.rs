//! One optimizer step over a batch of samples, sharded across ranks.
//!
//! Every rank receives the whole step's samples (rank 0 reads the stream and
//! broadcasts them), cuts them into the same micro-batches, and trains on
//! micro-batches `rank, rank + N, ...`. Loss denominators are the totals of
//! the whole step, so the gradients summed over ranks are a single rank's,
//! up to the rounding of f32 sums taken in another order.

use std::time::Instant;

use sleuth_model::Model;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::batch::Sample;
use crate::loss::{Aggregation, LossConfig, LossInputs, Totals, policy_loss, sft_loss};
use crate::shard::{AdamW, Layout, Shard, all_gather_params, flatten, reduce_scatter_grads, take_grads, unflatten};
use sleuth_c10d::{Collective, CollectiveError, Reduce};

/// Reinforcement learning from group advantages, or supervised fine-tuning
/// on teacher trajectories.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    Rl(LossConfig),
    Sft(Aggregation),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainerConfig {
    pub objective: Objective,
    pub optimizer: AdamW,
    /// Global gradient-norm clip; 0 = off.
    pub max_grad_norm: f64,
    /// Samples per forward/backward pass.
    pub micro_batch: usize,
}

/// What one step did, averaged over the step's trainable tokens.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StepStats {
    pub step: u64,
    pub loss: f64,
    pub sequences: f64,
    pub tokens: f64,
    /// Trainable tokens / predicted positions (SFT reports it; RL too).
    pub trainable_fraction: f64,
    pub clip_fraction: f64,
    pub ratio_mean: f64,
    pub ratio_max: f64,
    pub kl: f64,
    pub entropy: f64,
    /// Mean |learner - sampler| logprob of the sampled tokens.
    pub logprob_mismatch: f64,
    pub grad_norm: f64,
    pub learning_rate: f64,
    pub tokens_per_second: f64,
    pub advantage_mean: f64,
    pub advantage_std: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("{0}")]
    Batch(String),
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}

pub struct Trainer {
    pub vars: VarStore,
    pub model: Model,
    pub layout: Layout,
    pub shard: Shard,
    reference: Option<(VarStore, Model)>,
    pub config: TrainerConfig,
    pub collective: Box<dyn Collective>,
}

/// Right-padded tensors of a micro-batch: inputs, targets, target mask,
/// behaviour logprobs, padding mask, advantages, sampling temperatures.
struct MicroBatch {
    inputs: Tensor,
    targets: Tensor,
    mask: Tensor,
    behaviour: Tensor,
    attention: Tensor,
    advantages: Tensor,
    /// Per row: what its logits are divided by ([`Scoring::Sampled`]).
    temperatures: Tensor,
}

/// Which distribution the learner's logprobs are taken under.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Scoring {
    /// The model's own (temperature 1): what SFT teaches.
    Model,
    /// The one each sample was drawn from (its logits divided by its
    /// temperature): what the policy loss compares with the behaviour
    /// logprobs, and the KL with the reference.
    Sampled,
}

fn micro_batch(samples: &[&Sample], device: Device) -> MicroBatch {
    let width = samples.iter().map(|s| s.tokens.len() - 1).max().unwrap_or(1);
    let rows = samples.len();
    let (mut inputs, mut targets) = (vec![0i64; rows * width], vec![0i64; rows * width]);
    let (mut mask, mut behaviour, mut attention) =
        (vec![0f32; rows * width], vec![0f32; rows * width], vec![0i64; rows * width]);
    for (row, sample) in samples.iter().enumerate() {
        let n = sample.tokens.len() - 1;
        let at = row * width;
        inputs[at..at + n].copy_from_slice(&sample.tokens[..n]);
        targets[at..at + n].copy_from_slice(&sample.tokens[1..]);
        mask[at..at + n].copy_from_slice(&sample.mask[1..]);
        behaviour[at..at + n].copy_from_slice(&sample.behaviour[1..]);
        attention[at..at + n].iter_mut().for_each(|a| *a = 1);
    }
    let shape = [rows as i64, width as i64];
    let advantages: Vec<f32> = samples.iter().map(|s| s.advantage).collect();
    let temperatures: Vec<f32> = samples.iter().map(|s| s.temperature).collect();
    MicroBatch {
        inputs: Tensor::from_slice(&inputs).view(shape).to_device(device),
        targets: Tensor::from_slice(&targets).view(shape).to_device(device),
        mask: Tensor::from_slice(&mask).view(shape).to_device(device),
        behaviour: Tensor::from_slice(&behaviour).view(shape).to_device(device),
        attention: Tensor::from_slice(&attention).view(shape).to_device(device),
        advantages: Tensor::from_slice(&advantages).to_device(device),
        temperatures: Tensor::from_slice(&temperatures).to_device(device),
    }
}

/// Logprobs of `targets` at the trainable positions (0 elsewhere) under
/// `scoring`'s distribution, and the summed entropy of those positions'
/// distributions. Only trainable positions go through the output
/// projection: prompts and observations never need their [positions, vocab]
/// logits.
fn token_logprobs(model: &Model, batch: &MicroBatch, scoring: Scoring) -> (Tensor, f64) {
    let hidden = model.hidden_states(&batch.inputs, Some(&batch.attention));
    let (rows, width, size) = (hidden.size()[0], hidden.size()[1], hidden.size()[2]);
    let trainable = batch.mask.view([-1]).gt(0.5).nonzero().squeeze_dim(1);
    let selected = hidden.view([rows * width, size]).index_select(0, &trainable);
    let logits = model.project(&selected).to_kind(Kind::Float);
    let logits = match scoring {
        Scoring::Model => logits,
        Scoring::Sampled => {
            let per_position = batch.temperatures.unsqueeze(1).expand([rows, width], false).reshape([-1]);
            logits / per_position.index_select(0, &trainable).unsqueeze(1)
        }
    };
    let log_probs = logits.log_softmax(-1, Kind::Float);
    let targets = batch.targets.view([-1]).index_select(0, &trainable);
    let taken = log_probs.gather(-1, &targets.unsqueeze(-1), false).squeeze_dim(-1);
    let entropy = tch::no_grad(|| -(log_probs.exp() * &log_probs).sum(Kind::Double).double_value(&[]));
    let full = Tensor::zeros([rows * width], (Kind::Float, hidden.device()));
    let scattered = full.index_put(&[Some(trainable)], &taken, false).view([rows, width]);
    (scattered, entropy)
}

impl Trainer {
    /// Shards the model held in `vars` over the collective's ranks. Every
    /// rank must start from the same weights. `reference` is a frozen copy
    /// for the KL term.
    pub fn new(
        vars: VarStore,
        model: Model,
        reference: Option<(VarStore, Model)>,
        config: TrainerConfig,
        collective: Box<dyn Collective>,
    ) -> Self {
        let layout = Layout::new(&vars, collective.world());
        let shard = Shard::new(layout.slice_tensor(&flatten(&vars, &layout), collective.rank()));
        Self { vars, model, layout, shard, reference, config, collective }
    }

    /// Replaces this rank's shard (resuming from a checkpoint) and refreshes the model.
    pub fn restore(&mut self, shard: Shard) -> Result<(), TrainError> {
        if shard.len() != self.layout.chunk {
            return Err(TrainError::Batch(format!(
                "checkpoint shard has {} parameters, this rank owns {}",
                shard.len(),
                self.layout.chunk
            )));
        }
        self.shard = shard;
        let full = all_gather_params(self.collective.as_mut(), &self.layout, &self.shard.params)?;
        unflatten(&self.vars, &self.layout, &full);
        Ok(())
    }

    /// The current full parameters by HF name (after a step every rank holds them).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let variables = self.vars.variables();
        self.layout.entries.iter().map(|e| (e.name.clone(), variables[&e.name].detach().shallow_clone())).collect()
    }

    /// `values` combined over ranks by `op` (on the training device: NCCL
    /// takes CUDA tensors only).
    fn all_reduce_f64<const N: usize>(&mut self, values: &[f64; N], op: Reduce) -> Result<[f64; N], CollectiveError> {
        let tensor = Tensor::from_slice(values).to_device(self.vars.device());
        self.collective.all_reduce(&tensor, op)?;
        let mut out = [0f64; N];
        tensor.to_device(Device::Cpu).copy_data(&mut out, N);
        Ok(out)
    }

    /// One optimizer step on `samples` (the whole step's, identical on every rank).
    pub fn step(&mut self, samples: &[Sample]) -> Result<StepStats, TrainError> {
        let started = Instant::now();
        if samples.is_empty() {
            return Err(TrainError::Batch("a step needs at least one sample".into()));
        }
        let device = self.vars.device();
        let totals = Totals {
            tokens: samples.iter().map(|s| s.trainable_tokens() as f64).sum(),
            sequences: samples.len() as f64,
        };
        if totals.tokens == 0.0 {
            return Err(TrainError::Batch("no sample of the step has a trainable token".into()));
        }
        let (rank, world) = (self.collective.rank(), self.collective.world());
        // Sums over this rank's micro-batches: loss, entropy, clipped, ratio, kl, mismatch, ratio max.
        let mut sums = [0f64; 6];
        let mut ratio_max = 0f64;
        let chunks: Vec<Vec<&Sample>> =
            samples.chunks(self.config.micro_batch.max(1)).map(|c| c.iter().collect()).collect();
        for chunk in chunks.iter().skip(rank).step_by(world) {
            let batch = micro_batch(chunk, device);
            let scoring = match self.config.objective {
                Objective::Rl(_) => Scoring::Sampled,
                Objective::Sft(_) => Scoring::Model,
            };
            let (logprobs, entropy) = token_logprobs(&self.model, &batch, scoring);
            let loss = match self.config.objective {
                Objective::Rl(config) => {
                    let reference = match (&self.reference, config.kl_coef > 0.0) {
                        (Some((_, model)), true) => Some(tch::no_grad(|| token_logprobs(model, &batch, scoring).0)),
                        _ => None,
                    };
                    let out = policy_loss(
                        &config,
                        &LossInputs {
                            logprobs: &logprobs,
                            behaviour: &batch.behaviour,
                            advantages: &batch.advantages,
                            mask: &batch.mask,
                            reference: reference.as_ref(),
                        },
                        totals,
                    );
                    sums[2] += out.clipped_tokens;
                    sums[3] += out.ratio_sum;
                    sums[4] += out.kl_sum;
                    sums[5] += out.mismatch_sum;
                    ratio_max = ratio_max.max(out.ratio_max);
                    out.loss
                }
                Objective::Sft(aggregation) => sft_loss(&logprobs, &batch.mask, aggregation, totals),
            };
            sums[0] += loss.double_value(&[]);
            sums[1] += entropy;
            // Gradients accumulate in the variables over the micro-batches.
            loss.backward();
        }
        // The six sums add up over ranks, the ratio max takes the largest.
        let totals_sum = self.all_reduce_f64(&sums, Reduce::Sum)?;
        let global_ratio_max = self.all_reduce_f64(&[ratio_max], Reduce::Max)?[0];

        let flat = take_grads(&self.vars, &self.layout);
        let grad = reduce_scatter_grads(self.collective.as_mut(), &self.layout, &flat)?;
        drop(flat);
        let squared = grad.square().sum(Kind::Double).double_value(&[]);
        let grad_norm = self.all_reduce_f64(&[squared], Reduce::Sum)?[0].sqrt();
        let scale = if self.config.max_grad_norm > 0.0 && grad_norm > self.config.max_grad_norm {
            self.config.max_grad_norm / (grad_norm + 1e-6)
        } else {
            1.0
        };
        self.shard.adamw(&grad, scale, &self.config.optimizer);
        let full = all_gather_params(self.collective.as_mut(), &self.layout, &self.shard.params)?;
        unflatten(&self.vars, &self.layout, &full);
        drop(full);

        let advantages: Vec<f64> = samples.iter().map(|s| f64::from(s.advantage)).collect();
        let advantage_mean = advantages.iter().sum::<f64>() / advantages.len() as f64;
        let advantage_var =
            advantages.iter().map(|a| (a - advantage_mean).powi(2)).sum::<f64>() / advantages.len() as f64;
        let tokens_all: f64 = samples.iter().map(|s| s.tokens.len() as f64).sum();
        let t = totals.tokens;
        Ok(StepStats {
            step: self.shard.step,
            loss: totals_sum[0],
            sequences: totals.sequences,
            tokens: t,
            trainable_fraction: crate::batch::trainable_fraction(samples),
            entropy: totals_sum[1] / t,
            clip_fraction: totals_sum[2] / t,
            ratio_mean: totals_sum[3] / t,
            ratio_max: global_ratio_max,
            kl: totals_sum[4] / t,
            logprob_mismatch: totals_sum[5] / t,
            grad_norm,
            learning_rate: self.config.optimizer.lr,
            tokens_per_second: tokens_all / started.elapsed().as_secs_f64(),
            advantage_mean,
            advantage_std: advantage_var.sqrt(),
        })
    }
}
