//! A served collection: its documents and retrievers, and the collections a
//! gateway serves by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use tantivy::IndexReader;

use crate::bm25::{self, Bm25Scorer};
use crate::error::Error;
use crate::index::{self, Manifest, StoredDocument};
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
        let tokens = bm25::tokens(&mut self.bm25.options.analyzer(), query);
        let searcher = self.reader.searcher();
        Ok(self.bm25.top_k(&searcher, &tokens, k)?.into_iter().map(|(ordinal, score)| Hit { ordinal, score }).collect())
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
