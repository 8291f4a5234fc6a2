//! Retrieval benchmark: Sleuth's BM25 and sentence encoder against their
//! peers, `bm25s` and `sentence-transformers`, in one run on this machine,
//! on the same SciFact corpus and test queries.
//!
//! - BM25: queries/s and p50/p99 latency with 1 and 32 concurrent clients
//!   (in-process for both: threads issuing single-query searches), and nDCG@10
//!   of both rankings computed by the same trec_eval-exact code.
//! - Embedding: sentences/s encoding the same documents and queries, batch 32.
//!
//! Run: `make bench` (needs ../shared/data and `make setup`'s venv).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::{Value, json};
use sleuth_beir::{BadLines, BeirDir};
use tool_gateway::bm25::Bm25Options;
use tool_gateway::collection::Collection;
use tool_gateway::embed::{Encoder, default_model_dir};

/// Passes over the 300 test queries per measurement.
const REPEAT: usize = 20;
const K: usize = 10;
const CLIENTS: [usize; 2] = [1, 32];
/// Documents encoded in the embedding measurement (SciFact abstracts, up to 256 tokens).
const EMBED_DOCUMENTS: usize = 256;
const EMBED_BATCH: usize = 32;

struct Throughput {
    qps: f64,
    p50: Duration,
    p99: Duration,
}

fn summarize(qps: f64, mut latencies: Vec<Duration>) -> Throughput {
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    Throughput { qps, p50: at(0.50), p99: at(0.99) }
}

fn peer(script: &str, request: &Value) -> Result<Value> {
    let path = sleuth_testkit::checkout_file(&format!("bench/peers/{script}"));
    sleuth_testkit::run_python_json(&path, &[], Some(request))
}

fn sleuth_bm25(collection: &Collection, queries: &[(String, String)], clients: usize) -> Result<Throughput> {
    let work: Vec<&str> = (0..REPEAT).flat_map(|_| queries.iter().map(|(_, text)| text.as_str())).collect();
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let latencies = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..clients)
            .map(|_| {
                scope.spawn(|| {
                    let mut latencies = Vec::new();
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let Some(query) = work.get(index) else { break };
                        let began = Instant::now();
                        let hits = collection.bm25(query, K).expect("search");
                        std::hint::black_box(hits);
                        latencies.push(began.elapsed());
                    }
                    latencies
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("worker")).collect::<Vec<_>>()
    });
    Ok(summarize(work.len() as f64 / started.elapsed().as_secs_f64(), latencies))
}

fn main() -> Result<()> {
    let source = sleuth_testkit::beir_collection("scifact")?;
    let beir = BeirDir::new(&source);
    let corpus: Vec<_> = beir.corpus(BadLines::Fail)?.collect::<Result<_, _>>()?;
    let qrels = beir.qrels("test")?;
    let queries: Vec<(String, String)> = beir
        .queries(BadLines::Fail)?
        .into_iter()
        .filter(|q| qrels.contains_key(&q.id))
        .map(|q| (q.id, q.text))
        .collect();
    println!(
        "SciFact: {} documents, {} judged test queries, {} threads available",
        corpus.len(),
        queries.len(),
        num_threads()
    );

    // --- BM25 ---
    let scratch = tempfile::tempdir()?;
    let index_dir = scratch.path().join("scifact");
    tool_gateway::index::build(
        &beir,
        &index_dir,
        "scifact",
        &Bm25Options::default(),
        BadLines::Fail,
        None,
        &mut |_| {},
    )?;
    let collection = Collection::open(&index_dir, index_dir.display().to_string())?;
    let ours_rankings: BTreeMap<String, Vec<String>> = queries
        .iter()
        .map(|(id, text)| {
            let hits = collection.bm25(text, K).expect("search");
            (id.clone(), hits.iter().map(|h| collection.document(h.ordinal).id.clone()).collect())
        })
        .collect();
    let ours_ndcg = sleuth_metrics::evaluate(&ours_rankings, &qrels).ndcg_at_10;
    let ours: Vec<Throughput> =
        CLIENTS.iter().map(|&c| sleuth_bm25(&collection, &queries, c)).collect::<Result<_>>()?;

    let request = json!({
        "corpus": corpus.iter().map(|d| (d.id.clone(), format!("{}\n{}", d.title, d.text))).collect::<Vec<_>>(),
        "queries": queries,
        "k": K,
        "repeat": REPEAT,
        "clients": CLIENTS,
    });
    let answer = peer("bm25s_peer.py", &request)?;
    let peer_rankings: BTreeMap<String, Vec<String>> = serde_json::from_value(answer["rankings"].clone())?;
    let peer_ndcg = sleuth_metrics::evaluate(&peer_rankings, &qrels).ndcg_at_10;
    let theirs: Vec<Throughput> = CLIENTS
        .iter()
        .map(|clients| {
            let result = &answer["results"][clients.to_string()];
            let latencies: Vec<Duration> = result["latencies_us"]
                .as_array()
                .map(|l| l.iter().filter_map(Value::as_f64).map(|us| Duration::from_secs_f64(us / 1e6)).collect())
                .unwrap_or_default();
            summarize(result["qps"].as_f64().unwrap_or(0.0), latencies)
        })
        .collect();

    println!(
        "\nBM25 (k={K}, {REPEAT} passes over the test queries)  nDCG@10: sleuth {ours_ndcg:.4}, bm25s {peer_ndcg:.4}"
    );
    println!(
        "{:>8} {:>12} {:>10} {:>10} {:>12} {:>10} {:>10} {:>9}",
        "clients", "sleuth q/s", "p50", "p99", "bm25s q/s", "p50", "p99", "ratio"
    );
    for ((clients, o), t) in CLIENTS.iter().zip(&ours).zip(&theirs) {
        println!(
            "{clients:>8} {:>12.0} {:>10.1?} {:>10.1?} {:>12.0} {:>10.1?} {:>10.1?} {:>8.2}x",
            o.qps,
            o.p50,
            o.p99,
            t.qps,
            t.p50,
            t.p99,
            o.qps / t.qps
        );
    }

    // --- Embedding ---
    let Some(model_dir) = default_model_dir() else {
        anyhow::bail!("all-MiniLM-L6-v2 is not installed in the venv; run `make setup`");
    };
    let encoder = Encoder::load(&model_dir, tch::Device::Cpu)?;
    let documents: Vec<String> =
        corpus.iter().take(EMBED_DOCUMENTS).map(|d| format!("{} {}", d.title, d.text).trim().to_owned()).collect();
    let query_texts: Vec<String> = queries.iter().map(|(_, text)| text.clone()).collect();
    println!("\nEmbedding (all-MiniLM-L6-v2, batch {EMBED_BATCH}, max 256 tokens)");
    println!("{:>24} {:>14} {:>14} {:>9}", "texts", "sleuth sent/s", "s-t sent/s", "ratio");
    for (label, texts) in [
        (format!("{} documents", documents.len()), &documents),
        (format!("{} queries", query_texts.len()), &query_texts),
    ] {
        encoder.encode(&texts[..EMBED_BATCH.min(texts.len())])?; // warm-up
        let started = Instant::now();
        encoder.encode_all(texts, EMBED_BATCH, &mut |_| {})?;
        let ours = texts.len() as f64 / started.elapsed().as_secs_f64();
        let answer = peer(
            "sentence_transformers_peer.py",
            &json!({"model_dir": model_dir, "texts": texts, "batch_size": EMBED_BATCH}),
        )?;
        let theirs = answer["sentences_per_s"].as_f64().unwrap_or(0.0);
        println!("{label:>24} {ours:>14.1} {theirs:>14.1} {:>8.2}x", ours / theirs);
    }
    Ok(())
}

fn num_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
