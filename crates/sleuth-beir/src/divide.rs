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
//! recall that fails on new questions (measured: see docs/learner.md).

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

/// Groups of questions connected by shared judged documents, each sorted,
/// the groups in order of their first question.
fn connected(qrels: &Qrels) -> Vec<Vec<String>> {
    // Union-find over questions and documents (documents prefixed apart).
    let mut parent: BTreeMap<String, String> = BTreeMap::new();
    fn root(parent: &BTreeMap<String, String>, node: &str) -> String {
        let mut at = node.to_owned();
        while let Some(up) = parent.get(&at).filter(|up| **up != at) {
            at = up.clone();
        }
        at
    }
    for (question, judged) in qrels {
        let q = format!("q\u{1}{question}");
        parent.entry(q.clone()).or_insert_with(|| q.clone());
        for document in judged.keys() {
            let d = format!("d\u{1}{document}");
            parent.entry(d.clone()).or_insert_with(|| d.clone());
            let (a, b) = (root(&parent, &q), root(&parent, &d));
            if a != b {
                parent.insert(a, b);
            }
        }
    }
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for question in qrels.keys() {
        let top = root(&parent, &format!("q\u{1}{question}"));
        groups.entry(top).or_default().push(question.clone());
    }
    let mut groups: Vec<Vec<String>> = groups.into_values().collect();
    groups.sort();
    groups
}

/// Divides the questions of `qrels` among `parts` by weight, whole groups
/// of connected questions at a time (see the module docs), in an order
/// drawn from `seed`: the same inputs give the same parts.
pub fn divide(qrels: &Qrels, parts: &[Part], seed: u64) -> Result<BTreeMap<String, Qrels>, BeirError> {
    let fail = |message: String| Err(BeirError::Divide(message));
    if parts.is_empty() {
        return fail("name at least one part".into());
    }
    for (i, part) in parts.iter().enumerate() {
        if parts[..i].iter().any(|p| p.name == part.name) {
            return fail(format!("part {:?} is named twice", part.name));
        }
    }
    let mut groups = connected(qrels);
    if groups.len() < parts.len() {
        return fail(format!(
            "{} questions in {} groups sharing judged documents cannot fill {} parts",
            qrels.len(),
            groups.len(),
            parts.len()
        ));
    }
    // Fisher-Yates from the seed, then each group to the part furthest
    // below its share (largest groups first would pack tighter, but a
    // seeded order keeps the parts alike in kind).
    let mut rng = Rng(seed);
    for i in (1..groups.len()).rev() {
        groups.swap(i, rng.below(i + 1));
    }
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
    Ok(out)
}

/// Writes `out`, a BEIR directory over the same corpus and queries as
/// `source` (linked, not copied), with every split of `source` but `from`,
/// and `from`'s questions divided among `parts`. Returns the questions per
/// part.
pub fn write_divided(
    source: &BeirDir,
    from: &str,
    parts: &[Part],
    seed: u64,
    out: &Path,
) -> Result<Vec<(String, usize)>, BeirError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| BeirError::Io { path, source }
    };
    let divided = divide(&source.qrels(from)?, parts, seed)?;
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
    let mut counts = Vec::new();
    for part in parts {
        let qrels = &divided[&part.name];
        let mut text = String::from("query-id\tcorpus-id\tscore\n");
        for (question, judged) in qrels {
            for (document, score) in judged {
                text.push_str(&format!("{question}\t{document}\t{score}\n"));
            }
        }
        let path = qrels_dir.join(format!("{}.tsv", part.name));
        std::fs::write(&path, text).map_err(io(&path))?;
        counts.push((part.name.clone(), qrels.len()));
    }
    Ok(counts)
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

    #[test]
    fn questions_sharing_a_document_stay_together() {
        // a1-a3 share documents through a chain; b and c stand alone.
        let judged = qrels(&[("a1", "x"), ("a2", "x"), ("a2", "y"), ("a3", "y"), ("b", "z"), ("c", "w")]);
        for seed in 0..20 {
            let divided = divide(&judged, &parts(&["sft:1", "rl:1"]), seed).unwrap();
            let home = |q: &str| divided.iter().find(|(_, part)| part.contains_key(q)).unwrap().0.clone();
            assert_eq!((home("a1"), home("a2")), (home("a3"), home("a3")), "seed {seed}");
            let total: usize = divided.values().map(|part| part.len()).sum();
            assert_eq!(total, 5, "every question in exactly one part");
            assert!(divided.values().all(|part| !part.is_empty()), "seed {seed}: {divided:?}");
        }
        assert_eq!(
            divide(&judged, &parts(&["sft:1", "rl:1"]), 7).unwrap(),
            divide(&judged, &parts(&["sft:1", "rl:1"]), 7).unwrap()
        );
    }

    #[test]
    fn parts_follow_their_weights() {
        let rows: Vec<(String, String)> = (0..700).map(|i| (format!("q{i}"), format!("d{i}"))).collect();
        let rows: Vec<(&str, &str)> = rows.iter().map(|(q, d)| (q.as_str(), d.as_str())).collect();
        let divided = divide(&qrels(&rows), &parts(&["sft:3", "rl:3", "validation:1"]), 1).unwrap();
        let sizes: Vec<usize> = ["sft", "rl", "validation"].iter().map(|p| divided[*p].len()).collect();
        assert_eq!(sizes, vec![300, 300, 100]);
    }

    #[test]
    fn bad_parts_are_named() {
        assert!("sft".parse::<Part>().unwrap_err().contains("NAME:WEIGHT"));
        assert!("sft:0".parse::<Part>().unwrap_err().contains("weight above 0"));
        assert!("s/t:1".parse::<Part>().unwrap_err().contains("letters"));
        assert!("sft:x".parse::<Part>().unwrap_err().contains("whole number"));
        let one = qrels(&[("a", "x"), ("b", "x")]);
        let error = divide(&one, &parts(&["sft:1", "rl:1"]), 1).unwrap_err().to_string();
        assert!(error.contains("2 questions in 1 groups"), "{error}");
        let error = divide(&one, &parts(&["sft:1", "sft:2"]), 1).unwrap_err().to_string();
        assert!(error.contains("named twice"), "{error}");
    }

    #[test]
    fn a_divided_collection_keeps_the_other_splits_and_links_the_corpus() {
        let scratch = tempfile::tempdir().unwrap();
        let source = scratch.path().join("synth");
        crate::synth::write(&source, crate::synth::SynthSpec { seed: 1, companies: 40 }).unwrap();
        let out = scratch.path().join("halves");
        let counts = write_divided(&BeirDir::new(&source), "train", &parts(&["sft:1", "rl:1"]), 1, &out).unwrap();
        let divided = BeirDir::new(&out);
        assert_eq!(divided.splits(), vec!["rl", "sft", "test", "validation"]);
        let (sft, rl, train) = (
            divided.qrels("sft").unwrap(),
            divided.qrels("rl").unwrap(),
            BeirDir::new(&source).qrels("train").unwrap(),
        );
        assert_eq!(counts, vec![("sft".to_owned(), sft.len()), ("rl".to_owned(), rl.len())]);
        assert_eq!(sft.len() + rl.len(), train.len());
        assert!(sft.keys().all(|q| train[q] == sft[q] && !rl.contains_key(q)));
        // A company's questions share its document: all four in one part.
        let company = |q: &str| q.split('-').next().unwrap().to_owned();
        assert!(sft.keys().all(|q| !rl.keys().any(|r| company(r) == company(q))));
        assert_eq!(
            divided.queries(crate::BadLines::Fail).unwrap().len(),
            BeirDir::new(&source).queries(crate::BadLines::Fail).unwrap().len()
        );
        assert!(std::fs::symlink_metadata(out.join("corpus.jsonl")).is_ok());
        let clash =
            write_divided(&BeirDir::new(&source), "train", &parts(&["test:1", "rl:1"]), 1, &scratch.path().join("x"));
        assert!(clash.unwrap_err().to_string().contains("\"test\" is already a split"));
        assert!(!scratch.path().join("x").exists(), "nothing written on an error");
    }
}
