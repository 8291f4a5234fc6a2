//! The kit's server in-process on an ephemeral port: health stays open,
//! strangers are rejected, overload is shed with retry advice, shutdown
//! drains in-flight calls and gives up at the drain deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use sleuth_kit::client::{connect, upstream_probe};
use sleuth_kit::health::probe_fn;
use sleuth_kit::{BearerToken, GrpcService, ServeArgs};
use sleuth_proto::rollout::v1::rollout_orchestrator_client::RolloutOrchestratorClient;
use sleuth_proto::rollout::v1::rollout_orchestrator_server::{
    RolloutOrchestrator, RolloutOrchestratorServer, SERVICE_NAME,
};
use sleuth_proto::rollout::v1::{GetRunRequest, ListRunsRequest, Run, RunEvent, WatchRunRequest};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::codegen::BoxStream;
use tonic::{Code, Request, Response, Status};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// A handler whose `GetRun` takes `delay` and whose `WatchRun` never ends.
#[derive(Clone)]
struct Slow {
    delay: Duration,
    completed: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl RolloutOrchestrator for Slow {
    async fn get_run(&self, request: Request<GetRunRequest>) -> Result<Response<Run>, Status> {
        tokio::time::sleep(self.delay).await;
        self.completed.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(Run { run_id: request.into_inner().run_id, ..Run::default() }))
    }

    async fn watch_run(&self, _: Request<WatchRunRequest>) -> Result<Response<BoxStream<RunEvent>>, Status> {
        Ok(Response::new(Box::pin(futures::stream::pending())))
    }
}

struct Running {
    addr: String,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<Result<(), sleuth_kit::KitError>>,
    completed: Arc<AtomicUsize>,
}

impl Running {
    /// Triggers shutdown and returns how long `serve` took to return.
    async fn shut_down(mut self) -> Duration {
        let started = Instant::now();
        self.stop.take().unwrap().send(()).unwrap();
        self.server.await.unwrap().unwrap();
        started.elapsed()
    }
}

/// Serve settings of a test on loopback without a token.
fn open() -> ServeArgs {
    ServeArgs { insecure: true, ..ServeArgs::default() }
}

async fn start(args: ServeArgs, delay: Duration, service: impl FnOnce(GrpcService) -> GrpcService) -> Result<Running> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let completed = Arc::new(AtomicUsize::new(0));
    let handlers = Slow { delay, completed: completed.clone() };
    let grpc = service(GrpcService::new(RolloutOrchestratorServer::new(handlers)));
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        sleuth_kit::serve(grpc, &args, listener, async {
            let _ = stopped.await;
        })
        .await
    });
    Ok(Running { addr, stop: Some(stop), server, completed })
}

async fn health(addr: &str, service: &str) -> Result<ServingStatus, Status> {
    let channel = connect(addr, None, Duration::from_secs(5)).await.map_err(|e| Status::unavailable(e.to_string()))?;
    let response = HealthClient::new(channel).check(HealthCheckRequest { service: service.to_owned() }).await?;
    Ok(response.into_inner().status())
}

async fn wait_for_status(addr: &str, wanted: ServingStatus) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if health(addr, SERVICE_NAME).await.ok() == Some(wanted) {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "{SERVICE_NAME} never became {wanted:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn token() -> BearerToken {
    "kit-test-token".parse().unwrap()
}

#[tokio::test]
async fn health_is_open_while_rpcs_need_the_token() -> Result<()> {
    let args = ServeArgs { auth_token: Some(token()), ..open() };
    let server = start(args, Duration::ZERO, |s| s).await?;
    wait_for_status(&server.addr, ServingStatus::Serving).await?;

    let anonymous = connect(&server.addr, None, Duration::from_secs(5)).await?;
    let error = RolloutOrchestratorClient::new(anonymous).get_run(GetRunRequest::default()).await.unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated);

    let wrong = connect(&server.addr, Some(&"not-the-token".parse()?), Duration::from_secs(5)).await?;
    let error = RolloutOrchestratorClient::new(wrong).get_run(GetRunRequest::default()).await.unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated);

    let member = connect(&server.addr, Some(&token()), Duration::from_secs(5)).await?;
    let run = RolloutOrchestratorClient::new(member).get_run(GetRunRequest { run_id: "r1".into() }).await?;
    assert_eq!(run.into_inner().run_id, "r1");

    // RPCs this service does not implement answer Unimplemented, past auth.
    let member = connect(&server.addr, Some(&token()), Duration::from_secs(5)).await?;
    let error = RolloutOrchestratorClient::new(member).list_runs(ListRunsRequest::default()).await.unwrap_err();
    assert_eq!(error.code(), Code::Unimplemented);
    server.shut_down().await;
    Ok(())
}

#[tokio::test]
async fn not_serving_until_every_probe_passes() -> Result<()> {
    let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = ready.clone();
    let probe = probe_fn("fake-dependency-switch", move || {
        let ready = flag.load(Ordering::SeqCst);
        Box::pin(async move { if ready { Ok(()) } else { Err("still starting".to_owned()) } })
    });
    let server = start(open(), Duration::ZERO, |s| s.with_probe(probe)).await?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(health(&server.addr, SERVICE_NAME).await?, ServingStatus::NotServing);
    assert_eq!(health(&server.addr, "").await?, ServingStatus::NotServing);
    ready.store(true, Ordering::SeqCst);
    wait_for_status(&server.addr, ServingStatus::Serving).await?;
    assert_eq!(health(&server.addr, "").await?, ServingStatus::Serving);
    server.shut_down().await;
    Ok(())
}

#[tokio::test]
async fn upstream_probe_follows_the_upstream_health() -> Result<()> {
    let upstream = start(open(), Duration::ZERO, |s| s).await?;
    let upstream_addr = upstream.addr.clone();
    let downstream = start(open(), Duration::ZERO, |s| {
        s.with_probe(upstream_probe("orchestrator", &upstream_addr, SERVICE_NAME, None).unwrap())
    })
    .await?;
    wait_for_status(&downstream.addr, ServingStatus::Serving).await?;
    upstream.shut_down().await;
    // Rechecked every few seconds while serving.
    let deadline = Instant::now() + Duration::from_secs(15);
    while health(&downstream.addr, SERVICE_NAME).await? == ServingStatus::Serving {
        anyhow::ensure!(Instant::now() < deadline, "downstream kept SERVING with its upstream gone");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    downstream.shut_down().await;
    Ok(())
}

#[tokio::test]
async fn overload_is_shed_with_retry_advice_and_health_still_answers() -> Result<()> {
    let args = ServeArgs { max_concurrent_requests: 1, ..open() };
    let server = start(args, Duration::from_secs(2), |s| s).await?;
    wait_for_status(&server.addr, ServingStatus::Serving).await?;
    let channel = connect(&server.addr, None, Duration::from_secs(5)).await?;
    let mut first = RolloutOrchestratorClient::new(channel.clone());
    let in_flight = tokio::spawn(async move { first.get_run(GetRunRequest::default()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;

    let error = RolloutOrchestratorClient::new(channel).get_run(GetRunRequest::default()).await.unwrap_err();
    assert_eq!(error.code(), Code::ResourceExhausted, "{error:?}");
    assert!(error.metadata().get(sleuth_kit::error::RETRY_AFTER_MS).is_some());
    assert_eq!(health(&server.addr, SERVICE_NAME).await?, ServingStatus::Serving);

    in_flight.await??;
    server.shut_down().await;
    Ok(())
}

#[tokio::test]
async fn shutdown_lets_in_flight_calls_finish() -> Result<()> {
    let server = start(open(), Duration::from_millis(800), |s| s).await?;
    wait_for_status(&server.addr, ServingStatus::Serving).await?;
    let channel = connect(&server.addr, None, Duration::from_secs(5)).await?;
    let mut client = RolloutOrchestratorClient::new(channel);
    let call = tokio::spawn(async move { client.get_run(GetRunRequest { run_id: "in-flight".into() }).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let completed = server.completed.clone();
    server.shut_down().await;
    assert_eq!(call.await??.into_inner().run_id, "in-flight");
    assert_eq!(completed.load(Ordering::SeqCst), 1);
    Ok(())
}

#[tokio::test]
async fn shutdown_gives_up_on_endless_streams_at_the_drain_deadline() -> Result<()> {
    let args = ServeArgs { drain_timeout: Duration::from_millis(500), ..open() };
    let server = start(args, Duration::ZERO, |s| s).await?;
    wait_for_status(&server.addr, ServingStatus::Serving).await?;
    let channel = connect(&server.addr, None, Duration::from_secs(5)).await?;
    let _stream = RolloutOrchestratorClient::new(channel).watch_run(WatchRunRequest::default()).await?.into_inner();
    let took = server.shut_down().await;
    // It waited for the stream, then gave up at the deadline instead of hanging.
    assert!(took >= Duration::from_millis(500), "returned before the drain deadline: {took:?}");
    assert!(took < Duration::from_secs(10), "drain deadline not enforced: {took:?}");
    Ok(())
}

/// Without a token a service does not start, naming the setting; with
/// `--insecure` it serves on loopback only, never on an address other hosts
/// reach.
#[tokio::test]
async fn a_service_without_a_token_does_not_start_and_insecure_is_loopback_only() -> Result<()> {
    let closed = start(ServeArgs::default(), Duration::ZERO, |s| s).await?;
    let error = closed.server.await?.unwrap_err().to_string();
    assert!(error.contains("SLEUTH_AUTH_TOKEN") && error.contains("SLEUTH_INSECURE"), "{error}");

    let exposed = TcpListener::bind("0.0.0.0:0").await?;
    let addr = exposed.local_addr()?;
    let grpc =
        GrpcService::new(RolloutOrchestratorServer::new(Slow { delay: Duration::ZERO, completed: Arc::default() }));
    let error = sleuth_kit::serve(grpc, &open(), exposed, async {}).await.unwrap_err().to_string();
    assert!(error.contains("loopback only") && error.contains(&addr.to_string()), "{error}");

    let local = start(open(), Duration::ZERO, |s| s).await?;
    assert!(!local.server.is_finished(), "serves on loopback with --insecure");
    local.shut_down().await;
    Ok(())
}
