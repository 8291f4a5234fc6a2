//! Nearest-neighbour search over a collection's document embeddings.
//!
//! Embeddings are unit vectors, so cosine similarity is a dot product. Small
//! collections use exact search (a scan: perfect recall, about a millisecond
//! per 10k documents); larger ones an HNSW graph (`hnsw_rs`), rebuilt from
//! the stored embeddings when the collection is opened.

use hnsw_rs::prelude::{Distance, Hnsw};
use serde::{Deserialize, Serialize};

use crate::collection::Hit;
use crate::embed::dot;

/// How a collection's vectors are searched, chosen when it is indexed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum VectorSearch {
    /// Scan every vector.
    Exact,
    /// Approximate search in an HNSW graph.
    #[default]
    Hnsw,
}

/// HNSW graph degree and search breadths: the usual settings for ~0.99 recall at 10.
const HNSW_CONNECTIONS: usize = 16;
const HNSW_LAYERS: usize = 16;
const HNSW_EF_CONSTRUCTION: usize = 200;
const HNSW_EF_SEARCH: usize = 128;

/// Cosine distance of unit vectors, `1 - a.b`, clamped at 0. (`hnsw_rs`'s own
/// `DistDot` asserts `a.b <= 1`, which rounding breaks for near-duplicates,
/// and a search must never panic.)
struct UnitCosine;

impl Distance<f32> for UnitCosine {
    fn eval(&self, a: &[f32], b: &[f32]) -> f32 {
        (1.0 - dot(a, b)).max(0.0)
    }
}

pub struct VectorIndex {
    dim: usize,
    /// Row-major embeddings by document ordinal.
    data: Vec<f32>,
    graph: Option<Hnsw<'static, f32, UnitCosine>>,
}

impl VectorIndex {
    /// Wraps the stored embeddings, building the HNSW graph if asked (blocking; parallel).
    pub fn new(dim: usize, data: Vec<f32>, search: VectorSearch) -> Self {
        let graph = (search == VectorSearch::Hnsw).then(|| {
            let count = data.len() / dim;
            let graph = Hnsw::new(HNSW_CONNECTIONS, count.max(1), HNSW_LAYERS, HNSW_EF_CONSTRUCTION, UnitCosine);
            let points: Vec<(&[f32], usize)> = data.chunks_exact(dim).enumerate().map(|(i, row)| (row, i)).collect();
            graph.parallel_insert_slice(&points);
            graph
        });
        Self { dim, data, graph }
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The `k` nearest documents to the unit vector `query`, best first.
    pub fn search(&self, query: &[f32], k: usize) -> Vec<Hit> {
        match &self.graph {
            Some(graph) => {
                let mut hits: Vec<Hit> = graph
                    .search(query, k, HNSW_EF_SEARCH.max(k))
                    .into_iter()
                    .map(|n| Hit { ordinal: n.d_id as u32, score: 1.0 - n.distance })
                    .collect();
                hits.sort_unstable_by(better);
                hits.truncate(k);
                hits
            }
            None => {
                let mut hits: Vec<Hit> = self
                    .data
                    .chunks_exact(self.dim)
                    .enumerate()
                    .map(|(ordinal, row)| Hit { ordinal: ordinal as u32, score: dot(row, query) })
                    .collect();
                if hits.len() > k && k > 0 {
                    hits.select_nth_unstable_by(k - 1, better);
                }
                hits.truncate(k);
                hits.sort_unstable_by(better);
                hits
            }
        }
    }
}

fn better(a: &Hit, b: &Hit) -> std::cmp::Ordering {
    b.score.total_cmp(&a.score).then(a.ordinal.cmp(&b.ordinal))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random unit vectors.
    fn unit_vectors(count: usize, dim: usize) -> Vec<f32> {
        let mut state = 7u64;
        let mut data = Vec::with_capacity(count * dim);
        for _ in 0..count {
            let row: Vec<f32> = (0..dim)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((state >> 33) as f32 / (1u64 << 31) as f32) - 0.5
                })
                .collect();
            let norm = dot(&row, &row).sqrt();
            data.extend(row.iter().map(|x| x / norm));
        }
        data
    }

    #[test]
    fn hnsw_finds_what_exact_search_finds() {
        let (count, dim) = (2000, 32);
        let data = unit_vectors(count, dim);
        let exact = VectorIndex::new(dim, data.clone(), VectorSearch::Exact);
        let hnsw = VectorIndex::new(dim, data.clone(), VectorSearch::Hnsw);
        let mut found = 0;
        for q in 0..50 {
            let query = &data[q * 37 % count * dim..][..dim];
            let truth: Vec<u32> = exact.search(query, 10).iter().map(|h| h.ordinal).collect();
            assert_eq!(truth[0], (q * 37 % count) as u32, "a stored vector is its own nearest neighbour");
            let approx = hnsw.search(query, 10);
            found += approx.iter().filter(|h| truth.contains(&h.ordinal)).count();
            assert!(approx.windows(2).all(|w| w[0].score >= w[1].score));
        }
        let recall = found as f64 / 500.0;
        assert!(recall >= 0.95, "HNSW recall@10 {recall}");
    }
}
