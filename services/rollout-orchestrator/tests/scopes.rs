//! With an administration token set, the calls that make the mesh work or
//! read the orchestrator's disk (CreateRun, CancelRun, Evaluate) open only
//! with it: an agent pod's mesh token is refused, naming the setting.

use anyhow::Result;
use sleuth_proto::rollout::v1 as pb;
use sleuth_proto::rollout::v1::rollout_orchestrator_client::RolloutOrchestratorClient;

#[tokio::test]
async fn evaluations_need_the_administration_token() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let args = [
        "rollout-orchestrator",
        "--listen=127.0.0.1:0",
        "--http-listen=127.0.0.1:0",
        "--auth-token=mesh-token",
        "--admin-token=admin-token",
        &format!("--database-url=sqlite://{}", scratch.path().join("runs.db").display()),
        "--redis-url=redis://127.0.0.1:9/0",
        &format!("--report-dir={}", scratch.path().join("evaluations").display()),
    ];
    let (addr, _running) = sleuth_testkit::start_service!(rollout_orchestrator, args);
    let as_holder = |token: &str| -> Result<_> {
        let token: sleuth_kit::BearerToken = token.parse()?;
        Ok(RolloutOrchestratorClient::new(sleuth_kit::client::connect_lazy(&addr, Some(&token))?))
    };
    let request = pb::EvaluateRequest::default(); // no tasks: refused after authorisation

    let refused = as_holder("mesh-token")?.evaluate(request.clone()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("SLEUTH_ADMIN_TOKEN"), "{refused:?}");

    let judged = as_holder("admin-token")?.evaluate(request).await.unwrap_err();
    assert_eq!(judged.code(), tonic::Code::InvalidArgument, "the admin token opens Evaluate: {judged:?}");
    Ok(())
}
