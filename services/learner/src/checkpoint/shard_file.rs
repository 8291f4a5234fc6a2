//! A shard's file: safetensors bytes holding this rank's chunk of the
//! parameters and its AdamW state, written and decoded here.

use tch::{Device, Kind, Tensor};

use super::CheckpointError;
use crate::shard::Shard;

/// Encodes named 1-D f32 tensors as safetensors bytes.
pub(super) fn safetensors_bytes(tensors: &[(&str, Tensor)]) -> Result<Vec<u8>, CheckpointError> {
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

/// The SHA-256 of shard bytes, as [`Meta::shard_sha256`] records it.
pub fn digest(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A shard from its safetensors bytes: three 1-D f32-convertible tensors of
/// one length (`params`, `exp_avg`, `exp_avg_sq`) and the optimizer's step
/// (one integer; the checkpoint's step when absent). Anything else is
/// [`CheckpointError::Corrupt`], never a panic.
pub(super) fn decode_shard(
    bytes: &[u8],
    key: &str,
    default_step: u64,
    device: Device,
) -> Result<Shard, CheckpointError> {
    let corrupt = |message: String| CheckpointError::Corrupt { key: key.to_owned(), message };
    let tensors = read_safetensors(bytes).map_err(|e| corrupt(format!("not a safetensors file: {e}")))?;
    let find = |name: &str| -> Result<Tensor, CheckpointError> {
        let tensor = tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
            .ok_or_else(|| corrupt(format!("has no tensor {name:?}")))?;
        if tensor.dim() != 1 || !tensor.is_floating_point() {
            return Err(corrupt(format!("{name} is {:?} {:?}, not a 1-D float tensor", tensor.kind(), tensor.size())));
        }
        Ok(tensor.to_kind(Kind::Float).to_device(device))
    };
    let step = match tensors.iter().find(|(n, _)| n == "step") {
        None => default_step,
        Some((_, t)) if t.numel() == 1 && !t.is_floating_point() => {
            // One element, whatever its shape ([], [1], [1, 1]): read through a view of one axis.
            u64::try_from(t.reshape([1]).f_int64_value(&[0])?).map_err(|_| corrupt("step is negative".into()))?
        }
        Some((_, t)) => return Err(corrupt(format!("step is {:?} {:?}, not one integer", t.kind(), t.size()))),
    };
    let (params, exp_avg, exp_avg_sq) = (find("params")?, find("exp_avg")?, find("exp_avg_sq")?);
    if exp_avg.numel() != params.numel() || exp_avg_sq.numel() != params.numel() {
        return Err(corrupt(format!(
            "params, exp_avg and exp_avg_sq have {}, {} and {} elements",
            params.numel(),
            exp_avg.numel(),
            exp_avg_sq.numel()
        )));
    }
    Ok(Shard { params, exp_avg, exp_avg_sq, step })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// One tensor a shard file might hold: a name, a dtype and a shape.
    fn tensor() -> impl Strategy<Value = (String, Tensor)> {
        let name = prop_oneof![Just("params"), Just("exp_avg"), Just("exp_avg_sq"), Just("step"), Just("other")];
        let kind = prop_oneof![Just(Kind::Float), Just(Kind::Double), Just(Kind::Int64), Just(Kind::BFloat16)];
        let shape = proptest::collection::vec(0i64..4, 0..3);
        (name, kind, shape)
            .prop_map(|(name, kind, shape)| (name.to_owned(), Tensor::ones(shape.as_slice(), (kind, Device::Cpu))))
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

        /// Whatever tensors a shard file holds, and whatever bytes replace
        /// part of it, decoding gives a consistent shard or Corrupt, never a
        /// panic (a one-element `step` of another shape used to panic).
        #[test]
        fn any_shard_file_decodes_or_is_corrupt(
            tensors in proptest::collection::vec(tensor(), 0..6),
            flip in proptest::option::of((any::<prop::sample::Index>(), any::<u8>())),
        ) {
            let mut unique: Vec<(String, Tensor)> = Vec::new();
            for (name, t) in tensors {
                if !unique.iter().any(|(n, _)| *n == name) {
                    unique.push((name, t));
                }
            }
            let named: Vec<(&str, Tensor)> = unique.iter().map(|(n, t)| (n.as_str(), t.shallow_clone())).collect();
            let mut bytes = safetensors_bytes(&named).unwrap();
            if let Some((at, value)) = flip {
                let i = at.index(bytes.len());
                bytes[i] = value;
            }
            match decode_shard(&bytes, "k", 3, Device::Cpu) {
                Ok(shard) => {
                    prop_assert_eq!(shard.params.dim(), 1);
                    prop_assert_eq!(shard.exp_avg.numel(), shard.params.numel());
                    prop_assert_eq!(shard.exp_avg_sq.numel(), shard.params.numel());
                }
                Err(CheckpointError::Corrupt { .. }) => {}
                Err(other) => prop_assert!(false, "not Corrupt: {other}"),
            }
        }
    }

    #[test]
    fn a_written_shard_decodes_to_itself() {
        let params = Tensor::from_slice(&[1.0f32, -2.0, 3.5]);
        let shard = Shard { exp_avg: params.zeros_like(), exp_avg_sq: params.ones_like(), params, step: 7 };
        let decoded = decode_shard(&shard_bytes(&shard).unwrap(), "k", 0, Device::Cpu).unwrap();
        assert_eq!(decoded.step, 7);
        assert!(decoded.params.equal(&shard.params) && decoded.exp_avg_sq.equal(&shard.exp_avg_sq));
    }
}
