//! The Qwen3.5 text decoder as data (docs/qwen35.md): 3 Gated DeltaNet layers then 1 gated
//! full-attention layer, repeated, each followed by a SwiGLU MLP; the weights in their stored
//! dtype, checked against the config as they are taken from the checkpoint; and what the model
//! costs (weight bytes, prefill FLOPs) and is (its fingerprint). The forward passes over these
//! weights are the backends' (`backend::cpu::forward`, `backend::cuda`).

use anyhow::{bail, Context, Result};

use crate::backend::cpu::kernels::deltanet;
use crate::backend::cpu::kernels::rope::{inv_freq, inv_freq_bf16};
use crate::backend::cpu::pool::Pool;
use crate::model::checkpoint::TensorSet;
use crate::model::config::{LayerType, Qwen35Config};
use crate::model::quant::{Quant, Role};
use crate::backend::cpu::CpuPrecision;
use crate::model::tensor::Matrix;

#[derive(Clone)]
pub struct Qwen35 {
    pub config: Qwen35Config,
    pub(crate) embed_tokens: Matrix,
    /// `lm_head.weight`, or the embedding when tied.
    pub(crate) lm_head: Matrix,
    /// `1 + norm.weight` (zero-centred RMSNorm).
    pub(crate) final_norm: Vec<f32>,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) inv_freq: Vec<f32>,
    /// How the CPU forward multiplies (see `set_cpu_precision`).
    pub(crate) cpu_precision: CpuPrecision,
}

#[derive(Clone)]
pub(crate) struct DecoderLayer {
    pub(crate) input_norm: Vec<f32>,
    pub(crate) post_attention_norm: Vec<f32>,
    pub(crate) mixer: Mixer,
    pub(crate) mlp: Mlp,
}

#[derive(Clone)]
pub(crate) enum Mixer {
    DeltaNet(GatedDeltaNet),
    Attention(GatedAttention),
}

#[derive(Clone)]
pub(crate) struct GatedDeltaNet {
    pub(crate) in_proj_qkv: Matrix,
    pub(crate) in_proj_z: Matrix,
    pub(crate) in_proj_b: Matrix,
    pub(crate) in_proj_a: Matrix,
    /// Depthwise conv taps, transposed to `[K, conv_dim]` (oldest tap first) so that one tap
    /// multiplies a whole row of channels.
    pub(crate) conv_taps: Vec<f32>,
    pub(crate) dt_bias: Vec<f32>,
    /// `−exp(A_log)`, in f32.
    pub(crate) neg_a: Vec<f32>,
    /// Plain weight of the gated RMSNorm (not 1 + w).
    pub(crate) norm: Vec<f32>,
    pub(crate) out_proj: Matrix,
}

#[derive(Clone)]
pub(crate) struct GatedAttention {
    /// Query and gate, interleaved per head: `[h0 query | h0 gate | h1 query | ...]`.
    pub(crate) q_proj: Matrix,
    pub(crate) k_proj: Matrix,
    pub(crate) v_proj: Matrix,
    pub(crate) o_proj: Matrix,
    pub(crate) q_norm: Vec<f32>,
    pub(crate) k_norm: Vec<f32>,
}

#[derive(Clone)]
pub(crate) struct Mlp {
    pub(crate) gate_proj: Matrix,
    pub(crate) up_proj: Matrix,
    pub(crate) down_proj: Matrix,
}

impl Qwen35 {
    /// Build the model from checkpoint tensors, checking every shape against the config.
    /// With `quant` (and the pool to quantize on), every matrix a forward pass multiplies by is
    /// quantized as soon as it is read, and its stored bytes are released, so the whole model
    /// never sits in memory twice.
    pub fn load(config: Qwen35Config, ts: &mut TensorSet, quant: Option<(Quant, &Pool)>) -> Result<Self> {
        let c = &config;
        let (h, v) = (c.hidden_size, c.vocab_size);
        // The embedding table is only looked up (one row per token): it stays as stored.
        let embed_tokens = matrix(ts, None, "embed_tokens.weight", &[v, h])?;
        let lm_head = if c.tie_word_embeddings {
            match quant {
                Some((q, pool)) => q.apply(pool, &embed_tokens, Role::LmHead),
                None => embed_tokens.clone(),
            }
        } else if ts.contains("lm_head.weight") {
            matrix(ts, quant, "lm_head.weight", &[v, h])?
        } else {
            // Using the embeddings instead would run, and generate the wrong tokens.
            bail!("tensor lm_head.weight is missing: the config sets tie_word_embeddings to false, so the checkpoint must hold its own output projection (lm_head.weight)");
        };
        let final_norm = zero_centred(ts, "norm.weight", &[h])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for (i, lt) in c.layer_types.iter().enumerate() {
            let p = format!("layers.{i}.");
            let mixer = match lt {
                LayerType::LinearAttention => {
                    let (hv, vd, cd, kk) = (
                        c.linear_num_value_heads,
                        c.linear_value_dim(),
                        c.linear_conv_dim(),
                        c.linear_conv_kernel_dim,
                    );
                    let la = format!("{p}linear_attn.");
                    // The decay -exp(A_log); a GGUF file holds it computed (`neg_a`).
                    let neg_a_name = format!("{la}neg_a");
                    let neg_a = if ts.contains(&neg_a_name) {
                        small(ts, &neg_a_name, &[hv])?
                    } else {
                        small(ts, &format!("{la}A_log"), &[hv])?.iter().map(|a| -a.exp()).collect()
                    };
                    Mixer::DeltaNet(GatedDeltaNet {
                        in_proj_qkv: matrix(ts, quant, &format!("{la}in_proj_qkv.weight"), &[cd, h])?,
                        in_proj_z: matrix(ts, quant, &format!("{la}in_proj_z.weight"), &[vd, h])?,
                        in_proj_b: matrix(ts, quant, &format!("{la}in_proj_b.weight"), &[hv, h])?,
                        in_proj_a: matrix(ts, quant, &format!("{la}in_proj_a.weight"), &[hv, h])?,
                        conv_taps: transpose(&small(ts, &format!("{la}conv1d.weight"), &[cd, 1, kk])?, cd, kk),
                        dt_bias: small(ts, &format!("{la}dt_bias"), &[hv])?,
                        neg_a,
                        norm: small(ts, &format!("{la}norm.weight"), &[c.linear_value_head_dim])?,
                        out_proj: matrix(ts, quant, &format!("{la}out_proj.weight"), &[h, vd])?,
                    })
                }
                LayerType::FullAttention => {
                    let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                    let sa = format!("{p}self_attn.");
                    Mixer::Attention(GatedAttention {
                        q_proj: matrix(ts, quant, &format!("{sa}q_proj.weight"), &[hq * d * 2, h])?,
                        k_proj: matrix(ts, quant, &format!("{sa}k_proj.weight"), &[hkv * d, h])?,
                        v_proj: matrix(ts, quant, &format!("{sa}v_proj.weight"), &[hkv * d, h])?,
                        o_proj: matrix(ts, quant, &format!("{sa}o_proj.weight"), &[h, hq * d])?,
                        q_norm: zero_centred(ts, &format!("{sa}q_norm.weight"), &[d])?,
                        k_norm: zero_centred(ts, &format!("{sa}k_norm.weight"), &[d])?,
                    })
                }
            };
            let f = c.intermediate_size;
            layers.push(DecoderLayer {
                input_norm: zero_centred(ts, &format!("{p}input_layernorm.weight"), &[h])?,
                post_attention_norm: zero_centred(ts, &format!("{p}post_attention_layernorm.weight"), &[h])?,
                mixer,
                mlp: Mlp {
                    gate_proj: matrix(ts, quant, &format!("{p}mlp.gate_proj.weight"), &[f, h])?,
                    up_proj: matrix(ts, quant, &format!("{p}mlp.up_proj.weight"), &[f, h])?,
                    down_proj: matrix(ts, quant, &format!("{p}mlp.down_proj.weight"), &[h, f])?,
                },
            });
        }
        let inv_freq = inv_freq(c.rope_theta, c.rotary_dim());
        Ok(Qwen35 { config, embed_tokens, lm_head, final_norm, layers, inv_freq, cpu_precision: CpuPrecision::Exact })
    }

    /// Use bf16-rounded RoPE frequencies (see `kernels::rope::inv_freq_bf16`), to compare with
    /// a reference that rounded them.
    pub fn set_rope_frequencies_bf16(&mut self, rounded: bool) {
        let c = &self.config;
        self.inv_freq = if rounded { inv_freq_bf16(c.rope_theta, c.rotary_dim()) } else { inv_freq(c.rope_theta, c.rotary_dim()) };
    }

    /// How the CPU forward multiplies. `Bf16Inputs` computes as the GPU does with tensor-core
    /// precision (`cuda::qwen35::Precision::TensorCores`): the input of every product rounded to
    /// bf16 (to nearest, ties to even) before the f32 sums, decode-sized products too (the GPU's
    /// GEMV rounds its inputs as its GEMM does): the CPU reference for that arithmetic (`tandem
    /// verify --precision tensor-cores`), and a measure of how far bf16 activations move a
    /// model's outputs. `Fast` is a CPU engine's `precision=fast`.
    pub fn set_cpu_precision(&mut self, precision: CpuPrecision) {
        self.cpu_precision = precision;
    }

    pub fn cpu_precision(&self) -> CpuPrecision {
        self.cpu_precision
    }

    /// `--quant int8`: replace every matrix a forward pass multiplies by (the LM head too) with
    /// its int8 quantization. The embedding table stays as stored (one row is read per token).
    pub fn quantize_int8(&mut self, pool: &Pool) {
        self.quantize(Quant::Int8, pool);
    }

    /// `--quant`: replace every matrix a forward pass multiplies by (the LM head too) with its
    /// quantization. The embedding table stays as stored (one row is read per token).
    pub fn quantize(&mut self, quant: Quant, pool: &Pool) {
        self.map_matrices_by_role(|m, role| quant.apply(pool, m, role));
    }

    /// Store the embedding table in `quant`'s format for the layers (as GGUF files of the local
    /// runners often hold it: a row is dequantized per token looked up). A tied LM head stays
    /// the same matrix.
    pub fn quantize_embedding(&mut self, quant: Quant, pool: &Pool) {
        let tied = std::ptr::eq(self.lm_head_data_ptr(), self.embed_data_ptr());
        self.embed_tokens = quant.apply(pool, &self.embed_tokens, Role::Layer);
        if tied {
            self.lm_head = self.embed_tokens.clone();
        }
    }

    /// For CPU engines, which read every weight in every decode step: copy the matrices that are
    /// still a checkpoint file's pages into memory of the process's own in 2 MB pages (see
    /// `zeroed_in_huge_pages`; the file's pages are given back as each is copied). The values,
    /// and so every result, stay the same. A GPU engine keeps the file's pages: it reads them
    /// once, to upload them.
    pub fn copy_file_weights_into_huge_pages(&mut self) {
        let tied = std::ptr::eq(self.lm_head_data_ptr(), self.embed_data_ptr());
        self.map_matrices(Matrix::in_huge_pages);
        if tied {
            // One copy serves both, as the file's one tensor did.
            self.embed_tokens = self.lm_head.clone();
        }
    }

    /// Replace every matrix a forward pass multiplies by with `f(matrix)`.
    pub fn map_matrices(&mut self, f: impl Fn(&Matrix) -> Matrix) {
        self.map_matrices_by_role(|m, _| f(m));
    }

    /// Replace every matrix a forward pass multiplies by with `f(matrix, its role)`.
    pub fn map_matrices_by_role(&mut self, f: impl Fn(&Matrix, Role) -> Matrix) {
        self.lm_head = f(&self.lm_head, Role::LmHead);
        let q = |m: &mut Matrix| *m = f(m, Role::Layer);
        for l in &mut self.layers {
            q(&mut l.mlp.gate_proj);
            q(&mut l.mlp.up_proj);
            q(&mut l.mlp.down_proj);
            match &mut l.mixer {
                Mixer::DeltaNet(d) => {
                    for m in [&mut d.in_proj_qkv, &mut d.in_proj_z, &mut d.in_proj_a, &mut d.in_proj_b, &mut d.out_proj] {
                        q(m);
                    }
                }
                Mixer::Attention(a) => {
                    for m in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj] {
                        q(m);
                    }
                }
            }
        }
    }

    /// What identifies this model to the state bridge: a hash of its config and of weights
    /// that `--quant` leaves as stored (the embedding table, every norm), so that a state made
    /// by the bf16 and one made by the int8 form of a checkpoint are interchangeable, and one
    /// made by any other checkpoint is refused.
    pub fn fingerprint(&self) -> u128 {
        let mut parts: Vec<Vec<u8>> = vec![format!("{:?}", self.config).into_bytes()];
        let (v, h) = (self.config.vocab_size, self.config.hidden_size);
        let mut row = vec![0f32; h];
        for r in [0, 1, v / 3, v / 2, v - 1] {
            self.embed_tokens.row_to_f32(r, &mut row);
            parts.push(row.iter().flat_map(|x| x.to_le_bytes()).collect());
        }
        parts.push(self.final_norm.iter().flat_map(|x| x.to_le_bytes()).collect());
        for l in &self.layers {
            parts.push(l.input_norm.iter().chain(&l.post_attention_norm).flat_map(|x| x.to_le_bytes()).collect());
        }
        // Two 64-bit halves: the parts forward and backward (each part's length mixed in, so
        // that bytes cannot move between parts unnoticed).
        let half = |order: &mut dyn Iterator<Item = &Vec<u8>>| {
            let mut h = crate::bridge::checksum::Hasher::default();
            for p in order {
                h.update(&(p.len() as u64).to_le_bytes());
                h.update(p);
            }
            h.finish()
        };
        let (lo, hi) = (half(&mut parts.iter()), half(&mut parts.iter().rev()));
        ((hi as u128) << 64) | lo as u128
    }

    /// Bytes of all weights held (the embedding table included, once even when tied).
    pub fn weight_bytes(&self) -> usize {
        let tied = std::ptr::eq(self.lm_head_data_ptr(), self.embed_data_ptr());
        self.weight_bytes_per_token() + if tied { 0 } else { self.embed_tokens.bytes() }
    }

    pub(crate) fn lm_head_data_ptr(&self) -> *const u8 {
        self.lm_head.data_ptr()
    }
    pub(crate) fn embed_data_ptr(&self) -> *const u8 {
        self.embed_tokens.data_ptr()
    }

    /// Floating-point operations (2 per multiply-add) of the layers' projections for one token:
    /// most of a prefill's, and all that runs on tensor cores or in a GEMM.
    pub fn projection_flops_per_token(&self) -> f64 {
        let mut weights = 0;
        self.for_each_layer_matrix(|m| weights += m.rows * m.cols);
        2.0 * weights as f64
    }

    /// Floating-point operations (2 per multiply-add) of a prefill of `t` tokens from an empty
    /// state: the projections, the LM head for the last token, attention over the causal
    /// prefix, and the chunked delta rule as `kernels::deltanet::chunked` performs it.
    pub fn prefill_flops(&self, t: usize) -> f64 {
        let c = &self.config;
        let t_f = t as f64;
        let mut fma = self.projection_flops_per_token() / 2.0 * t_f + (c.vocab_size * c.hidden_size) as f64;
        let attn_layers = c.num_full_attention_layers() as f64;
        // q·k and p·v over t(t+1)/2 visible pairs, per query head.
        fma += attn_layers * 2.0 * (c.num_attention_heads * c.head_dim) as f64 * t_f * (t_f + 1.0) / 2.0;
        let (dk, dv) = (c.linear_key_head_dim as f64, c.linear_value_head_dim as f64);
        let gdn_layers = (c.num_hidden_layers - c.num_full_attention_layers()) as f64;
        let mut per_head = 0.0;
        let mut left = t;
        while left > 0 {
            let n = left.min(deltanet::CHUNK) as f64;
            // A and P (n×n×dk each), the two substitutions, W·S, q·S, P·V', the state update.
            per_head += 2.0 * n * n * dk + n * n / 2.0 * (dk + dv) + 3.0 * n * dk * dv + n * n * dv;
            left -= n as usize;
        }
        fma += gdn_layers * c.linear_num_value_heads as f64 * per_head;
        2.0 * fma
    }

    /// Bytes of the LM head's weights (the largest single read of a decode step).
    pub fn lm_head_bytes(&self) -> usize {
        self.lm_head.bytes()
    }

    /// Bytes of weights one decode step streams: every layer matrix plus the LM head
    /// (the embedding lookup reads one row).
    pub fn weight_bytes_per_token(&self) -> usize {
        let mut total = self.lm_head.bytes();
        self.for_each_layer_matrix(|m| total += m.bytes());
        total
    }

    /// What the matrices hold, for reports: `layers: 8 q4_k, 40 q8_0; LM head: q6_k`.
    pub fn matrix_formats(&self) -> String {
        let mut counts: Vec<(String, usize)> = Vec::new();
        self.for_each_layer_matrix(|m| {
            let name = m.dtype().to_string();
            match counts.iter_mut().find(|(n, _)| *n == name) {
                Some((_, c)) => *c += 1,
                None => counts.push((name, 1)),
            }
        });
        let layers: Vec<String> = counts.iter().map(|(n, c)| format!("{c} {n}")).collect();
        format!("layers: {}; LM head: {}", layers.join(", "), self.lm_head.dtype())
    }

    /// `f(matrix)` for every matrix of the layers (not the LM head or the embedding).
    pub fn for_each_layer_matrix(&self, mut f: impl FnMut(&Matrix)) {
        for l in &self.layers {
            for m in [&l.mlp.gate_proj, &l.mlp.up_proj, &l.mlp.down_proj] {
                f(m);
            }
            match &l.mixer {
                Mixer::DeltaNet(d) => [&d.in_proj_qkv, &d.in_proj_z, &d.in_proj_a, &d.in_proj_b, &d.out_proj].into_iter().for_each(&mut f),
                Mixer::Attention(a) => [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj].into_iter().for_each(&mut f),
            }
        }
    }
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = x[r * cols + c];
        }
    }
    t
}

/// Take a matrix out of the set; with `quant`, quantize it (as the LM head for
/// `lm_head.weight`) and release the stored bytes.
fn matrix(ts: &mut TensorSet, quant: Option<(Quant, &Pool)>, name: &str, shape: &[usize]) -> Result<Matrix> {
    let t = ts.take(name, shape)?;
    let m = Matrix::from_tensor(&t).with_context(|| format!("{}: tensor {}", ts.source, t.name))?;
    let Some((quant, pool)) = quant else { return Ok(m) };
    let q = quant.apply(pool, &m, if name == "lm_head.weight" { Role::LmHead } else { Role::Layer });
    t.storage.release(t.offset, t.dtype.bytes_of(t.numel()));
    Ok(q)
}

fn small(ts: &mut TensorSet, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let t = ts.take(name, shape)?;
    t.to_f32_vec().with_context(|| format!("{}: tensor {}", ts.source, t.name))
}

/// `1 + w` of a zero-centred RMSNorm weight, computed in f32 like the reference (a GGUF
/// file holds it so already: `TensorSet::norms_hold_one`).
fn zero_centred(ts: &mut TensorSet, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let w = ts.take(name, shape)?.to_f32_vec()?;
    Ok(if ts.norms_hold_one { w } else { w.into_iter().map(|w| 1.0 + w).collect() })
}
