//! A Qwen3.5 model as llama.cpp's converter writes it to GGUF (architecture `qwen35`): the
//! config from the `qwen35.*` metadata, and the decoder's tensors under the checkpoint's own
//! names, with what the converter changed undone or taken as is:
//!
//! - names: `blk.N.attn_qkv` is `layers.N.linear_attn.in_proj_qkv`, and so on (`NAMES`);
//! - shapes: innermost first (reversed here), the conv kernel squeezed to `[channels, taps]`;
//! - the RMSNorm weights hold `1 + w` (the decoder's zero-centred weight plus one, in f32, as
//!   the loader computes it), except the DeltaNet's gated norm, which holds `w`;
//! - `ssm_a` holds `-exp(A_log)`, the decay the forward pass uses, and `ssm_dt.bias` the
//!   `dt_bias`;
//! - where a DeltaNet layer has more value heads than key heads, the value heads are stored
//!   tiled (`k0 v0, k1 v0, ..., k0 v1, ...`) instead of grouped by key head (`k0 v0, k0 v1,
//!   ..., k1 v0, ...`): the rows of the value part of `in_proj_qkv`, of `in_proj_z`, `in_proj_b`,
//!   `in_proj_a`, `ssm_a`, `ssm_dt` and the conv's value channels, and the columns of
//!   `out_proj`, are put back in the grouped order.
//!
//! Tensors are read in place from the mapped file where their order is kept, quantized ones
//! as their blocks (`model::blocks`), which the kernels multiply by directly. Where value heads
//! must be put back in order along a quantized matrix's rows, whole rows of blocks move; along
//! its columns, whole blocks, when a head's columns are a whole number of blocks; when they
//! are not (the 9B's `out_proj` in a k-quant: heads of 128 columns, blocks of 256), that one
//! matrix is dequantized to f32 and reordered, exactly, at four bytes a weight.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use super::{GgmlType, GgufFile, TensorInfo};
use crate::model::checkpoint::TensorSet;
use crate::model::config::{LayerType, Qwen35Config, PUBLISHED_MROPE_SECTION};
use crate::model::tensor::{DType, HeapStorage, Tensor};

/// The architecture name the converter writes for Qwen3.5's dense models.
pub const ARCHITECTURE: &str = "qwen35";

/// GGUF names (after `blk.N.`) and the checkpoint's (after `layers.N.`).
const NAMES: [(&str, &str); 23] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("attn_qkv.weight", "linear_attn.in_proj_qkv.weight"),
    ("attn_gate.weight", "linear_attn.in_proj_z.weight"),
    ("ssm_beta.weight", "linear_attn.in_proj_b.weight"),
    ("ssm_alpha.weight", "linear_attn.in_proj_a.weight"),
    ("ssm_a", "linear_attn.neg_a"),
    ("ssm_dt.bias", "linear_attn.dt_bias"),
    ("ssm_conv1d.weight", "linear_attn.conv1d.weight"),
    ("ssm_norm.weight", "linear_attn.norm.weight"),
    ("ssm_out.weight", "linear_attn.out_proj.weight"),
    // Older conversions of the same layers.
    ("ssm_dt", "linear_attn.dt_bias"),
    ("ssm_in.weight", "linear_attn.in_proj_qkvz.weight"),
    ("ssm_ba.weight", "linear_attn.in_proj_ba.weight"),
];

/// The decoder's config from the file's `qwen35.*` metadata and tensor shapes.
pub fn config(g: &GgufFile) -> Result<Qwen35Config> {
    let arch = g.str("general.architecture")?;
    if arch != ARCHITECTURE {
        bail!("{}: general.architecture is {arch:?}; tandem runs Qwen3.5 ({ARCHITECTURE:?})", g.path().display());
    }
    let key = |k: &str| format!("{ARCHITECTURE}.{k}");
    let embed = g.tensor_info("token_embd.weight").with_context(|| format!("{} has no tensor token_embd.weight", g.path().display()))?;
    let (vocab_size, hidden_size) = embed.rows_cols()?;
    if g.usize(&key("embedding_length"))? != hidden_size {
        bail!("{}: {} is {}, but token_embd.weight has rows of {hidden_size}", g.path().display(), key("embedding_length"), g.usize(&key("embedding_length"))?);
    }
    let num_hidden_layers = g.usize(&key("block_count"))?;
    let interval = g.usize(&key("full_attention_interval")).unwrap_or(4).max(1);
    let head_dim = g.usize(&key("attention.key_length"))?;
    let rotary = g.usize(&key("rope.dimension_count"))?;
    let value_heads = g.usize(&key("ssm.time_step_rank"))?;
    let inner = g.usize(&key("ssm.inner_size"))?;
    if value_heads == 0 || inner % value_heads != 0 {
        bail!("{}: {} = {inner} is not a multiple of {} = {value_heads}", g.path().display(), key("ssm.inner_size"), key("ssm.time_step_rank"));
    }
    // (llama.cpp's converter pads the three sections with a zero.)
    let sections = match g.get(&key("rope.dimension_sections")) {
        None => PUBLISHED_MROPE_SECTION,
        Some(_) => {
            let a = g.array(&key("rope.dimension_sections"))?;
            let n: Option<Vec<usize>> = a.iter().map(|v| v.as_u64().map(|n| n as usize)).collect();
            match n.as_deref() {
                Some([t, h, w, rest @ ..]) if rest.iter().all(|&x| x == 0) => [*t, *h, *w],
                _ => bail!("{}: {} = {a:?} is not three counts (and zeros)", g.path().display(), key("rope.dimension_sections")),
            }
        }
    };
    let cfg = Qwen35Config {
        hidden_size,
        num_hidden_layers,
        intermediate_size: g.usize(&key("feed_forward_length"))?,
        vocab_size,
        rms_norm_eps: g.f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
        max_position_embeddings: g.usize(&key("context_length"))?,
        tie_word_embeddings: g.tensor_info("output.weight").is_none(),
        layer_types: (0..num_hidden_layers).map(|i| if (i + 1) % interval == 0 { LayerType::FullAttention } else { LayerType::LinearAttention }).collect(),
        num_attention_heads: g.usize(&key("attention.head_count"))?,
        num_key_value_heads: g.usize(&key("attention.head_count_kv"))?,
        head_dim,
        rope_theta: g.f64(&key("rope.freq_base"))?,
        partial_rotary_factor: rotary as f64 / head_dim.max(1) as f64,
        mrope_section: sections,
        linear_num_key_heads: g.usize(&key("ssm.group_count"))?,
        linear_num_value_heads: value_heads,
        linear_key_head_dim: g.usize(&key("ssm.state_size"))?,
        linear_value_head_dim: inner / value_heads,
        linear_conv_kernel_dim: g.usize(&key("ssm.conv_kernel"))?,
    };
    cfg.validate().with_context(|| format!("{}: inconsistent Qwen3.5 metadata", g.path().display()))?;
    Ok(cfg)
}

/// The decoder's tensors under the checkpoint's names (see the module's notes).
pub fn tensors(g: &GgufFile, c: &Qwen35Config) -> Result<TensorSet> {
    let mut out: HashMap<String, Tensor> = HashMap::new();
    let (hk, hv, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim);
    // Value heads come tiled where there are more of them than key heads.
    let tiled = hv != hk;
    for info in g.tensors() {
        let name = &info.name;
        let short = match name.as_str() {
            "token_embd.weight" => "embed_tokens.weight".to_string(),
            "output_norm.weight" => "norm.weight".to_string(),
            "output.weight" => "lm_head.weight".to_string(),
            _ => {
                let Some(rest) = name.strip_prefix("blk.") else { continue };
                let Some((layer, field)) = rest.split_once('.') else { continue };
                let Ok(layer) = layer.parse::<usize>() else { continue };
                if layer >= c.num_hidden_layers {
                    // The multi-token-prediction layers the converter may append.
                    continue;
                }
                match NAMES.iter().find(|(gguf, _)| *gguf == field) {
                    Some((_, hf)) => format!("layers.{layer}.{hf}"),
                    None => bail!("{}: tensor {name:?} is not part of a Qwen3.5 decoder layer as tandem knows it", g.path().display()),
                }
            }
        };
        if short.ends_with("in_proj_qkvz.weight") || short.ends_with("in_proj_ba.weight") {
            bail!("{}: tensor {name:?} is from an older conversion that fused the DeltaNet projections; convert the model again with a current llama.cpp", g.path().display());
        }
        let mut t = tensor_of(g, info)?;
        if short.ends_with("conv1d.weight") {
            // [channels, taps] -> the checkpoint's [channels, 1, taps].
            if let [ch, taps] = t.shape[..] {
                t.shape = vec![ch, 1, taps];
            }
        }
        if tiled {
            let group = hv / hk;
            let v_rows = |t: &Tensor, from: usize, unit: usize| regroup(t, from, hk, group, unit, Axis::Rows);
            if short.ends_with("out_proj.weight") {
                if let DType::Blocks(f) = t.dtype {
                    if !dv.is_multiple_of(f.elements()) {
                        t = as_f32(&t)?;
                    }
                }
            }
            t = if short.ends_with("in_proj_qkv.weight") {
                v_rows(&t, 2 * c.linear_key_dim(), dv)?
            } else if short.ends_with("in_proj_z.weight") {
                v_rows(&t, 0, dv)?
            } else if short.ends_with("in_proj_b.weight") || short.ends_with("in_proj_a.weight") || short.ends_with("neg_a") || short.ends_with("dt_bias") {
                v_rows(&t, 0, 1)?
            } else if short.ends_with("conv1d.weight") {
                v_rows(&t, 2 * c.linear_key_dim(), dv)?
            } else if short.ends_with("out_proj.weight") {
                regroup(&t, 0, hk, group, dv, Axis::Columns)?
            } else {
                t
            };
        }
        t.name = name.clone();
        out.insert(short, t);
    }
    let mut set = TensorSet::new(out, g.path().display().to_string());
    set.norms_hold_one = true;
    Ok(set)
}

/// A tensor of the file with the checkpoint's shape, read in place: floats as themselves,
/// quantized types as their blocks.
fn tensor_of(g: &GgufFile, info: &TensorInfo) -> Result<Tensor> {
    let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
    let dtype = match info.ggml_type {
        GgmlType::F32 => DType::F32,
        GgmlType::F16 => DType::F16,
        GgmlType::BF16 => DType::BF16,
        other => DType::Blocks(other.block_format().expect("every other type is a block format")),
    };
    Ok(Tensor { name: info.name.clone(), dtype, shape, storage: g.storage().clone(), offset: info.start })
}

/// `t` dequantized to f32.
fn as_f32(t: &Tensor) -> Result<Tensor> {
    Ok(Tensor { name: t.name.clone(), dtype: DType::F32, shape: t.shape.clone(), storage: Arc::new(HeapStorage(t.to_f32_vec()?)), offset: 0 })
}

#[derive(Clone, Copy, PartialEq)]
enum Axis {
    Rows,
    Columns,
}

/// Put tiled value heads back in grouped order along `axis`, from index `from` on: the
/// tiled position of (key head k, value j of its group) is `j · key_heads + k`, the grouped
/// one `k · group + j`, each `unit` rows (or columns) long. A quantized tensor's rows move
/// whole, and its columns by whole blocks (`from` and `unit` multiples of a block).
fn regroup(t: &Tensor, from: usize, key_heads: usize, group: usize, unit: usize, axis: Axis) -> Result<Tensor> {
    let (rows, cols) = match t.shape[..] {
        [n] => (n, 1),
        [r, c] => (r, c),
        [r, 1, c] => (r, c),
        _ => bail!("tensor {} has shape {:?}, not one whose value heads tandem can reorder", t.name, t.shape),
    };
    let along = if axis == Axis::Rows { rows } else { cols };
    if from + key_heads * group * unit != along {
        bail!("tensor {} has {along} {} where its value heads need {}", t.name, if axis == Axis::Rows { "rows" } else { "columns" }, from + key_heads * group * unit);
    }
    // Cells: values, or a block format's blocks (a row is `cols / elements` of them).
    let per_cell = match t.dtype {
        DType::Blocks(f) => f.elements(),
        _ => 1,
    };
    if !cols.is_multiple_of(per_cell) || (axis == Axis::Columns && (!from.is_multiple_of(per_cell) || !unit.is_multiple_of(per_cell))) {
        bail!("tensor {}: its value heads ({unit} columns from {from}) do not fall on whole {} blocks of {per_cell}", t.name, t.dtype);
    }
    let (cols, from, unit) = if axis == Axis::Columns { (cols / per_cell, from / per_cell, unit / per_cell) } else { (cols / per_cell, from, unit) };
    // Source index along the axis of each destination index.
    let source = |i: usize| -> usize {
        if i < from {
            return i;
        }
        let (head, within) = ((i - from) / unit, (i - from) % unit);
        let (k, j) = (head / group, head % group);
        from + (j * key_heads + k) * unit + within
    };
    let size = t.dtype.bytes_of(per_cell);
    let bytes = &t.storage.bytes()[t.offset..t.offset + t.dtype.bytes_of(t.numel())];
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (sr, sc) = if axis == Axis::Rows { (source(r), c) } else { (r, source(c)) };
            let (d, s) = ((r * cols + c) * size, (sr * cols + sc) * size);
            out[d..d + size].copy_from_slice(&bytes[s..s + size]);
        }
    }
    let storage: Arc<dyn crate::model::tensor::Storage> = match t.dtype {
        DType::F32 => Arc::new(HeapStorage(out.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect::<Vec<f32>>())),
        DType::BF16 | DType::F16 => Arc::new(HeapStorage(out.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect::<Vec<u16>>())),
        DType::I8 | DType::Blocks(_) => Arc::new(HeapStorage(out)),
    };
    Ok(Tensor { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone(), storage, offset: 0 })
}
