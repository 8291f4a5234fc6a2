use anyhow::Context;
use clap::Parser;

/// Trains the policy on a run's trajectory groups and publishes its weights
/// (a gRPC server).
#[derive(Parser, Debug)]
#[command(
    name = "learner",
    version,
    after_help = "Other commands:\n  learner init-policy --help   make a fresh policy for a collection\n  \
                  learner best-policy --help   where an ended run's best validated policy is"
)]
struct Serve {
    #[command(flatten)]
    config: learner::Config,
}

/// The learner's commands besides serving. They are dispatched on the first
/// argument rather than declared as clap subcommands beside the server's
/// flags: a parent's required flags (`--run-id`, often given by environment
/// variables under Kubernetes) would otherwise be demanded of every
/// subcommand too.
#[derive(Parser, Debug)]
#[command(name = "learner", version)]
enum Command {
    /// Make a fresh policy for a collection: a BPE tokenizer trained on its
    /// text, a random Llama, and optionally copy pre-training.
    InitPolicy(learner::fresh::FreshArgs),
    /// Print where an ended run's best validated policy is (its best
    /// validated version with a checkpoint): to evaluate or serve it.
    BestPolicy(learner::lineage::BestPolicyArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let first = std::env::args_os().nth(1);
    if first.is_some_and(|first| first == "init-policy" || first == "best-policy") {
        match Command::parse() {
            Command::InitPolicy(args) => {
                let fresh = learner::fresh::init_policy(&args)?;
                println!(
                    "wrote {}: {} parameters, a vocabulary of {} tokens trained on {}",
                    fresh.dir.display(),
                    fresh.parameters,
                    fresh.vocab_size,
                    args.collection.display()
                );
                if let Some(copying) = fresh.copying {
                    println!("copy pre-training: {copying}");
                }
            }
            Command::BestPolicy(args) => println!("{}", learner::lineage::best_policy(&args).await?),
        }
        return Ok(());
    }
    let config = Serve::parse().config;
    let _telemetry = sleuth_kit::telemetry::init("learner", &config.telemetry)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    learner::run(config, listener, sleuth_kit::shutdown::signal()).await?;
    Ok(())
}
