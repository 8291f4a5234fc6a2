//! Assembling the tensors of an `UpdateWeights` stream, checked against the
//! served model as each chunk arrives: a stream can make the server hold at
//! most one copy of the model's parameters (in the dtypes it sends), never
//! whatever a peer announces.

use std::collections::{BTreeMap, HashMap};

use sleuth_proto::policy::v1 as pb;
use tch::Kind;

use crate::engine::RawTensor;
use crate::error::Error;

/// The parameters a model has: name to shape.
pub type Parameters = BTreeMap<String, Vec<i64>>;

/// A tensor being received.
struct Partial {
    kind: Kind,
    shape: Vec<i64>,
    /// Bytes the whole tensor has (shape product times element size).
    expected: usize,
    data: Vec<u8>,
}

/// The tensors of one stream, as they arrive.
pub struct Assembly<'a> {
    parameters: &'a Parameters,
    /// Distinct tensors the header announced.
    tensor_count: usize,
    tensors: HashMap<String, Partial>,
    /// Bytes received so far.
    pub bytes_received: u64,
}

/// The element kind and size of a wire dtype.
fn dtype(value: i32) -> Result<(Kind, usize), Error> {
    match pb::DType::try_from(value) {
        Ok(pb::DType::DtypeF32) => Ok((Kind::Float, 4)),
        Ok(pb::DType::DtypeBf16) => Ok((Kind::BFloat16, 2)),
        Ok(pb::DType::DtypeF16) => Ok((Kind::Half, 2)),
        _ => Err(Error::InvalidArgument(format!("tensor dtype {value} is not one of F32, BF16, F16"))),
    }
}

fn invalid(message: String) -> Error {
    Error::InvalidArgument(message)
}

impl<'a> Assembly<'a> {
    /// Starts a stream whose header announced `tensor_count` tensors.
    pub fn new(parameters: &'a Parameters, tensor_count: u32) -> Result<Self, Error> {
        let tensor_count = tensor_count as usize;
        if tensor_count == 0 || tensor_count > parameters.len() {
            return Err(invalid(format!(
                "tensor_count {tensor_count} must be from 1 to the model's {} parameters (or send a checkpoint_uri)",
                parameters.len()
            )));
        }
        Ok(Self { parameters, tensor_count, tensors: HashMap::new(), bytes_received: 0 })
    }

    /// Adds one chunk: of a parameter of the model, in its shape, continuing
    /// what arrived of that tensor and not past its end.
    pub fn add(&mut self, chunk: pb::TensorChunk) -> Result<(), Error> {
        let name = &chunk.name;
        let Some(model_shape) = self.parameters.get(name) else {
            return Err(invalid(format!("tensor {:?} is not a parameter of the model", shorten(name))));
        };
        let (kind, size) = dtype(chunk.dtype)?;
        let shape: Vec<i64> = chunk.shape.iter().map(|&d| i64::try_from(d).unwrap_or(-1)).collect();
        if &shape != model_shape {
            return Err(invalid(format!(
                "tensor {name:?} has shape {:?}, the model's is {model_shape:?}",
                chunk.shape
            )));
        }
        if !self.tensors.contains_key(name) && self.tensors.len() == self.tensor_count {
            return Err(invalid(format!(
                "tensor {name:?} is one more than the header's tensor_count {}",
                self.tensor_count
            )));
        }
        let partial = self.tensors.entry(name.clone()).or_insert_with(|| {
            let expected = model_shape.iter().product::<i64>().max(0) as usize * size;
            Partial { kind, shape, expected, data: Vec::new() }
        });
        if partial.kind != kind {
            return Err(invalid(format!("tensor {name:?}: a chunk changes its dtype")));
        }
        if partial.data.len() as u64 != chunk.byte_offset {
            return Err(invalid(format!(
                "tensor {name:?}: chunk at byte_offset {} does not continue the {} bytes received",
                chunk.byte_offset,
                partial.data.len()
            )));
        }
        if partial.data.len() + chunk.data.len() > partial.expected {
            return Err(invalid(format!(
                "tensor {name:?}: {} bytes would pass its {} bytes",
                partial.data.len() + chunk.data.len(),
                partial.expected
            )));
        }
        self.bytes_received += chunk.data.len() as u64;
        partial.data.extend_from_slice(&chunk.data);
        Ok(())
    }

    /// The tensors, once every announced one arrived whole.
    pub fn finish(self) -> Result<Vec<RawTensor>, Error> {
        if self.tensors.len() != self.tensor_count {
            return Err(invalid(format!(
                "header announced tensor_count {} but {} tensors arrived",
                self.tensor_count,
                self.tensors.len()
            )));
        }
        let mut tensors = Vec::with_capacity(self.tensors.len());
        for (name, Partial { kind, shape, expected, data }) in self.tensors {
            if data.len() != expected {
                return Err(invalid(format!(
                    "tensor {name:?}: {} bytes for shape {shape:?} ({expected} expected)",
                    data.len()
                )));
            }
            tensors.push(RawTensor { name, kind, shape, data });
        }
        Ok(tensors)
    }
}

/// A name cut for an error message.
fn shorten(name: &str) -> &str {
    let end = name.char_indices().nth(120).map_or(name.len(), |(at, _)| at);
    &name[..end]
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn parameters() -> Parameters {
        [("a".to_owned(), vec![2, 3]), ("b".to_owned(), vec![4])].into()
    }

    fn chunk(name: &str, shape: &[u64], byte_offset: u64, bytes: usize) -> pb::TensorChunk {
        pb::TensorChunk {
            name: name.into(),
            dtype: pb::DType::DtypeF32 as i32,
            shape: shape.to_vec(),
            byte_offset,
            data: vec![0; bytes],
        }
    }

    #[test]
    fn whole_tensors_in_chunks_assemble() {
        let parameters = parameters();
        let mut assembly = Assembly::new(&parameters, 2).unwrap();
        assembly.add(chunk("a", &[2, 3], 0, 16)).unwrap();
        assembly.add(chunk("a", &[2, 3], 16, 8)).unwrap();
        assembly.add(chunk("b", &[4], 0, 16)).unwrap();
        assert_eq!(assembly.bytes_received, 40);
        assert_eq!(assembly.finish().unwrap().len(), 2);
    }

    #[test]
    fn bad_streams_are_refused_before_buffering() {
        let parameters = parameters();
        let refused = |chunks: Vec<pb::TensorChunk>, count: u32| -> String {
            let mut assembly = match Assembly::new(&parameters, count) {
                Ok(assembly) => assembly,
                Err(error) => return error.to_string(),
            };
            for chunk in chunks {
                if let Err(error) = assembly.add(chunk) {
                    return error.to_string();
                }
            }
            assembly.finish().err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(refused(vec![], 3).contains("tensor_count 3"));
        assert!(refused(vec![chunk("c", &[1], 0, 4)], 1).contains("not a parameter"));
        assert!(refused(vec![chunk("a", &[3, 2], 0, 4)], 1).contains("shape"));
        assert!(refused(vec![chunk("a", &[2, 3], 0, 1 << 20)], 1).contains("would pass its 24 bytes"));
        assert!(refused(vec![chunk("a", &[2, 3], 8, 4)], 1).contains("does not continue"));
        assert!(refused(vec![chunk("a", &[2, 3], 0, 24), chunk("b", &[4], 0, 16)], 1).contains("one more"));
        assert!(refused(vec![chunk("a", &[2, 3], 0, 20)], 1).contains("20 bytes for shape"));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

        /// Any stream: a clear error or whole tensors, never a panic, and never
        /// more bytes held than the model's parameters take in F32.
        #[test]
        fn any_stream_is_bounded_and_never_panics(
            count in 0u32..4,
            chunks in proptest::collection::vec(
                (prop_oneof![Just("a".to_owned()), Just("b".to_owned()), "\\PC{0,8}"],
                 -1i32..5,
                 proptest::collection::vec(prop_oneof![Just(2u64), Just(3), Just(4), any::<u64>()], 0..3),
                 prop_oneof![Just(0u64), Just(8), Just(16), any::<u64>()],
                 0usize..40),
                0..8),
        ) {
            let parameters = parameters();
            let Ok(mut assembly) = Assembly::new(&parameters, count) else { return Ok(()) };
            for (name, dtype, shape, byte_offset, bytes) in chunks {
                let chunk = pb::TensorChunk { name, dtype, shape, byte_offset, data: vec![1; bytes] };
                if assembly.add(chunk).is_err() {
                    break;
                }
                let held: usize = assembly.tensors.values().map(|t| t.data.len()).sum();
                prop_assert!(held <= (6 + 4) * 4);
            }
            let _ = assembly.finish();
        }
    }
}
