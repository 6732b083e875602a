//! The Qwen3.5 text-decoder configuration, mirroring `config.json` (`text_config` of the
//! multimodal `Qwen3_5ForConditionalGeneration`, or the top level of a text-only
//! `Qwen3_5ForCausalLM` export). See docs/qwen35.md §1.

use anyhow::{bail, Context, Result};
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// Gated DeltaNet: conv window + f32 recurrent state.
    LinearAttention,
    /// Gated softmax attention with a KV cache.
    FullAttention,
}

/// The published checkpoints' `mrope_section` (every Qwen3.5 size), for a config without one.
pub const PUBLISHED_MROPE_SECTION: [usize; 3] = [11, 11, 10];

#[derive(Debug, Clone, PartialEq)]
pub struct Qwen35Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub layer_types: Vec<LayerType>,
    // full attention
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    /// The rotary pairs of each position axis of the multimodal RoPE (time, height, width:
    /// `mrope_section`). A text token holds the same position on every axis, which makes this
    /// the plain RoPE the forward pass computes; it is kept for the GGUF files tandem writes,
    /// whose `rope.dimension_sections` llama.cpp requires.
    pub mrope_section: [usize; 3],
    // gated DeltaNet
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
}

impl Qwen35Config {
    /// Refuse what no forward pass can take, before anything is applied (a failed call leaves
    /// the state as it was): no tokens, an id outside the vocabulary, or `applied` tokens after
    /// `position` past `context` (the model's, or less where an engine holds fewer; `engine`
    /// names it in the message).
    pub fn check_input(&self, tokens: &[u32], position: usize, applied: usize, context: usize, engine: &str) -> Result<()> {
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        let vocab = self.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= vocab) {
            bail!("token id {bad} is outside the model's vocabulary (ids 0..{vocab})");
        }
        if position + applied > context {
            let field = if context == self.max_position_embeddings { " (max_position_embeddings)" } else { "" };
            bail!("{applied} tokens after position {position} exceed {engine} context of {context} tokens{field}");
        }
        Ok(())
    }


    /// Parse `config.json` text; `source` names the file in errors.
    pub fn from_json_str(text: &str, source: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text).with_context(|| format!("{source}: not valid JSON"))?;
        let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        let text_cfg = match root.get("text_config") {
            Some(t) if t.is_object() => t,
            _ => &root,
        };
        let text_type = text_cfg.get("model_type").and_then(Value::as_str).unwrap_or(model_type);
        if !matches!(model_type, "qwen3_5" | "qwen3_5_text") && !matches!(text_type, "qwen3_5_text") {
            let archs = root.get("architectures").map(|a| a.to_string()).unwrap_or_default();
            bail!(
                "{source}: model_type {model_type:?} (architectures {archs}) is not Qwen3.5; \
                 tandem runs Qwen3_5ForConditionalGeneration / Qwen3_5ForCausalLM checkpoints \
                 (model_type \"qwen3_5\" or \"qwen3_5_text\")"
            );
        }
        let f = Fields { v: text_cfg, source };
        let num_hidden_layers = f.usize("num_hidden_layers")?;
        let layer_types = match text_cfg.get("layer_types") {
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("linear_attention") => Ok(LayerType::LinearAttention),
                    Some("full_attention") => Ok(LayerType::FullAttention),
                    _ => bail!("{source}: layer_types[{i}] = {t} is neither \"linear_attention\" nor \"full_attention\""),
                })
                .collect::<Result<Vec<_>>>()?,
            _ => {
                // HF Qwen3_5TextConfig.__post_init__: layer i is full attention iff (i+1) % interval == 0.
                let interval = f.usize_or("full_attention_interval", 4)?;
                (0..num_hidden_layers)
                    .map(|i| if (i + 1) % interval == 0 { LayerType::FullAttention } else { LayerType::LinearAttention })
                    .collect()
            }
        };
        // RoPE settings moved into `rope_parameters` in transformers 5; older exports keep them flat.
        let rope = text_cfg.get("rope_parameters").filter(|v| v.is_object());
        let rope_f = |key: &str, default: f64| -> Result<f64> {
            if let Some(v) = rope.and_then(|r| r.get(key)).or_else(|| text_cfg.get(key)) {
                return v.as_f64().with_context(|| format!("{source}: {key} = {v} is not a number"));
            }
            Ok(default)
        };
        let mrope_section = match rope.and_then(|r| r.get("mrope_section")).or_else(|| text_cfg.get("rope_scaling").and_then(|r| r.get("mrope_section"))) {
            None => PUBLISHED_MROPE_SECTION,
            Some(v) => match v.as_array().map(|a| a.iter().map(|x| x.as_u64().map(|n| n as usize)).collect::<Option<Vec<_>>>()) {
                Some(Some(s)) if s.len() == 3 => [s[0], s[1], s[2]],
                _ => bail!("{source}: mrope_section = {v} is not a list of three counts"),
            },
        };
        let tie = match text_cfg.get("tie_word_embeddings").or_else(|| root.get("tie_word_embeddings")) {
            Some(v) => v.as_bool().with_context(|| format!("{source}: tie_word_embeddings = {v} is not a boolean"))?,
            None => false,
        };
        let cfg = Qwen35Config {
            hidden_size: f.usize("hidden_size")?,
            num_hidden_layers,
            intermediate_size: f.usize("intermediate_size")?,
            vocab_size: f.usize("vocab_size")?,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)? as f32,
            max_position_embeddings: f.usize_or("max_position_embeddings", 262144)?,
            tie_word_embeddings: tie,
            layer_types,
            num_attention_heads: f.usize("num_attention_heads")?,
            num_key_value_heads: f.usize("num_key_value_heads")?,
            head_dim: f.usize("head_dim")?,
            rope_theta: rope_f("rope_theta", 1e7)?,
            partial_rotary_factor: rope_f("partial_rotary_factor", 0.25)?,
            mrope_section,
            linear_num_key_heads: f.usize("linear_num_key_heads")?,
            linear_num_value_heads: f.usize("linear_num_value_heads")?,
            linear_key_head_dim: f.usize("linear_key_head_dim")?,
            linear_value_head_dim: f.usize("linear_value_head_dim")?,
            linear_conv_kernel_dim: f.usize_or("linear_conv_kernel_dim", 4)?,
        };
        cfg.validate().with_context(|| format!("{source}: inconsistent Qwen3.5 config"))?;
        Ok(cfg)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.layer_types.len() != self.num_hidden_layers {
            bail!("layer_types has {} entries but num_hidden_layers is {}", self.layer_types.len(), self.num_hidden_layers);
        }
        if self.num_key_value_heads == 0 || self.num_attention_heads % self.num_key_value_heads != 0 {
            bail!("num_attention_heads {} is not a multiple of num_key_value_heads {}", self.num_attention_heads, self.num_key_value_heads);
        }
        if self.linear_num_key_heads == 0 || self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            bail!(
                "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                self.linear_num_value_heads,
                self.linear_num_key_heads
            );
        }
        let rot = self.rotary_dim();
        if rot % 2 != 0 || rot > self.head_dim {
            bail!("rotary dim {rot} (head_dim {} x partial_rotary_factor {}) must be even and at most head_dim", self.head_dim, self.partial_rotary_factor);
        }
        if self.linear_conv_kernel_dim == 0 {
            bail!("linear_conv_kernel_dim must be at least 1");
        }
        for (name, v) in [("hidden_size", self.hidden_size), ("vocab_size", self.vocab_size), ("head_dim", self.head_dim)] {
            if v == 0 {
                bail!("{name} must be positive");
            }
        }
        Ok(())
    }

    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor).round() as usize
    }
    /// Width of the GDN key (= query) projection: Hk * Dk.
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    /// Width of the GDN value projection: Hv * Dv.
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Channels of the causal conv (q | k | v, before the split).
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }
    pub fn num_full_attention_layers(&self) -> usize {
        self.layer_types.iter().filter(|t| **t == LayerType::FullAttention).count()
    }
    /// Bytes of one sequence's fixed-size state in f32: every DeltaNet layer's recurrent state
    /// and conv window (what a decode step reads and writes per sequence whatever its length).
    pub fn recurrent_state_bytes(&self) -> usize {
        let linear_layers = self.num_hidden_layers - self.num_full_attention_layers();
        let per_layer = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim + self.linear_conv_kernel_dim * self.linear_conv_dim();
        4 * linear_layers * per_layer
    }
    /// Bytes of keys and values per token in f32, over the attention layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        4 * 2 * self.num_full_attention_layers() * self.num_key_value_heads * self.head_dim
    }

    /// The published shapes (docs/qwen35.md §1.2), used by the synthetic models.
    pub fn preset(name: &str) -> Option<Self> {
        let (hidden, layers, heads, kv_heads, lin_v_heads, ffn, tie) = match name {
            "qwen3.5-0.8b" => (1024, 24, 8, 2, 16, 3584, true),
            "qwen3.5-2b" => (2048, 24, 8, 2, 16, 6144, true),
            "qwen3.5-9b" => (4096, 32, 16, 4, 32, 12288, false),
            "tiny" => return Some(Self::tiny()),
            _ => return None,
        };
        Some(Qwen35Config {
            hidden_size: hidden,
            num_hidden_layers: layers,
            intermediate_size: ffn,
            vocab_size: 248320,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 262144,
            tie_word_embeddings: tie,
            layer_types: (0..layers)
                .map(|i| if (i + 1) % 4 == 0 { LayerType::FullAttention } else { LayerType::LinearAttention })
                .collect(),
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim: 256,
            rope_theta: 1e7,
            partial_rotary_factor: 0.25,
            mrope_section: PUBLISHED_MROPE_SECTION,
            linear_num_key_heads: 16,
            linear_num_value_heads: lin_v_heads,
            linear_key_head_dim: 128,
            linear_value_head_dim: 128,
            linear_conv_kernel_dim: 4,
        })
    }
}

impl Qwen35Config {
    /// Not a published shape: Qwen3.5's vocabulary and layer pattern (three DeltaNet layers,
    /// then gated attention) at widths small enough that a server with real text in and out
    /// runs thousands of requests in a test.
    fn tiny() -> Self {
        let layers = 4;
        Qwen35Config {
            hidden_size: 64,
            num_hidden_layers: layers,
            intermediate_size: 128,
            vocab_size: 248320,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 32768,
            tie_word_embeddings: true,
            layer_types: (0..layers)
                .map(|i| if (i + 1) % 4 == 0 { LayerType::FullAttention } else { LayerType::LinearAttention })
                .collect(),
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 32,
            rope_theta: 1e7,
            partial_rotary_factor: 0.25,
            mrope_section: PUBLISHED_MROPE_SECTION,
            linear_num_key_heads: 2,
            linear_num_value_heads: 2,
            linear_key_head_dim: 32,
            linear_value_head_dim: 32,
            linear_conv_kernel_dim: 4,
        }
    }
}

/// Typed access to config fields with errors that name the file and the key.
struct Fields<'a> {
    v: &'a Value,
    source: &'a str,
}

impl Fields<'_> {
    fn usize(&self, key: &str) -> Result<usize> {
        match self.v.get(key) {
            None | Some(Value::Null) => bail!("{}: missing field {key}", self.source),
            Some(v) => v.as_u64().map(|n| n as usize).with_context(|| format!("{}: {key} = {v} is not a non-negative integer", self.source)),
        }
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => self.usize(key),
        }
    }
    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_f64().with_context(|| format!("{}: {key} = {v} is not a number", self.source)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_only_layout_and_default_layer_pattern() {
        let json = r#"{"architectures":["Qwen3_5ForCausalLM"],"model_type":"qwen3_5_text","hidden_size":64,
            "num_hidden_layers":8,"intermediate_size":128,"vocab_size":100,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":16,"linear_num_key_heads":2,"linear_num_value_heads":4,
            "linear_key_head_dim":16,"linear_value_head_dim":16,"rope_theta":10000.0,"partial_rotary_factor":0.5}"#;
        let c = Qwen35Config::from_json_str(json, "config.json").unwrap();
        assert_eq!(c.layer_types[3], LayerType::FullAttention);
        assert_eq!(c.layer_types[2], LayerType::LinearAttention);
        assert_eq!(c.num_full_attention_layers(), 2);
        assert_eq!(c.rotary_dim(), 8);
        assert_eq!(c.rope_theta, 10000.0);
        assert!(!c.tie_word_embeddings);
    }

    /// `mrope_section` from `rope_parameters` (transformers 5) or `rope_scaling`, the published
    /// one where neither has it, and an error naming it where it is not three counts.
    #[test]
    fn mrope_section_is_read_or_defaults_to_the_published_one() {
        let base = r#""model_type":"qwen3_5_text","hidden_size":64,"num_hidden_layers":4,"intermediate_size":128,"vocab_size":100,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"linear_num_key_heads":2,"linear_num_value_heads":4,
            "linear_key_head_dim":16,"linear_value_head_dim":16"#;
        let parse = |extra: &str| Qwen35Config::from_json_str(&format!("{{{base}{extra}}}"), "c.json");
        assert_eq!(parse("").unwrap().mrope_section, PUBLISHED_MROPE_SECTION);
        assert_eq!(parse(r#","rope_parameters":{"mrope_section":[2,3,3],"rope_theta":1e4}"#).unwrap().mrope_section, [2, 3, 3]);
        assert_eq!(parse(r#","rope_scaling":{"mrope_section":[4,2,2]}"#).unwrap().mrope_section, [4, 2, 2]);
        let err = parse(r#","rope_parameters":{"mrope_section":[11,11]}"#).unwrap_err().to_string();
        assert!(err.contains("c.json") && err.contains("mrope_section"), "{err}");
    }

    #[test]
    fn wrong_model_type_is_named() {
        let err = Qwen35Config::from_json_str(r#"{"model_type":"llama","architectures":["LlamaForCausalLM"]}"#, "x/config.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("x/config.json") && err.contains("llama"), "{err}");
    }

    #[test]
    fn missing_field_is_named() {
        let err = Qwen35Config::from_json_str(r#"{"model_type":"qwen3_5_text","hidden_size":8}"#, "c.json").unwrap_err().to_string();
        assert!(err.contains("missing field num_hidden_layers"), "{err}");
    }

    #[test]
    fn presets_match_the_spec_table() {
        let c = Qwen35Config::preset("qwen3.5-9b").unwrap();
        assert_eq!(c.linear_conv_dim(), 8192);
        assert_eq!(c.num_full_attention_layers(), 8);
        assert_eq!(Qwen35Config::preset("qwen3.5-0.8b").unwrap().linear_conv_dim(), 6144);
    }
}
