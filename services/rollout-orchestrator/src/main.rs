use anyhow::Context;
use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = rollout_orchestrator::Config::parse();
    let _telemetry = sleuth_kit::telemetry::init("rollout-orchestrator", &config.telemetry)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    rollout_orchestrator::run(config, listener, sleuth_kit::shutdown::signal()).await?;
    Ok(())
}
