//! `sleuth health`: is every service of the mesh up and ready?

use std::time::{Duration, Instant};

use sleuth_kit::BearerToken;
use sleuth_proto::{agent, inference, learner, policy, rollout, tools};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

#[derive(clap::Args, Debug)]
pub struct HealthArgs {
    /// Rollout orchestrator address (host:port).
    #[arg(long, env = "SLEUTH_ORCHESTRATOR", default_value = "127.0.0.1:50051")]
    orchestrator: String,
    /// Agent worker address.
    #[arg(long, env = "SLEUTH_AGENT", default_value = "127.0.0.1:50052")]
    agent: String,
    /// Tool gateway address.
    #[arg(long, env = "SLEUTH_TOOL_GATEWAY", default_value = "127.0.0.1:50053")]
    tool_gateway: String,
    /// Inference gateway address.
    #[arg(long, env = "SLEUTH_INFERENCE_GATEWAY", default_value = "127.0.0.1:50054")]
    inference_gateway: String,
    /// Policy server address.
    #[arg(long, env = "SLEUTH_POLICY_SERVER", default_value = "127.0.0.1:50055")]
    policy_server: String,
    /// Learner address.
    #[arg(long, env = "SLEUTH_LEARNER", default_value = "127.0.0.1:50056")]
    learner: String,
    /// Keep checking until every service is SERVING or this much time has passed (e.g. 60s).
    #[arg(long, value_parser = humantime::parse_duration)]
    wait: Option<Duration>,
    /// Bearer token, for meshes with authentication on (health itself needs none).
    #[arg(long, env = "SLEUTH_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<BearerToken>,
    /// A service not to check, by name (repeatable): e.g. `learner` on a
    /// mesh whose learner starts with its run.
    #[arg(long, value_parser = ["rollout-orchestrator", "agent", "tool-gateway", "inference-gateway", "policy-server", "learner"])]
    skip: Vec<String>,
    /// The only service to check, by name (repeatable): a pod's readiness
    /// probe where kubelet's own gRPC probe cannot speak the mesh's TLS.
    #[arg(long, conflicts_with = "skip", value_parser = ["rollout-orchestrator", "agent", "tool-gateway", "inference-gateway", "policy-server", "learner"])]
    only: Vec<String>,
}

/// One row of the table.
struct Check {
    service: &'static str,
    endpoint: String,
    status: String,
    latency: Option<Duration>,
}

impl Check {
    fn serving(&self) -> bool {
        self.status == "SERVING"
    }
}

/// Prints the health table; true when every service is SERVING.
pub async fn run(args: HealthArgs) -> anyhow::Result<bool> {
    let targets = [
        ("rollout-orchestrator", &args.orchestrator, rollout::v1::rollout_orchestrator_server::SERVICE_NAME),
        ("agent", &args.agent, agent::v1::agent_server::SERVICE_NAME),
        ("tool-gateway", &args.tool_gateway, tools::v1::tool_gateway_server::SERVICE_NAME),
        ("inference-gateway", &args.inference_gateway, inference::v1::inference_gateway_server::SERVICE_NAME),
        ("policy-server", &args.policy_server, policy::v1::policy_server_server::SERVICE_NAME),
        ("learner", &args.learner, learner::v1::learner_server::SERVICE_NAME),
    ];
    let checked = |service: &str| {
        !args.skip.iter().any(|s| s == service) && (args.only.is_empty() || args.only.iter().any(|s| s == service))
    };
    let targets: Vec<_> = targets.into_iter().filter(|(service, ..)| checked(service)).collect();
    let deadline = args.wait.map(|wait| Instant::now() + wait);
    loop {
        let checks = futures::future::join_all(
            targets
                .iter()
                .map(|(service, endpoint, grpc_name)| check(service, endpoint, grpc_name, args.auth_token.as_ref())),
        )
        .await;
        let healthy = checks.iter().all(Check::serving);
        let waiting = deadline.is_some_and(|deadline| Instant::now() < deadline);
        if healthy || !waiting {
            print_table(&checks);
            return Ok(healthy);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn check(service: &'static str, endpoint: &str, grpc_name: &str, token: Option<&BearerToken>) -> Check {
    let started = Instant::now();
    let status = match sleuth_kit::client::connect(endpoint, token, Duration::from_secs(2)).await {
        Err(error) => format!("UNREACHABLE ({})", root_cause(&error)),
        Ok(channel) => {
            let request = HealthCheckRequest { service: grpc_name.to_owned() };
            match tokio::time::timeout(Duration::from_secs(3), HealthClient::new(channel).check(request)).await {
                Err(_) => "TIMEOUT".to_owned(),
                Ok(Err(status)) => format!("ERROR ({:?}: {})", status.code(), status.message()),
                Ok(Ok(response)) => match response.into_inner().status() {
                    ServingStatus::Serving => "SERVING".to_owned(),
                    ServingStatus::NotServing => "NOT_SERVING".to_owned(),
                    other => other.as_str_name().to_owned(),
                },
            }
        }
    };
    Check {
        service,
        endpoint: endpoint.to_owned(),
        latency: Some(started.elapsed()).filter(|_| status == "SERVING"),
        status,
    }
}

fn root_cause(error: &dyn std::error::Error) -> String {
    let mut cause = error;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}

fn print_table(checks: &[Check]) {
    let endpoint_width = checks.iter().map(|c| c.endpoint.len()).max().unwrap_or(8).max(8);
    println!("{:<22} {:<endpoint_width$} {:>9}  STATUS", "SERVICE", "ENDPOINT", "LATENCY");
    for check in checks {
        let latency =
            check.latency.map(|l| format!("{:.1} ms", l.as_secs_f64() * 1e3)).unwrap_or_else(|| "-".to_owned());
        println!("{:<22} {:<endpoint_width$} {:>9}  {}", check.service, check.endpoint, latency, check.status);
    }
}
