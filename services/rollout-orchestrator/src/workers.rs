//! The agent workers episodes run on, each episode sent to the least-loaded
//! live worker. A worker that fails (process gone, connection refused,
//! overloaded) is skipped for a while and the episode goes to another one.
//! The set follows discovery ([`Workers::follow`]): fixed addresses, or a
//! Kubernetes Service's ready pods, so workers scaled up take episodes at
//! once, and a worker that leaves gets no new episode while the ones it
//! runs finish.
//!
//! An episode that ends for a reason outside the policy (the tool gateway or
//! the model endpoint failed, or its trace is missing) is rerun, never scored:
//! scoring it would teach the policy that the infrastructure's failures are
//! its own ([`Workers::run_to_policy_outcome`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sleuth_discovery::Members;
use sleuth_kit::client::MeshChannel;
use sleuth_kit::ticket::TicketKey;
use sleuth_proto::agent::v1::agent_client::AgentClient;
use sleuth_proto::agent::v1::{RunEpisodeRequest, RunEpisodeResponse};
use sleuth_proto::common::v1::{Episode, EpisodeOutcome};
use std::sync::Mutex;
use tonic::Code;
use tracing::Instrument as _;

/// How long a failed worker is skipped.
const BENCH: Duration = Duration::from_secs(5);
/// Reruns of an episode that keeps failing outside the policy; then it fails
/// (and so does its run) with the last reason, instead of being trained on.
const INFRASTRUCTURE_RERUNS: u32 = 3;

/// Why `episode` ended outside the policy's control, if it did: only
/// completed, turn-limit and token-budget endings are the policy's own.
pub fn infrastructure_failure(episode: &Episode) -> Option<String> {
    match episode.outcome() {
        EpisodeOutcome::ToolError | EpisodeOutcome::ModelError => {
            Some(format!("{}: {}", episode.outcome().as_str_name(), episode.outcome_detail))
        }
        _ if episode.turns > 0 && episode.trace.is_none() => Some("the episode has no trace".to_owned()),
        _ => None,
    }
}

struct Worker {
    address: String,
    client: AgentClient<MeshChannel>,
    in_flight: AtomicUsize,
    failed_at: Mutex<Option<Instant>>,
}

#[derive(Clone)]
pub struct Workers {
    /// The current workers; an episode holds its worker while it runs.
    workers: Members<Worker>,
    /// How long an episode keeps looking for a live worker before it fails.
    patience: Duration,
    /// Signs each attempt's ticket at the inference gateway (None: `--insecure`, no tickets).
    tickets: Option<TicketKey>,
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
    /// Workers at the fixed entries of `addresses` at once; `kube://` ones
    /// join through [`Workers::follow`].
    pub fn new(
        addresses: &[String],
        token: Option<&sleuth_kit::BearerToken>,
        patience: Duration,
        tickets: Option<TicketKey>,
    ) -> Result<Self, sleuth_kit::KitError> {
        let token = token.cloned();
        let workers = Members::new("agent worker", move |address| {
            Ok(Worker {
                address: address.to_owned(),
                client: sleuth_kit::sized!(AgentClient::new(sleuth_kit::client::connect_lazy(
                    address,
                    token.as_ref()
                )?)),
                in_flight: AtomicUsize::new(0),
                failed_at: Mutex::new(None),
            })
        });
        Ok(Self { workers: workers.with_fixed(addresses)?, patience, tickets })
    }

    /// Keeps the workers up to date with `changes` (see [`Members::follow`]):
    /// a worker that leaves gets no new episode, its running ones finish.
    pub fn follow(&self, changes: sleuth_discovery::Changes) {
        self.workers.follow(changes);
    }

    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Workers in the order to try them: live ones by load, benched ones last.
    fn order(&self) -> Vec<Arc<Worker>> {
        let mut workers: Vec<Arc<Worker>> = self.workers.current().into_iter().map(|(_, w)| w).collect();
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
        // The episode's own deadline, from its budgets: long episodes are
        // normal, a worker silent past this is not.
        let deadline = agent::budget::Budget::of(request.config.as_ref().and_then(|c| c.budget)).deadline();
        for (attempt, worker) in self.order().into_iter().enumerate() {
            let mut request = tonic::Request::new(request.clone());
            request.get_mut().episode_id = attempt_id(attempt);
            request.get_mut().ticket =
                self.tickets.as_ref().map(|key| agent::ticket::issue(key, request.get_ref())).unwrap_or_default();
            request.set_timeout(deadline);
            worker.in_flight.fetch_add(1, Ordering::Relaxed);
            // The worker enforces the deadline it is sent; the caller too, for a worker that hangs whole.
            let mut client = worker.client.clone();
            // Each attempt is the root of its own trace, as it is its own episode.
            let span = tracing::info_span!(
                parent: None,
                "episode",
                run_id = %request.get_ref().run_id,
                episode_id = %request.get_ref().episode_id,
                task_id = %request.get_ref().task.as_ref().map_or("", |t| t.task_id.as_str()),
                worker = %worker.address,
            );
            let result = tokio::time::timeout(deadline + Duration::from_secs(30), client.run_episode(request))
                .instrument(span)
                .await
                .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded(format!("no answer within {deadline:?}"))));
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

    /// Runs the episode until it ends with one of the policy's own outcomes:
    /// with no live worker it keeps trying for the configured patience; an
    /// episode that fails outside the policy is rerun (fresh episode id and
    /// trace, backing off) up to [`INFRASTRUCTURE_RERUNS`] times.
    /// `attempt_id(n)` names the n-th attempt; no two attempts share an id.
    pub async fn run_to_policy_outcome(
        &self,
        request: RunEpisodeRequest,
        attempt_id: impl Fn(usize) -> String,
    ) -> Result<Episode, String> {
        let started = Instant::now();
        let (mut attempts, mut reruns) = (0usize, 0u32);
        loop {
            let first = attempts;
            attempts += self.len().max(1);
            match self.run_episode(request.clone(), |i| attempt_id(first + i)).await {
                Ok(response) => {
                    let episode = response.episode.ok_or("agent returned no episode")?;
                    let Some(why) = infrastructure_failure(&episode) else { return Ok(episode) };
                    if reruns == INFRASTRUCTURE_RERUNS {
                        return Err(format!(
                            "episode {} failed {} times for reasons outside the policy; last: {why}",
                            episode.episode_id,
                            reruns + 1
                        ));
                    }
                    reruns += 1;
                    tracing::warn!(episode_id = %episode.episode_id, reruns, reason = %why, "episode failed outside the policy; rerunning it");
                    tokio::time::sleep(Duration::from_millis(500 << reruns)).await;
                }
                Err(Failure::Rejected(why)) => return Err(format!("agent rejected the episode: {why}")),
                Err(Failure::NoWorker(why)) if started.elapsed() > self.patience => {
                    return Err(format!("no agent worker could run the episode for {:?}: {why}", self.patience));
                }
                Err(Failure::NoWorker(_)) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sleuth_proto::common::v1::Trace;

    fn ended(outcome: EpisodeOutcome, turns: u32, traced: bool) -> Episode {
        Episode { outcome: outcome as i32, turns, trace: traced.then(Trace::default), ..Default::default() }
    }

    #[test]
    fn only_the_policys_own_endings_are_scored() {
        for outcome in [EpisodeOutcome::Completed, EpisodeOutcome::TurnLimit, EpisodeOutcome::TokenBudget] {
            assert_eq!(infrastructure_failure(&ended(outcome, 2, true)), None, "{outcome:?}");
        }
        for outcome in [EpisodeOutcome::ToolError, EpisodeOutcome::ModelError] {
            assert!(infrastructure_failure(&ended(outcome, 2, true)).is_some(), "{outcome:?}");
        }
        let untraced = infrastructure_failure(&ended(EpisodeOutcome::Completed, 2, false));
        assert!(untraced.is_some_and(|why| why.contains("no trace")));
        // No turn, no trace: nothing was sampled, nothing to trace.
        assert_eq!(infrastructure_failure(&ended(EpisodeOutcome::Completed, 0, false)), None);
    }
}
