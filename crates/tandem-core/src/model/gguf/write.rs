//! Writing a GGUF file: a model as llama.cpp's converter lays Qwen3.5 out (`qwen35.rs` reads it
//! back), its matrices in their dtype (bf16, f32, or a block format: `--quant q4_k` writes the
//! blocks the local runners read), the tokenizer as `tokenizer.ggml.*` and the chat template.
//! For the benchmarks (a GGUF file of a synthetic model) and the tests; the model it writes
//! loads back into the same weights, bit for bit.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::{GgmlType, Value};
use crate::model::config::LayerType;
use crate::model::tensor::{Matrix, WeightData};
use crate::model::{Mixer, Qwen35};

/// Where tensor data is aligned (`general.alignment` is left at its default).
const ALIGNMENT: usize = 32;

/// A GGUF file being assembled: metadata in order, then tensors.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    /// Name, dims (innermost first), type, bytes.
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    pub fn meta(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// A tensor of `dims` (GGUF's order: innermost first) of type `t`.
    pub fn tensor(&mut self, name: &str, dims: Vec<u64>, t: GgmlType, bytes: Vec<u8>) -> &mut Self {
        self.tensors.push((name.to_string(), dims, t, bytes));
        self
    }

    /// The file's bytes (version 3).
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(0x4655_4747u32.to_le_bytes());
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            out.extend(type_id(value).to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0usize;
        for (name, dims, t, bytes) in &self.tensors {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.id().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + bytes.len()).next_multiple_of(ALIGNMENT);
        }
        out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
        for (_, _, _, bytes) in &self.tensors {
            out.extend(bytes);
            out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
        }
        out
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        let mut f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        f.write_all(&self.bytes()).with_context(|| format!("writing {}", path.display()))
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::Str(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::Str(s) => put_str(out, s),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Array(items) => {
            // (An empty array is written as one of u8.)
            out.extend(items.first().map_or(0, type_id).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}

/// What a GGUF file of a model holds besides its weights.
pub struct Extras<'a> {
    /// A Hugging Face tokenizer.json, stored as `tokenizer.ggml.*` (byte-level BPE).
    pub tokenizer_json: Option<&'a [u8]>,
    pub chat_template: Option<&'a str>,
    pub eos_token_id: Option<u32>,
}

/// `net` as llama.cpp's converter writes Qwen3.5 (the transforms `qwen35.rs` undoes): blk.N
/// names, norms as the `1 + w` the model holds, `ssm_a` as −exp(A_log), the conv squeezed to
/// [channels, taps], value heads tiled where a DeltaNet layer has more of them than key heads.
pub fn qwen35(net: &Qwen35, extras: &Extras) -> Result<GgufWriter> {
    let c = &net.config;
    let mut w = GgufWriter::new();
    let a = |k: &str| format!("qwen35.{k}");
    let u = |x: usize| Value::U32(x as u32);
    w.meta("general.architecture", Value::Str("qwen35".into()))
        .meta("general.name", Value::Str("tandem".into()))
        .meta(&a("block_count"), u(c.num_hidden_layers))
        .meta(&a("context_length"), u(c.max_position_embeddings))
        .meta(&a("embedding_length"), u(c.hidden_size))
        .meta(&a("feed_forward_length"), u(c.intermediate_size))
        .meta(&a("attention.head_count"), u(c.num_attention_heads))
        .meta(&a("attention.head_count_kv"), u(c.num_key_value_heads))
        .meta(&a("attention.key_length"), u(c.head_dim))
        .meta(&a("attention.value_length"), u(c.head_dim))
        .meta(&a("attention.layer_norm_rms_epsilon"), Value::F32(c.rms_norm_eps))
        .meta(&a("rope.freq_base"), Value::F32(c.rope_theta as f32))
        .meta(&a("rope.dimension_count"), u(c.rotary_dim()))
        .meta(&a("rope.dimension_sections"), Value::Array(c.mrope_section.iter().chain(&[0]).map(|&s| Value::I32(s as i32)).collect()))
        .meta(&a("ssm.conv_kernel"), u(c.linear_conv_kernel_dim))
        .meta(&a("ssm.state_size"), u(c.linear_key_head_dim))
        .meta(&a("ssm.group_count"), u(c.linear_num_key_heads))
        .meta(&a("ssm.time_step_rank"), u(c.linear_num_value_heads))
        .meta(&a("ssm.inner_size"), u(c.linear_value_dim()))
        .meta(&a("full_attention_interval"), u(full_attention_interval(net)?));
    if let Some(t) = extras.tokenizer_json {
        tokenizer(&mut w, t)?;
    }
    if let Some(t) = extras.chat_template {
        w.meta("tokenizer.chat_template", Value::Str(t.into()));
    }
    if let Some(id) = extras.eos_token_id {
        w.meta("tokenizer.ggml.eos_token_id", Value::U32(id));
    }
    let (hk, hv, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim);
    let tiling = Tiling { key_heads: hk, group: hv / hk.max(1), on: hv != hk };
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    w.tensor("token_embd.weight", dims(&net.embed_tokens), ggml_type(&net.embed_tokens, "token_embd.weight")?, bytes(&net.embed_tokens));
    w.tensor("output_norm.weight", vec![c.hidden_size as u64], GgmlType::F32, f32s(&net.final_norm));
    if !std::ptr::eq(net.lm_head_data_ptr(), net.embed_data_ptr()) {
        w.tensor("output.weight", dims(&net.lm_head), ggml_type(&net.lm_head, "output.weight")?, bytes(&net.lm_head));
    }
    for (i, l) in net.layers.iter().enumerate() {
        let p = |n: &str| format!("blk.{i}.{n}");
        let mat = |w: &mut GgufWriter, n: &str, m: &Matrix| -> Result<()> {
            w.tensor(&p(n), dims(m), ggml_type(m, &p(n))?, bytes(m));
            Ok(())
        };
        match &l.mixer {
            Mixer::DeltaNet(d) => {
                let kd = 2 * c.linear_key_dim();
                let m = &d.in_proj_qkv;
                mat_tiled(&mut w, &p("attn_qkv.weight"), m, tiling, kd, dv, Axis::Rows)?;
                mat_tiled(&mut w, &p("attn_gate.weight"), &d.in_proj_z, tiling, 0, dv, Axis::Rows)?;
                mat_tiled(&mut w, &p("ssm_beta.weight"), &d.in_proj_b, tiling, 0, 1, Axis::Rows)?;
                mat_tiled(&mut w, &p("ssm_alpha.weight"), &d.in_proj_a, tiling, 0, 1, Axis::Rows)?;
                mat_tiled(&mut w, &p("ssm_out.weight"), &d.out_proj, tiling, 0, dv, Axis::Columns)?;
                let cd = c.linear_conv_dim();
                let kk = c.linear_conv_kernel_dim;
                // The taps back to [channels, taps] (the model holds them [taps, channels]).
                let mut conv = vec![0f32; cd * kk];
                for ch in 0..cd {
                    for t in 0..kk {
                        conv[ch * kk + t] = d.conv_taps[t * cd + ch];
                    }
                }
                let conv = tiling.apply(&conv, cd, kk, kd, dv, Axis::Rows);
                w.tensor(&p("ssm_conv1d.weight"), vec![kk as u64, cd as u64], GgmlType::F32, f32s(&conv));
                w.tensor(&p("ssm_a"), vec![hv as u64], GgmlType::F32, f32s(&tiling.apply(&d.neg_a, hv, 1, 0, 1, Axis::Rows)));
                w.tensor(&p("ssm_dt.bias"), vec![hv as u64], GgmlType::F32, f32s(&tiling.apply(&d.dt_bias, hv, 1, 0, 1, Axis::Rows)));
                w.tensor(&p("ssm_norm.weight"), vec![dv as u64], GgmlType::F32, f32s(&d.norm));
            }
            Mixer::Attention(at) => {
                mat(&mut w, "attn_q.weight", &at.q_proj)?;
                mat(&mut w, "attn_k.weight", &at.k_proj)?;
                mat(&mut w, "attn_v.weight", &at.v_proj)?;
                mat(&mut w, "attn_output.weight", &at.o_proj)?;
                w.tensor(&p("attn_q_norm.weight"), vec![c.head_dim as u64], GgmlType::F32, f32s(&at.q_norm));
                w.tensor(&p("attn_k_norm.weight"), vec![c.head_dim as u64], GgmlType::F32, f32s(&at.k_norm));
            }
        }
        mat(&mut w, "ffn_gate.weight", &l.mlp.gate_proj)?;
        mat(&mut w, "ffn_up.weight", &l.mlp.up_proj)?;
        mat(&mut w, "ffn_down.weight", &l.mlp.down_proj)?;
        w.tensor(&p("attn_norm.weight"), vec![c.hidden_size as u64], GgmlType::F32, f32s(&l.input_norm));
        w.tensor(&p("post_attention_norm.weight"), vec![c.hidden_size as u64], GgmlType::F32, f32s(&l.post_attention_norm));
    }
    Ok(w)
}

/// Every `full_attention_interval`-th layer attends (what the metadata can say).
fn full_attention_interval(net: &Qwen35) -> Result<usize> {
    let types = &net.config.layer_types;
    let interval = types.iter().position(|t| *t == LayerType::FullAttention).map_or(types.len().max(1), |i| i + 1);
    let regular = types.iter().enumerate().all(|(i, t)| (*t == LayerType::FullAttention) == ((i + 1) % interval == 0));
    if !regular {
        bail!("the model's full-attention layers are not every n-th layer, which qwen35's metadata cannot say");
    }
    Ok(interval)
}

fn dims(m: &Matrix) -> Vec<u64> {
    vec![m.cols as u64, m.rows as u64]
}

fn ggml_type(m: &Matrix, name: &str) -> Result<GgmlType> {
    Ok(match &m.data {
        WeightData::Bf16(_) => GgmlType::BF16,
        WeightData::F16(_) => GgmlType::F16,
        WeightData::F32(_) => GgmlType::F32,
        WeightData::Blocks { format, .. } => GgmlType::of_blocks(*format),
        WeightData::Int8 { .. } => bail!("{name}: int8 with row scales (--quant int8) is not a GGUF type; write Q8_0 (--quant q8_0) instead"),
    })
}

fn bytes(m: &Matrix) -> Vec<u8> {
    match &m.data {
        WeightData::Bf16(b) | WeightData::F16(b) => b.as_slice().iter().flat_map(|v| v.to_le_bytes()).collect(),
        WeightData::F32(b) => b.as_slice().iter().flat_map(|v| v.to_le_bytes()).collect(),
        WeightData::Blocks { data, .. } => data.as_slice().to_vec(),
        WeightData::Int8 { .. } => unreachable!("refused by ggml_type"),
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Axis {
    Rows,
    Columns,
}

/// Value heads in the converter's tiled order (`qwen35::regroup` puts them back): grouped
/// position `k · group + j` (key head k, value j of its group) to tiled `j · key_heads + k`,
/// each `unit` rows or columns long, from index `from` on.
#[derive(Clone, Copy)]
struct Tiling {
    key_heads: usize,
    group: usize,
    on: bool,
}

impl Tiling {
    /// The grouped index a tiled index takes its row (or column) from.
    fn source(&self, i: usize, from: usize, unit: usize) -> usize {
        if i < from {
            return i;
        }
        let (head, within) = ((i - from) / unit, (i - from) % unit);
        let (j, k) = (head / self.key_heads, head % self.key_heads);
        from + (k * self.group + j) * unit + within
    }

    /// `v` ([rows, cols] of f32) tiled along `axis`.
    fn apply(&self, v: &[f32], rows: usize, cols: usize, from: usize, unit: usize, axis: Axis) -> Vec<f32> {
        if !self.on {
            return v.to_vec();
        }
        let mut out = vec![0f32; v.len()];
        for r in 0..rows {
            for c in 0..cols {
                let (sr, sc) = if axis == Axis::Rows { (self.source(r, from, unit), c) } else { (r, self.source(c, from, unit)) };
                out[r * cols + c] = v[sr * cols + sc];
            }
        }
        out
    }
}

/// A matrix written with its value heads tiled: rows move whole (any dtype), columns by the
/// cell (a value, or a block format's block, which the heads' columns must fill whole).
fn mat_tiled(w: &mut GgufWriter, name: &str, m: &Matrix, tiling: Tiling, from: usize, unit: usize, axis: Axis) -> Result<()> {
    let t = ggml_type(m, name)?;
    let raw = bytes(m);
    if !tiling.on {
        w.tensor(name, dims(m), t, raw);
        return Ok(());
    }
    let per_cell = t.block_elements();
    if axis == Axis::Columns && (!from.is_multiple_of(per_cell) || !unit.is_multiple_of(per_cell)) {
        bail!("{name}: its value heads ({unit} columns) do not fill whole {} blocks of {per_cell}: write it in a format of smaller blocks", t.name());
    }
    let (cells, cell) = (m.cols / per_cell, t.block_bytes());
    let (from, unit) = if axis == Axis::Columns { (from / per_cell, unit / per_cell) } else { (from, unit) };
    let mut out = vec![0u8; raw.len()];
    for r in 0..m.rows {
        for c in 0..cells {
            let (sr, sc) = if axis == Axis::Rows { (tiling.source(r, from, unit), c) } else { (r, tiling.source(c, from, unit)) };
            out[(r * cells + c) * cell..][..cell].copy_from_slice(&raw[(sr * cells + sc) * cell..][..cell]);
        }
    }
    w.tensor(name, dims(m), t, out);
    Ok(())
}

/// A byte-level BPE tokenizer.json as `tokenizer.ggml.*`: tokens by id, their types (normal,
/// control for special added tokens, user-defined for the others), merges as "a b", the
/// Qwen3.5 pre-tokenizer.
fn tokenizer(w: &mut GgufWriter, json: &[u8]) -> Result<()> {
    let j: serde_json::Value = serde_json::from_slice(json).context("the tokenizer.json to store")?;
    let vocab = j["model"]["vocab"].as_object().context("tokenizer.json has no model.vocab")?;
    let added = j["added_tokens"].as_array().cloned().unwrap_or_default();
    let n = vocab.values().chain(added.iter().map(|a| &a["id"])).filter_map(|v| v.as_u64()).max().map_or(0, |m| m as usize + 1);
    let (mut tokens, mut types) = (vec![String::new(); n], vec![0i32; n]);
    for (t, id) in vocab {
        let id = id.as_u64().context("a vocab id is not a number")? as usize;
        (tokens[id], types[id]) = (t.clone(), 1);
    }
    for a in &added {
        let id = a["id"].as_u64().context("an added token's id is not a number")? as usize;
        (tokens[id], types[id]) = (a["content"].as_str().unwrap_or_default().to_string(), if a["special"].as_bool().unwrap_or(false) { 3 } else { 4 });
    }
    let merges: Vec<Value> = j["model"]["merges"]
        .as_array()
        .context("tokenizer.json has no model.merges")?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Value::Str(s.clone()),
            pair => Value::Str(format!("{} {}", pair[0].as_str().unwrap_or_default(), pair[1].as_str().unwrap_or_default())),
        })
        .collect();
    w.meta("tokenizer.ggml.model", Value::Str("gpt2".into()))
        .meta("tokenizer.ggml.pre", Value::Str("qwen35".into()))
        .meta("tokenizer.ggml.tokens", Value::Array(tokens.into_iter().map(Value::Str).collect()))
        .meta("tokenizer.ggml.token_type", Value::Array(types.into_iter().map(Value::I32).collect()))
        .meta("tokenizer.ggml.merges", Value::Array(merges));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::pool::Pool;
    use crate::model::load::LoadedModel;
    use crate::model::quant::Quant;

    /// Every `qwen35.*` key of the golden GGUF fixture, which the `gguf` package wrote as
    /// llama.cpp's converter lays Qwen3.5 out (llama.cpp's loader requires them, the rope's
    /// dimension sections among them), is in the file tandem writes of the same checkpoint,
    /// with the same value and type.
    #[test]
    fn a_written_gguf_file_has_the_converters_metadata() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        let m = LoadedModel::load(root.join("qwen35-tiny").to_str().unwrap()).unwrap();
        let path = std::env::temp_dir().join(format!("tandem-write-metadata-{}.gguf", std::process::id()));
        qwen35(&m.net, &Extras { tokenizer_json: None, chat_template: None, eos_token_id: None }).unwrap().write(&path).unwrap();
        let written = super::super::GgufFile::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let fixture = super::super::GgufFile::open(&root.join("gguf/qwen35-tiny-bf16.gguf")).unwrap();
        let keys: Vec<&str> = fixture.metadata().map(|(k, _)| k).filter(|k| k.starts_with("qwen35.") || *k == "general.architecture").collect();
        assert!(keys.len() >= 19, "the fixture holds {} of the architecture's keys", keys.len());
        for key in keys {
            assert_eq!(written.get(key), fixture.get(key), "{key}");
        }
    }

    /// The golden fixture (value heads tiled: 4 of them over 2 key heads), as stored and in
    /// Q8_0 blocks, written and read back: the same config and the same weights bit for bit
    /// (every matrix, norm, decay, conv tap), so the same logits; the chat template and end id
    /// come back too.
    #[test]
    fn a_written_gguf_file_loads_back_into_the_same_model() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        let pool = Pool::new(2);
        for quant in [None, Some(Quant::parse("q8_0").unwrap())] {
            let m = match quant {
                None => LoadedModel::load(dir.to_str().unwrap()).unwrap(),
                Some(q) => LoadedModel::load_quantized(dir.to_str().unwrap(), q, &pool).unwrap(),
            };
            let extras = Extras { tokenizer_json: None, chat_template: Some("{{ messages[0].content }}"), eos_token_id: Some(5) };
            let path = std::env::temp_dir().join(format!("tandem-write-{}-{}.gguf", std::process::id(), quant.map_or("bf16".into(), |q| q.name())));
            qwen35(&m.net, &extras).unwrap().write(&path).unwrap();
            let back = LoadedModel::load(path.to_str().unwrap()).unwrap();
            let _ = std::fs::remove_file(&path);
            assert_eq!(back.net.config, m.net.config);
            assert_eq!(back.stop_ids, vec![5]);
            let rows = |m: &Matrix| {
                let mut v = vec![0f32; m.cols];
                (0..m.rows).flat_map(|r| {
                    m.row_to_f32(r, &mut v);
                    v.clone()
                }).map(f32::to_bits).collect::<Vec<u32>>()
            };
            let (a, b) = (&m.net, &back.net);
            assert!(rows(&a.lm_head) == rows(&b.lm_head) && rows(&a.embed_tokens) == rows(&b.embed_tokens));
            assert_eq!(a.lm_head.dtype(), b.lm_head.dtype());
            assert_eq!(a.final_norm, b.final_norm);
            for (la, lb) in a.layers.iter().zip(&b.layers) {
                assert_eq!((&la.input_norm, &la.post_attention_norm), (&lb.input_norm, &lb.post_attention_norm));
                for (x, y) in [(&la.mlp.gate_proj, &lb.mlp.gate_proj), (&la.mlp.up_proj, &lb.mlp.up_proj), (&la.mlp.down_proj, &lb.mlp.down_proj)] {
                    assert!(rows(x) == rows(y) && x.dtype() == y.dtype());
                }
                match (&la.mixer, &lb.mixer) {
                    (Mixer::DeltaNet(x), Mixer::DeltaNet(y)) => {
                        for (p, q) in [(&x.in_proj_qkv, &y.in_proj_qkv), (&x.in_proj_z, &y.in_proj_z), (&x.in_proj_b, &y.in_proj_b), (&x.in_proj_a, &y.in_proj_a), (&x.out_proj, &y.out_proj)] {
                            assert!(rows(p) == rows(q) && p.dtype() == q.dtype());
                        }
                        assert_eq!((&x.conv_taps, &x.dt_bias, &x.neg_a, &x.norm), (&y.conv_taps, &y.dt_bias, &y.neg_a, &y.norm));
                    }
                    (Mixer::Attention(x), Mixer::Attention(y)) => {
                        for (p, q) in [(&x.q_proj, &y.q_proj), (&x.k_proj, &y.k_proj), (&x.v_proj, &y.v_proj), (&x.o_proj, &y.o_proj)] {
                            assert!(rows(p) == rows(q) && p.dtype() == q.dtype());
                        }
                        assert_eq!((&x.q_norm, &x.k_norm), (&y.q_norm, &y.k_norm));
                    }
                    _ => panic!("a layer of another kind"),
                }
            }
        }
    }
}
