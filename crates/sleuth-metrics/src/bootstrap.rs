//! 95 % bootstrap intervals over per-task scores: of one system's mean, and
//! of the paired difference between two systems scored on the same tasks
//! (resampling tasks, so task difficulty cancels out). Seeded, so a report
//! prints the same interval every time it is drawn.

/// Resamples drawn; 2,000 put the 2.5 % and 97.5 % quantiles within about
/// ±0.005 nDCG of their limit for a few hundred tasks.
pub const RESAMPLES: usize = 2000;

/// A mean with its 95 % percentile-bootstrap interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    /// The mean over the tasks themselves.
    pub mean: f64,
    /// 2.5 % quantile of the resampled means.
    pub low: f64,
    /// 97.5 % quantile of the resampled means.
    pub high: f64,
}

impl Interval {
    /// Whether the whole interval lies above zero (a paired difference that is significant).
    pub fn above_zero(&self) -> bool {
        self.low > 0.0
    }

    /// Whether the whole interval lies below zero.
    pub fn below_zero(&self) -> bool {
        self.high < 0.0
    }

    /// `above` when the interval lies above zero, `below` when below, else
    /// "": a paired difference's verdict, in the words of its report.
    pub fn verdict<'a>(&self, above: &'a str, below: &'a str) -> &'a str {
        if self.above_zero() {
            above
        } else if self.below_zero() {
            below
        } else {
            ""
        }
    }
}

/// splitmix64: a tiny, well-mixed generator; enough to pick resample indices.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n by multiply-and-shift (Lemire): no division, which
    /// dominates a bootstrap's cost.
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next()) * n as u128) >> 64) as usize
    }
}

/// The mean of `scores` with its 95 % interval; None for no scores.
pub fn mean_interval(scores: &[f64], seed: u64) -> Option<Interval> {
    if scores.is_empty() {
        return None;
    }
    let n = scores.len();
    let mean = scores.iter().sum::<f64>() / n as f64;
    let mut rng = SplitMix(seed);
    let mut means: Vec<f64> =
        (0..RESAMPLES).map(|_| (0..n).map(|_| scores[rng.below(n)]).sum::<f64>() / n as f64).collect();
    means.sort_by(f64::total_cmp);
    let quantile = |q: f64| means[((q * (RESAMPLES - 1) as f64).round() as usize).min(RESAMPLES - 1)];
    Some(Interval { mean, low: quantile(0.025), high: quantile(0.975) })
}

/// The mean of `a - b` over tasks both scored (by task id), with its 95 %
/// paired interval, and how many tasks were paired; None when none were.
pub fn paired_interval<'a>(
    a: impl IntoIterator<Item = (&'a str, f64)>,
    b: &std::collections::BTreeMap<String, f64>,
    seed: u64,
) -> Option<(Interval, usize)> {
    let differences: Vec<f64> =
        a.into_iter().filter_map(|(task, score)| b.get(task).map(|other| score - other)).collect();
    mean_interval(&differences, seed).map(|interval| (interval, differences.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_constant_has_a_point_interval_and_noise_a_wide_one() {
        let constant = mean_interval(&[0.5; 40], 1).expect("scores");
        assert_eq!((constant.mean, constant.low, constant.high), (0.5, 0.5, 0.5));
        let spread: Vec<f64> = (0..100).map(|i| f64::from(i % 2)).collect();
        let interval = mean_interval(&spread, 1).expect("scores");
        assert_eq!(interval.mean, 0.5);
        // Standard error of a fair coin's mean over 100: 0.05; the interval is about ±1.96 of it.
        assert!((0.38..0.43).contains(&interval.low) && (0.57..0.62).contains(&interval.high), "{interval:?}");
        assert_eq!(mean_interval(&spread, 1), Some(interval), "seeded: the same interval every time");
        assert_eq!(mean_interval(&[], 1), None);
    }

    #[test]
    fn a_paired_difference_pairs_tasks_by_id_and_cancels_their_difficulty() {
        // Task difficulty varies widely; system a is better by 0.1 on every task.
        let b: std::collections::BTreeMap<String, f64> =
            (0..50).map(|i| (format!("q{i}"), f64::from(i % 10) / 10.0 * 0.8)).collect();
        let a: Vec<(String, f64)> = b.iter().map(|(task, score)| (task.clone(), score + 0.1)).collect();
        let unpaired = mean_interval(&a.iter().map(|(_, s)| *s).collect::<Vec<_>>(), 3).expect("a");
        assert!(unpaired.high - unpaired.low > 0.1, "unpaired, the spread of difficulty dominates: {unpaired:?}");
        let mut with_extra = a.clone();
        with_extra.push(("only-in-a".into(), 1.0));
        let (paired, tasks) = paired_interval(with_extra.iter().map(|(t, s)| (t.as_str(), *s)), &b, 3).expect("paired");
        assert_eq!(tasks, 50, "a task only one system scored is not paired");
        assert!((paired.mean - 0.1).abs() < 1e-12 && (paired.high - paired.low) < 1e-9, "{paired:?}");
        assert!(paired.above_zero());
    }
}
