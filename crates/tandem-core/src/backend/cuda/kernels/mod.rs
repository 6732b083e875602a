//! tandem's CUDA kernels: the sources (split by family, joined into one program for NVRTC) and
//! each kernel's parameter list as Rust launches it (`Kernel`; see launch.rs). The parameter
//! names in the comments are the kernels' own.

use super::launch::{DevPtr, Kernel, Params, StateValues};

/// The kernel sources, in the order they are joined into one NVRTC program: each file may use
/// what the files before it define. (tests/cuda_on_cpu.rs joins the same list.)
pub const SOURCES: [(&str, &str); 8] = [
    ("common.cuh", include_str!("common.cuh")),
    ("norm.cu", include_str!("norm.cu")),
    ("blocks.cu", include_str!("blocks.cu")),
    ("gemv.cu", include_str!("gemv.cu")),
    ("gemm.cu", include_str!("gemm.cu")),
    ("deltanet.cu", include_str!("deltanet.cu")),
    ("attention.cu", include_str!("attention.cu")),
    ("sample.cu", include_str!("sample.cu")),
];

/// The one source NVRTC compiles: `SOURCES`, joined.
pub fn source() -> String {
    SOURCES.iter().map(|(_, text)| *text).collect::<Vec<_>>().join("\n")
}

type F32 = DevPtr<f32>;
type Bf16 = DevPtr<u16>;
type U32 = DevPtr<u32>;
type U8 = DevPtr<u8>;
/// A table of f32 arrays: a batched step's per-sequence states, or K/V block tables
/// (kernels/attention.cu, the paged cache).
type Table = DevPtr<DevPtr<f32>>;
/// A recurrent state (f32, or bf16 in the *_BF16_STATE builds), and a table of them.
type State = DevPtr<StateValues>;
type States = DevPtr<DevPtr<StateValues>>;

/// gemv.cu gemv_t1_* / gemv_t2_* / gemv_t4_* / gemv_t8_*: up to four matrices `(w, out, rows)` of one input, then
/// (x, x2, rms_inv, k, t, rows_per_block, accumulate, eps, round_in).
pub type GemvParams = (Bf16, F32, i32, Bf16, F32, i32, Bf16, F32, i32, Bf16, F32, i32, F32, F32, F32, i32, i32, i32, i32, f32, i32);
/// gemv.cu gemv_<format>_t*_*: as `GemvParams`, the matrices rows of blocks (blocks.cu).
pub type GemvBlocksParams = (U8, F32, i32, U8, F32, i32, U8, F32, i32, U8, F32, i32, F32, F32, F32, i32, i32, i32, i32, f32, i32);
/// blocks.cu dequantize_rows_*: (w, out, out_bf16, n, k): into f32, or bf16 where not null.
pub type DequantizeRowsParams = (U8, F32, Bf16, i32, i32);
/// blocks.cu embed_blocks_*: (table, ids, x, h).
pub type EmbedBlocksParams = (U8, U32, F32, i32);
/// gemv.cu gemv_stream_*: as `GemvParams` without t and rows_per_block.
pub type GemvStreamParams = (Bf16, F32, i32, Bf16, F32, i32, Bf16, F32, i32, Bf16, F32, i32, F32, F32, F32, i32, i32, f32, i32);
/// deltanet.cu conv_silu_rows_*: (conv, qkv, taps, out, t, cd, kk, qk_channels, dk, q_scale).
pub type ConvRowsParams = (F32, F32, F32, F32, i32, i32, i32, i32, i32, f32);
/// deltanet.cu deltanet_step_*: (conv, state, qkv, z, b, a, taps, neg_a, dt_bias, norm_w, core,
/// block_ss, done, t, hk, hv, dv, cd, kk, eps).
pub type DeltaNetStepParams = (F32, State, F32, F32, F32, F32, F32, F32, F32, F32, F32, F32, U32, i32, i32, i32, i32, i32, i32, f32);
/// deltanet.cu deltanet_step_batch_*: (convs, states, qkv, z, b, a, taps, neg_a, dt_bias,
/// norm_w, core, block_ss, done, hk, hv, dv, cd, in_row, kk, eps): qkv, z, b and a the first row
/// of each in one matrix of the sequences' projections, rows of `in_row` values.
pub type DeltaNetStepBatchParams = (Table, States, F32, F32, F32, F32, F32, F32, F32, F32, F32, F32, U32, i32, i32, i32, i32, i32, i32, f32);
/// deltanet.cu deltanet_step_heads_*: (convs, states, qkv, z, b, a, taps, neg_a, dt_bias, norm_w,
/// core, done, hk, hv, dv, cd, in_row, kk, eps), the projections as deltanet_step_batch's.
pub type DeltaNetStepHeadsParams = (Table, States, F32, F32, F32, F32, F32, F32, F32, F32, F32, U32, i32, i32, i32, i32, i32, i32, f32);
/// deltanet.cu deltanet_chunk_state*: (state, mixed, gcum, U, W, P, core, t, hk, hv, dk, dv, cd).
pub type ChunkStateParams = (State, F32, F32, F32, F32, F32, F32, i32, i32, i32, i32, i32, i32);
/// deltanet.cu conv_silu_rows_packed_*: (convs, seqs, qkv, taps, out, cd, kk, qk_channels, dk,
/// q_scale); `seqs` (first row, rows, first chunk, first gathered K/V row) per sequence of a
/// packed prefill (common.cuh: PackedSeq).
pub type ConvRowsPackedParams = (Table, U32, F32, F32, F32, i32, i32, i32, i32, f32);
/// deltanet.cu deltanet_chunk_state_packed*: (states, seqs, mixed, gcum, U, W, P, core, hk, hv,
/// dk, dv, cd).
pub type ChunkStatePackedParams = (States, U32, F32, F32, F32, F32, F32, F32, i32, i32, i32, i32, i32);
/// deltanet.cu deltanet_chunk_state_mma_*: (state, gcum, U, W_bf16, Q_bf16, K_bf16, P_bf16, core, t,
/// hv, dk, dv): the operands from deltanet_chunk_prep's bf16 outputs.
pub type ChunkStateMmaParams = (State, F32, F32, Bf16, Bf16, Bf16, Bf16, F32, i32, i32, i32, i32);
/// deltanet.cu deltanet_chunk_state_mma_packed_*: (states, seqs, gcum, U, W_bf16, Q_bf16, K_bf16,
/// P_bf16, core, hv, dk, dv).
pub type ChunkStateMmaPackedParams = (States, U32, F32, F32, Bf16, Bf16, Bf16, Bf16, F32, i32, i32, i32);

/// Tokens per chunk of the chunked delta rule (deltanet.cu CHUNK, cpu kernels/deltanet.rs CHUNK).
pub const DELTANET_CHUNK: usize = 64;

/// The tensor-core state walks' dynamic shared memory in bytes for key heads of `dk` channels
/// (deltanet.cu CHUNK_STATE_MMA_SHARED): a chunk's W, q and k rows, the state's bf16 copy (16
/// columns), P and V' (16 columns), bf16 rows padded by 8.
pub fn chunk_state_mma_shared(dk: usize) -> usize {
    const PAD: usize = 8;
    2 * ((3 * DELTANET_CHUNK + 16) * (dk + PAD) + (DELTANET_CHUNK + 16) * (DELTANET_CHUNK + PAD))
}
/// attention.cu attention_mma_*: (q, k_bf16, v_bf16, gate, out, t, hq, hkv, pos).
pub type AttentionMmaParams = (F32, Bf16, Bf16, F32, F32, i32, i32, i32, U32);
/// attention.cu attention_mma_packed_*: (q, k_bf16, v_bf16, gate, out, hq, hkv, pos, seqs).
pub type AttentionMmaPackedParams = (F32, Bf16, Bf16, F32, F32, i32, i32, U32, U32);

macro_rules! kernels {
    ($($(#[$doc:meta])* $konst:ident = $name:literal as $params:ty;)*) => {
        $($(#[$doc])* pub const $konst: Kernel<$params> = Kernel::new($name);)*
        /// Every kernel: its name and its parameter types as C++ spells them.
        pub const ALL: &[(&str, &[&str])] = &[$(($name, <$params as Params>::C_TYPES)),*];
    };
}

kernels! {
    /// (table, ids, x, h): row `ids[i]` of the bf16 table into x's row i.
    EMBED = "embed" as (Bf16, U32, F32, i32);
    /// (x, scale, out, out_bf16, d, eps): one row per block; out_bf16 where not null, else out.
    RMS_NORM = "rms_norm" as (F32, F32, F32, Bf16, i32, f32);
    /// (x, inv, d, eps): 1 / rms of each row.
    RMS_INV = "rms_inv" as (F32, F32, i32, f32);
    /// (gate, up, out_bf16, n): silu(gate) * up into gate, or into out_bf16 where not null.
    SWIGLU = "swiglu" as (F32, F32, Bf16, i32);
    /// (gate, up, out, n), all bf16.
    SWIGLU_BF16 = "swiglu_bf16" as (Bf16, Bf16, Bf16, i32, i32, i32);
    /// (x, y, n): f32 rounded to bf16.
    TO_BF16 = "to_bf16" as (F32, Bf16, i32);
    GEMV_T1_PLAIN = "gemv_t1_plain" as GemvParams;
    GEMV_T1_NORM = "gemv_t1_norm" as GemvParams;
    GEMV_T1_GLU = "gemv_t1_glu" as GemvParams;
    GEMV_T2_PLAIN = "gemv_t2_plain" as GemvParams;
    GEMV_T2_NORM = "gemv_t2_norm" as GemvParams;
    GEMV_T2_GLU = "gemv_t2_glu" as GemvParams;
    GEMV_T4_PLAIN = "gemv_t4_plain" as GemvParams;
    GEMV_T4_NORM = "gemv_t4_norm" as GemvParams;
    GEMV_T4_GLU = "gemv_t4_glu" as GemvParams;
    GEMV_T8_PLAIN = "gemv_t8_plain" as GemvParams;
    GEMV_T8_NORM = "gemv_t8_norm" as GemvParams;
    GEMV_T8_GLU = "gemv_t8_glu" as GemvParams;
    /// (x, scale, k, eps, round_in, q, sums): a block GEMV's inputs as 16-bit integers, their
    /// sums of 8 and scale (blocks.cu); normalised where scale is not null.
    BLOCK_INPUT = "block_input" as (F32, F32, i32, f32, i32, i32, U32, U32);
    DEQUANTIZE_ROWS_Q4_0 = "dequantize_rows_q4_0" as DequantizeRowsParams;
    EMBED_BLOCKS_Q4_0 = "embed_blocks_q4_0" as EmbedBlocksParams;
    GEMV_Q4_0_T1_PLAIN = "gemv_q4_0_t1_plain" as GemvBlocksParams;
    GEMV_Q4_0_T1_GLU = "gemv_q4_0_t1_glu" as GemvBlocksParams;
    GEMV_Q4_0_T2_PLAIN = "gemv_q4_0_t2_plain" as GemvBlocksParams;
    GEMV_Q4_0_T2_GLU = "gemv_q4_0_t2_glu" as GemvBlocksParams;
    GEMV_Q4_0_T4_PLAIN = "gemv_q4_0_t4_plain" as GemvBlocksParams;
    GEMV_Q4_0_T4_GLU = "gemv_q4_0_t4_glu" as GemvBlocksParams;
    GEMV_Q4_0_T8_PLAIN = "gemv_q4_0_t8_plain" as GemvBlocksParams;
    GEMV_Q4_0_T8_GLU = "gemv_q4_0_t8_glu" as GemvBlocksParams;
    DEQUANTIZE_ROWS_Q8_0 = "dequantize_rows_q8_0" as DequantizeRowsParams;
    EMBED_BLOCKS_Q8_0 = "embed_blocks_q8_0" as EmbedBlocksParams;
    GEMV_Q8_0_T1_PLAIN = "gemv_q8_0_t1_plain" as GemvBlocksParams;
    GEMV_Q8_0_T1_GLU = "gemv_q8_0_t1_glu" as GemvBlocksParams;
    GEMV_Q8_0_T2_PLAIN = "gemv_q8_0_t2_plain" as GemvBlocksParams;
    GEMV_Q8_0_T2_GLU = "gemv_q8_0_t2_glu" as GemvBlocksParams;
    GEMV_Q8_0_T4_PLAIN = "gemv_q8_0_t4_plain" as GemvBlocksParams;
    GEMV_Q8_0_T4_GLU = "gemv_q8_0_t4_glu" as GemvBlocksParams;
    GEMV_Q8_0_T8_PLAIN = "gemv_q8_0_t8_plain" as GemvBlocksParams;
    GEMV_Q8_0_T8_GLU = "gemv_q8_0_t8_glu" as GemvBlocksParams;
    DEQUANTIZE_ROWS_Q4_K = "dequantize_rows_q4_k" as DequantizeRowsParams;
    EMBED_BLOCKS_Q4_K = "embed_blocks_q4_k" as EmbedBlocksParams;
    GEMV_Q4_K_T1_PLAIN = "gemv_q4_k_t1_plain" as GemvBlocksParams;
    GEMV_Q4_K_T1_GLU = "gemv_q4_k_t1_glu" as GemvBlocksParams;
    GEMV_Q4_K_T2_PLAIN = "gemv_q4_k_t2_plain" as GemvBlocksParams;
    GEMV_Q4_K_T2_GLU = "gemv_q4_k_t2_glu" as GemvBlocksParams;
    GEMV_Q4_K_T4_PLAIN = "gemv_q4_k_t4_plain" as GemvBlocksParams;
    GEMV_Q4_K_T4_GLU = "gemv_q4_k_t4_glu" as GemvBlocksParams;
    GEMV_Q4_K_T8_PLAIN = "gemv_q4_k_t8_plain" as GemvBlocksParams;
    GEMV_Q4_K_T8_GLU = "gemv_q4_k_t8_glu" as GemvBlocksParams;
    DEQUANTIZE_ROWS_Q5_K = "dequantize_rows_q5_k" as DequantizeRowsParams;
    EMBED_BLOCKS_Q5_K = "embed_blocks_q5_k" as EmbedBlocksParams;
    GEMV_Q5_K_T1_PLAIN = "gemv_q5_k_t1_plain" as GemvBlocksParams;
    GEMV_Q5_K_T1_GLU = "gemv_q5_k_t1_glu" as GemvBlocksParams;
    GEMV_Q5_K_T2_PLAIN = "gemv_q5_k_t2_plain" as GemvBlocksParams;
    GEMV_Q5_K_T2_GLU = "gemv_q5_k_t2_glu" as GemvBlocksParams;
    GEMV_Q5_K_T4_PLAIN = "gemv_q5_k_t4_plain" as GemvBlocksParams;
    GEMV_Q5_K_T4_GLU = "gemv_q5_k_t4_glu" as GemvBlocksParams;
    GEMV_Q5_K_T8_PLAIN = "gemv_q5_k_t8_plain" as GemvBlocksParams;
    GEMV_Q5_K_T8_GLU = "gemv_q5_k_t8_glu" as GemvBlocksParams;
    DEQUANTIZE_ROWS_Q6_K = "dequantize_rows_q6_k" as DequantizeRowsParams;
    EMBED_BLOCKS_Q6_K = "embed_blocks_q6_k" as EmbedBlocksParams;
    GEMV_Q6_K_T1_PLAIN = "gemv_q6_k_t1_plain" as GemvBlocksParams;
    GEMV_Q6_K_T1_GLU = "gemv_q6_k_t1_glu" as GemvBlocksParams;
    GEMV_Q6_K_T2_PLAIN = "gemv_q6_k_t2_plain" as GemvBlocksParams;
    GEMV_Q6_K_T2_GLU = "gemv_q6_k_t2_glu" as GemvBlocksParams;
    GEMV_Q6_K_T4_PLAIN = "gemv_q6_k_t4_plain" as GemvBlocksParams;
    GEMV_Q6_K_T4_GLU = "gemv_q6_k_t4_glu" as GemvBlocksParams;
    GEMV_Q6_K_T8_PLAIN = "gemv_q6_k_t8_plain" as GemvBlocksParams;
    GEMV_Q6_K_T8_GLU = "gemv_q6_k_t8_glu" as GemvBlocksParams;
    /// (x, scale, k, eps, round_in, format, q, sums): a k-quant GEMV's inputs as int8 per 256
    /// values (precision=fast), their sums and scales (blocks.cu); normalised where scale is not null.
    BLOCK_INPUT8 = "block_input8" as (F32, F32, i32, f32, i32, i32, U8, U32);
    GEMV_Q4_K_A8_T1_PLAIN = "gemv_q4_k_a8_t1_plain" as GemvBlocksParams;
    GEMV_Q4_K_A8_T1_GLU = "gemv_q4_k_a8_t1_glu" as GemvBlocksParams;
    GEMV_Q4_K_A8_T2_PLAIN = "gemv_q4_k_a8_t2_plain" as GemvBlocksParams;
    GEMV_Q4_K_A8_T2_GLU = "gemv_q4_k_a8_t2_glu" as GemvBlocksParams;
    GEMV_Q4_K_A8_T4_PLAIN = "gemv_q4_k_a8_t4_plain" as GemvBlocksParams;
    GEMV_Q4_K_A8_T4_GLU = "gemv_q4_k_a8_t4_glu" as GemvBlocksParams;
    GEMV_Q4_K_A8_T8_PLAIN = "gemv_q4_k_a8_t8_plain" as GemvBlocksParams;
    GEMV_Q4_K_A8_T8_GLU = "gemv_q4_k_a8_t8_glu" as GemvBlocksParams;
    GEMV_Q5_K_A8_T1_PLAIN = "gemv_q5_k_a8_t1_plain" as GemvBlocksParams;
    GEMV_Q5_K_A8_T1_GLU = "gemv_q5_k_a8_t1_glu" as GemvBlocksParams;
    GEMV_Q5_K_A8_T2_PLAIN = "gemv_q5_k_a8_t2_plain" as GemvBlocksParams;
    GEMV_Q5_K_A8_T2_GLU = "gemv_q5_k_a8_t2_glu" as GemvBlocksParams;
    GEMV_Q5_K_A8_T4_PLAIN = "gemv_q5_k_a8_t4_plain" as GemvBlocksParams;
    GEMV_Q5_K_A8_T4_GLU = "gemv_q5_k_a8_t4_glu" as GemvBlocksParams;
    GEMV_Q5_K_A8_T8_PLAIN = "gemv_q5_k_a8_t8_plain" as GemvBlocksParams;
    GEMV_Q5_K_A8_T8_GLU = "gemv_q5_k_a8_t8_glu" as GemvBlocksParams;
    GEMV_Q6_K_A8_T1_PLAIN = "gemv_q6_k_a8_t1_plain" as GemvBlocksParams;
    GEMV_Q6_K_A8_T1_GLU = "gemv_q6_k_a8_t1_glu" as GemvBlocksParams;
    GEMV_Q6_K_A8_T2_PLAIN = "gemv_q6_k_a8_t2_plain" as GemvBlocksParams;
    GEMV_Q6_K_A8_T2_GLU = "gemv_q6_k_a8_t2_glu" as GemvBlocksParams;
    GEMV_Q6_K_A8_T4_PLAIN = "gemv_q6_k_a8_t4_plain" as GemvBlocksParams;
    GEMV_Q6_K_A8_T4_GLU = "gemv_q6_k_a8_t4_glu" as GemvBlocksParams;
    GEMV_Q6_K_A8_T8_PLAIN = "gemv_q6_k_a8_t8_plain" as GemvBlocksParams;
    GEMV_Q6_K_A8_T8_GLU = "gemv_q6_k_a8_t8_glu" as GemvBlocksParams;
    GEMV_STREAM_PLAIN = "gemv_stream_plain" as GemvStreamParams;
    GEMV_STREAM_NORM = "gemv_stream_norm" as GemvStreamParams;
    GEMV_STREAM_GLU = "gemv_stream_glu" as GemvStreamParams;
    /// (w, x, out, n, k, t, accumulate): the exact prefill GEMM, f32 sums.
    GEMM_BF16_F32 = "gemm_bf16_f32" as (Bf16, F32, F32, i32, i32, i32, i32);
    /// (w, x, out, n, k, t, accumulate): the same of f32 weights (a block format's, dequantized).
    GEMM_F32_F32 = "gemm_f32_f32" as (F32, F32, F32, i32, i32, i32, i32);
    CONV_SILU_ROWS_4 = "conv_silu_rows_4" as ConvRowsParams;
    CONV_SILU_ROWS_8 = "conv_silu_rows_8" as ConvRowsParams;
    /// (conv, qkv, t, cd, kk): the conv window after a prefill.
    CONV_STATE_TAIL = "conv_state_tail" as (F32, F32, i32, i32, i32);
    CONV_SILU_ROWS_PACKED_4 = "conv_silu_rows_packed_4" as ConvRowsPackedParams;
    CONV_SILU_ROWS_PACKED_8 = "conv_silu_rows_packed_8" as ConvRowsPackedParams;
    /// (convs, seqs, qkv, cd, kk): the conv windows after a packed prefill.
    CONV_STATE_TAIL_PACKED = "conv_state_tail_packed" as (Table, U32, F32, i32, i32);
    DELTANET_STEP_32 = "deltanet_step_32" as DeltaNetStepParams;
    DELTANET_STEP_64 = "deltanet_step_64" as DeltaNetStepParams;
    DELTANET_STEP_128 = "deltanet_step_128" as DeltaNetStepParams;
    DELTANET_STEP_BATCH_32 = "deltanet_step_batch_32" as DeltaNetStepBatchParams;
    DELTANET_STEP_BATCH_64 = "deltanet_step_batch_64" as DeltaNetStepBatchParams;
    DELTANET_STEP_BATCH_128 = "deltanet_step_batch_128" as DeltaNetStepBatchParams;
    DELTANET_STEP_32_BF16_STATE = "deltanet_step_32_bf16_state" as DeltaNetStepParams;
    DELTANET_STEP_64_BF16_STATE = "deltanet_step_64_bf16_state" as DeltaNetStepParams;
    DELTANET_STEP_128_BF16_STATE = "deltanet_step_128_bf16_state" as DeltaNetStepParams;
    DELTANET_STEP_BATCH_32_BF16_STATE = "deltanet_step_batch_32_bf16_state" as DeltaNetStepBatchParams;
    DELTANET_STEP_BATCH_64_BF16_STATE = "deltanet_step_batch_64_bf16_state" as DeltaNetStepBatchParams;
    DELTANET_STEP_BATCH_128_BF16_STATE = "deltanet_step_batch_128_bf16_state" as DeltaNetStepBatchParams;
    DELTANET_STEP_HEADS_32 = "deltanet_step_heads_32" as DeltaNetStepHeadsParams;
    DELTANET_STEP_HEADS_64 = "deltanet_step_heads_64" as DeltaNetStepHeadsParams;
    DELTANET_STEP_HEADS_128 = "deltanet_step_heads_128" as DeltaNetStepHeadsParams;
    DELTANET_STEP_HEADS_32_BF16_STATE = "deltanet_step_heads_32_bf16_state" as DeltaNetStepHeadsParams;
    DELTANET_STEP_HEADS_64_BF16_STATE = "deltanet_step_heads_64_bf16_state" as DeltaNetStepHeadsParams;
    DELTANET_STEP_HEADS_128_BF16_STATE = "deltanet_step_heads_128_bf16_state" as DeltaNetStepHeadsParams;
    /// (mixed, b, a, neg_a, dt_bias, gcum, U, W, P, W_bf16, Q_bf16, K_bf16, t, hk, hv, dk, dv,
    /// cd): the bf16 operands of the tensor-core walk where not null.
    DELTANET_CHUNK_PREP = "deltanet_chunk_prep" as (F32, F32, F32, F32, F32, F32, F32, F32, F32, Bf16, Bf16, Bf16, Bf16, i32, i32, i32, i32, i32, i32);
    DELTANET_CHUNK_STATE = "deltanet_chunk_state" as ChunkStateParams;
    DELTANET_CHUNK_STATE_1 = "deltanet_chunk_state_1" as ChunkStateParams;
    DELTANET_CHUNK_STATE_MMA_32 = "deltanet_chunk_state_mma_32" as ChunkStateMmaParams;
    DELTANET_CHUNK_STATE_MMA_64 = "deltanet_chunk_state_mma_64" as ChunkStateMmaParams;
    DELTANET_CHUNK_STATE_MMA_128 = "deltanet_chunk_state_mma_128" as ChunkStateMmaParams;
    DELTANET_CHUNK_STATE_BF16_STATE = "deltanet_chunk_state_bf16_state" as ChunkStateParams;
    DELTANET_CHUNK_STATE_1_BF16_STATE = "deltanet_chunk_state_1_bf16_state" as ChunkStateParams;
    DELTANET_CHUNK_STATE_MMA_32_BF16_STATE = "deltanet_chunk_state_mma_32_bf16_state" as ChunkStateMmaParams;
    DELTANET_CHUNK_STATE_MMA_64_BF16_STATE = "deltanet_chunk_state_mma_64_bf16_state" as ChunkStateMmaParams;
    DELTANET_CHUNK_STATE_MMA_128_BF16_STATE = "deltanet_chunk_state_mma_128_bf16_state" as ChunkStateMmaParams;
    /// (seqs, mixed, b, a, neg_a, dt_bias, gcum, U, W, P, hk, hv, dk, dv, cd).
    DELTANET_CHUNK_PREP_PACKED = "deltanet_chunk_prep_packed" as (U32, F32, F32, F32, F32, F32, F32, F32, F32, F32, Bf16, Bf16, Bf16, Bf16, i32, i32, i32, i32, i32);
    DELTANET_CHUNK_STATE_PACKED = "deltanet_chunk_state_packed" as ChunkStatePackedParams;
    DELTANET_CHUNK_STATE_MMA_PACKED_32 = "deltanet_chunk_state_mma_packed_32" as ChunkStateMmaPackedParams;
    DELTANET_CHUNK_STATE_MMA_PACKED_64 = "deltanet_chunk_state_mma_packed_64" as ChunkStateMmaPackedParams;
    DELTANET_CHUNK_STATE_MMA_PACKED_128 = "deltanet_chunk_state_mma_packed_128" as ChunkStateMmaPackedParams;
    DELTANET_CHUNK_STATE_PACKED_BF16_STATE = "deltanet_chunk_state_packed_bf16_state" as ChunkStatePackedParams;
    DELTANET_CHUNK_STATE_MMA_PACKED_32_BF16_STATE = "deltanet_chunk_state_mma_packed_32_bf16_state" as ChunkStateMmaPackedParams;
    DELTANET_CHUNK_STATE_MMA_PACKED_64_BF16_STATE = "deltanet_chunk_state_mma_packed_64_bf16_state" as ChunkStateMmaPackedParams;
    DELTANET_CHUNK_STATE_MMA_PACKED_128_BF16_STATE = "deltanet_chunk_state_mma_packed_128_bf16_state" as ChunkStateMmaPackedParams;
    /// (core, z, w, out_bf16, rows, dv, eps): in place, or into out_bf16 where not null.
    GATED_RMS_NORM = "gated_rms_norm" as (F32, F32, F32, Bf16, i32, i32, f32);
    /// (qg, q, gate, k, v, blocks, koff, q_norm, k_norm, inv_freq, hq, hkv, d, half, pos, eps).
    QK_NORM_ROPE = "qk_norm_rope" as (F32, F32, F32, F32, F32, Table, i32, F32, F32, F32, i32, i32, i32, i32, U32, f32);
    /// (qg, q, gate, k, v, blocks, width, koff, q_norm, k_norm, inv_freq, hq, hkv, d, half, pos,
    /// eps): one row per sequence of a batched step.
    QK_NORM_ROPE_BATCH = "qk_norm_rope_batch" as (F32, F32, F32, F32, F32, Table, i32, i32, F32, F32, F32, i32, i32, i32, i32, U32, f32);
    /// (qg, q, gate, k, v, blocks, width, koff, q_norm, k_norm, inv_freq, hq, hkv, d, half, pos,
    /// seqs, eps): the rows of every sequence of a packed prefill.
    QK_NORM_ROPE_PACKED = "qk_norm_rope_packed" as (F32, F32, F32, F32, F32, Table, i32, i32, F32, F32, F32, i32, i32, i32, i32, U32, U32, f32);
    /// (q, blocks, koff, gate, out, part, done, hq, hkv, d, chunk, splits, pos): decode rows.
    ATTENTION = "attention" as (F32, Table, i32, F32, F32, F32, U32, i32, i32, i32, i32, i32, U32);
    /// (q, blocks, width, koff, gate, out, part, done, hq, hkv, d, chunk, splits, pos): one row
    /// per sequence of a batched step.
    ATTENTION_BATCH = "attention_batch" as (F32, Table, i32, i32, F32, F32, F32, U32, i32, i32, i32, i32, i32, U32);
    /// (blocks, koff, k_bf16, v_bf16, n, row): positions 0..n of a layer's cache in bf16.
    KV_TO_BF16 = "kv_to_bf16" as (Table, i32, Bf16, Bf16, i32, i32);
    /// (blocks, width, koff, k_bf16, v_bf16, row, pos, seqs): each sequence of a packed prefill's.
    KV_TO_BF16_PACKED = "kv_to_bf16_packed" as (Table, i32, i32, Bf16, Bf16, i32, U32, U32);
    /// (q, blocks, koff, gate, out, t, hq, hkv, d, pos): prefill rows, f32 tiles.
    ATTENTION_TILED = "attention_tiled" as (F32, Table, i32, F32, F32, i32, i32, i32, i32, U32);
    ATTENTION_MMA_32 = "attention_mma_32" as AttentionMmaParams;
    ATTENTION_MMA_64 = "attention_mma_64" as AttentionMmaParams;
    ATTENTION_MMA_128 = "attention_mma_128" as AttentionMmaParams;
    ATTENTION_MMA_256 = "attention_mma_256" as AttentionMmaParams;
    ATTENTION_MMA_PACKED_32 = "attention_mma_packed_32" as AttentionMmaPackedParams;
    ATTENTION_MMA_PACKED_64 = "attention_mma_packed_64" as AttentionMmaPackedParams;
    ATTENTION_MMA_PACKED_128 = "attention_mma_packed_128" as AttentionMmaPackedParams;
    ATTENTION_MMA_PACKED_256 = "attention_mma_packed_256" as AttentionMmaPackedParams;
    /// (logits, n, part_v, part_i, done, out): the greedy pick of each row.
    ARGMAX_ROWS = "argmax_rows" as (F32, i32, F32, U32, U32, U32);
    /// (rows, params, out): a draw from each row, params (n, inv_t, top_k, top_p, u, argmax) a row.
    SAMPLE_ROWS = "sample_rows" as (Table, DevPtr<f64>, U32);
    /// (rows, allowed, words, n, out): each row's first n logits masked by its `words` words of
    /// bits into out (n a row).
    MASK_ROWS = "mask_rows" as (Table, U32, i32, i32, F32);
}
