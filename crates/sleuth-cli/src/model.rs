//! `sleuth model import-gguf`: bring a GGUF file (llama.cpp's format) to
//! Sleuth as the HF directory the policy server and learner load.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, Subcommand, ValueEnum};
use sleuth_gguf::OutputDtype;

#[derive(Args, Debug)]
pub struct ModelArgs {
    #[command(subcommand)]
    command: ModelCommand,
}

#[derive(Subcommand, Debug)]
enum ModelCommand {
    /// Import a Llama/Qwen2/Qwen3 GGUF into an HF directory (config, safetensors, tokenizer, chat template).
    ImportGguf(ImportArgs),
}

#[derive(Args, Debug)]
struct ImportArgs {
    /// The .gguf file.
    gguf: PathBuf,
    /// The directory to create (must not exist).
    out: PathBuf,
    /// Weight dtype of the written checkpoint (quantised tensors are dequantised).
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum Dtype {
    F32,
    Bf16,
}

pub fn run(args: ModelArgs) -> anyhow::Result<()> {
    let ModelCommand::ImportGguf(args) = args.command;
    let dtype = match args.dtype {
        Dtype::F32 => OutputDtype::F32,
        Dtype::Bf16 => OutputDtype::Bf16,
    };
    let started = Instant::now();
    let mut last_percent = None;
    let summary = sleuth_gguf::import_hf_dir(&args.gguf, &args.out, dtype, &mut |done, total, _| {
        let percent = done * 100 / total.max(1);
        if last_percent.is_none_or(|last| percent >= last + 10 || done == total) {
            eprintln!("  {done}/{total} tensors ({percent}%)");
            last_percent = Some(percent);
        }
    })?;
    let types: Vec<String> = summary.source_types.iter().map(|(t, n)| format!("{n} {t}")).collect();
    println!(
        "imported {} ({} tensors: {}; {} parameters; vocabulary {}) into {} in {:.1}s",
        summary.architecture,
        summary.tensors,
        types.join(", "),
        summary.parameters,
        summary.vocab_size,
        summary.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
