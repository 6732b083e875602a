//! Qwen3.5 on one GPU: the forward pass of model/qwen35.rs, layer by layer, with the weights
//! (bf16, as stored) and the request state in GPU memory. Activations are f32.
//!
//! Two shapes of work. Up to 8 token rows (decode, and very short prompts): bf16 GEMVs in f32
//! that normalise their input as they read it (each layer's input projections in one launch,
//! the output projections adding into the residual stream), a DeltaNet mixer in one launch per
//! sequence (conv, l2 norm, the delta rule token after token, gated norm) and attention over
//! the cache; a decode step of one sequence is captured
//! once as a CUDA graph (the token coming in and the logits going out through page-locked
//! memory) and replayed per token, and several sequences decode in one batched step
//! (`decode_batch`), every weight read once for all. More rows (prefill): GEMMs, either the f32
//! kernel (`Precision::Exact`, what `verify` checks) or cuBLAS on tensor cores with the
//! activations rounded to bf16 (`Precision::TensorCores`), the chunked delta rule
//! (deltanet.rs `chunked`: the chunks' matrices all at once, then the state through the chunks)
//! and tiled causal attention.

use anyhow::{bail, Context, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;

use std::sync::{Arc, Mutex};

use super::{Arg, GemmOut, Gpu, Pinned, Staging};
use crate::config::{LayerType, Qwen35Config};
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

/// The most positions one decode row can see: the decode attention splits them into at most
/// `ATTN_SPLITS` chunks of at most `ATTN_CHUNK` positions (kernels.cu), each scored in shared
/// memory (the prefill's tiled attention has no such limit).
pub const MAX_CONTEXT: usize = ATTN_SPLITS * ATTN_CHUNK;
const ATTN_SPLITS: usize = 64;
const ATTN_CHUNK: usize = 1024;
/// Products of at most this many tokens take the GEMV kernels, and sequences of at most this
/// many rows the one-launch DeltaNet step and the untiled attention.
const GEMV_MAX_T: usize = 8;
/// Blocks per logits row of the greedy pick (kernels.cu argmax_rows; at most 256).
const ARGMAX_SPANS: usize = 64;
/// The longest GEMV input row whose 1/rms each GEMV block computes itself (see `gemv`).
const RMS_IN_GEMV_MAX_K: usize = 2048;
/// The row length of the streaming GEMV (kernels.cu gemv_stream_*: 32 lanes x 8 x
/// STREAM_PIECES).
const GEMV_STREAM_K: usize = 1024;
/// The fewest K/V rows a state's caches grow to (`grow_kv`).
const KV_MIN_ROWS: usize = 256;
/// Tokens per chunk of the chunked delta rule (kernels.cu CHUNK, deltanet.rs CHUNK).
const DELTANET_CHUNK: usize = 64;
/// Tokens per thread of a prefill's conv (kernels.cu CONV_RUN).
const CONV_RUN: usize = 8;

/// The input of an output projection (`project_residual`).
enum Input {
    /// f32 rows at this device address.
    F32(u64),
    /// Already rounded to bf16 in `ws.xb` by the kernel before (a tensor-core GEMM's operand).
    Bf16Ready,
}

/// What a GEMV multiplies the weights with (kernels.cu IN_PLAIN, IN_NORM).
#[derive(Clone, Copy)]
enum GemvInput {
    /// x itself.
    Plain,
    /// rms_norm(x) times this scale (a block's input norm).
    Norm(u64),
}

/// What a GEMV does with its sums (kernels.cu gemv_body).
#[derive(Clone, Copy, PartialEq)]
enum GemvOut {
    /// Writes them.
    Write,
    /// Adds them to the output (a residual connection).
    Add,
    /// The MLP's gate and up projections (the first two matrices): writes silu(gate) * up
    /// into the gate's output.
    SwiGlu,
}

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
    /// Replay decode steps from CUDA graphs (on by default; off to time the launches).
    pub graphs: bool,
    weight_bytes: usize,
    /// Page-locked buffers for states copied from the GPU to the host, shared with the states.
    staging: Arc<Mutex<Staging>>,
}

/// A request's state in GPU memory: the same arrays as `State`, K/V with room to grow, and
/// once it has decoded a token, its captured decode step.
pub struct GpuState {
    pub position: usize,
    layers: Vec<GpuLayerState>,
    /// K/V rows allocated in each full-attention layer.
    capacity: usize,
    /// Logits of the last applied token (sampling reads them; `last_logits`).
    last: LastLogits,
    step: Option<StepGraph>,
    /// The staging buffers of the engine that made this state (for `download`).
    staging: Arc<Mutex<Staging>>,
}

/// Where a state's last logits are: on the host, or, after a decode step replayed from its graph,
/// still on the GPU in the step's buffer, with their argmax: greedy sampling needs no more, so
/// the row is copied to the host only when asked for.
enum LastLogits {
    Host(Vec<f32>),
    InStep { argmax: u32 },
}

enum GpuLayerState {
    Linear { conv: CudaSlice<f32>, recurrent: CudaSlice<f32> },
    /// `[capacity, Hkv, D]` each; the first `position` rows are in use.
    Full { k: CudaSlice<f32>, v: CudaSlice<f32> },
}

/// One decode step of one state captured as a CUDA graph, with the buffers it runs in: each
/// token writes its position and id to `ws.io` and replays the graph (one launch instead of
/// ~15 per layer). The graph holds the addresses of the state's arrays, so it is captured
/// again when the K/V caches move (they grow by doubling).
struct StepGraph {
    graph: Graph,
    /// The stream of the engine that captured it: the graph runs that engine's kernels on its
    /// weights, so another engine (a state handed from prefill to decode) captures its own.
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
    /// The buffers the graph runs in; its logits stay in `ws.logits` until the next replay.
    ws: Workspace,
    capacity: usize,
    /// The position and token id of the next step, and the argmax of the last one's logits.
    io_host: Pinned<u32>,
    argmax_host: Pinned<u32>,
}

/// A CUDA graph handle is not Send; a `StepGraph` is only used through `&mut GpuState`, by one
/// thread at a time, which is all the CUDA docs ask of a graph.
struct Graph(cudarc::driver::CudaGraph);
// SAFETY: see above; the graph is never used from two threads at once.
unsafe impl Send for Graph {}

/// The buffers of one forward call over `rows` token rows (of one or several sequences); each
/// layer reuses them.
struct Workspace {
    /// The position of each sequence's first row, then the token id of each row.
    io: CudaSlice<u32>,
    sequences: usize,
    x: CudaSlice<f32>,
    /// 1 / rms of each row of a long GEMV input (gemv).
    rms_inv: CudaSlice<f32>,
    /// The normalised rows of an exact prefill's GEMM input.
    xn: CudaSlice<f32>,
    // DeltaNet
    qkv: CudaSlice<f32>,
    conv_out: CudaSlice<f32>,
    z: CudaSlice<f32>,
    core: CudaSlice<f32>,
    beta: CudaSlice<f32>,
    alpha: CudaSlice<f32>,
    /// The chunked delta rule's cumulative decay, U, W and P (prefill rows only).
    gcum: CudaSlice<f32>,
    chunk_u: CudaSlice<f32>,
    chunk_w: CudaSlice<f32>,
    chunk_p: CudaSlice<f32>,
    // attention
    qg: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    q: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    // MLP
    ffn_gate: CudaSlice<f32>,
    ffn_up: CudaSlice<f32>,
    /// A bf16 copy of a GEMM's input (tensor-core prefill only).
    xb: CudaSlice<u16>,
    /// The decode DeltaNet step's hand-over between the blocks of a key head: each block's
    /// sum of squares per token, and a count of finished blocks per key head (zero between
    /// launches: the last block resets it).
    step_ss: CudaSlice<f32>,
    step_done: CudaSlice<u32>,
    /// The decode attention's hand-over between the chunks of a (row, head): each chunk's
    /// (max, exp-sum, weighted values), and a count of finished chunks (reset by the last).
    attn_part: CudaSlice<f32>,
    attn_done: CudaSlice<u32>,
    /// The final-normed rows that get logits, and their logits.
    normed: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    /// The greedy pick of each logits row (argmax_rows): each span's best value and index, a
    /// count of finished spans per row (reset by the last), and the picks.
    pick_v: CudaSlice<f32>,
    pick_i: CudaSlice<u32>,
    pick_done: CudaSlice<u32>,
    pick: CudaSlice<u32>,
}

impl Workspace {
    fn new(net: &GpuQwen35, rows: usize, sequences: usize, logit_rows: usize) -> Result<Workspace> {
        let c = &net.config;
        let g = &net.gpu;
        let (h, cd, vd, hv, f) = (c.hidden_size, c.linear_conv_dim(), c.linear_value_dim(), c.linear_num_value_heads, c.intermediate_size);
        let (qd, kvd) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
        let widest = h.max(vd).max(qd).max(f);
        let xb = if rows > GEMV_MAX_T && net.precision == Precision::TensorCores { rows * widest } else { 1 };
        let xn = if rows > GEMV_MAX_T && net.precision == Precision::Exact { rows * h } else { 1 };
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        let chunked = if rows > GEMV_MAX_T { rows } else { 0 };
        Ok(Workspace {
            io: g.scratch(sequences + rows)?,
            sequences,
            x: g.scratch(rows * h)?,
            rms_inv: g.scratch(rows.min(GEMV_MAX_T))?,
            xn: g.scratch(xn)?,
            qkv: g.scratch(rows * cd)?,
            conv_out: g.scratch(rows * cd)?,
            z: g.scratch(rows * vd)?,
            core: g.scratch(rows * vd)?,
            beta: g.scratch(rows * hv)?,
            alpha: g.scratch(rows * hv)?,
            gcum: g.scratch(chunked * hv)?,
            chunk_u: g.scratch(chunked * hv * dv)?,
            chunk_w: g.scratch(chunked * hv * dk)?,
            chunk_p: g.scratch(chunked.div_ceil(DELTANET_CHUNK) * hv * DELTANET_CHUNK * DELTANET_CHUNK)?,
            qg: g.scratch(rows * 2 * qd)?,
            k: g.scratch(rows * kvd)?,
            v: g.scratch(rows * kvd)?,
            q: g.scratch(rows * qd)?,
            gate: g.scratch(rows * qd)?,
            attn: g.scratch(rows * qd)?,
            ffn_gate: g.scratch(rows * f)?,
            ffn_up: g.scratch(rows * f)?,
            xb: g.scratch(xb)?,
            step_ss: g.scratch(hv * c.linear_value_head_dim / 32 * GEMV_MAX_T)?,
            step_done: g.zeros(c.linear_num_key_heads)?,
            attn_part: g.scratch(rows.min(GEMV_MAX_T) * c.num_attention_heads * ATTN_SPLITS * (c.head_dim + 2))?,
            attn_done: g.zeros(rows.min(GEMV_MAX_T) * c.num_attention_heads)?,
            normed: g.scratch(logit_rows * h)?,
            logits: g.scratch(logit_rows * c.vocab_size)?,
            pick_v: g.scratch(logit_rows * ARGMAX_SPANS)?,
            pick_i: g.scratch(logit_rows * ARGMAX_SPANS)?,
            pick_done: g.zeros(logit_rows)?,
            pick: g.scratch(logit_rows)?,
        })
    }

    /// The device address of sequence `i`'s position.
    fn position_of(&self, g: &Gpu, i: usize) -> u64 {
        g.ptr(&self.io) + 4 * i as u64
    }

    /// Write the sequences' positions and the rows' token ids (before the kernels run).
    fn write_io(&mut self, g: &Gpu, positions: &[usize], tokens: &[u32]) -> Result<()> {
        let io: Vec<u32> = positions.iter().map(|&p| p as u32).chain(tokens.iter().copied()).collect();
        g.stream.memcpy_htod(&io[..], &mut self.io.slice_mut(..io.len())).map_err(|e| anyhow::anyhow!("cuda:{}: copying token ids: {e:?}", g.ordinal))
    }
}

/// One line of `GpuQwen35::time_decode_gemvs`: a GEMV launch of `rows` x `cols` weights
/// (`bytes` of them) and its median time.
pub struct GemvTiming {
    pub what: String,
    pub rows: usize,
    pub cols: usize,
    pub bytes: usize,
    pub micros: f64,
}

/// Where one sequence's rows are in a forward call.
#[derive(Clone, Copy)]
struct Rows {
    first: usize,
    count: usize,
}

impl GpuQwen35 {
    /// Copy `net`'s weights to `gpu`. The GPU runs bf16 weights; another dtype (an int8
    /// quantization, an f16 or f32 checkpoint) is refused by name.
    pub fn upload(gpu: Gpu, net: &Qwen35, precision: Precision) -> Result<GpuQwen35> {
        let c = net.config.clone();
        if c.linear_key_head_dim != 32 && c.linear_key_head_dim != 64 && c.linear_key_head_dim != 128 {
            bail!("the CUDA DeltaNet kernel is built for key heads of 32, 64 or 128 channels, this model has {}", c.linear_key_head_dim);
        }
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        if dv % 32 != 0 || dk + dv > 256 || c.linear_num_key_heads == 0 || !c.linear_num_value_heads.is_multiple_of(c.linear_num_key_heads) || c.linear_conv_kernel_dim > 8 {
            bail!(
                "the CUDA DeltaNet kernels take value heads of a multiple of 32 channels, key + value head dims up to 256, a whole number of value heads per key head and conv kernels up to 8 (this model: dk {dk}, dv {dv}, {} value and {} key heads, conv {})",
                c.linear_num_value_heads,
                c.linear_num_key_heads,
                c.linear_conv_kernel_dim
            );
        }
        if c.head_dim > 256 || c.head_dim % 16 != 0 {
            bail!("the CUDA attention kernels take head dims that are a multiple of 16 up to 256 (this model: {})", c.head_dim);
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
        let staging = Arc::new(Mutex::new(Staging::default()));
        gpu.synchronize()?;
        Ok(GpuQwen35 { gpu, config: c, embed, lm_head, final_norm, layers, inv_freq, precision, graphs: true, weight_bytes, staging })
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

    /// Host state to GPU state (the bridge's host-to-device copy).
    pub fn upload_state(&self, s: &State) -> Result<GpuState> {
        self.place_state(s)
    }

    /// The empty state of a fresh request, zeroed on the GPU from the config's shapes (copying
    /// a host state's zeros would cross the bus, 50 MB of recurrent state on the 9B model; and
    /// building that host state first took 2.4 ms of a 9B prefill on an H200). Its K/V caches
    /// get rows on the first forward call, which knows how many it needs.
    pub fn new_state(&self) -> Result<GpuState> {
        let c = &self.config;
        let layers = c
            .layer_types
            .iter()
            .map(|kind| {
                Ok(match kind {
                    LayerType::LinearAttention => GpuLayerState::Linear {
                        conv: self.gpu.zeros(c.linear_conv_kernel_dim * c.linear_conv_dim())?,
                        recurrent: self.gpu.zeros(c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim)?,
                    },
                    LayerType::FullAttention => GpuLayerState::Full { k: self.gpu.zeros(0)?, v: self.gpu.zeros(0)? },
                })
            })
            .collect::<Result<_>>()?;
        Ok(GpuState { position: 0, layers, capacity: 0, last: LastLogits::Host(Vec::new()), step: None, staging: self.staging.clone() })
    }

    /// `s` copied to the GPU.
    fn place_state(&self, s: &State) -> Result<GpuState> {
        s.check_shape(&self.config)?;
        let g = &self.gpu;
        let row = self.config.num_key_value_heads * self.config.head_dim;
        let capacity = (s.position + KV_MIN_ROWS).next_power_of_two();
        // Straight from pageable memory: staging through the page-locked buffers measured slower
        // this way (H100: 12.9 against 8.1 ms for 72 MB), as the CPU's copy into them is the
        // slow part and the driver pipelines its own staging better.
        let copy = |host: &[f32], len: usize| -> Result<CudaSlice<f32>> {
            let mut dev = g.scratch::<f32>(len)?;
            if !host.is_empty() {
                g.stream.memcpy_htod(host, &mut dev.slice_mut(..host.len())).map_err(|e| anyhow::anyhow!("cuda:{}: copying a state to the GPU: {e:?}", g.ordinal))?;
            }
            Ok(dev)
        };
        let layers = s
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerState::Linear { conv, recurrent } => GpuLayerState::Linear { conv: copy(conv, conv.len())?, recurrent: copy(recurrent, recurrent.len())? },
                    // The rows past the position are never read before they are written.
                    LayerState::Full { k, v } => GpuLayerState::Full { k: copy(k, capacity * row)?, v: copy(v, capacity * row)? },
                })
            })
            .collect::<Result<_>>()?;
        Ok(GpuState { position: s.position, layers, capacity, last: LastLogits::Host(s.last_logits.clone()), step: None, staging: self.staging.clone() })
    }

    /// A state of another GPU (or of another engine on this one) copied to this GPU: the
    /// bridge's device-to-device copy (a peer copy between two GPUs). Only the K/V rows in use
    /// are copied.
    pub fn copy_state(&self, s: &GpuState) -> Result<GpuState> {
        let g = &self.gpu;
        let err = |e| anyhow::anyhow!("cuda:{}: copying a state from cuda:{}: {e:?}", g.ordinal, s.ordinal());
        // The source's stream must be done writing before this stream reads.
        s.stream().synchronize().map_err(err)?;
        let row = self.config.num_key_value_heads * self.config.head_dim;
        let copy = |src: &CudaSlice<f32>, len: usize, used: usize| -> Result<CudaSlice<f32>> {
            let mut dst = g.zeros::<f32>(len)?;
            if used > 0 {
                g.stream.memcpy_dtod(&src.slice(..used), &mut dst.slice_mut(..used)).map_err(err)?;
            }
            Ok(dst)
        };
        let layers = s
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    GpuLayerState::Linear { conv, recurrent } => GpuLayerState::Linear { conv: copy(conv, conv.len(), conv.len())?, recurrent: copy(recurrent, recurrent.len(), recurrent.len())? },
                    GpuLayerState::Full { k, v } => GpuLayerState::Full { k: copy(k, k.len(), s.position * row)?, v: copy(v, v.len(), s.position * row)? },
                })
            })
            .collect::<Result<_>>()?;
        g.synchronize()?;
        Ok(GpuState { position: s.position, layers, capacity: s.capacity, last: LastLogits::Host(s.host_logits()?), step: None, staging: self.staging.clone() })
    }

    /// GPU state to host state (the bridge's device-to-host copy).
    pub fn download_state(&self, s: &GpuState) -> Result<State> {
        s.download()
    }

    /// Apply `tokens` to a host `State`: upload, forward, download. What `verify` runs (it
    /// compares states).
    pub fn forward_host(&self, tokens: &[u32], state: &mut State, which: Logits) -> Result<Vec<f32>> {
        let mut g = self.upload_state(state)?;
        let logits = self.forward(tokens, &mut g, which)?;
        *state = self.download_state(&g)?;
        Ok(logits)
    }

    /// Apply `tokens` to `state`, leaving the last token's logits in the state (what the engines
    /// run: after a decode step they stay on the GPU with their argmax; `GpuState::last_logits`).
    pub fn apply(&self, tokens: &[u32], state: &mut GpuState) -> Result<()> {
        if tokens.len() == 1 && self.graphs {
            self.check(tokens, state.position)?;
            self.grow_kv(state, state.position + 1)?;
            return self.replay_step(tokens[0], state);
        }
        self.forward(tokens, state, Logits::Last).map(drop)
    }

    /// Apply `tokens` to `state`; the logits of the last token, or of every token. One token
    /// (a decode step) replays the state's captured step when `graphs` is on.
    pub fn forward(&self, tokens: &[u32], state: &mut GpuState, which: Logits) -> Result<Vec<f32>> {
        self.check(tokens, state.position)?;
        self.grow_kv(state, state.position + tokens.len())?;
        if tokens.len() == 1 && self.graphs {
            self.replay_step(tokens[0], state)?;
            return state.host_logits();
        }
        let t = tokens.len();
        let logit_rows = if which == Logits::All { t } else { 1 };
        let mut ws = Workspace::new(self, t, 1, logit_rows)?;
        ws.write_io(&self.gpu, &[state.position], tokens)?;
        self.enqueue(&ws, &mut [&mut *state], &[Rows { first: 0, count: t }], t - logit_rows, None)?;
        let v = self.config.vocab_size;
        let out = self.gpu.download(&ws.logits, logit_rows * v)?;
        state.position += t;
        state.last = LastLogits::Host(out[(logit_rows - 1) * v..].to_vec());
        Ok(out)
    }

    /// One decode step of several sequences: `tokens[i]` applied to `states[i]`, every weight
    /// read once for all of them (the GEMV takes up to 8 rows; more go through the GEMM); the
    /// mixers run per sequence on its own state. Each state's last logits are set.
    pub fn decode_batch(&self, tokens: &[u32], states: &mut [&mut GpuState]) -> Result<()> {
        if tokens.len() != states.len() {
            bail!("decode_batch: {} tokens for {} states", tokens.len(), states.len());
        }
        for (tok, s) in tokens.iter().zip(states.iter()) {
            self.check(std::slice::from_ref(tok), s.position)?;
        }
        for s in states.iter_mut() {
            let end = s.position + 1;
            self.grow_kv(s, end)?;
        }
        let n = tokens.len();
        let mut ws = Workspace::new(self, n, n, n)?;
        let positions: Vec<usize> = states.iter().map(|s| s.position).collect();
        ws.write_io(&self.gpu, &positions, tokens)?;
        let rows: Vec<Rows> = (0..n).map(|i| Rows { first: i, count: 1 }).collect();
        self.enqueue(&ws, states, &rows, 0, None)?;
        let v = self.config.vocab_size;
        let out = self.gpu.download(&ws.logits, n * v)?;
        for (i, s) in states.iter_mut().enumerate() {
            s.position += 1;
            s.last = LastLogits::Host(out[i * v..(i + 1) * v].to_vec());
        }
        Ok(())
    }

    /// Refuse what the kernels cannot take, before anything is applied.
    fn check(&self, tokens: &[u32], position: usize) -> Result<()> {
        let c = &self.config;
        if tokens.is_empty() {
            bail!("forward called with no tokens");
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            bail!("token id {bad} is outside the model's vocabulary (ids 0..{})", c.vocab_size);
        }
        let context = c.max_position_embeddings.min(MAX_CONTEXT);
        if position + tokens.len() > context {
            bail!("{} tokens after position {position} exceed the CUDA engine's context of {context} tokens", tokens.len());
        }
        Ok(())
    }

    /// A decode step through the state's captured graph (captured now if it has none, or if
    /// its K/V caches moved since). The logits stay in the step's buffer; their argmax comes
    /// back.
    fn replay_step(&self, token: u32, state: &mut GpuState) -> Result<()> {
        let g = &self.gpu;
        if state.step.as_ref().is_none_or(|s| s.capacity != state.capacity || !std::sync::Arc::ptr_eq(&s.stream, &g.stream)) {
            // The old step's buffer may hold the last logits: they come to the host first, so
            // that a failed capture leaves the state whole.
            state.last_logits()?;
            state.step = None;
            let ws = Workspace::new(self, 1, 1, 1)?;
            let (io_host, mut argmax_host) = (Pinned::<u32>::new(g, 2)?, Pinned::<u32>::new(g, 1)?);
            // The attention's split over the positions is sized for the whole cache, so that
            // the one captured launch serves every position.
            let visible = state.capacity.min(MAX_CONTEXT);
            g.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| anyhow::anyhow!("cuda:{}: starting a graph capture: {e:?}", g.ordinal))?;
            // The position and token id come in from pinned memory and the argmax goes out to
            // it inside the graph: one launch and one wait per token.
            let enqueued = g
                .copy_to_device(&io_host, g.ptr(&ws.io))
                .and_then(|()| self.enqueue(&ws, &mut [&mut *state], &[Rows { first: 0, count: 1 }], 0, Some(visible)))
                .and_then(|()| self.enqueue_argmax(&ws, 1))
                .and_then(|()| g.copy_to_host(g.ptr(&ws.pick), &mut argmax_host));
            // End the capture whatever happened, so that the stream is usable again.
            let captured = g.stream.end_capture(CUgraphInstantiate_flags(0));
            enqueued?;
            let graph = captured.map_err(|e| anyhow::anyhow!("cuda:{}: capturing the decode step: {e:?}", g.ordinal))?.context("the captured decode step is empty")?;
            state.step = Some(StepGraph { graph: Graph(graph), stream: g.stream.clone(), ws, capacity: state.capacity, io_host, argmax_host });
        }
        let step = state.step.as_mut().expect("captured above");
        // The previous replay has finished (its argmax was read), so the host side is free.
        step.io_host.as_mut_slice().copy_from_slice(&[state.position as u32, token]);
        step.graph.0.launch().map_err(|e| anyhow::anyhow!("cuda:{}: replaying the decode step: {e:?}", g.ordinal))?;
        g.synchronize()?;
        state.position += 1;
        state.last = LastLogits::InStep { argmax: step.argmax_host.as_slice()[0] };
        Ok(())
    }

    /// The greedy pick of each of the first `rows` rows of `ws.logits` into `ws.pick`.
    fn enqueue_argmax(&self, ws: &Workspace, rows: usize) -> Result<()> {
        let g = &self.gpu;
        let args = [Arg::Ptr(g.ptr(&ws.logits)), Arg::I32(self.config.vocab_size as i32), Arg::Ptr(g.ptr(&ws.pick_v)), Arg::Ptr(g.ptr(&ws.pick_i)), Arg::Ptr(g.ptr(&ws.pick_done)), Arg::Ptr(g.ptr(&ws.pick))];
        g.launch("argmax_rows", (ARGMAX_SPANS as u32, rows as u32, 1), 256, 0, &args)
    }

    /// Seconds per decode step on the GPU alone: `steps` replays of `state`'s step graph back to
    /// back, one wait at the end (what `apply` adds per token on top is the host's part: the
    /// wait for the step, the copy of its argmax). The state is advanced `steps` times at the
    /// same position; a bench state only.
    pub fn time_step_replays(&self, state: &mut GpuState, steps: usize) -> Result<f64> {
        let g = &self.gpu;
        let token = crate::sampling::argmax(state.last_logits()?);
        self.replay_step(token, state)?;
        let step = state.step.as_ref().context("no step graph was captured")?;
        let start = std::time::Instant::now();
        for _ in 0..steps {
            step.graph.0.launch().map_err(|e| anyhow::anyhow!("cuda:{}: replaying the decode step: {e:?}", g.ordinal))?;
        }
        g.synchronize()?;
        Ok(start.elapsed().as_secs_f64() / steps as f64)
    }

    /// Make room for `end` K/V rows (doubling), keeping the rows in use.
    fn grow_kv(&self, state: &mut GpuState, end: usize) -> Result<()> {
        if end <= state.capacity {
            return Ok(());
        }
        let row = self.config.num_key_value_heads * self.config.head_dim;
        let used = state.position * row;
        // At least KV_MIN_ROWS: every growth moves the caches, and the state's captured decode
        // step with them, so that a short prompt would otherwise re-capture it every few steps.
        let cap = end.next_power_of_two().max(KV_MIN_ROWS);
        for l in &mut state.layers {
            if let GpuLayerState::Full { k, v } = l {
                for buf in [k, v] {
                    let mut bigger = self.gpu.zeros::<f32>(cap * row)?;
                    if used > 0 {
                        self.gpu.stream.memcpy_dtod(&buf.slice(..used), &mut bigger.slice_mut(..used)).map_err(|e| anyhow::anyhow!("cuda:{}: {e:?}", self.gpu.ordinal))?;
                    }
                    *buf = bigger;
                }
            }
        }
        state.capacity = cap;
        Ok(())
    }

    /// Queue the forward pass of the rows in `ws.io` (sequence i's rows `rows[i]` applied to
    /// `states[i]`) and the logits of rows `logits_from..`. Nothing is allocated or copied to
    /// or from the host here, so that a decode step can be captured as it is. `visible` sizes
    /// the attention scores for that many positions (default: what each sequence needs now).
    fn enqueue(&self, ws: &Workspace, states: &mut [&mut GpuState], rows: &[Rows], logits_from: usize, visible: Option<usize>) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let h = c.hidden_size;
        let t: usize = rows.iter().map(|r| r.count).sum();
        let _pdl = g.pdl_for(t <= GEMV_MAX_T);
        let x = g.ptr(&ws.x);
        let ids = ws.position_of(g, ws.sequences);
        g.launch("embed", (t as u32, 1, 1), 256, 0, &[Arg::Ptr(g.ptr(&self.embed)), Arg::Ptr(ids), Arg::Ptr(x), Arg::I32(h as i32)])?;
        for (li, layer) in self.layers.iter().enumerate() {
            // Each block normalises x on the way into its projections and adds its output to x
            // (the residual stream) itself.
            match &layer.mixer {
                GpuMixer::DeltaNet(m) => self.deltanet(m, &layer.input_norm, ws, t, states, rows, li)?,
                GpuMixer::Attention(m) => self.attention(m, &layer.input_norm, ws, t, states, rows, li, visible)?,
            }
            self.mlp(layer, ws, t)?;
        }
        let n = t - logits_from;
        let last = x + (logits_from * h * 4) as u64;
        let (head, logits) = (self.lm_head.as_ref().map_or(g.ptr(&self.embed), |m| g.ptr(&m.w)), g.ptr(&ws.logits));
        if n <= GEMV_MAX_T {
            return self.gemv(ws, GemvInput::Norm(g.ptr(&self.final_norm)), &[(head, logits, c.vocab_size)], last, h, n, GemvOut::Write);
        }
        let normed = g.ptr(&ws.normed);
        self.rms_norm(last, g.ptr(&self.final_norm), normed, 0, n, h)?;
        self.matmul_raw(ws, normed, n, head, c.vocab_size, h, logits)
    }

    /// The decode GEMV (kernels.cu gemv_*): `out_j[t, n_j] (+)= input(x)[t, k] · W_jᵀ` for t <= 8
    /// and up to four matrices `(weights, out, n_j)` of the same input, in one launch.
    #[allow(clippy::too_many_arguments)]
    fn gemv(&self, ws: &Workspace, input: GemvInput, mats: &[(u64, u64, usize)], x: u64, k: usize, t: usize, output: GemvOut) -> Result<()> {
        debug_assert!(t <= GEMV_MAX_T && !mats.is_empty() && mats.len() <= 4);
        let glu = output == GemvOut::SwiGlu;
        debug_assert!(!glu || (mats.len() == 2 && mats[0].2 == mats[1].2 && matches!(input, GemvInput::Norm(_))));
        let g = &self.gpu;
        let mut inv = 0;
        let (mode, x2) = match input {
            GemvInput::Plain => ("plain", 0),
            GemvInput::Norm(scale) => {
                // The 1/rms of a short row is found by every block of the GEMV itself; of a
                // long one by a kernel before it. Measured on an H100 (interleaved runs of
                // whole decode steps): in the GEMV, the 0.8B model's (rows of 1024) steps were
                // 1.5% faster and the 9B's (4096) 1% slower.
                if k > RMS_IN_GEMV_MAX_K {
                    inv = g.ptr(&ws.rms_inv);
                    g.launch("rms_inv", (t as u32, 1, 1), 256, 0, &[Arg::Ptr(x), Arg::Ptr(inv), Arg::I32(k as i32), Arg::F32(self.config.rms_norm_eps)])?;
                }
                ("norm", scale)
            }
        };
        let mut args = Vec::with_capacity(19);
        for j in 0..4 {
            match mats.get(j) {
                Some(&(w, out, n)) => args.extend([Arg::Ptr(w), Arg::Ptr(out), Arg::I32(n as i32)]),
                None => args.extend([Arg::Ptr(0), Arg::Ptr(0), Arg::I32(0)]),
            }
        }
        let (accumulate, eps) = (Arg::I32((output == GemvOut::Add) as i32), Arg::F32(self.config.rms_norm_eps));
        if t == 1 && k == GEMV_STREAM_K {
            // One token, rows of 1024: every warp streams through rows (as many blocks as run
            // at once, fewer where the rows run out first). On an H200 (bench's GEMV table) the
            // 0.8B model's DeltaNet input projection went from 9.0 to 7.0 us, its gate and up
            // with the SwiGLU from 9.5 to 5.8 us and its LM head from 168 to 119 us.
            let name = format!("gemv_stream_{}", if glu { "glu" } else { mode });
            let rows = if glu { mats[0].2 } else { mats.iter().map(|m| m.2).sum() };
            let blocks = (self.gpu.resident_blocks(&name)? as usize).min(rows.div_ceil(8));
            args.extend([Arg::Ptr(x), Arg::Ptr(x2), Arg::Ptr(inv), Arg::I32(k as i32), accumulate, eps]);
            return self.gpu.launch(&name, (blocks as u32, 1, 1), 256, 0, &args);
        }
        let name = format!("gemv_t{}_{}", if t == 1 { 1 } else { 8 }, if glu { "glu" } else { mode });
        // Rows per block: the most (of 8, 4, 2, 1) whose blocks still fill at least half of
        // what the GPU runs at once, so that a matrix of few rows gets several warps per row
        // and its loads are spread over the GPU (as long as every lane of a row's warps has 8
        // columns to read). Measured on an H100, every rows-per-block for every decode GEMV of
        // the 0.8B and 9B models (bench's GEMV table): this picks the fastest or within 4% of
        // it; choosing instead by how full the last round of blocks is made the 0.8B model's
        // DeltaNet input projection 1.5x slower (2 rows per block, 6 rounds of small blocks).
        let resident = self.gpu.resident_blocks(&name)? as usize;
        // (With the SwiGLU a unit's rows are gate and up rows in turn: an even count.)
        let units = |rb: usize| if glu { (2 * mats[0].2).div_ceil(rb) } else { mats.iter().map(|m| m.2.div_ceil(rb)).sum::<usize>() };
        let allowed = [8usize, 4, 2, 1].into_iter().filter(|&rb| (rb == 8 || (8 / rb) * 256 <= k) && !(glu && rb == 1));
        let rb = allowed.clone().find(|&rb| 2 * units(rb) >= resident).unwrap_or_else(|| allowed.last().unwrap_or(8));
        args.extend([Arg::Ptr(x), Arg::Ptr(x2), Arg::Ptr(inv), Arg::I32(k as i32), Arg::I32(t as i32), Arg::I32(rb as i32), accumulate, eps]);
        // A block per unit: the GPU's block scheduler evens out the last round.
        self.gpu.launch(&name, (units(rb) as u32, 1, 1), 256, 0, &args)
    }

    /// The one-token GEMVs of a decode step timed alone, by kind: the DeltaNet and attention
    /// input and output projections, the MLP's and the LM head. Each kind's launches go through
    /// every layer's matrices in turn (so that, as in a step, the weights come from memory and
    /// not from the L2 cache), captured as a CUDA graph of at least `launches`, replayed `reps`
    /// times: the median microseconds per launch. A graph of a kernel that does almost nothing
    /// (the SwiGLU of one row) shows what a launch itself costs.
    pub fn time_decode_gemvs(&self, launches: usize, reps: usize) -> Result<Vec<GemvTiming>> {
        let g = &self.gpu;
        let err = |e| anyhow::anyhow!("cuda:{}: timing the decode GEMVs: {e:?}", g.ordinal);
        let mut ws = Workspace::new(self, 1, 1, 1)?;
        for buf in [&mut ws.x, &mut ws.core, &mut ws.attn, &mut ws.ffn_gate, &mut ws.ffn_up] {
            g.stream.memset_zeros(buf).map_err(err)?;
        }
        let ws = &ws;
        let (x, h) = (g.ptr(&ws.x), self.config.hidden_size);
        // Per kind: its name and, per layer of that kind, (input norm, [(matrix, out)], input).
        type Launch<'a> = (Option<&'a CudaSlice<f32>>, Vec<(&'a GpuMatrix, u64)>, u64);
        let mut kinds: Vec<(&str, Vec<Launch>)> = ["DeltaNet in (qkv, z, b, a)", "DeltaNet out (+ residual)", "attention in (q + gate, k, v)", "attention out (+ residual)", "MLP gate, up (+ SwiGLU)", "MLP down (+ residual)"]
            .into_iter()
            .map(|what| (what, Vec::new()))
            .collect();
        for l in &self.layers {
            match &l.mixer {
                GpuMixer::DeltaNet(m) => {
                    kinds[0].1.push((Some(&l.input_norm), vec![(&m.in_proj_qkv, g.ptr(&ws.qkv)), (&m.in_proj_z, g.ptr(&ws.z)), (&m.in_proj_b, g.ptr(&ws.beta)), (&m.in_proj_a, g.ptr(&ws.alpha))], x));
                    kinds[1].1.push((None, vec![(&m.out_proj, x)], g.ptr(&ws.core)));
                }
                GpuMixer::Attention(m) => {
                    kinds[2].1.push((Some(&l.input_norm), vec![(&m.q_proj, g.ptr(&ws.qg)), (&m.k_proj, g.ptr(&ws.k)), (&m.v_proj, g.ptr(&ws.v))], x));
                    kinds[3].1.push((None, vec![(&m.o_proj, x)], g.ptr(&ws.attn)));
                }
            }
            kinds[4].1.push((Some(&l.post_attention_norm), vec![(&l.gate_proj, g.ptr(&ws.ffn_gate)), (&l.up_proj, g.ptr(&ws.ffn_up))], x));
            kinds[5].1.push((None, vec![(&l.down_proj, x)], g.ptr(&ws.ffn_gate)));
        }
        let mut out = Vec::new();
        let mut time = |what: &str, rows: usize, cols: usize, bytes: usize, count: usize, work: &dyn Fn() -> Result<()>| -> Result<()> {
            let rounds = launches.div_ceil(count);
            work()?;
            g.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(err)?;
            let enqueued = (0..rounds).try_for_each(|_| work());
            let captured = g.stream.end_capture(CUgraphInstantiate_flags(0));
            enqueued?;
            let graph = captured.map_err(err)?.context("the captured GEMVs are empty")?;
            graph.launch().map_err(err)?;
            let mut micros = Vec::with_capacity(reps);
            for _ in 0..reps {
                let event = || g.stream.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(err);
                let before = event()?;
                graph.launch().map_err(err)?;
                let after = event()?;
                g.synchronize()?;
                micros.push(before.elapsed_ms(&after).map_err(err)? as f64 * 1e3 / (rounds * count) as f64);
            }
            micros.sort_by(f64::total_cmp);
            out.push(GemvTiming { what: what.to_string(), rows, cols, bytes, micros: micros[micros.len() / 2] });
            Ok(())
        };
        for (kind, (what, list)) in kinds.iter().enumerate() {
            let Some((_, mats, _)) = list.first() else { continue };
            // As a step runs them: the MLP's gate and up with its SwiGLU, the outputs added to x.
            let output = match kind {
                4 => GemvOut::SwiGlu,
                1 | 3 | 5 => GemvOut::Add,
                _ => GemvOut::Write,
            };
            let (rows, cols) = (mats.iter().map(|m| m.0.rows).sum::<usize>(), mats[0].0.cols);
            time(what, rows, cols, rows * cols * 2, list.len(), &|| {
                list.iter().try_for_each(|(norm, mats, input)| {
                    let mats: Vec<(u64, u64, usize)> = mats.iter().map(|&(m, o)| (g.ptr(&m.w), o, m.rows)).collect();
                    match norm {
                        Some(n) => self.gemv(ws, GemvInput::Norm(g.ptr(n)), &mats, *input, cols, 1, output),
                        None => self.gemv(ws, GemvInput::Plain, &mats, *input, cols, 1, output),
                    }
                })
            })?;
        }
        let (head, v) = (self.lm_head.as_ref().map_or(g.ptr(&self.embed), |m| g.ptr(&m.w)), self.config.vocab_size);
        time("LM head", v, h, v * h * 2, 1, &|| self.gemv(ws, GemvInput::Norm(g.ptr(&self.final_norm)), &[(head, g.ptr(&ws.logits), v)], x, h, 1, GemvOut::Write))?;
        let (gate, up) = (g.ptr(&ws.ffn_gate), g.ptr(&ws.ffn_up));
        time("SwiGLU of one row (what a launch costs)", 1, h, 0, 1, &|| g.launch("swiglu", (h.div_ceil(1024) as u32, 1, 1), 256, 0, &[Arg::Ptr(gate), Arg::Ptr(up), Arg::Ptr(0), Arg::I32(h as i32)]))?;
        Ok(out)
    }

    /// `rms_norm(x[rows, d]) * w` into `out` (f32), or rounded to bf16 into `out_bf16` where
    /// that is not 0.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm(&self, x: u64, w: u64, out: u64, out_bf16: u64, rows: usize, d: usize) -> Result<()> {
        // Sixteen values a thread (kept in registers between the sum and the scaling), up to
        // 1024 threads: a row is one block.
        let threads = d.div_ceil(16).next_multiple_of(32).clamp(32, 1024) as u32;
        self.gpu.launch("rms_norm", (rows as u32, 1, 1), threads, 0, &[Arg::Ptr(x), Arg::Ptr(w), Arg::Ptr(out), Arg::Ptr(out_bf16), Arg::I32(d as i32), Arg::F32(self.config.rms_norm_eps)])
    }

    /// `out[t, n] = x[t, k] · W[n, k]ᵀ` (W at device address `w`).
    #[allow(clippy::too_many_arguments)]
    fn matmul_raw(&self, ws: &Workspace, x: u64, t: usize, w: u64, n: usize, k: usize, out: u64) -> Result<()> {
        if t <= GEMV_MAX_T {
            return self.gemv(ws, GemvInput::Plain, &[(w, out, n)], x, k, t, GemvOut::Write);
        }
        let input = self.gemm_input(ws, x, t, k)?;
        self.gemm(input, t, w, n, k, out, false)
    }

    /// The input of prefill GEMMs, `x[t, k]` (f32): for tensor cores rounded to bf16 into
    /// `ws.xb` (once for all the products of that input).
    fn gemm_input(&self, ws: &Workspace, x: u64, t: usize, k: usize) -> Result<u64> {
        if self.precision == Precision::Exact {
            return Ok(x);
        }
        let g = &self.gpu;
        let xb = g.ptr(&ws.xb);
        g.launch("to_bf16", ((t * k).div_ceil(1024) as u32, 1, 1), 256, 0, &[Arg::Ptr(x), Arg::Ptr(xb), Arg::I32((t * k) as i32)])?;
        Ok(xb)
    }

    /// `out[t, n] (+)= input[t, k] · W[n, k]ᵀ` for prefill: `input` from `gemm_input`.
    #[allow(clippy::too_many_arguments)]
    fn gemm(&self, input: u64, t: usize, w: u64, n: usize, k: usize, out: u64, accumulate: bool) -> Result<()> {
        let g = &self.gpu;
        match self.precision {
            Precision::Exact => g.launch(
                "gemm_bf16_f32",
                (n.div_ceil(64) as u32, t.div_ceil(64) as u32, 1),
                256,
                0,
                &[Arg::Ptr(w), Arg::Ptr(input), Arg::Ptr(out), Arg::I32(n as i32), Arg::I32(k as i32), Arg::I32(t as i32), Arg::I32(accumulate as i32)],
            ),
            Precision::TensorCores => g.gemm_bf16(input, t, w, n, k, out, if accumulate { GemmOut::F32Add } else { GemmOut::F32 }),
        }
    }

    /// Several products of the RMS-normalised input `rms_norm(x[t, k]) * norm`: for decode-sized
    /// t one launch for all of them (the GEMV normalises), else the norm into `ws.xn` (or, for
    /// tensor cores, in bf16 into `ws.xb`) and a GEMM each.
    fn project(&self, ws: &Workspace, x: u64, norm: &CudaSlice<f32>, t: usize, mats: &[(&GpuMatrix, u64)]) -> Result<()> {
        let g = &self.gpu;
        let k = mats[0].0.cols;
        debug_assert!(mats.iter().all(|(m, _)| m.cols == k));
        if t <= GEMV_MAX_T && mats.len() <= 4 {
            let list: Vec<(u64, u64, usize)> = mats.iter().map(|&(m, out)| (g.ptr(&m.w), out, m.rows)).collect();
            return self.gemv(ws, GemvInput::Norm(g.ptr(norm)), &list, x, k, t, GemvOut::Write);
        }
        let input = match self.precision {
            Precision::Exact => {
                let xn = g.ptr(&ws.xn);
                self.rms_norm(x, g.ptr(norm), xn, 0, t, k)?;
                xn
            }
            Precision::TensorCores => {
                let xb = g.ptr(&ws.xb);
                self.rms_norm(x, g.ptr(norm), 0, xb, t, k)?;
                xb
            }
        };
        mats.iter().try_for_each(|&(m, out)| self.gemm(input, t, g.ptr(&m.w), m.rows, k, out, false))
    }

    /// `x += input · Wᵀ`: a block's output added to the residual stream (by the GEMV or GEMM
    /// itself).
    fn project_residual(&self, ws: &Workspace, input: Input, t: usize, m: &GpuMatrix) -> Result<()> {
        let g = &self.gpu;
        let x = g.ptr(&ws.x);
        let input = match input {
            Input::Bf16Ready => return self.gemm(g.ptr(&ws.xb), t, g.ptr(&m.w), m.rows, m.cols, x, true),
            Input::F32(input) => input,
        };
        if t <= GEMV_MAX_T {
            return self.gemv(ws, GemvInput::Plain, &[(g.ptr(&m.w), x, m.rows)], input, m.cols, t, GemvOut::Add);
        }
        // The GEMM adds into the residual stream itself.
        let input = self.gemm_input(ws, input, t, m.cols)?;
        self.gemm(input, t, g.ptr(&m.w), m.rows, m.cols, x, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn deltanet(&self, m: &DeltaNet, norm: &CudaSlice<f32>, ws: &Workspace, t: usize, states: &mut [&mut GpuState], rows: &[Rows], li: usize) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (hk, hv, dk, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (vd, cd, kk) = (c.linear_value_dim(), c.linear_conv_dim(), c.linear_conv_kernel_dim);
        let x = g.ptr(&ws.x);
        let (qkv, z, beta, alpha, conv_out, core) = (g.ptr(&ws.qkv), g.ptr(&ws.z), g.ptr(&ws.beta), g.ptr(&ws.alpha), g.ptr(&ws.conv_out), g.ptr(&ws.core));
        self.project(ws, x, norm, t, &[(&m.in_proj_qkv, qkv), (&m.in_proj_z, z), (&m.in_proj_b, beta), (&m.in_proj_a, alpha)])?;
        let f32_at = |base: u64, row: usize, width: usize| base + (row * width * 4) as u64;
        let (taps, neg_a, dt_bias, norm_w) = (g.ptr(&m.conv_taps), g.ptr(&m.neg_a), g.ptr(&m.dt_bias), g.ptr(&m.norm));
        let eps = Arg::F32(c.rms_norm_eps);
        // Where every sequence takes the prefill path and the out projection is a tensor-core
        // GEMM, the gated norm writes that GEMM's bf16 operand itself.
        let norm_to_bf16 = t > GEMV_MAX_T && self.precision == Precision::TensorCores && rows.iter().all(|r| r.count > GEMV_MAX_T);
        for (s, r) in states.iter_mut().zip(rows) {
            let GpuLayerState::Linear { conv, recurrent } = &s.layers[li] else { bail!("layer {li}: state kind differs from the model's") };
            let (conv, recurrent) = (g.ptr(conv), g.ptr(recurrent));
            let (qkv, z, beta, alpha, conv_out, core) = (f32_at(qkv, r.first, cd), f32_at(z, r.first, vd), f32_at(beta, r.first, hv), f32_at(alpha, r.first, hv), f32_at(conv_out, r.first, cd), f32_at(core, r.first, vd));
            let (count, dims) = (r.count as i32, [Arg::I32(hk as i32), Arg::I32(hv as i32)]);
            if r.count <= GEMV_MAX_T {
                // Conv, norms, the delta rule and the gated norm in one launch.
                let kernel = match dk {
                    32 => "deltanet_step_32",
                    64 => "deltanet_step_64",
                    _ => "deltanet_step_128",
                };
                let args = [
                    Arg::Ptr(conv), Arg::Ptr(recurrent), Arg::Ptr(qkv), Arg::Ptr(z), Arg::Ptr(beta), Arg::Ptr(alpha), Arg::Ptr(taps), Arg::Ptr(neg_a), Arg::Ptr(dt_bias), Arg::Ptr(norm_w), Arg::Ptr(core),
                    Arg::Ptr(g.ptr(&ws.step_ss)), Arg::Ptr(g.ptr(&ws.step_done)), Arg::I32(count), dims[0], dims[1], Arg::I32(dv as i32), Arg::I32(cd as i32), Arg::I32(kk as i32), eps,
                ];
                g.launch(kernel, ((hv * dv / 32) as u32, 1, 1), 512, 0, &args)?;
                continue;
            }
            // A prefill: the conv over all rows at once, then the chunked delta rule.
            // (The conv also l2-normalises the q and k heads, q times 1/sqrt(dk).)
            let conv_args = [
                Arg::Ptr(conv), Arg::Ptr(qkv), Arg::Ptr(taps), Arg::Ptr(conv_out), Arg::I32(count), Arg::I32(cd as i32), Arg::I32(kk as i32), Arg::I32((2 * hk * dk) as i32), Arg::I32(dk as i32),
                Arg::F32(1.0 / (dk as f32).sqrt()),
            ];
            let conv_kernel = if kk <= 4 { "conv_silu_rows_4" } else { "conv_silu_rows_8" };
            g.launch(conv_kernel, (r.count.div_ceil(CONV_RUN) as u32, cd.div_ceil(1024) as u32, 1), 256, 0, &conv_args)?;
            g.launch("conv_state_tail", (cd.div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::Ptr(conv), Arg::Ptr(qkv), Arg::I32(count), Arg::I32(cd as i32), Arg::I32(kk as i32)])?;
            let (gcum, cu, cw, cp) = (g.ptr(&ws.gcum), g.ptr(&ws.chunk_u), g.ptr(&ws.chunk_w), g.ptr(&ws.chunk_p));
            let shape = [Arg::I32(count), dims[0], dims[1], Arg::I32(dk as i32), Arg::I32(dv as i32), Arg::I32(cd as i32)];
            let mut prep = vec![Arg::Ptr(conv_out), Arg::Ptr(beta), Arg::Ptr(alpha), Arg::Ptr(neg_a), Arg::Ptr(dt_bias), Arg::Ptr(gcum), Arg::Ptr(cu), Arg::Ptr(cw), Arg::Ptr(cp)];
            prep.extend(shape);
            g.launch("deltanet_chunk_prep", (r.count.div_ceil(DELTANET_CHUNK) as u32, hv as u32, 1), 256, 0, &prep)?;
            let mut walk = vec![Arg::Ptr(recurrent), Arg::Ptr(conv_out), Arg::Ptr(gcum), Arg::Ptr(cu), Arg::Ptr(cw), Arg::Ptr(cp), Arg::Ptr(core)];
            walk.extend(shape);
            // 16 value columns per block (kernels.cu deltanet_chunk_state): on tensor cores where
            // the precision allows bf16 operands; else in f32, where a grid that fits on the SMs
            // gets the build that spills no registers.
            let grid = (hv as u32, (dv / 16) as u32, 1);
            if self.precision == Precision::TensorCores && g.bf16_mma {
                let kernel = match dk {
                    32 => "deltanet_chunk_state_mma_32",
                    64 => "deltanet_chunk_state_mma_64",
                    _ => "deltanet_chunk_state_mma_128",
                };
                g.launch(kernel, grid, 128, 0, &walk)?;
            } else {
                let walk_kernel = if hv * dv / 16 <= g.sms as usize { "deltanet_chunk_state_1" } else { "deltanet_chunk_state" };
                g.launch(walk_kernel, grid, 256, 0, &walk)?;
            }
            let out_bf16 = if norm_to_bf16 { g.ptr(&ws.xb) + (r.first * vd * 2) as u64 } else { 0 };
            let args = [Arg::Ptr(core), Arg::Ptr(z), Arg::Ptr(norm_w), Arg::Ptr(out_bf16), Arg::I32((r.count * hv) as i32), Arg::I32(dv as i32), eps];
            g.launch("gated_rms_norm", ((r.count * hv).div_ceil(8) as u32, 1, 1), 256, 0, &args)?;
        }
        let input = if norm_to_bf16 { Input::Bf16Ready } else { Input::F32(g.ptr(&ws.core)) };
        self.project_residual(ws, input, t, &m.out_proj)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(&self, m: &Attention, norm: &CudaSlice<f32>, ws: &Workspace, t: usize, states: &mut [&mut GpuState], rows: &[Rows], li: usize, visible: Option<usize>) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let x = g.ptr(&ws.x);
        let (qg, k, v, q, gate, attn) = (g.ptr(&ws.qg), g.ptr(&ws.k), g.ptr(&ws.v), g.ptr(&ws.q), g.ptr(&ws.gate), g.ptr(&ws.attn));
        self.project(ws, x, norm, t, &[(&m.q_proj, qg), (&m.k_proj, k), (&m.v_proj, v)])?;
        let f32_at = |base: u64, row: usize, width: usize| base + (row * width * 4) as u64;
        let row = hkv * d;
        for (i, (s, r)) in states.iter_mut().zip(rows).enumerate() {
            let pos = ws.position_of(g, i);
            let GpuLayerState::Full { k: kc, v: vc } = &s.layers[li] else { bail!("layer {li}: state kind differs from the model's") };
            let (kc, vc) = (g.ptr(kc), g.ptr(vc));
            // Norms and RoPE; keys and values go into the caches at their rows.
            g.launch(
                "qk_norm_rope",
                (r.count as u32, (hq + hkv) as u32, 1),
                d.next_multiple_of(32) as u32,
                0,
                &[
                    Arg::Ptr(f32_at(qg, r.first, 2 * hq * d)),
                    Arg::Ptr(f32_at(q, r.first, hq * d)),
                    Arg::Ptr(f32_at(gate, r.first, hq * d)),
                    Arg::Ptr(f32_at(k, r.first, row)),
                    Arg::Ptr(f32_at(v, r.first, row)),
                    Arg::Ptr(kc),
                    Arg::Ptr(vc),
                    Arg::Ptr(g.ptr(&m.q_norm)),
                    Arg::Ptr(g.ptr(&m.k_norm)),
                    Arg::Ptr(g.ptr(&self.inv_freq)),
                    Arg::I32(hq as i32),
                    Arg::I32(hkv as i32),
                    Arg::I32(d as i32),
                    Arg::I32((c.rotary_dim() / 2) as i32),
                    Arg::Ptr(pos),
                    Arg::F32(c.rms_norm_eps),
                ],
            )?;
            let (q, gate, attn) = (f32_at(q, r.first, hq * d), f32_at(gate, r.first, hq * d), f32_at(attn, r.first, hq * d));
            if r.count > GEMV_MAX_T {
                let grid = (r.count.div_ceil(64) as u32, hq as u32, 1);
                // Tensor cores where the precision allows bf16 operands and a build of the
                // kernel exists for the head dim; else the f32 tiles.
                let mma = match d {
                    32 => Some("attention_mma_32"),
                    64 => Some("attention_mma_64"),
                    128 => Some("attention_mma_128"),
                    256 => Some("attention_mma_256"),
                    _ => None,
                };
                match mma {
                    Some(kernel) if self.precision == Precision::TensorCores && g.bf16_mma => {
                        // The caches' rows so far rounded to bf16 (its operands), K then V.
                        let n = (s.position + r.count) * row;
                        let kv: CudaSlice<u16> = g.scratch(2 * n)?;
                        let (kb, vb) = (g.ptr(&kv), g.ptr(&kv) + 2 * n as u64);
                        for (from, to) in [(kc, kb), (vc, vb)] {
                            g.launch("to_bf16", (n.div_ceil(1024) as u32, 1, 1), 256, 0, &[Arg::Ptr(from), Arg::Ptr(to), Arg::I32(n as i32)])?;
                        }
                        let args = [Arg::Ptr(q), Arg::Ptr(kb), Arg::Ptr(vb), Arg::Ptr(gate), Arg::Ptr(attn), Arg::I32(r.count as i32), Arg::I32(hq as i32), Arg::I32(hkv as i32), Arg::Ptr(pos)];
                        g.launch(kernel, grid, 256, 0, &args)?;
                    }
                    _ => {
                        let args = [Arg::Ptr(q), Arg::Ptr(kc), Arg::Ptr(vc), Arg::Ptr(gate), Arg::Ptr(attn), Arg::I32(r.count as i32), Arg::I32(hq as i32), Arg::I32(hkv as i32), Arg::I32(d as i32), Arg::Ptr(pos)];
                        g.launch("attention_tiled", grid, 256, 0, &args)?;
                    }
                }
                continue;
            }
            // Chunks of at least 64 positions, as many as the most positions a row can see need
            // (a captured step serves every position up to the cache's capacity).
            let most = visible.unwrap_or(s.position + r.count);
            let chunk = most.div_ceil(ATTN_SPLITS).max(64);
            let splits = most.div_ceil(chunk);
            debug_assert!(chunk <= ATTN_CHUNK && splits <= ATTN_SPLITS);
            let args = [
                Arg::Ptr(q), Arg::Ptr(kc), Arg::Ptr(vc), Arg::Ptr(gate), Arg::Ptr(attn), Arg::Ptr(g.ptr(&ws.attn_part)), Arg::Ptr(g.ptr(&ws.attn_done)),
                Arg::I32(hq as i32), Arg::I32(hkv as i32), Arg::I32(d as i32), Arg::I32(chunk as i32), Arg::I32(splits as i32), Arg::Ptr(pos),
            ];
            g.launch("attention", (r.count as u32, hq as u32, splits as u32), 128, 0, &args)?;
        }
        self.project_residual(ws, Input::F32(attn), t, &m.o_proj)
    }

    fn mlp(&self, l: &Layer, ws: &Workspace, t: usize) -> Result<()> {
        let g = &self.gpu;
        let (x, gate, up) = (g.ptr(&ws.x), g.ptr(&ws.ffn_gate), g.ptr(&ws.ffn_up));
        if t <= GEMV_MAX_T {
            // One GEMV for gate and up that writes silu(gate) * up itself.
            let mats = [(g.ptr(&l.gate_proj.w), gate, l.gate_proj.rows), (g.ptr(&l.up_proj.w), up, l.up_proj.rows)];
            self.gemv(ws, GemvInput::Norm(g.ptr(&l.post_attention_norm)), &mats, x, l.gate_proj.cols, t, GemvOut::SwiGlu)?;
            return self.project_residual(ws, Input::F32(gate), t, &l.down_proj);
        }
        if self.precision == Precision::TensorCores {
            // Gate and up rounded to bf16 by their GEMMs (as a bf16 model computes them), which
            // halves what they write and the SwiGLU reads (its 32 launches of a 9B prefill of
            // 2048 tokens on an H200: 2.0 ms from f32, 1.4 ms from bf16); the SwiGLU writes the
            // down projection's bf16 operand, which adds into x.
            let xb = g.ptr(&ws.xb);
            let (h, f) = (l.gate_proj.cols, l.gate_proj.rows);
            self.rms_norm(x, g.ptr(&l.post_attention_norm), 0, xb, t, h)?;
            g.gemm_bf16(xb, t, g.ptr(&l.gate_proj.w), f, h, gate, GemmOut::Bf16)?;
            g.gemm_bf16(xb, t, g.ptr(&l.up_proj.w), f, h, up, GemmOut::Bf16)?;
            let n = t * f;
            g.launch("swiglu_bf16", (n.div_ceil(1024) as u32, 1, 1), 256, 0, &[Arg::Ptr(gate), Arg::Ptr(up), Arg::Ptr(xb), Arg::I32(n as i32)])?;
            return self.gemm(xb, t, g.ptr(&l.down_proj.w), l.down_proj.rows, f, x, true);
        }
        // Exact: gate and up in f32, the SwiGLU in place in gate.
        self.project(ws, x, &l.post_attention_norm, t, &[(&l.gate_proj, gate), (&l.up_proj, up)])?;
        let n = t * l.down_proj.cols;
        g.launch("swiglu", (n.div_ceil(1024) as u32, 1, 1), 256, 0, &[Arg::Ptr(gate), Arg::Ptr(up), Arg::Ptr(0), Arg::I32(n as i32)])?;
        self.project_residual(ws, Input::F32(gate), t, &l.down_proj)
    }
}

impl GpuState {
    /// The GPU this state lives on.
    pub fn ordinal(&self) -> usize {
        self.stream().context().ordinal()
    }

    fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
        match &self.layers[0] {
            GpuLayerState::Linear { conv, .. } => conv.stream(),
            GpuLayerState::Full { k, .. } => k.stream(),
        }
    }

    /// This state copied to host memory (the bridge's device-to-host copy).
    pub fn download(&self) -> Result<State> {
        let stream = self.stream();
        let kv = self.layers.iter().find_map(|l| match l {
            GpuLayerState::Full { k, .. } => Some(k.len() / self.capacity * self.position),
            _ => None,
        });
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let mut down = |s: &CudaSlice<f32>, n: usize| -> Result<Vec<f32>> {
            let (src, _sync) = cudarc::driver::DevicePtr::device_ptr(s, stream);
            staging.download(stream, src, n)
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    GpuLayerState::Linear { conv, recurrent } => LayerState::Linear { conv: down(conv, conv.len())?.into(), recurrent: down(recurrent, recurrent.len())?.into() },
                    GpuLayerState::Full { k, v } => LayerState::Full { k: down(k, kv.unwrap_or(0))?, v: down(v, kv.unwrap_or(0))? },
                })
            })
            .collect::<Result<_>>()?;
        drop(staging);
        Ok(State { position: self.position, layers, last_logits: self.host_logits()? })
    }

    /// Bytes of state data on the GPU that a transfer moves (K/V up to the position).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                GpuLayerState::Linear { conv, recurrent } => 4 * (conv.len() + recurrent.len()),
                GpuLayerState::Full { k, .. } => 2 * 4 * k.len() / self.capacity * self.position,
            })
            .sum::<usize>()
            + 4 * match &self.last {
                LastLogits::Host(l) => l.len(),
                LastLogits::InStep { .. } => self.step.as_ref().map_or(0, |s| s.ws.logits.len()),
            }
    }

    /// The last token's logits, copied to the host first if a decode step left them on the GPU.
    pub fn last_logits(&mut self) -> Result<&[f32]> {
        if let LastLogits::InStep { .. } = self.last {
            self.last = LastLogits::Host(self.host_logits()?);
        }
        match &self.last {
            LastLogits::Host(l) => Ok(l),
            LastLogits::InStep { .. } => unreachable!("brought to the host above"),
        }
    }

    /// The argmax of the last logits (`sampling::argmax`), where the GPU found it: after a
    /// decode step replayed from its graph.
    pub fn last_argmax(&self) -> Option<u32> {
        match self.last {
            LastLogits::InStep { argmax } => Some(argmax),
            LastLogits::Host(_) => None,
        }
    }

    /// Whether the state has logits to sample from (a fresh state has none).
    pub fn has_logits(&self) -> bool {
        !matches!(&self.last, LastLogits::Host(l) if l.is_empty())
    }

    /// A host copy of the last logits, wherever they are.
    fn host_logits(&self) -> Result<Vec<f32>> {
        match &self.last {
            LastLogits::Host(l) => Ok(l.clone()),
            LastLogits::InStep { .. } => {
                let step = self.step.as_ref().context("the decode step whose buffer holds the logits is gone")?;
                let (src, _sync) = cudarc::driver::DevicePtr::device_ptr(&step.ws.logits, &step.stream);
                self.staging.lock().unwrap_or_else(|e| e.into_inner()).download(&step.stream, src, step.ws.logits.len())
            }
        }
    }
}
