//! The model a service runs and where: one set of flags and variables for
//! every libtorch service (the policy server, the learner).

use std::path::PathBuf;

use tch::Device;

use crate::{DeviceSpec, Dtype, DtypeSpec};

/// `--model` / `SLEUTH_MODEL`, `--device` / `SLEUTH_DEVICE`, `--dtype` / `SLEUTH_DTYPE`.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// HF-format model directory (config.json, safetensors, tokenizer).
    /// Default: the SmolLM2-135M-Instruct that `make setup` imports into
    /// ~/.cache/sleuth/models.
    #[arg(long = "model", env = "SLEUTH_MODEL")]
    pub dir: Option<PathBuf>,

    /// Device: auto (CUDA when present), cpu, cuda or cuda:N.
    #[arg(long, env = "SLEUTH_DEVICE", default_value = "auto")]
    pub device: DeviceSpec,

    /// Compute dtype: auto (bf16 where the device computes it natively:
    /// CUDA, CPUs with AVX512-BF16 or AMX; f32 elsewhere), f32 or bf16. The
    /// learner keeps parameter shards, gradients and AdamW state in f32
    /// (f64 for gradient sums) whatever this is.
    #[arg(long, env = "SLEUTH_DTYPE", default_value = "auto")]
    pub dtype: DtypeSpec,
}

impl ModelArgs {
    /// The model directory: the configured one, or the imported SmolLM2.
    pub fn directory(&self) -> PathBuf {
        self.dir.clone().unwrap_or_else(sleuth_kit::config::default_model_dir)
    }

    /// The dtype to compute in on `device`, logged with why.
    pub fn compute_dtype(&self, device: Device) -> Dtype {
        let dtype = self.dtype.resolve(device);
        tracing::info!(dtype = ?dtype.kind, requested = %self.dtype, reason = %dtype.reason, "compute dtype");
        dtype
    }
}
