//! Builds, once per machine, the test fixtures too heavy to build inside a
//! test, into the sleuth cache (`make test-fixtures`, which `make test` runs
//! first). Each job reports what it does and skips what is already there, so
//! a warm machine pays nothing and a cold one pays before any test starts
//! its clock.
//!
//! The jobs run side by side, one per core, the longest first, and every
//! libtorch operation runs on the thread that calls it: the models are small
//! enough that one operation spread over two cores left a fifth of the
//! machine idle (1.66 busy cores of 2 over the fixtures of a cold run), and
//! one job after another kept the machine waiting on the longest.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{Context, Result};
use sleuth_tests::fixture;

/// One fixture to make.
struct Job {
    name: String,
    /// Seconds it took on two cores, cold (the longest start first).
    cost: u32,
    make: Box<dyn FnOnce() -> Result<()> + Send>,
}

fn main() -> Result<()> {
    let started = Instant::now();
    // The imprinted policies are made for the tools a tool gateway lists.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let tools = runtime.block_on(fixture::imprint_tools())?;
    drop(runtime);

    let mut jobs = vec![
        Job { name: "SciFact vector index".into(), cost: 309, make: Box::new(scifact_vectors) },
        Job {
            name: "learning base policy".into(),
            cost: 440,
            make: Box::new(|| fixture::prepare_learning_base().map(drop)),
        },
    ];
    let imprint_costs = [165, 91, 37, 85];
    for ((name, replies), cost) in fixture::IMPRINTS.into_iter().zip(imprint_costs) {
        let tools = tools.clone();
        jobs.push(Job {
            name: format!("{name} policy"),
            cost,
            make: Box::new(move || fixture::prepare_policy(name, replies, &tools)),
        });
    }
    jobs.sort_by_key(|job| std::cmp::Reverse(job.cost));
    let workers = std::thread::available_parallelism().map_or(1, usize::from).min(jobs.len());
    tch::set_num_threads(1);

    let queue = Mutex::new(VecDeque::from(jobs));
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                loop {
                    // Taken in a statement of its own: the queue is not locked while the job runs.
                    let Some(job) = queue.lock().expect("queue").pop_front() else { break };
                    if let Err(error) = (job.make)() {
                        eprintln!("fixtures: {} failed: {error:#}", job.name);
                        failures.lock().expect("failures").push(format!("{}: {error:#}", job.name));
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().expect("failures");
    anyhow::ensure!(failures.is_empty(), "{} fixture(s) failed:\n{}", failures.len(), failures.join("\n"));
    eprintln!(
        "fixtures: ready in {} ({:.0}s, {workers} at a time)",
        sleuth_testkit::cache_dir()?.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// SciFact embedded for vector search ([`sleuth_testkit::SCIFACT_VECTORS`]).
fn scifact_vectors() -> Result<()> {
    let cache = sleuth_testkit::cache_dir()?;
    let dir = cache.join(sleuth_testkit::SCIFACT_VECTORS);
    if dir.join("manifest.json").is_file() {
        eprintln!("fixtures: SciFact vector index cached: {}", dir.display());
        return Ok(());
    }
    let source = sleuth_testkit::beir_collection("scifact")?;
    let parent = dir.parent().context("fixture path has a parent")?;
    std::fs::create_dir_all(parent)?;
    // Build beside the target and rename, so an interrupted build leaves nothing a test could find.
    let scratch = tempfile::Builder::new().prefix(".scifact-").tempdir_in(parent)?;
    let out = scratch.path().join("index");
    eprintln!("fixtures: embedding SciFact (5,183 abstracts; minutes on a CPU) into {}", dir.display());
    let started = Instant::now();
    fixture::index_collection(&source, &out, "scifact", true)?;
    std::fs::rename(&out, &dir).with_context(|| format!("moving the SciFact index into {}", dir.display()))?;
    eprintln!("fixtures: SciFact vector index built in {:.0}s", started.elapsed().as_secs_f64());
    Ok(())
}
