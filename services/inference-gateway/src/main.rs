use anyhow::Context;
use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = inference_gateway::Config::parse();
    let _telemetry = sleuth_kit::telemetry::init("inference-gateway", &config.telemetry)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    inference_gateway::run(config, listener, sleuth_kit::shutdown::signal()).await?;
    Ok(())
}
