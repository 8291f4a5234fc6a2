//! The policy server's errors and their gRPC codes.

use sleuth_kit::{ErrorKind, KitError, ServiceError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is wrong; the message names the field and value.
    #[error("{0}")]
    InvalidArgument(String),
    /// Weights of the served run that are not newer than the served ones (or version 0).
    #[error("weights version {offered} is not newer than the served version {served} of the same run")]
    StaleVersion { offered: u64, served: u64 },
    /// The request needs other weights than those served: newer, or another
    /// run's (see `GenerateRequest.min_policy_version` and `run_id`).
    #[error("serves {serving}; the request needs {needed}")]
    Behind { serving: String, needed: String },
    #[error("overloaded: {0}")]
    Overloaded(String),
    #[error("{0}")]
    Internal(String),
    /// The scheduler thread stopped: this replica generates nothing until restarted.
    #[error("{0}; this replica serves nothing until restarted")]
    SchedulerDown(String),
    #[error(transparent)]
    Model(#[from] sleuth_model::ModelError),
    #[error(transparent)]
    Torch(#[from] sleuth_torch::TorchError),
    #[error(transparent)]
    Kit(#[from] KitError),
    /// A checkpoint path outside the configured roots, or another store failure.
    #[error(transparent)]
    Store(#[from] sleuth_store::StoreError),
}

impl ServiceError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::StaleVersion { .. } | Error::Behind { .. } => ErrorKind::FailedPrecondition,
            Error::Overloaded(_) => ErrorKind::ResourceExhausted { retry_after: std::time::Duration::from_millis(500) },
            Error::Internal(_) => ErrorKind::Internal,
            Error::SchedulerDown(_) => ErrorKind::Unavailable,
            Error::Model(sleuth_model::ModelError::Config { .. } | sleuth_model::ModelError::Weights(_)) => {
                ErrorKind::InvalidArgument
            }
            Error::Model(_) => ErrorKind::Internal,
            Error::Torch(error) => error.kind(),
            Error::Kit(error) => error.kind(),
            Error::Store(error) => error.kind(),
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(error: Error) -> Self {
        sleuth_kit::error::into_status(&error)
    }
}
