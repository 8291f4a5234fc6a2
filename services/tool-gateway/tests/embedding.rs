//! The libtorch BERT encoder agrees with sentence-transformers, and the
//! batcher groups concurrent queries without changing their embeddings.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tool_gateway::embed::batcher::Embedder;
use tool_gateway::embed::{Encoder, default_model_dir};

fn sentences() -> Vec<String> {
    [
        "Vitamin D deficiency is associated with lower bone density.",
        "short",
        "The quick brown fox jumps over the lazy dog, again and again, until the dog finally wakes up and chases it.",
        "0-dimensional biomaterials show inductive properties.",
        // Longer than the 256-token limit: truncation must match too.
        &"protein folding and misfolding in neurodegenerative disease ".repeat(60),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn encoder() -> Result<Encoder> {
    let dir = default_model_dir().context("all-MiniLM-L6-v2 is not installed in the venv; run `make setup`")?;
    Ok(Encoder::load(&dir, tch::Device::Cpu)?)
}

#[test]
fn embeddings_match_sentence_transformers() -> Result<()> {
    let encoder = encoder()?;
    let ours = encoder.encode(&sentences())?;

    let dir = default_model_dir().context("model dir")?;
    let script = &sleuth_testkit::checkout_file("services/tool-gateway/tests/st_reference.py");
    let input = serde_json::to_value(sentences())?;
    let theirs: Vec<Vec<f32>> =
        serde_json::from_value(sleuth_testkit::run_python_json(script, &[dir.as_os_str()], Some(&input))?)?;

    assert_eq!(ours.len(), theirs.len());
    for (index, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a.len(), 384);
        let max_diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(max_diff < 1e-4, "sentence {index}: max |diff| {max_diff}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_queries_are_batched_without_changing_results() -> Result<()> {
    let encoder = encoder()?;
    let alone = encoder.encode(&sentences())?;
    let embedder = Embedder::spawn(Arc::new(encoder), 32, Duration::from_millis(20));
    let mut callers = Vec::new();
    for round in 0..8 {
        for (index, sentence) in sentences().into_iter().enumerate() {
            let embedder = embedder.clone();
            callers.push(tokio::spawn(async move { (round, index, embedder.embed(sentence).await) }));
        }
    }
    for caller in callers {
        let (_, index, vector) = caller.await?;
        let vector = vector?;
        let max_diff = vector.iter().zip(&alone[index]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(max_diff < 1e-4, "sentence {index} changed when batched: {max_diff}");
    }
    let stats = embedder.stats();
    assert_eq!(stats.queries, 40);
    assert!(stats.batches < stats.queries, "40 concurrent queries ran in {} batches", stats.batches);
    Ok(())
}
