//! Qwen3.5 on one GPU: the forward pass of backend/cpu/forward.rs, layer by layer, with the weights
//! (bf16, as stored) and the request state in GPU memory. Activations are f32.
//!
//! Two shapes of work. Up to 8 token rows (decode, and very short prompts): bf16 GEMVs in f32
//! that normalise their input as they read it (each layer's input projections in one launch,
//! the output projections adding into the residual stream), a DeltaNet mixer in one launch per
//! sequence (conv, l2 norm, the delta rule token after token, gated norm) and attention over
//! the cache; a decode step of one sequence is captured
//! once as a CUDA graph (the token coming in and the logits going out through page-locked
//! memory) and replayed per token. Several sequences decode in one batched step
//! (`decode_batch`): every weight read once for all, each layer's mixer one launch for all
//! (their states through address tables), replayed from the graph of its batch-size bucket
//! with padding rows (graph.rs). More rows (prefill): GEMMs, either the f32
//! kernel (`Precision::Exact`, what `verify` checks) or cuBLAS on tensor cores with the
//! activations rounded to bf16 (`Precision::TensorCores`), the chunked delta rule
//! (deltanet.rs `chunked`: the chunks' matrices all at once, then the state through the chunks)
//! and tiled causal attention. Several prompts prefill in one forward (`prefill_batch`): their
//! rows packed, one GEMM per projection for all, each DeltaNet prefill kernel one launch for
//! all sequences, attention per sequence, logits of each prompt's last row.
//!
//! This file holds the model's weights on the GPU and the forward call; `layers.rs` the layers
//! it enqueues, `gemv.rs` the decode GEMV, `graph.rs` the captured decode steps, `state.rs` a
//! request's state on the GPU, `state_slots.rs` the slot that holds its DeltaNet layers' state,
//! `kv_cache.rs` the paged K/V cache its attention layers keep (both pieces of a
//! `device_pool.rs` pool), `workspace.rs` the buffers of a call.

use anyhow::{bail, Context, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

mod blocks;
pub mod device_pool;
mod gemv;
mod graph;
pub mod kv_cache;
mod layers;
mod state;
pub use state::GpuSnapshot;
pub mod transfer;
use state::CopyOut;
pub mod state_slots;
mod workspace;

use self::kv_cache::{KvBlocks, KvPool, KV_BLOCK};
use self::state_slots::{SlotLayout, SlotPool, StateDtype, StateSlot};

use self::workspace::Workspace;
use self::layers::NormOut;
use super::kernels as k;
use super::kernels::DELTANET_CHUNK;
use super::launch::{DevPtr, Grid, StateValues};
use super::{GemmOut, Gpu, Pinned, Staging};
use crate::model::config::{LayerType, Qwen35Config};
use crate::model::Mixer;
use crate::model::{Logits, Qwen35};
use crate::state::{HostSnapshot, LayerState, Lineage, State};
use crate::model::blocks::BlockFormat;
use crate::model::tensor::{Matrix, WeightData};
use crate::sampling::{GpuDraw, MaskedPick};

/// How the products with the weights are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// f32 activations times bf16 weights, f32 sums: the CPU engine's arithmetic.
    Exact,
    /// The activations rounded to bf16, f32 sums: cuBLAS bf16 x bf16 on tensor cores for
    /// prefills and large decode batches, the GEMV on the same rounded inputs for the rest,
    /// so that a sequence's products are the same whichever kernel its step takes.
    TensorCores,
    /// `TensorCores`, and the decode GEMVs of Q4_K, Q5_K and Q6_K blocks against the inputs
    /// quantized to int8 per 256 values (kernels/blocks.cu block_input8): the CPU engine's
    /// precision=fast for those blocks (W4A8 / W6A8), four products an instruction.
    Fast,
}

impl Precision {
    /// Whether prefills and large decode batches take the tensor cores on bf16-rounded inputs.
    pub fn tensor_cores(self) -> bool {
        matches!(self, Precision::TensorCores | Precision::Fast)
    }
}

/// The most positions one decode row can see: the decode attention splits them into at most
/// `ATTN_SPLITS` chunks of at most `ATTN_CHUNK` positions (kernels/attention.cu), each scored in shared
/// memory (the prefill's tiled attention has no such limit).
pub const MAX_CONTEXT: usize = ATTN_SPLITS * ATTN_CHUNK;
const ATTN_SPLITS: usize = 64;
const ATTN_CHUNK: usize = 1024;
/// Query heads per key/value head that one block of the decode attention serves at most
/// (kernels/attention.cu).
const ATTN_GROUP_MAX: usize = 8;
/// Products of at most this many tokens take the GEMV kernels, and sequences of at most this
/// many rows the one-launch DeltaNet step and the untiled attention.
const GEMV_MAX_T: usize = 8;
/// The default of `GpuQwen35::decode_gemm_from`: from 4 sequences (a bucket of 4 rows), or
/// from 2 for models of rows longer than 2048 (`decode_gemm_from_for`). Measured on an H100
/// (`tandem bench --sections cuda`, the two paths interleaved): the 0.8B (rows of 1024)
/// decodes 2 sequences faster on the GEMV (1,191 against 1,021 tok/s) and 3 or 4 faster on the
/// GEMM (1,998 against 1,788 at 4); the 9B (rows of 4096) is faster on the GEMM from 2 (264
/// against 236), 1.6x at 4 and 2.8x at 8. The GEMV of several tokens reads each token's input
/// once per weight chunk, from L1 where a row is short.
const DECODE_GEMM_FROM: usize = 4;
const DECODE_GEMM_FROM_LONG_ROWS: usize = 2;
/// `DECODE_GEMM_FROM` for a model of this shape.
fn decode_gemm_from_for(c: &Qwen35Config) -> usize {
    if c.hidden_size > 2048 {
        DECODE_GEMM_FROM_LONG_ROWS
    } else {
        DECODE_GEMM_FROM
    }
}
/// From how many sequences a batched decode step runs the DeltaNet mixer with a block per value
/// head (kernels/deltanet.cu deltanet_step_heads_*) rather than per 32 columns of one
/// (deltanet_step_batch_*): the same bits either way. Measured by `tandem bench --sections cuda`
/// (the two kernels interleaved), the mixer's time per step per 32 columns / per value head:
/// H200, 2026-11-26, the 0.8B 0.216 / 0.200 ms at 2 sequences (the whole step 0.93x), 0.230 /
/// 0.204 at 4 (1.01x), 5.66 / 3.09 at 256 (1.40x); H100, 2026-11-26, with an earlier per-head
/// kernel, the 9B 0.332 / 0.326 at 2, 0.389 / 0.479 at 4, 12.7 / 14.7 at 256.
const STEP_HEADS_FROM: usize = 4;
/// Blocks per logits row of the greedy pick (kernels/sample.cu argmax_rows; at most 256).
const ARGMAX_SPANS: usize = 64;
/// Blocks per logits row of a grammar's mask (kernels/sample.cu mask_rows).
const MASK_SPANS: usize = 64;
/// The longest GEMV input row whose 1/rms each GEMV block computes itself (see `gemv`).
const RMS_IN_GEMV_MAX_K: usize = 2048;
/// The row length of the streaming GEMV (kernels/gemv.cu gemv_stream_*: 32 lanes x 8 x
/// STREAM_PIECES).
const GEMV_STREAM_K: usize = 1024;
/// The fewest positions a captured decode step's attention is sized for (graph.rs: a step
/// serves every position up to its span, a power of two, and is captured again past it).
const KV_MIN_ROWS: usize = 256;
/// Tokens per thread of a prefill's conv (kernels/deltanet.cu CONV_RUN).
const CONV_RUN: usize = 8;
/// The values per sequence of a packed prefill's `seqs` (kernels/common.cuh: PackedSeq).
const PACKED_SEQ_FIELDS: usize = 4;

/// The input of an output projection (`project_residual`).
enum Input {
    /// f32 rows.
    F32(DevPtr<f32>),
    /// Already rounded to bf16 in `ws.xb` by the kernel before (a tensor-core GEMM's operand).
    Bf16Ready,
}

/// What a GEMV multiplies the weights with (kernels/gemv.cu IN_PLAIN, IN_NORM).
#[derive(Clone, Copy)]
enum GemvInput {
    /// x itself.
    Plain,
    /// rms_norm(x) times this scale (a block's input norm).
    Norm(DevPtr<f32>),
}

/// What a GEMV does with its sums (kernels/gemv.cu gemv_body).
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

/// A weight matrix on the device, `rows` x `cols`, row-major: bf16, or rows of GGML blocks of
/// `format` (blocks.rs: their GPU layout, held in the same u16 buffer).
struct GpuMatrix {
    w: CudaSlice<u16>,
    rows: usize,
    cols: usize,
    format: Option<BlockFormat>,
}

/// Rows of a `GpuMatrix` (all of them, or a block of a stacked matrix): what the products take.
#[derive(Clone, Copy)]
struct MatrixRows {
    w: DevPtr<u16>,
    rows: usize,
    cols: usize,
    format: Option<BlockFormat>,
}

impl MatrixRows {
    /// Bytes a GEMV over these rows reads.
    fn bytes(&self) -> usize {
        match self.format {
            None => 2 * self.rows * self.cols,
            Some(f) => self.rows * blocks::gpu_row_bytes(f, self.cols),
        }
    }
}

impl GpuMatrix {
    fn all(&self, g: &Gpu) -> MatrixRows {
        MatrixRows { w: g.ptr(&self.w), rows: self.rows, cols: self.cols, format: self.format }
    }

    /// Rows `first..first + rows`.
    fn rows(&self, g: &Gpu, first: usize, rows: usize) -> MatrixRows {
        debug_assert!(first + rows <= self.rows);
        let per_row = match self.format {
            None => self.cols,
            Some(f) => blocks::gpu_row_bytes(f, self.cols) / 2,
        };
        MatrixRows { w: g.ptr(&self.w).offset(first * per_row), rows, cols: self.cols, format: self.format }
    }
}

struct DeltaNet {
    /// The four input projections stacked in one matrix: qkv (conv_dim rows), z (value_dim),
    /// b and a (a row per value head each). A batched decode step takes them in one product
    /// (its mixer reads each sequence's row of the four), a prefill or a lone sequence each
    /// alone (`in_projs`).
    in_proj: GpuMatrix,
    conv_taps: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    neg_a: CudaSlice<f32>,
    norm: CudaSlice<f32>,
    out_proj: GpuMatrix,
}

impl DeltaNet {
    /// Where qkv, z, b and a start among `in_proj`'s rows (and so among the values of a row of
    /// its product), and its rows in all.
    fn in_proj_starts(c: &Qwen35Config) -> [usize; 5] {
        let (cd, vd, hv) = (c.linear_conv_dim(), c.linear_value_dim(), c.linear_num_value_heads);
        [0, cd, cd + vd, cd + vd + hv, cd + vd + 2 * hv]
    }

    /// The input projections' rows of `in_proj`: qkv, z, b, a.
    fn in_projs(&self, g: &Gpu, c: &Qwen35Config) -> [MatrixRows; 4] {
        let s = DeltaNet::in_proj_starts(c);
        std::array::from_fn(|i| self.in_proj.rows(g, s[i], s[i + 1] - s[i]))
    }
}

struct Attention {
    q_proj: GpuMatrix,
    k_proj: GpuMatrix,
    v_proj: GpuMatrix,
    o_proj: GpuMatrix,
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
    /// Where this layer's keys start in a K/V block (kernels/attention.cu `koff`), in values.
    koff: usize,
}

enum GpuMixer {
    DeltaNet(DeltaNet),
    Attention(Attention),
}

struct Layer {
    input_norm: CudaSlice<f32>,
    post_attention_norm: CudaSlice<f32>,
    mixer: GpuMixer,
    /// The MLP's gate and up projections stacked in one matrix (intermediate_size rows each):
    /// a tensor-core product takes both at once (`gate_up`).
    gate_up_proj: GpuMatrix,
    down_proj: GpuMatrix,
}

impl Layer {
    /// The gate's and the up projection's rows of `gate_up_proj`.
    fn gate_up(&self, g: &Gpu) -> [MatrixRows; 2] {
        let f = self.gate_up_proj.rows / 2;
        [self.gate_up_proj.rows(g, 0, f), self.gate_up_proj.rows(g, f, f)]
    }
}

pub struct GpuQwen35 {
    pub gpu: Gpu,
    pub config: Qwen35Config,
    /// The embedding table (rows looked up by the embed kernels; the LM head where tied).
    embed: GpuMatrix,
    /// Where a GEMM over a block-format matrix takes its weights dequantized (f32 for exact
    /// products, bf16 for tensor cores): as large as the largest such matrix, or empty.
    dequantized: CudaSlice<f32>,
    /// Whether any matrix is in a block format.
    block_weights: bool,
    /// None when the LM head is the embedding table (tied).
    lm_head: Option<GpuMatrix>,
    final_norm: CudaSlice<f32>,
    layers: Vec<Layer>,
    inv_freq: CudaSlice<f32>,
    pub precision: Precision,
    /// Replay decode steps from CUDA graphs (on by default; off to time the launches).
    pub graphs: bool,
    /// Batched decode steps of at least this many sequences compute their products as
    /// tensor-core GEMMs, smaller ones with the GEMV (`set_decode_gemm_from`).
    decode_gemm_from: usize,
    /// Batched decode steps of at least this many sequences run the DeltaNet mixer with a block
    /// per value head (`set_step_heads_from`).
    step_heads_from: usize,
    weight_bytes: usize,
    /// Page-locked buffers for states copied from the GPU to the host, shared with the states.
    staging: Arc<Mutex<Staging>>,
    /// The blocks of the states' K/V caches.
    kv: Arc<KvPool>,
    /// The states' slots (their DeltaNet layers' conv windows and recurrent states).
    slots: Arc<SlotPool>,
    /// The slots of the snapshots a prefix cache keeps on this GPU (`snapshot_state`); None:
    /// snapshots go to host memory.
    snapshot_slots: Option<Arc<SlotPool>>,
    /// How its snapshots leave the GPU (`GpuSnapshot::download`).
    copy_out: Arc<CopyOut>,
    /// The batched decode steps captured so far (graph.rs).
    batch_steps: Mutex<graph::BatchSteps>,
}

/// An engine's pools on its GPU; two engines on one GPU share them (`share_pools`).
#[derive(Clone)]
pub struct GpuPools {
    pub kv: Arc<KvPool>,
    pub slots: Arc<SlotPool>,
    /// The slots of snapshots kept on the GPU (`keep_snapshots_on_device`).
    pub snapshots: Option<Arc<SlotPool>>,
}

/// A request's state in GPU memory: the same arrays as `State` (the K/V rows in blocks of the
/// engine's paged cache), and once it has decoded a token, its captured decode step.
pub struct GpuState {
    pub position: usize,
    /// Where its DeltaNet layers' arrays are (`layers` holds their addresses).
    slot: StateSlot,
    layers: Vec<GpuLayerState>,
    /// The blocks of the K/V caches of every full-attention layer.
    kv: KvBlocks,
    /// The stream of the engine that made this state (a copy to the host runs there).
    stream: Arc<cudarc::driver::CudaStream>,
    /// Logits of the last applied token (sampling reads them; `last_logits`).
    last: LastLogits,
    step: Option<StepGraph>,
    /// The staging buffers of the engine that made this state (for `download`).
    staging: Arc<Mutex<Staging>>,
    /// The snapshots it went on from (whose K/V rows it holds).
    lineage: Lineage,
    /// While it is handed from one engine to another (`mark_handed_off`): passed on its
    /// stream once the work its engine queued for it is done, so that a copy to another GPU
    /// waits for that alone and not for what the engine queued since. None otherwise.
    handed_off: Option<cudarc::driver::CudaEvent>,
}

/// Where a state's last logits are: on the host, or, after a decode step replayed from its graph
/// or a batched step, still on the GPU in the step's buffer, with their argmax: greedy sampling
/// needs no more, so the row is copied to the host only when asked for.
enum LastLogits {
    /// Shared with the snapshots taken of the state.
    Host(Arc<[f32]>),
    InStep { argmax: u32 },
    /// Row `row` of a batched step's logits (on the stream that wrote them), valid while the
    /// buffer's step count (`written`, bumped by every step that reuses the buffer) is `step`.
    InBatch { argmax: u32, logits: Arc<CudaSlice<f32>>, written: Arc<AtomicU64>, step: u64, row: usize, vocab: usize, stream: Arc<cudarc::driver::CudaStream> },
}

enum GpuLayerState {
    /// The conv window (f32) and recurrent state (in the slot's dtype): addresses in the
    /// state's slot.
    Linear { conv: DevPtr<f32>, recurrent: DevPtr<StateValues> },
    /// Its keys and values are in the state's K/V blocks (`GpuState::kv`).
    Full,
}

/// One decode step of one state captured as a CUDA graph, with the buffers it runs in: each
/// token writes its position and id to `ws.io` and replays the graph (one launch instead of
/// ~15 per layer). The graph holds the addresses of the state's arrays and reads its block
/// table from `blocks_host` (written before each replay); its attention is sized for `span`
/// positions, so it is captured again when the state grows past them.
struct StepGraph {
    graph: Graph,
    /// The stream of the engine that captured it: the graph runs that engine's kernels on its
    /// weights, so another engine (a state handed from prefill to decode) captures its own.
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
    /// The buffers the graph runs in; its logits stay in `ws.logits` until the next replay.
    ws: Workspace,
    span: usize,
    /// The position and token id of the next step, the state's block table (`span /
    /// KV_BLOCK` entries), and the argmax of the last one's logits.
    io_host: Pinned<u32>,
    blocks_host: Pinned<u64>,
    argmax_host: Pinned<u32>,
}

/// A CUDA graph handle is not Send; a `StepGraph` is only used through `&mut GpuState`, by one
/// thread at a time, which is all the CUDA docs ask of a graph.
struct Graph(cudarc::driver::CudaGraph);
// SAFETY: see above; the graph is never used from two threads at once.
unsafe impl Send for Graph {}


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

/// Which rows of a forward call get logits.
#[derive(Clone, Copy)]
enum LogitRows {
    /// The rows from this one on: every row, the last one, or one per sequence of a batched
    /// decode step.
    From(usize),
    /// The last row of each sequence (a packed prefill): gathered first, then normed and
    /// multiplied as `From` rows are.
    LastOfEach,
}

impl GpuQwen35 {
    /// Copy `net`'s weights to `gpu`. The GPU runs bf16 weights and GGML's Q4_0, Q8_0, Q4_K,
    /// Q5_K and Q6_K blocks (a GGUF file's, or `--quant q4_k` and its siblings); another dtype
    /// (an int8 quantization, an f16 or f32 checkpoint) is refused by name.
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
        // (A whole number of query heads per key/value head: the config's own check.)
        if c.num_attention_heads / c.num_key_value_heads > ATTN_GROUP_MAX {
            bail!(
                "the CUDA decode attention takes up to {ATTN_GROUP_MAX} query heads per key/value head (this model: {} query heads, {} key/value heads)",
                c.num_attention_heads,
                c.num_key_value_heads
            );
        }
        let weight_bytes = std::cell::Cell::new(0);
        // The largest block-format matrix (the dequantized weights of its GEMMs).
        let largest_blocks = std::cell::Cell::new(0usize);
        // Matrices of the same columns stacked into one, their rows in the order given (one
        // matrix: itself). Block formats in their GPU layout (blocks.rs), all parts of one.
        let stacked = |parts: &[(&Matrix, &str)]| -> Result<GpuMatrix> {
            let format = match &parts[0].0.data {
                WeightData::Blocks { format, .. } => Some(*format),
                _ => None,
            };
            let mut data: Vec<u16> = Vec::new();
            for &(m, name) in parts {
                if m.cols % 8 != 0 {
                    bail!("{name}: {} columns; the CUDA GEMV needs a multiple of 8", m.cols);
                }
                if m.cols != parts[0].0.cols {
                    bail!("{name}: {} columns where {} has {}; they are stacked into one matrix", m.cols, parts[0].1, parts[0].0.cols);
                }
                match (&m.data, format) {
                    (WeightData::Bf16(b), None) => data.extend_from_slice(b.as_slice()),
                    (WeightData::Blocks { format: f, data: bytes }, Some(first)) if *f == first => {
                        blocks::check(first, name)?;
                        let laid = blocks::gpu_layout(first, m.cols, bytes.as_slice());
                        data.extend(laid.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])));
                    }
                    (WeightData::Blocks { format: f, .. }, Some(first)) => {
                        bail!("{name} is {f} where {} is {first}: the CUDA engine stacks them into one matrix of one format", parts[0].1)
                    }
                    _ => bail!(
                        "{name}: the CUDA engine runs bf16 weights and Q4_0, Q8_0, Q4_K, Q5_K and Q6_K blocks; this matrix is {} (from --quant int8, or an f16 or F32 tensor): for a GPU engine use --quant q4_k (or another block format), or load a BF16 or block-quantized file",
                        m.dtype()
                    ),
                }
                weight_bytes.set(weight_bytes.get() + m.bytes());
            }
            let rows = parts.iter().map(|p| p.0.rows).sum::<usize>();
            Ok(GpuMatrix { w: gpu.upload(&data)?, rows, cols: parts[0].0.cols, format })
        };
        // A layer's matrix: the largest in a block format sizes the GEMMs' dequantized weights.
        // (The embedding is only looked up, and a block-format LM head always takes the GEMV:
        // its dequantized weights would be gigabytes.)
        let stacked_layer = |parts: &[(&Matrix, &str)]| -> Result<GpuMatrix> {
            let m = stacked(parts)?;
            if m.format.is_some() {
                largest_blocks.set(largest_blocks.get().max(m.rows * m.cols));
            }
            Ok(m)
        };
        let mat = |m: &Matrix, name: &str| stacked_layer(&[(m, name)]);
        let tied = std::ptr::eq(net.lm_head_data_ptr(), net.embed_data_ptr());
        let lm_head = if tied { None } else { Some(stacked(&[(&net.lm_head, "lm_head")])?) };
        let embed = stacked(&[(&net.embed_tokens, "embed_tokens")])?;
        // (The table is counted with the LM head where tied, below.)
        weight_bytes.set(weight_bytes.get() - net.embed_tokens.bytes());
        let mut layers = Vec::with_capacity(net.layers.len());
        // The attention layers' places in a K/V block (kv_cache.rs): keys then values of each.
        let mut koff = 0;
        let kv_layer_values = 2 * KV_BLOCK * c.num_key_value_heads * c.head_dim;
        for (i, l) in net.layers.iter().enumerate() {
            let p = format!("layers.{i}");
            let mixer = match &l.mixer {
                Mixer::DeltaNet(d) => GpuMixer::DeltaNet(DeltaNet {
                    in_proj: stacked_layer(&[
                        (&d.in_proj_qkv, &format!("{p}.in_proj_qkv")),
                        (&d.in_proj_z, &format!("{p}.in_proj_z")),
                        (&d.in_proj_b, &format!("{p}.in_proj_b")),
                        (&d.in_proj_a, &format!("{p}.in_proj_a")),
                    ])?,
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
                    koff: {
                        koff += kv_layer_values;
                        koff - kv_layer_values
                    },
                }),
            };
            layers.push(Layer {
                input_norm: gpu.upload(&l.input_norm)?,
                post_attention_norm: gpu.upload(&l.post_attention_norm)?,
                mixer,
                gate_up_proj: stacked_layer(&[(&l.mlp.gate_proj, &format!("{p}.gate_proj")), (&l.mlp.up_proj, &format!("{p}.up_proj"))])?,
                down_proj: mat(&l.mlp.down_proj, &format!("{p}.down_proj"))?,
            });
        }
        if tied {
            weight_bytes.set(weight_bytes.get() + net.embed_tokens.bytes());
        }
        let weight_bytes = weight_bytes.get();
        // Exact products take the dequantized weights in f32, tensor cores in bf16 (half of it;
        // the engine's precision may change after upload).
        let dequantized = gpu.zeros::<f32>(largest_blocks.get().max(1))?;
        let final_norm = gpu.upload(&net.final_norm)?;
        let inv_freq = gpu.upload(&net.inv_freq)?;
        let staging = Arc::new(Mutex::new(Staging::default()));
        gpu.synchronize()?;
        let decode_gemm_from = decode_gemm_from_for(&c);
        let kv = Arc::new(KvPool::new(gpu.stream.context(), &c)?);
        let slots = Arc::new(SlotPool::new(gpu.stream.context(), SlotLayout::new(&c, StateDtype::F32))?);
        let copy_out = Arc::new(CopyOut::new(gpu.stream.context())?);
        let block_weights = largest_blocks.get() > 0;
        Ok(GpuQwen35 { gpu, config: c, embed, dequantized, block_weights, lm_head, final_norm, layers, inv_freq, precision, graphs: true, decode_gemm_from, step_heads_from: STEP_HEADS_FROM, weight_bytes, staging, kv, slots, snapshot_slots: None, copy_out, batch_steps: Mutex::default() })
    }

    /// Whether any matrix is in a block format (its GEMMs take dequantized weights).
    fn has_block_weights(&self) -> bool {
        self.block_weights
    }

    /// The LM head's rows (the embedding table's where tied).
    fn lm_head_rows(&self) -> MatrixRows {
        self.lm_head.as_ref().unwrap_or(&self.embed).all(&self.gpu)
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

    /// From how many sequences a batched decode step computes its products as tensor-core
    /// GEMMs (with tensor-core precision; exact precision keeps the GEMV up to 8).
    pub fn decode_gemm_from(&self) -> usize {
        self.decode_gemm_from
    }

    /// Set `decode_gemm_from` (at least 2; past 8 the GEMV takes every batch up to 8); the
    /// batched steps captured so far are dropped, to be captured again as they are needed.
    pub fn set_decode_gemm_from(&mut self, n: usize) {
        self.decode_gemm_from = n.max(2);
        *self.batch_steps.get_mut().unwrap_or_else(|e| e.into_inner()) = graph::BatchSteps::default();
    }

    /// From how many sequences a batched decode step runs the DeltaNet mixer with a block per
    /// value head (where the head's shape allows: `layers::step_heads_fit`).
    pub fn step_heads_from(&self) -> usize {
        self.step_heads_from
    }

    /// Set `step_heads_from` (usize::MAX: never); the batched steps captured so far are dropped.
    pub fn set_step_heads_from(&mut self, n: usize) {
        self.step_heads_from = n.max(2);
        *self.batch_steps.get_mut().unwrap_or_else(|e| e.into_inner()) = graph::BatchSteps::default();
    }

    /// The engine's K/V block pool.
    pub fn kv_pool(&self) -> &Arc<KvPool> {
        &self.kv
    }

    /// The engine's pool of state slots.
    pub fn slot_pool(&self) -> &Arc<SlotPool> {
        &self.slots
    }

    /// Whether a prefill's products, state walk and attention run on tensor cores (bf16
    /// operands): the precision asks for them and the GPU has bf16 mma.
    fn prefills_on_tensor_cores(&self) -> bool {
        self.precision.tensor_cores() && self.gpu.bf16_mma
    }

    /// The dtype of the recurrent states this engine makes.
    pub fn state_dtype(&self) -> StateDtype {
        self.slots.layout().dtype
    }

    /// Keep the recurrent states of the states made from now on in `dtype` (a new, empty slot
    /// pool), and run the kernels built for it. States made before keep their slots; the engine
    /// runs them again once set back to their dtype (it refuses them meanwhile: `check_slot`).
    /// The batched steps captured so far are dropped (they hold the other dtype's kernels).
    pub fn set_state_dtype(&mut self, dtype: StateDtype) -> Result<()> {
        if dtype != self.state_dtype() {
            self.slots = Arc::new(SlotPool::new(self.gpu.stream.context(), SlotLayout::new(&self.config, dtype))?);
            if self.snapshot_slots.is_some() {
                self.snapshot_slots = Some(Arc::new(SlotPool::for_snapshots(self.gpu.stream.context(), *self.slots.layout(), 4 * self.config.vocab_size)?));
            }
            *self.batch_steps.get_mut().unwrap_or_else(|e| e.into_inner()) = graph::BatchSteps::default();
        }
        Ok(())
    }

    /// The engine's pools: what another engine on this GPU takes to share them.
    pub fn pools(&self) -> GpuPools {
        GpuPools { kv: self.kv.clone(), slots: self.slots.clone(), snapshots: self.snapshot_slots.clone() }
    }

    /// Take fresh states' K/V blocks and slots (and snapshots' slots) from `pools` (another
    /// engine's on this GPU) instead of pools of this engine's own.
    pub fn share_pools(&mut self, pools: GpuPools) -> Result<()> {
        let GpuPools { kv, slots, snapshots } = pools;
        if kv.ordinal() != self.gpu.ordinal || kv.block_values() != self.kv.block_values() {
            bail!("cuda:{}: a K/V pool of cuda:{} with blocks of {} values cannot serve this engine (blocks of {})", self.gpu.ordinal, kv.ordinal(), kv.block_values(), self.kv.block_values());
        }
        if slots.ordinal() != self.gpu.ordinal || slots.layout() != self.slots.layout() {
            bail!(
                "cuda:{}: the state slots of the other engine on cuda:{} hold {} recurrent states, this engine's {}: give both engines the same state dtype",
                self.gpu.ordinal,
                slots.ordinal(),
                slots.layout().dtype,
                self.state_dtype()
            );
        }
        self.kv = kv;
        self.slots = slots;
        self.snapshot_slots = snapshots;
        Ok(())
    }

    /// Keep the snapshots `snapshot_state` takes on this GPU, in a slot pool of their own (no
    /// limit: the prefix cache that holds them keeps to its budget); their K/V blocks are
    /// shared with the states they come from.
    pub fn keep_snapshots_on_device(&mut self) -> Result<()> {
        if self.snapshot_slots.is_none() {
            self.snapshot_slots = Some(Arc::new(SlotPool::for_snapshots(self.gpu.stream.context(), *self.slots.layout(), 4 * self.config.vocab_size)?));
        }
        Ok(())
    }

    /// Whether this engine runs `state` where it is: a state of this GPU whose slot holds what
    /// this engine's kernels read (its recurrent states in this engine's dtype). Another one
    /// is copied over first (`copy_state`).
    pub fn runs_in_place(&self, state: &GpuState) -> bool {
        state.ordinal() == self.gpu.ordinal && state.slot.layout() == self.slots.layout()
    }

    fn check_slot(&self, state: &GpuState) -> Result<()> {
        if state.slot.layout() != self.slots.layout() {
            bail!("cuda:{}: a state whose recurrent states are {} cannot run on this engine, which keeps them in {}", self.gpu.ordinal, state.slot.layout().dtype, self.state_dtype());
        }
        Ok(())
    }

    /// Bytes of weights one decode step reads (every matrix and the LM head).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
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
            self.reserve_kv(state, state.position + 1)?;
            return self.replay_step(tokens[0], state);
        }
        self.forward(tokens, state, Logits::Last).map(drop)
    }

    /// Apply `tokens` to `state`; the logits of the last token, or of every token. One token
    /// (a decode step) replays the state's captured step when `graphs` is on.
    pub fn forward(&self, tokens: &[u32], state: &mut GpuState, which: Logits) -> Result<Vec<f32>> {
        self.check(tokens, state.position)?;
        self.reserve_kv(state, state.position + tokens.len())?;
        if tokens.len() == 1 && self.graphs {
            self.replay_step(tokens[0], state)?;
            return state.host_logits();
        }
        self.forward_launches(tokens, state, which)
    }

    /// `forward` kernel by kernel (checked, K/V blocks taken): no graph.
    fn forward_launches(&self, tokens: &[u32], state: &mut GpuState, which: Logits) -> Result<Vec<f32>> {
        let t = tokens.len();
        let logit_rows = if which == Logits::All { t } else { 1 };
        let mut ws = Workspace::new(self, t, 1, logit_rows)?;
        ws.write_io(&self.gpu, &[state.position], tokens)?;
        let width = state.kv.table().len();
        ws.write_blocks(&self.gpu, &[&mut *state], width)?;
        self.enqueue(&ws, &mut [&mut *state], &[Rows { first: 0, count: t }], LogitRows::From(t - logit_rows), None)?;
        let v = self.config.vocab_size;
        let out = self.gpu.download(&ws.logits, logit_rows * v)?;
        state.position += t;
        state.last = LastLogits::Host(Arc::from(&out[(logit_rows - 1) * v..]));
        Ok(out)
    }

    /// One decode step of several sequences: `tokens[i]` applied to `states[i]`, every weight
    /// read once for all of them (by the GEMV below `decode_gemm_from` rows, else the GEMM), each
    /// layer's mixer in one launch for all (their states through the step's address tables).
    /// With `graphs` on, the step is replayed from the graph of its batch-size bucket
    /// (`replay_batch`). Each state's last logits are set: its greedy pick comes back, the row
    /// stays on the GPU until asked for.
    pub fn decode_batch(&self, tokens: &[u32], states: &mut [&mut GpuState]) -> Result<()> {
        if tokens.len() != states.len() {
            bail!("decode_batch: {} tokens for {} states", tokens.len(), states.len());
        }
        for (tok, s) in tokens.iter().zip(states.iter()) {
            self.check(std::slice::from_ref(tok), s.position)?;
        }
        for s in states.iter_mut() {
            let end = s.position + 1;
            self.reserve_kv(s, end)?;
        }
        let n = tokens.len();
        if self.graphs {
            return match states {
                [one] => self.replay_step(tokens[0], one),
                _ => self.replay_batch(tokens, states),
            };
        }
        let mut ws = if n > 1 { Workspace::batched(self, n)? } else { Workspace::new(self, 1, 1, 1)? };
        let positions: Vec<usize> = states.iter().map(|s| s.position).collect();
        ws.write_io(&self.gpu, &positions, tokens)?;
        if n > 1 {
            ws.write_tables(&self.gpu, states)?;
        }
        let width = states.iter().map(|s| s.kv.table().len()).max().unwrap_or(0);
        ws.write_blocks(&self.gpu, states, width)?;
        let rows: Vec<Rows> = (0..n).map(|i| Rows { first: i, count: 1 }).collect();
        self.enqueue(&ws, states, &rows, LogitRows::From(0), None)?;
        // The greedy picks are found on the GPU and only they come back.
        self.enqueue_argmax(&ws, n)?;
        let picks = self.gpu.download(&ws.pick, n)?;
        // A workspace of its own: no later step writes these logits.
        self.advance_batch(states, |_| 1, &picks, &ws.logits, &Arc::new(AtomicU64::new(0)), 0);
        Ok(())
    }

    /// Prefill several prompts in one forward: `prompts[i]` applied to `states[i]`, their rows
    /// packed one after another (no padding), so that each projection is one GEMM over all of
    /// them (a prompt of a few hundred tokens alone leaves most of the tensor cores idle); each
    /// sequence's mixer runs on its own rows and state, and only each prompt's last row gets
    /// logits. Each state's last logits are left as `decode_batch` leaves them: the greedy
    /// pick on the host, the row on the GPU until asked for. Every prompt is checked before
    /// anything is applied.
    ///
    /// A prompt of at most `GEMV_MAX_T` tokens is applied alone: alone it takes the GEMV, and
    /// packed it would take the GEMM, which sums in another order (with exact precision the
    /// exact GEMM, another kernel still), so that it could pick another token. Every packed
    /// prompt takes the GEMM alone too.
    pub fn prefill_batch(&self, prompts: &[&[u32]], states: &mut [&mut GpuState]) -> Result<()> {
        if prompts.len() != states.len() {
            bail!("prefill_batch: {} prompts for {} states", prompts.len(), states.len());
        }
        for (p, s) in prompts.iter().zip(states.iter()) {
            if p.is_empty() {
                bail!("prefill_batch: an empty prompt (a state with nothing to apply has no new logits)");
            }
            self.check(p, s.position)?;
        }
        let (mut long, mut long_states) = (Vec::new(), Vec::new());
        for (p, s) in prompts.iter().zip(states.iter_mut()) {
            if p.len() <= GEMV_MAX_T {
                self.apply(p, s)?;
            } else {
                long.push(*p);
                long_states.push(&mut **s);
            }
        }
        match long.len() {
            0 => Ok(()),
            1 => self.apply(long[0], long_states[0]),
            _ => self.prefill_packed(&long, &mut long_states),
        }
    }

    /// `prefill_batch` of prompts of more than `GEMV_MAX_T` tokens each, checked.
    fn prefill_packed(&self, prompts: &[&[u32]], states: &mut [&mut GpuState]) -> Result<()> {
        for (p, s) in prompts.iter().zip(states.iter_mut()) {
            let end = s.position + p.len();
            self.reserve_kv(s, end)?;
        }
        let n = prompts.len();
        let mut rows = Vec::with_capacity(n);
        let mut t = 0;
        for p in prompts {
            rows.push(Rows { first: t, count: p.len() });
            t += p.len();
        }
        let mut ws = Workspace::new(self, t, n, n)?;
        let positions: Vec<usize> = states.iter().map(|s| s.position).collect();
        ws.write_io(&self.gpu, &positions, &prompts.concat())?;
        ws.write_packed(&self.gpu, states, &rows)?;
        self.enqueue(&ws, states, &rows, LogitRows::LastOfEach, None)?;
        self.enqueue_argmax(&ws, n)?;
        let picks = self.gpu.download(&ws.pick, n)?;
        self.advance_batch(states, |i| prompts[i].len(), &picks, &ws.logits, &Arc::new(AtomicU64::new(0)), 0);
        Ok(())
    }

    /// After a batched call: state `i` `applied(i)` positions on, its last logits row `i` of
    /// `logits` (valid while `written` is `step`) with its greedy pick.
    fn advance_batch(&self, states: &mut [&mut GpuState], applied: impl Fn(usize) -> usize, picks: &[u32], logits: &Arc<CudaSlice<f32>>, written: &Arc<AtomicU64>, step: u64) {
        for (i, s) in states.iter_mut().enumerate() {
            s.position += applied(i);
            s.last = LastLogits::InBatch { argmax: picks[i], logits: logits.clone(), written: written.clone(), step, row: i, vocab: self.config.vocab_size, stream: self.gpu.stream.clone() };
        }
    }

    /// Refuse a prompt the kernels cannot apply at `position`, before anything is applied.
    pub fn check_prompt(&self, tokens: &[u32], position: usize) -> Result<()> {
        self.check(tokens, position)
    }

    /// Refuse what the kernels cannot take, before anything is applied.
    fn check(&self, tokens: &[u32], position: usize) -> Result<()> {
        self.config.check_input(tokens, position, tokens.len(), self.config.max_position_embeddings.min(MAX_CONTEXT), "the CUDA engine's")
    }

    /// Queue the forward pass of the rows in `ws.io` (sequence i's rows `rows[i]` applied to
    /// `states[i]`) and the logits of the rows `logits` names. Nothing is allocated or copied to
    /// or from the host here, so that a decode step can be captured as it is. `visible` sizes
    /// the attention scores for that many positions (default: what each sequence needs now).
    fn enqueue(&self, ws: &Workspace, states: &mut [&mut GpuState], rows: &[Rows], logits: LogitRows, visible: Option<usize>) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let h = c.hidden_size;
        let t: usize = rows.iter().map(|r| r.count).sum();
        for s in states.iter() {
            self.check_slot(s)?;
        }
        let _pdl = g.pdl_for(t <= GEMV_MAX_T);
        let x = g.ptr(&ws.x);
        let ids = ws.position_of(g, ws.sequences);
        match self.embed.format {
            None => g.launch(k::EMBED, Grid::x(t, 256), (g.ptr(&self.embed.w), ids, x, h as i32))?,
            Some(f) => g.launch(blocks::embed_kernel(f), Grid::x(t, 256), (g.ptr(&self.embed.w).reinterpret::<u8>(), ids, x, h as i32))?,
        }
        for (li, layer) in self.layers.iter().enumerate() {
            // Each block normalises x on the way into its projections and adds its output to x
            // (the residual stream) itself.
            match &layer.mixer {
                GpuMixer::DeltaNet(m) => self.deltanet(m, &layer.input_norm, ws, t, states, rows, li)?,
                GpuMixer::Attention(m) => self.attention(m, &layer.input_norm, ws, t, states, rows, li, visible)?,
            }
            self.mlp(layer, ws, t)?;
        }
        let (last, n) = match logits {
            LogitRows::From(from) => (x.offset(from * h), t - from),
            LogitRows::LastOfEach => {
                let gathered = g.ptr(&ws.last_rows);
                for (i, r) in rows.iter().enumerate() {
                    g.copy_on_device(x.offset((r.first + r.count - 1) * h), gathered.offset(i * h), h)?;
                }
                (gathered, rows.len())
            }
        };
        let (head, logits) = (self.lm_head_rows(), g.ptr(&ws.logits));
        // (A block-format LM head by the GEMV at any number of rows, in launches of 8.)
        if ws.takes_gemv(n) || head.format.is_some() {
            return self.gemv(ws, GemvInput::Norm(g.ptr(&self.final_norm)), &[(head, logits)], last, h, n, GemvOut::Write);
        }
        let normed = g.ptr(&ws.normed);
        self.rms_norm(last, g.ptr(&self.final_norm), NormOut::F32(normed), n, h)?;
        self.matmul(ws, normed, n, head, logits)
    }

    /// Draws (`sampling::GpuDraw`, with the host's uniform) from the last logits of states
    /// whose decode step on this engine left them on the GPU, all in one launch
    /// (kernels/sample.cu sample_rows): each state's id, and only the indices cross to the host.
    /// None for a state whose logits are elsewhere or where no logit qualifies: the host draws
    /// then, with the same uniform.
    pub fn sample_rows(&self, draws: &[(&GpuState, GpuDraw)]) -> Result<Vec<Option<u32>>> {
        let g = &self.gpu;
        let rows: Vec<Option<u64>> = draws.iter().map(|(s, d)| self.logits_row(s, d.allowed)).collect();
        let (mut ptrs, mut params) = (Vec::new(), Vec::new());
        for (row, (s, d)) in rows.iter().zip(draws) {
            if let Some(row) = row {
                ptrs.push(*row);
                let argmax = s.last_argmax().map_or(-1.0, |a| a as f64);
                params.extend([d.allowed as f64, d.inv_t as f64, d.top_k as f64, d.top_p as f64, d.u, argmax]);
            }
        }
        if ptrs.is_empty() {
            return Ok(vec![None; draws.len()]);
        }
        let (ptrs_dev, params_dev, out) = (g.upload(&ptrs)?, g.upload(&params)?, g.scratch::<u32>(ptrs.len())?);
        g.launch(k::SAMPLE_ROWS, Grid::new((ptrs.len(), 1, 1), 1024), (g.ptr(&ptrs_dev).reinterpret(), g.ptr(&params_dev), g.ptr(&out)))?;
        let mut ids = g.download(&out, ptrs.len())?.into_iter();
        Ok(rows.iter().zip(draws).map(|(row, (s, _))| row.and_then(|_| ids.next()).filter(|&id| id != u32::MAX && still_current(s))).collect())
    }

    /// Picks from the last logits of states whose step left them on this GPU, each row masked
    /// first by its grammar (`sampling::MaskedPick`; kernels/sample.cu mask_rows, into a copy,
    /// so that the state's row stays the model's): greedy (argmax_rows over the masked rows) or
    /// a draw (sample_rows). Only the masks go up and the ids come back. None for a state whose
    /// logits are elsewhere or where a draw finds no logit: the host picks then.
    pub fn sample_masked(&self, picks: &[(&GpuState, MaskedPick)]) -> Result<Vec<Option<u32>>> {
        let g = &self.gpu;
        let Some(n) = picks.first().map(|(_, p)| p.allowed) else { return Ok(Vec::new()) };
        if let Some((_, p)) = picks.iter().find(|(_, p)| p.allowed != n) {
            bail!("sample_masked: rows of {n} and of {} ids in one call", p.allowed);
        }
        let rows: Vec<Option<u64>> = picks.iter().map(|(s, _)| self.logits_row(s, n)).collect();
        let words = n.div_ceil(32);
        let (mut ptrs, mut masks, mut kept) = (Vec::new(), Vec::new(), Vec::new());
        for (row, (_, p)) in rows.iter().zip(picks) {
            if let Some(row) = row {
                ptrs.push(*row);
                let m = &p.mask[..words.min(p.mask.len())];
                masks.extend_from_slice(m);
                masks.resize(masks.len() + words - m.len(), 0);
                kept.push(p);
            }
        }
        let m = ptrs.len();
        if m == 0 {
            return Ok(vec![None; picks.len()]);
        }
        let (ptrs_dev, masks_dev, masked) = (g.upload(&ptrs)?, g.upload(&masks)?, g.scratch::<f32>(m * n)?);
        g.launch(k::MASK_ROWS, Grid::new((MASK_SPANS, m, 1), 256), (g.ptr(&ptrs_dev).reinterpret(), g.ptr(&masks_dev), words as i32, n as i32, g.ptr(&masked)))?;
        // The greedy picks: every masked row's argmax, in one launch.
        let greedy = if kept.iter().any(|p| p.draw.is_none()) {
            let (part_v, part_i, done, out) = (g.scratch::<f32>(m * ARGMAX_SPANS)?, g.scratch::<u32>(m * ARGMAX_SPANS)?, g.zeros::<u32>(m)?, g.scratch::<u32>(m)?);
            g.launch(k::ARGMAX_ROWS, Grid::new((ARGMAX_SPANS, m, 1), 256), (g.ptr(&masked), n as i32, g.ptr(&part_v), g.ptr(&part_i), g.ptr(&done), g.ptr(&out)))?;
            g.download(&out, m)?
        } else {
            Vec::new()
        };
        // The draws: from the masked rows, their largest found again (the step's argmax may be
        // masked).
        let (mut draw_rows, mut params) = (Vec::new(), Vec::new());
        for (j, p) in kept.iter().enumerate() {
            if let Some(d) = p.draw {
                draw_rows.push(g.ptr(&masked).offset(j * n).addr());
                params.extend([n as f64, d.inv_t as f64, d.top_k as f64, d.top_p as f64, d.u, -1.0]);
            }
        }
        let mut drawn = if draw_rows.is_empty() {
            Vec::new()
        } else {
            let (rows_dev, params_dev, out) = (g.upload(&draw_rows)?, g.upload(&params)?, g.scratch::<u32>(draw_rows.len())?);
            g.launch(k::SAMPLE_ROWS, Grid::new((draw_rows.len(), 1, 1), 1024), (g.ptr(&rows_dev).reinterpret(), g.ptr(&params_dev), g.ptr(&out)))?;
            g.download(&out, draw_rows.len())?
        }
        .into_iter();
        let mut j = 0;
        let mut out = Vec::with_capacity(picks.len());
        for (row, (s, p)) in rows.iter().zip(picks) {
            out.push(match row {
                None => None,
                Some(_) => {
                    j += 1;
                    let id = match p.draw {
                        None => Some(greedy[j - 1]),
                        Some(_) => drawn.next().filter(|&id| id != u32::MAX),
                    };
                    id.filter(|_| still_current(s))
                }
            });
        }
        Ok(out)
    }

    /// The address of `state`'s last logits where a step on this GPU left them in GPU memory,
    /// at least `n` of them. A batch's rows may come from another engine on this GPU (the
    /// prefill engine beside a decode engine): its step has finished (it brought its greedy
    /// picks back), and the buffer lives as long as the state holds it.
    fn logits_row(&self, state: &GpuState, n: usize) -> Option<u64> {
        let g = &self.gpu;
        let here = g.stream.context().cu_ctx();
        match &state.last {
            LastLogits::InBatch { logits, written, step, row, vocab, stream, .. } if stream.context().cu_ctx() == here && written.load(Ordering::Acquire) == *step && n <= *vocab => Some(g.ptr(&**logits).offset(row * vocab).addr()),
            LastLogits::InStep { .. } => match &state.step {
                Some(step) if Arc::ptr_eq(&step.stream, &g.stream) && n <= step.ws.logits.len() => Some(g.ptr(&*step.ws.logits).addr()),
                _ => None,
            },
            _ => None,
        }
    }

    /// The greedy pick of each of the first `rows` rows of `ws.logits` into `ws.pick`.
    fn enqueue_argmax(&self, ws: &Workspace, rows: usize) -> Result<()> {
        let g = &self.gpu;
        let args = (g.ptr(&ws.logits), self.config.vocab_size as i32, g.ptr(&ws.pick_v), g.ptr(&ws.pick_i), g.ptr(&ws.pick_done), g.ptr(&ws.pick));
        g.launch(k::ARGMAX_ROWS, Grid::new((ARGMAX_SPANS, rows, 1), 256), args)
    }
}

/// Whether a state's last logits on the GPU are still its own: a row that a later step may
/// have overwritten while it was read (another engine's reused buffer) counts as not picked,
/// and the host then refuses it with the reason.
fn still_current(s: &GpuState) -> bool {
    !matches!(&s.last, LastLogits::InBatch { written, step, .. } if written.load(Ordering::Acquire) != *step)
}
