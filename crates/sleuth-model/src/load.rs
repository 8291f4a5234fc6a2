//! Loading HF safetensors checkpoints into a `VarStore`: one
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::Deserialize;
use tch::nn::VarStore;

use crate::ModelError;

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

/// Fills every variable of `vars` from the checkpoint in `dir`. A variable the
/// checkpoint lacks, or a shape that differs, is an error naming it; tensors
/// the model does not use (rotary caches, `position_ids`) are ignored.
pub fn load_weights(vars: &mut VarStore, dir: &Path) -> Result<(), ModelError> {
    let single = dir.join("model.safetensors");
    let index_path = dir.join("model.safetensors.index.json");
    let shards: Vec<String> = if single.is_file() {
        vec!["model.safetensors".to_owned()]
    } else if index_path.is_file() {
        let text = std::fs::read_to_string(&index_path)
            .map_err(|source| ModelError::Io { path: index_path.display().to_string(), source })?;
        let index: ShardIndex = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config { path: index_path.display().to_string(), message: e.to_string() })?;
        index.weight_map.values().cloned().collect::<BTreeSet<_>>().into_iter().collect()
    } else {
        return Err(ModelError::Weights(format!(
            "{} has neither model.safetensors nor model.safetensors.index.json",
            dir.display()
        )));
    };
    let mut missing: Option<BTreeSet<String>> = None;
    for shard in &shards {
        let path = dir.join(shard);
        let not_in_shard: BTreeSet<String> = vars
            .load_partial(&path)
            .map_err(|e| ModelError::Weights(format!("{}: {e}", path.display())))?
            .into_iter()
            .collect();
        missing = Some(match missing {
            None => not_in_shard,
            Some(before) => before.intersection(&not_in_shard).cloned().collect(),
        });
    }
    match missing {
        Some(missing) if !missing.is_empty() => Err(ModelError::Weights(format!(
            "{} lacks {} parameter(s) the model needs, e.g. {}",
            dir.display(),
            missing.len(),
            missing.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
        ))),
        _ => Ok(()),
    }
}
