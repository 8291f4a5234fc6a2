//! The tower stack in front of a service's RPC handlers.
//!
//! From the outside in:
//!
//! 0. **A server span** per call, child of the caller's trace context
//!    ([`crate::trace_context::server_span`]), so refusals are traced too.
//! 1. **Authentication** ([`RequireBearerLayer`]) sits outermost so that
//!    strangers are turned away before they take a concurrency permit: an
//!    unauthenticated flood cannot starve the mesh's own callers.
//! 2. **Load shedding** sits outside the concurrency limit so that a request
//!    arriving when every permit is taken fails at once with
//!    `ResourceExhausted` (and retry advice) instead of waiting in an
//!    unbounded queue: callers such as the orchestrator back off and retry
//!    elsewhere, and memory stays bounded.
//! 3. **A process-wide concurrency limit** bounds work in flight across every
//!    connection (a per-connection limit would let one HTTP/2 connection
//!    multiplexing many calls through, and many connections multiply it).
//!
//! The per-request timeout is applied by tonic's server itself (see
//! [`crate::serve`]) because tonic also honours the caller's shorter
//! `grpc-timeout`; for streaming RPCs it bounds the time to the first
//! response, not the whole stream.
//!
//! gRPC health is mounted beside this stack, not inside it: probes must stay
//! answerable without credentials and under overload, so that Kubernetes
//! does not restart a pod for being busy.

use axum::error_handling::HandleErrorLayer;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::load_shed::LoadShedLayer;
use tower::{BoxError, ServiceBuilder};

use crate::auth::{Access, RequireBearerLayer};
use crate::error::{KitError, into_status};

/// Wraps every route of `router` in the stack described above.
pub fn guard(router: axum::Router, max_concurrent_requests: usize, access: Access) -> axum::Router {
    let limits = ServiceBuilder::new()
        .layer(HandleErrorLayer::new(reject))
        .layer(LoadShedLayer::new())
        .layer(GlobalConcurrencyLimitLayer::new(max_concurrent_requests));
    let router = router.layer(limits);
    let router = if access.is_guarded() { router.layer(RequireBearerLayer::new(access)) } else { router };
    router.layer(axum::middleware::from_fn(crate::trace_context::server_span))
}

/// The only error the limit layers produce is tower's `Overloaded`; anything
/// else would be a bug in the stack and is reported as such.
async fn reject(error: BoxError) -> http::Response<axum::body::Body> {
    if error.is::<tower::load_shed::error::Overloaded>() {
        into_status(&KitError::Overloaded).into_http()
    } else {
        into_status(&KitError::RequestStack(error.to_string())).into_http()
    }
}
