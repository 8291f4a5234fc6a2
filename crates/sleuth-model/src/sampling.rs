//! Sampling a next token, with the logprobs the learner's importance ratios
//! depend on.
//!
//! For every sampled token two logprobs exist:
//!
//! - the **behaviour logprob**: `log p(token)` under the distribution the
//!   token was actually drawn from: logits divided by the temperature, cut to
//!   the `top_k` most likely tokens, then to the smallest most-likely set whose
//!   probability reaches `top_p`, and renormalised over what is left. Greedy
//!   decoding (temperature 0) draws from a point mass: its behaviour logprob is 0.
//! - the **model logprob**: `log_softmax(logits)[token]` at temperature 1
//!   without truncation, the policy's own probability of the token.

use tch::{Kind, Tensor};

/// How one sequence samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 = greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 = no nucleus cut.
    pub top_p: f32,
    /// 0 = no top-k cut.
    pub top_k: usize,
}

impl Default for Sampling {
    fn default() -> Self {
        Self { temperature: 1.0, top_p: 1.0, top_k: 0 }
    }
}

impl Sampling {
    /// Checks the parameters, naming the offending one.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0 && self.temperature <= 100.0) {
            return Err(format!("temperature must be between 0 and 100, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        Ok(())
    }
}

/// A sampled token and its logprobs (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    pub model_logprob: f32,
}

/// A small, fast, seedable generator (SplitMix64): each request owns one, so
/// its draws are reproducible from its seed whatever else is in the batch.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Samples the next token of every row of `logits` ([rows, vocab]), each row
/// with its own parameters and generator. Greedy rows are decided in one
/// batched pass; the others are sampled row by row.
pub fn sample_rows(logits: &Tensor, rows: &mut [(&Sampling, &mut Rng)]) -> Vec<Sampled> {
    let logits = logits.to_kind(Kind::Float);
    let model_logprobs = logits.log_softmax(-1, Kind::Float);
    let greedy = Vec::<i64>::try_from(logits.argmax(-1, false)).unwrap_or_default();
    let greedy_logprobs = Vec::<f32>::try_from(
        model_logprobs
            .gather(1, &Tensor::from_slice(&greedy).to_device(logits.device()).unsqueeze(1), false)
            .squeeze_dim(1),
    )
    .unwrap_or_default();
    rows.iter_mut()
        .enumerate()
        .map(|(row, (sampling, rng))| {
            if sampling.temperature == 0.0 {
                Sampled { token: greedy[row] as u32, logprob: 0.0, model_logprob: greedy_logprobs[row] }
            } else {
                sample(&logits.get(row as i64), sampling, rng)
            }
        })
        .collect()
}

/// Samples from one row of logits (`[vocab]`, any float kind).
pub fn sample(logits: &Tensor, sampling: &Sampling, rng: &mut Rng) -> Sampled {
    let logits = logits.to_kind(Kind::Float);
    let model_logprobs = logits.log_softmax(-1, Kind::Float);
    if sampling.temperature == 0.0 {
        let token = logits.argmax(-1, false).int64_value(&[]);
        let model_logprob = model_logprobs.double_value(&[token]) as f32;
        return Sampled { token: token as u32, logprob: 0.0, model_logprob };
    }
    let scaled = logits / f64::from(sampling.temperature);
    let vocab = scaled.size()[0];
    let (values, indices) = if sampling.top_k > 0 && (sampling.top_k as i64) < vocab {
        scaled.topk(sampling.top_k as i64, -1, true, true)
    } else {
        scaled.sort(-1, true)
    };
    let mut keep = values.size()[0];
    if sampling.top_p < 1.0 {
        let cumulative =
            Vec::<f32>::try_from(values.softmax(-1, Kind::Float).cumsum(-1, Kind::Float)).unwrap_or_default();
        // The smallest prefix whose mass reaches top_p; never empty.
        keep = cumulative.iter().position(|&c| c >= sampling.top_p).map_or(keep, |i| i as i64 + 1);
    }
    let kept_logprobs =
        Vec::<f32>::try_from(values.narrow(0, 0, keep).log_softmax(-1, Kind::Float)).unwrap_or_default();
    let draw = rng.next_f64();
    let mut cumulative = 0.0f64;
    let mut choice = kept_logprobs.len() - 1;
    for (i, logprob) in kept_logprobs.iter().enumerate() {
        cumulative += f64::from(logprob.exp());
        if draw < cumulative {
            choice = i;
            break;
        }
    }
    let token = indices.int64_value(&[choice as i64]);
    Sampled {
        token: token as u32,
        logprob: kept_logprobs[choice],
        model_logprob: model_logprobs.double_value(&[token]) as f32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Tensor {
        Tensor::from_slice(&[2.0f32, 1.0, 0.5, -1.0, -3.0])
    }

    #[test]
    fn greedy_takes_the_argmax_with_behaviour_logprob_zero() {
        let sampled = sample(&logits(), &Sampling { temperature: 0.0, ..Default::default() }, &mut Rng::new(1));
        assert_eq!(sampled.token, 0);
        assert_eq!(sampled.logprob, 0.0);
        let expected = logits().log_softmax(-1, Kind::Float).double_value(&[0]) as f32;
        assert!((sampled.model_logprob - expected).abs() < 1e-6);
    }

    #[test]
    fn behaviour_logprob_is_under_the_truncated_tempered_distribution() {
        let sampling = Sampling { temperature: 0.7, top_k: 3, top_p: 1.0 };
        let mut rng = Rng::new(7);
        let kept = (logits().narrow(0, 0, 3) / 0.7).log_softmax(-1, Kind::Float);
        for _ in 0..50 {
            let s = sample(&logits(), &sampling, &mut rng);
            assert!(s.token < 3, "top_k=3 sampled token {}", s.token);
            let expected = kept.double_value(&[i64::from(s.token)]) as f32;
            assert!((s.logprob - expected).abs() < 1e-5, "{} vs {expected}", s.logprob);
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_the_mass() {
        // softmax([2, 1, 0.5, -1, -3]) ~ [0.61, 0.22, 0.14, 0.03, 0.004]: top_p 0.8 keeps two tokens.
        let sampling = Sampling { temperature: 1.0, top_p: 0.8, top_k: 0 };
        let mut rng = Rng::new(3);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            seen.insert(sample(&logits(), &sampling, &mut rng).token);
        }
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), [0, 1]);
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens() {
        let sampling = Sampling::default();
        let draw = |seed| {
            (0..20)
                .map({
                    let mut rng = Rng::new(seed);
                    move |_| sample(&logits(), &sampling, &mut rng).token
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }

    #[test]
    fn sampling_frequencies_follow_the_distribution() {
        let sampling = Sampling::default();
        let mut rng = Rng::new(11);
        let n = 4000;
        let zeros = (0..n).filter(|_| sample(&logits(), &sampling, &mut rng).token == 0).count();
        let expected = logits().softmax(-1, Kind::Float).double_value(&[0]);
        assert!((zeros as f64 / n as f64 - expected).abs() < 0.03);
    }

    #[test]
    fn batched_rows_sample_like_single_rows() {
        let logits = Tensor::stack(&[logits(), logits().flip([0]), logits() * 0.5], 0);
        let greedy = Sampling { temperature: 0.0, ..Default::default() };
        let warm = Sampling { temperature: 0.8, top_k: 4, top_p: 0.95 };
        let (mut a, mut b, mut c) = (Rng::new(1), Rng::new(2), Rng::new(3));
        let batched = sample_rows(&logits, &mut [(&greedy, &mut a), (&warm, &mut b), (&greedy, &mut c)]);
        let (mut b2, mut c2) = (Rng::new(2), Rng::new(3));
        assert_eq!(batched[0], sample(&logits.get(0), &greedy, &mut Rng::new(1)));
        assert_eq!(batched[1], sample(&logits.get(1), &warm, &mut b2));
        assert_eq!(batched[2], sample(&logits.get(2), &greedy, &mut c2));
    }

    #[test]
    fn rejects_bad_parameters_by_name() {
        assert!(Sampling { temperature: -1.0, ..Default::default() }.validate().unwrap_err().contains("temperature"));
        assert!(
            Sampling { top_p: 0.0, ..Default::default() }
                .validate()
                .unwrap_err()
                .contains("top_p must be in (0, 1], got 0")
        );
    }
}
