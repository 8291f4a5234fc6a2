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
//! Resuming takes the newest step with `COMPLETE` whose shards match the
//! SHA-256 digests its meta records; a folder without `COMPLETE` (a crash
//! while writing) is ignored, and a damaged one is passed over for the one
//! before it. [`prune`] keeps the newest few and the best by validation.
//! Local files are fsynced before they are renamed into place (the object
//! store's `put`), so a sealed checkpoint survives a power cut. The RNG state is not saved: the learner
//! draws no random numbers (no dropout, no shuffling; steps are formed in
//! stream order), so there is none to restore.

use std::path::Path;

use serde::{Deserialize, Serialize};
use sleuth_store::ObjectStore;
use tch::Device;

use crate::shard::Shard;

mod shard_file;
use shard_file::decode_shard;
pub use shard_file::{digest, shard_bytes};

const COMPLETE: &str = "COMPLETE";

/// What a checkpoint records besides tensors.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// The version the step's weights are published as.
    pub step: u64,
    /// How far the run's version numbers run ahead of its own optimizer
    /// steps: versions published without training (the run's start
    /// weights, numbered above whatever the servers held; weights
    /// republished after lost versions). 0 in checkpoints written before it
    /// was recorded, which numbered their steps from 0.
    #[serde(default)]
    pub version_offset: u64,
    pub world_size: usize,
    /// The newest stream entry consumed by steps up to this one (`<ms>-<seq>`):
    /// after a restart, pending entries up to here are acknowledged, not retrained.
    pub stream_position: String,
    pub groups_consumed: u64,
    pub groups_dropped_stale: u64,
    pub groups_filtered: u64,
    pub groups_rejected: u64,
    pub created_unix: u64,
    /// SHA-256 (hex) of each rank's shard, by rank: a resumed rank checks its
    /// shard against it. Empty in checkpoints written before digests were
    /// recorded (their shards are taken as they load).
    #[serde(default)]
    pub shard_sha256: Vec<String>,
    /// How the flattened model was cut into shards: [`SHARD_LAYOUT`] (one
    /// contiguous chunk per rank), or empty in checkpoints written before
    /// it, whose multi-rank shards cut each parameter separately.
    #[serde(default)]
    pub shard_layout: String,
}

/// The shard layout this learner writes and reads (see [`crate::shard::Layout`]).
pub const SHARD_LAYOUT: &str = "flat";

impl Meta {
    /// The run's own optimizer steps so far: what its learning-rate
    /// schedule and `max_steps` count, whatever versions came before.
    pub fn steps_trained(&self) -> u64 {
        self.step - self.version_offset
    }

    /// Publishes the same weights as `version` (above `step`): the steps
    /// trained stay what they were.
    pub fn renumber(&mut self, version: u64) {
        debug_assert!(version >= self.step, "versions only grow");
        self.version_offset += version - self.step;
        self.step = version;
    }

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
    #[error(
        "checkpoint {step} was written by {written} ranks, this run has WORLD_SIZE {world}; resume with the same world size"
    )]
    WorldSize { step: u64, written: usize, world: usize },
    #[error(
        "checkpoint {step} cut its {world} shards parameter by parameter (learners before c10d); this learner cannot \
         resume it with {world} ranks: resume it with one rank, or start afresh"
    )]
    OldLayout { step: u64, world: usize },
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

/// Writes this rank's shard of `step` (bytes from [`shard_bytes`]); returns
/// its [`digest`] for the meta that seals the step.
pub async fn save_shard(
    store: &ObjectStore,
    step: u64,
    rank: usize,
    world: usize,
    bytes: Vec<u8>,
) -> Result<String, CheckpointError> {
    let digest = digest(&bytes);
    store.put(&shard_key(step, rank, world), bytes).await?;
    Ok(digest)
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

/// The meta of complete checkpoint `step`.
pub async fn meta(store: &ObjectStore, step: u64) -> Result<Meta, CheckpointError> {
    let key = format!("{}/meta.json", step_dir(step));
    let bytes = store.get(&key).await?;
    serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Corrupt { key, message: e.to_string() })
}

impl CheckpointError {
    /// A fault of this checkpoint's files (unreadable, missing or not what was
    /// sealed), for which resuming from the one before is right; not one of
    /// the store or the run's settings, which would fail for every checkpoint.
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            Self::Corrupt { .. } | Self::Torch(_) | Self::Store(sleuth_store::StoreError::ObjectNotFound { .. })
        )
    }
}

/// Complete checkpoint `step`'s meta and this rank's shard of it.
pub async fn load(
    store: &ObjectStore,
    step: u64,
    rank: usize,
    world: usize,
    device: Device,
) -> Result<(Meta, Shard), CheckpointError> {
    let meta = meta(store, step).await?;
    if meta.world_size != world {
        return Err(CheckpointError::WorldSize { step, written: meta.world_size, world });
    }
    // One rank's shard is the whole flattened model in either layout.
    if world > 1 && meta.shard_layout != SHARD_LAYOUT {
        return Err(CheckpointError::OldLayout { step, world });
    }
    let shard = load_shard(store, &meta, rank, world, device).await?;
    Ok((meta, shard))
}

/// This rank's shard of `meta`'s step.
async fn load_shard(
    store: &ObjectStore,
    meta: &Meta,
    rank: usize,
    world: usize,
    device: Device,
) -> Result<Shard, CheckpointError> {
    let key = shard_key(meta.step, rank, world);
    let bytes = store.get(&key).await?;
    match meta.shard_sha256.get(rank) {
        Some(expected) => {
            let actual = digest(&bytes);
            if actual != *expected {
                return Err(CheckpointError::Corrupt {
                    key,
                    message: format!("SHA-256 {actual} differs from {expected} recorded when it was sealed"),
                });
            }
        }
        // Checkpoints that record their layout were written with every
        // rank's digest: one missing was removed, not forgotten.
        None if !meta.shard_layout.is_empty() => {
            return Err(CheckpointError::Corrupt {
                key,
                message: format!(
                    "its meta.json records no SHA-256 for rank {rank} (it lists {})",
                    meta.shard_sha256.len()
                ),
            });
        }
        None => {}
    }
    decode_shard(&bytes, &key, meta.step, device)
}

/// Deletes checkpoints no resume or user needs: complete ones older than the
/// newest `keep` except `best` (the version validation chose), and folders a
/// crash left unsealed below the newest complete step. The `COMPLETE` marker
/// goes first, so a deletion cut short never leaves a folder that looks whole.
/// `keep` 0 keeps every checkpoint. Returns the steps deleted.
pub async fn prune(store: &ObjectStore, keep: usize, best: Option<u64>) -> Result<Vec<u64>, CheckpointError> {
    let complete = complete_steps(store).await?;
    let Some(&newest) = complete.last() else { return Ok(Vec::new()) };
    if keep == 0 {
        return Ok(Vec::new());
    }
    let kept: Vec<u64> = complete.iter().rev().take(keep).copied().chain(best).collect();
    let mut steps: Vec<u64> = store
        .list("step-")
        .await?
        .iter()
        .filter_map(|key| key.split('/').next()?.strip_prefix("step-")?.parse().ok())
        .filter(|step| *step < newest && !kept.contains(step))
        .collect();
    steps.dedup();
    for &step in &steps {
        let dir = step_dir(step);
        store.delete(&format!("{dir}/{COMPLETE}")).await?;
        store.delete_folder(&dir).await?;
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use tch::{Kind, Tensor};

    use super::*;

    #[test]
    fn renumbering_keeps_the_steps_trained() {
        let mut meta = Meta::default();
        meta.renumber(5); // start weights published above an earlier run's versions
        assert_eq!((meta.step, meta.steps_trained()), (5, 0));
        meta.step += 3; // three steps trained
        meta.renumber(11); // versions 9 and 10 lost in a crash
        assert_eq!((meta.step, meta.steps_trained()), (11, 3));
        let old: Meta = serde_json::from_str(
            r#"{"step": 4, "world_size": 1, "stream_position": "", "groups_consumed": 0,
            "groups_dropped_stale": 0, "groups_filtered": 0, "groups_rejected": 0, "created_unix": 0}"#,
        )
        .unwrap();
        assert_eq!(old.steps_trained(), 4, "older checkpoints numbered from 0");
    }

    async fn seal_step(store: &ObjectStore, step: u64) {
        store.put(&shard_key(step, 0, 1), vec![1, 2, 3]).await.unwrap();
        seal(store, &Meta { step, world_size: 1, ..Meta::default() }).await.unwrap();
    }

    #[tokio::test]
    async fn pruning_keeps_the_newest_the_best_and_anything_being_written() {
        let scratch = tempfile::tempdir().unwrap();
        let store = ObjectStore::Local { root: scratch.path().to_owned() };
        for step in [1, 2, 3, 5] {
            seal_step(&store, step).await;
        }
        // A crash's leftover below the newest, and a step being written above it.
        for step in [4, 7] {
            store.put(&shard_key(step, 0, 1), vec![1]).await.unwrap();
        }
        assert_eq!(prune(&store, 0, None).await.unwrap(), Vec::<u64>::new(), "keep 0 keeps all");
        assert_eq!(prune(&store, 2, Some(1)).await.unwrap(), [2, 4]);
        assert_eq!(complete_steps(&store).await.unwrap(), [1, 3, 5]);
        assert!(!scratch.path().join(step_dir(2)).exists() && !scratch.path().join(step_dir(4)).exists());
        assert!(scratch.path().join(shard_key(7, 0, 1)).is_file());
    }

    /// A one-rank shard of four parameters, all 1, after one step.
    fn four_ones() -> Shard {
        Shard {
            params: Tensor::ones([4], (Kind::Float, Device::Cpu)),
            exp_avg: Tensor::zeros([4], (Kind::Float, Device::Cpu)),
            exp_avg_sq: Tensor::zeros([4], (Kind::Float, Device::Cpu)),
            step: 1,
        }
    }

    #[tokio::test]
    async fn a_shard_that_is_not_the_one_sealed_is_damage() {
        let scratch = tempfile::tempdir().unwrap();
        let store = ObjectStore::Local { root: scratch.path().to_owned() };
        let bytes = shard_bytes(&four_ones()).unwrap();
        let sealed = Meta { step: 1, world_size: 1, shard_sha256: vec![digest(&bytes)], ..Meta::default() };
        save_shard(&store, 1, 0, 1, bytes.clone()).await.unwrap();
        seal(&store, &sealed).await.unwrap();
        let (meta, loaded) = load(&store, 1, 0, 1, Device::Cpu).await.unwrap();
        assert_eq!(meta, sealed);
        assert_eq!(loaded.params.sum(Kind::Float).double_value(&[]), 4.0);

        let mut flipped = bytes;
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        save_shard(&store, 1, 0, 1, flipped).await.unwrap();
        let error = load(&store, 1, 0, 1, Device::Cpu).await.unwrap_err();
        assert!(error.is_damage() && error.to_string().contains("SHA-256"), "{error}");
        let error = load(&store, 1, 0, 2, Device::Cpu).await.unwrap_err();
        assert!(!error.is_damage() && error.to_string().contains("WORLD_SIZE 2"), "{error}");
        store.delete(&shard_key(1, 0, 1)).await.unwrap();
        assert!(load(&store, 1, 0, 1, Device::Cpu).await.unwrap_err().is_damage(), "a missing shard");
    }

    /// A crash after a file is written but before it is renamed into place
    /// (a fault at that point) leaves its step unsealed: the checkpoint
    /// before it is still the newest complete one and loads, and the step
    /// is written whole when the learner comes back.
    #[tokio::test]
    async fn a_crash_between_write_and_rename_leaves_the_step_unsealed() {
        let scratch = tempfile::tempdir().unwrap();
        let store = ObjectStore::Local { root: scratch.path().to_owned() };
        let bytes = shard_bytes(&four_ones()).unwrap();
        let sealed = |step| Meta { step, world_size: 1, shard_sha256: vec![digest(&bytes)], ..Meta::default() };
        save_shard(&store, 1, 0, 1, bytes.clone()).await.unwrap();
        seal(&store, &sealed(1)).await.unwrap();

        save_shard(&store, 2, 0, 1, bytes.clone()).await.unwrap();
        sleuth_kit::fault::arm("object-store.put.before-rename", 1);
        let crashed = tokio::spawn({
            let (store, meta) = (store.clone(), sealed(2));
            async move { seal(&store, &meta).await }
        })
        .await;
        assert!(crashed.is_err_and(|e| e.is_panic()), "the fault struck in the middle of sealing");
        assert_eq!(complete_steps(&store).await.unwrap(), [1]);
        assert!(!scratch.path().join(step_dir(2)).join("meta.json").exists(), "no half-written meta in place");
        let (meta, loaded) = load(&store, 1, 0, 1, Device::Cpu).await.unwrap();
        assert_eq!((meta.step, loaded.params.numel()), (1, 4));

        seal(&store, &sealed(2)).await.unwrap();
        assert_eq!(complete_steps(&store).await.unwrap(), [1, 2]);
        assert_eq!(load(&store, 2, 0, 1, Device::Cpu).await.unwrap().0, sealed(2));
    }
}
