//! A policy replica whose scheduler thread dies (as a libtorch or device error
//! would kill it, injected here at the scheduler's fault point) stops
//! reporting SERVING, answers UNAVAILABLE and, once drained, exits; the
//! gateway serves its episodes from another replica. A test binary of its own: fault points are
//! armed process-wide.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use sleuth_kit::client::connect;
use sleuth_proto::common::v1::{ChatMessage, SamplingParams};
use sleuth_proto::inference::v1 as pb;
use sleuth_proto::inference::v1::inference_gateway_client::InferenceGatewayClient;
use sleuth_proto::policy::v1::GenerateRequest;
use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;
use sleuth_testkit::service::wait_serving;
use sleuth_testkit::start_service as start;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const POLICY: &str = "sleuth.policy.v1.PolicyServer";

fn turn(episode: &str, messages: &[ChatMessage]) -> pb::ChatRequest {
    pb::ChatRequest {
        episode_id: episode.into(),
        messages: messages.to_vec(),
        sampling: Some(SamplingParams { temperature: Some(0.0), max_new_tokens: 16, ..Default::default() }),
        ..Default::default()
    }
}

fn user(text: &str) -> ChatMessage {
    ChatMessage { role: "user".into(), content: text.into(), ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_scheduler_dies_stops_serving_and_its_episodes_move() -> Result<()> {
    let model = sleuth_testkit::smollm2()?;
    let model = model.to_str().context("utf-8 path")?.to_owned();
    let redis = sleuth_testkit::redis()?;
    let policy_args = sleuth_testkit::service::policy_server_args(&model, &[]);
    let (doomed, doomed_server) = start!(policy_server, policy_args.clone());
    let (healthy, _healthy) = start!(policy_server, policy_args);
    wait_serving(&doomed, POLICY).await?;
    wait_serving(&healthy, POLICY).await?;
    let replicas = format!("{doomed},{healthy}");
    let redis_url = sleuth_testkit::redis_url(&redis);
    let (gateway_addr, _gateway) = start!(
        inference_gateway,
        sleuth_testkit::service::inference_gateway_args(&model, &redis_url, &replicas, "127.0.0.1:0", &[])
    );
    wait_serving(&gateway_addr, "sleuth.inference.v1.InferenceGateway").await?;
    let mut gateway = InferenceGatewayClient::new(connect(&gateway_addr, None, Duration::from_secs(5)).await?);
    let routing =
        inference_gateway::routing::Replicas::new(&[doomed.clone(), healthy.clone()], None, Duration::from_secs(60))?;
    let episode = (0..100)
        .map(|i| format!("doomed-{i}"))
        .find(|e| routing.order(e)[0].address == doomed)
        .context("an episode on the doomed replica")?;

    let mut messages = vec![user("What is the capital of France?")];
    let first = gateway.chat(turn(&episode, &messages)).await?.into_inner();
    messages.push(first.message.context("message")?);
    messages.push(user("And the capital of Italy?"));

    // The doomed replica's scheduler dies in its next decode step, mid-turn:
    // the turn is served by the other replica (without the episode's cache).
    sleuth_kit::fault::arm("policy-scheduler-step", 1);
    let second = gateway.chat(turn(&episode, &messages)).await?.into_inner();
    ensure!(second.usage.context("usage")?.cached_prompt_tokens == 0, "served by the healthy replica");

    // Its health follows the scheduler (probes recheck every 5 s while serving).
    let mut health = HealthClient::new(connect(&doomed, None, Duration::from_secs(5)).await?);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = health.check(HealthCheckRequest { service: POLICY.into() }).await?.into_inner().status();
        if status == ServingStatus::NotServing {
            break;
        }
        ensure!(Instant::now() < deadline, "the dead replica still reports {status:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Asked directly, it says why, as UNAVAILABLE (callers go elsewhere).
    let mut direct = PolicyServerClient::new(connect(&doomed, None, Duration::from_secs(5)).await?);
    let sampling = SamplingParams { max_new_tokens: 4, ..Default::default() };
    let request = GenerateRequest { prompt_token_ids: vec![1, 2, 3], sampling: Some(sampling), ..Default::default() };
    let status = direct.generate(request).await.unwrap_err();
    ensure!(status.code() == tonic::Code::Unavailable, "{status:?}");
    ensure!(status.message().contains("scheduler thread died: fault injected"), "{status:?}");

    // Later turns keep going around it; the trace has every turn.
    messages.push(second.message.context("message")?);
    messages.push(user("Thanks!"));
    gateway.chat(turn(&episode, &messages)).await?;
    let trace =
        gateway.get_trace(pb::GetTraceRequest { episode_id: episode, ..Default::default() }).await?.into_inner();
    ensure!(trace.segments.len() == 6, "three turns of two segments: {}", trace.segments.len());

    // Once drained, the dead replica exits with the reason, for its supervisor to restart it.
    match doomed_server.ended(Duration::from_secs(60)).await? {
        Err(policy_server::Error::SchedulerDown(reason)) => ensure!(reason.contains("fault injected"), "{reason}"),
        other => anyhow::bail!("the dead replica ended with {other:?}"),
    }
    Ok(())
}
