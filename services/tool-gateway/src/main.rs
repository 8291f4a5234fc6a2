use anyhow::Context;
use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = tool_gateway::Config::parse();
    let _telemetry = sleuth_kit::telemetry::init("tool-gateway", &config.telemetry)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    tool_gateway::run(config, listener, sleuth_kit::shutdown::signal()).await?;
    Ok(())
}
