//! Training throughput of one GRPO step: Sleuth's learner (libtorch through
//! tch, f32 gradient accumulation, sharded AdamW with one rank) against a
//! plain PyTorch + transformers implementation of the same loss on the same
//! model and batch (bench/peers/grpo_step_peer.py, torch from the project
//! venv), in one run on this machine.
//!
//! Run: `cargo bench -p learner --bench grpo_step` (or `make bench`).

use std::time::Instant;

use anyhow::{Result, ensure};
use learner::batch::Sample;
use learner::loss::{Aggregation, LossConfig, PolicyLoss};
use learner::shard::AdamW;
use learner::trainer::{Objective, Trainer, TrainerConfig};
use serde_json::json;
use sleuth_c10d::Single;
use sleuth_model::{Config, Model, load_weights};
use tch::Device;
use tch::nn::VarStore;

const SEQUENCES: usize = 8;
const PROMPT: usize = 96;
const SAMPLED: usize = 160;
const STEPS: usize = 3;

fn batch() -> Vec<Sample> {
    (0..SEQUENCES)
        .map(|i| {
            let n = PROMPT + SAMPLED - (i * 8);
            let tokens: Vec<i64> = (0..n as i64).map(|t| 1000 + (t * 7919 + i as i64 * 104_729) % 40_000).collect();
            let mask = (0..n).map(|j| if j >= PROMPT { 1.0 } else { 0.0 }).collect();
            let behaviour = (0..n).map(|j| if j >= PROMPT { -2.0 - 0.001 * j as f32 } else { 0.0 }).collect();
            Sample::unsampled(tokens, mask, behaviour, if i % 2 == 0 { 1.0 } else { -1.0 })
        })
        .collect()
}

fn main() -> Result<()> {
    let model_dir = sleuth_testkit::cache_dir()?.join("models/smollm2-135m-instruct");
    ensure!(model_dir.join("config.json").is_file(), "{} missing: run `make setup`", model_dir.display());
    let config = Config::from_file(&model_dir.join("config.json"))?;
    let mut vars = VarStore::new(Device::Cpu);
    let model = Model::new(&vars.root(), &config);
    load_weights(&mut vars, &model_dir)?;
    let trainer_config = TrainerConfig {
        objective: Objective::Rl(LossConfig {
            policy: PolicyLoss::PPO,
            aggregation: Aggregation::TokenMean,
            tis_cap: None,
            kl_coef: 0.0,
        }),
        optimizer: AdamW { lr: 1e-6, ..AdamW::default() },
        max_grad_norm: 1.0,
        micro_batch: SEQUENCES,
    };
    let mut trainer = Trainer::new(vars, model, None, trainer_config, Box::new(Single));
    let samples = batch();
    let tokens: usize = samples.iter().map(|s| s.tokens.len()).sum();
    trainer.step(&samples)?; // warm-up
    let started = Instant::now();
    for _ in 0..STEPS {
        trainer.step(&samples)?;
    }
    let ours = started.elapsed().as_secs_f64() / STEPS as f64;

    let script = sleuth_testkit::checkout_file("bench/peers/grpo_step_peer.py");
    let encoded: Vec<_> = samples
        .iter()
        .map(|s| json!({"tokens": s.tokens, "mask": s.mask, "behaviour": s.behaviour, "advantage": s.advantage}))
        .collect();
    let request = json!({"model_dir": model_dir, "samples": encoded, "steps": STEPS});
    let peer = sleuth_testkit::run_python_json(&script, &[], Some(&request))?;
    let theirs = peer["seconds_per_step"].as_f64().unwrap_or(f64::NAN);

    println!(
        "one GRPO step (PPO loss, AdamW, grad clip), SmolLM2-135M f32, CPU ({} threads), {SEQUENCES} sequences, {tokens} tokens",
        tch::get_num_threads()
    );
    println!("CPU: {}", sleuth_torch::CpuFeatures::detect());
    println!("{:>28} {:>12} {:>12}", "", "s/step", "tokens/s");
    println!("{:>28} {ours:>12.2} {:>12.1}", "sleuth learner", tokens as f64 / ours);
    println!("{:>28} {theirs:>12.2} {:>12.1}", "pytorch + transformers", tokens as f64 / theirs);
    println!("{:>28} {:>25.2}x", "ratio (sleuth / peer)", theirs / ours);
    Ok(())
}
