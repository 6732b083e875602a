//! One entry point for "a model": a checkpoint directory or a `synthetic:NAME`, with the
//! tokenizer, chat template and stop tokens that belong to it.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::chat::ChatTemplate;
use crate::model::checkpoint::TensorSet;
use crate::model::config::Qwen35Config;
use crate::model::gguf::{self, GgufFile};
use crate::model::quant::Quant;
use crate::model::{synthetic, Qwen35};
use crate::backend::cpu::pool::Pool;
use crate::tokenizer::Tokenizer;

/// The real Qwen3.5 vocabulary, built in for the synthetic models.
const QWEN35_TOKENIZER_JSON: &[u8] = include_bytes!("../../../../assets/qwen3.5/tokenizer.json");
/// `<|im_end|>` and `<|endoftext|>`: Qwen3.5's generation_config eos_token_id.
const QWEN35_STOP_IDS: [u32; 2] = [248046, 248044];

pub struct LoadedModel {
    pub net: Qwen35,
    /// None for a checkpoint without tokenizer.json (then only token ids go in and out).
    pub tokenizer: Option<Tokenizer>,
    pub chat_template: ChatTemplate,
    pub stop_ids: Vec<u32>,
    /// What was loaded, as the user named it.
    pub name: String,
}

impl LoadedModel {
    /// Load `spec`: `synthetic:qwen3.5-0.8b|2b|9b`, a Hugging Face checkpoint directory or a
    /// GGUF file, with the weights as stored.
    pub fn load(spec: &str) -> Result<Self> {
        Self::load_with(spec, None)
    }

    /// Load with `--quant int8` (quantized on `pool` while loading).
    pub fn load_int8(spec: &str, pool: &Pool) -> Result<Self> {
        Self::load_quantized(spec, Quant::Int8, pool)
    }

    /// Load with `--quant` (quantized on `pool` while loading).
    pub fn load_quantized(spec: &str, quant: Quant, pool: &Pool) -> Result<Self> {
        Self::load_with(spec, Some((quant, pool)))
    }

    fn load_with(spec: &str, quant: Option<(Quant, &Pool)>) -> Result<Self> {
        if let Some(name) = spec.strip_prefix("synthetic:") {
            let config = synthetic::config(name)?;
            // The tokenizer first: parsing it peaks at a few hundred MB that are returned
            // before the weights arrive.
            let tokenizer = Tokenizer::from_bytes(QWEN35_TOKENIZER_JSON).context("built-in Qwen3.5 tokenizer")?;
            release_freed_memory();
            release_static(QWEN35_TOKENIZER_JSON);
            let mut tensors = synthetic::tensors(&config, name);
            let net = Qwen35::load(config, &mut tensors, quant)?;
            release_freed_memory();
            return Ok(LoadedModel {
                net,
                tokenizer: Some(tokenizer),
                chat_template: ChatTemplate::qwen35(),
                stop_ids: QWEN35_STOP_IDS.to_vec(),
                name: spec.to_string(),
            });
        }
        let dir = Path::new(spec);
        if dir.is_file() && dir.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            return Self::load_gguf(spec, quant);
        }
        if !dir.is_dir() {
            bail!("model {spec:?} is neither a checkpoint directory, a .gguf file nor synthetic:NAME (names: {})", synthetic::NAMES.join(", "));
        }
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).with_context(|| format!("reading {}", config_path.display()))?;
        let config = Qwen35Config::from_json_str(&text, &config_path.display().to_string())?;
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.exists() { Some(Tokenizer::from_file(&tok_path)?) } else { None };
        release_freed_memory();
        let mut tensors = TensorSet::open_dir(dir)?;
        let net = Qwen35::load(config, &mut tensors, quant)?;
        release_freed_memory();
        let chat_template = ChatTemplate::from_checkpoint(dir)?.unwrap_or_else(ChatTemplate::chatml);
        let stop_ids = stop_ids(dir, tokenizer.as_ref())?;
        Ok(LoadedModel { net, tokenizer, chat_template, stop_ids, name: spec.to_string() })
    }

    /// A GGUF file as llama.cpp's converter writes Qwen3.5 (`model::gguf::qwen35`): its
    /// config, weights, tokenizer, chat template and end-of-sequence ids from the file.
    fn load_gguf(spec: &str, quant: Option<(Quant, &Pool)>) -> Result<Self> {
        let file = GgufFile::open(Path::new(spec))?;
        let config = gguf::qwen35::config(&file)?;
        let mut tensors = gguf::qwen35::tensors(&file, &config)?;
        let net = Qwen35::load(config, &mut tensors, quant)?;
        drop(tensors);
        release_freed_memory();
        let tokenizer = gguf::tokenizer::tokenizer(&file)?;
        release_freed_memory();
        let chat_template = match file.get("tokenizer.chat_template") {
            Some(gguf::Value::Str(t)) => ChatTemplate::new(t.clone(), format!("{spec} (tokenizer.chat_template)"))?,
            _ => ChatTemplate::chatml(),
        };
        // The file's end-of-sequence and end-of-turn ids, and the chat format's own ends.
        let mut stop_ids: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"].iter().filter_map(|k| file.get(k).and_then(|v| v.as_u64())).map(|id| id as u32).collect();
        if let Some(t) = &tokenizer {
            stop_ids.extend(["<|im_end|>", "<|endoftext|>"].iter().filter_map(|s| t.token_id(s)));
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();
        Ok(LoadedModel { net, tokenizer, chat_template, stop_ids, name: spec.to_string() })
    }

    /// What holds a tokenizer for this model, for errors when it has none.
    pub fn tokenizer_source(&self) -> &'static str {
        if self.name.to_ascii_lowercase().ends_with(".gguf") {
            "tokenizer (tokenizer.ggml.* metadata)"
        } else {
            "tokenizer.json"
        }
    }

    /// Ids the sampler may choose: the tokenizer's vocabulary, or every logit row without one.
    pub fn sampleable_vocab(&self) -> usize {
        match &self.tokenizer {
            Some(t) => t.vocab_size().min(self.net.config.vocab_size),
            None => self.net.config.vocab_size,
        }
    }
}

/// Give memory freed by parsing or by quantizing back to the OS (glibc keeps it otherwise, and
/// a 33 MB tokenizer.json leaves ~180 MB behind).
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the OS.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Drop the resident pages of a constant embedded in the executable (read again from the
/// file if ever touched): the built-in tokenizer.json is parsed once.
fn release_static(bytes: &'static [u8]) {
    #[cfg(target_os = "linux")]
    {
        let page = 4096;
        let start = (bytes.as_ptr() as usize).div_ceil(page) * page;
        let end = (bytes.as_ptr() as usize + bytes.len()) / page * page;
        if end > start {
            // SAFETY: the range lies inside a read-only, file-backed mapping of the executable;
            // MADV_DONTNEED there only drops clean pages.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
            }
        }
    }
}

/// `eos_token_id` of generation_config.json (a number or a list); without one, the tokenizer's
/// `<|im_end|>` and `<|endoftext|>`.
fn stop_ids(dir: &Path, tokenizer: Option<&Tokenizer>) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    if path.exists() {
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", path.display()))?;
        match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => return Ok(vec![n.as_u64().context("eos_token_id")? as u32]),
            Some(serde_json::Value::Array(a)) => {
                return a
                    .iter()
                    .map(|x| x.as_u64().map(|n| n as u32).with_context(|| format!("{}: eos_token_id entry {x} is not an id", path.display())))
                    .collect()
            }
            _ => {}
        }
    }
    Ok(tokenizer
        .map(|t| ["<|im_end|>", "<|endoftext|>"].iter().filter_map(|s| t.token_id(s)).collect())
        .unwrap_or_default())
}
