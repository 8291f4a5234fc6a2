//! `sleuth`: the command-line client of every Sleuth gRPC API.

mod ask;
mod health;
mod search;

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
    /// Search a collection served by the tool gateway.
    Search(search::SearchArgs),
    /// Ask the policy server a question, rendered with the model's chat template.
    Ask(ask::AskArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let healthy = match cli.command {
        Command::Health(args) => health::run(args).await?,
        Command::Search(args) => search::run(args).await.map(|()| true)?,
        Command::Ask(args) => ask::run(args).await.map(|()| true)?,
    };
    if !healthy {
        std::process::exit(1);
    }
    Ok(())
}
