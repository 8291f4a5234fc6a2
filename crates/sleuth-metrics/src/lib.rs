//! Retrieval metrics, computed exactly as `trec_eval` does, so that figures
//! from Sleuth's evaluation jobs, its rewards and published results agree.
//!
//! - **nDCG@k** (`ndcg_cut_k`): gain = graded relevance (judgements <= 0
//!   count 0), discount `log2(rank + 1)`, ideal ranking = all judged
//!   documents sorted by relevance, cut at k. A query whose judgements are all
//!   non-relevant scores 0.
//! - **recall@k** (`recall_k`): relevant (relevance >= 1) documents in the
//!   top k over all relevant documents.
//! - **MRR** (`recip_rank`): 1 / rank of the first relevant document in the
//!   whole ranking, 0 when none is retrieved.
//!
//! Only judged queries are scored (those with an entry in the qrels); the
//! others are reported as skipped, as `trec_eval` ignores them.
//! A ranking is a list of document ids, best first; repeated ids count once,
//! at their first position (an agent may submit a document twice).
//!
//! Beside the metrics, how scored episodes become training signal, in plain
//! arithmetic the orchestrator (validating a run's spec) and the learner
//! (training it) share: [`advantage`] (group advantages) and
//! [`policy_loss`] (the names and settings of the policy losses); and
//! [`bootstrap`] intervals for comparing evaluations.

pub mod advantage;
pub mod answer;
pub mod bootstrap;
pub mod policy_loss;
pub mod reward;
pub mod run;
pub mod schedule;
pub mod validation;

use std::collections::{BTreeMap, HashSet};

pub use sleuth_beir::Qrels;

/// Relevance judgements of one query: document id -> graded relevance.
pub type Judgements = BTreeMap<String, i32>;

/// nDCG@k of `ranking` against one query's judgements.
pub fn ndcg_at(ranking: &[impl AsRef<str>], judgements: &Judgements, k: usize) -> f64 {
    let dcg: f64 = deduplicated(ranking)
        .take(k)
        .enumerate()
        .map(|(index, doc)| gain(judgements.get(doc).copied()) / discount(index))
        .sum();
    let mut ideal: Vec<f64> = judgements.values().map(|&rel| gain(Some(rel))).filter(|&g| g > 0.0).collect();
    ideal.sort_by(|a, b| b.total_cmp(a));
    let idcg: f64 = ideal.iter().take(k).enumerate().map(|(index, gain)| gain / discount(index)).sum();
    if idcg > 0.0 { dcg / idcg } else { 0.0 }
}

/// recall@k of `ranking` against one query's judgements; 0 when nothing is relevant.
pub fn recall_at(ranking: &[impl AsRef<str>], judgements: &Judgements, k: usize) -> f64 {
    let relevant = judgements.values().filter(|&&rel| rel >= 1).count();
    if relevant == 0 {
        return 0.0;
    }
    let found = deduplicated(ranking).take(k).filter(|doc| judgements.get(*doc).is_some_and(|&rel| rel >= 1)).count();
    found as f64 / relevant as f64
}

/// Reciprocal rank of the first relevant document; 0 when none is retrieved.
pub fn reciprocal_rank(ranking: &[impl AsRef<str>], judgements: &Judgements) -> f64 {
    deduplicated(ranking)
        .position(|doc| judgements.get(doc).is_some_and(|&rel| rel >= 1))
        .map_or(0.0, |index| 1.0 / (index + 1) as f64)
}

fn gain(relevance: Option<i32>) -> f64 {
    relevance.map_or(0.0, |rel| f64::from(rel.max(0)))
}

/// trec_eval's discount for the document at 0-based `index`.
fn discount(index: usize) -> f64 {
    ((index + 2) as f64).log2()
}

fn deduplicated<S: AsRef<str>>(ranking: &[S]) -> impl Iterator<Item = &str> {
    let mut seen = HashSet::new();
    ranking.iter().map(AsRef::as_ref).filter(move |doc| seen.insert(*doc))
}

/// Metrics of one query.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueryMetrics {
    pub ndcg_at_10: f64,
    pub recall_at_100: f64,
    pub reciprocal_rank: f64,
}

impl QueryMetrics {
    pub fn of(ranking: &[impl AsRef<str>], judgements: &Judgements) -> Self {
        Self {
            ndcg_at_10: ndcg_at(ranking, judgements, 10),
            recall_at_100: recall_at(ranking, judgements, 100),
            reciprocal_rank: reciprocal_rank(ranking, judgements),
        }
    }
}

/// Means over the judged queries of a run, with what was skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub ndcg_at_10: f64,
    pub recall_at_100: f64,
    pub mrr: f64,
    /// Queries scored (judged and ranked).
    pub evaluated: usize,
    /// Ranked queries without judgements (not scored).
    pub skipped_unjudged: usize,
    /// Judged queries the run has no ranking for (not scored, as trec_eval without -c).
    pub missing_from_run: usize,
    pub per_query: BTreeMap<String, QueryMetrics>,
}

/// Scores every judged query of `rankings` (query id -> ranking).
pub fn evaluate<S: AsRef<str>>(rankings: &BTreeMap<String, Vec<S>>, qrels: &Qrels) -> Summary {
    let mut per_query = BTreeMap::new();
    let mut skipped_unjudged = 0;
    for (query, ranking) in rankings {
        match qrels.get(query) {
            Some(judgements) => {
                per_query.insert(query.clone(), QueryMetrics::of(ranking, judgements));
            }
            None => skipped_unjudged += 1,
        }
    }
    let missing_from_run = qrels.keys().filter(|query| !rankings.contains_key(*query)).count();
    let evaluated = per_query.len();
    let mean = |metric: fn(&QueryMetrics) -> f64| {
        if evaluated == 0 { 0.0 } else { per_query.values().map(metric).sum::<f64>() / evaluated as f64 }
    };
    Summary {
        ndcg_at_10: mean(|m| m.ndcg_at_10),
        recall_at_100: mean(|m| m.recall_at_100),
        mrr: mean(|m| m.reciprocal_rank),
        evaluated,
        skipped_unjudged,
        missing_from_run,
        per_query,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judgements(pairs: &[(&str, i32)]) -> Judgements {
        pairs.iter().map(|(d, r)| (d.to_string(), *r)).collect()
    }

    #[test]
    fn perfect_ranking_scores_one() {
        let j = judgements(&[("a", 2), ("b", 1), ("c", 0)]);
        assert!((ndcg_at(&["a", "b", "x"], &j, 10) - 1.0).abs() < 1e-12);
        assert_eq!(recall_at(&["a", "b"], &j, 100), 1.0);
        assert_eq!(reciprocal_rank(&["x", "b"], &j), 0.5);
    }

    #[test]
    fn graded_gains_and_log_discount() {
        let j = judgements(&[("a", 2), ("b", 1)]);
        // DCG = 1/log2(2) + 2/log2(3); IDCG = 2/log2(2) + 1/log2(3)
        let expected = (1.0 + 2.0 / 3f64.log2()) / (2.0 + 1.0 / 3f64.log2());
        assert!((ndcg_at(&["b", "a"], &j, 10) - expected).abs() < 1e-12);
    }

    #[test]
    fn repeated_documents_count_once() {
        let j = judgements(&[("a", 1), ("b", 1)]);
        assert_eq!(ndcg_at(&["a", "a", "b"], &j, 10), ndcg_at(&["a", "b"], &j, 10));
        assert_eq!(recall_at(&["a", "a"], &j, 2), 0.5);
    }

    #[test]
    fn all_nonrelevant_query_scores_zero() {
        let j = judgements(&[("a", 0), ("b", -1)]);
        assert_eq!(ndcg_at(&["a", "b"], &j, 10), 0.0);
        assert_eq!(recall_at(&["a"], &j, 10), 0.0);
    }

    #[test]
    fn unjudged_and_missing_queries_are_reported_not_scored() {
        let qrels: Qrels = [("q1".to_string(), judgements(&[("a", 1)])), ("q2".to_string(), judgements(&[("b", 1)]))]
            .into_iter()
            .collect();
        let rankings: BTreeMap<String, Vec<&str>> =
            [("q1".to_string(), vec!["a"]), ("q9".to_string(), vec!["a"])].into_iter().collect();
        let summary = evaluate(&rankings, &qrels);
        assert_eq!((summary.evaluated, summary.skipped_unjudged, summary.missing_from_run), (1, 1, 1));
        assert_eq!(summary.ndcg_at_10, 1.0);
    }
}
