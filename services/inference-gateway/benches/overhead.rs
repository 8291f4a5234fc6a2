//! What the gateway adds to a turn: latency (p50/p99) of the same turns
//! through the gateway (template, tokenising, Redis trace, parsing, routing)
//! and straight to the policy server, at 1, 8, 64 and 256 concurrent
//! episodes, in one run. The policy is a tiny random Llama with SmolLM2's tokenizer, so
//! the policy's own time does not drown the difference. On a 2-core machine
//! the policy, Redis, the gateway and the clients share the cores: libtorch
//! is held to one thread (in production the gateway has its own pod), and
//! the gateway and direct phases alternate, three times each, because the
//! policy's batching makes any single phase noisy.
//!
//! Run: `cargo bench -p inference-gateway --bench overhead` (or `make bench`).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use sleuth_kit::client::connect;
use sleuth_model::export::{TinyShape, write_random_llama};
use sleuth_proto::common::v1::{ChatMessage, SamplingParams};
use sleuth_proto::inference::v1 as pb;
use sleuth_proto::inference::v1::inference_gateway_client::InferenceGatewayClient;
use sleuth_proto::policy::v1::GenerateRequest;
use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;
use sleuth_testkit::service::wait_serving;
use sleuth_testkit::start_service;

const CONCURRENCY: [usize; 4] = [1, 8, 64, 256];
const TURNS: usize = 3;
/// Alternating gateway/direct rounds per concurrency; small concurrencies get
/// more, so every percentile comes from at least 64 episodes' turns.
const REPEATS: usize = 3;
const NEW_TOKENS: u32 = 4;

fn sampling() -> SamplingParams {
    SamplingParams { temperature: Some(0.0), max_new_tokens: NEW_TOKENS, ..Default::default() }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// One episode of `TURNS` turns through the gateway; per-turn latencies and
/// the prompt token ids the policy server received each turn.
async fn gateway_episode(addr: String, episode: String) -> Result<(Vec<Duration>, Vec<Vec<u32>>)> {
    let mut gateway = InferenceGatewayClient::new(connect(&addr, None, Duration::from_secs(5)).await?);
    let mut messages =
        vec![ChatMessage { role: "user".into(), content: format!("Question {episode}?"), ..Default::default() }];
    let mut latencies = Vec::new();
    for turn in 0..TURNS {
        let started = Instant::now();
        let response = gateway
            .chat(pb::ChatRequest {
                episode_id: episode.clone(),
                messages: messages.clone(),
                sampling: Some(sampling()),
                ..Default::default()
            })
            .await?
            .into_inner();
        latencies.push(started.elapsed());
        messages.push(response.message.context("message")?);
        messages.push(ChatMessage {
            role: "tool".into(),
            content: format!("Observation {turn}."),
            ..Default::default()
        });
    }
    let trace =
        gateway.get_trace(pb::GetTraceRequest { episode_id: episode, ..Default::default() }).await?.into_inner();
    // Each turn's prompt: every segment before that turn's sampled segment.
    let mut prompts = Vec::new();
    let mut tokens = Vec::new();
    for segment in &trace.segments {
        if segment.loss_mask.first() == Some(&1) {
            prompts.push(tokens.clone());
        }
        tokens.extend_from_slice(&segment.token_ids);
    }
    Ok((latencies, prompts))
}

/// The same prompts sent straight to the policy server, turn by turn.
async fn direct_episode(addr: String, episode: String, prompts: Vec<Vec<u32>>) -> Result<Vec<Duration>> {
    let mut policy = PolicyServerClient::new(connect(&addr, None, Duration::from_secs(5)).await?);
    let mut latencies = Vec::new();
    for prompt in prompts {
        let started = Instant::now();
        policy
            .generate(GenerateRequest {
                session_id: episode.clone(),
                prompt_token_ids: prompt,
                sampling: Some(sampling()),
                ..Default::default()
            })
            .await?;
        latencies.push(started.elapsed());
    }
    Ok(latencies)
}

async fn all<T>(tasks: Vec<tokio::task::JoinHandle<Result<T>>>) -> (Vec<T>, usize) {
    let mut done = Vec::new();
    let mut errors = 0;
    for task in tasks {
        match task.await {
            Ok(Ok(value)) => done.push(value),
            Ok(Err(error)) => {
                errors += 1;
                eprintln!("error: {error:#}");
            }
            Err(error) => {
                errors += 1;
                eprintln!("task failed: {error}");
            }
        }
    }
    (done, errors)
}

/// The gateway's CPU work for one turn (render and tokenise what is new, find
/// the new tokens) at several depths of a long episode whose observations are
/// about 2 KB each, beside re-rendering and re-tokenising the whole
/// conversation at the same depth (what a turn cost before it rendered only
/// what is new): the first stays flat, the second grows with the episode.
fn cpu_per_turn(model: &std::path::Path) -> Result<()> {
    use inference_gateway::conversation::{LastReply, Renderer};
    use serde_json::json;
    let renderer = Renderer::load(model)?;
    let template = sleuth_chat::ChatTemplate::from_dir(model)?;
    let tokenizer = tokenizers::Tokenizer::from_file(model.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
    let system = json!({"role": "system", "content": "You answer questions by searching the documents."});
    let observation: String = (0..40).map(|i| format!("Document {i}: rain falls mainly on the plain. ")).collect();
    let reply = "Let me search for that.";
    let mut messages = vec![system.clone(), json!({"role": "user", "content": "What causes rain in Spain?"})];
    let (mut seen, mut sampled) = (0, Vec::new());
    println!("one turn's rendering at depth (observations of {} bytes):", observation.len());
    println!("{:>6} {:>10} {:>14} {:>16} {:>8}", "turn", "tokens", "new only (us)", "whole convo (us)", "ratio");
    for turn in 0..=80 {
        let last = (seen > 0).then(|| LastReply { message: &messages[seen - 1], sampled: &sampled });
        if [2, 10, 40, 80].contains(&turn) {
            let rounds = 50;
            let started = Instant::now();
            for _ in 0..rounds {
                std::hint::black_box(renderer.next_prompt(Some(&system), last, &messages[seen..], &[])?);
            }
            let new_only = started.elapsed().as_secs_f64() * 1e6 / f64::from(rounds);
            let started = Instant::now();
            let mut tokens = 0;
            for _ in 0..rounds {
                let text = template.render(&messages, &[], true)?;
                tokens = tokenizer.encode(text.as_str(), false).map_err(anyhow::Error::msg)?.len();
            }
            let whole = started.elapsed().as_secs_f64() * 1e6 / f64::from(rounds);
            println!("{turn:>6} {tokens:>10} {new_only:>14.0} {whole:>16.0} {:>7.1}x", whole / new_only);
        }
        ensure!(!renderer.next_prompt(Some(&system), last, &messages[seen..], &[])?.drift, "turn {turn} drifted");
        sampled = renderer.reply_tokens(Some(&system), &[], reply)?;
        messages.push(json!({"role": "assistant", "content": reply}));
        seen = messages.len();
        messages.push(json!({"role": "tool", "content": observation}));
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<()> {
    let smollm2 = sleuth_testkit::cache_dir()?.join("models/smollm2-135m-instruct");
    ensure!(smollm2.join("tokenizer.json").is_file(), "{} missing: run `make setup`", smollm2.display());
    let scratch = tempfile::tempdir()?;
    let model = scratch.path().join("tiny");
    write_random_llama(&smollm2, &model, TinyShape::default(), 1)?;
    let model = model.to_str().context("utf-8 path")?.to_owned();
    cpu_per_turn(std::path::Path::new(&model))?;
    let redis = sleuth_testkit::redis()?;
    let redis_url = sleuth_testkit::redis_url(&redis);
    let (policy_addr, _policy) = start_service!(
        policy_server,
        [
            "policy-server",
            "--listen",
            "127.0.0.1:0",
            "--device",
            "cpu",
            "--model",
            &model,
            "--max-batch",
            "256",
            "--max-queue",
            "1024",
            "--torch-threads",
            "1",
        ]
    );
    let (gateway_addr, _gateway) = start_service!(
        inference_gateway,
        sleuth_testkit::service::inference_gateway_args(&model, &redis_url, &policy_addr, "127.0.0.1:0", &[])
    );
    wait_serving(&gateway_addr, "sleuth.inference.v1.InferenceGateway").await?;

    println!("gateway overhead: {TURNS} turns per episode, {NEW_TOKENS} new tokens per turn, tiny random policy");
    println!(
        "{:>11} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7}",
        "episodes", "gw p50", "gw p99", "direct p50", "direct p99", "+p50", "+p99", "errors"
    );
    for concurrency in CONCURRENCY {
        let (mut through, mut direct, mut errors) = (Vec::new(), Vec::new(), 0);
        for repeat in 0..REPEATS.max(64 / concurrency) {
            let round = format!("{concurrency}-{repeat}");
            let tasks = (0..concurrency)
                .map(|i| tokio::spawn(gateway_episode(gateway_addr.clone(), format!("bench-{round}-{i}"))))
                .collect();
            let (gateway_runs, gateway_errors) = all(tasks).await;
            // Fresh session ids: the direct calls get no prefix the gateway's turns left behind.
            let tasks = gateway_runs
                .iter()
                .enumerate()
                .map(|(i, (_, prompts))| {
                    tokio::spawn(direct_episode(policy_addr.clone(), format!("direct-{round}-{i}"), prompts.clone()))
                })
                .collect();
            let (direct_runs, direct_errors) = all(tasks).await;
            through.extend(gateway_runs.into_iter().flat_map(|(l, _)| l));
            direct.extend(direct_runs.into_iter().flatten());
            errors += gateway_errors + direct_errors;
        }
        ensure!(!through.is_empty() && !direct.is_empty(), "no turn finished at {concurrency} episodes");
        through.sort();
        direct.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let (g50, g99, d50, d99) = (
            percentile(&through, 0.5),
            percentile(&through, 0.99),
            percentile(&direct, 0.5),
            percentile(&direct, 0.99),
        );
        println!(
            "{concurrency:>11} {:>8.2}ms {:>8.2}ms {:>8.2}ms {:>8.2}ms {:>+8.2}ms {:>+8.2}ms {:>7}",
            ms(g50),
            ms(g99),
            ms(d50),
            ms(d99),
            ms(g50) - ms(d50),
            ms(g99) - ms(d99),
            errors
        );
    }
    // The gateway's own measure: each turn's wall time minus its wait on the policy.
    let metrics = sleuth_kit::metrics::render();
    println!("\ngateway self time per turn (sleuth_gateway_overhead_seconds, all rounds):");
    for line in metrics.lines().filter(|l| l.starts_with("sleuth_gateway_overhead_seconds")) {
        println!("  {line}");
    }
    Ok(())
}
