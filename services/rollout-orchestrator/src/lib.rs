//! The rollout orchestrator: owns training runs. It fans each task out as a
//! group of episodes to agent workers, scores them, and publishes finished
//! groups to the run's Redis stream for the learner; run state lives in SQL
//! so a restarted orchestrator resumes its runs.
//!
//! - [`spec`]: checking a run spec at CreateRun;
//! - [`tasks`]: task sets from BEIR collections;
//! - [`workers`]: the agent workers, episode failover and reruns of infrastructure failures;
//! - [`runs`]: driving a run (concurrency, staleness gate, exactly-once publication);
//! - [`state`]: runs, groups and episodes in SQL;
//! - [`evaluate`]: evaluation jobs (a policy or a retrieval baseline);
//! - [`scoring`]: the reward a spec names, and [`judge`], the LLM judge of answers;
//! - [`dashboard`]: the web pages of runs, curves, episodes and evaluations.

pub mod dashboard;
pub mod evaluate;
pub mod jobs;
pub mod judge;
pub mod runs;
pub mod scoring;
pub mod spec;
pub mod state;
pub mod tasks;
pub mod validate;
pub mod workers;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use sleuth_kit::{ErrorKind, GrpcService, KitError, ServeArgs, ServiceError, TelemetryArgs};
use sleuth_proto::rollout::v1 as pb;
use sleuth_proto::rollout::v1::rollout_orchestrator_server::{RolloutOrchestrator, RolloutOrchestratorServer};
use sleuth_store::{Database, DatabaseArgs, RedisArgs, RedisStore};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use crate::runs::Runner;

/// Configuration, from flags or `SLEUTH_*` environment variables.
#[derive(clap::Parser, Debug, Clone)]
#[command(
    name = "rollout-orchestrator",
    version,
    about = "Owns training runs: fans tasks out to agent workers and publishes scored groups."
)]
pub struct Config {
    /// Address to listen on for gRPC.
    #[arg(long, env = "SLEUTH_LISTEN", default_value = "0.0.0.0:50051")]
    pub listen: SocketAddr,

    /// Address for the web dashboard (HTTP, behind the mesh's token).
    #[arg(long, env = "SLEUTH_HTTP_LISTEN", default_value = "0.0.0.0:8080")]
    pub http_listen: SocketAddr,

    /// The policy's model directory: its tokenizer spells out the tokens of
    /// episode traces on the dashboard (runs whose spec names a local model
    /// use that one's). Unset: tokens show as ids.
    #[arg(long, env = "SLEUTH_MODEL")]
    pub model: Option<std::path::PathBuf>,

    #[command(flatten)]
    pub database: DatabaseArgs,

    #[command(flatten)]
    pub redis: RedisArgs,

    /// Agent workers, comma separated: `host:port`, or
    /// `kube://SERVICE[.NAMESPACE]:PORT` for a Kubernetes Service's ready
    /// pods, followed as they come and go (see `sleuth_discovery`).
    #[arg(long, env = "SLEUTH_AGENT_WORKERS", value_delimiter = ',', default_value = "127.0.0.1:50052")]
    pub agent_workers: Vec<String>,

    /// Tool gateway for evaluation baselines (host:port); unset = no baselines.
    #[arg(long, env = "SLEUTH_TOOL_GATEWAY")]
    pub tool_gateway: Option<String>,

    /// The directories task sets (BEIR collections named in run specs and
    /// evaluations) may be read from; a source elsewhere is refused. Empty:
    /// no local task set is read.
    #[arg(long, env = "SLEUTH_TASK_ROOTS", value_delimiter = ',')]
    pub task_roots: Vec<std::path::PathBuf>,

    /// Where evaluation jobs write their TREC run files and JSON reports.
    #[arg(long, env = "SLEUTH_REPORT_DIR", default_value = "evaluations")]
    pub report_dir: std::path::PathBuf,

    /// How long a run rides out a fault before it fails: an episode waiting
    /// for a live agent worker, Redis or the database being unreachable (a
    /// pod rescheduled, a failover). A failed run resumes with `CreateRun`
    /// of the same run id and spec.
    #[arg(long, env = "SLEUTH_FAULT_PATIENCE", default_value = "2m", value_parser = humantime::parse_duration)]
    pub fault_patience: std::time::Duration,

    /// The LLM judge of the `judge` reward.
    #[command(flatten)]
    pub judge: judge::JudgeArgs,

    /// The token that alone opens administration (see `sleuth_kit::auth`).
    #[command(flatten)]
    pub admin: sleuth_kit::AdminTokenArgs,

    #[command(flatten)]
    pub serve: ServeArgs,

    /// Signs each episode's ticket at the inference gateway (see [`sleuth_kit::ticket`]).
    #[command(flatten)]
    pub tickets: sleuth_kit::TicketKeyArgs,

    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// Errors that stop the service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Kit(#[from] KitError),
    #[error(transparent)]
    Store(#[from] sleuth_store::StoreError),
    #[error(transparent)]
    Discovery(#[from] sleuth_discovery::DiscoveryError),
}

impl ServiceError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Kit(error) => error.kind(),
            Error::Store(error) => error.kind(),
            Error::Discovery(error) => error.kind(),
        }
    }
}

#[derive(Clone)]
pub struct Handlers {
    runner: Runner,
    evaluator: evaluate::Evaluator,
}

/// A store's failure as its caller sees it: the kit's code for it
/// (`Unavailable` for a database or Redis error), and its whole cause chain.
fn internal(error: sleuth_store::StoreError) -> Status {
    sleuth_kit::error::into_status(&error)
}

impl Handlers {
    async fn load(&self, run_id: &str) -> Result<pb::Run, Status> {
        self.runner
            .describe(run_id)
            .await
            .map_err(internal)?
            .ok_or_else(|| Status::not_found(format!("no run {run_id:?}")))
    }
}

#[tonic::async_trait]
impl RolloutOrchestrator for Handlers {
    async fn create_run(&self, request: Request<pb::CreateRunRequest>) -> Result<Response<pb::Run>, Status> {
        let request = request.into_inner();
        let spec = request.spec.ok_or_else(|| Status::invalid_argument("spec is required"))?;
        // It reads the task sets: blocking file I/O, off the runtime.
        let (checked, roots) = (spec.clone(), self.runner.evaluator.task_roots.clone());
        tokio::task::spawn_blocking(move || spec::validate(&checked, &roots))
            .await
            .map_err(|e| Status::internal(format!("checking the spec stopped: {e}")))?
            .map_err(Status::invalid_argument)?;
        scoring::Scorer::of_spec(spec.reward.as_ref(), self.runner.evaluator.judge.as_ref())
            .map_err(|e| Status::invalid_argument(format!("spec.reward.{e}")))?;
        let run_id = if request.run_id.is_empty() {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            format!("run-{nanos:x}")
        } else {
            request.run_id
        };
        sleuth_kit::names::check_name("run_id", &run_id).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if let Some(source) = spec.policy.as_ref().map(|p| p.from_run.as_str()).filter(|s| !s.is_empty()) {
            let refused = |why: &str| Status::failed_precondition(format!("spec.policy.from_run {source:?}: {why}"));
            match self.runner.state.run(source).await.map_err(internal)? {
                _ if source == run_id => {
                    return Err(Status::invalid_argument("spec.policy.from_run names the run itself"));
                }
                None => return Err(refused("no such run")),
                Some(run) if matches!(run.status(), pb::RunStatus::Pending | pb::RunStatus::Running) => {
                    return Err(refused("the run is still training; start from it once it has ended"));
                }
                Some(_) => {}
            }
        }
        if self.runner.state.create(&run_id, &spec).await.map_err(internal)? {
            tracing::info!(run = %run_id, "run created");
            self.runner.start(run_id.clone(), spec);
        } else if let Some(existing) = self.runner.state.run(&run_id).await.map_err(internal)?
            && existing.status == pb::RunStatus::Failed as i32
        {
            // A failed run resumes where it stopped: published groups are skipped.
            if existing.spec.as_ref() != Some(&spec) {
                return Err(Status::failed_precondition(format!(
                    "run {run_id:?} failed with another spec; resume it with the same spec, or create a new run"
                )));
            }
            // Only the caller that moves it out of Failed drives it: two
            // resumes at once must not start two drivers.
            if self
                .runner
                .state
                .transition(&run_id, pb::RunStatus::Failed, pb::RunStatus::Running, "")
                .await
                .map_err(internal)?
            {
                tracing::info!(run = %run_id, reason = %existing.status_detail, "failed run resumed");
                self.runner.start(run_id.clone(), spec);
            }
        }
        Ok(Response::new(self.load(&run_id).await?))
    }

    async fn get_run(&self, request: Request<pb::GetRunRequest>) -> Result<Response<pb::Run>, Status> {
        Ok(Response::new(self.load(&request.into_inner().run_id).await?))
    }

    async fn list_runs(&self, request: Request<pb::ListRunsRequest>) -> Result<Response<pb::ListRunsResponse>, Status> {
        let request = request.into_inner();
        let size = if request.page_size == 0 { 20 } else { request.page_size };
        if size > 100 {
            return Err(Status::invalid_argument(format!("page_size must be 1..=100, got {size}")));
        }
        let offset: i64 = if request.page_token.is_empty() {
            0
        } else {
            request.page_token.parse().map_err(|_| {
                Status::invalid_argument(format!("page_token {:?} is not one of ours", request.page_token))
            })?
        };
        let runs = self.runner.state.runs(offset, i64::from(size) + 1).await.map_err(internal)?;
        let next = if runs.len() > size as usize { (offset + i64::from(size)).to_string() } else { String::new() };
        let mut page = Vec::new();
        for run in runs.into_iter().take(size as usize) {
            page.push(self.load(&run.run_id).await?);
        }
        Ok(Response::new(pb::ListRunsResponse { runs: page, next_page_token: next }))
    }

    async fn cancel_run(&self, request: Request<pb::CancelRunRequest>) -> Result<Response<pb::Run>, Status> {
        let request = request.into_inner();
        self.load(&request.run_id).await?;
        let reason = if request.reason.is_empty() { "cancelled" } else { request.reason.as_str() };
        // Recorded first, then the driver told: a run that ended meanwhile
        // keeps the end it recorded.
        let running = pb::RunStatus::Running;
        if self
            .runner
            .state
            .transition(&request.run_id, running, pb::RunStatus::Cancelled, reason)
            .await
            .map_err(internal)?
        {
            self.runner.cancel(&request.run_id);
        }
        Ok(Response::new(self.load(&request.run_id).await?))
    }

    async fn evaluate(&self, request: Request<pb::EvaluateRequest>) -> Result<Response<pb::Evaluation>, Status> {
        Ok(Response::new(self.evaluator.start(request.into_inner()).await?))
    }

    async fn get_evaluation(
        &self,
        request: Request<pb::GetEvaluationRequest>,
    ) -> Result<Response<pb::Evaluation>, Status> {
        let id = request.into_inner().evaluation_id;
        match self.evaluator.get(&id) {
            Ok(Some(job)) => Ok(Response::new(job)),
            Ok(None) => Err(Status::not_found(format!(
                "no evaluation {id:?} (a job that was running when the orchestrator stopped is not kept)"
            ))),
            Err(why) => Err(Status::invalid_argument(why)),
        }
    }

    async fn watch_run(
        &self,
        request: Request<pb::WatchRunRequest>,
    ) -> Result<Response<tonic::codegen::BoxStream<pb::RunEvent>>, Status> {
        let run_id = request.into_inner().run_id;
        self.load(&run_id).await?;
        let handlers = self.clone();
        let mut episodes = self.runner.subscribe(&run_id);
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            let at = || {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                Some(prost_types::Timestamp { seconds: now.as_secs() as i64, nanos: now.subsec_nanos() as i32 })
            };
            loop {
                // Episodes finished since the last look, then the progress.
                if let Some(receiver) = episodes.as_mut() {
                    while let Ok(summary) = receiver.try_recv() {
                        let event = pb::RunEvent { at: at(), event: Some(pb::run_event::Event::Episode(summary)) };
                        if tx.send(Ok(event)).await.is_err() {
                            return;
                        }
                    }
                }
                let run = match handlers.load(&run_id).await {
                    Ok(run) => run,
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
                let progress = run.progress.unwrap_or_default();
                if tx
                    .send(Ok(pb::RunEvent { at: at(), event: Some(pb::run_event::Event::Progress(progress)) }))
                    .await
                    .is_err()
                {
                    return;
                }
                if run.status != pb::RunStatus::Running as i32 {
                    let _ = tx
                        .send(Ok(pb::RunEvent { at: at(), event: Some(pb::run_event::Event::Status(run.status)) }))
                        .await;
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

/// Serves the rollout-orchestrator on `listener` until `shutdown` resolves,
/// resuming the runs it was driving before.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    // Before any client is made: every mesh call of this process uses it.
    sleuth_kit::tls::install(&config.serve.tls)?;
    let database = Database::open(&config.database.database_url)?;
    let redis = RedisStore::from_args(&config.redis)?;
    redis.warn_unless_durable();
    let token = config.serve.bearer_token()?;
    let state = state::State::open(database.clone()).await?;
    let workers = workers::Workers::new(
        &config.agent_workers,
        token.as_ref(),
        config.fault_patience,
        config.tickets.key(&config.serve)?,
    )?;
    workers.follow(sleuth_discovery::discover("agent_workers", &config.agent_workers).await?);
    let tools = match &config.tool_gateway {
        Some(address) => {
            Some(sleuth_kit::sized!(sleuth_proto::tools::v1::tool_gateway_client::ToolGatewayClient::new(
                sleuth_kit::client::connect_lazy(address, token.as_ref())?,
            )))
        }
        None => None,
    };
    let evaluator = evaluate::Evaluator {
        tools,
        workers: workers.clone(),
        report_dir: config.report_dir.clone(),
        jobs: jobs::Jobs::new(config.report_dir.clone()),
        task_roots: sleuth_store::LocalRoots { roots: config.task_roots.clone(), setting: tasks::ROOTS_SETTING },
        judge: judge::Judge::from_args(&config.judge)
            .map_err(|message| KitError::Config { field: "judge", message })?,
    };
    let runner = Runner::new(state.clone(), redis.clone(), workers, evaluator.clone(), config.fault_patience);
    let shutdown = sleuth_kit::shutdown::Shared::new(shutdown);
    let pages = TcpListener::bind(config.http_listen).await.map_err(|e| KitError::Config {
        field: "http_listen",
        message: format!("cannot listen on {}: {e}", config.http_listen),
    })?;
    let pages_addr = pages.local_addr().map_err(|e| KitError::Config {
        field: "http_listen",
        message: format!("the listener has no local address: {e}"),
    })?;
    // The dashboard checks the same token: open only where gRPC may be.
    config.serve.token_for(pages_addr)?;
    let dashboard =
        dashboard::Dashboard::new(runner.clone(), database.clone(), config.report_dir.clone(), config.model);
    let dashboard = sleuth_kit::tls::serve_http(pages, dashboard.router(token.clone()), shutdown.wait());
    tracing::info!(addr = %pages_addr, "dashboard listening");
    tokio::spawn(async move {
        if let Err(error) = dashboard.await {
            tracing::error!(%error, "dashboard server failed");
        }
    });
    for run in state.unfinished().await? {
        if let Some(spec) = run.spec {
            tracing::info!(run = %run.run_id, "resuming run");
            runner.start(run.run_id, spec);
        }
    }
    let service = GrpcService::new(sleuth_kit::sized!(RolloutOrchestratorServer::new(Handlers { runner, evaluator })))
        .with_probe(database.probe())
        .with_probe(redis.probe())
        // Evaluate starts episodes and reads a collection's files on this host.
        .with_scope(
            &["CreateRun", "CancelRun", "Evaluate"],
            config.admin.token()?,
            sleuth_kit::AdminTokenArgs::SETTING,
        );
    sleuth_kit::serve(service, &config.serve, listener, shutdown.wait()).await?;
    Ok(())
}
