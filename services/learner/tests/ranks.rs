//! A learner of 1, 2 and 3 ranks as separate processes (c10d's Gloo over
//! loopback, the store at rank 0), on real Redis, SQLite and checkpoints:
//! every world size trains the same steps from the same groups to the same
//! weights within the tolerance below; a rank killed mid-run makes every
//! other rank fail its next step with an error naming it, and the run,
//! started again, ends where the uninterrupted one did.

mod support;

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, ensure};
use sleuth_store::RedisStore;
use sleuth_store::trajectories::publish;
use support::*;

/// AdamW's update is lr x m / sqrt(v): a relative change d in a gradient
/// moves a parameter by about lr x d per step. Ranks sum their f32
/// gradients in another order than one rank does (d ~ 1e-6, up to ~1e-4
/// where terms cancel), so after 6 steps at lr 1e-2 weights may differ by a
/// few 1e-6; the bound leaves room for that and nothing more.
const TOLERANCE: f64 = 2e-5;

const LIMIT: Duration = Duration::from_secs(180);

async fn publish_all(redis: &RedisStore, run: &str, entries: &[Vec<u8>]) -> Result<()> {
    for entry in entries {
        publish(redis, run, entry).await?;
    }
    Ok(())
}

/// The largest difference between the final weights of two runs.
fn max_difference(a: &Path, b: &Path) -> Result<f64> {
    let (a, b) = (final_params(a)?, final_params(b)?);
    ensure!(a.len() == b.len(), "{} tensors against {}", a.len(), b.len());
    let mut largest = 0f64;
    for ((name, x), (other, y)) in a.iter().zip(&b) {
        ensure!(name == other, "{name} against {other}");
        largest = largest.max((x - y).abs().max().double_value(&[]));
    }
    Ok(largest)
}

/// Runs every rank of `run` to the end; each must exit cleanly.
fn finish(ranks: Vec<std::process::Child>) -> Result<()> {
    for (rank, child) in ranks.into_iter().enumerate() {
        let (status, stderr) = exit_and_stderr(child, LIMIT)?;
        ensure!(status.success(), "rank {rank} exited with {status}:\n{stderr}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learner_ranks_train_alike_and_a_killed_rank_is_named_and_resumed() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (env, _redis_server) = Env::start(scratch.path())?;
    let redis = RedisStore::open(&env.redis_url)?;
    let entries = entries();

    let one = scratch.path().join("one");
    publish_all(&redis, "one", &entries).await?;
    tokio::task::block_in_place(|| finish(learner_ranks(&env, "one", &one, 1)?))?;
    for (run, world) in [("two", 2), ("three", 3)] {
        let dir = scratch.path().join(run);
        publish_all(&redis, run, &entries).await?;
        tokio::task::block_in_place(|| finish(learner_ranks(&env, run, &dir, world)?))?;
        let difference = max_difference(&one, &dir)?;
        println!("{world} ranks: final weights within {difference:.2e} of one rank's");
        ensure!(difference <= TOLERANCE, "{world} ranks end {difference:.2e} from one rank (bound {TOLERANCE:e})");
        ensure!(recorded_steps(&env.database, run).await? == (1..=STEPS).collect::<Vec<_>>());
    }

    // Three ranks; rank 2 is killed after step 3 (checkpoint at 2). The
    // next step's first collective fails on ranks 0 and 1, which name it.
    let killed = scratch.path().join("killed");
    let first_three = 3 * BATCH + 2; // + the corrupt and the flat entries
    publish_all(&redis, "killed", &entries[..first_three]).await?;
    let mut ranks = learner_ranks(&env, "killed", &killed, 3)?;
    until_step(&env, "killed", 3, &mut ranks[0]).await?;
    let mut gone = ranks.pop().expect("rank 2");
    let killed_now = gone.kill(); // SIGKILL
    gone.wait()?;
    killed_now?;
    publish_all(&redis, "killed", &entries[first_three..]).await?;
    for (rank, child) in ranks.into_iter().enumerate() {
        let (status, stderr) = tokio::task::block_in_place(|| exit_and_stderr(child, LIMIT))?;
        ensure!(!status.success(), "rank {rank} went on without rank 2:\n{stderr}");
        ensure!(stderr.contains("rank 2 is gone"), "rank {rank} does not name rank 2:\n{stderr}");
    }
    ensure!(!recorded_steps(&env.database, "killed").await?.contains(&4), "step 4 was recorded without rank 2");

    // Started again, the three ranks resume from step 2 and end where the
    // uninterrupted three-rank run did.
    tokio::task::block_in_place(|| finish(learner_ranks(&env, "killed", &killed, 3)?))?;
    let difference = max_difference(&scratch.path().join("three"), &killed)?;
    ensure!(difference == 0.0, "the resumed run ends {difference:e} from the uninterrupted one");
    Ok(())
}
