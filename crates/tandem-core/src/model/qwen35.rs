//! Qwen3.5 text decoder, exactly as qwen35-spec.md §2-3 (HF transformers 5.23.0
//! `Qwen3_5ForCausalLM`): 3 Gated DeltaNet layers then 1 gated full-attention layer, repeated,
//! each followed by a SwiGLU MLP. Activations are f32; weights are read in their stored dtype.

use anyhow::{bail, Context, Result};

use crate::checkpoint::TensorSet;
use crate::config::{LayerType, Qwen35Config};
use crate::kernels::attention::causal_attention;
use crate::kernels::deltanet::{self, ChunkScratch};
use crate::kernels::matmul::matmul;
use crate::kernels::norm::{gated_rms_norm_inplace, l2_normalize, rms_norm, rms_norm_inplace, sigmoid, silu, softplus};
use crate::kernels::rope::{apply_rope, cos_sin, inv_freq, inv_freq_bf16};
use crate::state::{LayerState, State};
use crate::tensor::{Matrix, Tensor};

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

struct DecoderLayer {
    input_norm: Vec<f32>,
    post_attention_norm: Vec<f32>,
    mixer: Mixer,
    mlp: Mlp,
}

enum Mixer {
    DeltaNet(GatedDeltaNet),
    Attention(GatedAttention),
}

struct GatedDeltaNet {
    in_proj_qkv: Matrix,
    in_proj_z: Matrix,
    in_proj_b: Matrix,
    in_proj_a: Matrix,
    /// Depthwise conv taps `[conv_dim, K]`, oldest tap first.
    conv_weight: Vec<f32>,
    dt_bias: Vec<f32>,
    /// `−exp(A_log)`, in f32.
    neg_a: Vec<f32>,
    /// Plain weight of the gated RMSNorm (not 1 + w).
    norm: Vec<f32>,
    out_proj: Matrix,
}

struct GatedAttention {
    /// Query and gate, interleaved per head: `[h0 query | h0 gate | h1 query | ...]`.
    q_proj: Matrix,
    k_proj: Matrix,
    v_proj: Matrix,
    o_proj: Matrix,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

struct Mlp {
    gate_proj: Matrix,
    up_proj: Matrix,
    down_proj: Matrix,
}

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
    pub fn load(config: Qwen35Config, ts: &TensorSet) -> Result<Self> {
        let c = &config;
        let (h, v) = (c.hidden_size, c.vocab_size);
        let embed_tokens = matrix(ts, "embed_tokens.weight", &[v, h])?;
        let lm_head = if ts.contains("lm_head.weight") && !c.tie_word_embeddings {
            matrix(ts, "lm_head.weight", &[v, h])?
        } else {
            embed_tokens.clone()
        };
        let final_norm = zero_centred(ts.get("norm.weight", &[h])?)?;
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
                        in_proj_qkv: matrix(ts, &format!("{la}in_proj_qkv.weight"), &[cd, h])?,
                        in_proj_z: matrix(ts, &format!("{la}in_proj_z.weight"), &[vd, h])?,
                        in_proj_b: matrix(ts, &format!("{la}in_proj_b.weight"), &[hv, h])?,
                        in_proj_a: matrix(ts, &format!("{la}in_proj_a.weight"), &[hv, h])?,
                        conv_weight: small(ts, &format!("{la}conv1d.weight"), &[cd, 1, kk])?,
                        dt_bias: small(ts, &format!("{la}dt_bias"), &[hv])?,
                        neg_a: a_log.iter().map(|a| -a.exp()).collect(),
                        norm: small(ts, &format!("{la}norm.weight"), &[c.linear_value_head_dim])?,
                        out_proj: matrix(ts, &format!("{la}out_proj.weight"), &[h, vd])?,
                    })
                }
                LayerType::FullAttention => {
                    let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                    let sa = format!("{p}self_attn.");
                    Mixer::Attention(GatedAttention {
                        q_proj: matrix(ts, &format!("{sa}q_proj.weight"), &[hq * d * 2, h])?,
                        k_proj: matrix(ts, &format!("{sa}k_proj.weight"), &[hkv * d, h])?,
                        v_proj: matrix(ts, &format!("{sa}v_proj.weight"), &[hkv * d, h])?,
                        o_proj: matrix(ts, &format!("{sa}o_proj.weight"), &[h, hq * d])?,
                        q_norm: zero_centred(ts.get(&format!("{sa}q_norm.weight"), &[d])?)?,
                        k_norm: zero_centred(ts.get(&format!("{sa}k_norm.weight"), &[d])?)?,
                    })
                }
            };
            let f = c.intermediate_size;
            layers.push(DecoderLayer {
                input_norm: zero_centred(ts.get(&format!("{p}input_layernorm.weight"), &[h])?)?,
                post_attention_norm: zero_centred(ts.get(&format!("{p}post_attention_layernorm.weight"), &[h])?)?,
                mixer,
                mlp: Mlp {
                    gate_proj: matrix(ts, &format!("{p}mlp.gate_proj.weight"), &[f, h])?,
                    up_proj: matrix(ts, &format!("{p}mlp.up_proj.weight"), &[f, h])?,
                    down_proj: matrix(ts, &format!("{p}mlp.down_proj.weight"), &[h, f])?,
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
    pub fn forward(&self, tokens: &[u32], state: &mut State, which: Logits) -> Result<Vec<f32>> {
        let c = &self.config;
        let (t, h) = (tokens.len(), c.hidden_size);
        if t == 0 {
            bail!("forward called with no tokens");
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            bail!("token id {bad} is outside the model's vocabulary (ids 0..{})", c.vocab_size);
        }
        if state.position + t > c.max_position_embeddings {
            bail!(
                "{} tokens after position {} exceed the model's context of {} tokens (max_position_embeddings)",
                t,
                state.position,
                c.max_position_embeddings
            );
        }
        if state.layers.len() != self.layers.len() {
            bail!("state has {} layers but the model has {}", state.layers.len(), self.layers.len());
        }

        let mut x = vec![0f32; t * h];
        for (i, &id) in tokens.iter().enumerate() {
            self.embed_tokens.row_to_f32(id as usize, &mut x[i * h..(i + 1) * h]);
        }
        let mut xn = vec![0f32; t * h];
        let mut mixed = vec![0f32; t * h];
        for (layer, layer_state) in self.layers.iter().zip(state.layers.iter_mut()) {
            rms_norm(&x, &layer.input_norm, c.rms_norm_eps, &mut xn);
            match (&layer.mixer, layer_state) {
                (Mixer::DeltaNet(m), LayerState::Linear { conv, recurrent }) => self.gated_deltanet(m, &xn, t, conv, recurrent, &mut mixed),
                (Mixer::Attention(m), LayerState::Full { k, v }) => self.gated_attention(m, &xn, t, state.position, k, v, &mut mixed),
                _ => bail!("state layer kinds do not match the model's layer_types"),
            }
            add_inplace(&mut x, &mixed);
            rms_norm(&x, &layer.post_attention_norm, c.rms_norm_eps, &mut xn);
            self.mlp(&layer.mlp, &xn, t, &mut mixed);
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
        matmul(rows, n, &self.lm_head, &mut logits);
        state.last_logits.clear();
        state.last_logits.extend_from_slice(&logits[(n - 1) * c.vocab_size..]);
        Ok(logits)
    }

    /// Gated DeltaNet (spec §2.4): projections, causal conv over the raw qkv columns, l2-normed
    /// q/k, the gated delta rule per value head, gated RMSNorm, output projection.
    fn gated_deltanet(&self, m: &GatedDeltaNet, xn: &[f32], t: usize, conv: &mut [f32], recurrent: &mut [f32], out: &mut [f32]) {
        let c = &self.config;
        let (hk, hv, dk, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (kd, vd, cd, kk) = (c.linear_key_dim(), c.linear_value_dim(), c.linear_conv_dim(), c.linear_conv_kernel_dim);

        let mut qkv = vec![0f32; t * cd];
        let mut z = vec![0f32; t * vd];
        let mut b = vec![0f32; t * hv];
        let mut a = vec![0f32; t * hv];
        matmul(xn, t, &m.in_proj_qkv, &mut qkv);
        matmul(xn, t, &m.in_proj_z, &mut z);
        matmul(xn, t, &m.in_proj_b, &mut b);
        matmul(xn, t, &m.in_proj_a, &mut a);

        // Causal depthwise conv + SiLU. `conv` holds the K raw columns before this call; the
        // window of token i is the K raw columns ending at i.
        let mut mixed_qkv = vec![0f32; t * cd];
        let raw = |j: isize, ch: usize| -> f32 {
            if j >= 0 {
                qkv[j as usize * cd + ch]
            } else {
                conv[(kk as isize + j) as usize * cd + ch]
            }
        };
        for i in 0..t {
            for ch in 0..cd {
                let taps = &m.conv_weight[ch * kk..(ch + 1) * kk];
                let mut acc = 0f32;
                for (j, &w) in taps.iter().enumerate() {
                    acc += w * raw(i as isize - (kk as isize - 1) + j as isize, ch);
                }
                mixed_qkv[i * cd + ch] = silu(acc);
            }
        }
        // New window: the last K raw columns of (old window ++ this call's columns).
        let mut window = vec![0f32; kk * cd];
        for j in 0..kk {
            let src = t as isize - kk as isize + j as isize;
            for ch in 0..cd {
                window[j * cd + ch] = raw(src, ch);
            }
        }
        conv.copy_from_slice(&window);

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

        // Per value head h (key head h / (Hv/Hk)): gather, run the delta rule, scatter.
        let group = hv / hk;
        let mut core = vec![0f32; t * vd];
        let (mut qh, mut kh, mut vh) = (vec![0f32; t * dk], vec![0f32; t * dk], vec![0f32; t * dv]);
        let (mut beta, mut g, mut oh) = (vec![0f32; t], vec![0f32; t], vec![0f32; t * dv]);
        let mut scratch = ChunkScratch::default();
        for head in 0..hv {
            let kh_idx = head / group;
            for i in 0..t {
                let row = &mixed_qkv[i * cd..(i + 1) * cd];
                qh[i * dk..(i + 1) * dk].copy_from_slice(&row[kh_idx * dk..(kh_idx + 1) * dk]);
                kh[i * dk..(i + 1) * dk].copy_from_slice(&row[kd + kh_idx * dk..kd + (kh_idx + 1) * dk]);
                vh[i * dv..(i + 1) * dv].copy_from_slice(&row[2 * kd + head * dv..2 * kd + (head + 1) * dv]);
                beta[i] = sigmoid(b[i * hv + head]);
                g[i] = m.neg_a[head] * softplus(a[i * hv + head] + m.dt_bias[head]);
            }
            let s = &mut recurrent[head * dk * dv..(head + 1) * dk * dv];
            if t == 1 {
                deltanet::recurrent_step(s, &qh, &kh, &vh, beta[0], g[0], &mut oh);
            } else {
                deltanet::chunked(s, &qh, &kh, &vh, &beta, &g, &mut oh, &mut scratch);
            }
            for i in 0..t {
                core[i * vd + head * dv..i * vd + (head + 1) * dv].copy_from_slice(&oh[i * dv..(i + 1) * dv]);
            }
        }
        gated_rms_norm_inplace(&mut core, &z, &m.norm, c.rms_norm_eps);
        matmul(&core, t, &m.out_proj, out);
    }

    /// Gated full attention (spec §2.5): per-head query/gate split, zero-centred q/k norms,
    /// partial NeoX RoPE, KV-cache append, causal GQA softmax, sigmoid output gate.
    #[allow(clippy::too_many_arguments)]
    fn gated_attention(&self, m: &GatedAttention, xn: &[f32], t: usize, pos0: usize, k_cache: &mut Vec<f32>, v_cache: &mut Vec<f32>, out: &mut [f32]) {
        let c = &self.config;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let mut qg = vec![0f32; t * hq * 2 * d];
        let mut k = vec![0f32; t * hkv * d];
        let mut v = vec![0f32; t * hkv * d];
        matmul(xn, t, &m.q_proj, &mut qg);
        matmul(xn, t, &m.k_proj, &mut k);
        matmul(xn, t, &m.v_proj, &mut v);

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

        let mut attn = vec![0f32; t * hq * d];
        causal_attention(&q, t, pos0, k_cache, v_cache, hq, hkv, d, &mut attn);
        for (o, &g) in attn.iter_mut().zip(&gate) {
            *o *= sigmoid(g);
        }
        matmul(&attn, t, &m.o_proj, out);
    }

    /// SwiGLU: `down(silu(gate(x)) * up(x))`.
    fn mlp(&self, m: &Mlp, xn: &[f32], t: usize, out: &mut [f32]) {
        let f = self.config.intermediate_size;
        let mut gate = vec![0f32; t * f];
        let mut up = vec![0f32; t * f];
        matmul(xn, t, &m.gate_proj, &mut gate);
        matmul(xn, t, &m.up_proj, &mut up);
        for (g, &u) in gate.iter_mut().zip(&up) {
            *g = silu(*g) * u;
        }
        matmul(&gate, t, &m.down_proj, out);
    }
}

fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn matrix(ts: &TensorSet, name: &str, shape: &[usize]) -> Result<Matrix> {
    let t = ts.get(name, shape)?;
    Matrix::from_tensor(t).with_context(|| format!("{}: tensor {}", ts.source, t.name))
}

fn small(ts: &TensorSet, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let t = ts.get(name, shape)?;
    t.to_f32_vec().with_context(|| format!("{}: tensor {}", ts.source, t.name))
}

/// `1 + w` of a zero-centred RMSNorm weight, computed in f32 like the reference.
fn zero_centred(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_f32_vec()?.into_iter().map(|w| 1.0 + w).collect())
}
