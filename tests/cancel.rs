//! Cancelling a run through the real mesh: its learner trains what the run
//! published before the cancel, seals its checkpoint and exits cleanly,
//! instead of waiting for groups that will never come.

use std::time::{Duration, Instant};

use anyhow::Result;
use sleuth_proto::agent::v1::AgentConfig;
use sleuth_proto::common::v1::AgentBudget;
use sleuth_proto::rollout::v1 as rollout;
use sleuth_tests::fixture::*;

/// The questions of `split` of the synthetic collection at `synth`.
fn synth_split(synth: &std::path::Path, split: &str) -> rollout::TaskSet {
    rollout::TaskSet {
        source_uri: synth.display().to_string(),
        collection: "synth".into(),
        split: split.into(),
        limit: 0,
    }
}

/// A run of `name` that a teacher plays (fast, deterministic), one episode
/// at a time, over more groups than are published before a cancel.
fn teacher_run(name: &str, synth: &std::path::Path) -> rollout::RunSpec {
    rollout::RunSpec {
        name: name.into(),
        train: Some(synth_split(synth, "train")),
        agent: Some(AgentConfig {
            budget: Some(AgentBudget {
                max_turns: 4,
                max_new_tokens_per_turn: 128,
                max_episode_tokens: 8192,
                observation_char_cap: 1500,
            }),
            teacher: "bm25:1".into(),
            tools: vec!["bm25_search".into()],
            ..Default::default()
        }),
        group_size: 2,
        global_batch_size: 1,
        max_epochs: 20,
        rollout_max_concurrency: 1,
        max_staleness: 4,
        training: Some(rollout::TrainingSpec { learning_rate: 1e-3, checkpoint_every: 1, ..Default::default() }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_runs_learner_trains_what_was_published_and_exits() -> Result<()> {
    const RUN: &str = "cancelled";
    let scratch = tempfile::tempdir()?;
    let (mesh, _) = teacher_mesh(scratch.path(), 1)?;
    let database = scratch.path().join("runs.db");
    let (orchestrator, mut client) = mesh.orchestrator(&database).await?;
    let spec = teacher_run(RUN, &scratch.path().join("synth"));
    client.create_run(rollout::CreateRunRequest { spec: Some(spec), run_id: RUN.into() }).await?;
    let mut learner = mesh.learner(RUN, scratch.path(), &database, &orchestrator)?;
    let started = wait_for(&mut client, RUN, Duration::from_secs(120), |run| {
        run.progress.as_ref().is_some_and(|p| p.groups_published >= 3)
    })
    .await?;
    let planned = started.progress.as_ref().map_or(0, |p| p.groups_total);
    let request = rollout::CancelRunRequest { run_id: RUN.into(), reason: "enough".into() };
    let cancelled = client.cancel_run(request).await?.into_inner();
    assert_eq!(cancelled.status, rollout::RunStatus::Cancelled as i32, "{cancelled:?}");
    // A group already past its last cancellation check may still publish
    // after this; every group published by the cancel is trained.
    let before_cancel = cancelled.progress.as_ref().map_or(0, |p| p.groups_published);

    let (exit, took) = learner.wait(Duration::from_secs(120))?;
    assert!(exit.success(), "learner exited with {exit}; log:\n{}", learner.log());
    let published = client
        .get_run(rollout::GetRunRequest { run_id: RUN.into() })
        .await?
        .into_inner()
        .progress
        .map_or(0, |p| p.groups_published);
    assert!(published < planned, "cancelled before the end: {published} of {planned}");
    let db = sleuth_store::Database::open(&format!("sqlite://{}", database.display()))?;
    let taken = learner::records::groups(&db, RUN).await?.len() as u64;
    assert!(taken >= before_cancel, "every group published by the cancel was taken: {taken} of {before_cancel}");
    eprintln!(
        "{RUN}: {before_cancel} groups published by the cancel, {published} of {planned} in all, {taken} taken, \
         learner out {took:?} after the cancel"
    );
    Ok(())
}

/// A run cancelled while its learner waits for the validation of its start
/// (the learner takes no step past a version due for validation before the
/// orchestrator has validated it): the learner sees the run has ended and
/// exits cleanly, instead of waiting for a validator the cancel aborted.
/// The tool gateway is paused (SIGSTOP) under agents that wait for it an
/// hour, so every episode blocks on its opening search and the validation
/// cannot finish before the cancel, on any machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_waiting_for_a_validation_exits_when_the_run_is_cancelled() -> Result<()> {
    const RUN: &str = "cancelled-validating";
    let scratch = tempfile::tempdir()?;
    let (mesh, _) = teacher_mesh_with(scratch.path(), 1, vec![("SLEUTH_TOOL_TIMEOUT", "1h".into())])?;
    let database = scratch.path().join("runs.db");
    let (orchestrator, mut client) = mesh.orchestrator(&database).await?;
    let synth = scratch.path().join("synth");
    let mut spec = teacher_run(RUN, &synth);
    spec.validation = Some(synth_split(&synth, "validation"));
    spec.training.as_mut().expect("training").eval_every = 1;
    // Every episode, the greedy policy's included, starts with a search.
    spec.agent.as_mut().expect("agent").opening_search = "bm25_search".into();
    mesh.tools.signal("STOP")?;
    client.create_run(rollout::CreateRunRequest { spec: Some(spec), run_id: RUN.into() }).await?;
    let mut learner = mesh.learner(RUN, scratch.path(), &database, &orchestrator)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !learner.log().contains("waiting for the orchestrator to validate this version") {
        anyhow::ensure!(Instant::now() < deadline, "the learner never waited for validation; log:\n{}", learner.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let request = rollout::CancelRunRequest { run_id: RUN.into(), reason: "enough".into() };
    client.cancel_run(request).await?;
    let exited = learner.wait(Duration::from_secs(120));
    mesh.tools.signal("CONT")?;
    let (exit, took) = exited?;
    assert!(exit.success(), "learner exited with {exit}; log:\n{}", learner.log());
    let log = learner.log();
    assert!(log.contains("the run ended before this version was validated"), "{log}");
    let run = client.get_run(rollout::GetRunRequest { run_id: RUN.into() }).await?.into_inner();
    assert!(run.validations.is_empty(), "nothing was validated: {:?}", run.validations);
    eprintln!("{RUN}: learner out {took:?} after the cancel");
    Ok(())
}
