//! A model teacher through the real mesh: the agent worker asks a second
//! policy, served by its own policy server behind an inference gateway's
//! OpenAI-compatible door (as a team serves a larger teacher model), for
//! each turn, and the student's inference gateway traces the replies as the
//! student policy's own tokens. The student is imprinted to always search
//! and the teacher to always submit, so who played each turn shows.

use std::ops::Not as _;

use anyhow::{Context, Result};
use sleuth_proto::agent::v1::RunEpisodeRequest;
use sleuth_proto::common::v1::{Episode, EpisodeOutcome, SegmentKind};
use sleuth_tests::ServiceProcess;
use sleuth_tests::fixture::*;

/// The weather question's episode on `mesh`'s first agent, played by `teacher`.
async fn taught(mesh: &Mesh, teacher: &str, episode: &str, max_turns: u32) -> Result<Episode> {
    let mut request: RunEpisodeRequest = request(episode, budget(max_turns, 64, 8192));
    request.config.as_mut().context("config")?.teacher = teacher.into();
    mesh.client().await?.run_episode(sleuth_tests::ticketed(request)).await?.into_inner().episode.context("episode")
}

/// A policy server serving `model` and an inference gateway with its
/// OpenAI-compatible door in front of it (on `redis_url`), both serving
/// (the model loaded); the door's URL.
async fn teacher_pool(model: &std::path::Path, redis_url: &str) -> Result<(ServiceProcess, ServiceProcess, String)> {
    let model = model.display().to_string();
    let policy = ServiceProcess::start(
        "policy-server",
        &[("SLEUTH_MODEL", model.clone()), ("SLEUTH_DEVICE", "cpu".into()), ("SLEUTH_DTYPE", "f32".into())],
    )?;
    let gateway = ServiceProcess::start(
        "inference-gateway",
        &[
            ("SLEUTH_MODEL", model),
            ("SLEUTH_REDIS_URL", redis_url.to_owned()),
            ("SLEUTH_POLICY_SERVERS", policy.addr.clone()),
        ],
    )?;
    sleuth_testkit::service::wait_serving(&policy.addr, "sleuth.policy.v1.PolicyServer").await?;
    sleuth_testkit::service::wait_serving(&gateway.addr, "sleuth.inference.v1.InferenceGateway").await?;
    let door = format!("http://{}", gateway.http.as_deref().context("the teacher gateway's OpenAI door")?);
    Ok((policy, gateway, door))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_teacher_behind_an_openai_door_plays_the_episode_as_the_policy() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let policies = policies(scratch.path()).await?;
    let mut mesh = Mesh::with_agents(&policies.searcher, &policies.index, 0)?;
    let (_teacher_policy, teacher_gateway, door) = teacher_pool(&policies.submitter, &mesh.redis_url).await?;
    mesh.agents.push(mesh.agent(&[("SLEUTH_TEACHER_URL", door.clone()), ("SLEUTH_TEACHER_ATTEMPTS", "1".into())])?);

    // The teacher submits at once, where the student would have searched.
    let episode = taught(&mesh, "model:submitter", "distil-1", 3).await?;
    assert_eq!(episode.outcome, EpisodeOutcome::Completed as i32, "{}", episode.outcome_detail);
    assert_eq!(episode.turns, 1, "{:?}", episode.messages);
    assert_eq!(episode.ranking[..2], ["rain", "fog"], "{:?}", episode.ranking);
    let reply = &episode.messages[2];
    assert_eq!((reply.role.as_str(), reply.tool_calls[0].name.as_str()), ("assistant", "submit_ranking"));
    // Traced as the student's own tokens: trainable, logprob 0 (a teacher's).
    let trace = episode.trace.as_ref().context("trace")?;
    let policy: Vec<_> = trace.segments.iter().filter(|s| s.kind == SegmentKind::Policy as i32).collect();
    assert_eq!(policy.len(), 1);
    assert!(policy[0].token_ids.is_empty().not());
    assert!(policy[0].loss_mask.iter().all(|&m| m == 1) && policy[0].logprobs.iter().all(|&l| l == 0.0));
    assert_eq!(trace.drift_events, 0, "the teacher's reply re-renders to its own tokens");
    // The teacher's side is one episode at its door, named after the student's.
    let metrics = reqwest_metrics(&teacher_gateway.addr).await?;
    let turns = metrics.lines().find(|l| l.starts_with("sleuth_gateway_turns_total{") && l.contains("\"http\""));
    assert!(turns.is_some_and(|l| l.contains("result=\"ok\"") && l.ends_with(" 1")), "{metrics}");

    // Several turns: the conversation the door is shown grows with the
    // tool results (OpenAI's tool messages), and each reply is traced.
    let (_searching_policy, _searching_gateway, searching_door) =
        teacher_pool(&policies.searcher, &mesh.redis_url).await?;
    mesh.agents[0] = mesh.agent(&[("SLEUTH_TEACHER_URL", searching_door)])?;
    let searched = taught(&mesh, "model:searcher", "distil-2", 3).await?;
    assert_eq!(searched.outcome, EpisodeOutcome::TurnLimit as i32, "{}", searched.outcome_detail);
    let calls: Vec<&str> = searched.messages.iter().flat_map(|m| &m.tool_calls).map(|c| c.name.as_str()).collect();
    assert_eq!(calls, ["bm25_search"; 3], "{:?}", searched.messages);
    assert!(searched.messages.iter().filter(|m| m.role == "tool").all(|m| m.content.contains("rain")));
    let trace = searched.trace.as_ref().context("trace")?;
    let policy = trace.segments.iter().filter(|s| s.kind == SegmentKind::Policy as i32);
    assert!(policy.clone().count() == 3 && policy.flat_map(|s| &s.logprobs).all(|&l| l == 0.0));

    // A dead endpoint ends the episode as a model error naming it; an agent
    // without one says what is missing.
    mesh.agents[0] =
        mesh.agent(&[("SLEUTH_TEACHER_URL", "http://127.0.0.1:1".into()), ("SLEUTH_TEACHER_ATTEMPTS", "2".into())])?;
    let dead = taught(&mesh, "model:submitter", "distil-3", 3).await?;
    assert_eq!(dead.outcome, EpisodeOutcome::ModelError as i32, "{}", dead.outcome_detail);
    assert!(dead.outcome_detail.contains("no reply after 2 attempts"), "{}", dead.outcome_detail);
    assert!(dead.outcome_detail.contains("http://127.0.0.1:1/v1/chat/completions"), "{}", dead.outcome_detail);
    mesh.agents[0] = mesh.agent(&[])?;
    let unset = taught(&mesh, "model:submitter", "distil-4", 3).await?;
    assert_eq!(unset.outcome, EpisodeOutcome::ToolError as i32, "{}", unset.outcome_detail);
    assert!(unset.outcome_detail.contains("without SLEUTH_TEACHER_URL"), "{}", unset.outcome_detail);
    Ok(())
}
