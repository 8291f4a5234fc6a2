//! BM25 over a tantivy inverted index, with configurable parameters.
//!
//! tantivy provides the analysis (tokenizer, lower-casing, stop words,
//! Snowball stemming) and the postings; the scoring is ours, because
//! tantivy's own BM25 hard-codes k1 = 1.2 and b = 0.75 and quantises
//! document lengths. Scores follow the Lucene variant used by Elasticsearch
//! and `bm25s`:
//!
//! ```text
//! idf(t)      = ln(1 + (N - df + 0.5) / (df + 0.5))
//! score(d, q) = sum over query tokens t: idf(t) * tf / (tf + k1 * (1 - b + b * len(d) / avg_len))
//! ```
//!
//! with exact document lengths (tokens after analysis). Evaluation is
//! term-at-a-time into a dense accumulator: exact, and fast for the short
//! queries agents write.

use std::cell::RefCell;

use serde::{Deserialize, Serialize};
use tantivy::postings::Postings;
use tantivy::schema::{Field, IndexRecordOption};
use tantivy::tokenizer::{
    Language, LowerCaser, RemoveLongFilter, SimpleTokenizer, Stemmer, StopWordFilter, TextAnalyzer, TokenStream,
};
use tantivy::{DocSet, Searcher, TERMINATED, Term};

use crate::error::Error;

/// Name the analyzer is registered under in the tantivy index.
pub const ANALYZER: &str = "sleuth_bm25";

/// BM25 parameters and text analysis, fixed when a collection is indexed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bm25Options {
    /// Term-frequency saturation.
    pub k1: f32,
    /// Length normalisation, 0..=1.
    pub b: f32,
    /// Snowball stemming of English ("english") or none ("none").
    pub stemmer: Stemming,
    /// Drop English stop words.
    pub stop_words: bool,
}

impl Default for Bm25Options {
    /// The parameters of the `bm25s` reference figures (k1 0.9, b 0.4,
    /// stemming and stop words), which also match BEIR's Elasticsearch setup closely.
    fn default() -> Self {
        Self { k1: 0.9, b: 0.4, stemmer: Stemming::English, stop_words: true }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Stemming {
    English,
    None,
}

impl Bm25Options {
    pub fn validate(&self) -> Result<(), Error> {
        if !(self.k1 > 0.0 && self.k1 <= 10.0) {
            return Err(Error::InvalidArgument(format!("bm25 k1 must be in (0, 10], got {}", self.k1)));
        }
        if !(0.0..=1.0).contains(&self.b) {
            return Err(Error::InvalidArgument(format!("bm25 b must be in [0, 1], got {}", self.b)));
        }
        Ok(())
    }

    /// The analyzer documents and queries go through.
    pub fn analyzer(&self) -> TextAnalyzer {
        let builder =
            TextAnalyzer::builder(SimpleTokenizer::default()).filter(RemoveLongFilter::limit(40)).filter(LowerCaser);
        match (self.stop_words, self.stemmer) {
            (true, Stemming::English) => builder
                .filter(StopWordFilter::new(Language::English).expect("English stop words ship with tantivy"))
                .filter(Stemmer::new(Language::English))
                .build(),
            (true, Stemming::None) => builder
                .filter(StopWordFilter::new(Language::English).expect("English stop words ship with tantivy"))
                .build(),
            (false, Stemming::English) => builder.filter(Stemmer::new(Language::English)).build(),
            (false, Stemming::None) => builder.build(),
        }
    }
}

/// The analyzed tokens of `text`, in order, repeats kept.
pub fn tokens(analyzer: &mut TextAnalyzer, text: &str) -> Vec<String> {
    let mut stream = analyzer.token_stream(text);
    let mut tokens = Vec::new();
    while stream.advance() {
        tokens.push(stream.token().text.clone());
    }
    tokens
}

/// A query as weighted terms: each distinct token once, weighted by how
/// often it occurs (a repeated word counts twice, as in Lucene), in order
/// of first occurrence.
pub fn weighted(tokens: Vec<String>) -> Vec<(String, f32)> {
    let mut terms: Vec<(String, f32)> = Vec::new();
    for token in tokens {
        match terms.iter_mut().find(|(term, _)| *term == token) {
            Some((_, weight)) => *weight += 1.0,
            None => terms.push((token, 1.0)),
        }
    }
    terms
}

/// Per-collection statistics and the map from tantivy documents to ordinals.
pub struct Bm25Scorer {
    pub options: Bm25Options,
    pub content: Field,
    /// Exact analyzed length of each document, by ordinal.
    pub lengths: Vec<u32>,
    pub average_length: f32,
    /// For each tantivy segment (in `Searcher::segment_readers` order): doc id -> ordinal.
    pub ordinals: Vec<Vec<u32>>,
}

thread_local! {
    /// Reused score accumulator, so a query allocates nothing proportional to the collection.
    static ACCUMULATOR: RefCell<(Vec<f32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

impl Bm25Scorer {
    /// How many documents hold the analyzed `token`.
    pub fn doc_freq(&self, searcher: &Searcher, token: &str) -> Result<u64, Error> {
        Ok(searcher.doc_freq(&Term::from_field_text(self.content, token))?)
    }

    /// The `k` best documents for the analyzed, weighted query `terms` (each
    /// term's BM25 contribution times its weight), as (ordinal, score), best
    /// first; ties go to the lower ordinal (earlier in the corpus).
    pub fn top_k(&self, searcher: &Searcher, terms: &[(String, f32)], k: usize) -> Result<Vec<(u32, f32)>, Error> {
        let documents = self.lengths.len();
        if terms.is_empty() || documents == 0 || k == 0 {
            return Ok(Vec::new());
        }
        let n = documents as f32;
        let Bm25Options { k1, b, .. } = self.options;
        ACCUMULATOR.with_borrow_mut(|(scores, touched)| {
            scores.clear();
            scores.resize(documents, 0.0);
            touched.clear();
            for (token, weight) in terms {
                let term = Term::from_field_text(self.content, token);
                let df = searcher.doc_freq(&term)? as f32;
                if df == 0.0 {
                    continue;
                }
                let term_weight = weight * sleuth_chat::bridge::idf(df, n);
                for (segment, ordinals) in searcher.segment_readers().iter().zip(&self.ordinals) {
                    let inverted = segment.inverted_index(self.content)?;
                    let Some(mut postings) = inverted
                        .read_postings(&term, IndexRecordOption::WithFreqs)
                        .map_err(tantivy::TantivyError::from)?
                    else {
                        continue;
                    };
                    let mut doc = postings.doc();
                    while doc != TERMINATED {
                        let ordinal = ordinals[doc as usize];
                        let tf = postings.term_freq() as f32;
                        let length = self.lengths[ordinal as usize] as f32;
                        let score = &mut scores[ordinal as usize];
                        if *score == 0.0 {
                            touched.push(ordinal);
                        }
                        *score += term_weight * tf / (tf + k1 * (1.0 - b + b * length / self.average_length));
                        doc = postings.advance();
                    }
                }
            }
            let better = |a: &u32, b: &u32| scores[*b as usize].total_cmp(&scores[*a as usize]).then(a.cmp(b));
            if touched.len() > k {
                touched.select_nth_unstable_by(k - 1, better);
                touched.truncate(k);
            }
            touched.sort_unstable_by(better);
            Ok(touched.iter().map(|&ordinal| (ordinal, scores[ordinal as usize])).collect())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn analysis_stems_lowercases_and_drops_stop_words() {
        let mut analyzer = Bm25Options::default().analyzer();
        assert_eq!(tokens(&mut analyzer, "The Running of the Mice"), ["run", "mice"]);
        let plain = Bm25Options { stemmer: Stemming::None, stop_words: false, ..Bm25Options::default() };
        assert_eq!(tokens(&mut plain.analyzer(), "The Running"), ["the", "running"]);
    }

    #[test]
    fn rejects_out_of_range_parameters() {
        let error = Bm25Options { b: 1.5, ..Bm25Options::default() }.validate().unwrap_err().to_string();
        assert!(error.contains("b must be in [0, 1], got 1.5"), "{error}");
        assert!(Bm25Options { k1: 0.0, ..Bm25Options::default() }.validate().is_err());
    }
}
