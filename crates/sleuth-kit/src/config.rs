//! Command-line and environment configuration shared by every service.
//!
//! Each field is a clap `long` flag and a `SLEUTH_<FIELD>` environment
//! variable, so Helm values map onto environment variables one to one.

use std::path::PathBuf;
use std::time::Duration;

use crate::auth::BearerToken;
use crate::error::KitError;

/// Where `make setup` imports the default policy model (SmolLM2-135M-Instruct):
/// the fallback of every `--model` option (policy server, inference gateway, CLI).
pub fn default_model_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sleuth/models/smollm2-135m-instruct")
}

/// How a service serves gRPC: authentication, limits and shutdown.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Bearer token every RPC except health must carry (`authorization: Bearer <token>`).
    /// Also sent on calls to other services. Unset: the service refuses to
    /// start unless `--insecure` (then on loopback only).
    #[arg(long, env = "SLEUTH_AUTH_TOKEN", hide_env_values = true, conflicts_with = "auth_token_file")]
    pub auth_token: Option<BearerToken>,

    /// File holding the bearer token (a mounted Kubernetes secret); trailing whitespace is ignored.
    #[arg(long, env = "SLEUTH_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,

    /// How long in-flight requests may take to finish after SIGTERM before connections are dropped.
    #[arg(long, env = "SLEUTH_DRAIN_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,

    /// Upper bound on one unary request (a smaller client `grpc-timeout` wins).
    #[arg(long, env = "SLEUTH_REQUEST_TIMEOUT", default_value = "120s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,

    /// Requests handled at once by this process; more are rejected with
    /// `ResourceExhausted` instead of queueing without bound.
    #[arg(long, env = "SLEUTH_MAX_CONCURRENT_REQUESTS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_requests: u32,

    /// Serve without a bearer token, on a loopback address only (a laptop, a
    /// test). Without it a service that has no token refuses to start:
    /// authentication never turns itself off.
    #[arg(long, env = "SLEUTH_INSECURE")]
    pub insecure: bool,

    /// Mutual TLS on this service's listeners and its calls to the mesh.
    #[command(flatten)]
    pub tls: crate::tls::TlsArgs,
}

impl ServeArgs {
    /// The configured bearer token, read from `--auth-token-file` if that is how it was given.
    pub fn bearer_token(&self) -> Result<Option<BearerToken>, KitError> {
        token_from(self.auth_token.as_ref(), self.auth_token_file.as_deref(), "auth_token_file")
    }

    /// The token a listener on `addr` checks. `None` (no authentication)
    /// only with `--insecure` and only on a loopback address: a service
    /// reachable from other hosts never serves unauthenticated.
    pub fn token_for(&self, addr: std::net::SocketAddr) -> Result<Option<BearerToken>, KitError> {
        let token = self.bearer_token()?;
        if token.is_none() {
            if !self.insecure {
                return Err(KitError::Config {
                    field: "auth_token",
                    message: "no SLEUTH_AUTH_TOKEN (or SLEUTH_AUTH_TOKEN_FILE): a service does not serve \
                              unauthenticated; set a token, or SLEUTH_INSECURE=true to serve on loopback only"
                        .into(),
                });
            }
            if !addr.ip().is_loopback() {
                return Err(KitError::Config {
                    field: "insecure",
                    message: format!("without a token a service listens on loopback only, not {addr}"),
                });
            }
        }
        Ok(token)
    }
}

/// A token given directly or as a file (trailing whitespace ignored); errors name `file_field`.
fn token_from(
    token: Option<&BearerToken>,
    file: Option<&std::path::Path>,
    file_field: &'static str,
) -> Result<Option<BearerToken>, KitError> {
    if let Some(token) = token {
        return Ok(Some(token.clone()));
    }
    let Some(path) = file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path).map_err(|source| KitError::Config {
        field: file_field,
        message: format!("cannot read {}: {source}", path.display()),
    })?;
    text.trim_end().parse().map(Some).map_err(|error| KitError::Config {
        field: file_field,
        message: format!("token in {}: {error}", path.display()),
    })
}

/// The weight-publication scope's token: a policy server requires it on
/// `UpdateWeights` and the learner sends it there. Unset: the mesh token
/// opens `UpdateWeights` like every call.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct PublishTokenArgs {
    /// Token that alone opens weight publication (`UpdateWeights`).
    #[arg(long, env = "SLEUTH_PUBLISH_TOKEN", hide_env_values = true, conflicts_with = "publish_token_file")]
    pub publish_token: Option<BearerToken>,

    /// File holding the publication token (a mounted secret).
    #[arg(long, env = "SLEUTH_PUBLISH_TOKEN_FILE")]
    pub publish_token_file: Option<PathBuf>,
}

impl PublishTokenArgs {
    /// The environment variable that sets the token, for errors.
    pub const SETTING: &'static str = "SLEUTH_PUBLISH_TOKEN";

    /// The configured token, read from its file if that is how it was given.
    pub fn token(&self) -> Result<Option<BearerToken>, KitError> {
        token_from(self.publish_token.as_ref(), self.publish_token_file.as_deref(), "publish_token_file")
    }
}

/// The administration scope's token: a tool gateway requires it to create,
/// load, publish and delete collections, an orchestrator to create and cancel
/// runs; the CLI sends it there. Unset: the mesh token opens them.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct AdminTokenArgs {
    /// Token that alone opens administration (collections, creating and cancelling runs).
    #[arg(long, env = "SLEUTH_ADMIN_TOKEN", hide_env_values = true, conflicts_with = "admin_token_file")]
    pub admin_token: Option<BearerToken>,

    /// File holding the administration token (a mounted secret).
    #[arg(long, env = "SLEUTH_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
}

impl AdminTokenArgs {
    /// The environment variable that sets the token, for errors.
    pub const SETTING: &'static str = "SLEUTH_ADMIN_TOKEN";

    /// The configured token, read from its file if that is how it was given.
    pub fn token(&self) -> Result<Option<BearerToken>, KitError> {
        token_from(self.admin_token.as_ref(), self.admin_token_file.as_deref(), "admin_token_file")
    }
}

/// The key episode tickets are signed with (see [`crate::ticket`]): the
/// orchestrator issues tickets with it, the inference gateway checks them.
/// Unset: no tickets, which only `--insecure` allows.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TicketKeyArgs {
    /// Key that signs episode tickets; the orchestrator and the inference gateway must share it.
    #[arg(long, env = "SLEUTH_TICKET_KEY", hide_env_values = true, conflicts_with = "ticket_key_file")]
    pub ticket_key: Option<BearerToken>,

    /// File holding the ticket key (a mounted secret).
    #[arg(long, env = "SLEUTH_TICKET_KEY_FILE")]
    pub ticket_key_file: Option<PathBuf>,
}

impl TicketKeyArgs {
    /// The environment variable that sets the key, for errors.
    pub const SETTING: &'static str = "SLEUTH_TICKET_KEY";

    /// The configured key. None only with `serve.insecure`: a service that
    /// issues or checks tickets never runs without them otherwise.
    pub fn key(&self, serve: &ServeArgs) -> Result<Option<crate::ticket::TicketKey>, KitError> {
        let key = token_from(self.ticket_key.as_ref(), self.ticket_key_file.as_deref(), "ticket_key_file")?;
        if key.is_none() && !serve.insecure {
            return Err(KitError::Config {
                field: "ticket_key",
                message: format!(
                    "{} (or {}_FILE) is unset: episodes would have no tickets, so any holder of the mesh \
                     token could write or read any episode's trace; set it, or pass --insecure on loopback",
                    Self::SETTING,
                    Self::SETTING
                ),
            });
        }
        Ok(key.map(crate::ticket::TicketKey::new))
    }
}

impl Default for ServeArgs {
    fn default() -> Self {
        Self {
            auth_token: None,
            auth_token_file: None,
            drain_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(120),
            max_concurrent_requests: 1024,
            insecure: false,
            tls: crate::tls::TlsArgs::default(),
        }
    }
}

/// Log output format.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Logging and trace export.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TelemetryArgs {
    /// OTLP/gRPC collector endpoint (e.g. http://otel-collector:4317); unset = no trace export.
    #[arg(long, env = "SLEUTH_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// Log filter in `tracing` EnvFilter syntax (e.g. `info,sleuth_kit=debug`).
    #[arg(long, env = "SLEUTH_LOG", default_value = "info")]
    pub log: String,

    /// Log output format.
    #[arg(long, env = "SLEUTH_LOG_FORMAT", value_enum, default_value_t)]
    pub log_format: LogFormat,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_token_from_secret_file_without_trailing_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "s3cret-token\n").unwrap();
        let args = ServeArgs { auth_token_file: Some(path), ..ServeArgs::default() };
        let token = args.bearer_token().unwrap().unwrap();
        assert!(token.matches_header("Bearer s3cret-token"));
    }

    #[test]
    fn missing_token_file_names_the_field_and_path() {
        let args = ServeArgs { auth_token_file: Some("/nonexistent/token".into()), ..ServeArgs::default() };
        let message = args.bearer_token().unwrap_err().to_string();
        assert!(message.contains("auth_token_file"), "{message}");
        assert!(message.contains("/nonexistent/token"), "{message}");
    }

    #[test]
    fn empty_token_file_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "\n").unwrap();
        let args = ServeArgs { auth_token_file: Some(path), ..ServeArgs::default() };
        assert!(args.bearer_token().unwrap_err().to_string().contains("empty"));
    }
}
