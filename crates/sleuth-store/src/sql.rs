//! SQL: run state. SQLite by default (one file, nothing to install), PostgreSQL
//! when configured (Kubernetes), through one sqlx `Any` pool.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use sqlx::any::{AnyPoolOptions, install_default_drivers};
use sqlx::{AnyPool, Row};

use crate::redis::error_source;
use crate::{StoreError, redact_url};

/// The run-state schema's versions (`migrations/`, embedded at build time).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

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

    /// Brings the schema to this build's version, [`MIGRATOR`]'s newest.
    /// Every service that keeps state in SQL calls it at start, so an
    /// upgrade changes existing tables in place, rows kept. PostgreSQL
    /// migrates under an advisory lock, so replicas starting together apply
    /// each migration once; SQLite takes no such lock, and a process that
    /// lost the race to another one finds the migration applied when it
    /// tries again. A SQLite file is first put in WAL mode ([`Database::prepare`]).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let version = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
        let mut attempt = 0;
        loop {
            let error = match self.prepare().await {
                Ok(()) => match MIGRATOR.run(&self.pool).await {
                    Ok(()) => return Ok(()),
                    Err(error) => error,
                },
                Err(source) => sqlx::migrate::MigrateError::Execute(source),
            };
            let message = match &error {
                sqlx::migrate::MigrateError::VersionMissing(newer) => format!(
                    "the database is at schema version {newer}, newer than this build knows; \
                     run the Sleuth release that migrated it, or restore the database from before the upgrade"
                ),
                other => other.to_string(),
            };
            attempt += 1;
            if self.engine != Engine::Sqlite
                || attempt == 3
                || matches!(error, sqlx::migrate::MigrateError::VersionMissing(_))
            {
                return Err(StoreError::Migrate { url: self.url.clone(), version, message });
            }
            tracing::warn!(url = %self.url, %message, "migration failed, trying again (another process may be migrating)");
            tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
        }
    }

    /// Puts a SQLite database in write-ahead-log mode, once (the mode is
    /// kept in the file): the orchestrator and the learner share one file
    /// locally, and in the default rollback mode a reader and a writer in two
    /// processes can fail each other with "database is locked" at once,
    /// without waiting. In WAL mode readers never block the writer, and
    /// writers wait their turn (busy timeout). Nothing to do on PostgreSQL.
    async fn prepare(&self) -> Result<(), sqlx::Error> {
        if self.engine == Engine::Sqlite {
            sqlx::query("PRAGMA journal_mode = WAL").execute(&self.pool).await?;
        }
        Ok(())
    }

    /// The learner's metrics of each recorded step of `run_id` (table
    /// `learner_steps`: every field of its `StepStats` and more, as JSON), in
    /// step order. The learner writes them; its resume logic and the
    /// orchestrator's dashboard read them.
    pub async fn learner_steps(&self, run_id: &str) -> Result<Vec<(u64, serde_json::Value)>, StoreError> {
        let failed = |source| StoreError::Sql { url: self.url.clone(), source };
        let rows = sqlx::query("SELECT step, metrics FROM learner_steps WHERE run_id = $1 ORDER BY step")
            .bind(run_id)
            .fetch_all(&self.pool)
            .await
            .map_err(failed)?;
        rows.iter()
            .map(|row| {
                let step: i64 = row.try_get("step").map_err(failed)?;
                let text: String = row.try_get("metrics").map_err(failed)?;
                Ok((step as u64, serde_json::from_str(&text).unwrap_or_default()))
            })
            .collect()
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
