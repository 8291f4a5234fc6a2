//! `sleuth model`: bring a model to Sleuth as the HF directory the policy
//! server, learner and inference gateway load.
//!
//! - `import-gguf` converts a GGUF file (llama.cpp's format).
//! - `fetch` provisions a pod (the chart's init container): from a local
//!   path (the image, a mounted claim) or `s3://`, an HF directory is copied
//!   and a `.gguf` file imported.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
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
    /// Provision an HF directory from a local path or s3:// (an HF directory, or a .gguf file to import).
    Fetch(FetchArgs),
}

#[derive(Args, Debug)]
struct FetchArgs {
    /// An HF model directory or a .gguf file: a local path, or s3://bucket/prefix
    /// (a directory) or s3://bucket/path/model.gguf.
    source: String,
    /// The directory to write. It appears complete or not at all; if it already
    /// holds a model fetched from the same source, nothing is done.
    out: PathBuf,
    /// Weight dtype when importing a GGUF.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
    #[command(flatten)]
    s3: sleuth_store::S3Args,
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

impl From<Dtype> for OutputDtype {
    fn from(dtype: Dtype) -> Self {
        match dtype {
            Dtype::F32 => OutputDtype::F32,
            Dtype::Bf16 => OutputDtype::Bf16,
        }
    }
}

pub async fn run(args: ModelArgs) -> anyhow::Result<()> {
    match args.command {
        ModelCommand::ImportGguf(args) => import(&args.gguf, &args.out, args.dtype.into()),
        ModelCommand::Fetch(args) => fetch(args).await,
    }
}

/// Where `fetch` records the source a directory came from, so a restarted
/// init container on the same volume does not fetch it again.
const SOURCE_MARKER: &str = ".sleuth-source";

async fn fetch(args: FetchArgs) -> anyhow::Result<()> {
    let FetchArgs { source, out, dtype, s3 } = args;
    if std::fs::read_to_string(out.join(SOURCE_MARKER)).is_ok_and(|marker| marker == source) {
        println!("{} already holds the model from {source}", out.display());
        return Ok(());
    }
    if out.exists() {
        anyhow::bail!(
            "{} exists and was not fetched from {source}; remove it or choose another directory",
            out.display()
        );
    }
    let name = out.file_name().with_context(|| format!("{} names no directory", out.display()))?;
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    // Written beside the target and renamed into place: a pod never starts
    // on half a model, and a failed fetch leaves nothing behind.
    let partial = parent.join(format!("{}.partial", name.to_string_lossy()));
    if partial.exists() {
        std::fs::remove_dir_all(&partial).with_context(|| format!("removing {}", partial.display()))?;
    }
    let started = Instant::now();
    eprintln!("fetching {source} into {}", out.display());
    let fetched = if source.ends_with(".gguf") {
        fetch_gguf(&source, &s3, &partial, dtype.into()).await
    } else {
        std::fs::create_dir(&partial).with_context(|| format!("creating {}", partial.display()))?;
        // Unbounded: the operator names the model to fetch.
        sleuth_store::object::fetch_model_dir(&source, &s3, &partial, None).await.map_err(anyhow::Error::from)
    };
    let checked = fetched.and_then(|()| check_model_dir(&partial));
    if let Err(error) = checked {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(error.context(format!("fetching the model from {source}")));
    }
    std::fs::write(partial.join(SOURCE_MARKER), &source)?;
    std::fs::rename(&partial, &out).with_context(|| format!("renaming {} to {}", partial.display(), out.display()))?;
    println!(
        "fetched {source} into {} ({} MB) in {:.1}s",
        out.display(),
        dir_bytes(&out)? >> 20,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Imports the GGUF at `source` (a local file, or an S3 object copied to a
/// scratch file beside `partial` first) into `partial`.
async fn fetch_gguf(source: &str, s3: &sleuth_store::S3Args, partial: &Path, dtype: OutputDtype) -> anyhow::Result<()> {
    if !source.starts_with("s3://") {
        return import(Path::new(source.strip_prefix("file://").unwrap_or(source)), partial, dtype);
    }
    let (dir, key) = source.rsplit_once('/').context("an s3:// GGUF needs a key")?;
    let bytes = sleuth_store::ObjectStore::open(dir, s3)?.get(key).await?;
    eprintln!("  downloaded {key} ({} MB)", bytes.len() >> 20);
    let scratch = tempfile::Builder::new().suffix(".gguf").tempfile_in(partial.parent().unwrap_or(Path::new(".")))?;
    std::fs::write(scratch.path(), bytes)?;
    import(scratch.path(), partial, dtype)
}

/// What every loader of an HF directory needs.
fn check_model_dir(dir: &Path) -> anyhow::Result<()> {
    for needed in ["config.json", "tokenizer.json"] {
        anyhow::ensure!(dir.join(needed).is_file(), "the model has no {needed}");
    }
    Ok(())
}

fn dir_bytes(dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        total += entry?.metadata()?.len();
    }
    Ok(total)
}

fn import(gguf: &Path, out: &Path, dtype: OutputDtype) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut last_percent = None;
    let summary = sleuth_gguf::import_hf_dir(gguf, out, dtype, &mut |done, total, _| {
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
