//! Answers in words and the documents cited for them.
//!
//! - **Answers** are compared as SQuAD's evaluation script compares them:
//!   lower-cased, ASCII punctuation removed, the articles `a`, `an`, `the`
//!   dropped, whitespace collapsed ([`normalise`]). Exact match is equality
//!   of the normalised texts; F1 is the harmonic mean of precision and
//!   recall over their tokens (as a multiset). Both take the best over the
//!   task's reference answers.
//! - **Citations** count only documents a tool showed this episode: an id
//!   the agent never retrieved, however relevant, counts as a wrong
//!   citation. Precision is over the distinct ids cited, recall over the
//!   task's relevant documents (judgement >= 1), so citing every document
//!   seen loses precision and citing nothing scores 0.

use std::collections::{BTreeSet, HashMap};

use crate::Judgements;

/// The normalised tokens of `text` (SQuAD's `normalize_answer`, split).
pub fn normalise(text: &str) -> Vec<String> {
    let kept: String = text.to_lowercase().chars().filter(|c| !c.is_ascii_punctuation()).collect();
    kept.split_whitespace().filter(|word| !matches!(*word, "a" | "an" | "the")).map(str::to_owned).collect()
}

/// 1 when `answer` and `reference` normalise to the same text, else 0.
pub fn exact_match(answer: &str, reference: &str) -> f64 {
    f64::from(u8::from(normalise(answer) == normalise(reference)))
}

/// Token F1 of `answer` against `reference`. When either normalises to no
/// tokens, 1 if both do and 0 otherwise (as SQuAD scores no-answers).
pub fn token_f1(answer: &str, reference: &str) -> f64 {
    let (answer, reference) = (normalise(answer), normalise(reference));
    if answer.is_empty() || reference.is_empty() {
        return f64::from(u8::from(answer == reference));
    }
    let mut left: HashMap<&str, usize> = HashMap::new();
    for token in &reference {
        *left.entry(token.as_str()).or_default() += 1;
    }
    let mut common = 0usize;
    for token in &answer {
        if let Some(count) = left.get_mut(token.as_str()).filter(|count| **count > 0) {
            *count -= 1;
            common += 1;
        }
    }
    if common == 0 {
        return 0.0;
    }
    let precision = common as f64 / answer.len() as f64;
    let recall = common as f64 / reference.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// The best of `score` over `references`; 0 without references.
pub fn best_over(references: &[impl AsRef<str>], answer: &str, score: fn(&str, &str) -> f64) -> f64 {
    references.iter().map(|reference| score(answer, reference.as_ref())).fold(0.0, f64::max)
}

/// How well an answer's citations match the task's judgements.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CitationScore {
    /// Cited relevant documents a tool showed, over the distinct ids cited.
    pub precision: f64,
    /// Cited relevant documents a tool showed, over the relevant documents.
    pub recall: f64,
    /// Harmonic mean of precision and recall (0 when both are).
    pub f1: f64,
    /// Distinct ids cited that no tool showed this episode.
    pub unseen: usize,
}

/// Scores `cited` against `judgements`, counting a citation only when its
/// document is among `shown` (the episode's `shown_doc_ids`).
pub fn citations(cited: &[impl AsRef<str>], shown: &[impl AsRef<str>], judgements: &Judgements) -> CitationScore {
    let cited: BTreeSet<&str> = cited.iter().map(AsRef::as_ref).collect();
    let shown: BTreeSet<&str> = shown.iter().map(AsRef::as_ref).collect();
    let relevant = judgements.values().filter(|&&grade| grade >= 1).count();
    let unseen = cited.iter().filter(|id| !shown.contains(*id)).count();
    let correct =
        cited.iter().filter(|id| shown.contains(*id) && judgements.get(**id).is_some_and(|&grade| grade >= 1)).count()
            as f64;
    let precision = if cited.is_empty() { 0.0 } else { correct / cited.len() as f64 };
    let recall = if relevant == 0 { 0.0 } else { correct / relevant as f64 };
    let f1 = if correct == 0.0 { 0.0 } else { 2.0 * precision * recall / (precision + recall) };
    CitationScore { precision, recall, f1, unseen }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judgements(pairs: &[(&str, i32)]) -> Judgements {
        pairs.iter().map(|(d, r)| (d.to_string(), *r)).collect()
    }

    #[test]
    fn normalisation_drops_case_punctuation_articles_and_spacing() {
        assert_eq!(normalise("  The Toubal-River, an  ABC!"), ["toubalriver", "abc"]);
        assert_eq!(normalise("a an the"), Vec::<String>::new());
        assert_eq!(normalise("Théâtre"), ["théâtre"], "only ASCII punctuation goes, as in SQuAD");
        assert_eq!(normalise("theatre another"), ["theatre", "another"], "articles are whole words");
    }

    #[test]
    fn exact_match_and_f1_follow_squad() {
        assert_eq!(exact_match("The Toubal.", "toubal"), 1.0);
        assert_eq!(exact_match("Toubal river", "toubal"), 0.0);
        assert_eq!(token_f1("Toubal river", "the Toubal"), 2.0 * 0.5 * 1.0 / 1.5);
        assert_eq!(token_f1("river river", "river"), 2.0 * 0.5 * 1.0 / 1.5, "a repeated token counts once per match");
        assert_eq!(token_f1("", "toubal"), 0.0);
        assert_eq!(token_f1("the", "a"), 1.0, "both empty after normalising");
        assert_eq!(best_over(&["Foukur", "Toubal"], "toubal", token_f1), 1.0);
        assert_eq!(best_over(&[] as &[&str], "toubal", exact_match), 0.0);
    }

    #[test]
    fn only_shown_relevant_citations_count() {
        let judged = judgements(&[("c1", 2), ("p3", 1), ("o3", 1), ("x", 0)]);
        let shown = ["c1", "p3", "o3", "d9", "x"];
        let honest = citations(&["c1", "p3", "o3"], &shown, &judged);
        assert_eq!((honest.precision, honest.recall, honest.f1, honest.unseen), (1.0, 1.0, 1.0, 0));
        let everything = citations(&shown, &shown, &judged);
        assert_eq!((everything.precision, everything.recall), (0.6, 1.0));
        let nothing = citations(&[] as &[&str], &shown, &judged);
        assert_eq!((nothing.precision, nothing.recall, nothing.f1), (0.0, 0.0, 0.0));
        // Relevant, but never retrieved: a wrong citation.
        let unseen = citations(&["c1", "c1", "p3"], &["p3"], &judged);
        assert_eq!((unseen.precision, unseen.recall, unseen.unseen), (0.5, 1.0 / 3.0, 1));
    }
}
