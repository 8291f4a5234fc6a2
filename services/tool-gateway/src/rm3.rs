//! BM25 with RM3 pseudo-relevance feedback (Lavrenko and Croft's relevance
//! model, interpolated with the query), the query-expansion baseline IR
//! practitioners reach for first. The settings and term filters are
//! Anserini's defaults (`-rm3`: 10 feedback documents, 10 expansion terms,
//! original query weight 0.5), so a table's "BM25+RM3" row means what it
//! means elsewhere:
//!
//! 1. BM25 retrieves the top `FEEDBACK_DOCUMENTS` for the query;
//! 2. each feedback document's analyzed terms, as frequencies normalised to
//!    sum 1, are weighted by the document's BM25 score and summed (RM1);
//!    terms shorter than 2 or longer than 20 characters, not `[a-z0-9]+`, or
//!    in more than a tenth of the collection's documents are left out;
//! 3. the `EXPANSION_TERMS` heaviest terms, normalised to sum 1, are
//!    interpolated with the query's own terms (normalised the same way);
//! 4. BM25 ranks the collection for that weighted query.

use std::collections::HashMap;

use tantivy::Searcher;
use tantivy::tokenizer::TextAnalyzer;

use crate::bm25::{self, Bm25Scorer};
use crate::error::Error;

/// Documents the relevance model is estimated from.
pub const FEEDBACK_DOCUMENTS: usize = 10;
/// Terms the relevance model keeps.
pub const EXPANSION_TERMS: usize = 10;
/// Weight of the original query in the interpolation.
pub const ORIGINAL_QUERY_WEIGHT: f32 = 0.5;
/// A term in more than this share of the documents says nothing about relevance.
const MAX_DOCUMENT_SHARE: f32 = 0.1;

/// The expanded query for `query` (analyzed, weighted terms): `feedback`
/// gives the analyzed body of a document by ordinal.
pub fn expand(
    scorer: &Bm25Scorer,
    searcher: &Searcher,
    analyzer: &mut TextAnalyzer,
    query: &[(String, f32)],
    feedback: impl Fn(u32) -> String,
) -> Result<Vec<(String, f32)>, Error> {
    let documents = scorer.lengths.len() as f32;
    let first = scorer.top_k(searcher, query, FEEDBACK_DOCUMENTS)?;
    let mut relevance: HashMap<String, f32> = HashMap::new();
    let mut common: HashMap<String, bool> = HashMap::new();
    for (ordinal, score) in first {
        let mut counts: HashMap<String, f32> = HashMap::new();
        for token in bm25::tokens(analyzer, &feedback(ordinal)) {
            if !expansion_shaped(&token) {
                continue;
            }
            let too_common = match common.get(&token) {
                Some(&known) => known,
                None => {
                    let share = scorer.doc_freq(searcher, &token)? as f32 / documents;
                    *common.entry(token.clone()).or_insert(share > MAX_DOCUMENT_SHARE)
                }
            };
            if !too_common {
                *counts.entry(token).or_default() += 1.0;
            }
        }
        let norm: f32 = counts.values().sum();
        for (term, count) in counts {
            *relevance.entry(term).or_default() += count / norm * score;
        }
    }
    let mut model: Vec<(String, f32)> = relevance.into_iter().collect();
    // Heaviest first; ties by term, so the expansion is deterministic.
    model.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    model.truncate(EXPANSION_TERMS);
    Ok(interpolate(query, &model, ORIGINAL_QUERY_WEIGHT))
}

/// Anserini's filter on expansion terms: 2 to 20 characters of `[a-z0-9]`.
fn expansion_shaped(term: &str) -> bool {
    (2..=20).contains(&term.len()) && term.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// `weight` of `query` plus `1 - weight` of `model`, each normalised to sum 1,
/// the query's terms first.
fn interpolate(query: &[(String, f32)], model: &[(String, f32)], weight: f32) -> Vec<(String, f32)> {
    let sum = |terms: &[(String, f32)]| terms.iter().map(|(_, w)| w).sum::<f32>().max(f32::MIN_POSITIVE);
    let (query_sum, model_sum) = (sum(query), sum(model));
    let mut terms: Vec<(String, f32)> = query.iter().map(|(t, w)| (t.clone(), weight * w / query_sum)).collect();
    for (term, w) in model {
        let share = (1.0 - weight) * w / model_sum;
        match terms.iter_mut().find(|(t, _)| t == term) {
            Some((_, existing)) => *existing += share,
            None => terms.push((term.clone(), share)),
        }
    }
    terms
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms(pairs: &[(&str, f32)]) -> Vec<(String, f32)> {
        pairs.iter().map(|(t, w)| ((*t).to_owned(), *w)).collect()
    }

    #[test]
    fn interpolation_normalises_both_sides_and_merges_shared_terms() {
        let mixed =
            interpolate(&terms(&[("heart", 2.0), ("attack", 2.0)]), &terms(&[("attack", 3.0), ("cardiac", 1.0)]), 0.5);
        assert_eq!(mixed, terms(&[("heart", 0.25), ("attack", 0.25 + 0.375), ("cardiac", 0.125)]));
        let total: f32 = mixed.iter().map(|(_, w)| w).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
    }

    #[test]
    fn expansion_terms_are_short_lower_case_words_or_numbers() {
        for kept in ["cardiac", "h2", "1903"] {
            assert!(expansion_shaped(kept), "{kept}");
        }
        for dropped in ["a", "caf\u{e9}", "svc-12", "x".repeat(21).as_str()] {
            assert!(!expansion_shaped(dropped), "{dropped}");
        }
    }
}
