//! Dividing one split's questions into disjoint parts (`sleuth data divide`):
//! a held-out validation set, or the questions trajectory SFT learns from
//! apart from those GRPO learns from.
//!
//! Questions that share a judged document go to the same part. In a
//! multi-hop collection several questions lead through the same bridge (the
//! synth collection's four questions about one company all judge its
//! document), so a per-question split would let one part's training answer
//! the other's questions: a policy that memorised a bridge during SFT then
//! "finds" it during GRPO on the same company, and GRPO learns to rely on
//! recall that fails on new questions (measured: see docs/experiments/learner-recipe.md).
//! Documents judged by very many questions (hubs) are the exception: they
//! join none (see [`connected`]).

use std::collections::BTreeMap;
use std::path::Path;

use crate::synth::Rng;
use crate::{BeirDir, BeirError, Qrels};

/// One part to make and its share of the questions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The split it is written as (`qrels/<name>.tsv`).
    pub name: String,
    /// Its share, relative to the other parts' weights.
    pub weight: u32,
}

impl std::str::FromStr for Part {
    type Err = String;

    /// `name:weight`, e.g. `sft:3`.
    fn from_str(text: &str) -> Result<Self, String> {
        let (name, weight) = text.split_once(':').ok_or_else(|| format!("{text:?} is not NAME:WEIGHT"))?;
        let weight: u32 = weight.parse().map_err(|_| format!("{text:?}: weight {weight:?} is not a whole number"))?;
        let valid = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !valid || weight == 0 {
            return Err(format!("{text:?}: a part needs a name of letters, digits, - or _ and a weight above 0"));
        }
        Ok(Self { name: name.to_owned(), weight })
    }
}

/// Questions in groups that no part boundary may cut, and the documents
/// whose questions were left in several groups.
#[derive(Debug, Clone, PartialEq)]
struct Grouping {
    /// Each sorted; the groups in order of their first question.
    groups: Vec<Vec<String>>,
    /// Hub documents, with how many questions judge each.
    hubs: Vec<(String, usize)>,
}

/// Joins questions that share a judged document into groups of at most
/// `cap` questions. Every document judged by at most some number of
/// questions joins all of its questions; that number is the largest that
/// keeps every group within `cap`. Documents judged by more are hubs and
/// join none: a team page or a person judged by hundreds of questions leaks
/// no one answer, yet joining through it put nearly every question in one
/// group. The most specific documents (a company's own page) are the last
/// to become hubs.
fn connected(qrels: &Qrels, cap: usize) -> Grouping {
    let questions: Vec<&String> = qrels.keys().collect();
    let index: BTreeMap<&str, usize> = questions.iter().enumerate().map(|(i, q)| (q.as_str(), i)).collect();
    let mut judged_by: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (question, judged) in qrels {
        for document in judged.keys() {
            judged_by.entry(document.as_str()).or_default().push(index[question.as_str()]);
        }
    }
    // Each question's group (a root question's index) when every document
    // judged by at most `limit` questions joins its questions.
    let roots = |limit: usize| -> Vec<usize> {
        fn root(parent: &mut [usize], mut at: usize) -> usize {
            while parent[at] != at {
                parent[at] = parent[parent[at]];
                at = parent[at];
            }
            at
        }
        let mut parent: Vec<usize> = (0..questions.len()).collect();
        for by in judged_by.values().filter(|by| by.len() <= limit) {
            for &question in &by[1..] {
                let (a, b) = (root(&mut parent, by[0]), root(&mut parent, question));
                parent[a] = b;
            }
        }
        (0..questions.len()).map(|i| root(&mut parent, i)).collect()
    };
    let largest = |roots: &[usize]| {
        let mut sizes = vec![0usize; roots.len()];
        roots.iter().for_each(|&r| sizes[r] += 1);
        sizes.into_iter().max().unwrap_or(0)
    };
    // Groups only grow with the limit: the largest limit within `cap`, by
    // bisection over the documents' distinct question counts.
    let mut counts: Vec<usize> = judged_by.values().map(Vec::len).collect();
    counts.sort_unstable();
    counts.dedup();
    let (mut fits, mut over) = (0usize, counts.len());
    while fits < over {
        let middle = (fits + over).div_ceil(2);
        if largest(&roots(counts[middle - 1])) <= cap { fits = middle } else { over = middle - 1 }
    }
    let limit = if fits == 0 { 1 } else { counts[fits - 1] };
    let mut groups: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for (i, top) in roots(limit).into_iter().enumerate() {
        groups.entry(top).or_default().push(questions[i].clone());
    }
    let mut groups: Vec<Vec<String>> = groups.into_values().collect();
    groups.sort();
    let hubs =
        judged_by.iter().filter(|(_, by)| by.len() > limit).map(|(document, by)| ((*document).to_owned(), by.len()));
    Grouping { groups, hubs: hubs.collect() }
}

/// How the questions were divided, for the caller to report.
#[derive(Debug, Clone, PartialEq)]
pub struct Division {
    /// Each part's questions, by part name.
    pub parts: BTreeMap<String, Qrels>,
    /// The largest group kept in one part.
    pub largest_group: usize,
    /// Hub documents whose questions went to several groups, with how many
    /// questions judge each, most judged first.
    pub hubs: Vec<(String, usize)>,
}

/// A part smaller than this many questions is refused by default
/// (`sleuth data divide --min-questions`): a validation of fewer questions
/// chooses a checkpoint by noise, and a training part of fewer teaches little.
pub const MIN_QUESTIONS: usize = 20;

/// Divides the questions of `qrels` among `parts` by weight, whole groups
/// of connected questions at a time (see the module docs), in an order
/// drawn from `seed`: the same inputs give the same parts. A group holds at
/// most half the smallest part's share, so no group decides a part's size; documents judged by more questions than that are hubs
/// (see [`connected`]). Refuses when a part would get fewer than
/// `min_questions`.
pub fn divide(qrels: &Qrels, parts: &[Part], seed: u64, min_questions: usize) -> Result<Division, BeirError> {
    let fail = |message: String| Err(BeirError::Divide(message));
    if parts.is_empty() {
        return fail("name at least one part".into());
    }
    for (i, part) in parts.iter().enumerate() {
        if parts[..i].iter().any(|p| p.name == part.name) {
            return fail(format!("part {:?} is named twice", part.name));
        }
    }
    let total_weight: u64 = parts.iter().map(|p| u64::from(p.weight)).sum();
    let share = |part: &Part| qrels.len() as f64 * f64::from(part.weight) / total_weight as f64;
    let smallest = parts.iter().map(share).fold(f64::INFINITY, f64::min);
    let cap = ((smallest / 2.0).floor() as usize).max(1);
    let Grouping { mut groups, hubs } = connected(qrels, cap);
    // Fisher-Yates from the seed, then each group to the part furthest
    // below its share (largest groups first would pack tighter, but a
    // seeded order keeps the parts alike in kind).
    let mut rng = Rng(seed);
    for i in (1..groups.len()).rev() {
        groups.swap(i, rng.below(i + 1));
    }
    let largest_group = groups.iter().map(Vec::len).max().unwrap_or(0);
    let mut filled = vec![0usize; parts.len()];
    let mut out: BTreeMap<String, Qrels> = parts.iter().map(|p| (p.name.clone(), Qrels::new())).collect();
    for group in groups {
        let neediest = (0..parts.len())
            .min_by(|&a, &b| {
                let fill = |i: usize| filled[i] as f64 / f64::from(parts[i].weight);
                fill(a).total_cmp(&fill(b))
            })
            .expect("parts is not empty");
        filled[neediest] += group.len();
        let part = out.get_mut(&parts[neediest].name).expect("every part has an entry");
        for question in group {
            part.insert(question.clone(), qrels[&question].clone());
        }
    }
    let small: Vec<String> = parts
        .iter()
        .filter(|p| out[&p.name].len() < min_questions)
        .map(|p| format!("{} {}", p.name, out[&p.name].len()))
        .collect();
    if !small.is_empty() {
        return fail(format!(
            "{} questions divided by weight leave {} below {min_questions} questions; a part that small \
             cannot choose or teach anything: give it more weight, or use a larger split",
            qrels.len(),
            small.join(", ")
        ));
    }
    let mut hubs = hubs;
    hubs.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(Division { parts: out, largest_group, hubs })
}

/// Writes `out`, a BEIR directory over the same corpus and queries as
/// `source` (linked, not copied), with every split of `source` but `from`,
/// and `from`'s questions divided among `parts` (see [`divide`]). Returns
/// the division.
pub fn write_divided(
    source: &BeirDir,
    from: &str,
    parts: &[Part],
    seed: u64,
    min_questions: usize,
    out: &Path,
) -> Result<Division, BeirError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| BeirError::Io { path, source }
    };
    let division = divide(&source.qrels(from)?, parts, seed, min_questions)?;
    let kept: Vec<String> = source.splits().into_iter().filter(|s| s != from).collect();
    if let Some(clash) = parts.iter().find(|p| kept.contains(&p.name)) {
        return Err(BeirError::Divide(format!(
            "part {:?} is already a split of {}",
            clash.name,
            source.root().display()
        )));
    }
    let qrels_dir = out.join("qrels");
    std::fs::create_dir_all(&qrels_dir).map_err(io(&qrels_dir))?;
    for file in ["corpus.jsonl", "queries.jsonl"] {
        let target = std::path::absolute(source.root().join(file)).map_err(io(&source.root().join(file)))?;
        symlink(&target, &out.join(file)).map_err(io(&out.join(file)))?;
    }
    for split in kept {
        let path = qrels_dir.join(format!("{split}.tsv"));
        std::fs::copy(source.root().join("qrels").join(format!("{split}.tsv")), &path).map_err(io(&path))?;
    }
    for part in parts {
        let qrels = &division.parts[&part.name];
        let mut text = String::from("query-id\tcorpus-id\tscore\n");
        for (question, judged) in qrels {
            for (document, score) in judged {
                text.push_str(&format!("{question}\t{document}\t{score}\n"));
            }
        }
        let path = qrels_dir.join(format!("{}.tsv", part.name));
        std::fs::write(&path, text).map_err(io(&path))?;
    }
    Ok(division)
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(not(unix))]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::fs::copy(target, link).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qrels(rows: &[(&str, &str)]) -> Qrels {
        let mut qrels = Qrels::new();
        for (question, document) in rows {
            qrels.entry((*question).to_owned()).or_default().insert((*document).to_owned(), 1);
        }
        qrels
    }

    fn parts(text: &[&str]) -> Vec<Part> {
        text.iter().map(|t| t.parse().unwrap()).collect()
    }

    /// `n` questions `s0..`, each judging a document of its own.
    fn singles(n: usize) -> Vec<(String, String)> {
        (0..n).map(|i| (format!("s{i}"), format!("own{i}"))).collect()
    }

    fn borrowed(rows: &[(String, String)]) -> Vec<(&str, &str)> {
        rows.iter().map(|(q, d)| (q.as_str(), d.as_str())).collect()
    }

    #[test]
    fn questions_sharing_a_document_stay_together() {
        // a1-a3 share documents through a chain; 21 others stand alone.
        let mut rows = singles(21);
        for (q, d) in [("a1", "x"), ("a2", "x"), ("a2", "y"), ("a3", "y")] {
            rows.push((q.into(), d.into()));
        }
        let judged = qrels(&borrowed(&rows));
        for seed in 0..20 {
            let divided = divide(&judged, &parts(&["sft:1", "rl:1"]), seed, 1).unwrap();
            let home = |q: &str| divided.parts.iter().find(|(_, part)| part.contains_key(q)).unwrap().0.clone();
            assert_eq!((home("a1"), home("a2")), (home("a3"), home("a3")), "seed {seed}");
            let total: usize = divided.parts.values().map(|part| part.len()).sum();
            assert_eq!(total, 24, "every question in exactly one part");
            assert!(divided.parts.values().all(|part| part.len() >= 11), "seed {seed}: {divided:?}");
            assert_eq!((divided.largest_group, divided.hubs.len()), (3, 0));
        }
        assert_eq!(
            divide(&judged, &parts(&["sft:1", "rl:1"]), 7, 1).unwrap(),
            divide(&judged, &parts(&["sft:1", "rl:1"]), 7, 1).unwrap()
        );
    }

    /// One document judged by every question (a team page) joined them all
    /// into one group, so one part got nearly everything. It is a hub now:
    /// the parts get their shares, and pairs sharing a specific document
    /// still stay together.
    #[test]
    fn a_hub_document_does_not_pull_every_question_into_one_part() {
        let mut rows = singles(210);
        rows.extend((0..210).map(|i| (format!("s{i}"), "team-page".to_owned())));
        rows.extend((0..210).step_by(2).map(|i| (format!("s{i}"), format!("pair{}", i / 2))));
        rows.extend((1..210).step_by(2).map(|i| (format!("s{i}"), format!("pair{}", i / 2))));
        let judged = qrels(&borrowed(&rows));
        let divided = divide(&judged, &parts(&["sft:3", "rl:3", "validation:1"]), 1, MIN_QUESTIONS).unwrap();
        let sizes: Vec<usize> = ["sft", "rl", "validation"].iter().map(|p| divided.parts[*p].len()).collect();
        assert_eq!(sizes, vec![90, 90, 30], "{divided:?}");
        assert_eq!(divided.hubs, vec![("team-page".to_owned(), 210)]);
        assert_eq!(divided.largest_group, 2);
        for part in divided.parts.values() {
            let pair = |q: &str| q[1..].parse::<usize>().unwrap() / 2;
            assert!(part.keys().all(|q| part.keys().filter(|r| pair(r) == pair(q)).count() == 2), "pairs kept");
        }
    }

    #[test]
    fn parts_follow_their_weights() {
        let rows = singles(700);
        let divided = divide(&qrels(&borrowed(&rows)), &parts(&["sft:3", "rl:3", "validation:1"]), 1, 1).unwrap();
        let sizes: Vec<usize> = ["sft", "rl", "validation"].iter().map(|p| divided.parts[*p].len()).collect();
        assert_eq!(sizes, vec![300, 300, 100]);
    }

    #[test]
    fn bad_parts_are_named() {
        assert!("sft".parse::<Part>().unwrap_err().contains("NAME:WEIGHT"));
        assert!("sft:0".parse::<Part>().unwrap_err().contains("weight above 0"));
        assert!("s/t:1".parse::<Part>().unwrap_err().contains("letters"));
        assert!("sft:x".parse::<Part>().unwrap_err().contains("whole number"));
        let rows = singles(100);
        let few = qrels(&borrowed(&rows));
        let error = divide(&few, &parts(&["sft:5", "rl:5", "validation:1"]), 1, MIN_QUESTIONS).unwrap_err().to_string();
        assert!(error.contains("100 questions divided by weight leave validation 9 below 20 questions"), "{error}");
        let error = divide(&few, &parts(&["sft:1", "sft:2"]), 1, 1).unwrap_err().to_string();
        assert!(error.contains("named twice"), "{error}");
    }

    #[test]
    fn a_divided_collection_keeps_the_other_splits_and_links_the_corpus() {
        let scratch = tempfile::tempdir().unwrap();
        let source = scratch.path().join("synth");
        crate::synth::write(
            &source,
            crate::synth::SynthSpec { family: crate::synth::Family::Companies, seed: 1, size: 40 },
        )
        .unwrap();
        let out = scratch.path().join("halves");
        let division =
            write_divided(&BeirDir::new(&source), "train", &parts(&["sft:1", "rl:1"]), 1, MIN_QUESTIONS, &out).unwrap();
        let divided = BeirDir::new(&out);
        assert_eq!(divided.splits(), vec!["rl", "sft", "test", "validation"]);
        let (sft, rl, train) = (
            divided.qrels("sft").unwrap(),
            divided.qrels("rl").unwrap(),
            BeirDir::new(&source).qrels("train").unwrap(),
        );
        assert_eq!((division.parts["sft"].len(), division.parts["rl"].len()), (sft.len(), rl.len()));
        assert_eq!(sft.len() + rl.len(), train.len());
        assert!(sft.keys().all(|q| train[q] == sft[q] && !rl.contains_key(q)));
        // A company's questions share its document: all four in one part.
        let company = |q: &str| q.split('-').next().unwrap().to_owned();
        assert!(sft.keys().all(|q| !rl.keys().any(|r| company(r) == company(q))), "{division:?}");
        assert_eq!(
            divided.queries(crate::BadLines::Fail).unwrap().len(),
            BeirDir::new(&source).queries(crate::BadLines::Fail).unwrap().len()
        );
        assert!(std::fs::symlink_metadata(out.join("corpus.jsonl")).is_ok());
        let clash = write_divided(
            &BeirDir::new(&source),
            "train",
            &parts(&["test:1", "rl:1"]),
            1,
            1,
            &scratch.path().join("x"),
        );
        assert!(clash.unwrap_err().to_string().contains("\"test\" is already a split"));
        assert!(!scratch.path().join("x").exists(), "nothing written on an error");
    }
}
