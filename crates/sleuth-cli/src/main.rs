//! `sleuth`: the command-line client of every Sleuth gRPC API.

mod ask;
mod auth;
mod chart;
mod compare;
mod data;
mod health;
mod model;
mod report;
mod run_spec;
mod runs;
mod search;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "sleuth", version, about = "Client of the Sleuth mesh's gRPC APIs")]
struct Cli {
    #[command(subcommand)]
    command: Command,

    /// Mutual TLS to a mesh that requires it (the same settings as its services').
    #[command(flatten)]
    tls: sleuth_kit::tls::TlsArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check the gRPC health of every service of a running mesh and print a table.
    Health(health::HealthArgs),
    /// Search a collection served by the tool gateway.
    Search(search::SearchArgs),
    /// Ask the policy server a question, rendered with the model's chat template.
    Ask(ask::AskArgs),
    /// Create, follow, cancel and list training runs (rollout orchestrator).
    Run(runs::RunArgs),
    /// Evaluate the policy or a retrieval baseline on a task split.
    Eval(runs::EvalArgs),
    /// Finished evaluations side by side, with paired bootstrap intervals against one of them.
    Compare(compare::CompareArgs),
    /// Work with model files: import a GGUF, provision an HF directory from a path or S3.
    Model(model::ModelArgs),
    /// Make collections: a seeded synthetic multi-hop BEIR collection.
    Data(data::DataArgs),
    /// Mesh tokens on Kubernetes: make the token Secret once (the Helm chart's hook).
    Auth(auth::AuthArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    sleuth_kit::tls::install(&cli.tls)?;
    let code = match cli.command {
        Command::Health(args) => i32::from(!health::run(args).await?),
        Command::Search(args) => search::run(args).await.map(|()| 0)?,
        Command::Ask(args) => ask::run(args).await.map(|()| 0)?,
        Command::Run(args) => runs::run(args).await?,
        Command::Eval(args) => runs::eval(args).await?,
        Command::Compare(args) => compare::run(args).await.map(|()| 0)?,
        Command::Model(args) => model::run(args).await.map(|()| 0)?,
        Command::Data(args) => data::run(args).map(|()| 0)?,
        Command::Auth(args) => auth::run(args).await.map(|()| 0)?,
    };
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}
