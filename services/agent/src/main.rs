use anyhow::Context;
use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = agent::Config::parse();
    let _telemetry = sleuth_kit::telemetry::init("agent", &config.telemetry)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    agent::run(config, listener, sleuth_kit::shutdown::signal()).await?;
    Ok(())
}
