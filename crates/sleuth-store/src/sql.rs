//! SQL: run state. SQLite by default (one file, nothing to install), PostgreSQL
//! when configured (Kubernetes), through one sqlx `Any` pool.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use sqlx::any::{AnyPoolOptions, install_default_drivers};
use sqlx::{AnyPool, Row};

use crate::redis::error_source;
use crate::{StoreError, redact_url};

/// Where the run-state database is.
#[derive(clap::Args, Debug, Clone)]
pub struct DatabaseArgs {
    /// sqlite://path/to/file.db (created if missing) or postgres://user:password@host:port/db.
    #[arg(long, env = "SLEUTH_DATABASE_URL", default_value = "sqlite://sleuth.db", hide_env_values = true)]
    pub database_url: String,
}

/// Which SQL engine a database URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
}

/// A pool of connections to the run-state database.
#[derive(Clone)]
pub struct Database {
    url: String,
    engine: Engine,
    pool: AnyPool,
}

impl Database {
    /// Opens a pool for `url` without connecting yet: `sqlite://path/to/runs.db`
    /// (created if missing) or `postgres://user:password@host:port/db`.
    pub fn open(url: &str) -> Result<Self, StoreError> {
        let redacted = redact_url(url);
        let engine = if url.starts_with("sqlite:") {
            Engine::Sqlite
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Engine::Postgres
        } else {
            return Err(StoreError::InvalidUrl {
                field: "database_url",
                value: redacted,
                message: "must start with sqlite:// or postgres://".to_owned(),
            });
        };
        install_default_drivers();
        let url_with_create = match engine {
            Engine::Sqlite if !url.contains("mode=") => {
                format!("{url}{}mode=rwc", if url.contains('?') { '&' } else { '?' })
            }
            _ => url.to_owned(),
        };
        let pool = AnyPoolOptions::new()
            .max_connections(match engine {
                // SQLite serialises writers anyway; more connections only add lock contention.
                Engine::Sqlite => 4,
                Engine::Postgres => 16,
            })
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy(&url_with_create)
            .map_err(|error| StoreError::InvalidUrl {
                field: "database_url",
                value: redacted.clone(),
                message: error.to_string(),
            })?;
        Ok(Self { url: redacted, engine, pool })
    }

    /// Opens `url` and checks that the database answers.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let database = Self::open(url)?;
        database.ping().await?;
        Ok(database)
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// The URL with its password redacted.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Runs `SELECT 1`.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let row = sqlx::query("SELECT 1")
            .fetch_one(&self.pool)
            .await
            .map_err(|source| StoreError::Sql { url: self.url.clone(), source })?;
        let one: i32 = row.try_get(0).map_err(|source| StoreError::Sql { url: self.url.clone(), source })?;
        debug_assert_eq!(one, 1);
        Ok(())
    }

    /// Readiness probe: the database answers a query.
    pub fn probe(&self) -> Arc<dyn sleuth_kit::Probe> {
        let database = self.clone();
        sleuth_kit::health::probe_fn("database", move || {
            let database = database.clone();
            async move { database.ping().await.map_err(|error| format!("{error}: {}", error_source(&error))) }.boxed()
        })
    }
}
