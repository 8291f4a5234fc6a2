use anyhow::Context;
use clap::{Parser, Subcommand};

/// Search tools (BM25, read document) over indexed collections, for agents.
/// Without a subcommand it serves gRPC.
#[derive(Parser, Debug)]
#[command(name = "tool-gateway", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    #[command(flatten)]
    config: tool_gateway::Config,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Build the index of a BEIR collection.
    Index(tool_gateway::offline::IndexArgs),
    /// Search an index from the command line.
    Search(tool_gateway::offline::SearchArgs),
    /// Run every judged query of a BEIR split and report nDCG@10, recall@100 and MRR.
    Evaluate(tool_gateway::offline::EvaluateArgs),
    /// Follow the listed leads of every judged query of a split and report
    /// which lead number reaches the next judged document, hop by hop.
    Leads(tool_gateway::offline::LeadsArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Index(args)) => tool_gateway::offline::index(args)?,
        Some(Command::Search(args)) => tool_gateway::offline::search(args)?,
        Some(Command::Evaluate(args)) => tool_gateway::offline::evaluate(args)?,
        Some(Command::Leads(args)) => tool_gateway::offline::leads(args)?,
        None => {
            let config = cli.config;
            let _telemetry = sleuth_kit::telemetry::init("tool-gateway", &config.telemetry)?;
            let listener = tokio::net::TcpListener::bind(config.listen)
                .await
                .with_context(|| format!("cannot listen on {}", config.listen))?;
            tool_gateway::run(config, listener, sleuth_kit::shutdown::signal()).await?;
        }
    }
    Ok(())
}
