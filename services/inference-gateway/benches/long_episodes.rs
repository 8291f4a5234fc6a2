//! The gateway's own time per turn deep into a long episode: 50 turns, each
//! answered by a tool observation of about 2,000 tokens, through the real
//! gateway and Redis. Turns are scripted teacher replies, so no policy runs
//! and what is timed is the gateway's work alone: reading and writing the
//! trace, checking the history's digest, rendering and tokenising what is
//! new. Beside it, what re-rendering and re-tokenising the whole
//! conversation costs at the same depth (what every turn cost before the
//! gateway rendered only what is new). Turn k is the call after k observations.
//!
//! Run: `cargo bench -p inference-gateway --bench long_episodes` (or `make bench`).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::json;
use sleuth_kit::client::connect;
use sleuth_proto::common::v1::{ChatMessage, SamplingParams};
use sleuth_proto::inference::v1 as pb;
use sleuth_proto::inference::v1::inference_gateway_client::InferenceGatewayClient;
use sleuth_testkit::start_service;

const TURNS: usize = 50;
const REPORTED: [usize; 3] = [1, 10, 50];
const EPISODES: usize = 3;
const OBSERVATION_TOKENS: usize = 2000;

fn message(role: &str, content: &str) -> ChatMessage {
    ChatMessage { role: role.into(), content: content.into(), ..Default::default() }
}

/// An observation of about `OBSERVATION_TOKENS` tokens: search hits as an agent sees them.
fn observation(tokenizer: &tokenizers::Tokenizer) -> Result<String> {
    let mut text = String::new();
    for i in 0.. {
        text.push_str(&format!(
            "[d{i}] Rainfall in the Iberian plateau depends on Atlantic fronts, relief and the season; \
             station {i} recorded {} mm in the wettest month.\n",
            40 + i * 7 % 90
        ));
        let tokens = tokenizer.encode(text.as_str(), false).map_err(anyhow::Error::msg)?.len();
        if tokens >= OBSERVATION_TOKENS {
            break;
        }
    }
    Ok(text)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<()> {
    let model = sleuth_testkit::smollm2()?;
    let tokenizer = tokenizers::Tokenizer::from_file(model.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
    let template = sleuth_chat::ChatTemplate::from_dir(&model)?;
    let model = model.to_str().context("utf-8 path")?.to_owned();
    let redis = sleuth_testkit::redis()?;
    let redis_url = sleuth_testkit::redis_url(&redis);
    // Teacher turns never reach a policy server; the address only satisfies the configuration.
    let (gateway_addr, _gateway) = start_service!(
        inference_gateway,
        sleuth_testkit::service::inference_gateway_args(&model, &redis_url, "127.0.0.1:9", "127.0.0.1:0", &[])
    );
    let mut gateway = InferenceGatewayClient::new(connect(&gateway_addr, None, Duration::from_secs(5)).await?);
    let observation = observation(&tokenizer)?;
    let reply = r#"<tool_call>[{"name": "search", "arguments": {"query": "rainfall in Spain"}}]</tool_call>"#;

    // per_turn[e][k]: the gateway's time for turn k of episode e.
    let mut per_turn = vec![Vec::new(); EPISODES];
    let mut conversations = Vec::new();
    for (episode, times) in per_turn.iter_mut().enumerate() {
        let mut messages = vec![
            message("system", "Answer by searching the documents; cite what you find."),
            message("user", "Why does it rain more in the north of Spain?"),
        ];
        for turn in 0..=TURNS {
            let request = pb::ChatRequest {
                episode_id: format!("long-{episode}"),
                messages: messages.clone(),
                sampling: Some(SamplingParams { max_new_tokens: 64, ..Default::default() }),
                teacher_reply: reply.to_owned(),
                turns_before: Some(turn as u32),
                ..Default::default()
            };
            let started = Instant::now();
            let response = gateway.chat(request).await?.into_inner();
            times.push(started.elapsed());
            ensure!(!response.drift, "turn {turn} drifted");
            messages.push(response.message.context("message")?);
            messages.push(ChatMessage {
                role: "tool".into(),
                content: observation.clone(),
                tool_call_id: format!("call_{turn}_0"),
                ..Default::default()
            });
        }
        conversations.push(messages);
    }

    let trace = gateway
        .get_trace(pb::GetTraceRequest { episode_id: "long-0".into(), ..Default::default() })
        .await?
        .into_inner();
    let trace_tokens: usize = trace.segments.iter().map(|s| s.token_ids.len()).sum();
    println!(
        "long episodes: {TURNS} turns, observations of {} tokens, {EPISODES} episodes (median), trace of {trace_tokens} tokens",
        tokenizer.encode(observation.as_str(), false).map_err(anyhow::Error::msg)?.len()
    );
    println!("{:>6} {:>12} {:>16} {:>22}", "turn", "tokens", "gateway (ms)", "whole re-render (ms)");
    let mut medians = Vec::new();
    for turn in REPORTED {
        let mut times: Vec<Duration> = per_turn.iter().map(|t| t[turn]).collect();
        times.sort();
        let median = times[EPISODES / 2];
        medians.push(median);
        // The old per-turn cost: the conversation as sent at this turn, rendered and tokenised whole.
        let sent = &conversations[0][..2 * turn + 2];
        let sent: Vec<serde_json::Value> = sent.iter().map(|m| json!({"role": m.role, "content": m.content})).collect();
        let started = Instant::now();
        let text = template.render(&sent, &[], true)?;
        let tokens = tokenizer.encode(text.as_str(), false).map_err(anyhow::Error::msg)?.len();
        let whole = started.elapsed();
        println!("{turn:>6} {tokens:>12} {:>16.1} {:>22.1}", median.as_secs_f64() * 1e3, whole.as_secs_f64() * 1e3);
    }
    let ratio = medians[medians.len() - 1].as_secs_f64() / medians[0].as_secs_f64();
    println!("turn {} / turn {}: {ratio:.2}x (target: within 1.5x)", REPORTED[REPORTED.len() - 1], REPORTED[0]);
    Ok(())
}
