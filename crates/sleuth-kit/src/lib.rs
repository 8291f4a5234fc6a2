//! The plumbing every Sleuth service shares, so that each service crate only
//! holds its own domain logic.
//!
//! A service's `lib.rs` builds a [`serve::GrpcService`] (its routes and the
//! probes of the dependencies it needs) and hands it to [`serve::serve`],
//! which adds health, reflection, authentication, the tower stack and
//! graceful shutdown.

pub mod auth;
pub mod chat_endpoint;
pub mod client;
pub mod config;
pub mod error;
pub mod fault;
pub mod health;
pub mod limits;
pub mod metrics;
pub mod names;
pub mod pause;
pub mod seed;
pub mod serve;
pub mod shutdown;
pub mod stack;
pub mod telemetry;
pub mod ticket;
pub mod tls;
pub mod trace_context;

pub use auth::BearerToken;
pub use config::{AdminTokenArgs, PublishTokenArgs, ServeArgs, TelemetryArgs, TicketKeyArgs};
pub use error::{ErrorKind, KitError, ServiceError};
pub use health::Probe;
pub use serve::{GrpcService, serve};
