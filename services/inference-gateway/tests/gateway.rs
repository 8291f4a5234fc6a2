//! The gateway with a real policy server (SmolLM2) and real Redis: turns are
//! recorded token for token, later turns extend the recorded tokens, drift is
//! detected, and traces survive a gateway restart.

use std::time::Duration;

use anyhow::{Context, Result};
use sleuth_kit::client::{MeshChannel, connect};
use sleuth_proto::common::v1::{ChatMessage, SamplingParams, SegmentKind, ToolSpec, Trace};
use sleuth_proto::inference::v1 as pb;
use sleuth_proto::inference::v1::inference_gateway_client::InferenceGatewayClient;
use tonic::Code;

use sleuth_testkit::service::inference_gateway_args as gateway_args;
use sleuth_testkit::service::policy_server_args;
use sleuth_testkit::service::wait_serving as serving;
use sleuth_testkit::start_service as start;

fn user(text: &str) -> ChatMessage {
    ChatMessage { role: "user".into(), content: text.into(), ..Default::default() }
}

fn chat(episode: &str, messages: &[ChatMessage]) -> pb::ChatRequest {
    pb::ChatRequest {
        episode_id: episode.into(),
        messages: messages.to_vec(),
        sampling: Some(SamplingParams { temperature: Some(0.0), max_new_tokens: 24, ..Default::default() }),
        logprobs: true,
        ..Default::default()
    }
}

fn tokens(trace: &Trace) -> Vec<u32> {
    trace.segments.iter().flat_map(|s| s.token_ids.iter().copied()).collect()
}

/// A search tool the model may call.
fn search_tool() -> ToolSpec {
    ToolSpec {
        name: "search".into(),
        description: "Search the documents for a query.".into(),
        parameters_json: r#"{"type": "object", "properties": {"query": {"type": "string"}}}"#.into(),
    }
}

/// One policy server (SmolLM2 on the CPU, f32) behind a gateway, with Redis;
/// everything stops when it drops.
struct OneReplica {
    model: String,
    redis_url: String,
    policy_addr: String,
    gateway: InferenceGatewayClient<MeshChannel>,
    _policy: sleuth_testkit::service::Running<policy_server::Error>,
    /// The gateway server (a test may stop it and start another).
    gateway_server: sleuth_testkit::service::Running<inference_gateway::Error>,
    _redis: sleuth_testkit::TestServer,
}

async fn one_replica() -> Result<OneReplica> {
    one_replica_with(&[]).await
}

/// [`one_replica`] with `extra` gateway flags.
async fn one_replica_with(extra: &[&str]) -> Result<OneReplica> {
    let model = sleuth_testkit::smollm2()?;
    let model = model.to_str().context("utf-8 path")?.to_owned();
    let redis = sleuth_testkit::redis()?;
    let redis_url = sleuth_testkit::redis_url(&redis);
    // publish_version reloads the model's own directory as a checkpoint.
    let (policy_addr, policy) = start!(policy_server, policy_server_args(&model, &["--checkpoint-roots", &model]));
    let (gateway_addr, gateway_stop) =
        start!(inference_gateway, gateway_args(&model, &redis_url, &policy_addr, "127.0.0.1:0", extra));
    serving(&gateway_addr, "sleuth.inference.v1.InferenceGateway").await?;
    let gateway = InferenceGatewayClient::new(connect(&gateway_addr, None, Duration::from_secs(5)).await?);
    Ok(OneReplica {
        model,
        redis_url,
        policy_addr,
        gateway,
        _policy: policy,
        gateway_server: gateway_stop,
        _redis: redis,
    })
}

/// Has the policy server serve `run`'s `version`: the same weights, reloaded from the model directory.
async fn publish_version(stack: &OneReplica, run: &str, version: u64) -> Result<()> {
    use sleuth_proto::policy::v1 as policy;
    let header = policy::UpdateWeightsRequest {
        part: Some(policy::update_weights_request::Part::Header(policy::WeightsHeader {
            version,
            checkpoint_uri: stack.model.clone(),
            run_id: run.into(),
            ..Default::default()
        })),
    };
    let channel = connect(&stack.policy_addr, None, Duration::from_secs(5)).await?;
    policy::policy_server_client::PolicyServerClient::new(channel).update_weights(tokio_stream::iter([header])).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_are_recorded_token_for_token_and_survive_a_restart() -> Result<()> {
    let stack = one_replica().await?;
    let mut gateway = stack.gateway.clone();

    let mut messages = vec![user("What is the capital of France?")];
    let first = gateway.chat(chat("ep-1", &messages)).await?.into_inner();
    let reply = first.message.clone().context("message")?;
    assert_eq!(reply.content, "The capital of France is Paris.");
    assert_eq!(first.finish_reason, "stop");
    assert!(!first.drift);

    messages.push(reply);
    messages.push(user("And the capital of Italy?"));
    let second = gateway.chat(chat("ep-1", &messages)).await?.into_inner();
    assert!(!second.drift, "the reply re-renders to the tokens the policy produced");
    let usage = second.usage.context("usage")?;
    assert!(usage.cached_prompt_tokens > 30, "turn 2 reused the episode's cached prefix: {usage:?}");

    let trace =
        gateway.get_trace(pb::GetTraceRequest { episode_id: "ep-1".into(), ..Default::default() }).await?.into_inner();
    let kinds: Vec<i32> = trace.segments.iter().map(|s| s.kind).collect();
    let (prompt, policy) = (SegmentKind::Prompt as i32, SegmentKind::Policy as i32);
    assert_eq!(kinds, [prompt, policy, prompt, policy]);
    for segment in &trace.segments {
        let expected_mask = if segment.kind == policy { 1 } else { 0 };
        assert!(segment.loss_mask.iter().all(|&m| m == expected_mask));
        assert_eq!(segment.loss_mask.len(), segment.token_ids.len());
        if segment.kind == policy {
            assert_eq!(segment.logprobs.len(), segment.token_ids.len());
        }
    }
    // The trace is exactly what the policy saw and produced: turn 2's prompt
    // (all tokens before the last segment) plus its sampled tokens.
    let all = tokens(&trace);
    assert_eq!(usage.prompt_tokens as usize + second.token_ids.len(), all.len());
    assert_eq!(&all[all.len() - second.token_ids.len()..], second.token_ids.as_slice());

    // A restarted gateway (same Redis) continues the episode.
    let OneReplica { model, redis_url, policy_addr, gateway_server, _policy, _redis, .. } = stack;
    gateway_server.stop().await?;
    let (restarted, _restarted_stop) =
        start!(inference_gateway, gateway_args(&model, &redis_url, &policy_addr, "127.0.0.1:0", &[]));
    serving(&restarted, "sleuth.inference.v1.InferenceGateway").await?;
    let mut gateway = InferenceGatewayClient::new(connect(&restarted, None, Duration::from_secs(5)).await?);
    let finished = gateway
        .finish_episode(pb::FinishEpisodeRequest { episode_id: "ep-1".into(), ..Default::default() })
        .await?
        .into_inner();
    assert_eq!(finished, trace);

    // An edited history no longer matches what the policy produced: drift is
    // counted and the recorded tokens are kept.
    let mut edited = messages.clone();
    edited[1].content = "Paris, of course.".into();
    edited.push(second.message.context("message")?);
    edited.push(user("Thanks!"));
    let third = gateway.chat(chat("ep-1", &edited)).await?.into_inner();
    assert!(third.drift);
    let after =
        gateway.get_trace(pb::GetTraceRequest { episode_id: "ep-1".into(), ..Default::default() }).await?.into_inner();
    assert_eq!(after.drift_events, 1);
    assert!(tokens(&after).starts_with(&all), "recorded tokens are never rewritten");

    // Bad input names the field.
    let status = gateway.chat(chat("", &messages)).await.unwrap_err();
    assert!(status.code() == Code::InvalidArgument && status.message().contains("episode_id"), "{status:?}");
    let status = gateway.chat(chat("ep-1", &messages[..1])).await.unwrap_err();
    assert!(status.code() == Code::InvalidArgument && status.message().contains("never truncated"), "{status:?}");
    let status =
        gateway.get_trace(pb::GetTraceRequest { episode_id: "nope".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    Ok(())
}

/// POSTs JSON over HTTP/1.1 and returns (status, body).
async fn post(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &serde_json::Value,
) -> Result<(u16, serde_json::Value)> {
    post_text(addr, path, headers, &body.to_string()).await
}

/// POSTs `body` as it is (valid JSON or not); the status and the JSON answer.
async fn post_text(addr: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Result<(u16, serde_json::Value)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status: u16 = response.split_whitespace().nth(1).context("status line")?.parse()?;
    let json = response.split("\r\n\r\n").nth(1).context("body")?;
    Ok((status, serde_json::from_str(json.trim()).with_context(|| format!("body: {json}"))?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_endpoint_runs_the_same_turns() -> Result<()> {
    let model = sleuth_testkit::smollm2()?;
    let model = model.to_str().context("utf-8 path")?.to_owned();
    let redis = sleuth_testkit::redis()?;
    let redis_url = sleuth_testkit::redis_url(&redis);
    let (policy_addr, _policy) = start!(policy_server, policy_server_args(&model, &[]));
    let http = format!("127.0.0.1:{}", sleuth_testkit::free_port()?);
    let (gateway_addr, _gateway) = start!(
        inference_gateway,
        gateway_args(&model, &redis_url, &policy_addr, &http, &["--auth-token", "http-test-token"])
    );
    serving(&gateway_addr, "sleuth.inference.v1.InferenceGateway").await?;
    let auth = ("authorization", "Bearer http-test-token");
    let question = serde_json::json!({
        "model": "anything",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 24,
        "logprobs": true
    });

    let (status, body) = post(&http, "/episodes/http-1/v1/chat/completions", &[auth], &question).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["content"], "The capital of France is Paris.");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 0);
    assert_eq!(
        body["choices"][0]["logprobs"]["content"].as_array().map(Vec::len),
        body["usage"]["completion_tokens"].as_u64().map(|n| n as usize)
    );

    // A stop string ends the reply before it (OpenAI's semantics; the reply is
    // trimmed as every reply is); a string or a list.
    for (stop, content) in [
        (serde_json::json!("Paris"), "The capital of France is"),
        (serde_json::json!(["is", "France"]), "The capital of"),
    ] {
        let mut stopped = question.clone();
        stopped["stop"] = stop;
        let episode = format!("/episodes/http-stop-{content}/v1/chat/completions").replace(' ', "-");
        let (status, body) = post(&http, &episode, &[auth], &stopped).await?;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["choices"][0]["message"]["content"], content);
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
    }

    // The header form names the same kind of episode; the trace is the gRPC one.
    let (status, _) =
        post(&http, "/v1/chat/completions", &[auth, ("x-sleuth-episode-id", "http-2")], &question).await?;
    assert_eq!(status, 200);
    let mut grpc = InferenceGatewayClient::new(
        connect(&gateway_addr, Some(&"http-test-token".parse()?), Duration::from_secs(5)).await?,
    );
    let trace =
        grpc.get_trace(pb::GetTraceRequest { episode_id: "http-2".into(), ..Default::default() }).await?.into_inner();
    assert_eq!(trace.segments.len(), 2);

    // Errors come in OpenAI's shape with HTTP codes.
    let (status, body) = post(&http, "/v1/chat/completions", &[auth], &question).await?;
    assert_eq!(status, 400);
    assert!(body["error"]["message"].as_str().unwrap_or_default().contains("x-sleuth-episode-id"), "{body}");
    let (status, body) = post(&http, "/episodes/http-3/v1/chat/completions", &[], &question).await?;
    assert_eq!((status, body["error"]["type"].as_str()), (401, Some("authentication_error")));
    let bad_stop = serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", 3]});
    let (status, body) = post(&http, "/episodes/http-3/v1/chat/completions", &[auth], &bad_stop).await?;
    assert_eq!(status, 400);
    assert!(body["error"]["message"].as_str().unwrap_or_default().contains("stop[1]"), "{body}");
    let bad = serde_json::json!({"messages": [{"role": "user", "content": [1, 2]}]});
    let (status, body) = post(&http, "/episodes/http-3/v1/chat/completions", &[auth], &bad).await?;
    assert_eq!(status, 400);
    assert!(body["error"]["message"].as_str().unwrap_or_default().contains("messages[0].content"), "{body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn episodes_stick_to_a_replica_and_fail_over_when_it_dies() -> Result<()> {
    let model = sleuth_testkit::smollm2()?;
    let model = model.to_str().context("utf-8 path")?.to_owned();
    let redis = sleuth_testkit::redis()?;
    let redis_url = sleuth_testkit::redis_url(&redis);
    let (first_addr, first_stop) = start!(policy_server, policy_server_args(&model, &[]));
    let (second_addr, _second) = start!(policy_server, policy_server_args(&model, &[]));
    let replicas = format!("{first_addr},{second_addr}");
    let (gateway_addr, _gateway) =
        start!(inference_gateway, gateway_args(&model, &redis_url, &replicas, "127.0.0.1:0", &[]));
    serving(&gateway_addr, "sleuth.inference.v1.InferenceGateway").await?;
    let mut gateway = InferenceGatewayClient::new(connect(&gateway_addr, None, Duration::from_secs(5)).await?);

    // An episode whose own replica is the first one.
    let routing = inference_gateway::routing::Replicas::new(
        &[first_addr.clone(), second_addr.clone()],
        None,
        Duration::from_secs(60),
    )?;
    let episode = (0..100)
        .map(|i| format!("sticky-{i}"))
        .find(|e| routing.order(e)[0].address == first_addr)
        .context("an episode on the first replica")?;

    let mut messages = vec![user("What is the capital of France?")];
    let first = gateway.chat(chat(&episode, &messages)).await?.into_inner();
    messages.push(first.message.context("message")?);
    messages.push(user("And the capital of Italy?"));
    let second = gateway.chat(chat(&episode, &messages)).await?.into_inner();
    assert!(second.usage.context("usage")?.cached_prompt_tokens > 30, "turn 2 went to the replica holding turn 1");

    // Its replica goes away: the next turn fails over instead of failing.
    first_stop.stop().await?;
    messages.push(second.message.context("message")?);
    messages.push(user("Thanks!"));
    let third = gateway.chat(chat(&episode, &messages)).await?.into_inner();
    assert_eq!(third.usage.context("usage")?.cached_prompt_tokens, 0, "served by the other replica, without its cache");
    let trace =
        gateway.get_trace(pb::GetTraceRequest { episode_id: episode, ..Default::default() }).await?.into_inner();
    assert_eq!(trace.segments.len(), 6, "all three turns recorded");
    Ok(())
}

/// A training run's turns are sampled by weights no older than the run's
/// learner version: a replica behind it (restarted on its base weights, or
/// holding another run's weights) holds the turn until it is brought up to
/// date, generating nothing before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_turns_wait_for_a_replica_serving_its_version() -> Result<()> {
    let stack = one_replica().await?;
    let mut gateway = stack.gateway.clone();
    let store = sleuth_store::RedisStore::open(&stack.redis_url)?;
    sleuth_store::trajectories::set_learner_version(&store, "run-w", 1).await?;

    // Outside a run any weights serve.
    let messages = vec![user("What is the capital of France?")];
    assert_eq!(gateway.chat(chat("free", &messages)).await?.into_inner().policy_version, 0);

    // Nor does another run's version 1: version numbers count each run's own steps.
    publish_version(&stack, "run-x", 1).await?;
    let turn = pb::ChatRequest { run_id: "run-w".into(), ..chat("w-1", &messages) };
    let waiting = tokio::spawn({
        let mut gateway = gateway.clone();
        async move { gateway.chat(turn).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!waiting.is_finished(), "a replica on run-x's weights must not serve a turn of run-w at version 1");
    publish_version(&stack, "run-w", 1).await?;
    let reply = waiting.await??.into_inner();
    assert_eq!(reply.policy_version, 1);
    let trace =
        gateway.get_trace(pb::GetTraceRequest { episode_id: "w-1".into(), ..Default::default() }).await?.into_inner();
    let sampled = trace.segments.iter().filter(|s| s.kind == SegmentKind::Policy as i32);
    assert!(sampled.clone().count() == 1 && sampled.clone().all(|s| s.policy_version == 1), "{trace:?}");
    Ok(())
}

/// A scripted teacher's reply is recorded as the tokens the policy would
/// have sampled to write it: parsed like a sampled reply, traced as a policy
/// segment (trainable, logprobs 0, no sampling temperature), and the
/// policy's next turn, sampled at 0.7 and recorded so, continues from it
/// without drift.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teachers_reply_is_traced_as_the_policys_own_tokens() -> Result<()> {
    let stack = one_replica().await?;
    let mut gateway = stack.gateway.clone();
    let tool = search_tool();
    let call = r#"<tool_call>[{"name": "search", "arguments": {"query": "capital of France"}}]</tool_call>"#;
    let mut messages = vec![user("What is the capital of France?")];
    let mut taught =
        pb::ChatRequest { tools: vec![tool.clone()], teacher_reply: call.into(), ..chat("teacher-1", &messages) };
    // Within the turn's budget (as the policy, a longer reply is cut at max_new_tokens).
    taught.sampling.as_mut().context("sampling")?.max_new_tokens = 64;
    let first = gateway.chat(taught).await?.into_inner();
    let reply = first.message.clone().context("message")?;
    assert_eq!(first.finish_reason, "tool_calls");
    assert_eq!(reply.tool_calls.len(), 1);
    assert_eq!(reply.tool_calls[0].arguments_json, r#"{"query":"capital of France"}"#);

    messages.push(reply.clone());
    messages.push(ChatMessage {
        role: "tool".into(),
        content: "Paris is the capital of France.".into(),
        tool_call_id: reply.tool_calls[0].id.clone(),
        ..Default::default()
    });
    let mut sampled = pb::ChatRequest { tools: vec![tool], ..chat("teacher-1", &messages) };
    sampled.sampling.as_mut().context("sampling")?.temperature = Some(0.7);
    let second = gateway.chat(sampled).await?;
    assert!(!second.into_inner().drift, "the policy's turn continues the teacher's tokens");

    let trace = gateway
        .get_trace(pb::GetTraceRequest { episode_id: "teacher-1".into(), ..Default::default() })
        .await?
        .into_inner();
    let policy: Vec<_> = trace.segments.iter().filter(|s| s.kind == SegmentKind::Policy as i32).collect();
    assert_eq!(policy.len(), 2);
    let tokenizer = tokenizers::Tokenizer::from_file(format!("{}/tokenizer.json", stack.model))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let written = tokenizer.decode(&policy[0].token_ids, false).map_err(|e| anyhow::anyhow!("{e}"))?;
    assert_eq!(written, format!("{call}<|im_end|>"), "the reply's tokens through the end of turn");
    assert!(policy[0].logprobs.iter().all(|&l| l == 0.0) && policy[0].loss_mask.iter().all(|&m| m == 1));
    // The learner scores sampled tokens at their temperature; the teacher's were not sampled.
    assert_eq!((policy[0].temperature, policy[1].temperature), (0.0, 0.7), "{policy:?}");
    assert_eq!(trace.drift_events, 0);
    Ok(())
}

/// A policy server and a gateway serving HTTP too, with `extra` gateway
/// flags, once the gateway is SERVING (health needs no token); everything
/// stops when it drops.
struct HttpStack {
    /// The OpenAI-compatible endpoint's address.
    http: String,
    /// The gateway's gRPC address.
    grpc: String,
    _policy: sleuth_testkit::service::Running<policy_server::Error>,
    _gateway: sleuth_testkit::service::Running<inference_gateway::Error>,
    _redis: sleuth_testkit::TestServer,
}

async fn http_stack(extra: &[&str]) -> Result<HttpStack> {
    let model = sleuth_testkit::smollm2()?;
    let model = model.to_str().context("utf-8 path")?.to_owned();
    let redis = sleuth_testkit::redis()?;
    let redis_url = sleuth_testkit::redis_url(&redis);
    let (policy_addr, policy) = start!(policy_server, policy_server_args(&model, &[]));
    let http = format!("127.0.0.1:{}", sleuth_testkit::free_port()?);
    let (grpc, gateway) = start!(inference_gateway, gateway_args(&model, &redis_url, &policy_addr, &http, extra));
    serving(&grpc, "sleuth.inference.v1.InferenceGateway").await?;
    Ok(HttpStack { http, grpc, _policy: policy, _gateway: gateway, _redis: redis })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_runs_a_tool_calling_round_trip() -> Result<()> {
    let stack = http_stack(&["--auth-token", "client-token"]).await?;
    let (http, gateway_addr) = (stack.http.clone(), stack.grpc.clone());
    let script = sleuth_testkit::checkout_file("services/inference-gateway/tests/openai_client.py");
    let base_url = format!("http://{http}/episodes/openai-1/v1");
    let summary = tokio::task::spawn_blocking(move || {
        sleuth_testkit::run_python_json(&script, &[base_url.as_ref(), "client-token".as_ref()], None)
    })
    .await??;
    assert_eq!(summary["finish_reason"], "tool_calls", "{summary}");
    assert_eq!(summary["tool_calls"][0]["name"], "search", "{summary}");
    assert_eq!(summary["tool_calls"][0]["arguments"]["query"], "black holes", "{summary}");
    assert_eq!(summary["logprobs"], summary["completion_tokens"]);
    assert!(summary["second"]["cached_tokens"].as_u64().unwrap_or(0) > 100, "turn 2 reused turn 1: {summary}");

    // The assistant's tool call re-rendered to exactly the tokens the policy
    // sampled (no drift), and the tool result is an observation segment.
    let mut grpc = InferenceGatewayClient::new(
        connect(&gateway_addr, Some(&"client-token".parse()?), Duration::from_secs(5)).await?,
    );
    let trace =
        grpc.get_trace(pb::GetTraceRequest { episode_id: "openai-1".into(), ..Default::default() }).await?.into_inner();
    assert_eq!(trace.drift_events, 0, "{summary}");
    let kinds: Vec<i32> = trace.segments.iter().map(|s| s.kind).collect();
    let (prompt, policy, observation) =
        (SegmentKind::Prompt as i32, SegmentKind::Policy as i32, SegmentKind::Observation as i32);
    assert_eq!(kinds, [prompt, policy, observation, policy]);
    Ok(())
}

/// Turns of one episode are recorded one at a time: of concurrent turns over
/// one history, one is recorded and the others are refused, never silently
/// overwritten. A caller's count of turns must match the trace's; a trace
/// gone with its TTL is refused, not restarted; reading a trace keeps it alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_of_an_episode_are_atomic_and_an_expired_trace_is_refused() -> Result<()> {
    // Longer than a turn takes here even beside other tests, shorter than the test's idle wait.
    let stack = one_replica_with(&["--trace-ttl", "15s"]).await?;
    let history = [user("Name a colour.")];
    let racing: Vec<_> = (0..6)
        .map(|_| {
            let mut gateway = stack.gateway.clone();
            let request = chat("race", &history);
            tokio::spawn(async move { gateway.chat(request).await })
        })
        .collect();
    let mut recorded = Vec::new();
    for turn in racing {
        match turn.await? {
            Ok(response) => recorded.push(response.into_inner()),
            // Refused as concurrent, or (once one was recorded) as a history behind the trace.
            Err(status) => assert!(matches!(status.code(), Code::Aborted | Code::InvalidArgument), "{status:?}"),
        }
    }
    assert_eq!(recorded.len(), 1, "exactly one of the concurrent turns is recorded");
    let mut gateway = stack.gateway.clone();
    let trace =
        gateway.get_trace(pb::GetTraceRequest { episode_id: "race".into(), ..Default::default() }).await?.into_inner();
    let sampled: Vec<&Vec<u32>> =
        trace.segments.iter().filter(|s| s.kind == SegmentKind::Policy as i32).map(|s| &s.token_ids).collect();
    assert_eq!(sampled, [&recorded[0].token_ids]);

    // The caller counts turns: a replayed first turn is refused.
    let counted = |turns_before: u32, messages: &[ChatMessage]| {
        let mut request = chat("counted", messages);
        request.turns_before = Some(turns_before);
        request
    };
    let first = gateway.chat(counted(0, &history)).await.context("first counted turn")?.into_inner();
    let mut messages = history.to_vec();
    messages.extend([first.message.context("reply")?, user("Another one.")]);
    let replayed = gateway.chat(counted(0, &messages)).await.expect_err("a replayed turn is refused");
    assert_eq!(replayed.code(), Code::Aborted, "{replayed:?}");
    assert!(replayed.message().contains("holds 1 turns"), "{}", replayed.message());
    let second = gateway.chat(counted(1, &messages)).await.context("second counted turn")?.into_inner();
    messages.extend([second.message.context("reply")?, user("And another.")]);

    // Reads keep the trace alive past its TTL; idleness lets it expire, and
    // the next turn is refused instead of starting a new trace.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_secs(5)).await;
        gateway.get_trace(pb::GetTraceRequest { episode_id: "counted".into(), ..Default::default() }).await?;
    }
    tokio::time::sleep(Duration::from_secs(17)).await;
    let expired = gateway.chat(counted(2, &messages)).await.expect_err("an expired trace is refused");
    assert_eq!(expired.code(), Code::FailedPrecondition, "{expired:?}");
    assert!(expired.message().contains("expired"), "{}", expired.message());
    Ok(())
}

/// The HTTP endpoint sits behind the same guards as gRPC: a caller without
/// the token is turned away before its body is read (an unparsable body
/// gets 401, not 400), and calls beyond the concurrency limit get 429 with
/// retry advice in OpenAI's error shape instead of queueing unbounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_endpoint_is_authenticated_first_and_sheds_load() -> Result<()> {
    let stack = http_stack(&["--auth-token", "s3cret", "--max-concurrent-requests", "1"]).await?;
    let http = stack.http.clone();

    let path = "/episodes/guarded/v1/chat/completions";
    let (status, body) = post_text(&http, path, &[], "{not json").await?;
    assert_eq!(status, 401, "{body}");
    assert_eq!(body["error"]["type"], "authentication_error");

    let request = serde_json::json!({
        "messages": [{"role": "user", "content": "Write a long story about the sea."}],
        "max_tokens": 48, "temperature": 0.0
    });
    let calls: Vec<_> = (0..4)
        .map(|i| {
            let (http, request) = (http.clone(), request.clone());
            tokio::spawn(async move {
                let path = format!("/episodes/load-{i}/v1/chat/completions");
                post(&http, &path, &[("authorization", "Bearer s3cret")], &request).await
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for call in calls {
        let (status, body) = call.await??;
        if status == 429 {
            assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
        }
        statuses.push(status);
    }
    assert!(statuses.contains(&200) && statuses.contains(&429), "{statuses:?}");
    Ok(())
}

fn message(role: &str, text: &str) -> ChatMessage {
    ChatMessage { role: role.into(), content: text.into(), ..Default::default() }
}

/// Five turns with tool observations and a weight update in the middle: the
/// trace is exactly what the policy server received and generated, token for
/// token, with masks, logprobs and the version of every turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_five_turn_tool_episode_is_traced_exactly() -> Result<()> {
    let stack = one_replica().await?;
    let mut gateway = stack.gateway.clone();
    let tool = search_tool();
    // Worked examples so that SmolLM2-135M calls the tool (see openai_client.py).
    let mut messages = vec![message("system", "Answer every request by calling the search tool.")];
    for query in ["rainfall in Spain", "vitamin D deficiency", "protein folding"] {
        messages.push(message("user", &format!("Find documents about {query}.")));
        let call = format!(r#"<tool_call>[{{"name": "search", "arguments": {{"query": "{query}"}}}}]</tool_call>"#);
        messages.push(message("assistant", &call));
    }
    messages.push(message("user", "Find documents about black holes."));

    let mut responses = Vec::new();
    for turn in 0..5 {
        if turn == 2 {
            // The learner publishes version 1 between turns 2 and 3.
            publish_version(&stack, "", 1).await?;
        }
        let mut request = chat("tools-1", &messages);
        request.tools = vec![tool.clone()];
        request.sampling.as_mut().context("sampling")?.max_new_tokens = 48;
        let response = gateway.chat(request).await?.into_inner();
        let reply = response.message.clone().context("message")?;
        messages.push(reply.clone());
        match reply.tool_calls.first() {
            Some(call) => messages.push(ChatMessage {
                role: "tool".into(),
                content: format!("[d{turn}] A document about black holes."),
                tool_call_id: call.id.clone(),
                ..Default::default()
            }),
            None => messages.push(message("user", "Find documents about dark matter.")),
        }
        responses.push(response);
    }
    assert_eq!(responses[0].finish_reason, "tool_calls", "the worked examples made the policy call the tool");

    let trace = gateway
        .get_trace(pb::GetTraceRequest { episode_id: "tools-1".into(), ..Default::default() })
        .await?
        .into_inner();
    let policy_kind = SegmentKind::Policy as i32;
    assert!(trace.segments.iter().any(|s| s.kind == SegmentKind::Observation as i32), "tool results are observations");
    let sampled: Vec<usize> =
        trace.segments.iter().enumerate().filter(|(_, s)| s.kind == policy_kind).map(|(i, _)| i).collect();
    assert_eq!(sampled.len(), 5);
    for (turn, (&at, response)) in sampled.iter().zip(&responses).enumerate() {
        // What the policy server received this turn is every token before its
        // sampled segment; what it generated is that segment.
        let before: usize = trace.segments[..at].iter().map(|s| s.token_ids.len()).sum();
        let usage = response.usage.context("usage")?;
        assert_eq!(before, usage.prompt_tokens as usize, "turn {turn} prompt");
        let segment = &trace.segments[at];
        assert_eq!(segment.token_ids, response.token_ids, "turn {turn} tokens");
        assert_eq!(segment.logprobs, response.logprobs, "turn {turn} logprobs");
        assert_eq!(segment.policy_version, response.policy_version, "turn {turn} version");
        assert_eq!(segment.policy_version, u64::from(turn >= 2), "turn {turn} ran on the version it should");
    }
    for segment in &trace.segments {
        let mask = u8::from(segment.kind == policy_kind);
        assert_eq!(segment.loss_mask, vec![mask; segment.token_ids.len()]);
        assert_eq!(segment.logprobs.len(), if mask == 1 { segment.token_ids.len() } else { 0 });
    }
    assert_eq!(trace.drift_events, 0, "tool-calling turns re-render to the sampled tokens");

    // The turns show in the gateway's metrics (process-wide, shared with other tests).
    let metrics = sleuth_kit::metrics::render();
    for series in [
        "sleuth_gateway_turns_total{front_door=\"grpc\",result=\"ok\"}".to_owned(),
        format!("sleuth_gateway_replica_in_flight{{replica=\"{}\"}} 0", stack.policy_addr),
        "sleuth_gateway_overhead_seconds_count".to_owned(),
        "sleuth_gateway_completion_tokens_total".to_owned(),
    ] {
        assert!(metrics.contains(&series), "{series} missing from:\n{metrics}");
    }
    Ok(())
}

/// With a ticket key, an episode started with a ticket is its holder's: a
/// run's turn and a teacher reply need a ticket (a teacher reply its teacher
/// grant), the episode's turns and trace need its ticket or the admin
/// token, a ticket opens no other episode and adopts no trace begun without
/// one, and the ticket's budget bounds the trace. Episodes of no run stay
/// open to the mesh token (the OpenAI door's clients).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticketed_episode_is_its_holders_alone_and_within_its_budget() -> Result<()> {
    use sleuth_kit::ticket::{Grant, TicketKey};
    let stack = http_stack(&["--ticket-key", "gateway-ticket-key", "--admin-token", "gateway-admin"]).await?;
    let key = TicketKey::new("gateway-ticket-key".parse()?);
    let mut gateway = InferenceGatewayClient::new(connect(&stack.grpc, None, Duration::from_secs(5)).await?);
    let admin: sleuth_kit::BearerToken = "gateway-admin".parse()?;
    let mut as_admin = InferenceGatewayClient::new(connect(&stack.grpc, Some(&admin), Duration::from_secs(5)).await?);
    let messages = vec![user("What is the capital of France?")];
    let denied = |status: tonic::Status, needle: &str| {
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        assert!(status.message().contains(needle), "{:?} lacks {needle:?}", status.message());
    };
    let turn = |episode: &str, ticket: &str| pb::ChatRequest {
        run_id: "r".into(),
        ticket: ticket.into(),
        ..chat(episode, &messages)
    };
    let read = |episode: &str, ticket: &str| pb::GetTraceRequest { episode_id: episode.into(), ticket: ticket.into() };

    denied(gateway.chat(turn("e1", "")).await.unwrap_err(), r#"a turn of run "r" needs episode "e1"'s ticket"#);
    let e1 = key.issue("e1", Grant::Policy, 4096);
    let first = gateway.chat(turn("e1", &e1)).await?.into_inner();
    let prompt = first.usage.context("usage")?.prompt_tokens;
    denied(gateway.chat(turn("e2", &e1)).await.unwrap_err(), r#"not one issued for episode "e2""#);
    let door = pb::ChatRequest { run_id: String::new(), ..turn("e1", "") };
    denied(gateway.chat(door).await.unwrap_err(), "was started with a ticket");
    denied(gateway.get_trace(read("e1", "")).await.unwrap_err(), "was started with a ticket");
    let finish = pb::FinishEpisodeRequest { episode_id: "e1".into(), ticket: String::new() };
    denied(gateway.finish_episode(finish).await.unwrap_err(), "was started with a ticket");
    let own = gateway.get_trace(read("e1", &e1)).await?.into_inner();
    assert_eq!(own, as_admin.get_trace(read("e1", "")).await?.into_inner(), "the admin token reads any trace");
    // The OpenAI door takes the ticket in a header.
    let body = serde_json::json!({"messages": [{"role": "user", "content": "Thanks."}], "max_tokens": 4});
    let (path, d1) = ("/episodes/d1/v1/chat/completions", key.issue("d1", Grant::Policy, 4096));
    let (status, answer) = post(&stack.http, path, &[("x-sleuth-episode-ticket", d1.as_str())], &body).await?;
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = post(&stack.http, path, &[], &body).await?;
    assert_eq!(status, 403, "{answer}");

    let teach =
        |episode: &str, ticket: &str| pb::ChatRequest { teacher_reply: "Paris.".into(), ..turn(episode, ticket) };
    denied(gateway.chat(teach("t1", &key.issue("t1", Grant::Policy, 4096))).await.unwrap_err(), "teacher grant");
    gateway.chat(teach("t1", &key.issue("t1", Grant::Teacher, 4096))).await?;

    // The mesh token alone keeps episodes of no run; a ticket cannot take one over.
    let free = pb::ChatRequest { run_id: String::new(), ..turn("free", "") };
    gateway.chat(free).await?;
    gateway.get_trace(read("free", "")).await?;
    denied(gateway.chat(turn("free", &key.issue("free", Grant::Policy, 4096))).await.unwrap_err(), "without a ticket");

    // A budget of five tokens past the prompt: the reply is cut there, and no turn follows.
    let tight = key.issue("tight", Grant::Policy, prompt + 5);
    let cut = gateway.chat(turn("tight", &tight)).await?.into_inner();
    assert_eq!((cut.finish_reason.as_str(), cut.usage.context("usage")?.completion_tokens), ("length", 5));
    let mut longer = messages.clone();
    longer.push(cut.message.context("message")?);
    longer.push(user("And of Spain?"));
    let over = pb::ChatRequest { messages: longer, ..turn("tight", &tight) };
    let status = gateway.chat(over).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains(&format!("past its ticket's max_episode_tokens {}", prompt + 5)), "{status:?}");
    Ok(())
}
