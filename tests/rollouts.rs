//! Rollouts across real service processes: agent workers running episodes
//! against the inference gateway (with a policy server) and the tool gateway,
//! and the orchestrator driving runs and evaluations over them.
//!
//! The policies are tiny models imprinted (trajectory SFT, `learner::imprint`)
//! to always answer one way, so each budget and outcome can be reached on
//! purpose: one always searches, one always submits a ranking.

use std::time::Duration;

use anyhow::{Context, Result};
use sleuth_kit::client::connect;
use sleuth_proto::common::v1::EpisodeOutcome;
use sleuth_proto::rollout::v1 as rollout;
use sleuth_proto::rollout::v1::rollout_orchestrator_client::RolloutOrchestratorClient as OrchestratorClient;
use sleuth_tests::ServiceProcess;
use sleuth_tests::fixture::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_and_failures_end_episodes_with_the_right_outcome() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let Policies { index, searcher, submitter, malformed, .. } = policies(scratch.path()).await?;

    // A policy that submits at once: completed, with its ranking and trace.
    let mesh = Mesh::start(&submitter, &index)?;
    let mut agent = mesh.client().await?;
    let done = run(&mut agent, "submit-1", budget(4, 64, 4096)).await?;
    assert_eq!(done.outcome(), EpisodeOutcome::Completed, "{}", done.outcome_detail);
    assert_eq!(done.ranking, ["rain", "fog"], "{}: {:?}", done.outcome_detail, done.messages.last());
    assert_eq!(done.turns, 1);
    let trace = done.trace.as_ref().context("trace")?;
    let traced: u32 = trace.segments.iter().map(|s| s.token_ids.len() as u32).sum();
    assert_eq!(traced, done.total_tokens);
    assert!(done.generated_tokens > 10);
    drop(mesh);

    // A policy whose tool calls never parse: each gets an error observation
    // and another turn, until the turn limit (not a "completed" empty answer).
    let mesh = Mesh::start(&malformed, &index)?;
    let mut agent = mesh.client().await?;
    let broken = run(&mut agent, "malformed-1", budget(3, 64, 8192)).await?;
    assert_eq!(broken.outcome(), EpisodeOutcome::TurnLimit, "{}", broken.outcome_detail);
    assert_eq!(broken.turns, 3);
    let errors = broken.messages.iter().filter(|m| m.role == "tool" && m.content == agent::episode::MALFORMED_CALL);
    assert_eq!(errors.count(), 3, "{:?}", broken.messages);
    drop(mesh);

    // A policy that searches forever.
    let mut mesh = Mesh::start(&searcher, &index)?;
    let mut agent = mesh.client().await?;
    let looped = run(&mut agent, "search-1", budget(3, 64, 8192)).await?;
    assert_eq!(looped.outcome(), EpisodeOutcome::TurnLimit, "{}", looped.outcome_detail);
    assert_eq!(looped.turns, 3);
    let observations: Vec<&str> =
        looped.messages.iter().filter(|m| m.role == "tool").map(|m| m.content.as_str()).collect();
    assert_eq!(observations.len(), 3, "every search ran; history kept whole");
    assert!(observations[0].contains("rain"), "{}", observations[0]);

    // An episode outlives the kit's generic request timeout (here 10 ms; three
    // turns of generation and search take far longer): RunEpisode is bounded
    // by the episode's own deadline, not cut and reported as a dead worker.
    let patient = mesh.agent(&[("SLEUTH_REQUEST_TIMEOUT", "10ms".into())])?;
    sleuth_testkit::service::wait_serving(&patient.addr, "sleuth.agent.v1.Agent").await?;
    let mut patient_client = sleuth_proto::agent::v1::agent_client::AgentClient::new(
        connect(&patient.addr, None, Duration::from_secs(5)).await?,
    );
    let long = run(&mut patient_client, "search-long", budget(3, 64, 8192)).await?;
    assert_eq!((long.outcome(), long.turns), (EpisodeOutcome::TurnLimit, 3), "{}", long.outcome_detail);
    drop(patient);

    let cut = run(&mut agent, "search-2", budget(3, 5, 8192)).await?;
    assert_eq!(cut.outcome(), EpisodeOutcome::TokenBudget, "per-turn budget: {}", cut.outcome_detail);
    let prompt_tokens = looped.trace.as_ref().context("trace")?.segments[0].token_ids.len() as u32;
    let spent = run(&mut agent, "search-3", budget(8, 64, prompt_tokens + 60)).await?;
    assert_eq!(spent.outcome(), EpisodeOutcome::TokenBudget, "episode budget: {}", spent.outcome_detail);
    assert!(spent.turns >= 1);

    // Many episodes at once on one worker.
    let runs: Vec<_> = (0..6)
        .map(|i| {
            let mut agent = agent.clone();
            tokio::spawn(async move { run(&mut agent, &format!("many-{i}"), budget(2, 64, 8192)).await })
        })
        .collect();
    for handle in runs {
        assert_eq!(handle.await??.outcome(), EpisodeOutcome::TurnLimit);
    }

    // The tool gateway dies: tool_error. Then the policy dies: model_error.
    mesh.tools.kill()?;
    let broken = run(&mut agent, "tools-down", budget(3, 64, 8192)).await?;
    assert_eq!(broken.outcome(), EpisodeOutcome::ToolError, "{}", broken.outcome_detail);
    mesh.policy.kill()?;
    let broken = run(&mut agent, "model-down", budget(3, 64, 8192)).await?;
    assert!(
        matches!(broken.outcome(), EpisodeOutcome::ModelError | EpisodeOutcome::ToolError),
        "{:?}: {}",
        broken.outcome(),
        broken.outcome_detail
    );

    // Bad requests name the field.
    let mut bad = request("", budget(3, 64, 8192));
    let status = agent.run_episode(bad.clone()).await.unwrap_err();
    assert!(status.message().contains("episode_id"), "{status:?}");
    bad.episode_id = "x".into();
    bad.task.as_mut().context("task")?.collection.clear();
    let status = agent.run_episode(bad).await.unwrap_err();
    assert!(status.message().contains("task.collection"), "{status:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_publish_every_group_once_within_concurrency_and_staleness() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let Policies { index, submitter, .. } = policies(scratch.path()).await?;
    let mesh = Mesh::with_agents(&submitter, &index, 2)?;
    mesh.client().await?;
    let (orchestrator, mut client) = mesh.orchestrator(&scratch.path().join("runs.db")).await?;

    // Bad specs name the field.
    let mut bad = spec(&index, 0, 2, 2, 0, 4);
    let status = client
        .create_run(rollout::CreateRunRequest { spec: Some(bad.clone()), run_id: "bad".into() })
        .await
        .unwrap_err();
    assert!(status.message().contains("spec.group_size"), "{status:?}");
    bad.group_size = 2;
    bad.train.as_mut().context("train")?.split = "nope".into();
    let status =
        client.create_run(rollout::CreateRunRequest { spec: Some(bad), run_id: "bad".into() }).await.unwrap_err();
    assert!(status.message().contains("spec.train"), "{status:?}");

    // 6 tasks, groups of 3, 2 groups per step, at most 2 episodes at once, no staleness allowed.
    let created = client
        .create_run(rollout::CreateRunRequest { spec: Some(spec(&index, 3, 2, 2, 0, 4)), run_id: "gated".into() })
        .await?
        .into_inner();
    assert_eq!(created.stream_key, "sleuth:run:gated:groups");
    let redis = sleuth_store::RedisStore::open(&mesh.redis_url)?;

    // Watch the workers' own in-flight gauges while the run goes.
    let mut peak = 0;
    let first_step =
        |run: &rollout::Run| published(run) >= 2 && run.progress.as_ref().is_some_and(|p| p.episodes_in_flight == 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        peak = peak.max(in_flight(&mesh.agents).await?);
        let run = client.get_run(rollout::GetRunRequest { run_id: "gated".into() }).await?.into_inner();
        if first_step(&run) {
            break;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "first step's groups never published: {run:?}");
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    // The learner is still at version 0: the next step's groups must wait.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let held = client.get_run(rollout::GetRunRequest { run_id: "gated".into() }).await?.into_inner();
    assert_eq!(published(&held), 2, "no group may start more than max_staleness steps ahead of the learner");
    assert_eq!(stream_groups(&mesh.redis_url, "gated").await?.len(), 2);

    // The learner takes the first step's groups: the next step's may start.
    for version in 1..=2 {
        sleuth_store::trajectories::set_groups_taken(&redis, "gated", 2 * version).await?;
        let target = 2 * (version + 1);
        loop {
            peak = peak.max(in_flight(&mesh.agents).await?);
            let run = client.get_run(rollout::GetRunRequest { run_id: "gated".into() }).await?.into_inner();
            if published(&run) >= target {
                break;
            }
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
    }
    let succeeded = |run: &rollout::Run| run.status == rollout::RunStatus::Succeeded as i32;
    let finished = wait_for(&mut client, "gated", Duration::from_secs(60), succeeded).await?;
    assert!(peak <= 2, "rollout_max_concurrency 2 exceeded: {peak} episodes in flight at once");
    assert!(peak >= 1, "the workers' gauges were observed");
    // Ended for good: its published-group markers get a deadline (polled:
    // the end is recorded before the markers are given it).
    let marker = sleuth_store::trajectories::published_key("gated", "e0-q1");
    let mut connection = redis.connection().await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ttl: i64 = redis::cmd("TTL").arg(&marker).query_async(&mut connection).await?;
        if ttl > 0 {
            break;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "{marker} never got a deadline (TTL {ttl})");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Every task's group published exactly once, with G scored episodes.
    let groups = stream_groups(&mesh.redis_url, "gated").await?;
    let mut ids: Vec<&str> = groups.iter().map(|g| g.group_id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["e0-q1", "e0-q2", "e0-q3", "e0-q4", "e0-q5", "e0-q6"]);
    for group in &groups {
        assert_eq!(group.episodes.len(), 3);
        for episode in &group.episodes {
            assert_eq!(
                episode.outcome(),
                EpisodeOutcome::Completed,
                "{}: {} {:?}",
                episode.episode_id,
                episode.outcome_detail,
                episode.messages
            );
            assert!(episode.trace.is_some(), "{} has no trace", episode.episode_id);
        }
    }
    let q1 = groups.iter().find(|g| g.group_id == "e0-q1").context("q1")?;
    // The submitter ranks rain then fog: q1's judgements (rain 2, fog 1) give nDCG 1.
    assert!((q1.episodes[0].reward - 1.0).abs() < 1e-9, "{}", q1.episodes[0].reward);
    assert_eq!(published(&finished), 6);
    let listed = client.list_runs(rollout::ListRunsRequest::default()).await?.into_inner();
    assert!(listed.runs.iter().any(|r| r.run_id == "gated"));

    // The CLI, with exit codes scripts rely on: 0 for a succeeded run, 2 for an invalid spec.
    let sleuth = |args: &[&str]| -> Result<std::process::Output> {
        Ok(std::process::Command::new(sleuth_tests::binary("sleuth")?)
            .args(args)
            .args(["--orchestrator", orchestrator.addr.as_str()])
            .output()?)
    };
    let status = sleuth(&["run", "status", "gated"])?;
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success() && text.contains("gated  succeeded  groups 6/6"), "{text}");
    assert_eq!(sleuth(&["run", "watch", "gated"])?.status.code(), Some(0));
    let bad = scratch.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "train: {source_uri: x, collection: y}\ngroup_size: 2\nglobal_batch_size: 1\nrollout_max_concurency: 4\n",
    )?;
    let created = sleuth(&["run", "create", "-f", bad.to_str().context("utf-8")?])?;
    assert_eq!(created.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&created.stderr).contains("rollout_max_concurency"));
    Ok(())
}

/// Groups of one episode are always flat (no advantage to learn from): the
/// learner drops every one. The run must still finish: the orchestrator's
/// staleness window counts the groups the learner took, dropped ones too
/// (it used to wait for a learner version that flat groups never produce).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flat_groups_never_stall_a_run() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let Policies { index, submitter, .. } = policies(scratch.path()).await?;
    let mesh = Mesh::with_agents(&submitter, &index, 1)?;
    mesh.client().await?;
    let (orchestrator, mut client) = mesh.orchestrator(&scratch.path().join("runs.db")).await?;
    client
        .create_run(rollout::CreateRunRequest { spec: Some(spec(&index, 1, 2, 2, 0, 4)), run_id: "flat".into() })
        .await?;
    // The learner sizes its steps (2 groups) and staleness (0) from the spec.
    let learner = mesh.learner("flat", scratch.path(), &scratch.path().join("learner.db"), &orchestrator)?;
    let succeeded = |run: &rollout::Run| run.status == rollout::RunStatus::Succeeded as i32;
    let finished = wait_for(&mut client, "flat", Duration::from_secs(90), succeeded).await?;
    assert_eq!(published(&finished), 6);
    let redis = sleuth_store::RedisStore::open(&mesh.redis_url)?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while sleuth_store::trajectories::groups_taken(&redis, "flat").await? < 6 {
        anyhow::ensure!(std::time::Instant::now() < deadline, "the learner never took all 6 flat groups");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(sleuth_store::trajectories::learner_version(&redis, "flat").await?, 0, "flat groups train nothing");
    let log = learner.log();
    assert!(log.contains("training settings from the run's spec") && log.contains("\"global_batch_size\":2"), "{log}");
    Ok(())
}

/// A run whose workers are all gone fails once its fault patience is spent,
/// naming why; created again with the same id and spec, it resumes where it
/// stopped and publishes every group exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_run_resumes_where_it_stopped() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let Policies { index, submitter, .. } = policies(scratch.path()).await?;
    let mut mesh = Mesh::with_agents(&submitter, &index, 1)?;
    mesh.client().await?;
    let patience = [("SLEUTH_FAULT_PATIENCE", "2s".to_owned())];
    let (_orchestrator, mut client) = mesh.orchestrator_with(&scratch.path().join("runs.db"), &patience).await?;
    let worker = mesh.agents[0].addr.clone();
    mesh.agents[0].kill()?;
    let create = rollout::CreateRunRequest { spec: Some(spec(&index, 2, 2, 2, 100, 4)), run_id: "resumed".into() };
    client.create_run(create.clone()).await?;
    let failed = |run: &rollout::Run| run.status == rollout::RunStatus::Failed as i32;
    let failed = wait_for(&mut client, "resumed", Duration::from_secs(60), failed).await?;
    assert!(failed.status_detail.contains("no agent worker"), "{}", failed.status_detail);

    // The worker comes back where it was; the same CreateRun resumes the run.
    mesh.agents[0] = mesh.agent(&[("SLEUTH_LISTEN", worker)])?;
    mesh.client().await?;
    let mut other = create.clone();
    other.spec.as_mut().context("spec")?.group_size = 3;
    let status = client.create_run(other).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
    client.create_run(create).await?;
    let succeeded = |run: &rollout::Run| run.status == rollout::RunStatus::Succeeded as i32;
    let finished = wait_for(&mut client, "resumed", Duration::from_secs(90), succeeded).await?;
    assert_eq!(published(&finished), 6);
    let groups = stream_groups(&mesh.redis_url, "resumed").await?;
    let mut ids: Vec<&str> = groups.iter().map(|g| g.group_id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["e0-q1", "e0-q2", "e0-q3", "e0-q4", "e0-q5", "e0-q6"], "every group once");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_survive_a_dead_worker_and_an_orchestrator_restart() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let Policies { index, searcher, .. } = policies(scratch.path()).await?;
    let mut mesh = Mesh::with_agents(&searcher, &index, 2)?;
    mesh.client().await?;
    let database = scratch.path().join("runs.db");
    let (mut orchestrator, mut client) = mesh.orchestrator(&database).await?;
    client
        .create_run(rollout::CreateRunRequest { spec: Some(spec(&index, 2, 2, 2, 100, 3)), run_id: "faults".into() })
        .await?;

    // A worker dies mid-run: its episodes are rerun on the other one.
    wait_for(&mut client, "faults", Duration::from_secs(120), |run| {
        run.progress.as_ref().is_some_and(|p| p.episodes_in_flight > 0)
    })
    .await?;
    mesh.agents[0].kill()?;
    wait_for(&mut client, "faults", Duration::from_secs(120), |run| published(run) >= 3).await?;

    // The orchestrator dies mid-run and comes back: the run resumes.
    orchestrator.kill()?;
    let before = stream_groups(&mesh.redis_url, "faults").await?.len();
    assert!((3..6).contains(&before), "killed mid-run ({before} groups out)");
    let (_restarted, mut client) = mesh.orchestrator(&database).await?;
    let done = wait_for(&mut client, "faults", Duration::from_secs(180), |run| {
        run.status != rollout::RunStatus::Running as i32
    })
    .await?;
    assert_eq!(done.status, rollout::RunStatus::Succeeded as i32, "{}", done.status_detail);

    // Nothing lost, nothing published twice.
    let groups = stream_groups(&mesh.redis_url, "faults").await?;
    let mut ids: Vec<String> = groups.iter().map(|g| g.group_id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!((groups.len(), ids.len()), (6, 6), "{ids:?}");
    assert!(groups.iter().all(|g| g.episodes.len() == 2));
    let outcomes: Vec<(EpisodeOutcome, &str)> =
        groups.iter().flat_map(|g| &g.episodes).map(|e| (e.outcome(), e.outcome_detail.as_str())).collect();
    // Each ran to a normal end on a live worker (the imprinted searcher does
    // not call its tool for every question it never saw; that ends as completed).
    assert!(
        outcomes.iter().all(|(o, _)| matches!(o, EpisodeOutcome::TurnLimit | EpisodeOutcome::Completed)),
        "{outcomes:?}"
    );
    assert!(groups.iter().flat_map(|g| &g.episodes).all(|e| e.trace.is_some() && e.turns >= 1));
    Ok(())
}

/// The evaluation harness with the BM25 baseline on SciFact's test split
/// gives the tool gateway's own BM25 figure: same rankings, same metric code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bm25_baseline_evaluation_reproduces_the_tool_gateway_figure() -> Result<()> {
    let source = sleuth_testkit::beir_collection("scifact")?;
    let scratch = tempfile::tempdir()?;
    let index = scratch.path().join("scifact-index");
    let beir = sleuth_beir::BeirDir::new(&source);
    let bm25 = tool_gateway::bm25::Bm25Options::default();
    tool_gateway::index::build(&beir, &index, "scifact", &bm25, sleuth_beir::BadLines::Fail, None, &mut |_| {})?;

    // The tool gateway's figure, computed the way its `evaluate` command does.
    let collection = tool_gateway::collection::Collection::open(&index, index.display().to_string())?;
    let qrels = beir.qrels("test")?;
    let mut rankings = std::collections::BTreeMap::new();
    for query in beir.queries(sleuth_beir::BadLines::Fail)?.iter().filter(|q| qrels.contains_key(&q.id)) {
        let hits = collection.bm25(&query.text, 100)?;
        rankings.insert(
            query.id.clone(),
            hits.iter().map(|h| collection.document(h.ordinal).id.clone()).collect::<Vec<_>>(),
        );
    }
    let expected = sleuth_metrics::evaluate(&rankings, &qrels).ndcg_at_10;

    let redis = sleuth_testkit::redis()?;
    let tools = ServiceProcess::start(
        "tool-gateway",
        &[
            ("SLEUTH_COLLECTIONS", format!("scifact={}", index.display())),
            ("SLEUTH_INDEX_ROOT", index.display().to_string()),
        ],
    )?;
    sleuth_testkit::service::wait_serving(&tools.addr, "sleuth.tools.v1.ToolGateway").await?;
    let reports = scratch.path().join("reports");
    let orchestrator = ServiceProcess::start(
        "rollout-orchestrator",
        &[
            ("SLEUTH_REDIS_URL", sleuth_testkit::redis_url(&redis)),
            ("SLEUTH_DATABASE_URL", format!("sqlite://{}", scratch.path().join("runs.db").display())),
            ("SLEUTH_TOOL_GATEWAY", tools.addr.clone()),
            ("SLEUTH_REPORT_DIR", reports.display().to_string()),
            ("SLEUTH_TASK_ROOTS", source.display().to_string()),
        ],
    )?;
    sleuth_testkit::service::wait_serving(&orchestrator.addr, "sleuth.rollout.v1.RolloutOrchestrator").await?;
    let mut client = OrchestratorClient::new(connect(&orchestrator.addr, None, Duration::from_secs(5)).await?);
    let tasks = rollout::TaskSet {
        source_uri: source.display().to_string(),
        collection: "scifact".into(),
        split: "test".into(),
        limit: 0,
    };
    let bad = rollout::EvaluateRequest {
        policy: Some(rollout::PolicySpec { model_uri: "baseline:bm42".into(), ..Default::default() }),
        tasks: Some(tasks.clone()),
        ..Default::default()
    };
    let status = client.evaluate(bad).await.unwrap_err();
    assert!(status.message().contains("baseline:bm42"), "{status:?}");
    // A request may not make the mesh run thousands of episodes per task,
    // nor name a path for its split.
    for (samples, split, named) in [(10_000, "test", "samples_per_task"), (1, "../../etc/passwd", "split")] {
        let bad = rollout::EvaluateRequest {
            policy: Some(rollout::PolicySpec { model_uri: "baseline:bm25".into(), ..Default::default() }),
            tasks: Some(rollout::TaskSet { split: split.into(), ..tasks.clone() }),
            samples_per_task: samples,
            ..Default::default()
        };
        let status = client.evaluate(bad).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(named), "{status:?}");
    }

    let request = rollout::EvaluateRequest {
        policy: Some(rollout::PolicySpec { model_uri: "baseline:bm25".into(), ..Default::default() }),
        tasks: Some(tasks),
        samples_per_task: 1,
        ..Default::default()
    };
    let started = client.evaluate(request).await?.into_inner();
    assert_eq!(started.tasks_total, 300);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let done = loop {
        let job = client
            .get_evaluation(rollout::GetEvaluationRequest { evaluation_id: started.evaluation_id.clone() })
            .await?
            .into_inner();
        if job.status != rollout::RunStatus::Running as i32 {
            break job;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "evaluation still running: {job:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(done.status, rollout::RunStatus::Succeeded as i32, "{}", done.status_detail);
    let ndcg = done.metrics["ndcg@10"];
    assert!((ndcg - expected).abs() < 1e-12, "harness {ndcg} vs tool gateway {expected}");
    assert!((ndcg - 0.6804).abs() < 5e-5, "the documented SciFact BM25 figure: {ndcg}");
    assert!(reports.join(format!("{}.run", started.evaluation_id)).is_file());
    assert!(reports.join(format!("{}.json", started.evaluation_id)).is_file());
    Ok(())
}

/// One episode is one distributed trace across the mesh: the orchestrator's
/// episode span is its root, and the agent, inference gateway, policy server
/// and tool gateway each add spans under it, carried by `traceparent`
/// metadata. The episode names its trace; the trace names its episode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_episode_is_one_trace_across_the_mesh() -> Result<()> {
    let collector = sleuth_testkit::otlp_collector()?;
    let scratch = tempfile::tempdir()?;
    let Policies { index, searcher, .. } = policies(scratch.path()).await?;
    let mesh = Mesh::traced(&searcher, &index, &sleuth_testkit::otlp_endpoint(&collector))?;
    mesh.client().await?;
    let (_orchestrator, mut client) = mesh.orchestrator(&scratch.path().join("runs.db")).await?;
    // One task, one episode of two searches.
    let mut spec = spec(&index, 1, 1, 1, 0, 2);
    spec.train.as_mut().context("train")?.limit = 1;
    client.create_run(rollout::CreateRunRequest { spec: Some(spec), run_id: "traced".into() }).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let episode = loop {
        if let Some(group) = stream_groups(&mesh.redis_url, "traced").await?.pop() {
            break group.episodes.into_iter().next().context("an episode")?;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "no group published");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!((episode.outcome(), episode.turns), (EpisodeOutcome::TurnLimit, 2), "{}", episode.outcome_detail);
    let trace_id = episode.trace_id.clone();
    assert_eq!(trace_id.len(), 32, "the episode names its trace: {trace_id:?}");

    // Spans leave each process in batches every 100 ms.
    let expected: [(&str, &str); 8] = [
        ("rollout-orchestrator", "episode"),
        ("agent", "/sleuth.agent.v1.Agent/RunEpisode"),
        ("agent", "policy_turn"),
        ("inference-gateway", "gateway_turn"),
        ("policy-server", "/sleuth.policy.v1.PolicyServer/Generate"),
        ("policy-server", "generate"),
        ("tool-gateway", "/sleuth.tools.v1.ToolGateway/CallTool"),
        ("tool-gateway", "tool_call"),
    ];
    // Complete when every expected span is in, and every parent named (spans
    // of one trace leave their processes in separate batches).
    let complete = |log: &str| {
        let spans: Vec<ExportedSpan> = exported_spans(log).into_iter().filter(|s| s.trace_id == trace_id).collect();
        let present = |service: &str, name: &str| spans.iter().any(|s| s.service == service && s.name == name);
        let parented = |s: &ExportedSpan| s.parent_id.is_empty() || spans.iter().any(|p| p.span_id == s.parent_id);
        expected.iter().all(|(service, name)| present(service, name)) && spans.iter().all(parented)
    };
    let log = sleuth_testkit::wait_for_log(&collector, Duration::from_secs(30), complete)?;
    let spans: Vec<ExportedSpan> = exported_spans(&log).into_iter().filter(|s| s.trace_id == trace_id).collect();
    let services: std::collections::BTreeSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    assert!(services.len() >= 5, "{services:?}");
    // One root: the orchestrator's episode span; every other span has a parent in the trace.
    let roots: Vec<&ExportedSpan> = spans.iter().filter(|s| s.parent_id.is_empty()).collect();
    assert_eq!(roots.len(), 1, "{roots:?}");
    assert_eq!((roots[0].service.as_str(), roots[0].name.as_str()), ("rollout-orchestrator", "episode"));
    // The root names the run and the episode; the turns name their turn and policy version.
    let root = log_block(&log, &roots[0].span_id);
    assert!(root.contains("run_id: Str(traced)"), "{root}");
    assert!(root.contains(&format!("episode_id: Str({})", episode.episode_id)), "{root}");
    let turn = spans.iter().find(|s| s.name == "gateway_turn").context("a gateway turn")?;
    let turn = log_block(&log, &turn.span_id);
    assert!(turn.contains("-> policy_version: ") && turn.contains("-> turn: "), "{turn}");
    Ok(())
}

/// A span as the collector's debug log prints it.
#[derive(Debug, Default, Clone)]
struct ExportedSpan {
    service: String,
    trace_id: String,
    span_id: String,
    parent_id: String,
    name: String,
}

/// The spans in the collector's detailed debug log: a resource's
/// `service.name` line, then per span its trace, parent and own ids and name.
fn exported_spans(log: &str) -> Vec<ExportedSpan> {
    let mut spans = Vec::new();
    let (mut service, mut span) = (String::new(), None::<ExportedSpan>);
    for line in log.lines() {
        let line = line.trim();
        let value = |key: &str| {
            line.strip_prefix(key)
                .and_then(|rest| rest.trim_start().strip_prefix(':'))
                .map(|v| v.trim().trim_start_matches("Str(").trim_end_matches(')').to_owned())
        };
        if let Some(name) = line.strip_prefix("-> service.name:").map(|v| v.trim()) {
            service = name.trim_start_matches("Str(").trim_end_matches(')').to_owned();
        } else if let Some(id) = value("Trace ID") {
            spans.extend(span.take());
            span = Some(ExportedSpan { service: service.clone(), trace_id: id, ..Default::default() });
        } else if let (Some(id), Some(span)) = (value("Parent ID"), span.as_mut()) {
            span.parent_id = id;
        } else if let (Some(id), Some(span)) = (value("ID"), span.as_mut()) {
            span.span_id = id;
        } else if let (Some(name), Some(span)) = (value("Name"), span.as_mut()) {
            span.name = name;
        }
    }
    spans.extend(span);
    spans
}

/// The lines the collector printed for the span `span_id`, from its id to
/// the next span, attributes included.
fn log_block<'a>(log: &'a str, span_id: &str) -> &'a str {
    let at = log.find(&format!("ID             : {span_id}")).unwrap_or(log.len());
    let end = log[at..].find("Span #").map_or(log.len(), |n| at + n);
    &log[at..end]
}

/// Agent workers found through Kubernetes (a fake API server speaking the
/// real list and watch protocol): the orchestrator follows the agents'
/// EndpointSlices, so agents scaled up take episodes and an agent that
/// stops being ready takes no more, with no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_scaled_through_kubernetes_take_episodes_without_a_restart() -> Result<()> {
    use sleuth_testkit::kube_api::FakeKubeApi;
    let scratch = tempfile::tempdir()?;
    let Policies { index, searcher, .. } = policies(scratch.path()).await?;
    let mesh = Mesh::with_agents(&searcher, &index, 3)?;
    mesh.client().await?;
    let api = FakeKubeApi::start().await?;
    // Each test agent listens on its own port: one slice per pod.
    let port = |i: usize| -> Result<u16> { Ok(mesh.agents[i].addr.rsplit(':').next().context("port")?.parse()?) };
    let slice = |i: usize, ready: bool| -> Result<()> {
        api.set_slice("agent", &format!("agent-{i}"), "grpc", port(i)?, &[("127.0.0.1", ready)]);
        Ok(())
    };
    slice(0, true)?;
    let kube = [
        ("SLEUTH_AGENT_WORKERS", "kube://agent:grpc".to_owned()),
        ("KUBECONFIG", api.kubeconfig().display().to_string()),
    ];
    let (orchestrator, mut client) = mesh.orchestrator_with(&scratch.path().join("runs.db"), &kube).await?;
    let episodes = |i: usize| mesh.agents[i].log().matches("episode finished").count();
    let run = async |client: &mut OrchestratorClient<sleuth_kit::client::MeshChannel>, id: &str| -> Result<()> {
        client
            .create_run(rollout::CreateRunRequest { spec: Some(spec(&index, 2, 2, 2, 100, 2)), run_id: id.into() })
            .await?;
        let done = wait_for(client, id, Duration::from_secs(60), |r| r.status != rollout::RunStatus::Running as i32)
            .await
            // Within the test's own limit, so a stuck run shows where it stopped.
            .with_context(|| format!("the orchestrator's log:\n{}", orchestrator.log()))?;
        anyhow::ensure!(done.status == rollout::RunStatus::Succeeded as i32, "{}", done.status_detail);
        Ok(())
    };

    run(&mut client, "one-agent").await?;
    let first = [episodes(0), episodes(1), episodes(2)];
    assert!(first[0] >= 12 && first[1] == 0 && first[2] == 0, "only the listed agent works: {first:?}");

    // kubectl scale up, and the first pod terminating: its endpoint turns unready.
    slice(1, true)?;
    slice(2, true)?;
    slice(0, false)?;
    sleuth_testkit::kube_api::eventually("the orchestrator following", Duration::from_secs(20), || {
        let log = orchestrator.log();
        log.matches("agent worker joined").count() >= 3 && log.contains("agent worker left")
    })
    .await
    .with_context(|| orchestrator.log())?;
    run(&mut client, "scaled").await?;
    let second = [episodes(0) - first[0], episodes(1), episodes(2)];
    assert_eq!(second[0], 0, "the unready agent gets no episode: {second:?}");
    assert!(second[1] > 0 && second[2] > 0 && second[1] + second[2] >= 12, "spread over the new agents: {second:?}");
    eprintln!("kubernetes discovery: episodes per agent {first:?} with one agent listed, then {second:?}");
    Ok(())
}

/// Policy replicas found through Kubernetes: the inference gateway serves
/// turns on the ready replica its Service lists; when that pod goes away and
/// another becomes ready, the gateway drops the first and serves on the
/// second, with no restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_replicas_join_and_leave_the_gateway_through_kubernetes() -> Result<()> {
    use sleuth_proto::common::v1::{ChatMessage, SamplingParams};
    use sleuth_proto::inference::v1::ChatRequest;
    use sleuth_proto::inference::v1::inference_gateway_client::InferenceGatewayClient;
    use sleuth_testkit::kube_api::{FakeKubeApi, eventually};

    let scratch = tempfile::tempdir()?;
    let Policies { searcher, .. } = policies(scratch.path()).await?;
    let redis = sleuth_testkit::redis()?;
    let replica = || {
        ServiceProcess::start(
            "policy-server",
            &[
                ("SLEUTH_MODEL", searcher.display().to_string()),
                ("SLEUTH_DEVICE", "cpu".into()),
                ("SLEUTH_DTYPE", "f32".into()),
            ],
        )
    };
    let (mut first, second) = (replica()?, replica()?);
    let port = |p: &ServiceProcess| -> Result<u16> { Ok(p.addr.rsplit(':').next().context("port")?.parse()?) };
    let api = FakeKubeApi::start().await?;
    api.set_slice("policy", "policy-a", "grpc", port(&first)?, &[("127.0.0.1", true)]);
    let gateway = ServiceProcess::start(
        "inference-gateway",
        &[
            ("SLEUTH_MODEL", searcher.display().to_string()),
            ("SLEUTH_REDIS_URL", sleuth_testkit::redis_url(&redis)),
            ("SLEUTH_POLICY_SERVERS", "kube://policy:grpc".into()),
            ("KUBECONFIG", api.kubeconfig().display().to_string()),
        ],
    )?;
    sleuth_testkit::service::wait_serving(&gateway.addr, "sleuth.inference.v1.InferenceGateway").await?;
    let mut client = InferenceGatewayClient::new(connect(&gateway.addr, None, Duration::from_secs(5)).await?);
    let turn = |episode: String| ChatRequest {
        episode_id: episode,
        messages: vec![ChatMessage { role: "user".into(), content: "why does it rain".into(), ..Default::default() }],
        sampling: Some(SamplingParams { temperature: Some(0.0), max_new_tokens: 8, ..Default::default() }),
        ..Default::default()
    };

    // The listed replica serves (once the watch has listed it).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while client.chat(turn("on-first".into())).await.is_err() {
        anyhow::ensure!(std::time::Instant::now() < deadline, "no turn served\n{}", gateway.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Its pod terminates (unready, then gone) and another one becomes ready:
    // ready as Kubernetes' readiness probe says, once its model is loaded
    // (the server's health includes that), not merely started. Listed
    // earlier, it refused the turns under load ("the model is still loading").
    api.set_slice("policy", "policy-a", "grpc", port(&first)?, &[("127.0.0.1", false)]);
    first.kill()?;
    sleuth_testkit::service::wait_serving(&second.addr, "sleuth.policy.v1.PolicyServer").await?;
    api.set_slice("policy", "policy-b", "grpc", port(&second)?, &[("127.0.0.1", true)]);
    eventually("the gateway following", Duration::from_secs(20), || {
        let log = gateway.log();
        log.contains("policy replica left") && log.matches("policy replica joined").count() == 2
    })
    .await
    .with_context(|| gateway.log())?;
    for i in 0..4 {
        let reply = client.chat(turn(format!("on-second-{i}"))).await?.into_inner();
        anyhow::ensure!(reply.message.is_some(), "turn {i} has no reply");
    }
    Ok(())
}
