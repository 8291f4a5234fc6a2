//! A learner serves from its first moment: while it waits for its run it
//! answers health NOT_SERVING (so readiness probes and `helm install --wait`
//! see a live pod, not a socket that never answers), its RPCs say what it
//! waits for, and SIGTERM stops it at once.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use sleuth_proto::learner::v1::GetStatusRequest;
use sleuth_proto::learner::v1::learner_client::LearnerClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

#[tokio::test]
async fn a_learner_waiting_for_its_run_answers_not_serving_and_says_why() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let redis = sleuth_testkit::redis()?;
    let model = scratch.path().join("model");
    let config = serde_json::json!({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": true, "eos_token_id": 63
    });
    sleuth_model::export::write_random(&config, &model, &model, 9)?;
    // An orchestrator that never answers: the run can never be found.
    let orchestrator = format!("127.0.0.1:{}", sleuth_testkit::free_port()?);
    let addr = format!("127.0.0.1:{}", sleuth_testkit::free_port()?);
    let mut learner = Command::new(env!("CARGO_BIN_EXE_learner"))
        .args(["--listen", &addr, "--run-id", "later", "--device", "cpu", "--orchestrator", &orchestrator])
        .args(["--redis-url", &sleuth_testkit::redis_url(&redis)])
        .arg("--database-url")
        .arg(format!("sqlite://{}", scratch.path().join("runs.db").display()))
        .arg("--model")
        .arg(&model)
        .arg("--checkpoint-uri")
        .arg(scratch.path().join("checkpoints"))
        .env("SLEUTH_LOG", "warn")
        .env("SLEUTH_INSECURE", "true")
        .spawn()?;

    let deadline = Instant::now() + Duration::from_secs(60);
    let channel = loop {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?;
        match endpoint.connect().await {
            Ok(channel) => break channel,
            Err(error) if Instant::now() > deadline => bail!("the learner never accepted a connection: {error}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    for service in ["", "sleuth.learner.v1.Learner"] {
        // A bound socket nobody serves accepts the connection and never answers.
        let mut client = HealthClient::new(channel.clone());
        let check = client.check(HealthCheckRequest { service: service.into() });
        let health = tokio::time::timeout(Duration::from_secs(10), check)
            .await
            .map_err(|_| anyhow::anyhow!("no health answer within 10 s while the learner waits for its run"))??
            .into_inner();
        assert_eq!(health.status(), ServingStatus::NotServing, "health of {service:?} while waiting for the run");
    }
    let status = LearnerClient::new(channel).get_status(GetStatusRequest {}).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("waiting for run later") && status.message().contains(&orchestrator),
        "{status:?}"
    );

    let stopped = Command::new("kill").args(["-TERM", &learner.id().to_string()]).status()?;
    assert!(stopped.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(exit) = learner.try_wait()? {
            assert!(exit.success(), "a learner stopped while waiting for its run exited with {exit}");
            return Ok(());
        }
        if Instant::now() > deadline {
            let _ = learner.kill();
            bail!("the learner did not stop within 30 s of SIGTERM while waiting for its run");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
