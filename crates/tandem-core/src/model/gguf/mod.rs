//! A GGUF file, the format the local runners (llama.cpp and those built on it) read: a header,
//! typed metadata (the architecture's hyperparameters, the tokenizer, the chat template), a
//! table of tensors (name, shape, element type, offset) and their data, aligned. The file is
//! memory-mapped and nothing in it is trusted: every count, length, type and offset is
//! checked against the file before it is used, and an error names the file and the field or
//! tensor that is wrong, so a damaged or hostile file is an error, never a crash or a huge
//! allocation.
//!
//! Shapes are kept in GGUF's order, innermost first (`dims[0]` is a row's length): a PyTorch
//! weight `[rows, cols]` is stored with `dims = [cols, rows]`.

pub mod blocks;
pub mod qwen35;
pub mod tokenizer;
pub mod write;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};

pub use blocks::GgmlType;

use crate::model::tensor::Storage;

/// "GGUF" read as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// Where tensor data is aligned unless `general.alignment` says otherwise.
const DEFAULT_ALIGNMENT: u64 = 32;
/// GGML's most dimensions a tensor has.
const MAX_DIMS: u32 = 4;
/// How deep arrays of arrays may nest (the format allows it; no model's metadata goes past 1).
const MAX_ARRAY_DEPTH: usize = 3;
/// The most items one metadata array may hold: a value takes 32 bytes in memory however few it
/// takes in the file, so a count is held to what models need (the largest, a vocabulary's
/// merges, is under a million) rather than to what the file's size allows.
const MAX_ARRAY_ITEMS: u64 = 1 << 24;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    /// The format's name of the value's type, for errors.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "uint8",
            Value::I8(_) => "int8",
            Value::U16(_) => "uint16",
            Value::I16(_) => "int16",
            Value::U32(_) => "uint32",
            Value::I32(_) => "int32",
            Value::U64(_) => "uint64",
            Value::I64(_) => "int64",
            Value::F32(_) => "float32",
            Value::F64(_) => "float64",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// An integer of any width and sign that is not negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A float or an integer, as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v as f64),
            Value::I16(v) => Some(v as f64),
            Value::I32(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
}

/// One entry of the tensor table.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// Innermost first.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Where the data starts, from the start of the file.
    pub start: usize,
    pub bytes: usize,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// `[rows, cols]` of a 2-D tensor (`dims = [cols, rows]`), or an error naming it.
    pub fn rows_cols(&self) -> Result<(usize, usize)> {
        match self.dims[..] {
            [cols, rows] => Ok((rows as usize, cols as usize)),
            _ => bail!("tensor {} has shape {:?} (GGUF order, innermost first), not a matrix", self.name, self.dims),
        }
    }
}

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    storage: Arc<dyn Storage>,
    pub version: u32,
    /// In the file's order.
    metadata: Vec<(String, Value)>,
    by_key: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    pub alignment: u64,
}

impl GgufFile {
    /// Memory-map and parse `path`.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: the map is read-only; like every reader of model files we assume nobody
        // truncates the file while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("memory-mapping {}", path.display()))?;
        Self::parse(path, Arc::new(map))
    }

    /// Parse a GGUF file held in `storage`; `path` names it in errors.
    pub fn parse(path: &Path, storage: Arc<dyn Storage>) -> Result<GgufFile> {
        let bytes = storage.bytes();
        let mut r = Reader { bytes, at: 0, path };
        let magic = r.u32("the magic number")?;
        if magic != MAGIC {
            bail!("{} is not a GGUF file (it starts with {:02x?}, not \"GGUF\")", path.display(), &bytes[..4]);
        }
        let version = r.u32("the version")?;
        match version {
            2 | 3 => {}
            1 => bail!("{} is GGUF version 1 (32-bit counts), which tandem does not read: convert the model again with a current llama.cpp", path.display()),
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => bail!("{} is a big-endian GGUF file, which tandem does not read: use the little-endian file", path.display()),
            v => bail!("{} has GGUF version {v}; tandem reads versions 2 and 3", path.display()),
        }
        let tensor_count = r.u64("the tensor count")?;
        let kv_count = r.u64("the metadata count")?;
        // Each entry takes at least a few bytes: a count the file cannot hold is damage, and
        // must not size an allocation.
        r.check_count(kv_count, 8 + 4, "the metadata count")?;
        r.check_count(tensor_count, 8 + 4 + 4 + 8, "the tensor count")?;

        let mut metadata = Vec::with_capacity(kv_count as usize);
        let mut by_key = HashMap::with_capacity(kv_count as usize);
        for i in 0..kv_count {
            let key = r.string(&format!("metadata entry {i}'s key"))?;
            let what = format!("metadata {key:?}");
            let kind = r.u32(&what)?;
            let value = r.value(kind, &what, 0)?;
            if by_key.insert(key.clone(), metadata.len()).is_some() {
                bail!("{}: metadata key {key:?} appears twice", path.display());
            }
            metadata.push((key, value));
        }
        let alignment = match by_key.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if *a > 0 && a.is_power_of_two() => *a as u64,
            Some(v) => bail!("{}: metadata general.alignment is {v:?}; it must be a uint32 power of two", path.display()),
        };

        let mut infos = Vec::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let name = r.string(&format!("tensor {i}'s name"))?;
            let what = format!("tensor {name:?}");
            let n_dims = r.u32(&what)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                bail!("{}: {what} has {n_dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}", path.display());
            }
            let dims = (0..n_dims).map(|_| r.u64(&what)).collect::<Result<Vec<u64>>>()?;
            let type_id = r.u32(&what)?;
            let offset = r.u64(&what)?;
            infos.push((name, dims, type_id, offset));
        }
        // The data section starts at the next multiple of the alignment.
        let data_start = (r.at as u64).next_multiple_of(alignment);
        let file_len = bytes.len() as u64;
        let mut tensors = Vec::with_capacity(infos.len());
        let mut by_name = HashMap::with_capacity(infos.len());
        for (name, dims, type_id, offset) in infos {
            let ggml_type = GgmlType::from_id(type_id).with_context(|| format!("{}: tensor {name:?}", path.display()))?;
            if let Some(d) = dims.iter().position(|&d| d == 0) {
                bail!("{}: tensor {name:?} has size 0 in dimension {d} (shape {dims:?})", path.display());
            }
            let elements = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).with_context(|| format!("{}: tensor {name:?}'s shape {dims:?} overflows", path.display()))?;
            let block = ggml_type.block_elements() as u64;
            if !dims[0].is_multiple_of(block) {
                bail!("{}: tensor {name:?} rows have {} values, not a multiple of {}'s block of {block}", path.display(), dims[0], ggml_type.name());
            }
            let size = (elements / block).checked_mul(ggml_type.block_bytes() as u64).with_context(|| format!("{}: tensor {name:?} is too large", path.display()))?;
            if !offset.is_multiple_of(alignment) {
                bail!("{}: tensor {name:?} starts at data offset {offset}, not a multiple of the alignment {alignment}", path.display());
            }
            let start = data_start.checked_add(offset);
            let end = start.and_then(|s| s.checked_add(size));
            match (start, end) {
                (Some(s), Some(e)) if e <= file_len => {
                    let info = TensorInfo { name: name.clone(), dims, ggml_type, start: s as usize, bytes: size as usize };
                    if by_name.insert(name.clone(), tensors.len()).is_some() {
                        bail!("{}: tensor {name:?} appears twice", path.display());
                    }
                    tensors.push(info);
                }
                _ => bail!(
                    "{}: tensor {name:?} ({} bytes at data offset {offset}) runs past the end of the file ({file_len} bytes): the file is truncated or damaged",
                    path.display(),
                    size
                ),
            }
        }
        Ok(GgufFile { path: path.to_path_buf(), storage, version, metadata, by_key, tensors, by_name, alignment })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The storage the tensors' bytes live in (for weights read in place).
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// Every metadata entry, in the file's order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.by_key.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A metadata value that must be there.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).with_context(|| format!("{} has no metadata {key:?}", self.path.display()))
    }

    /// A non-negative integer of any width.
    pub fn u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64().with_context(|| format!("{}: metadata {key:?} is a {} ({v:?}), not a non-negative integer", self.path.display(), v.type_name()))
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        let v = self.u64(key)?;
        usize::try_from(v).with_context(|| format!("{}: metadata {key:?} = {v} is too large", self.path.display()))
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_f64().with_context(|| format!("{}: metadata {key:?} is a {}, not a number", self.path.display(), v.type_name()))
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            Value::Str(s) => Ok(s),
            v => bail!("{}: metadata {key:?} is a {}, not a string", self.path.display(), v.type_name()),
        }
    }

    pub fn array(&self, key: &str) -> Result<&[Value]> {
        match self.require(key)? {
            Value::Array(a) => Ok(a),
            v => bail!("{}: metadata {key:?} is a {}, not an array", self.path.display(), v.type_name()),
        }
    }

    /// Every tensor, in the table's order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's bytes (checked to lie inside the file when it was opened).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.storage.bytes()[info.start..info.start + info.bytes]
    }

    /// A tensor's values as f32, every element type through its plain dequantizer.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.tensor_info(name).with_context(|| format!("{} has no tensor {name:?}", self.path.display()))?;
        let mut out = vec![0f32; info.elements() as usize];
        blocks::dequantize(info.ggml_type, self.tensor_bytes(info), &mut out);
        Ok(out)
    }
}

/// A cursor over the header that turns every short read into an error naming the field.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        match self.at.checked_add(n) {
            Some(end) if end <= self.bytes.len() => {
                let s = &self.bytes[self.at..end];
                self.at = end;
                Ok(s)
            }
            _ => bail!("{}: the file ends (at {} bytes) inside {what}: it is truncated or damaged", self.path.display(), self.bytes.len()),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// `count` items of at least `least` bytes each must fit in what is left of the file.
    fn check_count(&self, count: u64, least: u64, what: &str) -> Result<()> {
        let left = (self.bytes.len() - self.at) as u64;
        if count.checked_mul(least).is_none_or(|n| n > left) {
            bail!("{}: {what} is {count}, more than the {left} bytes left in the file can hold: the file is damaged", self.path.display());
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        self.check_count(len, 1, &format!("the length of {what}"))?;
        let raw = self.take(len as usize, what)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_string()),
            Err(e) => bail!("{}: {what} is not UTF-8 ({e})", self.path.display()),
        }
    }

    fn value(&mut self, kind: u32, what: &str, depth: usize) -> Result<Value> {
        Ok(match kind {
            0 => Value::U8(self.array::<1>(what)?[0]),
            1 => Value::I8(self.array::<1>(what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => bail!("{}: {what} is a bool of value {b}, not 0 or 1", self.path.display()),
            },
            8 => Value::Str(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    bail!("{}: {what} nests arrays more than {MAX_ARRAY_DEPTH} deep", self.path.display());
                }
                let item = self.u32(what)?;
                let count = self.u64(what)?;
                // The smallest item of the kind (a string or an array at least its length).
                let least = match item {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8..=12 => 8,
                    k => bail!("{}: {what} is an array of unknown type {k}", self.path.display()),
                };
                self.check_count(count, least, &format!("the length of {what}"))?;
                if count > MAX_ARRAY_ITEMS {
                    bail!("{}: {what} is an array of {count} items, more than the {MAX_ARRAY_ITEMS} tandem reads", self.path.display());
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(item, what, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            k => bail!("{}: {what} has unknown value type {k}", self.path.display()),
        })
    }
}

#[cfg(test)]
mod tests;
