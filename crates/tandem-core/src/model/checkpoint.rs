//! Reading a Hugging Face checkpoint directory: `config.json`, single or sharded safetensors,
//! the three weight-name prefixes of published Qwen3.5 exports. Files are memory-mapped;
//! tensors keep their stored dtype.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::model::tensor::{DType, Storage, Tensor};

/// Tensors by their name inside the text decoder (prefix removed: `layers.0.mlp.up_proj.weight`,
/// `embed_tokens.weight`, `norm.weight`, `lm_head.weight`).
pub struct TensorSet {
    tensors: HashMap<String, Tensor>,
    /// Tensors made on first use (synthetic models), so that a loader which quantizes each
    /// matrix as it goes never holds the whole model in its stored dtype.
    lazy: HashMap<String, (Vec<usize>, Box<dyn Fn() -> Tensor + Send + Sync>)>,
    /// Where the tensors came from, for error messages.
    pub source: String,
    /// The RMSNorm weights hold `1 + w` already (a GGUF file's do), not the checkpoint's `w`.
    pub norms_hold_one: bool,
}

/// Decoder prefixes, in the order they are tried (docs/qwen35.md §1.3).
const PREFIXES: [&str; 3] = ["model.language_model.", "language_model.model.", "model."];

impl TensorSet {
    pub fn new(tensors: HashMap<String, Tensor>, source: String) -> Self {
        TensorSet { tensors, lazy: HashMap::new(), source, norms_hold_one: false }
    }

    /// A set whose tensors are produced by `make` when taken.
    pub fn lazy(specs: Vec<(String, Vec<usize>, Box<dyn Fn() -> Tensor + Send + Sync>)>, source: String) -> Self {
        let lazy = specs.into_iter().map(|(n, shape, f)| (n, (shape, f))).collect();
        TensorSet { tensors: HashMap::new(), lazy, source, norms_hold_one: false }
    }

    /// Remove and return the tensor `name`, checked against the expected shape.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if let Some((s, make)) = self.lazy.remove(name) {
            if s != shape {
                bail!("{}: tensor {name} has shape {s:?}, expected {shape:?} from config.json", self.source);
            }
            return Ok(make());
        }
        self.get(name, shape)?;
        let t = self.tensors.remove(name).expect("checked by get");
        if let Some(i) = t.first_non_finite()? {
            bail!("{}: tensor {name} holds a value that is not finite (NaN or infinity) at element {i}: the checkpoint is damaged", self.source);
        }
        Ok(t)
    }

    /// Memory-map every safetensors file of `dir` (following `model.safetensors.index.json`
    /// when present) and collect the decoder's tensors, skipping `model.visual.*` and `mtp.*`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let files = safetensors_files(dir)?;
        let mut raw: HashMap<String, Tensor> = HashMap::new();
        for file in &files {
            for t in read_safetensors(file)? {
                raw.insert(t.name.clone(), t);
            }
        }
        let prefix = PREFIXES
            .iter()
            .find(|p| raw.contains_key(&format!("{p}embed_tokens.weight")))
            .with_context(|| {
                format!(
                    "{}: no embed_tokens.weight under any of the prefixes {PREFIXES:?}; is this a Qwen3.5 checkpoint?",
                    dir.display()
                )
            })?;
        let mut tensors = HashMap::new();
        for (name, mut t) in raw {
            let short = if let Some(rest) = name.strip_prefix(prefix) {
                rest.to_string()
            } else if name == "lm_head.weight" || name == "language_model.lm_head.weight" {
                "lm_head.weight".to_string()
            } else {
                // model.visual.*, mtp.* and anything else outside the text decoder.
                continue;
            };
            // `model.` is a prefix of `model.visual.`; keep only decoder names.
            if short.starts_with("visual.") || short.starts_with("language_model.") {
                continue;
            }
            t.name = name;
            tensors.insert(short, t);
        }
        Ok(TensorSet::new(tensors, dir.display().to_string()))
    }

    /// The tensor `name`, checked against the expected shape.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<&Tensor> {
        let t = self.tensors.get(name).with_context(|| format!("{}: tensor {name} is missing", self.source))?;
        if t.shape != shape {
            bail!("{}: tensor {} has shape {:?}, expected {:?} from config.json", self.source, t.name, t.shape, shape);
        }
        Ok(t)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.lazy.contains_key(name)
    }
}

/// The safetensors files of a checkpoint directory.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).with_context(|| format!("reading {}", index.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", index.display()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{}: no \"weight_map\" object", index.display()))?;
        let mut shards = BTreeSet::new();
        for (tensor, file) in map {
            let file = file.as_str().with_context(|| format!("{}: weight_map[{tensor}] is not a file name", index.display()))?;
            shards.insert(file.to_string());
        }
        let files: Vec<PathBuf> = shards.into_iter().map(|f| dir.join(f)).collect();
        for f in &files {
            if !f.exists() {
                bail!("{} names shard {}, which does not exist", index.display(), f.display());
            }
        }
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    bail!("{}: no model.safetensors or model.safetensors.index.json", dir.display())
}

/// All tensors of one safetensors file, memory-mapped.
pub fn read_safetensors(path: &Path) -> Result<Vec<Tensor>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: the mapping is read-only; a checkpoint being rewritten while it is served is
    // outside what any inference engine can guard against.
    let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("memory-mapping {}", path.display()))?;
    let (header_len, metadata) = safetensors::SafeTensors::read_metadata(&map)
        .map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file ({e})", path.display()))?;
    let data_start = 8 + header_len;
    let data_len = map.len() - data_start;
    let storage: Arc<dyn Storage> = Arc::new(map);
    let mut out = Vec::new();
    for (name, info) in metadata.tensors() {
        let dtype = match info.dtype {
            safetensors::Dtype::BF16 => DType::BF16,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::F32 => DType::F32,
            other => {
                // Vision tower or MTP tensors of other dtypes are skipped later; keep the name.
                if name.contains("visual.") || name.starts_with("mtp.") {
                    continue;
                }
                bail!("{}: tensor {name} has dtype {other:?}; tandem reads bf16, f16 and f32 weights", path.display())
            }
        };
        let (begin, end) = info.data_offsets;
        let numel: usize = info.shape.iter().product();
        if end > data_len || end - begin != dtype.bytes_of(numel) {
            bail!(
                "{}: tensor {name} claims bytes {begin}..{end} but the data section has {data_len} bytes \
                 (shape {:?} {dtype}): the file is truncated or corrupt",
                path.display(),
                info.shape
            );
        }
        out.push(Tensor { name, dtype, shape: info.shape.clone(), storage: storage.clone(), offset: data_start + begin });
    }
    Ok(out)
}
