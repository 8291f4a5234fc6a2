//! The inference gateway: the agents' model endpoint. It renders the model's
//! own chat template, sends token ids to a policy server and records, per
//! episode, exactly which tokens the policy saw and produced, with loss masks,
//! logprobs and policy versions, in Redis (token-in/token-out).
//!
//! - [`conversation`] builds each turn's prompt from the recorded tokens;
//! - [`episode`] keeps the traces in Redis;
//! - [`handlers`] serves `Chat`, `GetTrace` and `FinishEpisode`;
//! - [`openai`] serves the same turns as OpenAI-compatible HTTP;
//! - [`tickets`] decides who may act on an episode.
//!
//! - [`routing`] keeps each episode on one policy-server replica, with failover;
//! - [`metrics`] counts turns, tokens, drift, malformed calls, per-replica load
//!   and the latency the gateway adds.
//!
//! Replicas come from a tower `Discover` stream (a static list today).

pub mod conversation;
pub mod episode;
pub mod error;
pub mod handlers;
pub mod metrics;
pub mod openai;
pub mod routing;
pub mod tickets;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use sleuth_kit::{AdminTokenArgs, GrpcService, ServeArgs, TelemetryArgs, TicketKeyArgs};
use sleuth_proto::inference::v1::inference_gateway_server::InferenceGatewayServer;
use sleuth_store::{RedisArgs, RedisStore};
use tokio::net::TcpListener;

pub use error::Error;

use crate::handlers::{Handlers, OnDrift};

/// Configuration, from flags or `SLEUTH_*` environment variables.
#[derive(clap::Parser, Debug, Clone)]
#[command(
    name = "inference-gateway",
    version,
    about = "The agents' model endpoint: chat templates, routing and exact token traces."
)]
pub struct Config {
    /// Address to listen on for gRPC.
    #[arg(long, env = "SLEUTH_LISTEN", default_value = "0.0.0.0:50054")]
    pub listen: SocketAddr,

    #[command(flatten)]
    pub redis: RedisArgs,

    /// Policy-server replicas, comma separated: `host:port`, or
    /// `kube://SERVICE[.NAMESPACE]:PORT` for a Kubernetes Service's ready
    /// pods, followed as they come and go; each episode sticks to one.
    #[arg(long, env = "SLEUTH_POLICY_SERVERS", value_delimiter = ',', default_value = "127.0.0.1:50055")]
    pub policy_servers: Vec<String>,

    /// Longest a policy replica may take for one turn (queueing included)
    /// before the turn fails with UNAVAILABLE (not retried elsewhere).
    #[arg(long, env = "SLEUTH_POLICY_TIMEOUT", default_value = "5m", value_parser = humantime::parse_duration)]
    pub policy_timeout: Duration,

    /// The served model's directory, for its chat template and tokenizer.
    /// Default: the SmolLM2-135M-Instruct that `make setup` imports.
    #[arg(long, env = "SLEUTH_MODEL")]
    pub model: Option<PathBuf>,

    /// Address for the OpenAI-compatible HTTP endpoint (/v1/chat/completions).
    #[arg(long, env = "SLEUTH_HTTP_LISTEN", default_value = "0.0.0.0:8080")]
    pub http_listen: SocketAddr,

    /// How long an episode's trace is kept after its last turn.
    #[arg(long, env = "SLEUTH_TRACE_TTL", default_value = "24h", value_parser = humantime::parse_duration)]
    pub trace_ttl: Duration,

    /// When the conversation no longer re-renders to the recorded tokens: keep the
    /// recorded tokens (counted as drift) or fail the turn.
    #[arg(long, env = "SLEUTH_ON_DRIFT", value_enum, default_value = "keep")]
    pub on_drift: OnDrift,

    #[command(flatten)]
    pub serve: ServeArgs,

    /// Checks the episode tickets the orchestrator issues (see [`tickets`]).
    #[command(flatten)]
    pub tickets: TicketKeyArgs,

    /// Opens any episode's turns and trace, ticket or not (an operator's reach).
    #[command(flatten)]
    pub admin: AdminTokenArgs,

    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// Serves the inference gateway on `listener` until `shutdown` resolves.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    // Before any client is made: every mesh call of this process uses it.
    sleuth_kit::tls::install(&config.serve.tls)?;
    let token = config.serve.bearer_token()?;
    let redis = RedisStore::from_args(&config.redis)?;
    redis.warn_unless_durable();
    let model = config.model.clone().unwrap_or_else(sleuth_kit::config::default_model_dir);
    let renderer = conversation::Renderer::load(&model)?;
    if config.policy_servers.is_empty() {
        return Err(Error::InvalidArgument("policy_servers must name at least one replica".to_owned()));
    }
    let policy = routing::Replicas::empty(token.as_ref(), config.policy_timeout)
        .discover(sleuth_discovery::discover("policy_servers", &config.policy_servers).await?);
    let handlers = std::sync::Arc::new(Handlers {
        renderer,
        traces: episode::TraceStore::new(redis.clone(), config.trace_ttl),
        policy,
        runs: redis.clone(),
        on_drift: config.on_drift,
        tickets: tickets::Tickets::new(config.tickets.key(&config.serve)?, config.admin.token()?),
    });
    let http = TcpListener::bind(config.http_listen).await.map_err(|e| {
        Error::InvalidArgument(format!("cannot listen for HTTP on http_listen {}: {e}", config.http_listen))
    })?;
    let http_addr = http.local_addr().map_err(|e| Error::Internal(e.to_string()))?;
    // The OpenAI door checks the same token: open only where gRPC may be.
    config.serve.token_for(http_addr)?;
    tracing::info!(addr = %http_addr, "openai-compatible http listening");
    // One shutdown signal for both front doors.
    let shutdown = sleuth_kit::shutdown::Shared::new(shutdown);
    let router = openai::router(handlers.clone(), token.clone(), &config.serve);
    let http_server = sleuth_kit::tls::serve_http(http, router, shutdown.wait());
    tokio::spawn(async move {
        if let Err(error) = http_server.await {
            tracing::error!(%error, "http server failed");
        }
    });
    let mut service =
        GrpcService::new(sleuth_kit::sized!(InferenceGatewayServer::from_arc(handlers))).with_probe(redis.probe());
    // Fixed replicas must answer before the gateway serves; discovered ones
    // are ready endpoints already.
    for address in config.policy_servers.iter().filter(|a| !a.starts_with("kube://")) {
        service = service.with_probe(sleuth_kit::client::upstream_probe(
            "policy-server",
            address,
            sleuth_proto::policy::v1::policy_server_server::SERVICE_NAME,
            token.as_ref(),
        )?);
    }
    sleuth_kit::serve(service, &config.serve, listener, shutdown.wait()).await?;
    Ok(())
}
