//! Bridges: what a multi-hop search follows from one search's results to
//! the next. A bridge is a phrase the results show and the question does
//! not: the name of the entity that links the question to its answer. It
//! is chosen by what the collection says is salient (how rare its words are
//! across the collection, the IDF an index keeps), never by what a name
//! looks like, so lower-case names, identifiers with digits (`svc-12`,
//! `INC-1123`, `rhabeksa-store`) and names that start a sentence are all
//! found, on any collection.
//!
//! The rule, for each listed hit: split its text into [`words`]; a phrase
//! is a run of adjacent words, broken by punctuation, a stop word, or a
//! word the question or an earlier query holds; within a run, words far
//! less rare than the run's rarest (under half its IDF) break it too, so
//! "started by Ada Varnok" yields "Ada Varnok" and "Razak during 1950"
//! yields "Razak" and "1950". Phrases rank by their rarest word's IDF.

use std::collections::{HashMap, HashSet};

use crate::observation::ListedHit;

/// Lucene's English stop words, which the gateway's BM25 analyzer drops: a
/// phrase never starts, ends or runs through one.
const STOP_WORDS: [&str; 33] = [
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no", "not", "of",
    "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this", "to", "was", "will", "with",
];

/// Characters that join letters and digits into one identifier when they
/// stand between two of them.
const JOINERS: [char; 6] = ['-', '_', '.', '/', ':', '#'];

/// A word of a text, as [`words`] splits it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Word<'a> {
    /// The word as written.
    pub text: &'a str,
    /// Punctuation other than a joiner follows it (a clause or list ends).
    pub ends_phrase: bool,
}

/// The words of `text` as an index keeps identifiers: runs of letters and
/// digits, with `-`, `_`, `.`, `/`, `:` or `#` kept inside a word when
/// letters or digits stand on both sides (`svc-12`, `v1.2`, `INC-1123`).
pub fn words(text: &str) -> Vec<Word<'_>> {
    let mut words: Vec<Word> = Vec::new();
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let mut start: Option<usize> = None;
    for (i, &(at, c)) in chars.iter().enumerate() {
        let joins =
            JOINERS.contains(&c) && start.is_some() && chars.get(i + 1).is_some_and(|(_, next)| next.is_alphanumeric());
        if c.is_alphanumeric() || joins {
            start.get_or_insert(at);
            continue;
        }
        if let Some(from) = start.take() {
            words.push(Word { text: &text[from..at], ends_phrase: false });
        }
        if let Some(last) = words.last_mut().filter(|_| !c.is_whitespace()) {
            last.ends_phrase = true;
        }
    }
    if let Some(from) = start {
        words.push(Word { text: &text[from..], ends_phrase: true });
    }
    words
}

/// Whether `word` (any case) is a stop word.
pub fn is_stop_word(word: &str) -> bool {
    STOP_WORDS.contains(&word.to_lowercase().as_str())
}

/// Lucene's BM25 inverse document frequency of a word in `df` of `n`
/// documents: the salience bridges rank by, and what the gateway's BM25
/// weighs a query term with.
pub fn idf(df: f32, n: f32) -> f32 {
    (1.0 + (n - df + 0.5) / (df + 0.5)).ln()
}

/// The IDF of every word of `documents` (lower-cased [`words`], stop words
/// left out), counted over the documents themselves: the statistics of a
/// collection held in memory, as copy pre-training has it.
pub fn collection_idf<'a>(documents: impl IntoIterator<Item = &'a str>) -> HashMap<String, f32> {
    let mut df: HashMap<String, f32> = HashMap::new();
    let mut n = 0.0f32;
    for document in documents {
        n += 1.0;
        let distinct: HashSet<String> =
            words(document).iter().map(|w| w.text.to_lowercase()).filter(|w| !is_stop_word(w)).collect();
        for word in distinct {
            *df.entry(word).or_default() += 1.0;
        }
    }
    df.into_iter().map(|(word, df)| (word, idf(df, n))).collect()
}

/// The bridges `hits` offer, most salient first, each once and as a query:
/// the phrase after a space. The space makes the query's tokens the
/// phrase's tokens in the results: byte-level BPE tokenizers (GPT-2's,
/// Qwen's, a fresh policy's) fold a word's leading space into its first
/// token, so `"query": "Raklon` would spell the first word with tokens the
/// results never show, and a policy could only recall names, not copy new
/// ones. Searches ignore the space.
/// `known`: the question and the queries searched so far; `idf`: a
/// lower-cased word's IDF in the collection (0 for a word it lacks).
pub fn bridges(hits: &[ListedHit], known: &[String], idf: impl Fn(&str) -> f32) -> Vec<String> {
    let known: HashSet<String> = known.iter().flat_map(|k| words(k)).map(|w| w.text.to_lowercase()).collect();
    // (salience, first seen, phrase): first seen keeps ties in reading order.
    let mut found: Vec<(f32, usize, String)> = Vec::new();
    let mut keep = |phrase: &[(Word, f32)]| {
        let Some(salience) = phrase.iter().map(|(_, idf)| *idf).reduce(f32::max).filter(|s| *s > 0.0) else {
            return;
        };
        let text = phrase.iter().map(|(w, _)| w.text).collect::<Vec<_>>().join(" ");
        match found.iter_mut().find(|(_, _, seen)| seen.eq_ignore_ascii_case(&text)) {
            Some(seen) => seen.0 = seen.0.max(salience),
            None => found.push((salience, found.len(), text)),
        }
    };
    for hit in hits {
        let mut run: Vec<(Word, f32)> = Vec::new();
        for word in words(&hit.text) {
            let lower = word.text.to_lowercase();
            let breaks = is_stop_word(&lower) || known.contains(&lower);
            if !breaks {
                run.push((word, idf(&lower)));
            }
            if breaks || word.ends_phrase {
                salient_phrases(&run).for_each(&mut keep);
                run.clear();
            }
        }
        salient_phrases(&run).for_each(&mut keep);
    }
    found.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    found.into_iter().map(|(_, _, phrase)| format!(" {phrase}")).collect()
}

/// The parts of `run` whose words are at least half as rare as its rarest.
fn salient_phrases<'r, 'w>(run: &'r [(Word<'w>, f32)]) -> impl Iterator<Item = &'r [(Word<'w>, f32)]> {
    let rarest = run.iter().map(|(_, idf)| *idf).fold(0.0f32, f32::max);
    run.split(move |(_, idf)| *idf < rarest / 2.0).filter(|phrase| !phrase.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(text: &str) -> ListedHit {
        ListedHit { id: "d".into(), text: text.into() }
    }

    fn texts(text: &str) -> Vec<&str> {
        words(text).iter().map(|w| w.text).collect()
    }

    #[test]
    fn identifiers_stay_whole_and_punctuation_ends_phrases() {
        assert_eq!(
            texts("svc-12 calls INC-1123, rhabeksa-store (v1.2) and path/to_x."),
            ["svc-12", "calls", "INC-1123", "rhabeksa-store", "v1.2", "and", "path/to_x"]
        );
        let ends: Vec<bool> = words("a b, c. d-").iter().map(|w| w.ends_phrase).collect();
        assert_eq!(ends, [false, true, true, true]);
    }

    #[test]
    fn bridges_rank_by_the_rarest_word_whatever_its_case() {
        let idf: HashMap<&str, f32> =
            [("written", 0.5), ("elixir", 2.0), ("dynamodb", 2.1), ("calls", 0.4), ("rhabeksa-store", 6.0)].into();
        let hits =
            [hit("kaquka-worker. kaquka-worker is written in Elixir, stores in DynamoDB and calls rhabeksa-store.")];
        let known = ["What does the service that kaquka-worker calls for downstream work handle?".to_owned()];
        let found = bridges(&hits, &known, |w| idf.get(w).copied().unwrap_or(0.0));
        assert_eq!(found[..3], [" rhabeksa-store", " DynamoDB", " Elixir"]);
    }

    #[test]
    fn a_name_is_one_phrase_and_common_words_beside_it_are_not() {
        let idf: HashMap<&str, f32> =
            [("started", 0.7), ("ada", 3.5), ("varnok", 5.0), ("1903", 4.0), ("klabou", 5.0)].into();
        let hits = [hit("Klabou Atelier. Klabou Atelier was started by Ada Varnok in 1903.")];
        let known = ["Name the river near the founder of Klabou Atelier.".to_owned()];
        let found = bridges(&hits, &known, |w| idf.get(w).copied().unwrap_or(0.0));
        assert_eq!(found, [" Ada Varnok", " 1903", " started"]);
    }

    #[test]
    fn idf_over_documents_counts_each_document_once() {
        let idf = collection_idf(["Varnok met Varnok", "the rain", "rain"]);
        assert_eq!(idf["varnok"], super::idf(1.0, 3.0));
        assert_eq!(idf["rain"], super::idf(2.0, 3.0));
        assert!(!idf.contains_key("the"));
    }
}
