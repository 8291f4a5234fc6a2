//! A collection's index on disk, built once from a BEIR corpus and opened by
//! every gateway that serves the collection.
//!
//! ```text
//! <dir>/manifest.json      what was indexed and how (written last: its presence marks a complete index)
//! <dir>/documents.jsonl    id, title, text and analyzed length of each document, by ordinal
//! <dir>/tantivy/           inverted index of title + text, with each document's ordinal
//! ```
//!
//! Building writes into `<dir>.partial` and renames it into place at the end,
//! so a crash never leaves a half-built index that looks complete.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sleuth_beir::{BadLines, BeirDir};
use tantivy::schema::{FAST, INDEXED, IndexRecordOption, STORED, Schema, TextFieldIndexing, TextOptions};
use tantivy::{Index, IndexReader, ReloadPolicy, TantivyDocument};

use crate::bm25::{self, ANALYZER, Bm25Options, Bm25Scorer};
use crate::embed::Encoder;
use crate::error::Error;
use crate::vectors::VectorSearch;

const FORMAT: u32 = 1;
const MANIFEST: &str = "manifest.json";
const DOCUMENTS: &str = "documents.jsonl";
const TANTIVY: &str = "tantivy";
const VECTORS: &str = "vectors.f32";
/// Documents per embedding forward pass at index time.
const EMBED_BATCH: usize = 32;

/// What an index holds and how it was built.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: u32,
    pub name: String,
    pub documents: u64,
    pub skipped_lines: u64,
    pub source: String,
    pub bm25: Bm25Options,
    /// Present when the index holds document embeddings for vector search.
    #[serde(default)]
    pub vectors: Option<VectorManifest>,
}

/// The largest embedding dimension an index may declare.
pub const MAX_DIM: u32 = 65_536;

impl Manifest {
    /// Reads and checks a manifest: the format this build writes, a sane
    /// embedding dimension and BM25 parameters. An index's files are data;
    /// nothing in them may crash the gateway.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let manifest: Self = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if manifest.format != FORMAT {
            return Err(format!(
                "index format {} is not supported (expected {FORMAT}); rebuild the index",
                manifest.format
            ));
        }
        if let Some(vectors) = &manifest.vectors
            && !(1..=MAX_DIM).contains(&vectors.dim)
        {
            return Err(format!("vectors.dim {} must be from 1 to {MAX_DIM}", vectors.dim));
        }
        let bm25 = &manifest.bm25;
        if !(bm25.k1.is_finite() && bm25.k1 >= 0.0 && (0.0..=1.0).contains(&bm25.b)) {
            return Err(format!("bm25 k1 {} must be finite and >= 0, b {} from 0 to 1", bm25.k1, bm25.b));
        }
        Ok(manifest)
    }
}

/// Which model embedded the documents; queries must use the same one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VectorManifest {
    pub model: String,
    pub dim: u32,
    pub max_tokens: u32,
    /// Exact scan or HNSW graph.
    pub search: VectorSearch,
}

/// One stored document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredDocument {
    pub id: String,
    pub title: String,
    pub text: String,
    /// Analyzed tokens of title + text (the BM25 document length).
    pub length: u32,
}

/// What BM25 indexes of a document: its title, then its text.
pub fn body(title: &str, text: &str) -> String {
    format!("{title}\n{text}")
}

/// Progress of a build, reported as it goes.
#[derive(Debug, Clone, PartialEq)]
pub struct BuildProgress {
    pub phase: &'static str,
    pub done: u64,
    pub total: u64,
    pub skipped_lines: u64,
}

/// How often (in documents) progress is reported.
const PROGRESS_EVERY: u64 = 1000;

/// Builds the index of the BEIR collection `source` into `out`.
pub fn build(
    source: &BeirDir,
    out: &Path,
    name: &str,
    bm25: &Bm25Options,
    bad_lines: BadLines,
    encoder: Option<(&Encoder, VectorSearch)>,
    progress: &mut dyn FnMut(BuildProgress),
) -> Result<Manifest, Error> {
    bm25.validate()?;
    if out.join(MANIFEST).exists() {
        return Err(Error::AlreadyExists(format!("an index already exists at {}", out.display())));
    }
    // Never overwrite anything else: the finished index is renamed onto `out`.
    if std::fs::read_dir(out).is_ok_and(|mut entries| entries.next().is_some()) || out.is_file() {
        return Err(Error::AlreadyExists(format!("{} exists and is not empty; choose a new directory", out.display())));
    }
    let partial = partial_dir(out);
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(|e| Error::io(&partial, e))?;
    }
    std::fs::create_dir_all(partial.join(TANTIVY)).map_err(|e| Error::io(&partial, e))?;

    let schema = schema();
    let content = schema.get_field("content").expect("schema has content");
    let ordinal = schema.get_field("ordinal").expect("schema has ordinal");
    let index = Index::create_in_dir(partial.join(TANTIVY), schema)?;
    index.tokenizers().register(ANALYZER, bm25.analyzer());
    let mut writer = index.writer_with_num_threads(1, 100_000_000)?;
    let mut analyzer = bm25.analyzer();

    let documents_path = partial.join(DOCUMENTS);
    let mut documents = BufWriter::new(File::create(&documents_path).map_err(|e| Error::io(&documents_path, e))?);
    let mut records = source.corpus(bad_lines)?;
    let mut seen = HashSet::new();
    let mut duplicates: u64 = 0;
    let mut count: u64 = 0;
    // Texts to embed (title and text, as BEIR evaluates dense retrievers), only when embedding.
    let mut passages: Vec<String> = Vec::new();
    while let Some(record) = records.next() {
        let document = record?;
        if !seen.insert(document.id.clone()) {
            let message = format!("duplicate document id {:?} in {}", document.id, source.corpus_path().display());
            if bad_lines == BadLines::Fail {
                return Err(Error::InvalidArgument(message));
            }
            duplicates += 1;
            continue;
        }
        let body = body(&document.title, &document.text);
        let length = bm25::tokens(&mut analyzer, &body).len() as u32;
        if encoder.is_some() {
            passages.push(format!("{} {}", document.title, document.text).trim().to_owned());
        }
        let mut doc = TantivyDocument::new();
        doc.add_u64(ordinal, count);
        doc.add_text(content, &body);
        writer.add_document(doc)?;
        let stored = StoredDocument { id: document.id, title: document.title, text: document.text, length };
        serde_json::to_writer(&mut documents, &stored).map_err(|e| Error::Internal(e.to_string()))?;
        documents.write_all(b"\n").map_err(|e| Error::io(&documents_path, e))?;
        count += 1;
        if count.is_multiple_of(PROGRESS_EVERY) {
            let (read, total) = records.progress();
            progress(BuildProgress { phase: "bm25", done: read, total, skipped_lines: records.skipped() });
        }
    }
    documents.flush().map_err(|e| Error::io(&documents_path, e))?;
    let skipped_lines = records.skipped() + duplicates;
    progress(BuildProgress { phase: "writing", done: count, total: count, skipped_lines });
    writer.commit()?;
    // One segment: queries then walk one postings list per term.
    let segments = index.searchable_segment_ids()?;
    if segments.len() > 1 {
        writer.merge(&segments).wait()?;
    }
    writer.wait_merging_threads()?;

    let vectors = match encoder {
        None => None,
        Some((encoder, vector_search)) => {
            let total = passages.len() as u64;
            let mut report = |done: usize| {
                if done.is_multiple_of(EMBED_BATCH * 8) || done as u64 == total {
                    progress(BuildProgress { phase: "embedding", done: done as u64, total, skipped_lines });
                }
            };
            let embeddings = encoder.encode_all(&passages, EMBED_BATCH, &mut report)?;
            let bytes: Vec<u8> = embeddings.iter().flatten().flat_map(|x| x.to_le_bytes()).collect();
            let path = partial.join(VECTORS);
            std::fs::write(&path, bytes).map_err(|e| Error::io(&path, e))?;
            Some(VectorManifest {
                model: encoder.name.clone(),
                dim: encoder.dim as u32,
                max_tokens: encoder.max_tokens as u32,
                search: vector_search,
            })
        }
    };

    let manifest = Manifest {
        format: FORMAT,
        name: name.to_owned(),
        documents: count,
        skipped_lines,
        source: source.root().display().to_string(),
        bm25: bm25.clone(),
        vectors,
    };
    let manifest_path = partial.join(MANIFEST);
    std::fs::write(&manifest_path, serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Internal(e.to_string()))?)
        .map_err(|e| Error::io(&manifest_path, e))?;
    // `out` is absent or an empty directory (checked above); rename replaces an empty one.
    std::fs::rename(&partial, out).map_err(|e| Error::io(out, e))?;
    Ok(manifest)
}

/// Scratch directory beside `out`, unique per process so concurrent builds never share one.
fn partial_dir(out: &Path) -> PathBuf {
    let mut name = out.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".partial-{}", std::process::id()));
    out.with_file_name(name)
}

fn schema() -> Schema {
    let mut builder = Schema::builder();
    builder.add_u64_field("ordinal", FAST | INDEXED | STORED);
    let indexing = TextFieldIndexing::default().set_tokenizer(ANALYZER).set_index_option(IndexRecordOption::WithFreqs);
    builder.add_text_field("content", TextOptions::default().set_indexing_options(indexing));
    builder.build()
}

/// An opened index: documents in memory, BM25 over tantivy.
pub struct OpenIndex {
    pub manifest: Manifest,
    pub documents: Vec<StoredDocument>,
    pub reader: IndexReader,
    pub scorer: Bm25Scorer,
    /// Document embeddings, row-major by ordinal, when the index has them.
    pub vectors: Option<Vec<f32>>,
}

/// Opens the complete index in `dir`.
pub fn open(dir: &Path) -> Result<OpenIndex, Error> {
    let manifest_path = dir.join(MANIFEST);
    let manifest_bytes = std::fs::read(&manifest_path).map_err(|error| match error.kind() {
        std::io::ErrorKind::NotFound => {
            Error::NotFound(format!("no complete index at {} (no {MANIFEST})", dir.display()))
        }
        _ => Error::io(&manifest_path, error),
    })?;
    let manifest = Manifest::parse(&manifest_bytes)
        .map_err(|message| Error::InvalidArgument(format!("{}: {message}", manifest_path.display())))?;
    let documents_path = dir.join(DOCUMENTS);
    let file = File::open(&documents_path).map_err(|e| Error::io(&documents_path, e))?;
    // The count is data: reserve no more than the documents file could hold.
    let file_bytes = file.metadata().map_err(|e| Error::io(&documents_path, e))?.len();
    let mut documents = Vec::with_capacity(manifest.documents.min(file_bytes / 2) as usize);
    for (index, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| Error::io(&documents_path, e))?;
        let document: StoredDocument = serde_json::from_str(&line)
            .map_err(|e| Error::Internal(format!("{}:{}: {e}", documents_path.display(), index + 1)))?;
        documents.push(document);
    }
    if documents.len() as u64 != manifest.documents {
        return Err(Error::Internal(format!(
            "{} holds {} documents, manifest says {}",
            documents_path.display(),
            documents.len(),
            manifest.documents
        )));
    }

    let index = Index::open_in_dir(dir.join(TANTIVY))?;
    index.tokenizers().register(ANALYZER, manifest.bm25.analyzer());
    let reader = index.reader_builder().reload_policy(ReloadPolicy::Manual).try_into()?;
    let schema = index.schema();
    let content = schema.get_field("content")?;
    let searcher = reader.searcher();
    let mut ordinals = Vec::new();
    for segment in searcher.segment_readers() {
        let column = segment.fast_fields().u64("ordinal")?;
        let map = (0..segment.max_doc())
            .map(|doc| {
                column
                    .first(doc)
                    .map(|o| o as u32)
                    .ok_or_else(|| Error::Internal(format!("document {doc} has no ordinal")))
            })
            .collect::<Result<Vec<u32>, Error>>()?;
        ordinals.push(map);
    }
    let lengths: Vec<u32> = documents.iter().map(|d| d.length).collect();
    let average_length = if lengths.is_empty() {
        1.0
    } else {
        (lengths.iter().map(|&l| u64::from(l)).sum::<u64>() as f32 / lengths.len() as f32).max(1.0)
    };
    let scorer = Bm25Scorer { options: manifest.bm25.clone(), content, lengths, average_length, ordinals };
    let vectors = match &manifest.vectors {
        None => None,
        Some(info) => {
            let path = dir.join(VECTORS);
            let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
            let expected = (manifest.documents as usize).saturating_mul(info.dim as usize).saturating_mul(4);
            if bytes.len() != expected {
                return Err(Error::Internal(format!(
                    "{} has {} bytes, expected {expected}",
                    path.display(),
                    bytes.len()
                )));
            }
            Some(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
        }
    };
    Ok(OpenIndex { manifest, documents, reader, scorer, vectors })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_collection() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("corpus.jsonl"), "{\"_id\": \"d1\", \"title\": \"t\", \"text\": \"rain\"}\n")
            .unwrap();
        dir
    }

    fn build_into(out: &Path) -> Result<Manifest, Error> {
        let source = tiny_collection();
        build(&BeirDir::new(source.path()), out, "tiny", &Bm25Options::default(), BadLines::Fail, None, &mut |_| {})
    }

    /// A built index whose manifest is replaced by `edit` of the real one.
    fn open_with_manifest(edit: impl FnOnce(&mut serde_json::Value)) -> Result<OpenIndex, Error> {
        let parent = tempfile::tempdir().unwrap();
        let out = parent.path().join("index");
        build_into(&out).unwrap();
        let path = out.join(MANIFEST);
        let mut manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        edit(&mut manifest);
        std::fs::write(&path, manifest.to_string()).unwrap();
        open(&out)
    }

    #[test]
    fn crafted_manifests_are_refused_not_obeyed() {
        // A count far past the documents file: refused after reading, nothing reserved for it.
        let error = open_with_manifest(|m| m["documents"] = serde_json::json!(u64::MAX / 2)).err().unwrap();
        assert!(error.to_string().contains("holds 1 documents"), "{error}");
        let vectors = |dim: u64| {
            move |m: &mut serde_json::Value| {
                m["vectors"] = serde_json::json!({"model": "m", "dim": dim, "max_tokens": 8, "search": "exact"})
            }
        };
        let error = open_with_manifest(vectors(0)).err().unwrap();
        assert!(error.to_string().contains("vectors.dim 0"), "{error}");
        let error = open_with_manifest(|m| m["bm25"]["b"] = serde_json::json!(7.0)).err().unwrap();
        assert!(error.to_string().contains("b 7"), "{error}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 10_000, ..Default::default() })]

        /// Any manifest text: a manifest or a clear error, never a panic.
        #[test]
        fn any_manifest_text_parses_or_is_refused(
            format in proptest::prop_oneof![proptest::strategy::Just(1u64), proptest::prelude::any::<u64>()],
            documents in proptest::prelude::any::<u64>(),
            dim in proptest::prelude::any::<u32>(),
            k1 in proptest::prelude::any::<f32>(),
            b in proptest::prelude::any::<f32>(),
            noise in "\\PC{0,40}",
        ) {
            let text = format!(
                r#"{{"format": {format}, "name": "x", "documents": {documents}, "skipped_lines": 0, "source": "s",
                "bm25": {{"k1": {k1}, "b": {b}, "stemmer": "english", "stop_words": true}},
                "vectors": {{"model": "m", "dim": {dim}, "max_tokens": 8, "search": "exact"}}}}"#
            );
            if let Ok(manifest) = Manifest::parse(text.as_bytes()) {
                let dim = manifest.vectors.as_ref().map_or(1, |v| v.dim);
                proptest::prop_assert!((1..=MAX_DIM).contains(&dim));
            }
            let _ = Manifest::parse(noise.as_bytes());
            let _ = Manifest::parse(text.replace(':', &noise).as_bytes());
        }
    }

    #[test]
    fn never_overwrites_a_directory_that_is_not_empty() {
        let parent = tempfile::tempdir().unwrap();
        std::fs::write(parent.path().join("precious.txt"), "keep me").unwrap();
        let error = build_into(parent.path()).unwrap_err().to_string();
        assert!(error.contains("not empty"), "{error}");
        assert_eq!(std::fs::read_to_string(parent.path().join("precious.txt")).unwrap(), "keep me");
    }

    #[test]
    fn builds_into_an_empty_directory_and_refuses_to_build_twice() {
        let parent = tempfile::tempdir().unwrap();
        let out = parent.path().join("index");
        std::fs::create_dir(&out).unwrap();
        assert_eq!(build_into(&out).unwrap().documents, 1);
        assert!(matches!(build_into(&out), Err(Error::AlreadyExists(_))));
        let leftovers: Vec<_> =
            std::fs::read_dir(parent.path()).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
        assert_eq!(leftovers.len(), 1, "no partial directory left behind: {leftovers:?}");
    }
}
