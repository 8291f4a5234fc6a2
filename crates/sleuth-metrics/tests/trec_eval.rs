//! The Rust metrics agree with trec_eval (through pytrec_eval) query by query
//! on a run with graded judgements, score ties, non-relevant-only queries,
//! unjudged queries and judged queries missing from the run.

use std::collections::BTreeMap;

use anyhow::Result;
use sleuth_metrics::run::{read_run, write_run};
use sleuth_metrics::{Qrels, evaluate};

/// A small deterministic generator, so the fixture is the same on every run.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, bound: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % bound
    }
}

fn fixture() -> (Qrels, BTreeMap<String, Vec<(String, f64)>>) {
    let mut rng = Lcg(42);
    let mut qrels = Qrels::new();
    let mut run = BTreeMap::new();
    for q in 0..60 {
        let query = format!("q{q:02}");
        if q % 10 != 9 {
            // Judged: graded 0..=3, some -1, and every 7th query non-relevant only.
            let judgements = qrels.entry(query.clone()).or_default();
            for _ in 0..(3 + rng.next(30)) {
                let rel = if q % 7 == 0 { 0 } else { rng.next(5) as i32 - 1 };
                judgements.insert(format!("d{:03}", rng.next(300)), rel);
            }
        }
        if q % 13 != 5 {
            // Retrieved: scores from a small set, so ties are common.
            let mut ranking: Vec<(String, f64)> = Vec::new();
            for _ in 0..(1 + rng.next(150)) {
                let doc = format!("d{:03}", rng.next(300));
                if !ranking.iter().any(|(d, _)| *d == doc) {
                    ranking.push((doc, rng.next(20) as f64 / 4.0));
                }
            }
            run.insert(query, ranking);
        }
    }
    (qrels, run)
}

#[test]
fn metrics_match_trec_eval_query_by_query() -> Result<()> {
    let (qrels, run) = fixture();
    let dir = tempfile::tempdir()?;
    let qrels_path = dir.path().join("qrels.txt");
    let run_path = dir.path().join("run.txt");
    let mut qrels_text = String::new();
    for (query, judgements) in &qrels {
        for (doc, rel) in judgements {
            qrels_text.push_str(&format!("{query} 0 {doc} {rel}\n"));
        }
    }
    std::fs::write(&qrels_path, qrels_text)?;
    let mut run_file = Vec::new();
    write_run(&mut run_file, &run, "fixture")?;
    std::fs::write(&run_path, &run_file)?;

    let script = &sleuth_testkit::checkout_file("crates/sleuth-metrics/tests/pytrec_eval_check.py");
    let output = sleuth_testkit::run_python_json(script, &[qrels_path.as_os_str(), run_path.as_os_str()], None)?;
    let reference: BTreeMap<String, BTreeMap<String, f64>> = serde_json::from_value(output)?;

    let rankings = read_run(std::io::Cursor::new(run_file))?;
    let summary = evaluate(&rankings, &qrels);
    assert!(summary.skipped_unjudged > 0 && summary.missing_from_run > 0, "fixture must exercise skipping");
    assert_eq!(summary.per_query.keys().collect::<Vec<_>>(), reference.keys().collect::<Vec<_>>());
    for (query, ours) in &summary.per_query {
        let theirs = &reference[query];
        for (name, value) in
            [("ndcg_cut_10", ours.ndcg_at_10), ("recall_100", ours.recall_at_100), ("recip_rank", ours.reciprocal_rank)]
        {
            assert!((value - theirs[name]).abs() < 1e-9, "{query} {name}: ours {value}, trec_eval {}", theirs[name]);
        }
    }
    Ok(())
}
