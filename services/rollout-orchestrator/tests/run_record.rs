//! A run's record (status, the reason for it, progress) reads as one
//! consistent thing, whenever it is read and by whichever orchestrator
//! process: the real server on loopback, real Redis and SQLite, and pause
//! points (`sleuth_kit::pause`) that hold a reader while the run ends, so the
//! races these tests guard fail the same way on every machine.

use std::time::Duration;

use anyhow::{Context, Result};
use sleuth_proto::rollout::v1 as pb;
use sleuth_proto::rollout::v1::rollout_orchestrator_client::RolloutOrchestratorClient;
use sleuth_store::{RedisStore, trajectories};

/// A BEIR collection of two judged questions under `dir`.
fn collection(dir: &std::path::Path) -> Result<std::path::PathBuf> {
    let source = dir.join("tiny");
    std::fs::create_dir_all(source.join("qrels"))?;
    std::fs::write(
        source.join("corpus.jsonl"),
        "{\"_id\": \"rain\", \"title\": \"Rain\", \"text\": \"Rain falls.\"}\n\
         {\"_id\": \"fog\", \"title\": \"Fog\", \"text\": \"Fog lingers.\"}\n",
    )?;
    std::fs::write(
        source.join("queries.jsonl"),
        "{\"_id\": \"q1\", \"text\": \"what falls\"}\n{\"_id\": \"q2\", \"text\": \"what lingers\"}\n",
    )?;
    std::fs::write(source.join("qrels").join("test.tsv"), "query-id\tcorpus-id\tscore\nq1\train\t1\nq2\tfog\t1\n")?;
    Ok(source)
}

fn spec(source: &std::path::Path) -> pb::RunSpec {
    pb::RunSpec {
        name: "record".into(),
        train: Some(pb::TaskSet {
            source_uri: source.display().to_string(),
            collection: "tiny".into(),
            split: "test".into(),
            limit: 0,
        }),
        group_size: 1,
        global_batch_size: 1,
        max_epochs: 1,
        rollout_max_concurrency: 1,
        max_staleness: 100,
        ..Default::default()
    }
}

/// An orchestrator in this process on `database` and `redis`, sending
/// episodes to `workers`, with one second of fault patience.
macro_rules! orchestrator {
    ($dir:expr, $database:expr, $redis:expr, $workers:expr) => {{
        let args = [
            "rollout-orchestrator",
            "--listen=127.0.0.1:0",
            "--http-listen=127.0.0.1:0",
            "--fault-patience=1s",
            &format!("--database-url={}", $database),
            &format!("--redis-url={}", $redis),
            &format!("--agent-workers={}", $workers),
            &format!("--report-dir={}", $dir.join("evaluations").display()),
            &format!("--task-roots={}", $dir.display()),
        ];
        let (addr, running) = sleuth_testkit::start_service!(rollout_orchestrator, args);
        let client = RolloutOrchestratorClient::connect(format!("http://{addr}")).await?;
        (running, client)
    }};
}

async fn get(client: &mut RolloutOrchestratorClient<tonic::transport::Channel>, run: &str) -> Result<pb::Run> {
    Ok(client.get_run(pb::GetRunRequest { run_id: run.into() }).await?.into_inner())
}

/// A reader that read the run while it was running, and is answered after
/// the run failed, sees the run as it was: running, no reason. It used to
/// see the failure without its reason (the status came from the process's
/// memory, the reason from the database read before the failure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_read_as_it_fails_never_shows_the_failure_without_its_reason() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let source = collection(scratch.path())?;
    let redis = sleuth_testkit::redis()?;
    let database = format!("sqlite://{}", scratch.path().join("runs.db").display());
    let nobody = format!("127.0.0.1:{}", sleuth_testkit::free_port()?); // no worker listens there
    let (_orchestrator, mut client) =
        orchestrator!(scratch.path(), database, sleuth_testkit::redis_url(&redis), nobody);

    // CreateRun answers with the run as it reads it: held after reading,
    // until the run has failed (no worker, patience spent) and said so.
    let read = sleuth_kit::pause::arm("orchestrator.run-read");
    let ended = sleuth_kit::pause::arm("orchestrator.run-ended");
    let mut creating = client.clone();
    let request = pb::CreateRunRequest { spec: Some(spec(&source)), run_id: "failing".into() };
    let created = tokio::spawn(async move { creating.create_run(request).await });
    tokio::time::timeout(Duration::from_secs(30), read.reached(1)).await.context("CreateRun never read the run")?;
    tokio::time::timeout(Duration::from_secs(30), ended.reached(1)).await.context("the run never ended")?;
    ended.release();
    read.release();
    let answered = created.await??.into_inner();
    assert_eq!(
        (pb::RunStatus::try_from(answered.status)?, answered.status_detail.as_str()),
        (pb::RunStatus::Running, ""),
        "read before the failure, answered after it: the run as read"
    );
    let failed = get(&mut client, "failing").await?;
    assert_eq!(failed.status, pb::RunStatus::Failed as i32);
    assert!(failed.status_detail.contains("no agent worker"), "{:?}", failed.status_detail);
    Ok(())
}

/// A run that finished before the orchestrator restarted reports what it
/// published from the restarted process too (it used to report no
/// progress: progress lived in the memory of the process that drove it),
/// and the learner, which asks whether every group is out, gets the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_orchestrator_reports_a_finished_runs_progress() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let source = collection(scratch.path())?;
    let redis = sleuth_testkit::redis()?;
    let redis_url = sleuth_testkit::redis_url(&redis);
    let database = format!("sqlite://{}", scratch.path().join("runs.db").display());
    // Both groups were published before a crash (markers in Redis), so the
    // run records them without running an episode: no worker is needed.
    let store = RedisStore::open(&redis_url)?;
    for group in ["e0-q1", "e0-q2"] {
        trajectories::publish_once(&store, "finished", group, b"group").await?;
    }
    let nobody = format!("127.0.0.1:{}", sleuth_testkit::free_port()?);
    let (orchestrator, mut client) = orchestrator!(scratch.path(), database, redis_url, nobody);
    client.create_run(pb::CreateRunRequest { spec: Some(spec(&source)), run_id: "finished".into() }).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let finished = loop {
        let run = get(&mut client, "finished").await?;
        if run.status != pb::RunStatus::Running as i32 {
            break run;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "the run never ended: {run:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(finished.status, pb::RunStatus::Succeeded as i32, "{}", finished.status_detail);
    let counts = |run: &pb::Run| run.progress.map(|p| (p.groups_published, p.groups_total));
    assert_eq!(counts(&finished), Some((2, 2)));

    orchestrator.stop().await?;
    let (_restarted, mut client) = orchestrator!(scratch.path(), database, redis_url, nobody);
    let read = get(&mut client, "finished").await?;
    assert_eq!(read.status, pb::RunStatus::Succeeded as i32);
    assert_eq!(counts(&read), Some((2, 2)), "the restarted orchestrator reports the run's progress");
    let listed = client.list_runs(pb::ListRunsRequest::default()).await?.into_inner();
    assert_eq!(listed.runs.iter().map(counts).collect::<Vec<_>>(), [Some((2, 2))]);
    Ok(())
}
