//! The inference gateway's errors and their gRPC codes.

use sleuth_kit::{ErrorKind, KitError, ServiceError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    /// The caller may not act on the episode (see [`crate::tickets`]).
    #[error("{0}")]
    Denied(String),
    /// The conversation no longer matches the recorded tokens and the gateway is set to fail.
    #[error("episode {episode}: {message}")]
    Drift { episode: String, message: String },
    /// The policy server failed; nothing of this turn was recorded.
    #[error("policy server: {0}")]
    Policy(tonic::Status),
    /// The trace could not be written after retries: the episode must fail, not train on a gap.
    #[error("episode {episode}: trace not saved after {attempts} attempts: {message}")]
    TraceLost { episode: String, attempts: u32, message: String },
    /// Another turn of the episode was recorded since this one read the trace:
    /// this turn's tokens are not recorded (they would overwrite the other's).
    #[error(
        "episode {episode}: another turn was recorded while this one ran (turns of one episode run one at a time); nothing of this turn was recorded"
    )]
    ConcurrentTurn { episode: String },
    /// The caller continues an episode whose trace is gone.
    #[error(
        "episode {episode} continues, but its trace is gone: it expired (SLEUTH_TRACE_TTL after its last activity) or the episode began elsewhere; its tokens cannot be recorded, so start a new episode"
    )]
    TraceGone { episode: String },
    /// The caller's count of turns disagrees with the trace's.
    #[error(
        "episode {episode}: turns_before is {turns_before} but the trace holds {recorded} turns (a concurrent or replayed turn); nothing of this turn was recorded"
    )]
    TurnsDisagree { episode: String, turns_before: u32, recorded: u32 },
    #[error("{0}")]
    Internal(String),
    #[error(transparent)]
    Chat(#[from] sleuth_chat::ChatError),
    #[error(transparent)]
    Store(#[from] sleuth_store::StoreError),
    #[error(transparent)]
    Kit(#[from] KitError),
    #[error(transparent)]
    Discovery(#[from] sleuth_discovery::DiscoveryError),
}

impl ServiceError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::NotFound(_) => ErrorKind::NotFound,
            Error::Denied(_) => ErrorKind::PermissionDenied,
            Error::Drift { .. } | Error::TraceGone { .. } => ErrorKind::FailedPrecondition,
            Error::ConcurrentTurn { .. } | Error::TurnsDisagree { .. } => ErrorKind::Aborted,
            Error::Policy(status) if status.code() == tonic::Code::InvalidArgument => ErrorKind::InvalidArgument,
            Error::Policy(status) if status.code() == tonic::Code::ResourceExhausted => {
                ErrorKind::ResourceExhausted { retry_after: std::time::Duration::from_millis(500) }
            }
            Error::Policy(_) | Error::TraceLost { .. } => ErrorKind::Unavailable,
            Error::Chat(sleuth_chat::ChatError::Template(_)) => ErrorKind::InvalidArgument,
            Error::Internal(_) | Error::Chat(_) => ErrorKind::Internal,
            Error::Store(error) => error.kind(),
            Error::Kit(error) => error.kind(),
            Error::Discovery(error) => error.kind(),
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(error: Error) -> Self {
        sleuth_kit::error::into_status(&error)
    }
}
