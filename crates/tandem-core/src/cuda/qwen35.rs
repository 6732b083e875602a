//! Qwen3.5 on one GPU: the forward pass of model/qwen35.rs, layer by layer, with the weights
//! (bf16, as stored) and the request state in GPU memory. Activations are f32. Products of up
//! to 8 tokens (decode) run the bf16 GEMV kernel in f32; longer ones (prefill) run either the
//! f32 GEMM kernel (`Precision::Exact`, what `verify` checks) or cuBLAS on tensor cores with the
//! activations rounded to bf16 (`Precision::TensorCores`, the fast prefill).
//!
//! Missing against the CPU engine (see the README): the chunked DeltaNet for prefill (the
//! recurrent step runs token after token, which is exact but slower on long prompts), batched
//! decode of several sequences, and CUDA graphs.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;

use super::{Arg, Gpu};
use crate::config::Qwen35Config;
use crate::model::qwen35::Mixer;
use crate::model::{Logits, Qwen35};
use crate::state::{LayerState, State};
use crate::tensor::{Matrix, WeightData};

/// How prefill products (more than 8 tokens) are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// f32 activations times bf16 weights, f32 sums: the CPU engine's arithmetic.
    Exact,
    /// cuBLAS bf16 x bf16 on tensor cores, f32 sums: the activations are rounded to bf16.
    TensorCores,
}

/// The most positions one attention row can see: its scores live in 48 KB of shared memory.
pub const MAX_CONTEXT: usize = 12 * 1024;
/// Products of at most this many tokens take the GEMV kernel.
const GEMV_MAX_T: usize = 8;

struct GpuMatrix {
    w: CudaSlice<u16>,
    rows: usize,
    cols: usize,
}

struct DeltaNet {
    in_proj_qkv: GpuMatrix,
    in_proj_z: GpuMatrix,
    in_proj_b: GpuMatrix,
    in_proj_a: GpuMatrix,
    conv_taps: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    neg_a: CudaSlice<f32>,
    norm: CudaSlice<f32>,
    out_proj: GpuMatrix,
}

struct Attention {
    q_proj: GpuMatrix,
    k_proj: GpuMatrix,
    v_proj: GpuMatrix,
    o_proj: GpuMatrix,
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
}

enum GpuMixer {
    DeltaNet(DeltaNet),
    Attention(Attention),
}

struct Layer {
    input_norm: CudaSlice<f32>,
    post_attention_norm: CudaSlice<f32>,
    mixer: GpuMixer,
    gate_proj: GpuMatrix,
    up_proj: GpuMatrix,
    down_proj: GpuMatrix,
}

pub struct GpuQwen35 {
    pub gpu: Gpu,
    pub config: Qwen35Config,
    embed: CudaSlice<u16>,
    /// None when the LM head is the embedding table (tied).
    lm_head: Option<GpuMatrix>,
    final_norm: CudaSlice<f32>,
    layers: Vec<Layer>,
    inv_freq: CudaSlice<f32>,
    pub precision: Precision,
    weight_bytes: usize,
}

/// A request's state in GPU memory: the same arrays as `State`, K/V with room to grow.
pub struct GpuState {
    pub position: usize,
    layers: Vec<GpuLayerState>,
    /// Logits of the last applied token, on the host (sampling runs there).
    pub last_logits: Vec<f32>,
}

enum GpuLayerState {
    Linear { conv: CudaSlice<f32>, recurrent: CudaSlice<f32> },
    /// `[capacity, Hkv, D]` each; the first `position` rows are in use.
    Full { k: CudaSlice<f32>, v: CudaSlice<f32>, capacity: usize },
}

impl GpuQwen35 {
    /// Copy `net`'s weights to `gpu`. The GPU runs bf16 weights; another dtype (an int8
    /// quantization, an f16 or f32 checkpoint) is refused by name.
    pub fn upload(gpu: Gpu, net: &Qwen35, precision: Precision) -> Result<GpuQwen35> {
        let c = net.config.clone();
        if c.linear_key_head_dim != 32 && c.linear_key_head_dim != 64 && c.linear_key_head_dim != 128 {
            bail!("the CUDA DeltaNet kernel is built for key heads of 32, 64 or 128 channels, this model has {}", c.linear_key_head_dim);
        }
        if c.linear_value_head_dim > 1024 || c.head_dim > 1024 || c.linear_conv_kernel_dim > 8 {
            bail!("the CUDA kernels take head dims up to 1024 and conv kernels up to 8 (this model: {} / {} / {})", c.linear_value_head_dim, c.head_dim, c.linear_conv_kernel_dim);
        }
        let mut weight_bytes = 0;
        let mut mat = |m: &Matrix, name: &str| -> Result<GpuMatrix> {
            let WeightData::Bf16(b) = &m.data else {
                bail!("{name}: the CUDA engine runs bf16 weights; this matrix is {:?} (drop --quant for a GPU engine)", m.dtype());
            };
            if m.cols % 8 != 0 {
                bail!("{name}: {} columns; the CUDA GEMV needs a multiple of 8", m.cols);
            }
            weight_bytes += m.bytes();
            Ok(GpuMatrix { w: gpu.upload(b.as_slice())?, rows: m.rows, cols: m.cols })
        };
        let tied = std::ptr::eq(net.lm_head_data_ptr(), net.embed_data_ptr());
        let lm_head = if tied { None } else { Some(mat(&net.lm_head, "lm_head")?) };
        let WeightData::Bf16(e) = &net.embed_tokens.data else { bail!("embed_tokens: the CUDA engine runs bf16 weights") };
        let embed = gpu.upload(e.as_slice())?;
        let mut layers = Vec::with_capacity(net.layers.len());
        for (i, l) in net.layers.iter().enumerate() {
            let p = format!("layers.{i}");
            let mixer = match &l.mixer {
                Mixer::DeltaNet(d) => GpuMixer::DeltaNet(DeltaNet {
                    in_proj_qkv: mat(&d.in_proj_qkv, &format!("{p}.in_proj_qkv"))?,
                    in_proj_z: mat(&d.in_proj_z, &format!("{p}.in_proj_z"))?,
                    in_proj_b: mat(&d.in_proj_b, &format!("{p}.in_proj_b"))?,
                    in_proj_a: mat(&d.in_proj_a, &format!("{p}.in_proj_a"))?,
                    conv_taps: gpu.upload(&d.conv_taps)?,
                    dt_bias: gpu.upload(&d.dt_bias)?,
                    neg_a: gpu.upload(&d.neg_a)?,
                    norm: gpu.upload(&d.norm)?,
                    out_proj: mat(&d.out_proj, &format!("{p}.out_proj"))?,
                }),
                Mixer::Attention(a) => GpuMixer::Attention(Attention {
                    q_proj: mat(&a.q_proj, &format!("{p}.q_proj"))?,
                    k_proj: mat(&a.k_proj, &format!("{p}.k_proj"))?,
                    v_proj: mat(&a.v_proj, &format!("{p}.v_proj"))?,
                    o_proj: mat(&a.o_proj, &format!("{p}.o_proj"))?,
                    q_norm: gpu.upload(&a.q_norm)?,
                    k_norm: gpu.upload(&a.k_norm)?,
                }),
            };
            layers.push(Layer {
                input_norm: gpu.upload(&l.input_norm)?,
                post_attention_norm: gpu.upload(&l.post_attention_norm)?,
                mixer,
                gate_proj: mat(&l.mlp.gate_proj, &format!("{p}.gate_proj"))?,
                up_proj: mat(&l.mlp.up_proj, &format!("{p}.up_proj"))?,
                down_proj: mat(&l.mlp.down_proj, &format!("{p}.down_proj"))?,
            });
        }
        if tied {
            weight_bytes += net.embed_tokens.bytes();
        }
        let final_norm = gpu.upload(&net.final_norm)?;
        let inv_freq = gpu.upload(&net.inv_freq)?;
        gpu.synchronize()?;
        Ok(GpuQwen35 { gpu, config: c, embed, lm_head, final_norm, layers, inv_freq, precision, weight_bytes })
    }

    /// Give the GPU back (to load another model on it).
    pub fn into_gpu(self) -> Gpu {
        self.gpu
    }

    /// Use the RoPE frequencies of `net` (after `Qwen35::set_rope_frequencies_bf16`).
    pub fn set_rope_frequencies(&mut self, net: &Qwen35) -> Result<()> {
        self.inv_freq = self.gpu.upload(&net.inv_freq)?;
        Ok(())
    }

    /// Bytes of weights one decode step reads (every matrix and the LM head).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// The empty state of a fresh request.
    pub fn new_state(&self) -> Result<GpuState> {
        let c = &self.config;
        let layers = c
            .layer_types
            .iter()
            .map(|t| {
                Ok(match t {
                    crate::config::LayerType::LinearAttention => GpuLayerState::Linear {
                        conv: self.gpu.zeros(c.linear_conv_kernel_dim * c.linear_conv_dim())?,
                        recurrent: self.gpu.zeros(c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim)?,
                    },
                    crate::config::LayerType::FullAttention => {
                        let capacity = 256;
                        let n = capacity * c.num_key_value_heads * c.head_dim;
                        GpuLayerState::Full { k: self.gpu.zeros(n)?, v: self.gpu.zeros(n)?, capacity }
                    }
                })
            })
            .collect::<Result<_>>()?;
        Ok(GpuState { position: 0, layers, last_logits: Vec::new() })
    }

    /// Host state to GPU state (the bridge's host-to-device copy).
    pub fn upload_state(&self, s: &State) -> Result<GpuState> {
        s.check_shape(&self.config)?;
        let c = &self.config;
        let row = c.num_key_value_heads * c.head_dim;
        let layers = s
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerState::Linear { conv, recurrent } => GpuLayerState::Linear { conv: self.gpu.upload(conv)?, recurrent: self.gpu.upload(recurrent)? },
                    LayerState::Full { k, v } => {
                        let capacity = (s.position + 256).next_power_of_two();
                        let (mut kd, mut vd) = (self.gpu.zeros::<f32>(capacity * row)?, self.gpu.zeros::<f32>(capacity * row)?);
                        if !k.is_empty() {
                            self.gpu.stream.memcpy_htod(&k[..], &mut kd.slice_mut(..k.len())).map_err(|e| anyhow::anyhow!("copying keys to the GPU: {e:?}"))?;
                            self.gpu.stream.memcpy_htod(&v[..], &mut vd.slice_mut(..v.len())).map_err(|e| anyhow::anyhow!("copying values to the GPU: {e:?}"))?;
                        }
                        GpuLayerState::Full { k: kd, v: vd, capacity }
                    }
                })
            })
            .collect::<Result<_>>()?;
        Ok(GpuState { position: s.position, layers, last_logits: s.last_logits.clone() })
    }

    /// GPU state to host state (the bridge's device-to-host copy).
    pub fn download_state(&self, s: &GpuState) -> Result<State> {
        let c = &self.config;
        let kv = s.position * c.num_key_value_heads * c.head_dim;
        let layers = s
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    GpuLayerState::Linear { conv, recurrent } => LayerState::Linear { conv: self.gpu.download(conv, conv.len())?.into(), recurrent: self.gpu.download(recurrent, recurrent.len())?.into() },
                    GpuLayerState::Full { k, v, .. } => LayerState::Full { k: self.gpu.download(k, kv)?, v: self.gpu.download(v, kv)? },
                })
            })
            .collect::<Result<_>>()?;
        Ok(State { position: s.position, layers, last_logits: s.last_logits.clone() })
    }

    /// Apply `tokens` to a host `State`: upload, forward, download. What `verify` runs (it
    /// compares states), and the shape of a handoff between a CPU and a GPU engine.
    pub fn forward_host(&self, tokens: &[u32], state: &mut State, which: Logits) -> Result<Vec<f32>> {
        let mut g = self.upload_state(state)?;
        let logits = self.forward(tokens, &mut g, which)?;
        *state = self.download_state(&g)?;
        Ok(logits)
    }

    /// Apply `tokens` to `state`; the logits of the last token, or of every token.
    pub fn forward(&self, tokens: &[u32], state: &mut GpuState, which: Logits) -> Result<Vec<f32>> {
        let c = &self.config;
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            bail!("token id {bad} is outside the model's vocabulary (ids 0..{})", c.vocab_size);
        }
        let end = state.position + tokens.len();
        if end > c.max_position_embeddings.min(MAX_CONTEXT) {
            bail!("{} tokens after position {} exceed the CUDA engine's context of {} tokens", tokens.len(), state.position, c.max_position_embeddings.min(MAX_CONTEXT));
        }
        self.grow_kv(state, end)?;
        let (t, h) = (tokens.len(), c.hidden_size);
        let g = &self.gpu;
        let ids = g.upload(tokens)?;
        let mut x = g.scratch::<f32>(t * h)?;
        g.launch("embed", (t as u32, 1, 1), 256, 0, &[Arg::Ptr(g.ptr(&self.embed)), Arg::Ptr(g.ptr(&ids)), Arg::Ptr(g.ptr(&x)), Arg::I32(h as i32)])?;
        let mut xn = g.scratch::<f32>(t * h)?;
        let mixed = g.scratch::<f32>(t * h)?;
        for (li, layer) in self.layers.iter().enumerate() {
            self.rms_norm(&x, &layer.input_norm, &mut xn, t, h)?;
            match &layer.mixer {
                GpuMixer::DeltaNet(m) => self.deltanet(m, &xn, t, state, li, &mixed)?,
                GpuMixer::Attention(m) => self.attention(m, &xn, t, state, li, &mixed)?,
            }
            self.add(&mut x, &mixed, t * h)?;
            self.rms_norm(&x, &layer.post_attention_norm, &mut xn, t, h)?;
            self.mlp(layer, &xn, t, &mixed)?;
            self.add(&mut x, &mixed, t * h)?;
        }
        state.position = end;
        // Final norm and LM head over the rows that need logits.
        let rows = if which == Logits::All { t } else { 1 };
        let first = t - rows;
        let mut last = g.scratch::<f32>(rows * h)?;
        g.stream.memcpy_dtod(&x.slice(first * h..t * h), &mut last.slice_mut(..)).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let mut last_n = g.scratch::<f32>(rows * h)?;
        self.rms_norm(&last, &self.final_norm, &mut last_n, rows, h)?;
        let v = c.vocab_size;
        let logits = g.scratch::<f32>(rows * v)?;
        match &self.lm_head {
            Some(m) => self.matmul(&last_n, rows, m, &logits)?,
            None => self.matmul_raw(g.ptr(&last_n), rows, g.ptr(&self.embed), v, h, g.ptr(&logits))?,
        }
        let out = g.download(&logits, rows * v)?;
        state.last_logits.clear();
        state.last_logits.extend_from_slice(&out[(rows - 1) * v..]);
        Ok(out)
    }

    fn grow_kv(&self, state: &mut GpuState, end: usize) -> Result<()> {
        let row = self.config.num_key_value_heads * self.config.head_dim;
        let used = state.position * row;
        for l in &mut state.layers {
            if let GpuLayerState::Full { k, v, capacity } = l {
                if end > *capacity {
                    let cap = end.next_power_of_two();
                    for buf in [k, v] {
                        let mut bigger = self.gpu.zeros::<f32>(cap * row)?;
                        if used > 0 {
                            self.gpu.stream.memcpy_dtod(&buf.slice(..used), &mut bigger.slice_mut(..used)).map_err(|e| anyhow::anyhow!("{e:?}"))?;
                        }
                        *buf = bigger;
                    }
                    *capacity = cap;
                }
            }
        }
        Ok(())
    }

    fn rms_norm(&self, x: &CudaSlice<f32>, w: &CudaSlice<f32>, out: &mut CudaSlice<f32>, rows: usize, d: usize) -> Result<()> {
        let g = &self.gpu;
        g.launch("rms_norm", (rows as u32, 1, 1), 256, 0, &[Arg::Ptr(g.ptr(x)), Arg::Ptr(g.ptr(w)), Arg::Ptr(g.ptr(out)), Arg::I32(d as i32), Arg::F32(self.config.rms_norm_eps)])
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<()> {
        let g = &self.gpu;
        g.launch("add_inplace", (n.div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::Ptr(g.ptr(x)), Arg::Ptr(g.ptr(y)), Arg::I32(n as i32)])
    }

    /// `out[t, rows] = x[t, cols] · Wᵀ`.
    fn matmul(&self, x: &CudaSlice<f32>, t: usize, m: &GpuMatrix, out: &CudaSlice<f32>) -> Result<()> {
        let g = &self.gpu;
        self.matmul_raw(g.ptr(x), t, g.ptr(&m.w), m.rows, m.cols, g.ptr(out))
    }

    fn matmul_raw(&self, x: u64, t: usize, w: u64, n: usize, k: usize, out: u64) -> Result<()> {
        let g = &self.gpu;
        if t <= GEMV_MAX_T {
            // 8 warps per block, one row each.
            return g.launch("gemv_bf16", (n.div_ceil(8) as u32, 1, 1), 256, 0, &[Arg::Ptr(w), Arg::Ptr(x), Arg::Ptr(out), Arg::I32(n as i32), Arg::I32(k as i32), Arg::I32(t as i32)]);
        }
        match self.precision {
            Precision::Exact => g.launch("gemm_bf16_f32", (n.div_ceil(64) as u32, t.div_ceil(64) as u32, 1), 256, 0, &[Arg::Ptr(w), Arg::Ptr(x), Arg::Ptr(out), Arg::I32(n as i32), Arg::I32(k as i32), Arg::I32(t as i32)]),
            Precision::TensorCores => {
                let xb = g.scratch::<u16>(t * k)?;
                g.launch("to_bf16", ((t * k).div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::Ptr(x), Arg::Ptr(g.ptr(&xb)), Arg::I32((t * k) as i32)])?;
                g.gemm_bf16(g.ptr(&xb), t, w, n, k, out)
            }
        }
    }

    fn deltanet(&self, m: &DeltaNet, xn: &CudaSlice<f32>, t: usize, state: &mut GpuState, li: usize, out: &CudaSlice<f32>) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (hk, hv, dk, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (vd, cd, kk) = (c.linear_value_dim(), c.linear_conv_dim(), c.linear_conv_kernel_dim);
        let (qkv, z, b, a) = (g.scratch::<f32>(t * cd)?, g.scratch::<f32>(t * vd)?, g.scratch::<f32>(t * hv)?, g.scratch::<f32>(t * hv)?);
        self.matmul(xn, t, &m.in_proj_qkv, &qkv)?;
        self.matmul(xn, t, &m.in_proj_z, &z)?;
        self.matmul(xn, t, &m.in_proj_b, &b)?;
        self.matmul(xn, t, &m.in_proj_a, &a)?;
        let GpuLayerState::Linear { conv, recurrent } = &mut state.layers[li] else { bail!("layer {li}: state kind differs from the model's") };
        let mixed = g.scratch::<f32>(t * cd)?;
        g.launch("conv_silu", (cd.div_ceil(128) as u32, 1, 1), 128, 0, &[Arg::Ptr(g.ptr(conv)), Arg::Ptr(g.ptr(&qkv)), Arg::Ptr(g.ptr(&m.conv_taps)), Arg::Ptr(g.ptr(&mixed)), Arg::I32(t as i32), Arg::I32(cd as i32), Arg::I32(kk as i32)])?;
        let block = dk.next_multiple_of(32) as u32;
        g.launch("l2norm_qk", (t as u32, 2 * hk as u32, 1), block, 0, &[Arg::Ptr(g.ptr(&mixed)), Arg::I32(cd as i32), Arg::I32(hk as i32), Arg::I32(dk as i32), Arg::F32(1.0 / (dk as f32).sqrt())])?;
        let core = g.scratch::<f32>(t * vd)?;
        let kernel = match dk {
            32 => "deltanet_32",
            64 => "deltanet_64",
            _ => "deltanet_128",
        };
        g.launch(
            kernel,
            (hv as u32, 1, 1),
            dv as u32,
            0,
            &[
                Arg::Ptr(g.ptr(recurrent)),
                Arg::Ptr(g.ptr(&mixed)),
                Arg::Ptr(g.ptr(&b)),
                Arg::Ptr(g.ptr(&a)),
                Arg::Ptr(g.ptr(&m.neg_a)),
                Arg::Ptr(g.ptr(&m.dt_bias)),
                Arg::Ptr(g.ptr(&core)),
                Arg::I32(t as i32),
                Arg::I32(hk as i32),
                Arg::I32(hv as i32),
                Arg::I32(dv as i32),
                Arg::I32(cd as i32),
            ],
        )?;
        g.launch("gated_rms_norm", ((t * hv) as u32, 1, 1), dv.next_multiple_of(32).min(256) as u32, 0, &[Arg::Ptr(g.ptr(&core)), Arg::Ptr(g.ptr(&z)), Arg::Ptr(g.ptr(&m.norm)), Arg::I32(dv as i32), Arg::F32(c.rms_norm_eps)])?;
        self.matmul(&core, t, &m.out_proj, out)
    }

    fn attention(&self, m: &Attention, xn: &CudaSlice<f32>, t: usize, state: &mut GpuState, li: usize, out: &CudaSlice<f32>) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (qg, k, v) = (g.scratch::<f32>(t * hq * 2 * d)?, g.scratch::<f32>(t * hkv * d)?, g.scratch::<f32>(t * hkv * d)?);
        self.matmul(xn, t, &m.q_proj, &qg)?;
        self.matmul(xn, t, &m.k_proj, &k)?;
        self.matmul(xn, t, &m.v_proj, &v)?;
        let (q, gate) = (g.scratch::<f32>(t * hq * d)?, g.scratch::<f32>(t * hq * d)?);
        let pos0 = state.position;
        g.launch(
            "qk_norm_rope",
            (t as u32, (hq + hkv) as u32, 1),
            d.next_multiple_of(32) as u32,
            0,
            &[
                Arg::Ptr(g.ptr(&qg)),
                Arg::Ptr(g.ptr(&q)),
                Arg::Ptr(g.ptr(&gate)),
                Arg::Ptr(g.ptr(&k)),
                Arg::Ptr(g.ptr(&m.q_norm)),
                Arg::Ptr(g.ptr(&m.k_norm)),
                Arg::Ptr(g.ptr(&self.inv_freq)),
                Arg::I32(hq as i32),
                Arg::I32(hkv as i32),
                Arg::I32(d as i32),
                Arg::I32((c.rotary_dim() / 2) as i32),
                Arg::I32(pos0 as i32),
                Arg::F32(c.rms_norm_eps),
            ],
        )?;
        let GpuLayerState::Full { k: kc, v: vc, .. } = &mut state.layers[li] else { bail!("layer {li}: state kind differs from the model's") };
        let row = hkv * d;
        g.stream.memcpy_dtod(&k, &mut kc.slice_mut(pos0 * row..(pos0 + t) * row)).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        g.stream.memcpy_dtod(&v, &mut vc.slice_mut(pos0 * row..(pos0 + t) * row)).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let attn = g.scratch::<f32>(t * hq * d)?;
        let shared = ((pos0 + t) * 4) as u32;
        g.launch(
            "attention",
            (t as u32, hq as u32, 1),
            128,
            shared,
            &[Arg::Ptr(g.ptr(&q)), Arg::Ptr(g.ptr(kc)), Arg::Ptr(g.ptr(vc)), Arg::Ptr(g.ptr(&gate)), Arg::Ptr(g.ptr(&attn)), Arg::I32(hq as i32), Arg::I32(hkv as i32), Arg::I32(d as i32), Arg::I32(pos0 as i32)],
        )?;
        self.matmul(&attn, t, &m.o_proj, out)
    }

    fn mlp(&self, l: &Layer, xn: &CudaSlice<f32>, t: usize, out: &CudaSlice<f32>) -> Result<()> {
        let g = &self.gpu;
        let f = self.config.intermediate_size;
        let (gate, up) = (g.scratch::<f32>(t * f)?, g.scratch::<f32>(t * f)?);
        self.matmul(xn, t, &l.gate_proj, &gate)?;
        self.matmul(xn, t, &l.up_proj, &up)?;
        g.launch("swiglu", ((t * f).div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::Ptr(g.ptr(&gate)), Arg::Ptr(g.ptr(&up)), Arg::I32((t * f) as i32)])?;
        self.matmul(&gate, t, &l.down_proj, out)
    }
}
