//! The one mapping from service errors to gRPC status codes.
//!
//! Every service error enum implements [`ServiceError`] with an exhaustive
//! `match` that says which [`ErrorKind`] each variant is; [`into_status`] is
//! the only place that turns a kind into a `tonic::Status`. Handlers never
//! build `Status::internal(format!(..))` themselves.

use std::time::Duration;

use tonic::{Code, Status};

/// What kind of failure an error is, from the caller's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is wrong; retrying it unchanged will fail again.
    InvalidArgument,
    /// A named thing (run, collection, episode) does not exist.
    NotFound,
    /// Creating something that already exists.
    AlreadyExists,
    /// The system is not in a state that allows the request (e.g. an older weight version).
    FailedPrecondition,
    /// Lost a race with a concurrent change (e.g. two turns of one episode at
    /// once); the caller may retry from a fresh read.
    Aborted,
    /// Overloaded: retry after the given delay.
    ResourceExhausted { retry_after: Duration },
    /// A dependency is down; retrying later may work.
    Unavailable,
    /// No or wrong credentials.
    Unauthenticated,
    /// Valid credentials that do not open this call (it needs a scope's own token).
    PermissionDenied,
    /// Not implemented by this version of the service.
    Unimplemented,
    /// A bug or an unexpected failure inside the service.
    Internal,
}

impl ErrorKind {
    /// A short label for metrics and logs (`invalid_argument`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::NotFound => "not_found",
            ErrorKind::AlreadyExists => "already_exists",
            ErrorKind::FailedPrecondition => "failed_precondition",
            ErrorKind::Aborted => "aborted",
            ErrorKind::ResourceExhausted { .. } => "resource_exhausted",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Unauthenticated => "unauthenticated",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::Unimplemented => "unimplemented",
            ErrorKind::Internal => "internal",
        }
    }
}

/// Implemented by each service's error type to classify its variants.
pub trait ServiceError: std::error::Error {
    fn kind(&self) -> ErrorKind;
}

/// Metadata key carrying the retry advice of `ResourceExhausted` errors, in milliseconds.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";

/// Converts a service error into the status its caller receives.
///
/// The message is the error's `Display` chain, which by convention names the
/// offending field and value. Internal errors are also logged here, once, with
/// their full source chain.
pub fn into_status<E: ServiceError + ?Sized>(error: &E) -> Status {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    let code = match error.kind() {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::AlreadyExists => Code::AlreadyExists,
        ErrorKind::FailedPrecondition => Code::FailedPrecondition,
        ErrorKind::Aborted => Code::Aborted,
        ErrorKind::ResourceExhausted { retry_after } => {
            let mut status =
                Status::resource_exhausted(format!("{message}; retry after {} ms", retry_after.as_millis()));
            status.metadata_mut().insert(
                RETRY_AFTER_MS,
                retry_after.as_millis().to_string().parse().expect("digits are valid metadata"),
            );
            return status;
        }
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Unauthenticated => Code::Unauthenticated,
        ErrorKind::PermissionDenied => Code::PermissionDenied,
        ErrorKind::Unimplemented => Code::Unimplemented,
        ErrorKind::Internal => {
            tracing::error!(error = %message, "internal error");
            Code::Internal
        }
    };
    Status::new(code, message)
}

/// Errors raised by the kit itself.
#[derive(Debug, thiserror::Error)]
pub enum KitError {
    #[error("invalid {field}: {message}")]
    Config { field: &'static str, message: String },
    #[error("missing or invalid bearer token")]
    Unauthenticated,
    /// The mesh token was presented for a call that needs a scope's own token.
    #[error("{path} needs its own token ({setting}), not the mesh token")]
    PermissionDenied { path: String, setting: &'static str },
    #[error("server is at its limit of concurrent requests")]
    Overloaded,
    #[error("cannot connect to {endpoint}")]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot build gRPC reflection service")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("gRPC server failed")]
    Serve(#[from] tonic::transport::Error),
    #[error("cannot start telemetry: {0}")]
    Telemetry(String),
    #[error("request stack failed: {0}")]
    RequestStack(String),
}

impl ServiceError for KitError {
    fn kind(&self) -> ErrorKind {
        match self {
            KitError::Config { .. } => ErrorKind::InvalidArgument,
            KitError::Unauthenticated => ErrorKind::Unauthenticated,
            KitError::PermissionDenied { .. } => ErrorKind::PermissionDenied,
            KitError::Overloaded => ErrorKind::ResourceExhausted { retry_after: Duration::from_millis(100) },
            KitError::Connect { .. } => ErrorKind::Unavailable,
            KitError::Reflection(_) | KitError::Serve(_) | KitError::Telemetry(_) | KitError::RequestStack(_) => {
                ErrorKind::Internal
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum RunError {
        #[error("max_turns must be between 1 and 256, got {0}")]
        MaxTurns(u32),
        #[error("run {0} not found")]
        Missing(String),
    }

    impl ServiceError for RunError {
        fn kind(&self) -> ErrorKind {
            match self {
                RunError::MaxTurns(_) => ErrorKind::InvalidArgument,
                RunError::Missing(_) => ErrorKind::NotFound,
            }
        }
    }

    #[test]
    fn bad_input_is_invalid_argument_naming_field_and_value() {
        let status = into_status(&RunError::MaxTurns(0));
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "max_turns must be between 1 and 256, got 0");
        assert_eq!(into_status(&RunError::Missing("r1".into())).code(), Code::NotFound);
    }

    #[test]
    fn overload_carries_retry_advice() {
        let status = into_status(&KitError::Overloaded);
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(status.metadata().get(RETRY_AFTER_MS).unwrap(), "100");
        assert!(status.message().contains("retry after 100 ms"));
    }

    #[test]
    fn source_chain_is_part_of_the_message() {
        let io = std::io::Error::other("disk full");
        #[derive(Debug, thiserror::Error)]
        #[error("cannot write checkpoint")]
        struct Write(#[source] std::io::Error);
        impl ServiceError for Write {
            fn kind(&self) -> ErrorKind {
                ErrorKind::Internal
            }
        }
        let status = into_status(&Write(io));
        assert_eq!(status.code(), Code::Internal);
        assert_eq!(status.message(), "cannot write checkpoint: disk full");
    }
}
