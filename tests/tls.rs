//! Mutual TLS between real service processes: an inference gateway that
//! calls a policy server, both holding a certificate of the mesh's CA.
//! Clients with that CA's certificate get through; clients without one, with
//! another CA's, or in cleartext never reach a handler. The OpenAI door
//! serves HTTPS.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use sleuth_proto::policy::v1::GetModelInfoRequest;
use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;
use sleuth_testkit::tls::TestCa;
use sleuth_tests::ServiceProcess;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const TOKEN: &str = "tls-mesh-token";
/// The name the mesh's certificates are checked against: the test dials
/// 127.0.0.1, as a gateway dials a policy server's pod IP.
const SERVER_NAME: &str = "localhost";

/// The settings every service of the mesh gets: its certificate, key and CA.
fn tls_env(ca: &TestCa) -> Vec<(&'static str, String)> {
    vec![
        ("SLEUTH_AUTH_TOKEN", TOKEN.to_owned()),
        ("SLEUTH_TLS_CERT", ca.server_cert().display().to_string()),
        ("SLEUTH_TLS_KEY", ca.server_key().display().to_string()),
        ("SLEUTH_TLS_CA", ca.ca_cert().display().to_string()),
        ("SLEUTH_TLS_SERVER_NAME", SERVER_NAME.to_owned()),
    ]
}

/// A client trusting `trusted`'s CA, presenting `identity`'s certificate if any.
async fn tls_channel(
    addr: &str,
    trusted: &TestCa,
    identity: Option<&TestCa>,
) -> Result<Channel, tonic::transport::Error> {
    let mut config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(trusted.ca_cert()).expect("the CA's file")))
        .domain_name(SERVER_NAME);
    if let Some(holder) = identity {
        let (cert, key) = (std::fs::read(holder.server_cert()), std::fs::read(holder.server_key()));
        config = config.identity(Identity::from_pem(cert.expect("a certificate"), key.expect("a key")));
    }
    Endpoint::from_shared(format!("https://{addr}"))?
        .tls_config(config)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
}

fn with_token(request: GetModelInfoRequest) -> tonic::Request<GetModelInfoRequest> {
    let mut request = tonic::Request::new(request);
    request.metadata_mut().insert("authorization", format!("Bearer {TOKEN}").parse().expect("ascii"));
    request
}

/// Whether a call through `channel` (if it connected at all) reached the policy server's handler.
async fn model_info(channel: Result<Channel, tonic::transport::Error>) -> Result<String, String> {
    let channel = channel.map_err(|error| format!("connect: {error}"))?;
    PolicyServerClient::new(channel)
        .get_model_info(with_token(GetModelInfoRequest {}))
        .await
        .map(|info| info.into_inner().architecture)
        .map_err(|status| format!("{:?}: {}", status.code(), status.message()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_speak_mutual_tls_and_refuse_clients_without_the_mesh_certificate() -> Result<()> {
    let mesh_ca = TestCa::new()?;
    let stranger_ca = TestCa::new()?;
    let redis = sleuth_testkit::redis()?;
    let model = sleuth_testkit::smollm2()?;
    let mut env = tls_env(&mesh_ca);
    env.extend([("SLEUTH_MODEL", model.display().to_string()), ("SLEUTH_DEVICE", "cpu".into())]);
    let policy = ServiceProcess::start("policy-server", &env)?;
    env.extend([
        ("SLEUTH_REDIS_URL", sleuth_testkit::redis_url(&redis)),
        ("SLEUTH_POLICY_SERVERS", policy.addr.clone()),
    ]);
    let gateway = ServiceProcess::start("inference-gateway", &env)?;

    // The gateway is ready only once its probe of the policy server, a call
    // over the mesh's mutual TLS, has succeeded.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let channel = tls_channel(&gateway.addr, &mesh_ca, Some(&mesh_ca)).await?;
        let request = HealthCheckRequest { service: "sleuth.inference.v1.InferenceGateway".into() };
        let status = HealthClient::new(channel).check(request).await?.into_inner().status();
        if status == ServingStatus::Serving {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "gateway still {status:?}; gateway log:\n{}\npolicy server log:\n{}",
            gateway.log(),
            policy.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(gateway.log().contains(r#""tls":true"#), "{}", gateway.log());

    // A member of the mesh reaches the handler.
    let member = model_info(tls_channel(&policy.addr, &mesh_ca, Some(&mesh_ca)).await).await;
    assert_eq!(member.as_deref(), Ok("llama"), "{}", policy.log());
    // Without a certificate, with another CA's, or in cleartext: no answer.
    let anonymous = model_info(tls_channel(&policy.addr, &mesh_ca, None).await).await;
    assert!(anonymous.is_err(), "a client without a certificate was answered: {anonymous:?}");
    let stranger = model_info(tls_channel(&policy.addr, &mesh_ca, Some(&stranger_ca)).await).await;
    assert!(stranger.is_err(), "a client with another CA's certificate was answered: {stranger:?}");
    let cleartext = Endpoint::from_shared(format!("http://{}", policy.addr))?.connect().await;
    let cleartext = model_info(cleartext).await;
    assert!(cleartext.is_err(), "a cleartext client was answered: {cleartext:?}");
    // And a client that does not trust the mesh's CA does not talk to its servers.
    let unverified = model_info(tls_channel(&policy.addr, &stranger_ca, Some(&stranger_ca)).await).await;
    assert!(unverified.is_err(), "a server outside the client's CA was accepted: {unverified:?}");

    // The OpenAI door serves HTTPS with the mesh's certificate; its token
    // still guards it (no certificate is asked of HTTP clients).
    let http = gateway.http.clone().context("the gateway's HTTP address")?;
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&std::fs::read(mesh_ca.ca_cert())?)?)
        .build()?;
    let port = http.rsplit(':').next().context("a port")?;
    let response = client.post(format!("https://{SERVER_NAME}:{port}/v1/chat/completions")).body("{}").send().await?;
    assert_eq!(response.status(), reqwest::StatusCode::UNAUTHORIZED);
    let plain = client.post(format!("http://{http}/v1/chat/completions")).body("{}").send().await;
    assert!(plain.is_err(), "the door answered cleartext HTTP: {plain:?}");
    Ok(())
}
