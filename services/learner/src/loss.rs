//! Policy-gradient losses on the sampled tokens of a batch.
//!
//! Every tensor is [sequences, positions]: `logprobs` are the learner's
//! log-probabilities of the tokens that were sampled (with gradient),
//! `behaviour` the logprobs the sampler reported for them (recorded by the
//! gateway), `mask` 1 on tokens the policy sampled and 0 on prompts, tool
//! observations and template glue. Masked positions are selected away (not
//! multiplied by zero), so their gradient is exactly zero whatever their values.
//!
//! Importance ratios: by default r = exp(logprobs - behaviour), the ratio to
//! the policy that actually sampled. With truncated importance sampling
//! (`tis_cap`), the ratio is taken to the learner's own pre-update logprobs
//! instead and each token is weighted by min(exp(learner - behaviour), cap),
//! which corrects for the sampler and trainer computing different numbers for
//! the same weights without letting rare large ratios dominate.

use tch::{Kind, Tensor};

pub use sleuth_metrics::policy_loss::PolicyLoss;

/// How per-token losses become one number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Aggregation {
    /// Sum over all trainable tokens / their number (long episodes weigh more).
    TokenMean,
    /// Sum over each sequence's tokens, mean over sequences (Dr. GRPO).
    SeqMeanTokenSum,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossConfig {
    pub policy: PolicyLoss,
    pub aggregation: Aggregation,
    /// Truncated importance sampling cap; None = ratio straight to the sampler.
    pub tis_cap: Option<f64>,
    /// Coefficient of the k3 KL estimate to the reference policy; 0 = off.
    pub kl_coef: f64,
}

/// The denominators of the whole optimizer step (all micro-batches on all
/// ranks), so that sharded and single-rank runs compute the same gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Totals {
    pub tokens: f64,
    pub sequences: f64,
}

pub struct LossInputs<'a> {
    pub logprobs: &'a Tensor,
    pub behaviour: &'a Tensor,
    /// [sequences]: one advantage per episode.
    pub advantages: &'a Tensor,
    pub mask: &'a Tensor,
    /// Reference-policy logprobs, when `kl_coef` > 0.
    pub reference: Option<&'a Tensor>,
}

/// The loss of one micro-batch and its statistics as sums over its trainable
/// tokens (divide by the step's token total for means).
pub struct LossOutput {
    pub loss: Tensor,
    pub clipped_tokens: f64,
    pub ratio_sum: f64,
    pub ratio_max: f64,
    pub kl_sum: f64,
    /// Sum of |learner - behaviour| logprob: the train/inference mismatch.
    pub mismatch_sum: f64,
    pub tokens: f64,
}

pub fn policy_loss(config: &LossConfig, inputs: &LossInputs, totals: Totals) -> LossOutput {
    let trainable = inputs.mask.gt(0.5);
    let zeros = inputs.logprobs.zeros_like();
    let keep = |t: &Tensor| t.where_self(&trainable, &zeros);
    let logprobs = inputs.logprobs;
    let advantages = inputs.advantages.unsqueeze(1).expand_as(logprobs);
    let learner = logprobs.detach();
    // Behaviour logprobs of masked positions are meaningless (0): select them away.
    let behaviour = keep(inputs.behaviour);
    let (base, weight) = match config.tis_cap {
        Some(cap) => (learner.shallow_clone(), Some(keep(&(&learner - &behaviour).exp().clamp_max(cap)))),
        None => (behaviour.shallow_clone(), None),
    };
    let ratio = keep(&(logprobs - &base).exp());
    let detached_ratio = ratio.detach();
    let (per_token, clipped) = match config.policy {
        PolicyLoss::Ppo { clip_low, clip_high, dual_clip } => {
            let unclipped = -&advantages * &ratio;
            let clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high);
            let clipped = -&advantages * clipped_ratio;
            let mut loss = unclipped.maximum(&clipped);
            if let Some(c) = dual_clip {
                let cap = -&advantages * c;
                let negative = advantages.lt(0.0);
                loss = loss.minimum(&cap).where_self(&negative, &loss);
            }
            let was_clipped = detached_ratio
                .gt(1.0 + clip_high)
                .logical_and(&advantages.gt(0.0))
                .logical_or(&detached_ratio.lt(1.0 - clip_low).logical_and(&advantages.lt(0.0)));
            (loss, was_clipped)
        }
        PolicyLoss::Cispo { max_weight } => {
            let weight = detached_ratio.clamp_max(max_weight);
            (-&advantages * weight * logprobs, detached_ratio.gt(max_weight))
        }
        PolicyLoss::ImportanceSampling => (-&advantages * &ratio, detached_ratio.gt(f64::INFINITY)),
    };
    let mut per_token = match &weight {
        Some(weight) => per_token * weight,
        None => per_token,
    };
    let mut kl_sum = 0.0;
    if let (Some(reference), true) = (inputs.reference, config.kl_coef > 0.0) {
        let kl = keep(&k3_kl(logprobs, reference));
        kl_sum = kl.detach().sum(Kind::Double).double_value(&[]);
        per_token += kl * config.kl_coef;
    }
    let denominator = match config.aggregation {
        Aggregation::TokenMean => totals.tokens,
        Aggregation::SeqMeanTokenSum => totals.sequences,
    };
    let loss = keep(&per_token).sum(Kind::Float) / denominator.max(1.0);
    let sum = |t: &Tensor| keep(t).sum(Kind::Double).double_value(&[]);
    let ones = trainable.to_kind(Kind::Float);
    LossOutput {
        loss,
        clipped_tokens: sum(&(clipped.to_kind(Kind::Float) * &ones)),
        ratio_sum: sum(&detached_ratio),
        ratio_max: keep(&detached_ratio).max().double_value(&[]),
        kl_sum,
        mismatch_sum: sum(&(&learner - &behaviour).abs()),
        tokens: ones.sum(Kind::Double).double_value(&[]),
    }
}

/// The largest per-token KL estimate the loss takes (verl's `low_var_kl`
/// bound). k3 grows as exp(ref - logp): one sampled token the policy now
/// finds unlikely but the reference did not (a stale episode, or a token
/// whose probability one step moved far) gave a GRPO step a mean KL of 11.8
/// per token and a gradient norm of 5,507 against about 1 at other steps, so
/// that after clipping the whole step served that token. Beyond the bound a
/// token adds a constant and no gradient.
pub const KL_BOUND: f64 = 10.0;

/// The per-token k3 estimate of KL(policy || reference) on sampled tokens:
/// exp(ref - logp) - (ref - logp) - 1, unbiased and >= 0, with ref - logp
/// clamped to +-20 (so it cannot overflow) and the estimate to [`KL_BOUND`].
fn k3_kl(logprobs: &Tensor, reference: &Tensor) -> Tensor {
    let delta = (reference - logprobs).clamp(-20.0, 20.0);
    (delta.exp() - &delta - 1.0).clamp_max(KL_BOUND)
}

/// Cross-entropy on the trainable tokens (trajectory SFT): the negative
/// logprob of each teacher token, aggregated like the policy loss.
pub fn sft_loss(logprobs: &Tensor, mask: &Tensor, aggregation: Aggregation, totals: Totals) -> Tensor {
    let trainable = mask.gt(0.5);
    let per_token = (-logprobs).where_self(&trainable, &logprobs.zeros_like());
    let denominator = match aggregation {
        Aggregation::TokenMean => totals.tokens,
        Aggregation::SeqMeanTokenSum => totals.sequences,
    };
    per_token.sum(Kind::Float) / denominator.max(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(policy: PolicyLoss) -> LossConfig {
        LossConfig { policy, aggregation: Aggregation::TokenMean, tis_cap: None, kl_coef: 0.0 }
    }

    /// One sequence with tokens of ratio `ratios` to a behaviour logprob of 0.
    fn run(config: &LossConfig, ratios: &[f64], advantage: f64, mask: &[f64]) -> (f64, LossOutput, Tensor) {
        let logprobs: Vec<f32> = ratios.iter().map(|r| r.ln() as f32).collect();
        let logprobs = Tensor::from_slice(&logprobs).unsqueeze(0).set_requires_grad(true);
        let behaviour = logprobs.zeros_like().detach();
        let mask_t = Tensor::from_slice(&mask.iter().map(|&m| m as f32).collect::<Vec<_>>()).unsqueeze(0);
        let advantages = Tensor::from_slice(&[advantage as f32]);
        let tokens = mask.iter().sum::<f64>();
        let inputs = LossInputs {
            logprobs: &logprobs,
            behaviour: &behaviour,
            advantages: &advantages,
            mask: &mask_t,
            reference: None,
        };
        let out = policy_loss(config, &inputs, Totals { tokens, sequences: 1.0 });
        let value = out.loss.double_value(&[]);
        out.loss.backward();
        let grad = logprobs.grad();
        (value, out, grad)
    }

    fn approx(got: f64, want: f64) {
        assert!((got - want).abs() < 1e-5, "got {got}, want {want}");
    }

    #[test]
    fn ppo_clips_and_dual_clips_as_computed_by_hand() {
        let ppo = config(PolicyLoss::Ppo { clip_low: 0.2, clip_high: 0.2, dual_clip: Some(3.0) });
        // A = 1, r = 1.5: max(-1.5, -1.2) = -1.2 (clipped, no gradient).
        let (loss, out, grad) = run(&ppo, &[1.5], 1.0, &[1.0]);
        approx(loss, -1.2);
        assert_eq!(out.clipped_tokens, 1.0);
        approx(grad.double_value(&[0, 0]), 0.0);
        // A = -1, r = 1.5: max(1.5, 1.2) = 1.5, gradient -A * r = 1.5.
        let (loss, _, grad) = run(&ppo, &[1.5], -1.0, &[1.0]);
        approx(loss, 1.5);
        approx(grad.double_value(&[0, 0]), 1.5);
        // A = -1, r = 4: max(4, 1.2) = 4, dual clip caps it at 3 (no gradient).
        let (loss, _, grad) = run(&ppo, &[4.0], -1.0, &[1.0]);
        approx(loss, 3.0);
        approx(grad.double_value(&[0, 0]), 0.0);
        // Token mean over two tokens: A = 2, r = 1 and r = 0.5: (-2 + -1) / 2.
        let (loss, _, _) = run(&ppo, &[1.0, 0.5], 2.0, &[1.0, 1.0]);
        approx(loss, -1.5);
    }

    #[test]
    fn cispo_keeps_the_gradient_of_clipped_tokens() {
        let cispo = config(PolicyLoss::Cispo { max_weight: 2.0 });
        // r = 3 > 2: weight 2, loss -2 * A * logp, gradient -2 * A (PPO would give 0).
        let (loss, out, grad) = run(&cispo, &[3.0], 1.0, &[1.0]);
        approx(loss, -2.0 * 3f64.ln());
        approx(grad.double_value(&[0, 0]), -2.0);
        assert_eq!(out.clipped_tokens, 1.0);
    }

    #[test]
    fn importance_sampling_is_unclipped() {
        let is = config(PolicyLoss::ImportanceSampling);
        let (loss, _, grad) = run(&is, &[3.0], 0.5, &[1.0]);
        approx(loss, -1.5);
        approx(grad.double_value(&[0, 0]), -1.5);
    }

    #[test]
    fn truncated_importance_sampling_weights_by_the_capped_mismatch() {
        let tis = LossConfig { tis_cap: Some(2.0), ..config(PolicyLoss::ImportanceSampling) };
        // Learner/behaviour ratio 3 is capped at 2; the ratio to the learner itself is 1.
        let (loss, out, grad) = run(&tis, &[3.0, 1.5], 1.0, &[1.0, 1.0]);
        approx(loss, (-2.0 + -1.5) / 2.0);
        approx(grad.double_value(&[0, 0]), -1.0);
        approx(grad.double_value(&[0, 1]), -0.75);
        approx(out.mismatch_sum, 3f64.ln() + 1.5f64.ln());
    }

    #[test]
    fn sequence_mean_token_sum_divides_by_sequences() {
        let mut c = config(PolicyLoss::ImportanceSampling);
        c.aggregation = Aggregation::SeqMeanTokenSum;
        let (loss, _, _) = run(&c, &[1.0, 1.0, 1.0], 1.0, &[1.0, 1.0, 1.0]);
        approx(loss, -3.0);
    }

    #[test]
    fn k3_kl_is_added_per_token() {
        let logprobs = Tensor::from_slice(&[0.0f32]).unsqueeze(0).set_requires_grad(true);
        let reference = Tensor::from_slice(&[(0.5f32).ln()]).unsqueeze(0);
        let zeros = Tensor::from_slice(&[0.0f32]);
        let mask = Tensor::from_slice(&[1.0f32]).unsqueeze(0);
        let c = LossConfig { kl_coef: 0.1, ..config(PolicyLoss::ImportanceSampling) };
        let inputs = LossInputs {
            logprobs: &logprobs,
            behaviour: &logprobs.detach(),
            advantages: &zeros,
            mask: &mask,
            reference: Some(&reference),
        };
        let out = policy_loss(&c, &inputs, Totals { tokens: 1.0, sequences: 1.0 });
        // k3 = 0.5 - ln 0.5 - 1 = 0.193147.
        approx(out.kl_sum, 0.5 - 0.5f64.ln() - 1.0);
        approx(out.loss.double_value(&[]), 0.1 * (0.5 - 0.5f64.ln() - 1.0));
    }

    #[test]
    fn k3_kl_is_bounded_so_one_unlikely_token_cannot_take_the_step() {
        // Reference logprobs 0; the policy finds token 0 at -15 (unbounded
        // k3: e^15, about 3.3 million), token 1 at ln 0.5 (k3 = 1 - ln 2).
        let logprobs = Tensor::from_slice(&[-15.0f32, 0.5f32.ln()]).unsqueeze(0).set_requires_grad(true);
        let reference = logprobs.zeros_like().detach();
        let mask = Tensor::from_slice(&[1.0f32, 1.0]).unsqueeze(0);
        let c = LossConfig { kl_coef: 1.0, ..config(PolicyLoss::ImportanceSampling) };
        let inputs = LossInputs {
            logprobs: &logprobs,
            behaviour: &logprobs.detach(),
            advantages: &Tensor::from_slice(&[0.0f32]),
            mask: &mask,
            reference: Some(&reference),
        };
        let out = policy_loss(&c, &inputs, Totals { tokens: 2.0, sequences: 1.0 });
        let small = 1.0 - 2f64.ln();
        approx(out.kl_sum, KL_BOUND + small);
        approx(out.loss.double_value(&[]), (KL_BOUND + small) / 2.0);
        out.loss.backward();
        let grad = logprobs.grad();
        assert_eq!(grad.double_value(&[0, 0]), 0.0, "past the bound a token pulls no more");
        // d/dlogp of k3 = 1 - exp(ref - logp) = 1 - 2, over 2 tokens.
        approx(grad.double_value(&[0, 1]), -0.5);
    }

    #[test]
    fn masked_tokens_get_exactly_zero_gradient() {
        // Extreme values on masked positions (huge ratios) must not leak.
        for policy in ["ppo", "cispo", "importance_sampling"] {
            let c = LossConfig { tis_cap: Some(2.0), kl_coef: 0.1, ..config(policy.parse().unwrap()) };
            let logprobs =
                Tensor::from_slice(&[-0.5f32, 30.0, -1.0, -80.0, 0.2, -3.0]).view([2, 3]).set_requires_grad(true);
            let behaviour = Tensor::from_slice(&[-0.4f32, -90.0, -1.2, 0.0, 0.1, -2.0]).view([2, 3]);
            let reference = Tensor::from_slice(&[-0.6f32, 50.0, -0.9, 70.0, 0.0, -2.5]).view([2, 3]);
            let mask = Tensor::from_slice(&[1.0f32, 0.0, 1.0, 0.0, 1.0, 0.0]).view([2, 3]);
            let advantages = Tensor::from_slice(&[1.0f32, -1.0]);
            let inputs = LossInputs {
                logprobs: &logprobs,
                behaviour: &behaviour,
                advantages: &advantages,
                mask: &mask,
                reference: Some(&reference),
            };
            let out = policy_loss(&c, &inputs, Totals { tokens: 3.0, sequences: 2.0 });
            out.loss.backward();
            let grad = logprobs.grad();
            for (row, col) in [(0, 1), (1, 0), (1, 2)] {
                assert_eq!(grad.double_value(&[row, col]), 0.0, "{policy}: masked ({row}, {col})");
            }
            assert!(grad.double_value(&[0, 0]) != 0.0, "{policy}: trainable tokens do get gradient");
            assert!(out.loss.double_value(&[]).is_finite());
        }
    }

    #[test]
    fn sft_is_the_mean_negative_logprob_of_trainable_tokens() {
        let logprobs = Tensor::from_slice(&[-1.0f32, -2.0, -4.0]).unsqueeze(0).set_requires_grad(true);
        let mask = Tensor::from_slice(&[1.0f32, 0.0, 1.0]).unsqueeze(0);
        let loss = sft_loss(&logprobs, &mask, Aggregation::TokenMean, Totals { tokens: 2.0, sequences: 1.0 });
        approx(loss.double_value(&[]), 2.5);
        loss.backward();
        assert_eq!(logprobs.grad().double_value(&[0, 1]), 0.0);
    }
}
