use anyhow::Context;
use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = policy_server::Config::parse();
    let _telemetry = sleuth_kit::telemetry::init("policy-server", &config.telemetry)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    policy_server::run(config, listener, sleuth_kit::shutdown::signal()).await?;
    Ok(())
}
