//! `sleuth data synth`: make the seeded multi-hop collection Sleuth's demo
//! learns on (see `sleuth_beir::synth`), as an ordinary BEIR directory that
//! `tool-gateway index` and a run spec take like any other.
//!
//! `sleuth data divide`: split one split's questions into disjoint parts
//! (e.g. `sft`, `rl`, `validation`), keeping questions that share a judged
//! document together (see `sleuth_beir::divide`).

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
    /// Write a BEIR directory over the same corpus and queries whose split
    /// FROM is divided into disjoint parts (questions sharing a judged
    /// document stay in one part); every other split is kept.
    Divide(DivideArgs),
}

#[derive(Args, Debug)]
struct DivideArgs {
    /// The BEIR directory to read.
    source: PathBuf,
    /// The directory to write (corpus and queries are linked); must not exist.
    out: PathBuf,
    /// The split whose questions are divided.
    #[arg(long, default_value = "train")]
    from: String,
    /// The parts as NAME:WEIGHT, e.g. `sft:1 rl:1` or `train:6 validation:1`.
    #[arg(long, num_args = 1.., required = true)]
    into: Vec<sleuth_beir::divide::Part>,
    /// Seeds the order groups of questions are dealt out in.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Refuse when a part would get fewer questions than this.
    #[arg(long, default_value_t = sleuth_beir::divide::MIN_QUESTIONS, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u64).range(1..), |n| n as usize))]
    min_questions: usize,
}

#[derive(Args, Debug)]
struct SynthArgs {
    /// The directory to write (corpus.jsonl, queries.jsonl, qrels/); must not exist.
    out: PathBuf,
    /// The world: `companies` (companies, founders, towns; 1 to 3 searches)
    /// or `services` (services, teams, people, incidents; 1 to 4 searches).
    #[arg(long, default_value = "companies", value_parser = ["companies", "services"])]
    family: String,
    /// Seeds names, links and splits: the same seed writes the same bytes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Subjects of the questions (companies, or services); each gives four
    /// questions (one per type).
    #[arg(long, visible_alias = "companies", default_value_t = 200)]
    size: usize,
}

pub fn run(args: DataArgs) -> anyhow::Result<()> {
    match args.command {
        DataCommand::Synth(args) => synth(args),
        DataCommand::Divide(args) => divide(args),
    }
}

fn divide(args: DivideArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.out.exists(), "{} already exists; choose a new directory", args.out.display());
    let source = sleuth_beir::BeirDir::new(&args.source);
    let division =
        sleuth_beir::divide::write_divided(&source, &args.from, &args.into, args.seed, args.min_questions, &args.out)?;
    let parts: Vec<String> =
        args.into.iter().map(|p| format!("{} {}", p.name, division.parts[&p.name].len())).collect();
    println!("wrote {}: split {} divided into {}", args.out.display(), args.from, parts.join(", "));
    let shown: Vec<String> = division.hubs.iter().take(5).map(|(d, n)| format!("{d} ({n})")).collect();
    let hubs = match division.hubs.len() {
        0 => "no hub document".to_owned(),
        n => format!(
            "{n} hub documents judged by many questions, whose questions may fall in any part: {}",
            shown.join(", ")
        ),
    };
    println!(
        "  questions sharing a judged document kept together in groups of up to {}; {hubs}",
        division.largest_group
    );
    Ok(())
}

fn synth(args: SynthArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.out.exists(), "{} already exists; choose a new directory", args.out.display());
    let made = sleuth_beir::synth::write(
        &args.out,
        sleuth_beir::synth::SynthSpec {
            family: sleuth_beir::synth::Family::parse(&args.family)?,
            seed: args.seed,
            size: args.size,
        },
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
