//! What the learner takes off the run's stream: each entry's fate (trained,
//! or dropped as stale, flat, below the SFT reward threshold or corrupt),
//! the tally of the step being formed, reading entries (and those a lost
//! reply delivered), acknowledging exactly the trained ones, and announcing
//! its progress to the orchestrator.

use prost::Message;
use sleuth_proto::common::v1::{Episode, TrajectoryGroup};
use sleuth_store::patiently;
use sleuth_store::trajectories::{self, Entry, EntryId, GroupConsumer};

use crate::Error;
use crate::batch::{self, Sample};
use crate::checkpoint::Meta;
use crate::learn::{Plan, Sources};
use crate::records::{Disposition, GroupRecord};

/// What forming one step did with the entries it took. It reaches the
/// checkpoint's counters and stream position only once the step has trained:
/// a step abandoned at shutdown is formed again from the same entries (still
/// pending in the stream) after the restart, and must not count twice.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// What became of each group taken, in stream order.
    pub(crate) groups: Vec<GroupRecord>,
    /// The step's last entry: the checkpoint's stream position once trained.
    pub(crate) last: Option<EntryId>,
}

impl Tally {
    pub(crate) fn count(&self, disposition: Disposition) -> u64 {
        self.groups.iter().filter(|g| g.disposition == disposition).count() as u64
    }

    pub(crate) fn trained(&self) -> u64 {
        self.count(Disposition::Trained)
    }

    pub(crate) fn groups(&self) -> u64 {
        self.groups.len() as u64
    }

    /// Adds the step's counts to `meta`; returns the groups' records.
    pub(crate) fn apply(self, meta: &mut Meta) -> Vec<GroupRecord> {
        meta.groups_consumed += self.trained();
        meta.groups_dropped_stale += self.count(Disposition::Stale);
        meta.groups_filtered += self.count(Disposition::Flat) + self.count(Disposition::BelowMinReward);
        meta.groups_rejected += self.count(Disposition::Rejected);
        if let Some(last) = self.last {
            meta.stream_position = last.to_string();
        }
        self.groups
    }
}

/// Flat groups in a row after which the learner says so (and again each
/// time the streak doubles): a few flat groups are normal, a batch's worth
/// four times over is a policy that no longer varies.
pub(crate) const FLAT_STREAK_WARNING: u64 = 32;

/// Groups in a row whose episodes all got one reward. A policy that stopped
/// varying its episodes (a step that collapsed it, a sampling temperature
/// near 0) makes every group flat, and GRPO then takes no step at all, so
/// nothing, the KL anchor included, moves it back: an operator must hear of
/// it instead of watching a run go on to its end unchanged.
#[derive(Debug, Default)]
pub(crate) struct FlatStreak(u64);

impl FlatStreak {
    /// Counts one group's `disposition`; returns the streak when it is due
    /// to be reported ([`FLAT_STREAK_WARNING`], then each doubling).
    pub(crate) fn observe(&mut self, disposition: Disposition) -> Option<u64> {
        self.0 = if disposition == Disposition::Flat { self.0 + 1 } else { 0 };
        (self.0.is_multiple_of(FLAT_STREAK_WARNING) && (self.0 / FLAT_STREAK_WARNING).is_power_of_two())
            .then_some(self.0)
    }
}

/// Tells the orchestrator (through Redis) the version now served and how
/// many groups the learner is done with: its staleness window moves on.
pub(crate) async fn announce(sources: &Sources, run_id: &str, version: u64, taken: u64) -> Result<(), Error> {
    patiently("announcing the learner's version", sources.patience, || {
        trajectories::set_learner_version(&sources.redis, run_id, version)
    })
    .await?;
    patiently("announcing the groups taken", sources.patience, || {
        trajectories::set_groups_taken(&sources.redis, run_id, taken)
    })
    .await?;
    Ok(())
}

/// Up to `count` new entries for this consumer. A read whose reply was lost
/// (Redis went away mid-answer) still delivered its entries to us, pending:
/// after a failed read the pending entries not in `known` are taken instead,
/// or they would wait for the next restart.
pub(crate) async fn read_fresh(
    consumer: &GroupConsumer,
    count: usize,
    known: &[EntryId],
    patience: std::time::Duration,
) -> Result<Vec<Entry>, Error> {
    match consumer.read_new(count).await {
        Ok(fresh) => Ok(fresh),
        Err(error) => {
            tracing::warn!(%error, "reading the run's stream failed; taking what was delivered");
            let mut pending = patiently("reclaiming pending entries", patience, || consumer.reclaim_pending()).await?;
            pending.retain(|e| !known.contains(&e.id));
            pending.sort_by_key(|e| e.id);
            Ok(pending)
        }
    }
}

/// Acknowledges the entries inside the checkpoint `meta` describes (those up
/// to its stream position) and keeps read-ahead ones, which no step has
/// trained yet: acknowledging those would lose them in a crash.
pub(crate) async fn commit_trained(
    consumer: &GroupConsumer,
    uncommitted: &mut Vec<EntryId>,
    meta: &Meta,
    patience: std::time::Duration,
) -> Result<(), Error> {
    let Ok(position) = meta.stream_position.parse::<EntryId>() else { return Ok(()) };
    let (trained, ahead): (Vec<EntryId>, Vec<EntryId>) = uncommitted.iter().partition(|id| **id <= position);
    patiently("acknowledging trained entries", patience, || consumer.commit(&trained)).await?;
    *uncommitted = ahead;
    Ok(())
}

/// Turns one entry into samples for the step after `version` (none when the
/// group is dropped) and the record of what became of it.
pub(crate) fn take_group(entry: &Entry, plan: &Plan, version: u64) -> (Vec<Sample>, GroupRecord) {
    let mut record = GroupRecord {
        entry_id: entry.id.to_string(),
        group_id: String::new(),
        step: version + 1,
        disposition: Disposition::Rejected,
        detail: String::new(),
        token_version: 0,
    };
    let rejected = |mut record: GroupRecord, why: String| {
        record.detail = why;
        (Vec::new(), record)
    };
    let Some(payload) = &entry.payload else { return rejected(record, "entry has no group field".into()) };
    let group = match TrajectoryGroup::decode(payload.as_slice()) {
        Ok(group) => group,
        Err(e) => return rejected(record, format!("not a TrajectoryGroup: {e}")),
    };
    record.group_id.clone_from(&group.group_id);
    // Staleness of the tokens themselves (the versions the gateway recorded
    // for each sampled token), not of the label the orchestrator gave the group
    // when it started: an episode can outlive several weight updates.
    record.token_version = batch::oldest_token_version(&group);
    if plan.sft {
        // A teacher's episodes are off-policy by design: no staleness, a reward threshold.
        let kept = TrajectoryGroup { episodes: best_episodes(&group, plan.sft_min_reward), ..group.clone() };
        if kept.episodes.is_empty() {
            record.disposition = Disposition::BelowMinReward;
            record.detail = format!("no episode rewarded at least sft_min_reward {}", plan.sft_min_reward);
            return (Vec::new(), record);
        }
        return match batch::sft_samples(&kept) {
            Ok(samples) => {
                record.disposition = Disposition::Trained;
                (samples, record)
            }
            Err(e) => rejected(record, e.to_string()),
        };
    }
    if version.saturating_sub(record.token_version) > plan.max_staleness {
        record.disposition = Disposition::Stale;
        record.detail = format!(
            "tokens sampled by version {}, learner at {version}, max_staleness {}",
            record.token_version, plan.max_staleness
        );
        return (Vec::new(), record);
    }
    match batch::samples(&group, plan.estimator) {
        Ok(Some(samples)) => {
            record.disposition = Disposition::Trained;
            (samples, record)
        }
        Ok(None) => {
            record.disposition = Disposition::Flat;
            record.detail = "every episode has the same reward".into();
            (Vec::new(), record)
        }
        Err(e) => rejected(record, e.to_string()),
    }
}

/// Rejection sampling of a teacher's group: its episodes with the group's
/// highest reward, when that reaches `min_reward`, and of those the ones
/// that took the fewest turns. A mixture teacher plays one question several
/// ways (hops, which bridge), so the reward, not a rule, decides which way
/// SFT learns for that question; keeping every episode above the threshold
/// taught the policy each way alike. The fewest turns because a hop after
/// the answer was found scores as high (the ranking keeps the opening
/// search's hits first): keeping those ties taught the policy to hop where
/// its opening search had already won, which GRPO did not unlearn
/// (docs/learner.md, Trajectory SFT, has the counts).
fn best_episodes(group: &TrajectoryGroup, min_reward: f64) -> Vec<Episode> {
    let best = group.episodes.iter().map(|e| e.reward).filter(|r| r.is_finite()).fold(f64::NEG_INFINITY, f64::max);
    let at_best = |e: &&Episode| e.reward >= min_reward && e.reward >= best;
    let fewest = group.episodes.iter().filter(at_best).map(|e| e.turns).min();
    group.episodes.iter().filter(at_best).filter(|e| Some(e.turns) == fewest).cloned().collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use sleuth_proto::common::v1::{Episode, Trace, TraceSegment};

    use super::*;

    fn plan(sft: bool) -> Plan {
        Plan {
            run_id: "r".into(),
            sft,
            sft_min_reward: 0.5,
            rehearsal: None,
            learning_rate: 1e-3,
            lr_schedule: Default::default(),
            estimator: crate::advantage::Estimator::Grpo,
            global_batch_size: 1,
            max_staleness: 1,
            checkpoint_every: 1,
            max_steps: 0,
            start_model_uri: None,
            validation: None,
        }
    }

    /// A segment with lengths a fuzzer picks (mask and logprobs may disagree with the tokens).
    fn segment() -> impl Strategy<Value = TraceSegment> {
        (0i32..5, 0usize..6, 0usize..7, 0usize..7, any::<u64>()).prop_map(|(kind, tokens, mask, logprobs, version)| {
            TraceSegment {
                kind,
                token_ids: (0..tokens as u32).collect(),
                loss_mask: vec![1; mask],
                logprobs: vec![-1.0; logprobs],
                policy_version: version % 4,
                ..Default::default()
            }
        })
    }

    fn episode() -> impl Strategy<Value = Episode> {
        (
            prop_oneof![Just(0.0), Just(1.0), Just(f64::NAN), Just(f64::INFINITY), any::<f64>()],
            proptest::option::of(proptest::collection::vec(segment(), 0..4)),
        )
            .prop_map(|(reward, segments)| Episode {
                reward,
                trace: segments.map(|segments| Trace { segments, ..Default::default() }),
                ..Default::default()
            })
    }

    #[test]
    fn a_teachers_group_keeps_its_best_episodes_above_the_threshold_in_the_fewest_turns() {
        let group = |played: &[(f64, u32)]| TrajectoryGroup {
            episodes: played.iter().map(|&(reward, turns)| Episode { reward, turns, ..Default::default() }).collect(),
            ..Default::default()
        };
        let kept = |played: &[(f64, u32)], min| -> Vec<(f64, u32)> {
            best_episodes(&group(played), min).iter().map(|e| (e.reward, e.turns)).collect()
        };
        assert_eq!(
            kept(&[(0.9, 2), (0.4, 1), (0.9, 2), (f64::NAN, 1)], 0.5),
            [(0.9, 2), (0.9, 2)],
            "ties at the top all teach"
        );
        assert_eq!(
            kept(&[(0.9, 3), (0.9, 2), (0.4, 1), (0.9, 2), (0.9, 4)], 0.5),
            [(0.9, 2), (0.9, 2)],
            "a hop after the best reward was reached teaches nothing"
        );
        assert_eq!(kept(&[(0.4, 1), (0.3, 1)], 0.5), Vec::<(f64, u32)>::new(), "the best is still below the threshold");
        assert_eq!(kept(&[(f64::NAN, 1)], f64::NEG_INFINITY), Vec::<(f64, u32)>::new());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

        /// Any stream payload (a group of any shape, or bytes that are no
        /// group): samples whose arrays agree, or a recorded reason; never a panic.
        #[test]
        fn any_payload_is_trained_or_recorded_with_a_reason(
            episodes in proptest::collection::vec(episode(), 0..5),
            noise in proptest::collection::vec(any::<u8>(), 0..64),
            sft in any::<bool>(),
            version in 0u64..6,
        ) {
            let group = TrajectoryGroup { group_id: "g".into(), episodes, ..Default::default() };
            for payload in [Some(group.encode_to_vec()), Some(noise.clone()), None] {
                let entry = Entry { id: EntryId(1, 0), payload };
                let (samples, record) = take_group(&entry, &plan(sft), version);
                match record.disposition {
                    Disposition::Trained => {
                        prop_assert!(!samples.is_empty());
                        for sample in &samples {
                            prop_assert_eq!(sample.tokens.len(), sample.mask.len());
                            prop_assert_eq!(sample.tokens.len(), sample.behaviour.len());
                            prop_assert!(sample.advantage.is_finite());
                        }
                    }
                    _ => prop_assert!(samples.is_empty() && (!record.detail.is_empty() || record.disposition != Disposition::Rejected)),
                }
            }
        }
    }

    #[test]
    fn a_streak_of_flat_groups_is_reported_at_the_threshold_and_each_doubling_and_ends_with_any_other_group() {
        let mut streak = FlatStreak::default();
        let reported: Vec<u64> =
            (0..5 * FLAT_STREAK_WARNING).filter_map(|_| streak.observe(Disposition::Flat)).collect();
        assert_eq!(reported, [FLAT_STREAK_WARNING, 2 * FLAT_STREAK_WARNING, 4 * FLAT_STREAK_WARNING]);
        assert_eq!(streak.observe(Disposition::Stale), None);
        let again: Vec<u64> = (0..FLAT_STREAK_WARNING).filter_map(|_| streak.observe(Disposition::Flat)).collect();
        assert_eq!(again, [FLAT_STREAK_WARNING], "a trained or stale group starts a new streak");
        assert_eq!(streak.observe(Disposition::Trained), None);
    }
}
