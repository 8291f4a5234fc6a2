//! The GGUF container: header, metadata key/values, tensor directory, and
//! reading one tensor's bytes at a time (a model never has to fit in memory
//! twice).
//!
//! Layout (little-endian, versions 2 and 3): magic `GGUF`, version u32,
//! tensor count u64, metadata count u64, the metadata, then per tensor its
//! name, dimensions (innermost first), type and offset; the data section
//! starts at the next multiple of `general.alignment` (32 by default).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::GgufError;
use crate::dequant::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Far beyond any real file; guards allocations against a corrupt length field.
const MAX_STRING: u64 = 1 << 30;
const MAX_DIMS: u32 = 8;
/// Arrays inside arrays at most this deep (real files nest none): a crafted
/// file cannot recurse the reader off its stack.
const MAX_NESTING: u32 = 4;

/// One metadata value. Integers keep their sign; every width is widened.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Unsigned(u64),
    Signed(i64),
    Float(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Unsigned(v) => Some(v),
            Value::Signed(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(v) => Some(v),
            Value::Unsigned(v) => Some(v as f64),
            Value::Signed(v) => Some(v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions as GGUF stores them: innermost (contiguous) first, the
    /// reverse of the row-major shape PyTorch and safetensors use.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset within the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Elements in the tensor (saturating: a crafted directory's dimensions
    /// then fail the extent check instead of overflowing).
    pub fn elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |product, &dim| product.saturating_mul(dim))
    }

    /// Row-major shape (outermost first), as in the HF checkpoint.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    pub fn byte_len(&self) -> u64 {
        self.ggml_type.byte_len(self.elements())
    }
}

#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    data_start: u64,
    file_len: u64,
}

impl GgufFile {
    /// Reads the header, metadata and tensor directory, and checks that every
    /// tensor's type is known and its bytes lie inside the file.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io { path: path.display().to_string(), source };
        let file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        Self::read_from(BufReader::new(file), file_len, path)
    }

    /// [`GgufFile::open`] over any reader of a file of `file_len` bytes
    /// (`path` names it in errors and for reading tensors later).
    pub fn read_from<R: Read + Seek>(inner: R, file_len: u64, path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io { path: path.display().to_string(), source };
        let mut reader = Reader { inner, path };

        let mut magic = [0u8; 4];
        reader.bytes(&mut magic)?;
        if &magic != MAGIC {
            return Err(reader.format(format!("magic bytes {magic:?}, expected \"GGUF\"")));
        }
        let version = reader.u32()?;
        if !(2..=3).contains(&version) {
            // A big-endian file reads as a huge version here.
            return Err(reader.format(format!("version {version}; versions 2 and 3 (little-endian) are supported")));
        }
        let tensor_count = reader.u64()?;
        let kv_count = reader.u64()?;

        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = reader.string()?;
            let kind = reader.u32()?;
            let value = reader.value(kind, &key, 0)?;
            metadata.insert(key, value);
        }

        let mut tensors = Vec::with_capacity(tensor_count.min(1 << 16) as usize);
        for _ in 0..tensor_count {
            let name = reader.string()?;
            let n_dims = reader.u32()?;
            if n_dims > MAX_DIMS {
                return Err(reader.format(format!("tensor {name} has {n_dims} dimensions")));
            }
            let dims = (0..n_dims).map(|_| reader.u64()).collect::<Result<Vec<_>, _>>()?;
            let type_id = reader.u32()?;
            let offset = reader.u64()?;
            let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| GgufError::Tensor {
                path: path.display().to_string(),
                tensor: name.clone(),
                reason: format!("ggml type {type_id} is not supported ({})", GgmlType::supported_names()),
            })?;
            tensors.push(TensorInfo { name, dims, ggml_type, offset });
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(value) => {
                value.as_u64().filter(|a| *a > 0 && a.is_power_of_two()).ok_or_else(|| GgufError::Metadata {
                    path: path.display().to_string(),
                    key: "general.alignment".into(),
                    reason: format!("{value:?} is not a power of two"),
                })?
            }
        };
        let position = reader.inner.stream_position().map_err(io)?;
        let data_start = position.div_ceil(alignment) * alignment;

        let file = GgufFile { path: path.to_owned(), version, metadata, tensors, data_start, file_len };
        for tensor in &file.tensors {
            file.check_extent(tensor)?;
        }
        Ok(file)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn check_extent(&self, tensor: &TensorInfo) -> Result<(), GgufError> {
        let block = tensor.ggml_type.block_elements();
        let reason = if tensor.dims.first().is_some_and(|inner| !inner.is_multiple_of(block)) {
            Some(format!(
                "innermost dimension {} is not a multiple of {}'s block of {block}",
                tensor.dims[0],
                tensor.ggml_type.name()
            ))
        } else if self.data_start.saturating_add(tensor.offset).saturating_add(tensor.byte_len()) > self.file_len {
            Some(format!(
                "data [{}, +{}) runs past the end of the file ({} bytes); truncated download?",
                self.data_start.saturating_add(tensor.offset),
                tensor.byte_len(),
                self.file_len
            ))
        } else {
            None
        };
        match reason {
            Some(reason) => Err(self.tensor_error(tensor, reason)),
            None => Ok(()),
        }
    }

    pub(crate) fn tensor_error(&self, tensor: &TensorInfo, reason: String) -> GgufError {
        GgufError::Tensor { path: self.path.display().to_string(), tensor: tensor.name.clone(), reason }
    }

    /// The tensor's raw bytes, as stored (quantised blocks included).
    pub fn read_raw(&self, tensor: &TensorInfo) -> Result<Vec<u8>, GgufError> {
        let io = |source| GgufError::Io { path: self.path.display().to_string(), source };
        let mut file = File::open(&self.path).map_err(io)?;
        file.seek(SeekFrom::Start(self.data_start + tensor.offset)).map_err(io)?;
        let mut bytes = vec![0u8; tensor.byte_len() as usize];
        file.read_exact(&mut bytes).map_err(io)?;
        Ok(bytes)
    }

    /// The tensor dequantised to f32, in GGUF's (row-major, innermost-last) order.
    pub fn read_f32(&self, tensor: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        let raw = self.read_raw(tensor)?;
        let mut out = vec![0f32; tensor.elements() as usize];
        tensor.ggml_type.dequantize(&raw, &mut out);
        Ok(out)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub(crate) fn metadata_error(&self, key: &str, reason: String) -> GgufError {
        GgufError::Metadata { path: self.path.display().to_string(), key: key.to_owned(), reason }
    }

    pub(crate) fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| self.metadata_error(key, "missing".into()))
    }

    pub(crate) fn require_u64(&self, key: &str) -> Result<u64, GgufError> {
        let value = self.require(key)?;
        value.as_u64().ok_or_else(|| self.metadata_error(key, format!("{value:?} is not an unsigned integer")))
    }

    pub(crate) fn require_str(&self, key: &str) -> Result<&str, GgufError> {
        let value = self.require(key)?;
        value.as_str().ok_or_else(|| self.metadata_error(key, format!("{value:?} is not a string")))
    }

    pub(crate) fn optional_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.get(key)
            .map(|value| value.as_f64().ok_or_else(|| self.metadata_error(key, format!("{value:?} is not a number"))))
            .transpose()
    }

    pub(crate) fn optional_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get(key).map(|_| self.require_u64(key)).transpose()
    }

    /// A string array (tokens, merges), each item checked.
    pub(crate) fn strings(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let value = self.require(key)?;
        let items = value.as_array().ok_or_else(|| self.metadata_error(key, "is not an array".into()))?;
        items
            .iter()
            .enumerate()
            .map(|(i, item)| item.as_str().ok_or_else(|| self.metadata_error(key, format!("item {i} is not a string"))))
            .collect()
    }
}

struct Reader<'a, R> {
    inner: R,
    path: &'a Path,
}

impl<R: Read> Reader<'_, R> {
    fn format(&self, reason: String) -> GgufError {
        GgufError::Format { path: self.path.display().to_string(), reason }
    }

    fn bytes(&mut self, buf: &mut [u8]) -> Result<(), GgufError> {
        self.inner.read_exact(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => self.format("file ends inside the header".into()),
            _ => GgufError::Io { path: self.path.display().to_string(), source: e },
        })
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut buf = [0u8; N];
        self.bytes(&mut buf)?;
        Ok(buf)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let len = self.u64()?;
        if len > MAX_STRING {
            return Err(self.format(format!("string length {len}")));
        }
        let mut buf = vec![0u8; len as usize];
        self.bytes(&mut buf)?;
        String::from_utf8(buf).map_err(|e| self.format(format!("string is not UTF-8: {e}")))
    }

    fn value(&mut self, kind: u32, key: &str, depth: u32) -> Result<Value, GgufError> {
        Ok(match kind {
            0 => Value::Unsigned(u8::from_le_bytes(self.array()?).into()),
            1 => Value::Signed(i8::from_le_bytes(self.array()?).into()),
            2 => Value::Unsigned(u16::from_le_bytes(self.array()?).into()),
            3 => Value::Signed(i16::from_le_bytes(self.array()?).into()),
            4 => Value::Unsigned(self.u32()?.into()),
            5 => Value::Signed(i32::from_le_bytes(self.array()?).into()),
            6 => Value::Float(f32::from_le_bytes(self.array()?).into()),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                let item_kind = self.u32()?;
                let len = self.u64()?;
                if len > MAX_STRING {
                    return Err(self.format(format!("metadata {key}: array length {len}")));
                }
                if item_kind == 9 && depth >= MAX_NESTING {
                    return Err(self.format(format!("metadata {key}: arrays nested more than {MAX_NESTING} deep")));
                }
                let items = (0..len).map(|_| self.value(item_kind, key, depth + 1)).collect::<Result<Vec<_>, _>>()?;
                Value::Array(items)
            }
            10 => Value::Unsigned(self.u64()?),
            11 => Value::Signed(i64::from_le_bytes(self.array()?)),
            12 => Value::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(self.format(format!("metadata {key}: unknown value type {other}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use proptest::prelude::*;

    use super::*;

    /// A header: magic, version, counts, one metadata entry and tensor
    /// directory entries, written from parts a fuzzer picks.
    fn header(version: u32, kv: &[(u32, Vec<u8>)], tensors: &[(Vec<u64>, u32, u64)]) -> Vec<u8> {
        let mut bytes = MAGIC.to_vec();
        bytes.extend(version.to_le_bytes());
        bytes.extend((tensors.len() as u64).to_le_bytes());
        bytes.extend((kv.len() as u64).to_le_bytes());
        for (i, (kind, value)) in kv.iter().enumerate() {
            let key = format!("k{i}");
            bytes.extend((key.len() as u64).to_le_bytes());
            bytes.extend(key.as_bytes());
            bytes.extend(kind.to_le_bytes());
            bytes.extend(value);
        }
        for (i, (dims, type_id, offset)) in tensors.iter().enumerate() {
            let name = format!("t{i}");
            bytes.extend((name.len() as u64).to_le_bytes());
            bytes.extend(name.as_bytes());
            bytes.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| bytes.extend(d.to_le_bytes()));
            bytes.extend(type_id.to_le_bytes());
            bytes.extend(offset.to_le_bytes());
        }
        bytes
    }

    fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        let len = bytes.len() as u64;
        GgufFile::read_from(Cursor::new(bytes), len, Path::new("fuzz.gguf"))
    }

    #[test]
    fn crafted_directories_are_refused_not_overflowed() {
        let huge = header(3, &[], &[(vec![1 << 40, 1 << 40], 0, 0)]);
        assert!(parse(huge).unwrap_err().to_string().contains("runs past the end"));
        let far = header(3, &[], &[(vec![32], 0, u64::MAX - 4)]);
        assert!(parse(far).unwrap_err().to_string().contains("runs past the end"));
        // An array of arrays of arrays ... (type 9 all the way down).
        let mut nested = Vec::new();
        for _ in 0..64 {
            nested.extend(9u32.to_le_bytes());
            nested.extend(1u64.to_le_bytes());
        }
        let deep = header(3, &[(9, nested)], &[]);
        assert!(parse(deep).unwrap_err().to_string().contains("nested"));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

        /// Any header, whole or cut anywhere, with bytes flipped: a file or a
        /// clear error, never a panic or an allocation past the file's size.
        #[test]
        fn any_header_parses_or_is_refused(
            version in prop_oneof![Just(3u32), Just(2), any::<u32>()],
            kv in proptest::collection::vec((0u32..14, proptest::collection::vec(any::<u8>(), 0..24)), 0..4),
            tensors in proptest::collection::vec(
                (proptest::collection::vec(prop_oneof![Just(32u64), Just(1), any::<u64>()], 0..10),
                 prop_oneof![Just(0u32), Just(8), any::<u32>()],
                 prop_oneof![Just(0u64), any::<u64>()]),
                0..4),
            cut in any::<prop::sample::Index>(),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        ) {
            let mut bytes = header(version, &kv, &tensors);
            let _ = parse(bytes.clone());
            for (at, value) in flips {
                let at = at.index(bytes.len());
                bytes[at] = value;
            }
            let _ = parse(bytes.clone());
            bytes.truncate(cut.index(bytes.len() + 1));
            let _ = parse(bytes);
        }
    }
}
