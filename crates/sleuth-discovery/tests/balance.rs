//! A balanced channel over a Service's ready endpoints, as agents reach the
//! gateways: pods a scale-out adds get calls without the caller restarting,
//! and a pod that leaves gets none after its endpoint is removed. Two real
//! gRPC servers (the health service, counting the calls each answers) behind
//! slices of the fake API server.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Result;
use sleuth_testkit::kube_api::FakeKubeApi;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// A gRPC server on a loopback port answering health checks, and how many it answered.
async fn replica() -> Result<(u16, Arc<AtomicUsize>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let (_reporter, health) = tonic_health::server::health_reporter();
    let counting = tower::layer::layer_fn(move |inner| {
        let counted = counted.clone();
        tower::util::MapRequest::new(inner, move |request| {
            counted.fetch_add(1, Ordering::SeqCst);
            request
        })
    });
    tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let _ =
            tonic::transport::Server::builder().layer(counting).add_service(health).serve_with_incoming(incoming).await;
    });
    Ok((port, calls))
}

/// One health check through `client`, within 10 s.
async fn call(client: &mut HealthClient<sleuth_kit::client::MeshChannel>) -> Result<()> {
    let check = client.check(HealthCheckRequest { service: String::new() });
    match tokio::time::timeout(Duration::from_secs(10), check).await {
        Ok(answer) => answer.map(drop).map_err(|status| anyhow::anyhow!("{status:?}")),
        Err(_) => anyhow::bail!("no answer within 10 s"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_added_by_a_scale_out_get_calls_without_a_restart() -> Result<()> {
    let api = FakeKubeApi::start().await?;
    // SAFETY: nextest runs each test in its own process; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("KUBECONFIG", api.kubeconfig()) };
    let (first_port, first) = replica().await?;
    let (second_port, second) = replica().await?;
    api.set_slice("tool-gateway", "tool-gateway-a", "grpc", first_port, &[("127.0.0.1", true)]);

    let channel = sleuth_discovery::balanced_channel("tool_gateway", "kube://tool-gateway:grpc", None).await?;
    let mut client = HealthClient::new(channel);
    for _ in 0..20 {
        call(&mut client).await?;
    }
    assert_eq!((first.load(Ordering::SeqCst), second.load(Ordering::SeqCst)), (20, 0));

    // Scale-out: a second pod becomes ready; the same channel starts using it.
    api.set_slice("tool-gateway", "tool-gateway-b", "grpc", second_port, &[("127.0.0.1", true)]);
    for _ in 0..200 {
        call(&mut client).await?;
        if second.load(Ordering::SeqCst) >= 10 {
            break;
        }
    }
    let (a, b) = (first.load(Ordering::SeqCst), second.load(Ordering::SeqCst));
    assert!(b >= 10, "the added replica answered {b} of the calls after the scale-out ({a} to the first)");

    // Scale-in: the first pod's endpoint goes; once the channel has seen
    // that, calls go to the second only (20 in a row, within 10 s).
    api.delete_slice("tool-gateway-a");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let before = first.load(Ordering::SeqCst);
        for _ in 0..20 {
            call(&mut client).await?;
        }
        if first.load(Ordering::SeqCst) == before {
            break;
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "the removed replica still gets calls after 10 s");
    }
    Ok(())
}
