//! Seeded synthetic BEIR collections to learn multi-hop search on, in two
//! families of different shapes, so the recipe is never shaped on one:
//!
//! - [`companies`] (the default): companies, their founders, the towns they
//!   live in and the rivers beside them; capitalised made-up names; 1 to 3
//!   searches.
//! - [`services`]: an operations wiki of services (lower-case hyphenated
//!   names), teams that own many of them (hub documents), people and
//!   incidents (identifiers like `INC-4821`); 1 to 4 searches.
//!
//! Both keep the same promises, checked as a collection is made: a
//! multi-hop question shares no content word with its answer document (the
//! answer is found only through the bridges earlier documents name); qrels
//! are graded (the answer 2, each bridge 1); every split (70 % train, 15 %
//! validation, 15 % test) is a world of its own, so no document answers
//! questions of two splits; document ids are opaque (eight hex digits) and
//! the corpus is shuffled, so neither an id nor a position gives a link
//! away. The same family, seed and size write the same bytes.

pub mod companies;
pub mod services;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use crate::BeirError;

/// Which world a collection describes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Family {
    /// Companies, founders, towns, rivers ([`companies`]).
    #[default]
    Companies,
    /// Services, teams, people, incidents ([`services`]).
    Services,
}

impl Family {
    /// Every family, by name.
    pub const ALL: [(&'static str, Family); 2] = [("companies", Family::Companies), ("services", Family::Services)];

    /// The family named `name`; an error lists the names.
    pub fn parse(name: &str) -> Result<Self, BeirError> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, f)| *f).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
            BeirError::Synth(format!("family must be one of {}, got {name:?}", names.join(", ")))
        })
    }
}

/// What collection to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthSpec {
    /// The world it describes.
    pub family: Family,
    /// Seeds every choice: names, links, splits.
    pub seed: u64,
    /// How many subjects questions are asked about (companies, or
    /// services), at least 4; each gives up to four questions.
    pub size: usize,
}

/// What [`write`] made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Synthesized {
    /// Documents in `corpus.jsonl` (distractors included).
    pub documents: usize,
    /// Questions per split (`train`, `validation`, `test`).
    pub questions: BTreeMap<&'static str, usize>,
    /// Questions per type, over all splits.
    pub types: BTreeMap<&'static str, usize>,
}

/// Writes the collection for `spec` into `dir` (created if missing):
/// `corpus.jsonl`, `queries.jsonl` (with each question's `metadata.type`
/// and `metadata.hops`) and `qrels/{train,validation,test}.tsv`.
pub fn write(dir: &Path, spec: SynthSpec) -> Result<Synthesized, BeirError> {
    if spec.size < 4 {
        return Err(BeirError::Synth(format!("size must be at least 4, got {}", spec.size)));
    }
    let mut rng = Rng(spec.seed);
    let world = match spec.family {
        Family::Companies => companies::world(&mut rng, spec.size),
        Family::Services => services::world(&mut rng, spec.size),
    };
    finish(dir, &mut rng, world)
}

/// The splits and the share of questions each gets (of 20).
pub(crate) const SPLITS: [(&str, u64); 3] = [("train", 14), ("validation", 3), ("test", 3)];

/// Words that carry no content: ignored when checking that a question and
/// its answer document share no word.
const STOPWORDS: &[&str] = &[
    "a", "an", "and", "as", "at", "by", "does", "for", "from", "in", "is", "it", "its", "of", "on", "the", "to", "was",
    "what", "where", "which", "who", "with",
];

/// A world before it is written: documents by key (what a document is,
/// `o3`; the corpus gets opaque ids) and questions.
pub(crate) struct World {
    /// (key, title, text).
    pub corpus: Vec<(String, String, String)>,
    pub questions: Vec<Question>,
}

/// A question of a world.
pub(crate) struct Question {
    pub split: &'static str,
    pub id: String,
    pub kind: &'static str,
    pub text: String,
    /// Document key -> grade (answer 2, bridges 1).
    pub judged: Vec<(String, i32)>,
    /// The answer document's text, for the no-shared-word check.
    pub answer_text: String,
    /// The answer in words: the fact the answer document states.
    pub answer: String,
}

/// SplitMix64: small, seedable, the same on every platform.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

/// Made-up capitalised words, never repeated and never a word of the
/// templates (a name must not look like question vocabulary).
pub(crate) struct Names {
    /// Lower-cased: names are drawn in lower case.
    taken: BTreeSet<String>,
}

impl Names {
    /// Names that are none of `vocabulary` in any case (nor a stop word):
    /// a service named `tousa-go` shared "go" with every document of a
    /// service written in Go.
    pub(crate) fn new<'a>(vocabulary: impl IntoIterator<Item = &'a str>) -> Self {
        let taken = vocabulary.into_iter().chain(STOPWORDS.iter().copied()).map(str::to_lowercase).collect();
        Self { taken }
    }

    pub(crate) fn fresh(&mut self, rng: &mut Rng, syllables: usize) -> String {
        const ONSETS: &[&str] =
            &["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "tr"];
        const VOWELS: &[&str] = &["a", "e", "i", "o", "u", "ai", "ou"];
        const CODAS: &[&str] = &["", "", "n", "r", "l", "s", "th", "k"];
        loop {
            let mut word = String::new();
            for _ in 0..syllables {
                word.push_str(rng.pick(ONSETS));
                word.push_str(rng.pick(VOWELS));
            }
            word.push_str(rng.pick(CODAS));
            if self.taken.insert(word.clone()) {
                let mut chars = word.chars();
                let first = chars.next().map(|c| c.to_ascii_uppercase()).unwrap_or('X');
                return std::iter::once(first).chain(chars).collect();
            }
        }
    }
}

/// Content words of `text`: lower case, split on anything not alphanumeric, stopwords dropped.
fn content_words(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .filter(|w| !STOPWORDS.contains(&w.as_str()))
        .collect()
}

/// Checks the multi-hop promise and writes `world` into `dir`.
fn finish(dir: &Path, rng: &mut Rng, world: World) -> Result<Synthesized, BeirError> {
    let World { mut corpus, questions } = world;
    // The multi-hop promise: nothing of the question in its answer.
    for question in questions.iter().filter(|q| q.judged.len() > 1) {
        let shared: Vec<String> =
            content_words(&question.text).intersection(&content_words(&question.answer_text)).cloned().collect();
        if !shared.is_empty() {
            return Err(BeirError::Synth(format!(
                "question {} shares {shared:?} with its answer document",
                question.id
            )));
        }
    }

    let ids = opaque_ids(rng, &corpus);
    shuffle(rng, &mut corpus);
    let documents = corpus.len();
    let io = |path: &Path, source: std::io::Error| BeirError::Io { path: path.to_owned(), source };
    std::fs::create_dir_all(dir.join("qrels")).map_err(|e| io(dir, e))?;
    let mut queries = String::new();
    let mut qrels: BTreeMap<&str, String> =
        SPLITS.iter().map(|(split, _)| (*split, "query-id\tcorpus-id\tscore\n".to_owned())).collect();
    let mut summary = Synthesized { documents, ..Default::default() };
    for question in &questions {
        let hops = question.judged.len();
        let line = serde_json::json!({
            "_id": question.id,
            "text": question.text,
            "metadata": {"type": question.kind, "hops": hops, "answers": [question.answer]},
        });
        let _ = writeln!(queries, "{line}");
        let split = question.split;
        let lines = qrels.get_mut(split).expect("every split has qrels");
        for (doc, grade) in &question.judged {
            let _ = writeln!(lines, "{}\t{}\t{grade}", question.id, ids[doc]);
        }
        *summary.questions.entry(split).or_default() += 1;
        *summary.types.entry(question.kind).or_default() += 1;
    }
    let mut lines = String::new();
    for (key, title, text) in &corpus {
        let _ = writeln!(lines, "{}", serde_json::json!({"_id": ids[key], "title": title, "text": text}));
    }
    let corpus_path = dir.join("corpus.jsonl");
    std::fs::write(&corpus_path, lines).map_err(|e| io(&corpus_path, e))?;
    let queries_path = dir.join("queries.jsonl");
    std::fs::write(&queries_path, queries).map_err(|e| io(&queries_path, e))?;
    for (split, text) in qrels {
        let path = dir.join("qrels").join(format!("{split}.tsv"));
        std::fs::write(&path, text).map_err(|e| io(&path, e))?;
    }
    Ok(summary)
}

/// The splits of `count` places a split's subjects live in (towns, teams):
/// every split gets one of its own, the rest are drawn by share, so no
/// place, and no document about it, is shared between splits.
pub(crate) fn places(rng: &mut Rng, count: usize) -> Vec<&'static str> {
    (0..count.max(SPLITS.len())).map(|p| if p < SPLITS.len() { SPLITS[p].0 } else { draw_split(rng) }).collect()
}

/// The indices of `splits` that are `split`.
pub(crate) fn in_split(splits: &[&str], split: &str) -> Vec<usize> {
    (0..splits.len()).filter(|&i| splits[i] == split).collect()
}

/// A split drawn by the shares of [`SPLITS`].
pub(crate) fn draw_split(rng: &mut Rng) -> &'static str {
    let mut draw = rng.next() % 20;
    SPLITS
        .iter()
        .find(|(_, share)| {
            let here = draw < *share;
            draw = draw.saturating_sub(*share);
            here
        })
        .map_or("train", |(split, _)| *split)
}

/// An opaque id (eight hex digits, all distinct) for each document's key.
fn opaque_ids(rng: &mut Rng, corpus: &[(String, String, String)]) -> BTreeMap<String, String> {
    let mut taken = BTreeSet::new();
    let mut ids = BTreeMap::new();
    for (key, _, _) in corpus {
        let id = loop {
            let id = format!("{:08x}", rng.next() as u32);
            if taken.insert(id.clone()) {
                break id;
            }
        };
        ids.insert(key.clone(), id);
    }
    ids
}

/// Fisher-Yates with the collection's generator.
fn shuffle<T>(rng: &mut Rng, items: &mut [T]) {
    for i in (1..items.len()).rev() {
        items.swap(i, rng.below(i + 1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_question_of_every_family_has_the_answer_its_answer_document_states() {
        for family in [Family::Companies, Family::Services] {
            let dir = tempfile::tempdir().unwrap();
            write(dir.path(), SynthSpec { family, seed: 3, size: 24 }).unwrap();
            let beir = crate::BeirDir::new(dir.path());
            let corpus: BTreeMap<String, String> = beir
                .corpus(crate::BadLines::Fail)
                .unwrap()
                .map(|d| d.map(|d| (d.id, d.text)))
                .collect::<Result<_, _>>()
                .unwrap();
            let mut qrels = crate::Qrels::new();
            for (split, _) in SPLITS {
                qrels.extend(beir.qrels(split).unwrap());
            }
            for query in beir.queries(crate::BadLines::Fail).unwrap() {
                let [answer] = query.answers.as_slice() else { panic!("{family:?} {}: {:?}", query.id, query.answers) };
                let (document, _) = qrels[&query.id].iter().find(|(_, grade)| **grade == 2).unwrap();
                assert!(corpus[document].contains(answer.as_str()), "{family:?} {}: {answer:?}", query.id);
            }
        }
    }
}
