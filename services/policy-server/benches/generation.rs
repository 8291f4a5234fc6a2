//! Generation benchmark: the policy server's engine (continuous batching in
//! libtorch) against `transformers` `generate()` on the same SmolLM2-135M
//! weights, in f32 and in bf16, on this machine, in one run.
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
        stop_strings: None,
        min_version: 0,
        run: String::new(),
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

/// The dtypes both sides run in: (engine kind, torch dtype name).
const DTYPES: [(tch::Kind, &str); 2] = [(tch::Kind::Float, "float32"), (tch::Kind::BFloat16, "bfloat16")];

struct Throughput {
    /// Tokens/s per entry of `BATCHES`.
    decode: Vec<f64>,
    prefill: f64,
}

async fn throughput(engine: &Engine, prompt: &[i64], long: &[i64]) -> Result<Throughput> {
    run(engine, vec![job("", prompt.to_vec(), 2)]).await?; // warm-up
    let mut decode = Vec::new();
    for batch in BATCHES {
        let started = Instant::now();
        let results = run(engine, (0..batch).map(|_| job("", prompt.to_vec(), NEW_TOKENS)).collect()).await?;
        let generated: usize = results.iter().map(|(t, _)| t.len()).sum();
        decode.push(generated as f64 / started.elapsed().as_secs_f64());
    }
    let started = Instant::now();
    run(engine, vec![job("", long.to_vec(), 1)]).await?;
    Ok(Throughput { decode, prefill: long.len() as f64 / started.elapsed().as_secs_f64() })
}

/// A 10-turn episode (each turn's prompt is the whole history plus a new
/// observation): (tokens prefilled, seconds), without and with prefix reuse.
async fn episodes(engine: &Engine) -> Result<[(usize, f64); 2]> {
    let mut episode = [(0usize, 0.0f64); 2];
    for (index, session) in ["", "episode"].iter().enumerate() {
        let mut history = tokens(64, 3);
        let started = Instant::now();
        let mut prefilled = 0;
        for turn in 0..TURNS {
            history.extend(tokens(OBSERVATION, 10 + turn as i64));
            let results = run(engine, vec![job(session, history.clone(), TURN_TOKENS)]).await?;
            let (generated, cached) = &results[0];
            prefilled += history.len() - cached;
            history.extend(generated);
        }
        episode[index] = (prefilled, started.elapsed().as_secs_f64());
    }
    Ok(episode)
}

#[tokio::main]
async fn main() -> Result<()> {
    let model = sleuth_testkit::cache_dir()?.join("models/smollm2-135m-instruct");
    ensure!(model.join("config.json").is_file(), "{} missing: run `make setup`", model.display());
    let scratch = tempfile::tempdir()?;
    let dir = model_without_eos(&model, scratch.path())?;
    let limits = Limits {
        max_batch: 32,
        kv_budget_tokens: 1 << 20,
        max_queue: 1024,
        prefix_cache_tokens: 1 << 20,
        torch_threads: 0,
    };
    let prompt = tokens(32, 1);
    let long = tokens(PREFILL, 2);

    let mut ours = Vec::new();
    let mut episode = None;
    for (kind, _) in DTYPES {
        let engine = Engine::start(dir.clone(), tch::Device::Cpu, kind, limits)?;
        ours.push(throughput(&engine, &prompt, &long).await?);
        if episode.is_none() {
            episode = Some(episodes(&engine).await?);
        }
    }

    let script = sleuth_testkit::checkout_file("bench/peers/transformers_generate_peer.py");
    let dtypes: Vec<&str> = DTYPES.iter().map(|(_, name)| *name).collect();
    let request = json!({"model_dir": model, "dtypes": dtypes, "prompt": prompt, "batches": BATCHES, "new_tokens": NEW_TOKENS, "prefill_tokens": long});
    let peer = sleuth_testkit::run_python_json(&script, &[], Some(&request))?;
    let theirs: Vec<Throughput> = dtypes
        .iter()
        .map(|dtype| Throughput {
            decode: BATCHES
                .iter()
                .map(|b| peer[dtype]["decode_tokens_per_s"][b.to_string()].as_f64().unwrap_or(0.0))
                .collect(),
            prefill: peer[dtype]["prefill_tokens_per_s"].as_f64().unwrap_or(0.0),
        })
        .collect();

    println!(
        "SmolLM2-135M-Instruct, CPU ({} threads), greedy, {NEW_TOKENS} new tokens per sequence; tokens/s",
        tch::get_num_threads()
    );
    // bf16 is fast only with native bf16 arithmetic; the figures mean little without this line.
    let cpu = sleuth_torch::CpuFeatures::detect();
    println!(
        "CPU: {cpu} (native bf16: {}; `--dtype auto` picks {:?})",
        cpu.native_bf16(),
        sleuth_torch::DtypeSpec::Auto.resolve(tch::Device::Cpu).kind
    );
    println!(
        "{:>22} {:>10} {:>10} {:>7} | {:>10} {:>10} {:>7} | {:>22}",
        "", "sleuth f32", "hf f32", "ratio", "sleuth bf16", "hf bf16", "ratio", "sleuth bf16 / hf f32"
    );
    let row = |label: String, pick: &dyn Fn(&Throughput) -> f64| {
        let (o32, t32, o16, t16) = (pick(&ours[0]), pick(&theirs[0]), pick(&ours[1]), pick(&theirs[1]));
        println!(
            "{label:>22} {o32:>10.1} {t32:>10.1} {:>6.2}x | {o16:>10.1} {t16:>10.1} {:>6.2}x | {:>21.2}x",
            o32 / t32,
            o16 / t16,
            o16 / t32
        );
    };
    for (i, batch) in BATCHES.iter().enumerate() {
        row(format!("decode, batch {batch}"), &|t| t.decode[i]);
    }
    row(format!("prefill, {PREFILL} tokens"), &|t| t.prefill);

    let [(without, without_s), (with, with_s)] = episode.expect("measured with the first dtype");
    println!(
        "\n{TURNS}-turn episode, f32 (+{OBSERVATION} observation tokens, {TURN_TOKENS} generated per turn):\n  \
         without prefix reuse: {without} tokens prefilled, {without_s:.1} s\n  \
         with prefix reuse:    {with} tokens prefilled, {with_s:.1} s\n  \
         prefill work {:.1}x less, {:.2}x faster",
        without as f64 / with as f64,
        without_s / with_s
    );
    Ok(())
}
