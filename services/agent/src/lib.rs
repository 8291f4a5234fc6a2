//! Agent workers: run the multi-turn search-agent loop for many episodes at
//! once against the inference gateway and the tool gateway.
//!
//! - [`prompt`]: what the model is told (system prompt, answer tool);
//! - [`episode`]: the loop of one episode, its budgets and outcomes (its
//!   tool calls run in `calls`);
//! - [`teacher`]: scripted strategies that reply instead of the policy (SFT data);
//! - [`model_teacher`]: a model at an OpenAI-compatible endpoint that replies
//!   instead of the policy (distillation data);
//! - [`ticket`]: the ticket an episode runs under at the inference gateway.

pub mod budget;
mod calls;
pub mod episode;
pub mod model_teacher;
pub mod prompt;
pub mod teacher;
pub mod ticket;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use sleuth_kit::{ErrorKind, GrpcService, KitError, ServeArgs, ServiceError, TelemetryArgs};
use sleuth_proto::agent::v1::agent_server::{Agent, AgentServer};
use sleuth_proto::agent::v1::{RunEpisodeRequest, RunEpisodeResponse};
use sleuth_proto::inference::v1::inference_gateway_client::InferenceGatewayClient;
use sleuth_proto::tools::v1::tool_gateway_client::ToolGatewayClient;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

/// Configuration, from flags or `SLEUTH_*` environment variables.
#[derive(clap::Parser, Debug, Clone)]
#[command(name = "agent", version, about = "Agent worker: runs multi-turn search-agent episodes.")]
pub struct Config {
    /// Address to listen on for gRPC.
    #[arg(long, env = "SLEUTH_LISTEN", default_value = "0.0.0.0:50052")]
    pub listen: SocketAddr,

    /// Inference gateway the agent's model calls go to: host:port, or
    /// kube://SERVICE[.NAMESPACE]:PORT to spread calls over its ready pods.
    #[arg(long, env = "SLEUTH_INFERENCE_GATEWAY", default_value = "127.0.0.1:50054")]
    pub inference_gateway: String,

    /// Tool gateway the agent's tool calls go to: host:port, or
    /// kube://SERVICE[.NAMESPACE]:PORT to spread calls over its ready pods.
    #[arg(long, env = "SLEUTH_TOOL_GATEWAY", default_value = "127.0.0.1:50053")]
    pub tool_gateway: String,

    /// Longest episode this worker serves. RunEpisode lasts as long as its
    /// episode, so this (not the kit's generic SLEUTH_REQUEST_TIMEOUT) bounds
    /// it; the orchestrator sends each episode a deadline from its budgets
    /// (`budget::Budget::deadline`), which wins when shorter.
    #[arg(long, env = "SLEUTH_EPISODE_TIMEOUT", default_value = "24h", value_parser = humantime::parse_duration)]
    pub episode_timeout: std::time::Duration,

    /// Deadline of each tool call (ListTools, CallTool): a tool gateway that
    /// hangs ends the episode as a tool error instead of holding it.
    #[arg(long, env = "SLEUTH_TOOL_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub tool_timeout: std::time::Duration,

    /// Deadline of each model turn (Chat); longer than the inference
    /// gateway's own SLEUTH_POLICY_TIMEOUT, so its clearer error comes first.
    #[arg(long, env = "SLEUTH_MODEL_TIMEOUT", default_value = "10m", value_parser = humantime::parse_duration)]
    pub model_timeout: std::time::Duration,

    /// Base URL of the OpenAI-compatible endpoint that plays `model:<name>`
    /// teachers (requests go to `<url>/v1/chat/completions`): an inference
    /// gateway's HTTP door in front of a policy-server pool serving the
    /// teacher model, or a hosted endpoint. Unset: episodes asking for a
    /// model teacher end as tool errors that say so.
    #[arg(long, env = "SLEUTH_TEACHER_URL")]
    pub teacher_url: Option<String>,

    /// The bearer token the teacher endpoint expects (from a Secret); unset:
    /// no `authorization` header.
    #[arg(long, env = "SLEUTH_TEACHER_TOKEN", hide_env_values = true)]
    pub teacher_token: Option<sleuth_kit::BearerToken>,

    /// Calls per teacher turn (1 s, 2 s, 4 s, ... apart) before the episode
    /// ends as a model error; each call has SLEUTH_MODEL_TIMEOUT.
    #[arg(long, env = "SLEUTH_TEACHER_ATTEMPTS", default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub teacher_attempts: u32,

    /// Episodes this worker runs at once; more are refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "SLEUTH_MAX_EPISODES", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_episodes: u32,

    #[command(flatten)]
    pub serve: ServeArgs,

    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// Errors that stop the service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Kit(#[from] KitError),
    #[error(transparent)]
    Discovery(#[from] sleuth_discovery::DiscoveryError),
}

impl ServiceError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Kit(error) => error.kind(),
            Error::Discovery(error) => error.kind(),
        }
    }
}

static IN_FLIGHT: std::sync::LazyLock<sleuth_kit::metrics::IntGauge> = std::sync::LazyLock::new(|| {
    sleuth_kit::metrics::gauge("sleuth_agent_episodes_in_flight", "Episodes this worker is running.")
});
static EPISODES: std::sync::LazyLock<sleuth_kit::metrics::IntCounterVec> = std::sync::LazyLock::new(|| {
    sleuth_kit::metrics::counter_vec("sleuth_agent_episodes_total", "Finished episodes by outcome.", &["outcome"])
});

/// The RPC handlers.
#[derive(Clone)]
pub struct Handlers {
    clients: episode::Clients,
    slots: Arc<Semaphore>,
}

#[tonic::async_trait]
impl Agent for Handlers {
    async fn run_episode(&self, request: Request<RunEpisodeRequest>) -> Result<Response<RunEpisodeResponse>, Status> {
        let request = request.into_inner();
        episode::validate(&request).map_err(Status::invalid_argument)?;
        let _slot = self.slots.clone().try_acquire_owned().map_err(|_| {
            let mut status = Status::resource_exhausted("this agent worker runs its maximum number of episodes");
            status.metadata_mut().insert(sleuth_kit::error::RETRY_AFTER_MS, "500".parse().expect("ascii"));
            status
        })?;
        IN_FLIGHT.inc();
        let span = tracing::info_span!(
            "agent_episode",
            run_id = %request.run_id,
            episode_id = %request.episode_id,
            task_id = %request.task.as_ref().map_or("", |t| t.task_id.as_str()),
        );
        let episode = episode::run(&self.clients, &request).instrument(span).await;
        IN_FLIGHT.dec();
        EPISODES.with_label_values(&[sleuth_metrics::reward::outcome_name(episode.outcome())]).inc();
        tracing::info!(
            episode = %episode.episode_id,
            task = %episode.task_id,
            outcome = ?episode.outcome(),
            turns = episode.turns,
            tokens = episode.total_tokens,
            "episode finished"
        );
        Ok(Response::new(RunEpisodeResponse { episode: Some(episode) }))
    }
}

/// The endpoint of model teachers, when `SLEUTH_TEACHER_URL` is set.
fn teacher_endpoint(config: &Config) -> Result<Option<model_teacher::TeacherEndpoint>, KitError> {
    let Some(url) = &config.teacher_url else { return Ok(None) };
    let chat = sleuth_kit::chat_endpoint::ChatEndpoint::new(
        "teacher_url",
        url,
        config.teacher_token.clone(),
        "teacher",
        config.model_timeout,
    )
    .map_err(|message| KitError::Config { field: "teacher_url", message })?;
    Ok(Some(model_teacher::TeacherEndpoint { chat, attempts: config.teacher_attempts }))
}

/// Serves the agent on `listener` until `shutdown` resolves.
pub async fn run(
    mut config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    // Before any client is made: every mesh call of this process uses it.
    sleuth_kit::tls::install(&config.serve.tls)?;
    config.serve.request_timeout = config.serve.request_timeout.max(config.episode_timeout);
    let token = config.serve.bearer_token()?;
    // Both gateways are stateless per call: each call may go to any replica.
    let model =
        sleuth_discovery::balanced_channel("inference_gateway", &config.inference_gateway, token.as_ref()).await?;
    let tools = sleuth_discovery::balanced_channel("tool_gateway", &config.tool_gateway, token.as_ref()).await?;
    let clients = episode::Clients {
        model: sleuth_kit::sized!(InferenceGatewayClient::new(model.clone())),
        tools: sleuth_kit::sized!(ToolGatewayClient::new(tools.clone())),
        tool_timeout: config.tool_timeout,
        model_timeout: config.model_timeout,
        teacher: teacher_endpoint(&config)?,
    };
    let handlers = Handlers { clients, slots: Arc::new(Semaphore::new(config.max_episodes as usize)) };
    let service = GrpcService::new(sleuth_kit::sized!(AgentServer::new(handlers)))
        .with_probe(sleuth_kit::client::upstream_probe_on(
            "inference-gateway",
            &config.inference_gateway,
            model,
            sleuth_proto::inference::v1::inference_gateway_server::SERVICE_NAME,
        ))
        .with_probe(sleuth_kit::client::upstream_probe_on(
            "tool-gateway",
            &config.tool_gateway,
            tools,
            sleuth_proto::tools::v1::tool_gateway_server::SERVICE_NAME,
        ));
    sleuth_kit::serve(service, &config.serve, listener, shutdown).await?;
    Ok(())
}
