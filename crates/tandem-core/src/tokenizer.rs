//! Text <-> token ids through the Hugging Face `tokenizers` crate and the checkpoint's own
//! `tokenizer.json`, plus incremental detokenization for streaming.

use std::path::Path;

use anyhow::{anyhow, Context, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Ids below this are real tokens (BPE ranks + added tokens); logit rows past it are padding.
    vocab_size: usize,
    /// The added tokens, and whether each is special (`<|im_end|>`, `<tool_call>`, ...).
    added: std::collections::HashMap<u32, bool>,
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_bytes(&bytes).with_context(|| format!("{}: not a valid tokenizer.json", path.display()))
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| anyhow!("{e}"))?;
        let vocab_size = inner.get_vocab_size(true);
        let added = inner.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, t.special)).collect();
        Ok(Tokenizer { inner, vocab_size, added })
    }

    /// Encode text as the model sees it: special tokens such as `<|im_start|>` written in the
    /// text are matched whole; nothing (no BOS) is added.
    /// The tokenizer as a tokenizer.json (what `model::gguf::write` stores in a GGUF file).
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(false).map_err(|e| anyhow!("writing the tokenizer as JSON: {e}"))
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| anyhow!("tokenizing failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decode ids to text, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| anyhow!("detokenizing failed: {e}"))
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The bytes token `id` stands for (what a log-probability's `bytes` reports): an added
    /// token's text, or a byte-level BPE piece mapped back through the byte-to-character table
    /// of GPT-2's byte-level encoding (which Qwen's tokenizer uses). A piece of another kind of
    /// vocabulary comes back as its UTF-8. None for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        if self.added.contains_key(&id) {
            return Some(piece.into_bytes());
        }
        piece.chars().map(byte_of_char).collect::<Option<Vec<u8>>>().or(Some(piece.into_bytes()))
    }
}

impl Tokenizer {
    /// Whether `id` is a special token (one the text of a reply cannot spell out by itself).
    pub fn is_special(&self, id: u32) -> bool {
        self.added.get(&id).copied().unwrap_or(false)
    }
}

/// The byte that byte-level BPE writes as `c`: the printable bytes (`!`..`~`, `¡`..`¬`,
/// `®`..`ÿ`) stand for themselves, and the other 68 bytes, in order, for U+0100 onwards.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let c = c as u32;
    if c < 256 {
        return printable(c).then_some(c as u8);
    }
    (0..=255u32).filter(|&b| !printable(b)).nth((c - 256) as usize).map(|b| b as u8)
}

/// Turns a growing list of ids into text deltas, holding back bytes that do not yet form whole
/// UTF-8 characters (a byte-level BPE token can end in the middle of one). The approach of
/// vLLM's incremental detokenizer: re-decode a short window of recent ids, never the whole text.
#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one id; returns the text that became final, possibly empty.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            return Ok(delta);
        }
        Ok(String::new())
    }

    /// Whatever is still held back at the end of the stream (replacement characters included).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tok.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or("").to_string())
    }
}
