//! Group advantages: every episode of a group answered the same task, so
//! each is scored against its siblings instead of a learned value function.

use std::str::FromStr;

/// Rewards closer than this count as equal (a group with no spread teaches nothing).
const SAME_REWARD: f64 = 1e-9;
/// Added to the standard deviation so a nearly flat group does not explode.
const STD_EPS: f64 = 1e-6;

/// How a group's rewards become per-episode advantages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Estimator {
    /// GRPO: (r - mean) / (std + eps), std with Bessel's correction (as torch.std).
    Grpo,
    /// Dr. GRPO: r - mean, no division by the standard deviation (no difficulty bias).
    DrGrpo,
    /// RLOO: r minus the mean of the other G-1 rewards.
    Rloo,
    /// GRPO for pass@k (Chen et al., 2025, "Pass@k Training"): the analytic
    /// advantage of each sample under the group's pass@k reward. An episode
    /// counts as correct when its reward is positive.
    PassAtK { k: usize },
}

impl FromStr for Estimator {
    type Err = String;

    /// `grpo`, `dr_grpo`, `rloo` or `grpo_pass_at_k` (k = 4) / `grpo_pass_at_k:K`.
    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "" | "grpo" => Ok(Self::Grpo),
            "dr_grpo" => Ok(Self::DrGrpo),
            "rloo" => Ok(Self::Rloo),
            "grpo_pass_at_k" => Ok(Self::PassAtK { k: 4 }),
            other => match other.strip_prefix("grpo_pass_at_k:").map(str::parse::<usize>) {
                Some(Ok(k)) if k >= 1 => Ok(Self::PassAtK { k }),
                _ => Err(format!("advantage {other:?} is not one of grpo, dr_grpo, rloo, grpo_pass_at_k[:K] (K >= 1)")),
            },
        }
    }
}

/// Per-episode advantages of one group, or None when the group is filtered:
/// every reward equal (zero variance, no learning signal) or fewer than two
/// episodes. Filtered groups are counted by the caller.
pub fn advantages(estimator: Estimator, rewards: &[f64]) -> Option<Vec<f64>> {
    let n = rewards.len();
    if n < 2 {
        return None;
    }
    let (min, max) = rewards.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &r| (lo.min(r), hi.max(r)));
    if max - min < SAME_REWARD {
        return None;
    }
    let mean = rewards.iter().sum::<f64>() / n as f64;
    Some(match estimator {
        Estimator::Grpo => {
            let variance = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            let std = variance.sqrt();
            rewards.iter().map(|r| (r - mean) / (std + STD_EPS)).collect()
        }
        Estimator::DrGrpo => rewards.iter().map(|r| r - mean).collect(),
        Estimator::Rloo => {
            let total: f64 = rewards.iter().sum();
            rewards.iter().map(|r| r - (total - r) / (n - 1) as f64).collect()
        }
        Estimator::PassAtK { k } => pass_at_k(rewards, k.min(n)),
    })
}

/// C(n, k) as f64 (0 when k > n).
fn choose(n: usize, k: usize) -> f64 {
    if k > n {
        return 0.0;
    }
    (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
}

/// Analytic pass@k advantages: with c correct of N, the group's expected
/// pass@k reward is R = 1 - C(N-c, k) / C(N, k) and its spread
/// s = sqrt(R (1 - R)); a correct sample gets (1 - R) / s and an incorrect
/// one (1 - R - C(N-c-1, k-1) / C(N-1, k-1)) / s.
fn pass_at_k(rewards: &[f64], k: usize) -> Vec<f64> {
    let n = rewards.len();
    let correct = rewards.iter().filter(|&&r| r > 0.0).count();
    let group = 1.0 - choose(n - correct, k) / choose(n, k);
    let spread = (group * (1.0 - group)).sqrt();
    if spread < SAME_REWARD {
        return vec![0.0; n];
    }
    let positive = (1.0 - group) / spread;
    let negative = (1.0 - group - choose(n - correct - 1, k - 1) / choose(n - 1, k - 1)) / spread;
    rewards.iter().map(|&r| if r > 0.0 { positive } else { negative }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "got {got:?}, want {want:?}");
        }
    }

    #[test]
    fn grpo_normalises_by_the_sample_std() {
        // mean 0.5, sample std sqrt(1/3) = 0.57735.
        let got = advantages(Estimator::Grpo, &[1.0, 0.0, 1.0, 0.0]).unwrap();
        close(&got, &[0.866_024_0, -0.866_024_0, 0.866_024_0, -0.866_024_0]);
    }

    #[test]
    fn dr_grpo_only_centres() {
        close(&advantages(Estimator::DrGrpo, &[1.0, 0.0, 0.5]).unwrap(), &[0.5, -0.5, 0.0]);
    }

    #[test]
    fn rloo_leaves_one_out() {
        // 3 - mean(1, 2) = 1.5; 1 - mean(3, 2) = -1.5; 2 - mean(3, 1) = 0.
        close(&advantages(Estimator::Rloo, &[3.0, 1.0, 2.0]).unwrap(), &[1.5, -1.5, 0.0]);
    }

    #[test]
    fn pass_at_k_matches_the_closed_form() {
        // N = 4, c = 1, k = 2: R = 1 - C(3,2)/C(4,2) = 0.5, s = 0.5;
        // correct: 0.5 / 0.5 = 1; incorrect: (1 - 0.5 - C(2,1)/C(3,1)) / 0.5 = -1/3.
        let got = advantages(Estimator::PassAtK { k: 2 }, &[1.0, 0.0, 0.0, 0.0]).unwrap();
        close(&got, &[1.0, -1.0 / 3.0, -1.0 / 3.0, -1.0 / 3.0]);
    }

    #[test]
    fn flat_groups_are_filtered() {
        for estimator in [Estimator::Grpo, Estimator::DrGrpo, Estimator::Rloo, Estimator::PassAtK { k: 2 }] {
            assert_eq!(advantages(estimator, &[0.3, 0.3, 0.3]), None);
            assert_eq!(advantages(estimator, &[1.0]), None);
        }
    }

    #[test]
    fn names_parse_and_bad_ones_are_named() {
        assert_eq!("rloo".parse::<Estimator>(), Ok(Estimator::Rloo));
        assert_eq!("grpo_pass_at_k:8".parse::<Estimator>(), Ok(Estimator::PassAtK { k: 8 }));
        assert!("ppo".parse::<Estimator>().unwrap_err().contains("\"ppo\""));
    }
}
