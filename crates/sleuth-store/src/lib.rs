//! Connections to the stateful parts of the mesh, shared by the services that
//! need them: Redis (trajectory streams, episode traces), SQL (run state:
//! SQLite locally, PostgreSQL on Kubernetes) and object storage (indexes and
//! checkpoints: a local directory or S3).
//!
//! Each connection can be turned into a readiness [`sleuth_kit::Probe`], so a
//! service reports NOT_SERVING until its stores answer.

pub mod lease;
pub mod object;
pub mod redis;
pub mod retry;
pub mod roots;
pub mod sql;
pub mod trajectories;

pub use object::{ObjectStore, S3Args};
pub use redis::{RedisArgs, RedisStore};
pub use retry::patiently;
pub use roots::LocalRoots;
pub use sql::{Database, DatabaseArgs};

/// Errors of every store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid {field} {value:?}: {message}")]
    InvalidUrl { field: &'static str, value: String, message: String },
    #[error("redis at {url}")]
    Redis {
        url: String,
        #[source]
        source: ::redis::RedisError,
    },
    #[error("database at {url}")]
    Sql {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    /// Another process took a lease this one held (it expired while this
    /// one was stuck): this one must stop acting in the lease's name.
    #[error(
        "lease {key} lost: {holder} held it, {now} holds it now; another process does this work now, so this one stops"
    )]
    LeaseLost { key: String, holder: String, now: String },
    /// The schema could not be brought to this build's version.
    #[error("migrating the database at {url} to schema version {version}: {message}")]
    Migrate { url: String, version: i64, message: String },
    #[error("object {key:?} not found in {store}")]
    ObjectNotFound { store: String, key: String },
    #[error("object store {store}: {message}")]
    Object { store: String, message: String },
    /// An object larger than its reader allows (see `ObjectStore::download`).
    #[error("object {key:?} in {store} is larger than the {limit} bytes allowed for it")]
    TooLarge { store: String, key: String, limit: u64 },
    /// A caller named a local path outside the directories it may use.
    #[error("{uri:?} {message}: a request may only name local paths inside {setting}")]
    Outside { uri: String, setting: &'static str, message: String },
    #[error("object store {store}")]
    Io {
        store: String,
        #[source]
        source: std::io::Error,
    },
}

impl sleuth_kit::ServiceError for StoreError {
    fn kind(&self) -> sleuth_kit::ErrorKind {
        use sleuth_kit::ErrorKind;
        match self {
            StoreError::InvalidUrl { .. } | StoreError::TooLarge { .. } => ErrorKind::InvalidArgument,
            StoreError::ObjectNotFound { .. } => ErrorKind::NotFound,
            StoreError::Redis { .. } | StoreError::Sql { .. } | StoreError::Object { .. } => ErrorKind::Unavailable,
            StoreError::Outside { .. } => ErrorKind::PermissionDenied,
            StoreError::Migrate { .. } => ErrorKind::FailedPrecondition,
            StoreError::LeaseLost { .. } => ErrorKind::Aborted,
            StoreError::Io { .. } => ErrorKind::Internal,
        }
    }
}

/// `url` with any password replaced, for logs and error messages.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        Ok(_) => url.to_owned(),
        Err(_) => "<unparseable url>".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(redact_url("redis://:hunter2@cache:6379/0"), "redis://:***@cache:6379/0");
        assert_eq!(redact_url("postgres://app:hunter2@db/runs"), "postgres://app:***@db/runs");
        assert_eq!(redact_url("sqlite://runs.db"), "sqlite://runs.db");
        assert!(!redact_url("not a url hunter2").contains("hunter2"));
    }
}
