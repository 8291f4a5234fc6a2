//! Builds, once per machine, the test fixtures too heavy to build inside a
//! test, into the sleuth cache (`make test-fixtures`, which `make test` runs
//! first). Each step reports what it does and skips what is already there, so
//! a warm machine pays nothing and a cold one pays before any test starts
//! its clock.

use std::time::Instant;

use anyhow::{Context, Result};
use sleuth_tests::fixture;

#[tokio::main]
async fn main() -> Result<()> {
    scifact_vectors()?;
    fixture::prepare_policies().await?;
    fixture::prepare_learning_base()?;
    eprintln!("fixtures: ready in {}", sleuth_testkit::cache_dir()?.display());
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
