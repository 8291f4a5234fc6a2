//! Learning-rate schedules over a run's steps (`training.lr_schedule`):
//! named here so the orchestrator refuses an unknown one when the run is
//! created, and the learner applies the same one.

use std::f64::consts::PI;
use std::str::FromStr;

/// How the learning rate moves over a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LrSchedule {
    /// `learning_rate` at every step.
    #[default]
    Constant,
    /// A linear warm-up over the first twentieth of the steps, then a
    /// cosine decay to a tenth of `learning_rate` at the last. A constant
    /// rate left a small policy's SFT validation swinging between versions
    /// (0.496, 0.094, 0.437, 0.268 at versions 20 to 50), so the version
    /// validation chose was partly a draw.
    Cosine,
}

impl FromStr for LrSchedule {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "" | "constant" => Ok(Self::Constant),
            "cosine" => Ok(Self::Cosine),
            other => Err(format!("lr_schedule {other:?} is not one of constant, cosine")),
        }
    }
}

impl LrSchedule {
    /// The fraction of the peak learning rate at `step` (counted from 0) of
    /// a run of `steps`; past the last step, the last step's.
    pub fn scale(self, step: u64, steps: u64) -> f64 {
        match self {
            Self::Constant => 1.0,
            Self::Cosine => {
                let warmup = (steps / 20).max(1);
                if step < warmup {
                    return (step + 1) as f64 / warmup as f64;
                }
                let progress = ((step - warmup) as f64 / steps.saturating_sub(warmup).max(1) as f64).min(1.0);
                0.1 + 0.45 * (1.0 + (PI * progress).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_warms_up_then_decays_to_a_tenth() {
        let cosine = LrSchedule::Cosine;
        assert_eq!((cosine.scale(0, 100), cosine.scale(4, 100)), (0.2, 1.0));
        assert!((cosine.scale(55, 105) - 0.55).abs() < 1e-9, "halfway through the decay: {}", cosine.scale(55, 105));
        assert!((cosine.scale(100, 100) - 0.1).abs() < 1e-9);
        assert!((cosine.scale(500, 100) - 0.1).abs() < 1e-9, "past the end it stays at a tenth");
        assert!(
            (1..100).all(|s| cosine.scale(s, 100) <= cosine.scale(s - 1, 100) || s < 5),
            "never rises after warm-up"
        );
        assert_eq!(cosine.scale(0, 1), 1.0, "a one-step run trains at the peak");
        assert_eq!(LrSchedule::Constant.scale(7, 10), 1.0);
        assert_eq!("".parse::<LrSchedule>(), Ok(LrSchedule::Constant));
        assert!("linear".parse::<LrSchedule>().unwrap_err().contains("\"linear\" is not one of constant, cosine"));
    }
}
