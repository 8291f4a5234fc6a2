//! From trajectory groups to training samples: each episode's trace becomes
//! one token sequence with its loss mask, the sampler's logprobs of the
//! sampled tokens and the episode's advantage.

use sleuth_proto::common::v1::{SegmentKind, TrajectoryGroup};

use crate::advantage::{Estimator, advantages};

/// One episode, ready for the model. `mask`, `behaviour` are per token of
/// `tokens`: the model predicts token j from tokens ..j, so the first token
/// is never trained on.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub tokens: Vec<i64>,
    pub mask: Vec<f32>,
    pub behaviour: Vec<f32>,
    pub advantage: f32,
    /// The softmax temperature the policy sampled the episode at; the
    /// policy loss scores its tokens at the same one, so the importance
    /// ratio measures a change of policy, not the temperature (as verl
    /// does). 1 for samples nobody sampled (teacher turns, SFT).
    pub temperature: f32,
}

impl Sample {
    /// A sample scored at temperature 1 (teacher turns, copy pre-training).
    pub fn unsampled(tokens: Vec<i64>, mask: Vec<f32>, behaviour: Vec<f32>, advantage: f32) -> Self {
        Self { tokens, mask, behaviour, advantage, temperature: 1.0 }
    }

    pub fn trainable_tokens(&self) -> usize {
        self.mask.iter().skip(1).filter(|&&m| m > 0.5).count()
    }
}

/// A group that cannot be trained on, with the reason naming the place.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("group {group_id:?}: {message}")]
pub struct BadGroup {
    pub group_id: String,
    pub message: String,
}

/// The samples of one group; `None` when the group has no reward spread
/// (filtered: it would only add noise).
pub fn samples(group: &TrajectoryGroup, estimator: Estimator) -> Result<Option<Vec<Sample>>, BadGroup> {
    let bad = |message: String| BadGroup { group_id: group.group_id.clone(), message };
    if group.episodes.is_empty() {
        return Err(bad("has no episodes".into()));
    }
    let rewards: Vec<f64> = group.episodes.iter().map(|e| e.reward).collect();
    if let Some(r) = rewards.iter().find(|r| !r.is_finite()) {
        return Err(bad(format!("reward {r} is not finite")));
    }
    let Some(advantages) = advantages(estimator, &rewards) else { return Ok(None) };
    group
        .episodes
        .iter()
        .zip(advantages)
        .map(|(episode, advantage)| {
            let mut sample = sequence(episode).map_err(|m| bad(format!("episode {:?}: {m}", episode.episode_id)))?;
            sample.advantage = advantage as f32;
            Ok(sample)
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// The oldest policy version that sampled any token of the group, from the
/// versions the inference gateway recorded per trace segment; the version the
/// orchestrator labelled the group with when no episode has sampled tokens.
pub fn oldest_token_version(group: &TrajectoryGroup) -> u64 {
    group
        .episodes
        .iter()
        .filter_map(|e| e.trace.as_ref())
        .flat_map(|t| &t.segments)
        .filter(|s| s.kind == SegmentKind::Policy as i32 && !s.token_ids.is_empty())
        .map(|s| s.policy_version)
        .min()
        .unwrap_or(group.policy_version)
}

/// All of a group's episodes as samples without advantages (trajectory SFT).
pub fn sft_samples(group: &TrajectoryGroup) -> Result<Vec<Sample>, BadGroup> {
    group
        .episodes
        .iter()
        .map(|episode| {
            sequence(episode).map_err(|message| BadGroup {
                group_id: group.group_id.clone(),
                message: format!("episode {:?}: {message}", episode.episode_id),
            })
        })
        .collect()
}

fn sequence(episode: &sleuth_proto::common::v1::Episode) -> Result<Sample, String> {
    let trace = episode.trace.as_ref().ok_or("has no trace")?;
    let mut sample = Sample::unsampled(Vec::new(), Vec::new(), Vec::new(), 0.0);
    let mut temperature = None;
    for (index, segment) in trace.segments.iter().enumerate() {
        let n = segment.token_ids.len();
        if segment.loss_mask.len() != n {
            return Err(format!("segment {index} has {n} token_ids but {} loss_mask entries", segment.loss_mask.len()));
        }
        let sampled = segment.loss_mask.iter().any(|&m| m != 0);
        if sampled && segment.logprobs.len() != n {
            return Err(format!("segment {index} has {n} sampled tokens but {} logprobs", segment.logprobs.len()));
        }
        if let Some(bad) = segment.loss_mask.iter().find(|&&m| m > 1) {
            return Err(format!("segment {index} has loss_mask value {bad} (0 or 1)"));
        }
        if !segment.temperature.is_finite() || segment.temperature < 0.0 {
            return Err(format!("segment {index} has temperature {} (0 or above)", segment.temperature));
        }
        if sampled && segment.temperature > 0.0 {
            match temperature {
                Some(t) if t != segment.temperature => {
                    return Err(format!(
                        "segment {index} was sampled at temperature {}, an earlier one at {t}: one episode, one temperature",
                        segment.temperature
                    ));
                }
                _ => temperature = Some(segment.temperature),
            }
        }
        sample.tokens.extend(segment.token_ids.iter().map(|&t| i64::from(t)));
        sample.mask.extend(segment.loss_mask.iter().map(|&m| f32::from(m)));
        if sampled {
            sample.behaviour.extend_from_slice(&segment.logprobs);
        } else {
            sample.behaviour.extend(std::iter::repeat_n(0.0, n));
        }
    }
    if sample.tokens.len() < 2 {
        return Err(format!("trace has {} tokens; at least 2 are needed", sample.tokens.len()));
    }
    sample.temperature = temperature.unwrap_or(1.0);
    Ok(sample)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sleuth_proto::common::v1::{Episode, SegmentKind, Trace, TraceSegment};

    fn episode(id: &str, reward: f64, sampled: &[u32]) -> Episode {
        Episode {
            episode_id: id.into(),
            reward,
            trace: Some(Trace {
                segments: vec![
                    TraceSegment {
                        kind: SegmentKind::Prompt as i32,
                        token_ids: vec![1, 2, 3],
                        loss_mask: vec![0; 3],
                        ..Default::default()
                    },
                    TraceSegment {
                        kind: SegmentKind::Policy as i32,
                        token_ids: sampled.to_vec(),
                        loss_mask: vec![1; sampled.len()],
                        logprobs: vec![-0.5; sampled.len()],
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn staleness_comes_from_the_recorded_token_versions() {
        let mut old = episode("a", 1.0, &[4, 5]);
        let mut fresh = episode("b", 0.0, &[6]);
        for (episode, version) in [(&mut old, 2), (&mut fresh, 5)] {
            let segments = &mut episode.trace.as_mut().unwrap().segments;
            segments[0].policy_version = 0; // a prompt's version says nothing about sampling
            segments[1].policy_version = version;
        }
        // The orchestrator labelled the group 5 when it started; one episode's tokens are from version 2.
        let group = TrajectoryGroup { episodes: vec![old, fresh.clone()], policy_version: 5, ..Default::default() };
        assert_eq!(oldest_token_version(&group), 2);
        let untraced = TrajectoryGroup {
            episodes: vec![Episode { trace: None, ..fresh }],
            policy_version: 4,
            ..Default::default()
        };
        assert_eq!(oldest_token_version(&untraced), 4, "no sampled token: the group's label");
    }

    #[test]
    fn traces_become_aligned_samples() {
        let group = TrajectoryGroup {
            group_id: "g".into(),
            episodes: vec![episode("a", 1.0, &[7, 8]), episode("b", 0.0, &[9])],
            ..Default::default()
        };
        let samples = samples(&group, Estimator::DrGrpo).unwrap().unwrap();
        assert_eq!(samples[0].tokens, [1, 2, 3, 7, 8]);
        assert_eq!(samples[0].mask, [0.0, 0.0, 0.0, 1.0, 1.0]);
        assert_eq!(samples[0].behaviour, [0.0, 0.0, 0.0, -0.5, -0.5]);
        assert_eq!((samples[0].advantage, samples[1].advantage), (0.5, -0.5));
        assert_eq!(samples[0].trainable_tokens(), 2);
    }

    #[test]
    fn an_episode_keeps_the_temperature_its_tokens_were_sampled_at() {
        let mut warm = episode("a", 1.0, &[7, 8]);
        let mut teacher_turn = warm.trace.as_ref().unwrap().segments[1].clone();
        teacher_turn.token_ids = vec![9];
        (teacher_turn.loss_mask, teacher_turn.logprobs) = (vec![1], vec![0.0]);
        let segments = &mut warm.trace.as_mut().unwrap().segments;
        segments[1].temperature = 0.7;
        segments.push(teacher_turn); // temperature 0: not sampled, says nothing
        let group = TrajectoryGroup { episodes: vec![warm.clone(), episode("b", 0.0, &[6])], ..Default::default() };
        let samples = samples(&group, Estimator::DrGrpo).unwrap().unwrap();
        assert_eq!((samples[0].temperature, samples[1].temperature), (0.7, 1.0), "unrecorded: scored at 1");

        let mut mixed = warm.clone();
        let mut hotter = mixed.trace.as_ref().unwrap().segments[1].clone();
        hotter.temperature = 1.2;
        mixed.trace.as_mut().unwrap().segments.push(hotter);
        let error = sequence(&mixed).unwrap_err();
        assert!(error.contains("segment 3 was sampled at temperature 1.2, an earlier one at 0.7"), "{error}");
        warm.trace.as_mut().unwrap().segments[1].temperature = -1.0;
        assert!(sequence(&warm).unwrap_err().contains("segment 1 has temperature -1"));
    }

    #[test]
    fn flat_groups_are_filtered_and_corrupt_ones_named() {
        let flat =
            TrajectoryGroup { episodes: vec![episode("a", 1.0, &[7]), episode("b", 1.0, &[8])], ..Default::default() };
        assert_eq!(samples(&flat, Estimator::Grpo), Ok(None));
        let mut broken = episode("b", 0.0, &[8, 9]);
        broken.trace.as_mut().unwrap().segments[1].logprobs.pop();
        let group = TrajectoryGroup {
            group_id: "g7".into(),
            episodes: vec![episode("a", 1.0, &[7]), broken],
            ..Default::default()
        };
        let error = samples(&group, Estimator::Grpo).unwrap_err().to_string();
        assert!(
            error.contains("group \"g7\": episode \"b\": segment 1 has 2 sampled tokens but 1 logprobs"),
            "{error}"
        );
    }
}

/// Samples as bytes (rank 0 broadcasts each step's samples to the others):
/// per sample its length, tokens (i64), mask and behaviour (f32), advantage,
/// temperature.
pub fn encode(samples: &[Sample]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend((samples.len() as u64).to_le_bytes());
    for s in samples {
        out.extend((s.tokens.len() as u64).to_le_bytes());
        s.tokens.iter().for_each(|t| out.extend(t.to_le_bytes()));
        s.mask.iter().for_each(|m| out.extend(m.to_le_bytes()));
        s.behaviour.iter().for_each(|b| out.extend(b.to_le_bytes()));
        out.extend(s.advantage.to_le_bytes());
        out.extend(s.temperature.to_le_bytes());
    }
    out
}

/// The inverse of [`encode`].
pub fn decode(bytes: &[u8]) -> Result<Vec<Sample>, String> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let part = bytes.get(at..at + n).ok_or("truncated sample payload")?;
        at += n;
        Ok(part)
    };
    let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let count = u64_at(take(8)?) as usize;
    let mut samples = Vec::with_capacity(count);
    for _ in 0..count {
        let n = u64_at(take(8)?) as usize;
        let tokens = take(8 * n)?.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8"))).collect();
        let mask = take(4 * n)?.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect();
        let behaviour = take(4 * n)?.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect();
        let advantage = f32::from_le_bytes(take(4)?.try_into().expect("4"));
        let temperature = f32::from_le_bytes(take(4)?.try_into().expect("4"));
        samples.push(Sample { tokens, mask, behaviour, advantage, temperature });
    }
    Ok(samples)
}

#[cfg(test)]
mod encoding_tests {
    #[test]
    fn samples_round_trip() {
        let samples = vec![super::Sample {
            tokens: vec![1, 2, 3],
            mask: vec![0.0, 1.0, 1.0],
            behaviour: vec![0.0, -0.5, -1.5],
            advantage: 0.25,
            temperature: 0.7,
        }];
        assert_eq!(super::decode(&super::encode(&samples)).unwrap(), samples);
        assert!(super::decode(&super::encode(&samples)[..20]).is_err());
    }
}

/// The fraction of predicted positions that are trainable. Trajectory SFT
/// refuses a batch where it is 0 (nothing to learn) or 1 (the mask marks
/// prompts and observations as assistant tokens: the trace is wrong).
pub fn trainable_fraction(samples: &[Sample]) -> f64 {
    let positions: usize = samples.iter().map(|s| s.tokens.len().saturating_sub(1)).sum();
    let trainable: usize = samples.iter().map(Sample::trainable_tokens).sum();
    if positions == 0 { 0.0 } else { trainable as f64 / positions as f64 }
}

/// Checks an SFT batch's mask (see [`trainable_fraction`]); returns the fraction.
pub fn check_sft_mask(samples: &[Sample]) -> Result<f64, String> {
    let fraction = trainable_fraction(samples);
    if fraction <= 0.0 {
        return Err("trajectory SFT: the loss mask marks no token as trainable (no assistant tokens)".into());
    }
    if fraction >= 1.0 {
        return Err(
            "trajectory SFT: the loss mask marks every token as trainable; prompts and observations must be 0".into()
        );
    }
    Ok(fraction)
}

#[cfg(test)]
mod sft_tests {
    use super::*;

    fn sample(mask: &[f32]) -> Sample {
        Sample::unsampled(vec![1; mask.len()], mask.to_vec(), vec![0.0; mask.len()], 0.0)
    }

    #[test]
    fn sft_refuses_all_or_nothing_masks() {
        assert_eq!(check_sft_mask(&[sample(&[0.0, 1.0, 1.0, 0.0, 1.0])]), Ok(0.75));
        assert!(check_sft_mask(&[sample(&[0.0, 0.0, 0.0])]).unwrap_err().contains("no token"));
        assert!(check_sft_mask(&[sample(&[1.0, 1.0, 1.0])]).unwrap_err().contains("every token"));
    }
}
