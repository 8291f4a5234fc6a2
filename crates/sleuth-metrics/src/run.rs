//! TREC run files: `qid Q0 docid rank score tag`, one retrieved document a line.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("run file line {line}: {message}")]
    BadLine { line: usize, message: String },
    #[error("run file: {0}")]
    Io(#[from] std::io::Error),
}

/// One query's retrieved documents with scores, best first.
pub type ScoredRanking = Vec<(String, f64)>;

/// Writes rankings (already ordered best first) as a TREC run.
pub fn write_run(out: &mut impl Write, rankings: &BTreeMap<String, ScoredRanking>, tag: &str) -> std::io::Result<()> {
    for (query, ranking) in rankings {
        for (index, (doc, score)) in ranking.iter().enumerate() {
            writeln!(out, "{query} Q0 {doc} {} {score} {tag}", index + 1)?;
        }
    }
    Ok(())
}

/// Reads a TREC run and orders each query's documents as trec_eval does:
/// by score, highest first, ties broken by document id in descending order
/// (the rank column is ignored).
pub fn read_run(input: impl BufRead) -> Result<BTreeMap<String, Vec<String>>, RunError> {
    let mut scored: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
    for (index, line) in input.lines().enumerate() {
        let line = line?;
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.is_empty() {
            continue;
        }
        let [query, _, doc, _, score, ..] = fields.as_slice() else {
            return Err(RunError::BadLine { line: index + 1, message: format!("expected 6 columns, got {line:?}") });
        };
        let score: f64 = score
            .parse()
            .map_err(|_| RunError::BadLine { line: index + 1, message: format!("score {score:?} is not a number") })?;
        scored.entry((*query).to_owned()).or_default().push(((*doc).to_owned(), score));
    }
    Ok(scored
        .into_iter()
        .map(|(query, mut docs)| {
            docs.sort_by(|(doc_a, a), (doc_b, b)| b.total_cmp(a).then_with(|| doc_b.cmp(doc_a)));
            (query, docs.into_iter().map(|(doc, _)| doc).collect())
        })
        .collect())
}
