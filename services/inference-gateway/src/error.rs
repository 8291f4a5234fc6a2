//! The inference gateway's errors and their gRPC codes.

use sleuth_kit::{ErrorKind, KitError, ServiceError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    /// The conversation no longer matches the recorded tokens and the gateway is set to fail.
    #[error("episode {episode}: {message}")]
    Drift { episode: String, message: String },
    /// The policy server failed; nothing of this turn was recorded.
    #[error("policy server: {0}")]
    Policy(tonic::Status),
    /// The trace could not be written after retries: the episode must fail, not train on a gap.
    #[error("episode {episode}: trace not saved after {attempts} attempts: {message}")]
    TraceLost { episode: String, attempts: u32, message: String },
    #[error("{0}")]
    Internal(String),
    #[error(transparent)]
    Chat(#[from] sleuth_chat::ChatError),
    #[error(transparent)]
    Store(#[from] sleuth_store::StoreError),
    #[error(transparent)]
    Kit(#[from] KitError),
}

impl ServiceError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::NotFound(_) => ErrorKind::NotFound,
            Error::Drift { .. } => ErrorKind::FailedPrecondition,
            Error::Policy(status) if status.code() == tonic::Code::InvalidArgument => ErrorKind::InvalidArgument,
            Error::Policy(status) if status.code() == tonic::Code::ResourceExhausted => {
                ErrorKind::ResourceExhausted { retry_after: std::time::Duration::from_millis(500) }
            }
            Error::Policy(_) | Error::TraceLost { .. } => ErrorKind::Unavailable,
            Error::Chat(sleuth_chat::ChatError::Template(_)) => ErrorKind::InvalidArgument,
            Error::Internal(_) | Error::Chat(_) => ErrorKind::Internal,
            Error::Store(error) => error.kind(),
            Error::Kit(error) => error.kind(),
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(error: Error) -> Self {
        sleuth_kit::error::into_status(&error)
    }
}
