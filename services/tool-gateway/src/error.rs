//! The tool gateway's errors and their gRPC codes.

use std::path::Path;

use sleuth_kit::{ErrorKind, KitError, ServiceError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request (or a tool call's arguments) is wrong; the message names the field and value.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    Internal(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Beir(#[from] sleuth_beir::BeirError),
    #[error("index: {0}")]
    Tantivy(#[from] tantivy::TantivyError),
    #[error(transparent)]
    Store(#[from] sleuth_store::StoreError),
    #[error(transparent)]
    Kit(#[from] KitError),
}

impl Error {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Error::Io { path: path.display().to_string(), source }
    }
}

impl From<tantivy::directory::error::OpenDirectoryError> for Error {
    fn from(error: tantivy::directory::error::OpenDirectoryError) -> Self {
        Error::Tantivy(error.into())
    }
}

impl ServiceError for Error {
    fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::NotFound(_) => ErrorKind::NotFound,
            Error::AlreadyExists(_) => ErrorKind::AlreadyExists,
            Error::Beir(sleuth_beir::BeirError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                ErrorKind::NotFound
            }
            Error::Beir(_) => ErrorKind::InvalidArgument,
            Error::Internal(_) | Error::Io { .. } | Error::Tantivy(_) => ErrorKind::Internal,
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
