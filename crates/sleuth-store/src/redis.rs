//! Redis: trajectory streams and episode traces.

use std::sync::Arc;

use futures::FutureExt;
use redis::aio::ConnectionManager;

use crate::{StoreError, redact_url};

/// A shared, reconnecting Redis connection.
#[derive(Clone)]
pub struct RedisStore {
    url: String,
    connection: ConnectionManager,
}

impl RedisStore {
    /// Connects to `url` (`redis://[:password@]host:port[/db]`) and checks it answers.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let redacted = redact_url(url);
        let client = redis::Client::open(url).map_err(|error| StoreError::InvalidUrl {
            field: "redis_url",
            value: redacted.clone(),
            message: error.to_string(),
        })?;
        let connection = ConnectionManager::new(client)
            .await
            .map_err(|source| StoreError::Redis { url: redacted.clone(), source })?;
        let store = Self { url: redacted, connection };
        store.ping().await?;
        Ok(store)
    }

    /// A connection handle; clones share one multiplexed connection.
    pub fn connection(&self) -> ConnectionManager {
        self.connection.clone()
    }

    /// The URL with its password redacted.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        redis::cmd("PING")
            .query_async::<String>(&mut connection)
            .await
            .map(drop)
            .map_err(|source| StoreError::Redis { url: self.url.clone(), source })
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
