//! A tool gateway that accepts connections and never answers (a hung
//! process) ends the agent's episode as a tool error within the tool
//! deadline, instead of holding the episode, its slot and the orchestrator's
//! call until the episode's own deadline a day away.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sleuth_proto::agent::v1::RunEpisodeRequest;
use sleuth_proto::agent::v1::agent_client::AgentClient;
use sleuth_proto::common::v1::{EpisodeOutcome, Task};

/// Accepts TCP connections and keeps them open without a byte in reply.
async fn black_hole() -> Result<(String, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?.to_string();
    let held = tokio::spawn(async move {
        let mut connections = Vec::new();
        while let Ok((connection, _)) = listener.accept().await {
            connections.push(connection);
        }
    });
    Ok((address, held))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_tool_gateway_ends_the_episode_within_the_tool_deadline() -> Result<()> {
    let (hung, _held) = black_hole().await?;
    let (address, _agent) = sleuth_testkit::start_service!(
        agent,
        [
            "agent",
            "--listen",
            "127.0.0.1:0",
            "--tool-gateway",
            hung.as_str(),
            "--inference-gateway",
            hung.as_str(),
            "--tool-timeout",
            "2s"
        ]
    );
    let channel = sleuth_kit::client::connect(&address, None, Duration::from_secs(5)).await?;
    let request = RunEpisodeRequest {
        episode_id: "hung-1".into(),
        task: Some(Task {
            task_id: "t".into(),
            question: "why is the sky blue".into(),
            collection: "c".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let started = Instant::now();
    let episode = tokio::time::timeout(Duration::from_secs(30), AgentClient::new(channel).run_episode(request))
        .await
        .context("the episode still hangs 30 s after its tool call's 2 s deadline")??
        .into_inner()
        .episode
        .context("episode")?;
    assert_eq!(episode.outcome(), EpisodeOutcome::ToolError, "{episode:?}");
    assert!(episode.outcome_detail.contains("listing tools"), "{}", episode.outcome_detail);
    assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
    Ok(())
}
