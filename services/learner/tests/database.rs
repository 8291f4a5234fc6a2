//! The learner rides out its database being unavailable: with the SQLite
//! file locked by another connection (as a PostgreSQL restart or failover
//! refuses writes), the step's records are retried, logged as such, and
//! written once the database is back; no step is lost or recorded twice.

mod support;

use std::io::BufRead as _;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use sleuth_store::RedisStore;
use sleuth_store::trajectories::publish;
use sqlx::Connection as _;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_recorded_while_the_database_is_locked_is_retried_until_it_is_back() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (env, _redis_server) = Env::start(scratch.path())?;
    let redis = RedisStore::open(&env.redis_url)?;
    let entries = entries();
    let first_two = 2 * BATCH + 2; // + the corrupt and the flat entries
    for entry in &entries[..first_two] {
        publish(&redis, "locked", entry).await?;
    }
    let mut command = learner_command(&env, "locked", &scratch.path().join("locked"), STEPS)?;
    let mut learner = command.stderr(std::process::Stdio::piped()).spawn()?;
    let stderr = learner.stderr.take().context("standard error was piped")?;
    let (lines, said) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    until_step(&env, "locked", 2, &mut learner).await?;

    // Another connection holds the database: every write of the learner's fails.
    let mut holder = sqlx::SqliteConnection::connect(&env.database).await?;
    sqlx::query("BEGIN EXCLUSIVE").execute(&mut holder).await?;
    for entry in &entries[first_two..] {
        publish(&redis, "locked", entry).await?;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = tokio::task::block_in_place(|| said.recv_timeout(left)).context("no retry was logged")?;
        if line.contains("store unavailable") && line.contains("recording the step") {
            break;
        }
    }
    sqlx::query("ROLLBACK").execute(&mut holder).await?;
    drop(holder);

    tokio::task::block_in_place(|| wait_exit(&mut learner, Duration::from_secs(120)))?;
    let steps = recorded_steps(&env.database, "locked").await?;
    ensure!(steps == (1..=STEPS).collect::<Vec<_>>(), "steps recorded: {steps:?}");
    Ok(())
}
