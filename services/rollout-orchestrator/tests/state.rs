//! Run state behaves the same on SQLite and PostgreSQL: idempotent creates,
//! status changes, groups recorded once, episodes, and the runs to resume.

use anyhow::Result;
use rollout_orchestrator::state::State;
use sleuth_proto::rollout::v1::{EpisodeSummary, RunSpec, RunStatus};
use sleuth_store::Database;

async fn exercise(database: Database) -> Result<()> {
    let state = State::open(database.clone()).await?;
    State::open(database).await?; // the schema is created once, reopening is harmless
    let spec = RunSpec { name: "t".into(), group_size: 4, ..Default::default() };
    assert!(state.create("r1", &spec).await?);
    assert!(!state.create("r1", &spec).await?, "creating twice is idempotent");
    assert!(state.create("r2", &spec).await?);
    let run = state.run("r1").await?.expect("r1");
    assert_eq!((run.status, run.spec.map(|s| s.group_size)), (RunStatus::Running as i32, Some(4)));
    assert_eq!(run.stream_key, "sleuth:run:r1:groups");
    state.set_status("r2", RunStatus::Cancelled, "by test").await?;
    let unfinished: Vec<String> = state.unfinished().await?.into_iter().map(|r| r.run_id).collect();
    assert_eq!(unfinished, ["r1"]);
    assert_eq!(state.run("r2").await?.expect("r2").status_detail, "by test");
    assert_eq!(state.runs(0, 10).await?.len(), 2);
    assert_eq!(state.runs(1, 10).await?.len(), 1);

    state.record_group("r1", "e0-q1", "1-0", 0.5, 3).await?;
    state.record_group("r1", "e0-q1", "1-0", 0.5, 3).await?;
    assert_eq!(state.published_groups("r1").await?, ["e0-q1"]);
    let summary = EpisodeSummary { episode_id: "ep".into(), task_id: "q1".into(), reward: 0.5, ..Default::default() };
    state.record_episode("r1", "e0-q1", &summary).await?;
    state.record_episode("r1", "e0-q1", &summary).await?;
    assert!(state.run("missing").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn state_on_sqlite() -> Result<()> {
    let dir = tempfile::tempdir()?;
    exercise(Database::open(&format!("sqlite://{}", dir.path().join("runs.db").display()))?).await
}

#[tokio::test]
async fn state_on_postgres() -> Result<()> {
    let server = sleuth_testkit::postgres()?;
    exercise(Database::connect(&sleuth_testkit::postgres_url(&server)).await?).await
}
