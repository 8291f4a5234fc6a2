//! Checkpoints in a directory or under `s3://`, one folder per step:
//!
//! ```text
//! step-00000012/rank-0-of-2.safetensors   each rank's shard: params, exp_avg, exp_avg_sq
//! step-00000012/rank-1-of-2.safetensors
//! step-00000012/meta.json                 step, world size, stream position, counters
//! step-00000012/hf/...                    merged HF export (config, safetensors, tokenizer)
//! step-00000012/COMPLETE                  written last, after every rank's shard
//! ```
//!
//! `resume` takes the newest step with `COMPLETE`; a folder without it (a
//! crash while writing) is ignored. The RNG state is not saved: the learner
//! draws no random numbers (no dropout, no shuffling; steps are formed in
//! stream order), so there is none to restore.

use std::path::Path;

use serde::{Deserialize, Serialize};
use sleuth_store::ObjectStore;
use tch::{Device, Kind, Tensor};

use crate::shard::Shard;

const COMPLETE: &str = "COMPLETE";

/// What a checkpoint records besides tensors.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    pub step: u64,
    pub world_size: usize,
    /// The newest stream entry consumed by steps up to this one (`<ms>-<seq>`):
    /// after a restart, pending entries up to here are acknowledged, not retrained.
    pub stream_position: String,
    pub groups_consumed: u64,
    pub groups_dropped_stale: u64,
    pub groups_filtered: u64,
    pub groups_rejected: u64,
    pub created_unix: u64,
}

impl Meta {
    /// Groups taken off the stream by the steps up to this one: trained or dropped.
    pub fn groups_taken(&self) -> u64 {
        self.groups_consumed + self.groups_dropped_stale + self.groups_filtered + self.groups_rejected
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Store(#[from] sleuth_store::StoreError),
    #[error("checkpoint {key}: {message}")]
    Corrupt { key: String, message: String },
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub fn step_dir(step: u64) -> String {
    format!("step-{step:08}")
}

fn shard_key(step: u64, rank: usize, world: usize) -> String {
    format!("{}/rank-{rank}-of-{world}.safetensors", step_dir(step))
}

/// Encodes named 1-D f32 tensors as safetensors bytes.
fn safetensors_bytes(tensors: &[(&str, Tensor)]) -> Result<Vec<u8>, CheckpointError> {
    let scratch = tempfile::NamedTempFile::new()?;
    Tensor::write_safetensors(tensors, scratch.path())?;
    Ok(std::fs::read(scratch.path())?)
}

fn read_safetensors(bytes: &[u8]) -> Result<Vec<(String, Tensor)>, CheckpointError> {
    let scratch = tempfile::NamedTempFile::new()?;
    std::fs::write(scratch.path(), bytes)?;
    Ok(Tensor::read_safetensors(scratch.path())?)
}

/// This rank's shard as safetensors bytes (params, exp_avg, exp_avg_sq, step).
pub fn shard_bytes(shard: &Shard) -> Result<Vec<u8>, CheckpointError> {
    let cpu = |t: &Tensor| t.to_device(Device::Cpu);
    safetensors_bytes(&[
        ("params", cpu(&shard.params)),
        ("exp_avg", cpu(&shard.exp_avg)),
        ("exp_avg_sq", cpu(&shard.exp_avg_sq)),
        ("step", Tensor::from_slice(&[shard.step as i64])),
    ])
}

/// Writes this rank's shard of `step` (bytes from [`shard_bytes`]).
pub async fn save_shard(
    store: &ObjectStore,
    step: u64,
    rank: usize,
    world: usize,
    bytes: Vec<u8>,
) -> Result<(), CheckpointError> {
    store.put(&shard_key(step, rank, world), bytes).await?;
    Ok(())
}

/// Writes the merged HF export (rank 0) from a local directory written by
/// `sleuth_model::export::save_hf_dir`.
pub async fn save_export(store: &ObjectStore, step: u64, local: &Path) -> Result<(), CheckpointError> {
    for entry in std::fs::read_dir(local)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        store.put(&format!("{}/hf/{name}", step_dir(step)), std::fs::read(entry.path())?).await?;
    }
    Ok(())
}

/// Seals `step` (rank 0, after every rank saved its shard): meta, then COMPLETE.
pub async fn seal(store: &ObjectStore, meta: &Meta) -> Result<(), CheckpointError> {
    let dir = step_dir(meta.step);
    let json = serde_json::to_vec_pretty(meta)
        .map_err(|e| CheckpointError::Corrupt { key: dir.clone(), message: e.to_string() })?;
    store.put(&format!("{dir}/meta.json"), json).await?;
    store.put(&format!("{dir}/{COMPLETE}"), Vec::new()).await?;
    Ok(())
}

/// Steps with a COMPLETE marker, oldest first.
pub async fn complete_steps(store: &ObjectStore) -> Result<Vec<u64>, CheckpointError> {
    let mut steps: Vec<u64> = store
        .list("step-")
        .await?
        .iter()
        .filter_map(|key| key.strip_suffix(&format!("/{COMPLETE}")))
        .filter_map(|dir| dir.strip_prefix("step-")?.parse().ok())
        .collect();
    steps.sort_unstable();
    Ok(steps)
}

/// The newest complete checkpoint's meta, if any.
pub async fn latest(store: &ObjectStore) -> Result<Option<Meta>, CheckpointError> {
    let Some(&step) = complete_steps(store).await?.last() else { return Ok(None) };
    let key = format!("{}/meta.json", step_dir(step));
    let bytes = store.get(&key).await?;
    serde_json::from_slice(&bytes).map(Some).map_err(|e| CheckpointError::Corrupt { key, message: e.to_string() })
}

/// This rank's shard of `meta`'s step.
pub async fn load_shard(
    store: &ObjectStore,
    meta: &Meta,
    rank: usize,
    world: usize,
    device: Device,
) -> Result<Shard, CheckpointError> {
    let key = shard_key(meta.step, rank, world);
    if meta.world_size != world {
        return Err(CheckpointError::Corrupt {
            key,
            message: format!(
                "was written by {} ranks, this run has WORLD_SIZE {world}; resume with the same world size",
                meta.world_size
            ),
        });
    }
    let tensors = read_safetensors(&store.get(&key).await?)?;
    let find =
        |name: &str| -> Result<Tensor, CheckpointError> {
            let tensor = tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t).ok_or_else(|| {
                CheckpointError::Corrupt { key: key.clone(), message: format!("has no tensor {name:?}") }
            })?;
            Ok(tensor.to_kind(Kind::Float).to_device(device))
        };
    let step = tensors.iter().find(|(n, _)| n == "step").map(|(_, t)| t.int64_value(&[0]) as u64).unwrap_or(meta.step);
    Ok(Shard { params: find("params")?, exp_avg: find("exp_avg")?, exp_avg_sq: find("exp_avg_sq")?, step })
}
