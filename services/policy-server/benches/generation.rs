//! Generation benchmark: the policy server's engine (continuous batching in
//! libtorch) against `transformers` `generate()` on the same SmolLM2-135M
//! weights, f32, on this machine, in one run.
//!
//! - decode tokens/s at batch 1, 8 and 32 (greedy, exactly N new tokens each);
//! - prefill tokens/s (one 512-token prompt);
//! - a 10-turn episode (each turn appends ~200 observation tokens and
//!   generates 50) with and without prefix reuse: prefilled tokens and time.
//!
//! Run: `make bench` (needs `make setup`'s venv and imported model).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Result, ensure};
use policy_server::engine::{Engine, Event, Job, Limits};
use serde_json::{Value, json};
use sleuth_model::sampling::Sampling;

const NEW_TOKENS: usize = 32;
const BATCHES: [usize; 3] = [1, 8, 32];
const PREFILL: usize = 512;
const TURNS: usize = 10;
const OBSERVATION: usize = 200;
const TURN_TOKENS: usize = 50;

/// The model with its EOS ids removed, so every sequence generates exactly
/// as many tokens as asked (transformers gets `min_new_tokens` for the same).
fn model_without_eos(model: &Path, scratch: &Path) -> Result<PathBuf> {
    let dir = scratch.join("model");
    std::fs::create_dir_all(&dir)?;
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json"))?)?;
    config["eos_token_id"] = Value::Null;
    std::fs::write(dir.join("config.json"), config.to_string())?;
    std::os::unix::fs::symlink(model.join("model.safetensors"), dir.join("model.safetensors"))?;
    Ok(dir)
}

fn job(session: &str, prompt: Vec<i64>, max_new_tokens: usize) -> Job {
    Job {
        session: session.to_owned(),
        prompt,
        sampling: Sampling { temperature: 0.0, ..Sampling::default() },
        seed: 0,
        max_new_tokens,
        stop_tokens: Vec::new(),
    }
}

/// Runs jobs concurrently; returns (generated tokens, cached prompt tokens) per job.
async fn run(engine: &Engine, jobs: Vec<Job>) -> Result<Vec<(Vec<i64>, usize)>> {
    let mut receivers = Vec::new();
    for job in jobs {
        receivers.push(engine.generate(job)?);
    }
    let mut results = Vec::new();
    for mut events in receivers {
        let mut tokens = Vec::new();
        let mut cached = 0;
        while let Some(event) = events.recv().await {
            match event? {
                Event::Token { sampled, .. } => tokens.push(i64::from(sampled.token)),
                Event::Done { cached_prompt_tokens, .. } => cached = cached_prompt_tokens,
            }
        }
        results.push((tokens, cached));
    }
    Ok(results)
}

fn tokens(count: usize, seed: i64) -> Vec<i64> {
    (0..count as i64).map(|i| 1000 + (i * 7919 + seed * 104_729) % 40_000).collect()
}

#[tokio::main]
async fn main() -> Result<()> {
    let model = sleuth_testkit::cache_dir()?.join("models/smollm2-135m-instruct");
    ensure!(model.join("config.json").is_file(), "{} missing: run `make setup`", model.display());
    let scratch = tempfile::tempdir()?;
    let dir = model_without_eos(&model, scratch.path())?;
    let limits = Limits { max_batch: 32, kv_budget_tokens: 1 << 20, max_queue: 1024, prefix_cache_tokens: 1 << 20 };
    let engine = Engine::start(dir, tch::Device::Cpu, tch::Kind::Float, limits)?;
    let prompt = tokens(32, 1);
    run(&engine, vec![job("", prompt.clone(), 2)]).await?; // warm-up

    let mut ours = Vec::new();
    for batch in BATCHES {
        let started = Instant::now();
        let results = run(&engine, (0..batch).map(|_| job("", prompt.clone(), NEW_TOKENS)).collect()).await?;
        let generated: usize = results.iter().map(|(t, _)| t.len()).sum();
        ours.push(generated as f64 / started.elapsed().as_secs_f64());
    }
    let long = tokens(PREFILL, 2);
    let started = Instant::now();
    run(&engine, vec![job("", long.clone(), 1)]).await?;
    let our_prefill = PREFILL as f64 / started.elapsed().as_secs_f64();

    // 10-turn episode: each turn's prompt is the whole history plus a new observation.
    let mut episode = [(0usize, 0.0f64); 2];
    for (index, session) in ["", "episode"].iter().enumerate() {
        let mut history = tokens(64, 3);
        let started = Instant::now();
        let mut prefilled = 0;
        for turn in 0..TURNS {
            history.extend(tokens(OBSERVATION, 10 + turn as i64));
            let results = run(&engine, vec![job(session, history.clone(), TURN_TOKENS)]).await?;
            let (generated, cached) = &results[0];
            prefilled += history.len() - cached;
            history.extend(generated);
        }
        episode[index] = (prefilled, started.elapsed().as_secs_f64());
    }

    let script = sleuth_testkit::checkout_file("bench/peers/transformers_generate_peer.py");
    let request = json!({"model_dir": model, "prompt": prompt, "batches": BATCHES, "new_tokens": NEW_TOKENS, "prefill_tokens": long});
    let peer = sleuth_testkit::run_python_json(&script, &[], Some(&request))?;

    println!(
        "SmolLM2-135M-Instruct, f32, CPU ({} threads), greedy, {NEW_TOKENS} new tokens per sequence",
        tch::get_num_threads()
    );
    println!("{:>22} {:>14} {:>16} {:>8}", "", "sleuth tok/s", "transformers", "ratio");
    for (batch, ours) in BATCHES.iter().zip(&ours) {
        let theirs = peer["decode_tokens_per_s"][batch.to_string()].as_f64().unwrap_or(0.0);
        println!("{:>22} {ours:>14.1} {theirs:>16.1} {:>7.2}x", format!("decode, batch {batch}"), ours / theirs);
    }
    let theirs = peer["prefill_tokens_per_s"].as_f64().unwrap_or(0.0);
    println!(
        "{:>22} {our_prefill:>14.1} {theirs:>16.1} {:>7.2}x",
        format!("prefill, {PREFILL} tokens"),
        our_prefill / theirs
    );
    let [(without, without_s), (with, with_s)] = episode;
    println!(
        "\n{TURNS}-turn episode (+{OBSERVATION} observation tokens, {TURN_TOKENS} generated per turn):\n  \
         without prefix reuse: {without} tokens prefilled, {without_s:.1} s\n  \
         with prefix reuse:    {with} tokens prefilled, {with_s:.1} s\n  \
         prefill work {:.1}x less, {:.2}x faster",
        without as f64 / with as f64,
        without_s / with_s
    );
    Ok(())
}
