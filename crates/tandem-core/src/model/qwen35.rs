//! Qwen3.5 text decoder, exactly as qwen35-spec.md §2-3 (HF transformers 5.23.0
//! `Qwen3_5ForCausalLM`): 3 Gated DeltaNet layers then 1 gated full-attention layer, repeated,
//! each followed by a SwiGLU MLP. Activations are f32; weights are read in their stored dtype.

use anyhow::{bail, Context, Result};

use crate::checkpoint::TensorSet;
use crate::config::{LayerType, Qwen35Config};
use crate::kernels::attention::attention_head;
use crate::kernels::deltanet::{self, ChunkScratch};
use crate::kernels::matmul::{matmul, matmul_group};
use crate::pool::Pool;
use crate::quant::quantize_int8_on;
use crate::kernels::norm::{gated_rms_norm_inplace, l2_normalize, rms_norm, rms_norm_inplace, sigmoid, silu, softplus, swiglu_inplace};
use crate::kernels::rope::{apply_rope, cos_sin, inv_freq, inv_freq_bf16};
use crate::state::{LayerState, State};
use crate::tensor::{Matrix, Tensor};

#[derive(Clone)]
pub struct Qwen35 {
    pub config: Qwen35Config,
    embed_tokens: Matrix,
    /// `lm_head.weight`, or the embedding when tied.
    lm_head: Matrix,
    /// `1 + norm.weight` (zero-centred RMSNorm).
    final_norm: Vec<f32>,
    layers: Vec<DecoderLayer>,
    inv_freq: Vec<f32>,
}

#[derive(Clone)]
struct DecoderLayer {
    input_norm: Vec<f32>,
    post_attention_norm: Vec<f32>,
    mixer: Mixer,
    mlp: Mlp,
}

#[derive(Clone)]
enum Mixer {
    DeltaNet(GatedDeltaNet),
    Attention(GatedAttention),
}

#[derive(Clone)]
struct GatedDeltaNet {
    in_proj_qkv: Matrix,
    in_proj_z: Matrix,
    in_proj_b: Matrix,
    in_proj_a: Matrix,
    /// Depthwise conv taps, transposed to `[K, conv_dim]` (oldest tap first) so that one tap
    /// multiplies a whole row of channels.
    conv_taps: Vec<f32>,
    dt_bias: Vec<f32>,
    /// `−exp(A_log)`, in f32.
    neg_a: Vec<f32>,
    /// Plain weight of the gated RMSNorm (not 1 + w).
    norm: Vec<f32>,
    out_proj: Matrix,
}

#[derive(Clone)]
struct GatedAttention {
    /// Query and gate, interleaved per head: `[h0 query | h0 gate | h1 query | ...]`.
    q_proj: Matrix,
    k_proj: Matrix,
    v_proj: Matrix,
    o_proj: Matrix,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

#[derive(Clone)]
struct Mlp {
    gate_proj: Matrix,
    up_proj: Matrix,
    down_proj: Matrix,
}

/// The most tokens one pass of `forward` applies (a multiple of the DeltaNet chunk).
pub const MAX_TOKENS_PER_PASS: usize = 2 * deltanet::CHUNK;

/// Which positions of a forward pass need logits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Logits {
    /// Only the last token (prefill before generation, decode).
    Last,
    /// Every token (verification against the reference).
    All,
}

impl Qwen35 {
    /// Build the model from checkpoint tensors, checking every shape against the config.
    /// With `int8` (the pool to quantize on), every matrix a forward pass multiplies by is
    /// quantized as soon as it is read, and its stored bytes are released, so the whole model
    /// never sits in memory twice.
    pub fn load(config: Qwen35Config, ts: &mut TensorSet, int8: Option<&Pool>) -> Result<Self> {
        let c = &config;
        let (h, v) = (c.hidden_size, c.vocab_size);
        // The embedding table is only looked up (one row per token): it stays as stored.
        let embed_tokens = matrix(ts, None, "embed_tokens.weight", &[v, h])?;
        let lm_head = if ts.contains("lm_head.weight") && !c.tie_word_embeddings {
            matrix(ts, int8, "lm_head.weight", &[v, h])?
        } else {
            match int8 {
                Some(pool) => quantize_int8_on(pool, &embed_tokens),
                None => embed_tokens.clone(),
            }
        };
        let final_norm = zero_centred(ts.take("norm.weight", &[h])?)?;
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
                    let a_log = small(ts, &format!("{la}A_log"), &[hv])?;
                    Mixer::DeltaNet(GatedDeltaNet {
                        in_proj_qkv: matrix(ts, int8, &format!("{la}in_proj_qkv.weight"), &[cd, h])?,
                        in_proj_z: matrix(ts, int8, &format!("{la}in_proj_z.weight"), &[vd, h])?,
                        in_proj_b: matrix(ts, int8, &format!("{la}in_proj_b.weight"), &[hv, h])?,
                        in_proj_a: matrix(ts, int8, &format!("{la}in_proj_a.weight"), &[hv, h])?,
                        conv_taps: transpose(&small(ts, &format!("{la}conv1d.weight"), &[cd, 1, kk])?, cd, kk),
                        dt_bias: small(ts, &format!("{la}dt_bias"), &[hv])?,
                        neg_a: a_log.iter().map(|a| -a.exp()).collect(),
                        norm: small(ts, &format!("{la}norm.weight"), &[c.linear_value_head_dim])?,
                        out_proj: matrix(ts, int8, &format!("{la}out_proj.weight"), &[h, vd])?,
                    })
                }
                LayerType::FullAttention => {
                    let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                    let sa = format!("{p}self_attn.");
                    Mixer::Attention(GatedAttention {
                        q_proj: matrix(ts, int8, &format!("{sa}q_proj.weight"), &[hq * d * 2, h])?,
                        k_proj: matrix(ts, int8, &format!("{sa}k_proj.weight"), &[hkv * d, h])?,
                        v_proj: matrix(ts, int8, &format!("{sa}v_proj.weight"), &[hkv * d, h])?,
                        o_proj: matrix(ts, int8, &format!("{sa}o_proj.weight"), &[h, hq * d])?,
                        q_norm: zero_centred(ts.take(&format!("{sa}q_norm.weight"), &[d])?)?,
                        k_norm: zero_centred(ts.take(&format!("{sa}k_norm.weight"), &[d])?)?,
                    })
                }
            };
            let f = c.intermediate_size;
            layers.push(DecoderLayer {
                input_norm: zero_centred(ts.take(&format!("{p}input_layernorm.weight"), &[h])?)?,
                post_attention_norm: zero_centred(ts.take(&format!("{p}post_attention_layernorm.weight"), &[h])?)?,
                mixer,
                mlp: Mlp {
                    gate_proj: matrix(ts, int8, &format!("{p}mlp.gate_proj.weight"), &[f, h])?,
                    up_proj: matrix(ts, int8, &format!("{p}mlp.up_proj.weight"), &[f, h])?,
                    down_proj: matrix(ts, int8, &format!("{p}mlp.down_proj.weight"), &[h, f])?,
                },
            });
        }
        let inv_freq = inv_freq(c.rope_theta, c.rotary_dim());
        Ok(Qwen35 { config, embed_tokens, lm_head, final_norm, layers, inv_freq })
    }

    /// Use bf16-rounded RoPE frequencies (see `kernels::rope::inv_freq_bf16`), to compare with
    /// a reference that rounded them.
    pub fn set_rope_frequencies_bf16(&mut self, rounded: bool) {
        let c = &self.config;
        self.inv_freq = if rounded { inv_freq_bf16(c.rope_theta, c.rotary_dim()) } else { inv_freq(c.rope_theta, c.rotary_dim()) };
    }

    /// `--quant int8`: replace every matrix a forward pass multiplies by (the LM head too) with
    /// its int8 quantization. The embedding table stays as stored (one row is read per token).
    pub fn quantize_int8(&mut self, pool: &Pool) {
        self.map_matrices(|m| quantize_int8_on(pool, m));
    }

    /// Replace every matrix a forward pass multiplies by with `f(matrix)`.
    pub fn map_matrices(&mut self, f: impl Fn(&Matrix) -> Matrix) {
        let q = |m: &mut Matrix| *m = f(m);
        q(&mut self.lm_head);
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

    /// Bytes of all weights held (the embedding table included, once even when tied).
    pub fn weight_bytes(&self) -> usize {
        let tied = std::ptr::eq(self.lm_head_data_ptr(), self.embed_data_ptr());
        self.weight_bytes_per_token() + if tied { 0 } else { self.embed_tokens.bytes() }
    }

    fn lm_head_data_ptr(&self) -> *const u8 {
        data_ptr(&self.lm_head)
    }
    fn embed_data_ptr(&self) -> *const u8 {
        data_ptr(&self.embed_tokens)
    }

    /// Floating-point operations (2 per multiply-add) of a prefill of `t` tokens from an empty
    /// state: the projections, the LM head for the last token, attention over the causal
    /// prefix, and the chunked delta rule as `kernels::deltanet::chunked` performs it.
    pub fn prefill_flops(&self, t: usize) -> f64 {
        let c = &self.config;
        let t_f = t as f64;
        let matmul_params = (self.weight_bytes_per_token() - self.lm_head.bytes()) as f64 / self.lm_head.dtype().size() as f64;
        let mut fma = matmul_params * t_f + (c.vocab_size * c.hidden_size) as f64;
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

    /// Bytes of weights one decode step streams: every layer matrix plus the LM head
    /// (the embedding lookup reads one row).
    pub fn weight_bytes_per_token(&self) -> usize {
        let mut total = self.lm_head.bytes();
        for l in &self.layers {
            total += l.mlp.gate_proj.bytes() + l.mlp.up_proj.bytes() + l.mlp.down_proj.bytes();
            total += match &l.mixer {
                Mixer::DeltaNet(d) => d.in_proj_qkv.bytes() + d.in_proj_z.bytes() + d.in_proj_a.bytes() + d.in_proj_b.bytes() + d.out_proj.bytes(),
                Mixer::Attention(a) => a.q_proj.bytes() + a.k_proj.bytes() + a.v_proj.bytes() + a.o_proj.bytes(),
            };
        }
        total
    }

    /// Apply `tokens` to `state` (which covers `[0, state.position)`), and return the logits of
    /// the last token (`Logits::Last`) or of every token (`Logits::All`, `[T, vocab]`).
    /// `state.last_logits` always ends up holding the last token's logits.
    ///
    /// Long inputs run in pieces of `MAX_TOKENS_PER_PASS`, which bounds the activations' memory
    /// and changes no result: the pieces start on DeltaNet chunk boundaries, so every chunk,
    /// every product and every attention row is computed exactly as in one pass.
    pub fn forward(&self, pool: &Pool, tokens: &[u32], state: &mut State, which: Logits) -> Result<Vec<f32>> {
        // Everything is checked before the first token is applied: a failed call leaves the
        // state as it was.
        let c = &self.config;
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            bail!("token id {bad} is outside the model's vocabulary (ids 0..{})", c.vocab_size);
        }
        if state.position + tokens.len() > c.max_position_embeddings {
            bail!(
                "{} tokens after position {} exceed the model's context of {} tokens (max_position_embeddings)",
                tokens.len(),
                state.position,
                c.max_position_embeddings
            );
        }
        state.check_shape(c)?;
        let mut logits = Vec::new();
        for piece in tokens.chunks(MAX_TOKENS_PER_PASS) {
            let out = self.forward_pass(pool, piece, state, which)?;
            if which == Logits::All {
                logits.extend_from_slice(&out);
            } else {
                logits = out;
            }
        }
        Ok(logits)
    }

    fn forward_pass(&self, pool: &Pool, tokens: &[u32], state: &mut State, which: Logits) -> Result<Vec<f32>> {
        let c = &self.config;
        let (t, h) = (tokens.len(), c.hidden_size);
        let mut x = vec![0f32; t * h];
        for (i, &id) in tokens.iter().enumerate() {
            self.embed_tokens.row_to_f32(id as usize, &mut x[i * h..(i + 1) * h]);
        }
        let mut xn = vec![0f32; t * h];
        let mut mixed = vec![0f32; t * h];
        for (layer, layer_state) in self.layers.iter().zip(state.layers.iter_mut()) {
            rms_norm(&x, &layer.input_norm, c.rms_norm_eps, &mut xn);
            match (&layer.mixer, layer_state) {
                (Mixer::DeltaNet(m), LayerState::Linear { conv, recurrent }) => self.gated_deltanet(pool, m, &xn, t, conv, recurrent, &mut mixed),
                (Mixer::Attention(m), LayerState::Full { k, v }) => self.gated_attention(pool, m, &xn, t, state.position, k, v, &mut mixed),
                _ => unreachable!("state layer kinds were checked against the model's layer_types"),
            }
            add_inplace(&mut x, &mixed);
            rms_norm(&x, &layer.post_attention_norm, c.rms_norm_eps, &mut xn);
            self.mlp(pool, &layer.mlp, &xn, t, &mut mixed);
            add_inplace(&mut x, &mixed);
        }
        state.position += t;

        let rows = match which {
            Logits::Last => &mut x[(t - 1) * h..],
            Logits::All => &mut x[..],
        };
        rms_norm_inplace(rows, &self.final_norm, c.rms_norm_eps);
        let n = rows.len() / h;
        let mut logits = vec![0f32; n * c.vocab_size];
        matmul(pool, rows, n, &self.lm_head, &mut logits);
        state.last_logits.clear();
        state.last_logits.extend_from_slice(&logits[(n - 1) * c.vocab_size..]);
        Ok(logits)
    }

    /// Gated DeltaNet (spec §2.4): projections, causal conv over the raw qkv columns, l2-normed
    /// q/k, the gated delta rule per value head, gated RMSNorm, output projection.
    #[allow(clippy::too_many_arguments)]
    fn gated_deltanet(&self, pool: &Pool, m: &GatedDeltaNet, xn: &[f32], t: usize, conv: &mut [f32], recurrent: &mut [f32], out: &mut [f32]) {
        let c = &self.config;
        let (hk, hv, dk, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (kd, vd, cd, kk) = (c.linear_key_dim(), c.linear_value_dim(), c.linear_conv_dim(), c.linear_conv_kernel_dim);

        let mut qkv = vec![0f32; t * cd];
        let mut z = vec![0f32; t * vd];
        let mut b = vec![0f32; t * hv];
        let mut a = vec![0f32; t * hv];
        matmul_group(pool, xn, t, &mut [(&m.in_proj_qkv, &mut qkv), (&m.in_proj_z, &mut z), (&m.in_proj_b, &mut b), (&m.in_proj_a, &mut a)]);

        // Causal depthwise conv + SiLU over the window (K raw columns before this call) ++ qkv.
        let mut window = Vec::with_capacity((kk + t) * cd);
        window.extend_from_slice(conv);
        window.extend_from_slice(&qkv);
        let mut mixed_qkv = vec![0f32; t * cd];
        causal_conv_silu(&window, &m.conv_taps, kk, cd, &mut mixed_qkv);
        conv.copy_from_slice(&window[t * cd..]);

        // q, k: l2-normalised per key head, q scaled by 1/√Dk.
        let q_scale = 1.0 / (dk as f32).sqrt();
        for row in mixed_qkv.chunks_exact_mut(cd) {
            for head in row[..kd].chunks_exact_mut(dk) {
                l2_normalize(head);
                head.iter_mut().for_each(|v| *v *= q_scale);
            }
            for head in row[kd..2 * kd].chunks_exact_mut(dk) {
                l2_normalize(head);
            }
        }

        // The delta rule, value heads split over the pool. Value head h reads key head
        // h / (Hv/Hk); each head owns its slice of the recurrent state and of `core`.
        let group = hv / hk;
        let mut core = vec![0f32; t * vd];
        let shared = SharedMut(core.as_mut_ptr(), recurrent.as_mut_ptr());
        pool.for_ranges(hv, 1, &|heads| {
            let shared = shared;
            let (mut qh, mut kh, mut vh) = (vec![0f32; t * dk], vec![0f32; t * dk], vec![0f32; t * dv]);
            let (mut beta, mut g, mut oh) = (vec![0f32; t], vec![0f32; t], vec![0f32; t * dv]);
            let mut scratch = ChunkScratch::default();
            for head in heads {
                let kh_idx = head / group;
                for i in 0..t {
                    let row = &mixed_qkv[i * cd..(i + 1) * cd];
                    qh[i * dk..(i + 1) * dk].copy_from_slice(&row[kh_idx * dk..(kh_idx + 1) * dk]);
                    kh[i * dk..(i + 1) * dk].copy_from_slice(&row[kd + kh_idx * dk..kd + (kh_idx + 1) * dk]);
                    vh[i * dv..(i + 1) * dv].copy_from_slice(&row[2 * kd + head * dv..2 * kd + (head + 1) * dv]);
                    beta[i] = sigmoid(b[i * hv + head]);
                    g[i] = m.neg_a[head] * softplus(a[i * hv + head] + m.dt_bias[head]);
                }
                // SAFETY: head slices of the state and of `core` are disjoint between workers.
                let s = unsafe { std::slice::from_raw_parts_mut(shared.1.add(head * dk * dv), dk * dv) };
                if t == 1 {
                    deltanet::recurrent_step(s, &qh, &kh, &vh, beta[0], g[0], &mut oh);
                } else {
                    deltanet::chunked(s, &qh, &kh, &vh, &beta, &g, &mut oh, &mut scratch);
                }
                for i in 0..t {
                    unsafe { std::ptr::copy_nonoverlapping(oh.as_ptr().add(i * dv), shared.0.add(i * vd + head * dv), dv) };
                }
            }
        });
        gated_rms_norm_inplace(&mut core, &z, &m.norm, c.rms_norm_eps);
        matmul(pool, &core, t, &m.out_proj, out);
    }

    /// Gated full attention (spec §2.5): per-head query/gate split, zero-centred q/k norms,
    /// partial NeoX RoPE, KV-cache append, causal GQA softmax, sigmoid output gate.
    #[allow(clippy::too_many_arguments)]
    fn gated_attention(&self, pool: &Pool, m: &GatedAttention, xn: &[f32], t: usize, pos0: usize, k_cache: &mut Vec<f32>, v_cache: &mut Vec<f32>, out: &mut [f32]) {
        let c = &self.config;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let mut qg = vec![0f32; t * hq * 2 * d];
        let mut k = vec![0f32; t * hkv * d];
        let mut v = vec![0f32; t * hkv * d];
        matmul_group(pool, xn, t, &mut [(&m.q_proj, &mut qg), (&m.k_proj, &mut k), (&m.v_proj, &mut v)]);

        let half = c.rotary_dim() / 2;
        let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
        let mut q = vec![0f32; t * hq * d];
        let mut gate = vec![0f32; t * hq * d];
        for i in 0..t {
            cos_sin(pos0 + i, &self.inv_freq, &mut cos, &mut sin);
            for head in 0..hq {
                let src = &qg[(i * hq + head) * 2 * d..(i * hq + head + 1) * 2 * d];
                let qh = &mut q[(i * hq + head) * d..(i * hq + head + 1) * d];
                rms_norm(&src[..d], &m.q_norm, c.rms_norm_eps, qh);
                apply_rope(qh, &cos, &sin);
                gate[(i * hq + head) * d..(i * hq + head + 1) * d].copy_from_slice(&src[d..]);
            }
            for head in k[i * hkv * d..(i + 1) * hkv * d].chunks_exact_mut(d) {
                rms_norm_inplace(head, &m.k_norm, c.rms_norm_eps);
                apply_rope(head, &cos, &sin);
            }
        }
        k_cache.extend_from_slice(&k);
        v_cache.extend_from_slice(&v);

        // Query heads split over the pool; each writes its own columns of `attn`.
        let mut attn = vec![0f32; t * hq * d];
        let shared = SharedMut(attn.as_mut_ptr(), std::ptr::null_mut());
        let (kc, vc) = (&k_cache[..], &v_cache[..]);
        pool.for_ranges(hq, 1, &|heads| {
            let shared = shared;
            // SAFETY: every head writes only its own d columns of each token's row.
            let out = unsafe { std::slice::from_raw_parts_mut(shared.0, t * hq * d) };
            let mut scores = Vec::new();
            for h in heads {
                attention_head(&q, t, pos0, kc, vc, hq, hkv, d, h, &mut scores, out);
            }
        });
        for (o, &g) in attn.iter_mut().zip(&gate) {
            *o *= sigmoid(g);
        }
        matmul(pool, &attn, t, &m.o_proj, out);
    }

    /// SwiGLU: `down(silu(gate(x)) * up(x))`.
    fn mlp(&self, pool: &Pool, m: &Mlp, xn: &[f32], t: usize, out: &mut [f32]) {
        let f = self.config.intermediate_size;
        let mut gate = vec![0f32; t * f];
        let mut up = vec![0f32; t * f];
        matmul_group(pool, xn, t, &mut [(&m.gate_proj, &mut gate), (&m.up_proj, &mut up)]);
        let g = SharedMut(gate.as_mut_ptr(), std::ptr::null_mut());
        pool.for_ranges(gate.len(), 16, &|r| {
            let g = g;
            // SAFETY: the ranges are disjoint parts of `gate`.
            let gate = unsafe { std::slice::from_raw_parts_mut(g.0.add(r.start), r.len()) };
            swiglu_inplace(gate, &up[r]);
        });
        matmul(pool, &gate, t, &m.down_proj, out);
    }
}

/// Pointers into buffers whose disjoint parts are written by different pool workers.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32, *mut f32);
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

crate::kernels::multiversion! {
    /// `out[i] = silu(Σ_j taps[j] ⊙ window[i + j])` for each of the `out.len() / cd` tokens:
    /// the depthwise causal conv, `window` being the K-1 (+1 stale) previous raw rows
    /// followed by this call's rows, all `[rows, cd]`.
    fn causal_conv_silu(window: &[f32], taps: &[f32], kk: usize, cd: usize, out: &mut [f32]) => causal_conv_silu_body
}

#[inline(always)]
fn causal_conv_silu_body(window: &[f32], taps: &[f32], kk: usize, cd: usize, out: &mut [f32]) {
    for (i, o) in out.chunks_exact_mut(cd).enumerate() {
        // Token i's window is rows i+1 ..= i+K of `window` (row 0 is the oldest stored column).
        o.iter_mut().for_each(|v| *v = 0.0);
        for j in 0..kk {
            let src = &window[(i + 1 + j) * cd..(i + 2 + j) * cd];
            let w = &taps[j * cd..(j + 1) * cd];
            for ((ov, &x), &wv) in o.iter_mut().zip(src).zip(w) {
                *ov = wv.mul_add(x, *ov);
            }
        }
        o.iter_mut().for_each(|v| *v = silu(*v));
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

fn data_ptr(m: &Matrix) -> *const u8 {
    match &m.data {
        crate::tensor::WeightData::Bf16(b) | crate::tensor::WeightData::F16(b) => b.as_slice().as_ptr() as *const u8,
        crate::tensor::WeightData::F32(b) => b.as_slice().as_ptr() as *const u8,
        crate::tensor::WeightData::Int8 { q, .. } => q.as_slice().as_ptr() as *const u8,
    }
}

fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Take a matrix out of the set; with `int8`, quantize it and release the stored bytes.
fn matrix(ts: &mut TensorSet, int8: Option<&Pool>, name: &str, shape: &[usize]) -> Result<Matrix> {
    let t = ts.take(name, shape)?;
    let m = Matrix::from_tensor(&t).with_context(|| format!("{}: tensor {}", ts.source, t.name))?;
    let Some(pool) = int8 else { return Ok(m) };
    let q = quantize_int8_on(pool, &m);
    t.storage.release(t.offset, t.numel() * t.dtype.size());
    Ok(q)
}

fn small(ts: &mut TensorSet, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let t = ts.take(name, shape)?;
    t.to_f32_vec().with_context(|| format!("{}: tensor {}", ts.source, t.name))
}

/// `1 + w` of a zero-centred RMSNorm weight, computed in f32 like the reference.
fn zero_centred(t: Tensor) -> Result<Vec<f32>> {
    Ok(t.to_f32_vec()?.into_iter().map(|w| 1.0 + w).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `forward` applies long inputs in pieces; the pieces start on DeltaNet chunk boundaries,
    /// so the result is bit for bit that of one pass.
    #[test]
    fn pieces_of_a_long_input_equal_one_pass_exactly() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        let m = crate::load::LoadedModel::load(dir.to_str().unwrap()).unwrap();
        let pool = Pool::new(2);
        let tokens: Vec<u32> = (0..300).map(|i| (i * 37 + 11) % 1024).collect();
        assert!(tokens.len() > 2 * MAX_TOKENS_PER_PASS);
        let _same_kernels = crate::kernels::hold_isa();
        let (mut one, mut pieces) = (State::new(&m.net.config), State::new(&m.net.config));
        let want = m.net.forward_pass(&pool, &tokens, &mut one, Logits::All).unwrap();
        let got = m.net.forward(&pool, &tokens, &mut pieces, Logits::All).unwrap();
        assert!(want == got, "logits differ");
        assert!(one == pieces, "states differ");
    }

    /// A call that fails leaves the state untouched (no part of the input is applied).
    #[test]
    fn a_rejected_input_leaves_the_state_as_it_was() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        let m = crate::load::LoadedModel::load(dir.to_str().unwrap()).unwrap();
        let pool = Pool::new(1);
        let mut st = State::new(&m.net.config);
        m.net.forward(&pool, &[1, 2, 3], &mut st, Logits::Last).unwrap();
        let before = st.clone();
        // A bad id in the third piece of a long input.
        let mut tokens: Vec<u32> = vec![5; 3 * MAX_TOKENS_PER_PASS];
        tokens[2 * MAX_TOKENS_PER_PASS + 1] = 1_000_000;
        let e = m.net.forward(&pool, &tokens, &mut st, Logits::Last).unwrap_err().to_string();
        assert!(e.contains("1000000"), "{e}");
        assert!(st == before, "the state changed");
        // A state of another shape.
        let mut wrong = before.clone();
        wrong.layers.pop();
        assert!(m.net.forward(&pool, &[1], &mut wrong, Logits::Last).is_err());
    }
}
