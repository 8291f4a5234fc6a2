//! `sleuth`: the command-line client of every Sleuth gRPC API.

mod health;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "sleuth", version, about = "Client of the Sleuth mesh's gRPC APIs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check the gRPC health of every service of a running mesh and print a table.
    Health(health::HealthArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let healthy = match cli.command {
        Command::Health(args) => health::run(args).await?,
    };
    if !healthy {
        std::process::exit(1);
    }
    Ok(())
}
