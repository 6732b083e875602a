//! The tokenizer a GGUF file holds (`tokenizer.ggml.*`), as the Hugging Face tokenizer it was
//! converted from: a byte-level BPE with the file's tokens, token types and merges, split
//! before merging by the pre-tokenizer the file names. The file stores the pre-tokenizer's
//! name only; its pattern comes from the published tokenizer of that family.

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value as Json};

use super::{GgufFile, Value};
use crate::tokenizer::Tokenizer;

/// Token types of `tokenizer.ggml.token_type`.
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The split before byte-level merging, by `tokenizer.ggml.pre` (the patterns of the Qwen3.5
/// and Qwen2/Qwen3 `tokenizer.json` files).
fn split_pattern(pre: &str) -> Option<&'static str> {
    match pre {
        "qwen35" => Some(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
        "qwen2" => Some(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
        _ => None,
    }
}

/// The file's tokenizer, or None where it holds none.
pub fn tokenizer(g: &GgufFile) -> Result<Option<Tokenizer>> {
    if g.get("tokenizer.ggml.tokens").is_none() {
        return Ok(None);
    }
    let path = g.path().display();
    let model = g.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        bail!("{path}: tokenizer.ggml.model is {model:?}; tandem reads the byte-level BPE (\"gpt2\") that Qwen models use");
    }
    let pre = g.str("tokenizer.ggml.pre").unwrap_or("qwen35");
    let pattern = split_pattern(pre).with_context(|| format!("{path}: tokenizer.ggml.pre is {pre:?}; tandem knows the Qwen pre-tokenizers \"qwen35\" and \"qwen2\""))?;
    let tokens = g.array("tokenizer.ggml.tokens")?;
    let types = match g.get("tokenizer.ggml.token_type") {
        Some(_) => g.array("tokenizer.ggml.token_type")?,
        None => &[],
    };
    if !types.is_empty() && types.len() != tokens.len() {
        bail!("{path}: tokenizer.ggml.token_type has {} entries for {} tokens", types.len(), tokens.len());
    }
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        let Value::Str(text) = token else { bail!("{path}: tokenizer.ggml.tokens[{id}] is a {}, not a string", token.type_name()) };
        let kind = match types.get(id) {
            None => NORMAL,
            Some(v) => v.as_f64().with_context(|| format!("{path}: tokenizer.ggml.token_type[{id}] is a {}", v.type_name()))? as i64,
        };
        match kind {
            CONTROL | USER_DEFINED => added.push(json!({
                "id": id, "content": text, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": kind == CONTROL,
            })),
            // Normal and byte tokens are the BPE's; unused ones (padding rows) are left out.
            NORMAL | 6 => {
                vocab.insert(text.clone(), json!(id));
            }
            _ => {}
        }
    }
    let merges = g
        .array("tokenizer.ggml.merges")?
        .iter()
        .enumerate()
        .map(|(i, m)| match m {
            Value::Str(s) => s.split_once(' ').map(|(a, b)| json!([a, b])).with_context(|| format!("{path}: tokenizer.ggml.merges[{i}] = {s:?} is not two tokens")),
            v => bail!("{path}: tokenizer.ggml.merges[{i}] is a {}, not a string", v.type_name()),
        })
        .collect::<Result<Vec<Json>>>()?;
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "", "end_of_word_suffix": "",
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    let bytes = serde_json::to_vec(&spec).expect("a JSON value serializes");
    Tokenizer::from_bytes(&bytes).map(Some).with_context(|| format!("{path}: the tokenizer in tokenizer.ggml.* is not one tandem can build"))
}
