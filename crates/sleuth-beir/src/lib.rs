//! BEIR-format collections: the task sets and corpora Sleuth trains and
//! evaluates on.
//!
//! ```text
//! <dir>/corpus.jsonl      {"_id": "...", "title": "...", "text": "..."}   one document a line
//! <dir>/queries.jsonl     {"_id": "...", "text": "..."}                   one query a line
//!                         optional "metadata": {"answers": ["..."]}        reference answers
//! <dir>/qrels/<split>.tsv query-id <TAB> corpus-id <TAB> score            optional header line
//! ```
//!
//! A query's reference answers, for tasks answered in words, are
//! `metadata.answers` (a list of strings) or `metadata.answer` (one string,
//! as BEIR's HotpotQA writes it); any other form is an error naming the
//! query.
//!
//! The corpus is streamed (collections can be far larger than memory);
//! queries and qrels are small and read whole. A malformed line is an error
//! naming the file and line number, or, with [`BadLines::Skip`], is counted
//! and skipped.

pub mod divide;
pub mod synth;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum BeirError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    BadLine { path: PathBuf, line: u64, message: String },
    #[error("{path}: no qrels split {split:?} (available: {available})")]
    UnknownSplit { path: PathBuf, split: String, available: String },
    /// A synthetic collection could not be made as asked.
    #[error("synthetic collection: {0}")]
    Synth(String),
    /// A split could not be divided as asked (see [`divide`]).
    #[error("dividing a split: {0}")]
    Divide(String),
}

/// What to do with a line that cannot be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BadLines {
    /// Stop with an error naming the file and line.
    #[default]
    Fail,
    /// Count the line and go on.
    Skip,
}

/// One document of the corpus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    pub id: String,
    pub title: String,
    pub text: String,
}

/// One query (a task's question).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub id: String,
    pub text: String,
    /// Reference answers (`metadata.answers`); empty when it has none.
    pub answers: Vec<String>,
}

/// Relevance judgements: query id -> document id -> graded relevance.
pub type Qrels = BTreeMap<String, BTreeMap<String, i32>>;

/// A BEIR collection directory.
#[derive(Debug, Clone)]
pub struct BeirDir {
    root: PathBuf,
}

impl BeirDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn corpus_path(&self) -> PathBuf {
        self.root.join("corpus.jsonl")
    }

    /// Streams the corpus.
    pub fn corpus(&self, bad_lines: BadLines) -> Result<Records<Document>, BeirError> {
        Records::open(self.corpus_path(), bad_lines, parse_document)
    }

    /// Reads every query.
    pub fn queries(&self, bad_lines: BadLines) -> Result<Vec<Query>, BeirError> {
        Records::open(self.root.join("queries.jsonl"), bad_lines, parse_query)?.collect()
    }

    /// The qrels splits present (`qrels/<split>.tsv`), sorted.
    pub fn splits(&self) -> Vec<String> {
        let mut splits: Vec<String> = std::fs::read_dir(self.root.join("qrels"))
            .into_iter()
            .flatten()
            .filter_map(|entry| entry.ok())
            .filter_map(|entry| entry.file_name().to_str()?.strip_suffix(".tsv").map(str::to_owned))
            .collect();
        splits.sort();
        splits
    }

    /// Reads the judgements of one split.
    pub fn qrels(&self, split: &str) -> Result<Qrels, BeirError> {
        let path = self.root.join("qrels").join(format!("{split}.tsv"));
        if !path.is_file() {
            return Err(BeirError::UnknownSplit { path, split: split.to_owned(), available: self.splits().join(", ") });
        }
        read_qrels(&path)
    }
}

/// Reads a qrels TSV (`query-id<TAB>corpus-id<TAB>score`, with or without a
/// header line; the 4-column TREC form `qid 0 docid rel` is accepted too).
pub fn read_qrels(path: &Path) -> Result<Qrels, BeirError> {
    let file = File::open(path).map_err(|source| BeirError::Io { path: path.to_owned(), source })?;
    let mut qrels = Qrels::new();
    for (index, line) in BufReader::new(file).lines().enumerate() {
        let line_number = index as u64 + 1;
        let line = line.map_err(|source| BeirError::Io { path: path.to_owned(), source })?;
        let bad = |message: String| BeirError::BadLine { path: path.to_owned(), line: line_number, message };
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (query, doc, score) = match fields.as_slice() {
            [] => continue,
            [query, doc, score] | [query, _, doc, score] => (*query, *doc, *score),
            _ => return Err(bad(format!("expected query-id, corpus-id and score, got {line:?}"))),
        };
        let Ok(score) = score.parse::<i32>() else {
            if line_number == 1 {
                continue; // header line
            }
            return Err(bad(format!("score must be an integer, got {score:?}")));
        };
        qrels.entry(query.to_owned()).or_default().insert(doc.to_owned(), score);
    }
    Ok(qrels)
}

/// A streaming JSONL reader that knows its file, line number and progress.
pub struct Records<T> {
    path: PathBuf,
    reader: BufReader<File>,
    parse: fn(&str) -> Result<T, String>,
    bad_lines: BadLines,
    line: u64,
    bytes_read: u64,
    total_bytes: u64,
    skipped: u64,
    skipped_examples: Vec<String>,
    buffer: String,
}

impl<T> Records<T> {
    fn open(path: PathBuf, bad_lines: BadLines, parse: fn(&str) -> Result<T, String>) -> Result<Self, BeirError> {
        let file = File::open(&path).map_err(|source| BeirError::Io { path: path.clone(), source })?;
        let total_bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(Self {
            path,
            reader: BufReader::with_capacity(1 << 20, file),
            parse,
            bad_lines,
            line: 0,
            bytes_read: 0,
            total_bytes,
            skipped: 0,
            skipped_examples: Vec::new(),
            buffer: String::new(),
        })
    }

    /// Bytes consumed so far and the file size, for progress reporting.
    pub fn progress(&self) -> (u64, u64) {
        (self.bytes_read, self.total_bytes)
    }

    /// Malformed lines skipped so far (always 0 with [`BadLines::Fail`]).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// `file:line: message` of the first few skipped lines, for reports.
    pub fn skipped_examples(&self) -> &[String] {
        &self.skipped_examples
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// How many skipped lines are kept as examples.
const SKIPPED_EXAMPLES: usize = 5;

impl<T> Iterator for Records<T> {
    type Item = Result<T, BeirError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            self.buffer.clear();
            let read = match self.reader.read_line(&mut self.buffer) {
                Ok(0) => return None,
                Ok(read) => read,
                Err(source) => return Some(Err(BeirError::Io { path: self.path.clone(), source })),
            };
            self.line += 1;
            self.bytes_read += read as u64;
            let text = self.buffer.trim();
            if text.is_empty() {
                continue;
            }
            match (self.parse)(text) {
                Ok(record) => return Some(Ok(record)),
                Err(message) if self.bad_lines == BadLines::Skip => {
                    self.skipped += 1;
                    if self.skipped_examples.len() < SKIPPED_EXAMPLES {
                        self.skipped_examples.push(format!("{}:{}: {message}", self.path.display(), self.line));
                    }
                }
                Err(message) => {
                    return Some(Err(BeirError::BadLine { path: self.path.clone(), line: self.line, message }));
                }
            }
        }
    }
}

/// BEIR ids are strings, but some exports write numbers.
#[derive(Deserialize)]
#[serde(untagged)]
enum Id {
    Text(String),
    Number(serde_json::Number),
}

impl Id {
    fn into_string(self) -> String {
        match self {
            Id::Text(text) => text,
            Id::Number(number) => number.to_string(),
        }
    }
}

#[derive(Deserialize)]
struct RawDocument {
    #[serde(rename = "_id")]
    id: Id,
    #[serde(default)]
    title: Option<String>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct RawQuery {
    #[serde(rename = "_id")]
    id: Id,
    text: String,
    #[serde(default)]
    metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

fn parse_document(line: &str) -> Result<Document, String> {
    let raw: RawDocument = serde_json::from_str(line).map_err(|error| format!("invalid document: {error}"))?;
    let id = raw.id.into_string();
    if id.is_empty() {
        return Err("document _id is empty".to_owned());
    }
    Ok(Document { id, title: raw.title.unwrap_or_default(), text: raw.text.unwrap_or_default() })
}

fn parse_query(line: &str) -> Result<Query, String> {
    let raw: RawQuery = serde_json::from_str(line).map_err(|error| format!("invalid query: {error}"))?;
    let id = raw.id.into_string();
    if id.is_empty() {
        return Err("query _id is empty".to_owned());
    }
    let answers = raw.metadata.as_ref().map(answers).transpose().map_err(|e| format!("query {id:?}: {e}"))?;
    Ok(Query { id, text: raw.text, answers: answers.unwrap_or_default() })
}

/// The reference answers in a query's metadata: `answers` (strings) or
/// `answer` (a string); neither is none.
fn answers(metadata: &serde_json::Map<String, serde_json::Value>) -> Result<Vec<String>, String> {
    let answers = match (metadata.get("answers"), metadata.get("answer")) {
        (Some(_), Some(_)) => return Err("metadata has both \"answers\" and \"answer\"; give one".to_owned()),
        (Some(serde_json::Value::Array(list)), None) => list
            .iter()
            .map(|answer| answer.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                format!("metadata.answers must be a list of strings, got {}", serde_json::Value::Array(list.clone()))
            })?,
        (Some(other), None) => return Err(format!("metadata.answers must be a list of strings, got {other}")),
        (None, Some(serde_json::Value::String(answer))) => vec![answer.clone()],
        (None, Some(other)) => return Err(format!("metadata.answer must be a string, got {other}")),
        (None, None) => Vec::new(),
    };
    if answers.iter().any(|answer| answer.trim().is_empty()) {
        return Err("metadata.answers must not hold an empty answer".to_owned());
    }
    Ok(answers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collection(corpus: &str) -> (tempfile::TempDir, BeirDir) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("corpus.jsonl"), corpus).unwrap();
        std::fs::write(dir.path().join("queries.jsonl"), "{\"_id\": \"q1\", \"text\": \"what causes rain\"}\n")
            .unwrap();
        std::fs::create_dir(dir.path().join("qrels")).unwrap();
        std::fs::write(dir.path().join("qrels/test.tsv"), "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t2\n")
            .unwrap();
        let beir = BeirDir::new(dir.path());
        (dir, beir)
    }

    const CORPUS: &str = "{\"_id\": \"d1\", \"title\": \"Rain\", \"text\": \"Clouds.\"}\n\
        not json at all\n\
        {\"_id\": 7, \"text\": \"numeric id, no title\"}\n";

    #[test]
    fn malformed_line_fails_naming_file_and_line() {
        let (_dir, beir) = collection(CORPUS);
        let error = beir.corpus(BadLines::Fail).unwrap().collect::<Result<Vec<_>, _>>().unwrap_err().to_string();
        assert!(error.contains("corpus.jsonl:2:"), "{error}");
    }

    #[test]
    fn skipping_bad_lines_counts_them() {
        let (_dir, beir) = collection(CORPUS);
        let mut records = beir.corpus(BadLines::Skip).unwrap();
        let docs: Vec<Document> = records.by_ref().collect::<Result<_, _>>().unwrap();
        assert_eq!(records.skipped(), 1);
        assert!(records.skipped_examples()[0].contains("corpus.jsonl:2:"));
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[1], Document { id: "7".into(), title: String::new(), text: "numeric id, no title".into() });
        let (read, total) = records.progress();
        assert_eq!(read, total);
    }

    #[test]
    fn reads_queries_and_graded_qrels() {
        let (_dir, beir) = collection(CORPUS);
        assert_eq!(beir.queries(BadLines::Fail).unwrap()[0].text, "what causes rain");
        let qrels = beir.qrels("test").unwrap();
        assert_eq!(qrels["q1"]["d2"], 2);
        assert_eq!(beir.splits(), ["test"]);
        let error = beir.qrels("dev").unwrap_err().to_string();
        assert!(error.contains("\"dev\"") && error.contains("available: test"), "{error}");
    }

    #[test]
    fn reference_answers_are_read_and_a_malformed_one_names_its_query() {
        let (dir, beir) = collection(CORPUS);
        let queries = [
            r#"{"_id": "q1", "text": "t", "metadata": {"answers": ["Toubal", "the Toubal"], "type": "river"}}"#,
            r#"{"_id": "q2", "text": "t", "metadata": {"answer": "yes"}}"#,
            r#"{"_id": "q3", "text": "t", "metadata": {"type": "river"}}"#,
        ];
        std::fs::write(dir.path().join("queries.jsonl"), queries.join("\n")).unwrap();
        let read: Vec<Vec<String>> = beir.queries(BadLines::Fail).unwrap().into_iter().map(|q| q.answers).collect();
        assert_eq!(read, [vec!["Toubal".to_owned(), "the Toubal".to_owned()], vec!["yes".to_owned()], vec![]]);
        for bad in [r#"{"answers": "Toubal"}"#, r#"{"answers": [1]}"#, r#"{"answer": ["x"]}"#, r#"{"answers": [" "]}"#]
        {
            let line = format!(r#"{{"_id": "q7", "text": "t", "metadata": {bad}}}"#);
            std::fs::write(dir.path().join("queries.jsonl"), line).unwrap();
            let error = beir.queries(BadLines::Fail).unwrap_err().to_string();
            assert!(
                error.contains("queries.jsonl:1")
                    && error.contains("query \"q7\"")
                    && error.contains("metadata.answer"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn bad_qrels_score_names_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("test.tsv");
        std::fs::write(&path, "query-id\tcorpus-id\tscore\nq1\td1\thigh\n").unwrap();
        let error = read_qrels(&path).unwrap_err().to_string();
        assert!(error.contains("test.tsv:2") && error.contains("\"high\""), "{error}");
    }

    mod properties {
        use proptest::prelude::*;

        use super::super::{parse_document, parse_query};

        /// JSON-ish lines: fields a BEIR line has, in any shape, and noise.
        fn line() -> impl Strategy<Value = String> {
            let value = prop_oneof![
                Just("null".to_owned()),
                Just("7".to_owned()),
                Just("\"\"".to_owned()),
                Just("\"d1\"".to_owned()),
                Just("[\"a\", 3]".to_owned()),
                Just("{\"answer\": \"x\"}".to_owned()),
                Just("{\"answers\": [\"x\", \"y\"]}".to_owned()),
                Just("{\"answers\": 3}".to_owned()),
            ];
            let key = prop_oneof![Just("_id"), Just("text"), Just("title"), Just("metadata"), Just("other")];
            let object = proptest::collection::vec((key, value), 0..5).prop_map(|fields| {
                let body: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
                format!("{{{}}}", body.join(", "))
            });
            prop_oneof![object, "\\PC{0,40}"]
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

            /// Any line is a record or an error that says what is wrong,
            /// never a panic; a record always has an id.
            #[test]
            fn any_line_is_a_record_or_a_reason(line in line()) {
                match parse_query(&line) {
                    Ok(query) => prop_assert!(!query.id.is_empty()),
                    Err(reason) => prop_assert!(!reason.is_empty()),
                }
                match parse_document(&line) {
                    Ok(document) => prop_assert!(!document.id.is_empty()),
                    Err(reason) => prop_assert!(!reason.is_empty()),
                }
            }
        }
    }
}
