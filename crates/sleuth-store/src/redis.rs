//! Redis: trajectory streams and episode traces.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::OnceCell;

use crate::{StoreError, redact_url};

/// Where Redis is and, over TLS, whom to trust.
#[derive(clap::Args, Debug, Clone)]
pub struct RedisArgs {
    /// Redis URL: redis://[:password@]host:port[/db], or rediss:// for TLS
    /// (ElastiCache with in-transit encryption, Azure Cache, Memorystore).
    #[arg(long, env = "SLEUTH_REDIS_URL", default_value = "redis://127.0.0.1:6379/0")]
    pub redis_url: String,
    /// PEM file of the certificate authorities a rediss:// server's
    /// certificate must chain to, in place of the system's roots (a private
    /// CA, Memorystore's server CA). Unset: the system's roots.
    #[arg(long, env = "SLEUTH_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,
}

/// A shared, reconnecting Redis connection, opened on first use so a service
/// can start (and report NOT_SERVING) before Redis is up.
#[derive(Clone)]
pub struct RedisStore {
    url: String,
    client: redis::Client,
    connection: Arc<OnceCell<ConnectionManager>>,
}

impl RedisStore {
    /// Validates `url` without connecting; a rediss:// server must present a
    /// certificate the system's roots trust.
    pub fn open(url: &str) -> Result<Self, StoreError> {
        Self::open_trusting(url, None)
    }

    /// Opens what a service's `--redis-*` options name, without connecting.
    pub fn from_args(args: &RedisArgs) -> Result<Self, StoreError> {
        Self::open_trusting(&args.redis_url, args.redis_ca_file.as_deref())
    }

    /// Validates `url`; over TLS, trusts the authorities in `ca_file` (PEM)
    /// instead of the system's roots.
    pub fn open_trusting(url: &str, ca_file: Option<&Path>) -> Result<Self, StoreError> {
        let redacted = redact_url(url);
        let invalid = |field, value: String, message: String| StoreError::InvalidUrl { field, value, message };
        let client = match ca_file {
            None => redis::Client::open(url),
            Some(path) => {
                let shown = path.display().to_string();
                if !url.starts_with("rediss://") {
                    return Err(invalid(
                        "redis_ca_file",
                        shown,
                        format!("a CA file only applies to TLS, but redis_url {redacted:?} is not rediss://"),
                    ));
                }
                let pem = std::fs::read(path)
                    .map_err(|error| invalid("redis_ca_file", shown, format!("cannot read it: {error}")))?;
                redis::Client::build_with_tls(url, redis::TlsCertificates { client_tls: None, root_cert: Some(pem) })
            }
        }
        .map_err(|error| invalid("redis_url", redacted.clone(), error.to_string()))?;
        Ok(Self { url: redacted, client, connection: Arc::default() })
    }

    /// Opens `url` and checks that Redis answers.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let store = Self::open(url)?;
        store.ping().await?;
        Ok(store)
    }

    /// A connection handle; clones share one multiplexed connection that
    /// reconnects by itself after Redis restarts.
    pub async fn connection(&self) -> Result<ConnectionManager, StoreError> {
        // No command blocks server-side (stream reads never BLOCK), so an
        // answer slower than this is a hung server, not a slow command.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(10)))
            .set_number_of_retries(2);
        self.connection
            .get_or_try_init(|| ConnectionManager::new_with_config(self.client.clone(), config))
            .await
            .cloned()
            .map_err(|source| StoreError::Redis { url: self.url.clone(), source })
    }

    /// The URL with its password redacted.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut connection = self.connection().await?;
        redis::cmd("PING")
            .query_async::<String>(&mut connection)
            .await
            .map(drop)
            .map_err(|source| StoreError::Redis { url: self.url.clone(), source })
    }

    /// What in Redis's configuration can lose acknowledged data: Sleuth
    /// acknowledges a trajectory group once Redis has it, so Redis must
    /// write every command to its append-only file before answering
    /// (`appendonly yes`, `appendfsync always`) and never evict a key
    /// (`maxmemory-policy noeviction`: streams and the learner's lease are
    /// keys). Each problem names the setting, its value and what it must be;
    /// an empty list means durable. A server that refuses `CONFIG GET`
    /// (managed services often do) gives one problem saying so.
    pub async fn durability_problems(&self) -> Result<Vec<String>, StoreError> {
        let mut connection = self.connection().await?;
        let mut problems = Vec::new();
        for (setting, required) in
            [("appendonly", "yes"), ("appendfsync", "always"), ("maxmemory-policy", "noeviction")]
        {
            let answer: Result<Vec<String>, _> =
                redis::cmd("CONFIG").arg("GET").arg(setting).query_async(&mut connection).await;
            match answer {
                Ok(pair) => match pair.get(1) {
                    Some(value) if value == required => {}
                    Some(value) => problems.push(format!("{setting} is {value}, must be {required}")),
                    None => problems.push(format!("{setting} is not reported, must be {required}")),
                },
                Err(error) => {
                    problems.push(format!(
                        "CONFIG GET is refused ({error}); check by hand that appendonly is yes, appendfsync always and maxmemory-policy noeviction"
                    ));
                    break;
                }
            }
        }
        Ok(problems)
    }

    /// Checks [`RedisStore::durability_problems`] once Redis answers, in the
    /// background, and logs each problem as a warning naming the setting
    /// (a service must start, and report NOT_SERVING, before Redis is up).
    /// It waits for the service's own first connection (its readiness probe
    /// makes it) rather than connecting itself, so it never holds up the
    /// probe's attempts while Redis is down.
    pub fn warn_unless_durable(&self) {
        let store = self.clone();
        tokio::spawn(async move {
            while !store.connection.initialized() {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            match store.durability_problems().await {
                Ok(problems) => {
                    for problem in problems {
                        tracing::warn!(redis = %store.url, %problem, "Redis can lose acknowledged trajectory groups");
                    }
                }
                Err(error) => tracing::warn!(redis = %store.url, %error, "could not read Redis's persistence settings"),
            }
        });
    }

    /// Readiness probe: Redis answers PING.
    pub fn probe(&self) -> Arc<dyn sleuth_kit::Probe> {
        let store = self.clone();
        sleuth_kit::health::probe_fn("redis", move || {
            let store = store.clone();
            async move { store.ping().await.map_err(|error| format!("{error}: {}", error_source(&error))) }.boxed()
        })
    }
}

pub(crate) fn error_source(error: &dyn std::error::Error) -> String {
    error.source().map(ToString::to_string).unwrap_or_default()
}
