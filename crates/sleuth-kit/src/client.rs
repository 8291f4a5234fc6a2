//! Connecting to other services of the mesh.

use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::auth::{BearerInterceptor, BearerToken};
use crate::error::KitError;

/// A channel to a Sleuth service that sends the mesh's bearer token on every call.
pub type MeshChannel = InterceptedService<Channel, BearerInterceptor>;

/// HTTP/2 pings on every channel: a peer that stops answering (a hung
/// process, a dropped NAT entry) fails its calls within seconds instead of
/// holding them until a deadline far away.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Parses `endpoint` ("host:port" or "http://host:port") into a tonic
/// endpoint; over mutual TLS when the process installed TLS settings
/// ([`crate::tls::install`]), whatever scheme the address names.
pub fn endpoint(endpoint: &str, connect_timeout: Duration) -> Result<Endpoint, KitError> {
    let invalid = |error: &dyn std::fmt::Display| KitError::Config {
        field: "endpoint",
        message: format!("{endpoint:?}: {error}"),
    };
    let tls = crate::tls::installed();
    let authority = endpoint.split_once("://").map_or(endpoint, |(_, rest)| rest);
    let uri = if tls.is_some() { format!("https://{authority}") } else { format!("http://{authority}") };
    let configured = Endpoint::from_shared(uri).map_err(|error| invalid(&error))?;
    let configured = match tls {
        Some(tls) => configured.tls_config(tls.grpc_client()).map_err(|error| invalid(&error))?,
        None => configured,
    };
    Ok(configured
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true))
}

/// `channel` sending the mesh's bearer token on every call.
pub fn with_token(channel: Channel, token: Option<&BearerToken>) -> MeshChannel {
    InterceptedService::new(channel, BearerInterceptor::new(token))
}

/// A channel that connects on first use and reconnects after failures, so a
/// service can start before the services it calls.
pub fn connect_lazy(address: &str, token: Option<&BearerToken>) -> Result<MeshChannel, KitError> {
    Ok(with_token(endpoint(address, Duration::from_secs(5))?.connect_lazy(), token))
}

/// Connects now, failing with `KitError::Connect` if the service cannot be reached.
pub async fn connect(address: &str, token: Option<&BearerToken>, timeout: Duration) -> Result<MeshChannel, KitError> {
    let channel = endpoint(address, timeout)?
        .connect()
        .await
        .map_err(|source| KitError::Connect { endpoint: address.to_owned(), source })?;
    Ok(with_token(channel, token))
}

/// Runs an outbound call with a deadline. The request carries it as
/// `grpc-timeout`, so the server stops working on it, and the caller stops
/// waiting when it passes even if the peer never answers. (tonic's channel
/// enforces `grpc-timeout` too, as a bare "Timeout expired"; whichever fires
/// first ends the call.)
pub async fn within<M, T>(
    deadline: Duration,
    message: M,
    call: impl AsyncFnOnce(tonic::Request<M>) -> Result<T, tonic::Status>,
) -> Result<T, tonic::Status> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(deadline);
    match tokio::time::timeout(deadline, call(request)).await {
        Ok(result) => result,
        Err(_) => Err(tonic::Status::deadline_exceeded(format!("no answer within {deadline:?}"))),
    }
}

/// A readiness probe that is healthy when `service` on `address` reports
/// SERVING, for services that call another one.
pub fn upstream_probe(
    label: &str,
    address: &str,
    service: &'static str,
    token: Option<&BearerToken>,
) -> Result<std::sync::Arc<dyn crate::Probe>, KitError> {
    Ok(upstream_probe_on(label, address, connect_lazy(address, token)?, service))
}

/// [`upstream_probe`] over a channel the caller made (a balanced one, say):
/// healthy when whichever replica answers reports `service` SERVING.
pub fn upstream_probe_on(
    label: &str,
    address: &str,
    channel: MeshChannel,
    service: &'static str,
) -> std::sync::Arc<dyn crate::Probe> {
    let address = address.to_owned();
    crate::health::probe_fn(label, move || {
        let mut client = tonic_health::pb::health_client::HealthClient::new(channel.clone());
        let address = address.clone();
        Box::pin(async move {
            let request = tonic_health::pb::HealthCheckRequest { service: service.to_owned() };
            match client.check(request).await {
                Ok(response)
                    if response.get_ref().status()
                        == tonic_health::pb::health_check_response::ServingStatus::Serving =>
                {
                    Ok(())
                }
                Ok(response) => Err(format!("{address} reports {:?}", response.get_ref().status())),
                Err(status) => Err(format!("{address}: {}", status.message())),
            }
        })
    })
}
