//! The policy losses a run may name (`training.loss`, `SLEUTH_LOSS`) and their
//! settings; the learner's `loss` module computes them.

use std::str::FromStr;

/// The per-token surrogate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PolicyLoss {
    /// PPO's clipped ratio, clip range [1 - low, 1 + high]; with `dual_clip`
    /// c, the loss of negative-advantage tokens is capped at -c * A.
    Ppo { clip_low: f64, clip_high: f64, dual_clip: Option<f64> },
    /// CISPO: REINFORCE on every token, weighted by the importance ratio
    /// clipped from above and detached, so no token's gradient is dropped.
    Cispo { max_weight: f64 },
    /// Plain importance sampling: -r * A, no clipping.
    ImportanceSampling,
}

impl PolicyLoss {
    /// PPO with the learner's default clips: 0.2 below, 0.28 above (DAPO's
    /// clip-higher), dual clip 3.
    pub const PPO: Self = Self::Ppo { clip_low: 0.2, clip_high: 0.28, dual_clip: Some(3.0) };
}

impl FromStr for PolicyLoss {
    type Err = String;

    /// `ppo` (clip 0.2/0.28, dual clip 3), `cispo` (weight cap 5) or `importance_sampling`.
    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "" | "ppo" => Ok(Self::PPO),
            "cispo" => Ok(Self::Cispo { max_weight: 5.0 }),
            "importance_sampling" => Ok(Self::ImportanceSampling),
            other => Err(format!("loss {other:?} is not one of ppo, cispo, importance_sampling")),
        }
    }
}
