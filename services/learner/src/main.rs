use anyhow::Context;
use clap::{Parser, Subcommand};

/// Trains the policy on a run's trajectory groups and publishes its weights.
/// Without a subcommand it serves gRPC.
#[derive(Parser, Debug)]
#[command(name = "learner", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    #[command(flatten)]
    config: learner::Config,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Make a fresh policy for a collection: a BPE tokenizer trained on its text and a random Llama.
    InitPolicy(learner::fresh::FreshArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::InitPolicy(args)) => {
            let fresh = learner::fresh::init_policy(&args)?;
            println!(
                "wrote {}: {} parameters, a vocabulary of {} tokens trained on {}",
                fresh.dir.display(),
                fresh.parameters,
                fresh.vocab_size,
                args.collection.display()
            );
        }
        None => {
            let config = cli.config;
            let _telemetry = sleuth_kit::telemetry::init("learner", &config.telemetry)?;
            let listener = tokio::net::TcpListener::bind(config.listen)
                .await
                .with_context(|| format!("cannot listen on {}", config.listen))?;
            learner::run(config, listener, sleuth_kit::shutdown::signal()).await?;
        }
    }
    Ok(())
}
