//! `sleuth data synth`: make the seeded multi-hop collection Sleuth's demo
//! learns on (see `sleuth_beir::synth`), as an ordinary BEIR directory that
//! `tool-gateway index` and a run spec take like any other.

use std::path::PathBuf;

use clap::{Args, Subcommand};

#[derive(Args, Debug)]
pub struct DataArgs {
    #[command(subcommand)]
    command: DataCommand,
}

#[derive(Subcommand, Debug)]
enum DataCommand {
    /// Write a synthetic BEIR collection (train/validation/test qrels) whose
    /// questions need 1 to 3 searches.
    Synth(SynthArgs),
}

#[derive(Args, Debug)]
struct SynthArgs {
    /// The directory to write (corpus.jsonl, queries.jsonl, qrels/); must not exist.
    out: PathBuf,
    /// Seeds names, links and splits: the same seed writes the same bytes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Companies in the world; each gives four questions (one per type).
    #[arg(long, default_value_t = 200)]
    companies: usize,
}

pub fn run(args: DataArgs) -> anyhow::Result<()> {
    let DataCommand::Synth(args) = args.command;
    anyhow::ensure!(!args.out.exists(), "{} already exists; choose a new directory", args.out.display());
    let made = sleuth_beir::synth::write(
        &args.out,
        sleuth_beir::synth::SynthSpec { seed: args.seed, companies: args.companies },
    )?;
    let splits: Vec<String> = made.questions.iter().map(|(split, n)| format!("{split} {n}")).collect();
    let types: Vec<String> = made.types.iter().map(|(kind, n)| format!("{kind} {n}")).collect();
    println!(
        "wrote {}: {} documents; questions: {}; types: {}",
        args.out.display(),
        made.documents,
        splits.join(", "),
        types.join(", ")
    );
    Ok(())
}
