//! Serving one Sleuth gRPC service: health, reflection, the guarded stack and
//! graceful shutdown with a drain deadline.

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::auth::{Access, BearerToken};
use crate::config::ServeArgs;
use crate::error::KitError;
use crate::health::{Probe, watch_readiness};
use crate::stack;

/// A service's RPC handlers and the dependencies it needs before it can serve.
pub struct GrpcService {
    name: &'static str,
    routes: Routes,
    probes: Vec<Arc<dyn Probe>>,
    /// Methods that only a scope's own token opens (see [`Access`]).
    access: Vec<(String, BearerToken, &'static str)>,
}

impl GrpcService {
    /// Wraps a tonic-generated server (e.g. `ToolGatewayServer::new(handlers)`).
    pub fn new<S>(server: S) -> Self
    where
        S: tower::Service<http::Request<tonic::body::Body>, Error = std::convert::Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        Self { name: S::NAME, routes: Routes::new(server), probes: Vec::new(), access: Vec::new() }
    }

    /// `methods` of this service open only with `token` (the value of
    /// `setting`), not with the mesh token; with no token they stay in the
    /// mesh's scope.
    pub fn with_scope(mut self, methods: &[&str], token: Option<BearerToken>, setting: &'static str) -> Self {
        if let Some(token) = token {
            for method in methods {
                self.access.push((format!("/{}/{method}", self.name), token.clone(), setting));
            }
        }
        self
    }

    /// Adds a dependency that must answer before the service reports SERVING.
    pub fn with_probe(mut self, probe: Arc<dyn Probe>) -> Self {
        self.probes.push(probe);
        self
    }

    /// The fully qualified gRPC service name, e.g. `sleuth.tools.v1.ToolGateway`.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

/// Serves `service` on `listener` until `shutdown` resolves, then drains.
///
/// On shutdown the service first reports NOT_SERVING (so load balancers stop
/// sending new calls), then stops accepting connections and lets in-flight
/// calls finish. Calls still running after `drain_timeout` are dropped and the
/// function returns anyway, so a pod never outlives its termination grace period.
pub async fn serve(
    service: GrpcService,
    args: &ServeArgs,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), KitError> {
    let GrpcService { name, routes, probes, access: scoped } = service;
    let local_addr = listener.local_addr().map_err(|error| KitError::Config {
        field: "listen",
        message: format!("listener has no local address: {error}"),
    })?;
    let token = args.token_for(local_addr)?;
    let access = scoped
        .into_iter()
        .fold(Access::mesh(token.clone()), |access, (path, token, setting)| access.scope(path, token, setting));

    let (reporter, health_server) = tonic_health::server::health_reporter();
    reporter.set_service_status(name, ServingStatus::NotServing).await;
    reporter.set_service_status("", ServingStatus::NotServing).await;
    // Aborted when serving ends for any reason, errors included.
    let readiness = AbortOnDrop(tokio::spawn(watch_readiness(reporter.clone(), name, probes)));
    let stop_readiness = readiness.0.abort_handle();

    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(sleuth_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name(name)
            .with_service_name(tonic_health::pb::health_server::SERVICE_NAME)
    };
    let routes = routes.add_service(reflection().build_v1()?).add_service(reflection().build_v1alpha()?);
    let guarded = stack::guard(routes.into_axum_router(), args.max_concurrent_requests as usize, access);
    // Health and metrics are added after the stack was applied, so they stay
    // outside it: probes and scrapers need no token and get answers under load.
    let routes = Routes::from(guarded).add_service(health_server);
    let routes = Routes::from(routes.into_axum_router().route("/metrics", axum::routing::get(crate::metrics::scrape)));

    crate::tls::install(&args.tls)?;
    let tls = crate::tls::installed();
    tracing::info!(service = name, addr = %local_addr, auth = token.is_some(), tls = tls.is_some(), "listening");

    let (drain_started, drain_signal) = tokio::sync::oneshot::channel();
    let stop_reporter = reporter.clone();
    let on_shutdown = async move {
        shutdown.await;
        stop_readiness.abort();
        stop_reporter.set_service_status(name, ServingStatus::NotServing).await;
        stop_reporter.set_service_status("", ServingStatus::NotServing).await;
        tracing::info!(service = name, "draining in-flight requests");
        let _ = drain_started.send(());
    };
    let mut builder = Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls.grpc_server())?;
    }
    let server = builder
        // Prometheus scrapes /metrics over HTTP/1.1; gRPC stays HTTP/2.
        .accept_http1(true)
        .timeout(args.request_timeout)
        // Mesh clients multiplex on one connection (a gateway sends every
        // episode's turns to a replica over one channel); hyper's default of
        // 200 streams would queue the rest on the client while the server
        // still has capacity. Above the concurrency limit, so that excess
        // calls reach the load shedder and get retry advice instead of
        // waiting unseen in a client queue, and health checks still fit.
        .max_concurrent_streams(Some(args.max_concurrent_requests.saturating_add(256)))
        .add_routes(routes)
        // Without TCP_NODELAY a response's last small frame can wait for the
        // client's delayed ACK (Nagle): ~40 ms stalls on single calls.
        .serve_with_incoming_shutdown(TcpIncoming::from(listener).with_nodelay(Some(true)), on_shutdown);

    let drain_deadline = async {
        match drain_signal.await {
            Ok(()) => tokio::time::sleep(args.drain_timeout).await,
            // The server stopped on its own; this branch must never win.
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        result = server => {
            result?;
            tracing::info!(service = name, "stopped");
        }
        () = drain_deadline => {
            tracing::warn!(service = name, drain_timeout = ?args.drain_timeout, "drain deadline passed, dropping remaining requests");
        }
    }
    drop(readiness);
    Ok(())
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
