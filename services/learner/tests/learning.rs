//! A few GRPO steps teach a tiny random policy a verifiable toy task: the
//! reward of an episode is the fraction of its 8 sampled tokens that are
//! token 7 (1 in 16 at the start). Sampling, behaviour logprobs, groups,
//! advantages, the PPO loss and AdamW all take their real paths.

use anyhow::Result;
use learner::advantage::Estimator;
use learner::batch::samples;
use learner::collective::Single;
use learner::loss::{Aggregation, LossConfig, PolicyLoss};
use learner::shard::AdamW;
use learner::trainer::{Objective, Trainer, TrainerConfig};
use sleuth_model::sampling::{Rng, Sampling, sample};
use sleuth_model::{Config, Model};
use sleuth_proto::common::v1::{Episode, SegmentKind, Trace, TraceSegment, TrajectoryGroup};
use tch::nn::VarStore;
use tch::{Device, Tensor};

const TARGET: u32 = 7;
const NEW_TOKENS: usize = 8;
const GROUP: usize = 8;
const PROMPTS: [[u32; 3]; 4] = [[1, 2, 3], [4, 5, 6], [2, 9, 4], [11, 3, 8]];
const STEPS: usize = 12;

fn episode(model: &Model, prompt: &[u32], rng: &mut Rng) -> Episode {
    let mut tokens: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
    let (mut sampled, mut logprobs) = (Vec::new(), Vec::new());
    tch::no_grad(|| {
        for _ in 0..NEW_TOKENS {
            let logits = model.forward(&Tensor::from_slice(&tokens).unsqueeze(0), None);
            let next = sample(&logits.get(0).get(-1), &Sampling::default(), rng);
            sampled.push(next.token);
            logprobs.push(next.logprob);
            tokens.push(i64::from(next.token));
        }
    });
    let hits = sampled.iter().filter(|&&t| t == TARGET).count();
    Episode {
        reward: hits as f64 / NEW_TOKENS as f64,
        trace: Some(Trace {
            segments: vec![
                TraceSegment {
                    kind: SegmentKind::Prompt as i32,
                    token_ids: prompt.to_vec(),
                    loss_mask: vec![0; prompt.len()],
                    ..Default::default()
                },
                TraceSegment {
                    kind: SegmentKind::Policy as i32,
                    loss_mask: vec![1; sampled.len()],
                    token_ids: sampled,
                    logprobs,
                    ..Default::default()
                },
            ],
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn grpo_raises_the_reward_of_a_tiny_policy() -> Result<()> {
    tch::manual_seed(11);
    let config: Config = serde_json::from_value(serde_json::json!({
        "model_type": "llama", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "tie_word_embeddings": true
    }))?;
    let vars = VarStore::new(Device::Cpu);
    let model = Model::new(&vars.root(), &config);
    tch::no_grad(|| {
        for (name, mut var) in vars.variables() {
            if !name.ends_with("norm.weight") {
                var.copy_(&(var.randn_like() * 0.02));
            }
        }
    });
    let trainer_config = TrainerConfig {
        objective: Objective::Rl(LossConfig {
            policy: PolicyLoss::PPO,
            aggregation: Aggregation::TokenMean,
            tis_cap: None,
            kl_coef: 0.0,
        }),
        optimizer: AdamW { lr: 2e-2, ..AdamW::default() },
        max_grad_norm: 1.0,
        micro_batch: 8,
    };
    let mut trainer = Trainer::new(vars, model, None, trainer_config, Box::new(Single));
    let mut rng = Rng::new(5);
    let mut curve = Vec::new();
    for step in 0..STEPS {
        let groups: Vec<TrajectoryGroup> = PROMPTS
            .iter()
            .enumerate()
            .map(|(i, prompt)| TrajectoryGroup {
                group_id: format!("{step}-{i}"),
                episodes: (0..GROUP).map(|_| episode(&trainer.model, prompt, &mut rng)).collect(),
                ..Default::default()
            })
            .collect();
        let rewards: Vec<f64> = groups.iter().flat_map(|g| g.episodes.iter().map(|e| e.reward)).collect();
        curve.push(rewards.iter().sum::<f64>() / rewards.len() as f64);
        let batch: Vec<_> = groups
            .iter()
            .filter_map(|g| samples(g, Estimator::Grpo).transpose())
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .flatten()
            .collect();
        if !batch.is_empty() {
            trainer.step(&batch)?;
        }
    }
    let curve_text: Vec<String> = curve.iter().map(|r| format!("{r:.3}")).collect();
    println!("mean reward per step: {}", curve_text.join(" "));
    let start = curve[..2].iter().sum::<f64>() / 2.0;
    let end = curve[STEPS - 2..].iter().sum::<f64>() / 2.0;
    assert!(end > start + 0.25, "reward went from {start:.3} to {end:.3}: {curve_text:?}");
    Ok(())
}

#[test]
fn trajectory_sft_fits_teacher_trajectories_on_assistant_tokens_only() -> Result<()> {
    tch::manual_seed(12);
    let config: Config = serde_json::from_value(serde_json::json!({
        "model_type": "llama", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "tie_word_embeddings": true
    }))?;
    let vars = VarStore::new(Device::Cpu);
    let model = Model::new(&vars.root(), &config);
    let trainer_config = TrainerConfig {
        objective: Objective::Sft(Aggregation::TokenMean),
        optimizer: AdamW { lr: 1e-2, ..AdamW::default() },
        max_grad_norm: 1.0,
        micro_batch: 4,
    };
    let mut trainer = Trainer::new(vars, model, None, trainer_config, Box::new(Single));
    // Teacher: after the prompt, always 7 7 7 7; the prompt itself (mask 0) is noise.
    let teacher: Vec<learner::batch::Sample> = PROMPTS
        .iter()
        .map(|prompt| {
            let tokens: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).chain([7, 7, 7, 7]).collect();
            let mask = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0].to_vec();
            learner::batch::Sample { behaviour: vec![0.0; tokens.len()], tokens, mask, advantage: 0.0 }
        })
        .collect();
    assert_eq!(learner::batch::check_sft_mask(&teacher), Ok(4.0 / 6.0));
    let losses: Vec<f64> = (0..15).map(|_| trainer.step(&teacher).map(|s| s.loss)).collect::<Result<_, _>>()?;
    println!("SFT loss per step: {losses:.3?}");
    assert!(losses[14] < losses[0] * 0.3, "SFT loss fell from {:.3} to {:.3}", losses[0], losses[14]);
    Ok(())
}
