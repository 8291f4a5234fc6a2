//! A served collection: its documents and retrievers, and the collections a
//! gateway serves by name.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use sleuth_chat::bridge;
use tantivy::IndexReader;

use crate::bm25::{self, Bm25Scorer};
use crate::error::Error;
use crate::index::{self, Manifest, StoredDocument};
use crate::rm3;
use crate::vectors::VectorIndex;

/// Retrieval methods a collection may support.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Bm25,
    Vector,
}

/// One hit: a document ordinal and its retriever score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    pub ordinal: u32,
    pub score: f32,
}

/// An opened, searchable collection.
pub struct Collection {
    pub manifest: Manifest,
    /// Where the index was loaded from (directory or s3:// URI).
    pub index_uri: String,
    /// The local directory holding the index files.
    pub local_dir: PathBuf,
    documents: Vec<StoredDocument>,
    by_id: std::collections::HashMap<String, u32>,
    reader: IndexReader,
    bm25: Bm25Scorer,
    vectors: Option<VectorIndex>,
}

impl Collection {
    /// Opens the index in `dir`.
    pub fn open(dir: &Path, index_uri: String) -> Result<Self, Error> {
        let opened = index::open(dir)?;
        let by_id = opened.documents.iter().enumerate().map(|(ordinal, d)| (d.id.clone(), ordinal as u32)).collect();
        Ok(Self {
            manifest: opened.manifest.clone(),
            index_uri,
            local_dir: dir.to_owned(),
            documents: opened.documents,
            by_id,
            reader: opened.reader,
            bm25: opened.scorer,
            vectors: opened.vectors.map(|data| {
                let info = opened.manifest.vectors.as_ref().expect("vectors come with their manifest");
                VectorIndex::new(info.dim as usize, data, info.search)
            }),
        })
    }

    /// The same collection served under another name.
    pub fn renamed(mut self, name: String) -> Self {
        self.manifest.name = name;
        self
    }

    pub fn name(&self) -> &str {
        &self.manifest.name
    }

    pub fn len(&self) -> usize {
        self.documents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.documents.is_empty()
    }

    pub fn methods(&self) -> &'static [Method] {
        if self.vectors.is_some() { &[Method::Bm25, Method::Vector] } else { &[Method::Bm25] }
    }

    /// The `k` documents whose embeddings are closest (cosine) to the unit
    /// vector `query`. Blocking (CPU work).
    pub fn vector_search(&self, query: &[f32], k: usize) -> Result<Vec<Hit>, Error> {
        let Some(vectors) = &self.vectors else {
            return Err(Error::InvalidArgument(format!("collection {:?} has no vector index", self.name())));
        };
        if query.len() != vectors.dim() {
            return Err(Error::InvalidArgument(format!(
                "query embedding has {} dimensions, collection {:?} has {}",
                query.len(),
                self.name(),
                vectors.dim()
            )));
        }
        Ok(vectors.search(query, k))
    }

    /// The `k` best documents for `query` by BM25. Blocking (CPU work).
    pub fn bm25(&self, query: &str, k: usize) -> Result<Vec<Hit>, Error> {
        let terms = bm25::weighted(bm25::tokens(&mut self.bm25.options.analyzer(), query));
        self.bm25_terms(&self.reader.searcher(), &terms, k)
    }

    /// The `k` best documents by BM25 for `query` expanded with RM3
    /// pseudo-relevance feedback (`crate::rm3`). Blocking (CPU work).
    pub fn bm25_rm3(&self, query: &str, k: usize) -> Result<Vec<Hit>, Error> {
        let mut analyzer = self.bm25.options.analyzer();
        let terms = bm25::weighted(bm25::tokens(&mut analyzer, query));
        let searcher = self.reader.searcher();
        let body = |ordinal: u32| {
            let document = self.document(ordinal);
            index::body(&document.title, &document.text)
        };
        let expanded = rm3::expand(&self.bm25, &searcher, &mut analyzer, &terms, body)?;
        self.bm25_terms(&searcher, &expanded, k)
    }

    /// How many documents hold each word of `text` (lower-cased
    /// `sleuth_chat::bridge::words`, stop words left out), by the index: the
    /// fewest of the analyzed terms a word becomes that any document holds,
    /// 0 for a word the collection lacks.
    pub fn word_df(&self, text: &str) -> Result<HashMap<String, u32>, Error> {
        let mut analyzer = self.bm25.options.analyzer();
        let searcher = self.reader.searcher();
        let mut counts = HashMap::new();
        for word in bridge::words(text) {
            let word = word.text.to_lowercase();
            if bridge::is_stop_word(&word) || counts.contains_key(&word) {
                continue;
            }
            let mut rarest: Option<u64> = None;
            for token in bm25::tokens(&mut analyzer, &word) {
                let df = self.bm25.doc_freq(&searcher, &token)?;
                if df > 0 {
                    rarest = Some(rarest.map_or(df, |r| r.min(df)));
                }
            }
            counts.insert(word, rarest.unwrap_or(0) as u32);
        }
        Ok(counts)
    }

    /// Of the `k` best documents by BM25 for the analyzed, weighted `terms`.
    fn bm25_terms(&self, searcher: &tantivy::Searcher, terms: &[(String, f32)], k: usize) -> Result<Vec<Hit>, Error> {
        Ok(self.bm25.top_k(searcher, terms, k)?.into_iter().map(|(ordinal, score)| Hit { ordinal, score }).collect())
    }

    /// Reciprocal rank fusion of BM25 and vector search: each document scores
    /// the sum of `1 / (60 + rank)` over the two rankings (top 100 of each).
    /// Blocking (CPU work).
    pub fn hybrid(&self, query: &str, vector: &[f32], k: usize) -> Result<Vec<Hit>, Error> {
        const DEPTH: usize = 100;
        const RRF_K: f32 = 60.0;
        let mut fused: std::collections::HashMap<u32, f32> = std::collections::HashMap::new();
        for ranking in [self.bm25(query, DEPTH)?, self.vector_search(vector, DEPTH)?] {
            for (rank, hit) in ranking.iter().enumerate() {
                *fused.entry(hit.ordinal).or_default() += 1.0 / (RRF_K + rank as f32 + 1.0);
            }
        }
        let mut hits: Vec<Hit> = fused.into_iter().map(|(ordinal, score)| Hit { ordinal, score }).collect();
        hits.sort_unstable_by(|a, b| b.score.total_cmp(&a.score).then(a.ordinal.cmp(&b.ordinal)));
        hits.truncate(k);
        Ok(hits)
    }

    pub fn document(&self, ordinal: u32) -> &StoredDocument {
        &self.documents[ordinal as usize]
    }

    pub fn document_by_id(&self, id: &str) -> Option<&StoredDocument> {
        self.ordinal(id).map(|ordinal| self.document(ordinal))
    }

    pub fn ordinal(&self, id: &str) -> Option<u32> {
        self.by_id.get(id).copied()
    }
}

/// The collections a gateway serves, by name. Readers take a cheap `Arc`
/// snapshot; loading or deleting a collection never blocks a search in flight.
#[derive(Default, Clone)]
pub struct Collections {
    inner: Arc<RwLock<BTreeMap<String, Arc<Collection>>>>,
}

impl Collections {
    pub fn get(&self, name: &str) -> Result<Arc<Collection>, Error> {
        let collections = self.inner.read().expect("collections lock poisoned");
        collections.get(name).cloned().ok_or_else(|| {
            let known: Vec<&str> = collections.keys().map(String::as_str).collect();
            Error::NotFound(format!("collection {name:?} is not served here (serving: {})", known.join(", ")))
        })
    }

    /// Serves `collection` under its name, replacing any earlier one.
    pub fn insert(&self, collection: Collection) -> Arc<Collection> {
        let collection = Arc::new(collection);
        self.inner.write().expect("collections lock poisoned").insert(collection.name().to_owned(), collection.clone());
        collection
    }

    pub fn remove(&self, name: &str) -> Result<Arc<Collection>, Error> {
        self.inner
            .write()
            .expect("collections lock poisoned")
            .remove(name)
            .ok_or_else(|| Error::NotFound(format!("collection {name:?} is not served here")))
    }

    pub fn list(&self) -> Vec<Arc<Collection>> {
        self.inner.read().expect("collections lock poisoned").values().cloned().collect()
    }
}

/// Collection names are path components and URL segments: keep them plain.
pub fn validate_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("collection name must match [a-z0-9_-]{{1,64}}, got {name:?}")))
    }
}

#[cfg(test)]
mod tests {
    use sleuth_beir::{BadLines, BeirDir};

    use super::*;
    use crate::bm25::Bm25Options;

    /// A collection of `documents` (id, text) built into a temporary index.
    fn collection(documents: &[(String, String)]) -> (tempfile::TempDir, Collection) {
        let dir = tempfile::tempdir().unwrap();
        let corpus: String = documents
            .iter()
            .map(|(id, text)| serde_json::json!({"_id": id, "title": "", "text": text}).to_string() + "\n")
            .collect();
        std::fs::write(dir.path().join("corpus.jsonl"), corpus).unwrap();
        let out = dir.path().join("index");
        let source = BeirDir::new(dir.path());
        index::build(&source, &out, "rm3", &Bm25Options::default(), BadLines::Fail, None, &mut |_| {}).unwrap();
        let collection = Collection::open(&out, out.display().to_string()).unwrap();
        (dir, collection)
    }

    #[test]
    fn rm3_finds_a_document_that_shares_only_the_feedback_terms() {
        // Two documents about the query teach RM3 its vocabulary; a third
        // never says the query's words but shares that vocabulary; forty
        // fillers keep those terms under a tenth of the collection.
        let mut documents: Vec<(String, String)> = [
            ("a", "heart attack myocardial infarction troponin"),
            ("b", "heart attack infarction troponin angioplasty"),
            ("c", "myocardial infarction troponin angioplasty"),
        ]
        .map(|(id, text)| (id.to_owned(), text.to_owned()))
        .into();
        documents.extend((0..40).map(|i| (format!("f{i}"), format!("weather report number{i} rain"))));
        let (_dir, collection) = collection(&documents);
        let ids = |hits: Vec<Hit>| -> Vec<String> {
            hits.into_iter().map(|h| collection.document(h.ordinal).id.clone()).collect()
        };
        assert_eq!(ids(collection.bm25("heart attack", 10).unwrap()), ["a", "b"], "BM25 finds only the query's words");
        let expanded = ids(collection.bm25_rm3("heart attack", 10).unwrap());
        assert_eq!(expanded[..2], ["a", "b"], "the query's own documents stay first: {expanded:?}");
        assert_eq!(expanded[2], "c", "the feedback terms find the third: {expanded:?}");
    }
}
