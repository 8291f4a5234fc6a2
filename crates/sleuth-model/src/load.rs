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

/// The shard files an index lists, each once. Names come from data (a
/// checkpoint may come from anywhere): each must be a plain file name in the
/// checkpoint's directory ending in `.safetensors`, never a path, so an index
/// cannot point the loader at other files.
pub fn shard_names(index_text: &str) -> Result<Vec<String>, String> {
    let index: ShardIndex = serde_json::from_str(index_text).map_err(|e| e.to_string())?;
    let names: BTreeSet<String> = index.weight_map.into_values().collect();
    for name in &names {
        let plain = Path::new(name).components().count() == 1
            && matches!(Path::new(name).components().next(), Some(std::path::Component::Normal(_)));
        if !plain || !name.ends_with(".safetensors") || name.contains(['/', '\\']) {
            return Err(format!("weight_map names shard {name:?}: shards must be file names ending in .safetensors"));
        }
    }
    if names.is_empty() {
        return Err("weight_map lists no shards".to_owned());
    }
    Ok(names.into_iter().collect())
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
        shard_names(&text).map_err(|message| ModelError::Config { path: index_path.display().to_string(), message })?
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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn shard_names_are_file_names_in_the_checkpoint() {
        let index = |name: &str| serde_json::json!({"weight_map": {"a": name, "b": "model-2.safetensors"}}).to_string();
        assert_eq!(shard_names(&index("model-1.safetensors")).unwrap(), ["model-1.safetensors", "model-2.safetensors"]);
        for bad in
            ["/etc/passwd.safetensors", "../x.safetensors", "sub/x.safetensors", "..", "x.bin", "C:\\x.safetensors"]
        {
            let error = shard_names(&index(bad)).unwrap_err();
            assert!(error.contains("must be file names"), "{bad}: {error}");
        }
        assert!(shard_names(r#"{"weight_map": {}}"#).unwrap_err().contains("no shards"));
    }

    /// A safetensors file: the header's length, the header, then `data`.
    fn safetensors(header: &str, declared: u64, data: &[u8]) -> Vec<u8> {
        [&declared.to_le_bytes()[..], header.as_bytes(), data].concat()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

        /// Any shard file (a header of any shape, lengths and offsets that lie,
        /// data cut short): tensors or an error from the loader, never a panic.
        #[test]
        fn any_safetensors_shard_loads_or_is_refused(
            dtype in prop_oneof![Just("F32"), Just("BF16"), Just("I64"), Just("X9")],
            shape in proptest::collection::vec(prop_oneof![Just(0u64), Just(2), Just(3), any::<u64>()], 0..3),
            offsets in (prop_oneof![Just(0u64), Just(8), any::<u64>()], prop_oneof![Just(24u64), Just(8), any::<u64>()]),
            lie in prop_oneof![Just(0i64), -4i64..4, Just(i64::MAX / 2)],
            data in proptest::collection::vec(any::<u8>(), 0..48),
            noise in "\\PC{0,12}",
        ) {
            let header = serde_json::json!({"w": {"dtype": dtype, "shape": shape, "data_offsets": [offsets.0, offsets.1]}})
                .to_string();
            let declared = (header.len() as i64).saturating_add(lie).max(0) as u64;
            let scratch = tempfile::tempdir().unwrap();
            for (i, bytes) in [safetensors(&header, declared, &data), safetensors(&noise, noise.len() as u64, &data)]
                .into_iter()
                .enumerate()
            {
                let path = scratch.path().join(format!("{i}.safetensors"));
                std::fs::write(&path, bytes).unwrap();
                let _ = tch::Tensor::read_safetensors(&path);
            }
        }

        /// Any index text: plain shard names or a clear error, never a panic
        /// and never a name that leaves the checkpoint's directory.
        #[test]
        fn any_index_yields_plain_names_or_an_error(
            names in proptest::collection::vec(prop_oneof![
                "[a-z0-9.-]{1,12}\\.safetensors", "\\PC{0,16}", Just("../../x.safetensors".to_owned())], 0..4),
            noise in "\\PC{0,24}",
        ) {
            let map: serde_json::Map<String, serde_json::Value> =
                names.iter().enumerate().map(|(i, n)| (format!("w{i}"), serde_json::json!(n))).collect();
            let text = serde_json::json!({"weight_map": map}).to_string();
            if let Ok(shards) = shard_names(&text) {
                for shard in shards {
                    prop_assert!(Path::new("/ckpt").join(&shard).parent() == Some(Path::new("/ckpt")), "{shard}");
                }
            }
            let _ = shard_names(&noise);
            let _ = shard_names(&text.replace('"', &noise));
        }
    }
}
