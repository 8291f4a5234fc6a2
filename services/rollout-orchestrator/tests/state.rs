//! Run state behaves the same on SQLite and PostgreSQL: idempotent creates,
//! status changes, groups recorded once, episodes, the runs to resume, and
//! upgrades of a database an older release made.

use anyhow::Result;
use prost::Message;
use rollout_orchestrator::state::State;
use sleuth_proto::common::v1::{Episode, TrajectoryGroup};
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
    assert!(state.transition("r2", RunStatus::Running, RunStatus::Cancelled, "by test").await?);
    assert!(
        !state.transition("r2", RunStatus::Running, RunStatus::Succeeded, "").await?,
        "only a running run ends: the cancellation stays"
    );
    let unfinished: Vec<String> = state.unfinished().await?.into_iter().map(|r| r.run_id).collect();
    assert_eq!(unfinished, ["r1"]);
    assert_eq!(state.run("r2").await?.expect("r2").status_detail, "by test");
    assert_eq!(state.runs(0, 10).await?.len(), 2);
    assert_eq!(state.runs(1, 10).await?.len(), 1);

    let group = TrajectoryGroup {
        run_id: "r1".into(),
        group_id: "e0-q1".into(),
        episodes: vec![Episode { episode_id: "r1-e0-q1-0".into(), reward: 0.5, ..Default::default() }],
        policy_version: 3,
        ..Default::default()
    };
    let encoded = group.encode_to_vec();
    state.record_group("r1", "e0-q1", "1-0", 0.5, 3, Some(&encoded)).await?;
    state.record_group("r1", "e0-q1", "1-0", 0.5, 3, Some(&encoded)).await?;
    state.record_group("r1", "e0-q2", "", 0.0, 0, None).await?; // found published after a crash
    state.set_groups_total("r1", 6).await?;
    let progress = state.run("r1").await?.and_then(|r| r.progress).expect("progress");
    assert_eq!((progress.groups_published, progress.groups_total), (2, 6), "a repeated group is counted once");
    let mut published = state.published_groups("r1").await?;
    published.sort();
    assert_eq!(published, ["e0-q1", "e0-q2"]);
    assert_eq!(state.group_trajectories("r1", "e0-q1").await?, Some(group), "the trajectories are kept");
    assert_eq!(state.group_trajectories("r1", "e0-q2").await?, None);
    assert_eq!(state.group_trajectories("r1", "e9-q9").await?, None);
    let summary = EpisodeSummary { episode_id: "ep".into(), task_id: "q1".into(), reward: 0.5, ..Default::default() };
    state.record_episode("r1", "e0-q1", &summary).await?;
    state.record_episode("r1", "e0-q1", &summary).await?;
    let stats = state.training_stats("r1").await?;
    assert_eq!((stats.len(), stats[0].episodes, stats[0].reward_mean), (1, 1, 0.5), "a repeat is counted once");
    assert_eq!(state.run("r1").await?.and_then(|r| r.progress).map(|p| p.episodes_finished), Some(1));
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

/// A database an older Sleuth made (its tables created at start, no
/// migration history) with a run and an episode in it.
async fn before_migrations(database: &Database) -> Result<()> {
    for ddl in [
        "CREATE TABLE runs (run_id TEXT PRIMARY KEY, spec TEXT NOT NULL, status INTEGER NOT NULL,
            detail TEXT NOT NULL, created_unix BIGINT NOT NULL, updated_unix BIGINT NOT NULL)",
        "CREATE TABLE run_episodes (run_id TEXT NOT NULL, episode_id TEXT NOT NULL, group_id TEXT NOT NULL,
            task_id TEXT NOT NULL, outcome INTEGER NOT NULL, reward DOUBLE PRECISION NOT NULL,
            ndcg DOUBLE PRECISION NOT NULL, turns BIGINT NOT NULL, tokens BIGINT NOT NULL,
            policy_version BIGINT NOT NULL, PRIMARY KEY (run_id, episode_id))",
        "INSERT INTO runs VALUES ('old', '', 2, 'from the last release', 1, 1)", // 2: running
        "INSERT INTO run_episodes VALUES ('old', 'old-e0-q1-0', 'e0-q1', 'q1', 1, 0.75, 0.5, 3, 900, 4)",
    ] {
        sqlx::query(ddl).execute(database.pool()).await?;
    }
    Ok(())
}

/// An upgrade adds to existing tables in place: the old rows stay, the new
/// column takes its default, new rows use it, and the history is recorded so
/// the next start changes nothing; a database newer than the build is refused.
async fn upgrade(database: Database) -> Result<()> {
    before_migrations(&database).await?;
    // Two services start together on one database (the learner and the orchestrator).
    let (first, second) = tokio::join!(State::open(database.clone()), State::open(database.clone()));
    let (state, _) = (first?, second?);
    let old = state.run("old").await?.expect("the old run is kept");
    assert_eq!((old.status, old.status_detail.as_str()), (RunStatus::Running as i32, "from the last release"));
    let kept = state.episodes("old", 0, 10).await?;
    assert_eq!(kept.len(), 1);
    assert_eq!((kept[0].episode_id.as_str(), kept[0].reward, kept[0].turns), ("old-e0-q1-0", 0.75, 3));
    assert_eq!(kept[0].metrics["ndcg@10"], 0.5);
    assert_eq!(kept[0].trace_id, "", "episodes from before traces name none");
    let progress = old.progress.expect("the record holds progress");
    assert_eq!((progress.episodes_finished, progress.groups_published), (1, 0), "counted from the rows kept");
    let stats = state.training_stats("old").await?;
    assert_eq!(
        (stats.len(), stats[0].version, stats[0].episodes),
        (1, 4, 1),
        "the old episode is in the per-version sums"
    );
    assert_eq!((stats[0].reward_mean, stats[0].ndcg_mean, stats[0].turns_mean), (0.75, 0.5, 3.0));

    let traced = EpisodeSummary {
        episode_id: "old-e1-q2-0".into(),
        task_id: "q2".into(),
        trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
        ..Default::default()
    };
    state.record_episode("old", "e1-q2", &traced).await?;
    let page = state.episodes("old", 1, 10).await?;
    assert_eq!(page.iter().map(|e| e.trace_id.as_str()).collect::<Vec<_>>(), ["0af7651916cd43dd8448eb211c80319c"]);

    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version").fetch_all(database.pool()).await?;
    let newest = sleuth_store::sql::MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    assert_eq!(versions, (1..=newest).collect::<Vec<_>>());
    State::open(database.clone()).await?;

    // A rollback to this build after a newer one migrated: refused by name.
    let from_the_future = match database.engine() {
        sleuth_store::sql::Engine::Sqlite => sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (999, 'from the future', TRUE, X'00', 0)",
        ),
        sleuth_store::sql::Engine::Postgres => sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (999, 'from the future', TRUE, decode('00', 'hex'), 0)",
        ),
    };
    from_the_future.execute(database.pool()).await?;
    let error = State::open(database).await.err().expect("a newer schema is refused").to_string();
    assert!(error.contains("schema version 999") && error.contains("newer than this build"), "{error}");
    Ok(())
}

/// A newer release's migration adds a column while this one keeps running
/// (a rolling upgrade; the learner and the orchestrator starting together
/// is the same race). This build's connection prepared its reads of a run
/// before, and SQLite re-prepares them against the new schema: the rows
/// must still read as this build's runs, not crash the driver.
#[tokio::test]
async fn a_run_reads_whole_after_another_connection_adds_a_column() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let url = format!("sqlite://{}", dir.path().join("runs.db").display());
    let state = State::open(Database::open(&url)?).await?;
    assert!(state.create("r", &RunSpec::default()).await?);
    assert!(state.run("r").await?.is_some());
    assert_eq!(state.runs(0, 10).await?.len(), 1);
    let newer = Database::open(&url)?;
    sqlx::query("ALTER TABLE runs ADD COLUMN from_a_later_release TEXT").execute(newer.pool()).await?;
    let run = state.run("r").await?.expect("the run");
    assert_eq!((run.run_id.as_str(), run.status), ("r", RunStatus::Running as i32));
    assert_eq!(state.runs(0, 10).await?.len(), 1);
    assert_eq!(state.unfinished().await?.len(), 1);
    Ok(())
}

#[tokio::test]
async fn an_old_sqlite_database_upgrades_with_its_rows_kept() -> Result<()> {
    let dir = tempfile::tempdir()?;
    upgrade(Database::open(&format!("sqlite://{}", dir.path().join("runs.db").display()))?).await
}

#[tokio::test]
async fn an_old_postgres_database_upgrades_with_its_rows_kept() -> Result<()> {
    let server = sleuth_testkit::postgres()?;
    upgrade(Database::connect(&sleuth_testkit::postgres_url(&server)).await?).await
}
