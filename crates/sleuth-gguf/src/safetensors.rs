//! A streaming safetensors writer: the header is computed from the shapes up
//! front, then tensors are written one at a time, so importing a model needs
//! memory for one tensor, not the whole checkpoint.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use serde_json::{Map, Value, json};

/// The dtypes the importer writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::Bf16 => "BF16",
        }
    }

    pub fn size(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }
}

pub struct Writer {
    out: BufWriter<File>,
    /// Names in the order their data must arrive, with their byte lengths.
    pending: std::collections::VecDeque<(String, u64)>,
    dtype: Dtype,
}

impl Writer {
    /// `tensors`: name and row-major shape of every tensor, in write order.
    pub fn create(path: &Path, dtype: Dtype, tensors: &[(String, Vec<u64>)]) -> std::io::Result<Self> {
        let mut header = Map::new();
        header.insert("__metadata__".into(), json!({ "format": "pt" }));
        let mut offset = 0u64;
        let mut pending = std::collections::VecDeque::new();
        for (name, shape) in tensors {
            let len = shape.iter().product::<u64>() * dtype.size();
            header.insert(
                name.clone(),
                json!({ "dtype": dtype.name(), "shape": shape, "data_offsets": [offset, offset + len] }),
            );
            pending.push_back((name.clone(), len));
            offset += len;
        }
        let mut header = serde_json::to_vec(&Value::Object(header))?;
        // The data section starts 8-byte aligned; the format pads the header with spaces.
        header.resize(header.len().div_ceil(8) * 8, b' ');
        let mut out = BufWriter::with_capacity(1 << 20, File::create(path)?);
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        Ok(Writer { out, pending, dtype })
    }

    /// Writes the next tensor's values, converting to the file's dtype.
    pub fn write(&mut self, name: &str, values: &[f32]) -> std::io::Result<()> {
        let (expected, len) = self.pending.pop_front().expect("more tensors written than declared");
        assert_eq!(expected, name, "tensors written out of the declared order");
        assert_eq!(len, values.len() as u64 * self.dtype.size(), "{name}: element count differs from its shape");
        match self.dtype {
            Dtype::F32 => values.iter().try_for_each(|v| self.out.write_all(&v.to_le_bytes())),
            Dtype::Bf16 => {
                values.iter().try_for_each(|v| self.out.write_all(&half::bf16::from_f32(*v).to_bits().to_le_bytes()))
            }
        }
    }

    pub fn finish(mut self) -> std::io::Result<()> {
        assert!(self.pending.is_empty(), "declared tensors never written: {:?}", self.pending);
        self.out.flush()?;
        self.out.into_inner().map_err(|e| e.into_error())?.sync_all()
    }
}
