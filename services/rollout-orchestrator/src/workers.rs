//! The agent workers episodes run on: a static list of addresses, each
//! episode sent to the least-loaded live worker. A worker that fails (process
//! gone, connection refused, overloaded) is skipped for a while and the
//! episode goes to another one. `Workers` is where DNS or Kubernetes
//! discovery would plug in.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sleuth_kit::client::MeshChannel;
use sleuth_proto::agent::v1::agent_client::AgentClient;
use sleuth_proto::agent::v1::{RunEpisodeRequest, RunEpisodeResponse};
use std::sync::Mutex;
use tonic::Code;

/// How long a failed worker is skipped.
const BENCH: Duration = Duration::from_secs(5);

struct Worker {
    address: String,
    client: AgentClient<MeshChannel>,
    in_flight: AtomicUsize,
    failed_at: Mutex<Option<Instant>>,
}

#[derive(Clone)]
pub struct Workers {
    workers: Arc<Vec<Worker>>,
}

/// Why an episode could not run on any worker.
#[derive(Debug)]
pub enum Failure {
    /// Every worker failed (or is benched); try again later.
    NoWorker(String),
    /// The request itself is wrong; retrying will not help.
    Rejected(String),
}

impl Workers {
    pub fn new(addresses: &[String], token: Option<&sleuth_kit::BearerToken>) -> Result<Self, sleuth_kit::KitError> {
        let workers = addresses
            .iter()
            .filter(|a| !a.is_empty())
            .map(|address| {
                Ok(Worker {
                    address: address.clone(),
                    client: AgentClient::new(sleuth_kit::client::connect_lazy(address, token)?),
                    in_flight: AtomicUsize::new(0),
                    failed_at: Mutex::new(None),
                })
            })
            .collect::<Result<Vec<_>, sleuth_kit::KitError>>()?;
        Ok(Self { workers: Arc::new(workers) })
    }

    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Workers in the order to try them: live ones by load, benched ones last.
    fn order(&self) -> Vec<&Worker> {
        let mut workers: Vec<&Worker> = self.workers.iter().collect();
        workers.sort_by_key(|w| {
            let benched = w.failed_at.lock().expect("lock").is_some_and(|at| at.elapsed() < BENCH);
            (benched, w.in_flight.load(Ordering::Relaxed))
        });
        workers
    }

    /// Runs the episode on some worker. `attempt_id` makes each attempt's
    /// episode id unique, so a retried episode starts a fresh trace.
    pub async fn run_episode(
        &self,
        request: RunEpisodeRequest,
        attempt_id: impl Fn(usize) -> String,
    ) -> Result<RunEpisodeResponse, Failure> {
        let mut last = String::from("no agent workers configured");
        for (attempt, worker) in self.order().into_iter().enumerate() {
            let mut request = request.clone();
            request.episode_id = attempt_id(attempt);
            worker.in_flight.fetch_add(1, Ordering::Relaxed);
            let result = worker.client.clone().run_episode(request).await;
            worker.in_flight.fetch_sub(1, Ordering::Relaxed);
            match result {
                Ok(response) => {
                    *worker.failed_at.lock().expect("lock") = None;
                    return Ok(response.into_inner());
                }
                Err(status) if status.code() == Code::InvalidArgument => {
                    return Err(Failure::Rejected(status.message().to_owned()));
                }
                Err(status) => {
                    tracing::warn!(worker = %worker.address, code = ?status.code(), message = status.message(), "episode failed on worker, trying another");
                    *worker.failed_at.lock().expect("lock") = Some(Instant::now());
                    last = format!("{}: {}", worker.address, status.message());
                }
            }
        }
        Err(Failure::NoWorker(last))
    }
}
