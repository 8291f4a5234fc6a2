//! Dynamic batching of query embeddings.
//!
//! Hundreds of episodes search at once; embedding each query alone wastes
//! the CPU on tiny matrix products. The batcher is an actor: callers send a
//! query and await its vector; the actor takes the first waiting query, then
//! whatever else arrives within `max_wait` (up to `max_batch`), and runs one
//! forward pass for all of them on a blocking thread. Under load batches
//! fill at once; alone, a query waits at most `max_wait`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::Instrument;

use super::Encoder;
use crate::error::Error;

/// Queries waiting beyond this many make callers wait to send (back-pressure).
const QUEUE: usize = 4096;

struct Job {
    text: String,
    reply: oneshot::Sender<Result<Vec<f32>, String>>,
    span: tracing::Span,
}

/// Handle to the batcher; cheap to clone.
#[derive(Clone)]
pub struct Embedder {
    sender: mpsc::Sender<Job>,
    pub encoder: Arc<Encoder>,
    counters: Arc<Counters>,
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    queries: AtomicU64,
}

/// How much batching happened: the mean batch is `queries / batches`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchStats {
    pub batches: u64,
    pub queries: u64,
}

impl Embedder {
    pub fn spawn(encoder: Arc<Encoder>, max_batch: usize, max_wait: Duration) -> Self {
        let (sender, receiver) = mpsc::channel(QUEUE);
        let counters = Arc::new(Counters::default());
        tokio::spawn(run(receiver, encoder.clone(), max_batch.max(1), max_wait, counters.clone()));
        Self { sender, encoder, counters }
    }

    pub fn stats(&self) -> BatchStats {
        BatchStats {
            batches: self.counters.batches.load(Ordering::Relaxed),
            queries: self.counters.queries.load(Ordering::Relaxed),
        }
    }

    /// The unit-length embedding of `text`.
    pub async fn embed(&self, text: String) -> Result<Vec<f32>, Error> {
        let (reply, answer) = oneshot::channel();
        let job = Job { text, reply, span: tracing::Span::current() };
        self.sender.send(job).await.map_err(|_| Error::Internal("embedding batcher stopped".to_owned()))?;
        answer
            .await
            .map_err(|_| Error::Internal("embedding batcher dropped the query".to_owned()))?
            .map_err(Error::Internal)
    }
}

async fn run(
    mut receiver: mpsc::Receiver<Job>,
    encoder: Arc<Encoder>,
    max_batch: usize,
    max_wait: Duration,
    counters: Arc<Counters>,
) {
    while let Some(first) = receiver.recv().await {
        let deadline = Instant::now() + max_wait;
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match tokio::time::timeout_at(deadline, receiver.recv()).await {
                Ok(Some(job)) => batch.push(job),
                _ => break,
            }
        }
        counters.batches.fetch_add(1, Ordering::Relaxed);
        counters.queries.fetch_add(batch.len() as u64, Ordering::Relaxed);
        let span = tracing::debug_span!("embed_batch", size = batch.len());
        let texts: Vec<String> = batch.iter().map(|job| job.text.clone()).collect();
        let encoder = encoder.clone();
        let result = tokio::task::spawn_blocking(move || encoder.encode(&texts))
            .instrument(span)
            .await
            .map_err(|join| join.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        match result {
            Ok(vectors) => {
                for (job, vector) in batch.into_iter().zip(vectors) {
                    let _entered = job.span.enter();
                    let _ = job.reply.send(Ok(vector));
                }
            }
            Err(message) => {
                for job in batch {
                    let _ = job.reply.send(Err(message.clone()));
                }
            }
        }
    }
}
