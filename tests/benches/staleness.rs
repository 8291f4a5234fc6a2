//! Wall-clock per learner step, synchronous (`max_staleness: 0`: the next
//! step's episodes start only on the new weights) against asynchronous
//! (`max_staleness: 2`: rollouts run up to two versions ahead while the
//! learner trains), same spec otherwise, each on a fresh mesh: the tiny
//! mixed imprinted policy on the weather collection, groups of 4, 2 groups a
//! step, a real learner publishing every step. Prints seconds per step and
//! the ratio.
//!
//! Run: `cargo bench -p sleuth-tests --bench staleness` (or `make bench`).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use sleuth_proto::common::v1::SamplingParams;
use sleuth_proto::rollout::v1 as rollout;
use sleuth_tests::fixture::{Mesh, Policies, policies, spec};

/// Steps timed per run, after the first (which includes start-up).
const STEPS: u64 = 6;

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let Policies { index, mixed, .. } = policies(scratch.path()).await?;
    println!("learner step wall-clock: groups of 4, 2 groups a step, {STEPS} steps timed after the first");
    println!("{:>14} {:>14} {:>14}", "max_staleness", "seconds/step", "episodes");
    let mut per_step = Vec::new();
    for staleness in [0u32, 2] {
        let data = scratch.path().join(format!("staleness-{staleness}"));
        std::fs::create_dir_all(&data)?;
        let mesh = Mesh::with_agents(&mixed, &index, 2)?;
        mesh.client().await?;
        let (orchestrator, mut client) = mesh.orchestrator(&data.join("runs.db")).await?;
        let mut run_spec = spec(&index, 4, 2, 8, staleness, 3);
        run_spec.max_epochs = 20;
        run_spec.agent.as_mut().context("agent")?.sampling =
            Some(SamplingParams { temperature: Some(1.0), seed: Some(3), ..Default::default() });
        run_spec.training =
            Some(rollout::TrainingSpec { learning_rate: 1e-3, checkpoint_every: 100, ..Default::default() });
        let run_id = format!("staleness-{staleness}");
        client.create_run(rollout::CreateRunRequest { spec: Some(run_spec), run_id: run_id.clone() }).await?;
        let _learner = mesh.learner(&run_id, &data, &data.join("learner.db"), &orchestrator)?;
        let redis = sleuth_store::RedisStore::open(&mesh.redis_url)?;
        let version = || sleuth_store::trajectories::learner_version(&redis, &run_id);
        let reach = |target: u64| async move {
            let deadline = Instant::now() + Duration::from_secs(900);
            while version().await? < target {
                ensure!(Instant::now() < deadline, "step {target} not reached in 15 minutes");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok::<_, anyhow::Error>(())
        };
        reach(1).await?;
        let started = Instant::now();
        reach(1 + STEPS).await?;
        let seconds = started.elapsed().as_secs_f64() / STEPS as f64;
        let run = client.get_run(rollout::GetRunRequest { run_id }).await?.into_inner();
        let episodes = run.progress.map_or(0, |p| p.episodes_finished);
        println!("{staleness:>14} {seconds:>14.2} {episodes:>14}");
        per_step.push(seconds);
    }
    println!("asynchronous (max_staleness 2) is {:.2}x the synchronous speed per step", per_step[0] / per_step[1]);
    Ok(())
}
