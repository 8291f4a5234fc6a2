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
//! "started by Ada Varnok" yields "Ada Varnok"; a word only one document
//! holds (it leads nowhere) and a number are never part of a bridge.
//! Phrases rank by their rarest word's IDF, more for one that titles a
//! listed document ([`bridges`]).

use std::collections::{HashMap, HashSet};

use crate::observation::{LEADS, ListedHit};

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

/// Whether `word`, lower-cased as every caller has it, is a stop word.
pub fn is_stop_word(word: &str) -> bool {
    STOP_WORDS.contains(&word)
}

/// Lucene's BM25 inverse document frequency of a word in `df` of `n`
/// documents: the salience bridges rank by, and what the gateway's BM25
/// weighs a query term with.
pub fn idf(df: f32, n: f32) -> f32 {
    (1.0 + (n - df + 0.5) / (df + 0.5)).ln()
}

/// How many documents of a collection hold each word (lower-cased
/// [`words`], stop words left out): what bridges are ranked by.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WordStats {
    /// Documents holding each word.
    pub df: HashMap<String, u32>,
    /// Documents in the collection.
    pub documents: u32,
}

impl WordStats {
    /// The statistics of `documents` (their texts), counted in memory, as
    /// copy pre-training has them.
    pub fn of_documents<'a>(documents: impl IntoIterator<Item = &'a str>) -> Self {
        let mut stats = Self::default();
        for document in documents {
            stats.documents += 1;
            let distinct: HashSet<String> =
                words(document).iter().map(|w| w.text.to_lowercase()).filter(|w| !is_stop_word(w)).collect();
            for word in distinct {
                *stats.df.entry(word).or_default() += 1;
            }
        }
        stats
    }

    /// How much a word says as a bridge: its IDF when at least two
    /// documents hold it, else 0. A word only one document holds leads back
    /// to where it was read, never to another document. A number (digits
    /// only: a year, a count, a price) is an attribute that many unrelated
    /// documents share by chance, not a name: 0 too. Identifiers that mix
    /// letters and digits (`INC-4821`, `svc-12`) are names and count.
    pub fn weight(&self, word: &str) -> f32 {
        if word.chars().all(|c| c.is_ascii_digit() || JOINERS.contains(&c)) {
            return 0.0;
        }
        match self.df.get(word) {
            Some(&df) if df >= 2 => idf(df as f32, self.documents as f32),
            _ => 0.0,
        }
    }
}

/// The bridges `hits` offer, most salient first, each once and as a query:
/// the phrase after a space. The space makes the query's tokens the
/// phrase's tokens in the results: byte-level BPE tokenizers (GPT-2's,
/// Qwen's, a fresh policy's) fold a word's leading space into its first
/// token, so `"query": "Raklon` would spell the first word with tokens the
/// results never show, and a policy could only recall names, not copy new
/// ones. Searches ignore the space.
///
/// `known`: the question and the queries searched so far. A phrase's
/// salience is its rarest word's [`WordStats::weight`], doubled for each
/// listed hit it is the title of (a phrase that titles a document names
/// something the collection has a document on), discounted by the rank of
/// the first hit that shows it as nDCG discounts (`1 / log2(rank + 1)`): a
/// better-ranked hit is more likely the question's own document, as a
/// relevance model weighs feedback documents by their relevance. Without
/// the discount another company's name (two documents) outranked the
/// question's founder (three). A phrase read in a hit whose title the
/// question or a query names counts double too: that hit is the document
/// on an entity the search is about, and its names are that entity's links
/// (as a bridge is a link on the named entity's page in HotpotQA), where a
/// better-ranked hit that only mentions the entity (a release note, a
/// sponsor) names entities of its own. How often the hits repeat a phrase is left
/// out: distractors share their template's words ("regatta" in every
/// sponsorship note), and counting them made those words the bridge.
pub fn bridges(hits: &[ListedHit], known: &[String], stats: &WordStats) -> Vec<String> {
    let known_texts: Vec<Vec<String>> = known.iter().map(|k| lower_words(k)).collect();
    let named: Vec<bool> = hits.iter().map(|hit| names(&known_texts, &lower_words(&hit.title))).collect();
    let known: HashSet<String> = known_texts.into_iter().flatten().collect();
    let titles: Vec<String> = hits.iter().map(|hit| hit.title.to_lowercase()).collect();
    // (salience, first seen, phrase): first seen keeps ties in reading order.
    let mut found: Vec<(f32, usize, String)> = Vec::new();
    let mut keep = |rank: usize, phrase: &[(Word, f32)]| {
        let Some(rarest) = phrase.iter().map(|(_, weight)| *weight).reduce(f32::max).filter(|s| *s > 0.0) else {
            return;
        };
        let text = phrase.iter().map(|(w, _)| w.text).collect::<Vec<_>>().join(" ");
        if found.iter().any(|(_, _, seen)| seen.eq_ignore_ascii_case(&text)) {
            return;
        }
        let lower = text.to_lowercase();
        let titled = titles.iter().filter(|t| **t == lower).count();
        let about_named = 1 + named[rank - 1] as usize;
        let discount = (rank as f32 + 1.0).log2();
        found.push((rarest * (1 + titled) as f32 * about_named as f32 / discount, found.len(), text));
    };
    for (index, hit) in hits.iter().enumerate() {
        let rank = index + 1;
        let mut run: Vec<(Word, f32)> = Vec::new();
        for word in words(&hit.text) {
            let lower = word.text.to_lowercase();
            let breaks = is_stop_word(&lower) || known.contains(&lower);
            if !breaks {
                run.push((word, stats.weight(&lower)));
            }
            if breaks || word.ends_phrase {
                salient_phrases(&run).for_each(|phrase| keep(rank, phrase));
                run.clear();
            }
        }
        salient_phrases(&run).for_each(|phrase| keep(rank, phrase));
    }
    found.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    found.into_iter().map(|(_, _, phrase)| format!(" {phrase}")).collect()
}

/// The leads a search's `hits` list (see `crate::observation::with_leads`):
/// their [`bridges`] as names, without the query's leading space, at most
/// [`LEADS`]. The agent lists them and copy pre-training shows them alike.
pub fn leads(hits: &[ListedHit], known: &[String], stats: &WordStats) -> Vec<String> {
    bridges(hits, known, stats).into_iter().take(LEADS).map(|lead| lead.trim().to_owned()).collect()
}

/// The first of `hits` whose text shows `name` (its words, in order and
/// adjacent, whatever their case): the document a searched name (a lead)
/// was read in, the link its search adds to the chain.
pub fn read_in<'h>(hits: &'h [ListedHit], name: &str) -> Option<&'h ListedHit> {
    let name = lower_words(name);
    hits.iter().find(|hit| names(&[lower_words(&hit.text)], &name))
}

/// The lower-cased [`words`] of `text`.
fn lower_words(text: &str) -> Vec<String> {
    words(text).iter().map(|w| w.text.to_lowercase()).collect()
}

/// Whether one of `texts` (lower-cased words) names `title` (lower-cased
/// words): holds its words, in order and adjacent. An empty title is named
/// by nothing.
fn names(texts: &[Vec<String>], title: &[String]) -> bool {
    !title.is_empty() && texts.iter().any(|text| text.windows(title.len()).any(|window| window == title))
}

/// The parts of `run` whose words weigh at least half its heaviest.
fn salient_phrases<'r, 'w>(run: &'r [(Word<'w>, f32)]) -> impl Iterator<Item = &'r [(Word<'w>, f32)]> {
    let rarest = run.iter().map(|(_, weight)| *weight).fold(0.0f32, f32::max);
    run.split(move |(_, weight)| *weight < rarest / 2.0 || *weight == 0.0).filter(|phrase| !phrase.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listed hit: the title is the text up to its first full stop.
    fn hit(text: &str) -> ListedHit {
        let title = text.split_once(". ").map_or("", |(title, _)| title).to_owned();
        ListedHit { id: "d".into(), title, text: text.into() }
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

    /// Statistics of a collection of 100 documents with `df` of each word.
    fn stats(df: &[(&str, u32)]) -> WordStats {
        WordStats { df: df.iter().map(|(w, n)| ((*w).to_owned(), *n)).collect(), documents: 100 }
    }

    #[test]
    fn bridges_rank_by_the_rarest_word_whatever_its_case() {
        let stats = stats(&[("written", 60), ("elixir", 12), ("dynamodb", 10), ("calls", 70), ("rhabeksa-store", 3)]);
        let hits =
            [hit("kaquka-worker. kaquka-worker is written in Elixir, stores in DynamoDB and calls rhabeksa-store.")];
        let known = ["What does the service that kaquka-worker calls for downstream work handle?".to_owned()];
        assert_eq!(bridges(&hits, &known, &stats)[..3], [" rhabeksa-store", " DynamoDB", " Elixir"]);
    }

    #[test]
    fn a_name_is_one_phrase_and_a_word_of_one_document_leads_nowhere() {
        let stats = stats(&[("started", 40), ("ada", 4), ("varnok", 3), ("1903", 1), ("makes", 40)]);
        let hits = [hit("Klabou Atelier. Klabou Atelier was started by Ada Varnok in 1903. It makes kettles.")];
        let known = ["Name the river near the founder of Klabou Atelier.".to_owned()];
        assert_eq!(bridges(&hits, &known, &stats), [" Ada Varnok", " started", " makes"]);
    }

    #[test]
    fn equally_rare_names_rank_by_the_hit_they_are_read_in_and_repeats_count_once() {
        let stats = stats(&[("kinoul", 3), ("bruraizak", 3), ("klougi", 3), ("regatta", 40)]);
        let hits = [
            hit("Goutrath Company. Goutrath Company was started by Kinoul Bruraizak."),
            hit("Leme Company. Leme Company was started by Klougi."),
            hit("Rebrais Mills. Rebrais Mills sponsored the regatta."),
            hit("Trire Foundry. Trire Foundry sponsored the regatta."),
        ];
        let known = ["Name the river near the founder of Goutrath Company.".to_owned()];
        assert_eq!(bridges(&hits, &known, &stats), [" Kinoul Bruraizak", " Klougi", " regatta"]);
    }

    #[test]
    fn a_phrase_that_titles_a_listed_document_outranks_a_word_as_rare() {
        let stats = stats(&[("kinoul", 3), ("bruraizak", 3), ("trade", 3)]);
        let hits = [
            hit("Goutrath Company. Goutrath Company was started by Kinoul Bruraizak."),
            hit("Tafou Bugiklail. Tafou Bugiklail gave a talk about trade."),
            hit("Kinoul Bruraizak. Kinoul Bruraizak gave a talk about trade."),
        ];
        let known = ["Name the river near the founder of Goutrath Company.".to_owned()];
        assert_eq!(bridges(&hits, &known, &stats)[..2], [" Kinoul Bruraizak", " trade"]);
    }

    #[test]
    fn a_rarer_name_in_a_lower_hit_yields_to_the_top_hits_name() {
        let stats = stats(&[("brarour", 3), ("maibodres", 3), ("detrer", 2)]);
        let hits = [
            hit("Bura Mills. Bura Mills was started by Brarour Maibodres."),
            hit("Bura Mills. Bura Mills sponsored the regatta."),
            hit("Detrer Mills. Detrer Mills sponsored the regatta."),
        ];
        let known = ["What trade does the person who established Bura Mills practise?".to_owned()];
        assert_eq!(bridges(&hits, &known, &stats), [" Brarour Maibodres", " Detrer"]);
    }

    #[test]
    fn names_read_on_the_named_entitys_own_document_outrank_a_better_hit_that_mentions_it() {
        let stats = stats(&[("bregar-pa", 4), ("ludin-klai", 4), ("mysql", 30), ("release", 40), ("logging", 40)]);
        let hits = [
            hit("bregar-pa release notes. bregar-pa release 3.1 changed logging in calls to pourik-zai."),
            hit("pourik-zai. pourik-zai stores data in MySQL and calls ludin-klai for downstream work."),
        ];
        let known = ["What datastore backs the dependency of pourik-zai?".to_owned()];
        assert_eq!(bridges(&hits, &known, &stats)[..2], [" ludin-klai", " bregar-pa"]);
        let unnamed = ["What datastore backs the dependency of it?".to_owned()];
        assert_eq!(bridges(&hits, &unnamed, &stats)[0], " bregar-pa", "no title named: rank decides");
        assert!(!names(&[lower_words("pourik-zai x")], &lower_words("pourik")), "a title is named whole");
        assert!(!names(&[lower_words("anything")], &lower_words(" ")), "an empty title is named by nothing");
    }

    #[test]
    fn a_lead_was_read_in_the_first_hit_that_shows_its_words() {
        let hits = [
            hit("bregar-pa release notes. bregar-pa release 3.1 changed logging."),
            hit("pourik-zai. pourik-zai was started by Ada  Varnok, who calls bregar-pa."),
        ];
        assert_eq!(read_in(&hits, "ada varnok").map(|h| h.title.as_str()), Some("pourik-zai"));
        assert_eq!(read_in(&hits, "bregar-pa").map(|h| h.title.as_str()), Some("bregar-pa release notes"));
        assert!(read_in(&hits, "Varnok Ada").is_none(), "words in order");
        assert!(read_in(&hits, "").is_none());
    }

    #[test]
    fn statistics_count_each_document_once() {
        let stats = WordStats::of_documents(["Varnok met Varnok", "the rain", "rain"]);
        assert_eq!((stats.df["varnok"], stats.df["rain"], stats.documents), (1, 2, 3));
        assert!(!stats.df.contains_key("the"));
        assert_eq!(stats.weight("varnok"), 0.0, "one document: no bridge");
        assert_eq!(stats.weight("rain"), idf(2.0, 3.0));
    }

    #[test]
    fn a_number_is_no_bridge_but_an_identifier_with_digits_is() {
        let stats = stats(&[("1950", 3), ("3.5", 3), ("inc-4821", 3), ("varnok", 3)]);
        assert_eq!((stats.weight("1950"), stats.weight("3.5")), (0.0, 0.0));
        assert_eq!(stats.weight("inc-4821"), stats.weight("varnok"));
        assert!(stats.weight("varnok") > 0.0);
    }
}
