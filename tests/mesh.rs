//! The whole mesh as a user runs it: six service processes on ephemeral
//! ports with Redis and SQLite, authentication on.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sleuth_kit::BearerToken;
use sleuth_kit::client::{MeshChannel, connect};
use sleuth_proto::{agent, inference, learner, policy, rollout, tools};
use sleuth_tests::{SERVICES, ServiceProcess};
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

fn grpc_name(service: &str) -> &'static str {
    match service {
        "tool-gateway" => tools::v1::tool_gateway_server::SERVICE_NAME,
        "policy-server" => policy::v1::policy_server_server::SERVICE_NAME,
        "learner" => learner::v1::learner_server::SERVICE_NAME,
        "rollout-orchestrator" => rollout::v1::rollout_orchestrator_server::SERVICE_NAME,
        "inference-gateway" => inference::v1::inference_gateway_server::SERVICE_NAME,
        "agent" => agent::v1::agent_server::SERVICE_NAME,
        other => panic!("unknown service {other}"),
    }
}

/// Starts the mesh against `redis_url`, wiring each service to its upstreams.
fn start_mesh(redis_url: &str, token: &str, data: &std::path::Path) -> Result<BTreeMap<&'static str, ServiceProcess>> {
    let mut mesh: BTreeMap<&'static str, ServiceProcess> = BTreeMap::new();
    for name in SERVICES {
        let mut env = vec![
            ("SLEUTH_AUTH_TOKEN", token.to_owned()),
            ("SLEUTH_DRAIN_TIMEOUT", format!("{}s", DRAIN_TIMEOUT.as_secs())),
            ("SLEUTH_REDIS_URL", redis_url.to_owned()),
            ("SLEUTH_DEVICE", "cpu".to_owned()),
            ("SLEUTH_DTYPE", "f32".to_owned()),
            ("SLEUTH_DATABASE_URL", format!("sqlite://{}", data.join("runs.db").display())),
        ];
        if name == "learner" {
            env.push(("SLEUTH_RUN_ID", "mesh".to_owned()));
            env.push(("SLEUTH_CHECKPOINT_URI", data.join("checkpoints").display().to_string()));
        }
        if name == "policy-server" || name == "inference-gateway" || name == "learner" {
            let model = sleuth_testkit::cache_dir()?.join("models/smollm2-135m-instruct");
            env.push(("SLEUTH_MODEL", model.display().to_string()));
        }
        if name == "inference-gateway" {
            env.push(("SLEUTH_HTTP_LISTEN", "127.0.0.1:0".to_owned()));
            env.push(("SLEUTH_POLICY_SERVERS", mesh["policy-server"].addr.clone()));
        }
        if name == "agent" {
            env.push(("SLEUTH_INFERENCE_GATEWAY", mesh["inference-gateway"].addr.clone()));
            env.push(("SLEUTH_TOOL_GATEWAY", mesh["tool-gateway"].addr.clone()));
        }
        mesh.insert(name, ServiceProcess::start(name, &env)?);
    }
    Ok(mesh)
}

async fn channel(process: &ServiceProcess, token: Option<&BearerToken>) -> Result<MeshChannel> {
    Ok(connect(&process.addr, token, Duration::from_secs(5)).await?)
}

async fn health(process: &ServiceProcess) -> Result<ServingStatus> {
    let request = HealthCheckRequest { service: grpc_name(process.name).to_owned() };
    let response = HealthClient::new(channel(process, None).await?).check(request).await?;
    Ok(response.into_inner().status())
}

async fn wait_until_serving(process: &ServiceProcess, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let status = health(process).await?;
        if status == ServingStatus::Serving {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{} still {status:?} after {limit:?}; log:\n{}",
            process.name,
            process.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Service names listed by the server's reflection service.
async fn reflected_services(channel: MeshChannel) -> Result<Vec<String>, tonic::Status> {
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses =
        ServerReflectionClient::new(channel).server_reflection_info(tokio_stream::once(request)).await?.into_inner();
    let response = responses.message().await?.ok_or_else(|| tonic::Status::internal("no reflection response"))?;
    match response.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => Ok(list.service.into_iter().map(|s| s.name).collect()),
        other => Err(tonic::Status::internal(format!("unexpected reflection response {other:?}"))),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_is_healthy_reflective_authenticated_and_drains_on_sigterm() -> Result<()> {
    let redis = sleuth_testkit::redis()?;
    let data = tempfile::tempdir()?;
    let token: BearerToken = "e2e-mesh-token".parse()?;
    let mut mesh = start_mesh(&sleuth_testkit::redis_url(&redis), "e2e-mesh-token", data.path())?;

    for process in mesh.values() {
        wait_until_serving(process, Duration::from_secs(60)).await?;
    }

    for process in mesh.values() {
        let name = grpc_name(process.name);
        // Reflection lists the service itself and health, and sits behind auth.
        let listed = reflected_services(channel(process, Some(&token)).await?).await?;
        assert!(listed.iter().any(|s| s == name), "{}: reflection lists {listed:?}", process.name);
        assert!(listed.iter().any(|s| s == "grpc.health.v1.Health"), "{}: {listed:?}", process.name);
        let anonymous = reflected_services(channel(process, None).await?).await.unwrap_err();
        assert_eq!(anonymous.code(), Code::Unauthenticated, "{}: {anonymous:?}", process.name);
    }

    // Weight updates above all must not be callable by strangers.
    let policy = &mesh["policy-server"];
    let mut stranger = policy::v1::policy_server_client::PolicyServerClient::new(channel(policy, None).await?);
    let header = policy::v1::UpdateWeightsRequest {
        part: Some(policy::v1::update_weights_request::Part::Header(policy::v1::WeightsHeader {
            version: 1,
            ..Default::default()
        })),
    };
    let error = stranger.update_weights(tokio_stream::once(header.clone())).await.unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated, "{error:?}");
    let error = stranger.get_model_info(policy::v1::GetModelInfoRequest {}).await.unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated, "{error:?}");
    // With the token the call reaches the service.
    let mut member = policy::v1::policy_server_client::PolicyServerClient::new(channel(policy, Some(&token)).await?);
    let info = member.get_model_info(policy::v1::GetModelInfoRequest {}).await?.into_inner();
    assert_eq!(info.architecture, "llama");
    // The learner waits on its run's (empty) stream at step 0.
    let learner = &mesh["learner"];
    let mut member = learner::v1::learner_client::LearnerClient::new(channel(learner, Some(&token)).await?);
    let status = member.get_status(learner::v1::GetStatusRequest {}).await?.into_inner();
    assert_eq!((status.run_id.as_str(), status.step), ("mesh", 0));
    // The orchestrator answers past auth.
    let orchestrator = &mesh["rollout-orchestrator"];
    let mut member = rollout::v1::rollout_orchestrator_client::RolloutOrchestratorClient::new(
        channel(orchestrator, Some(&token)).await?,
    );
    let error = member.get_run(rollout::v1::GetRunRequest { run_id: "nope".into() }).await.unwrap_err();
    assert_eq!(error.code(), Code::NotFound, "{error:?}");

    // Keep a connection open to every service while they shut down: idle
    // clients must not hold a pod past its drain deadline.
    let mut open = Vec::new();
    for process in mesh.values() {
        open.push(channel(process, Some(&token)).await?);
    }
    for process in mesh.values_mut().rev() {
        let (status, took) = process.terminate(DRAIN_TIMEOUT + Duration::from_secs(10))?;
        assert!(status.success(), "{} exited with {status}; log:\n{}", process.name, process.log());
        assert!(took <= DRAIN_TIMEOUT + Duration::from_secs(2), "{} took {took:?} to stop", process.name);
        assert!(
            process.log().contains("draining in-flight requests"),
            "{} did not drain; log:\n{}",
            process.name,
            process.log()
        );
    }
    drop(open);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orchestrator_is_not_serving_while_redis_is_down() -> Result<()> {
    let data = tempfile::tempdir()?;
    let port = sleuth_testkit::free_port()?;
    let env = [
        ("SLEUTH_REDIS_URL", format!("redis://127.0.0.1:{port}/0")),
        ("SLEUTH_DATABASE_URL", format!("sqlite://{}", data.path().join("runs.db").display())),
    ];
    let mut orchestrator = ServiceProcess::start("rollout-orchestrator", &env)?;
    // Until its first readiness check has failed and said why (no fixed wait).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !orchestrator.log().contains("not serving until dependencies are ready") {
        anyhow::ensure!(Instant::now() < deadline, "no readiness verdict within 20 s:\n{}", orchestrator.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(health(&orchestrator).await?, ServingStatus::NotServing);

    let redis = sleuth_testkit::redis_on_port(port).context("starting redis on the configured port")?;
    wait_until_serving(&orchestrator, Duration::from_secs(20)).await?;
    // This Redis keeps nothing on disk: the orchestrator says which settings lose groups.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !orchestrator.log().contains("appendfsync is everysec, must be always") {
        anyhow::ensure!(Instant::now() < deadline, "no durability warning:\n{}", orchestrator.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    drop(redis);
    let deadline = Instant::now() + Duration::from_secs(20);
    while health(&orchestrator).await? == ServingStatus::Serving {
        anyhow::ensure!(Instant::now() < deadline, "still SERVING with Redis gone");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, _) = orchestrator.terminate(Duration::from_secs(20))?;
    assert!(status.success());
    Ok(())
}
