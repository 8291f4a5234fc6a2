//! Episodes per second of a run as the number of agent workers goes 1 -> 2 -> 4,
//! on this machine, with a tiny imprinted policy (it always searches; each
//! episode is 2 model turns and 2 tool calls). Everything (policy server,
//! inference gateway, tool gateway, Redis, the workers, the orchestrator)
//! shares the same cores, which is where the curve flattens.
//!
//! Run: `cargo bench -p sleuth-tests --bench rollout_throughput` (or `make bench`).

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use sleuth_kit::client::connect;
use sleuth_proto::rollout::v1 as rollout;
use sleuth_proto::rollout::v1::rollout_orchestrator_client::RolloutOrchestratorClient;
use sleuth_tests::ServiceProcess;
use sleuth_tests::fixture::{Mesh, Policies, policies, spec, wait_for};

const WORKERS: [usize; 3] = [1, 2, 4];
const EPOCHS: u32 = 4;
const GROUP: u32 = 4;
const CONCURRENCY: u32 = 16;

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let Policies { index, searcher, .. } = policies(scratch.path()).await?;
    let mesh = Mesh::with_agents(&searcher, &index, 4)?;
    mesh.client().await?;
    println!(
        "rollout throughput: 6 tasks x {EPOCHS} epochs, groups of {GROUP}, {CONCURRENCY} episodes at once, 2 turns each"
    );
    println!("{:>8} {:>10} {:>12} {:>10}", "workers", "episodes", "seconds", "episodes/s");
    let mut rates = Vec::new();
    for workers in WORKERS {
        let addresses: Vec<String> = mesh.agents[..workers].iter().map(|a| a.addr.clone()).collect();
        let orchestrator = ServiceProcess::start(
            "rollout-orchestrator",
            &[
                ("SLEUTH_REDIS_URL", mesh.redis_url.clone()),
                (
                    "SLEUTH_DATABASE_URL",
                    format!("sqlite://{}", scratch.path().join(format!("runs-{workers}.db")).display()),
                ),
                ("SLEUTH_AGENT_WORKERS", addresses.join(",")),
                ("SLEUTH_TASK_ROOTS", index.parent().map(|p| p.display().to_string()).unwrap_or_default()),
            ],
        )?;
        sleuth_testkit::service::wait_serving(&orchestrator.addr, "sleuth.rollout.v1.RolloutOrchestrator").await?;
        let mut client =
            RolloutOrchestratorClient::new(connect(&orchestrator.addr, None, Duration::from_secs(5)).await?);
        let mut run_spec = spec(&index, GROUP, 1, CONCURRENCY, 1_000_000, 2);
        run_spec.max_epochs = EPOCHS;
        let run_id = format!("bench-{workers}");
        let started = Instant::now();
        client.create_run(rollout::CreateRunRequest { spec: Some(run_spec), run_id: run_id.clone() }).await?;
        let done = wait_for(&mut client, &run_id, Duration::from_secs(600), |run| {
            run.status != rollout::RunStatus::Running as i32
        })
        .await?;
        let seconds = started.elapsed().as_secs_f64();
        ensure!(done.status == rollout::RunStatus::Succeeded as i32, "run failed: {}", done.status_detail);
        let episodes = done.progress.map_or(0, |p| p.episodes_finished);
        let rate = episodes as f64 / seconds;
        rates.push(rate);
        println!("{workers:>8} {episodes:>10} {seconds:>12.1} {rate:>10.2}");
    }
    println!("scaling: 2 workers {:.2}x, 4 workers {:.2}x of 1 worker", rates[1] / rates[0], rates[2] / rates[0]);
    Ok(())
}
