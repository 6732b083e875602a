//! The layers on the GPU, each enqueued on the engine's stream: norms, projections, the
//! DeltaNet mixer, attention and the MLP. A block's paths are named methods: decode-sized rows
//! take the GEMV (`*_gemv`, `deltanet_step`, `attention_decode`), prefill rows the tensor cores
//! or the exact f32 kernels (`*_tensor_cores`, `*_exact`, `deltanet_chunked`,
//! `attention_prefill`).

use super::*;

/// Where `rms_norm` writes: f32 rows, or rows rounded to bf16 (a tensor-core GEMM's operand).
#[derive(Clone, Copy)]
pub(super) enum NormOut {
    F32(DevPtr<f32>),
    Bf16(DevPtr<u16>),
}

/// The input of a prefill GEMM (`gemm_input`): f32 rows for the exact kernel, bf16 rows for
/// the tensor cores.
#[derive(Clone, Copy)]
pub(super) enum GemmInput {
    F32(DevPtr<f32>),
    Bf16(DevPtr<u16>),
}

/// Whether deltanet_step_heads_* takes this model's value heads: built for square heads (dk = dv)
/// of 32, 64 or 128, whole key heads of value heads, and conv windows of up to 4 taps.
pub(super) fn step_heads_fit(c: &Qwen35Config) -> bool {
    let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
    dk == dv && matches!(dk, 32 | 64 | 128) && c.linear_num_value_heads.is_multiple_of(c.linear_num_key_heads) && c.linear_conv_kernel_dim <= 4
}

impl GpuQwen35 {
    /// `rms_norm(x[rows, d]) * w` into `out`.
    pub(super) fn rms_norm(&self, x: DevPtr<f32>, w: DevPtr<f32>, out: NormOut, rows: usize, d: usize) -> Result<()> {
        // Sixteen values a thread (kept in registers between the sum and the scaling), up to
        // 1024 threads: a row is one block. Rows of up to 4096 on 256 threads, whose 1/rms is
        // the GEMVs' to the bit (kernels/common.cuh thread_squares).
        let threads = if d.is_multiple_of(4) && d <= 16 * 256 { 256 } else { d.div_ceil(16).next_multiple_of(32).clamp(32, 1024) };
        let (out, out_bf16) = match out {
            NormOut::F32(p) => (p, DevPtr::NULL),
            NormOut::Bf16(p) => (DevPtr::NULL, p),
        };
        self.gpu.launch(k::RMS_NORM, Grid::x(rows, threads), (x, w, out, out_bf16, d as i32, self.config.rms_norm_eps))
    }

    /// `out[t, n] = x[t, k] · W[n, k]ᵀ`: the GEMV for decode-sized t, else a prefill GEMM.
    pub(super) fn matmul(&self, ws: &Workspace, x: DevPtr<f32>, t: usize, w: MatrixRows, out: DevPtr<f32>) -> Result<()> {
        if ws.takes_gemv(t) {
            return self.gemv(ws, GemvInput::Plain, &[(w, out)], x, w.cols, t, GemvOut::Write);
        }
        let input = self.gemm_input(ws, x, t, w.cols)?;
        self.gemm(input, t, w, out, false)
    }

    /// The input of prefill GEMMs from `x[t, k]` (f32): as it is for the exact kernel; for
    /// tensor cores rounded to bf16 into `ws.xb` (once for all the products of that input).
    pub(super) fn gemm_input(&self, ws: &Workspace, x: DevPtr<f32>, t: usize, k: usize) -> Result<GemmInput> {
        if self.precision == Precision::Exact {
            return Ok(GemmInput::F32(x));
        }
        let g = &self.gpu;
        let xb = g.ptr(&ws.xb);
        g.launch(k::TO_BF16, Grid::x((t * k).div_ceil(1024), 256), (x, xb, (t * k) as i32))?;
        Ok(GemmInput::Bf16(xb))
    }

    /// `out[t, n] (+)= input[t, k] · W[n, k]ᵀ` for prefill: the exact f32 kernel or cuBLAS on
    /// tensor cores, as the input is.
    pub(super) fn gemm(&self, input: GemmInput, t: usize, w: MatrixRows, out: DevPtr<f32>, accumulate: bool) -> Result<()> {
        let g = &self.gpu;
        let (n, k) = (w.rows, w.cols);
        let grid = Grid::new((n.div_ceil(64), t.div_ceil(64), 1), 256);
        match (input, self.dequantized_weights(w, &input)?) {
            (GemmInput::F32(x), None) => g.launch(k::GEMM_BF16_F32, grid, (w.w, x, out, n as i32, k as i32, t as i32, accumulate as i32)),
            (GemmInput::F32(x), Some(wf)) => g.launch(k::GEMM_F32_F32, grid, (wf, x, out, n as i32, k as i32, t as i32, accumulate as i32)),
            (GemmInput::Bf16(xb), wf) => g.gemm_bf16(xb, t, wf.map_or(w.w, |p| p.reinterpret()), n, k, if accumulate { GemmOut::F32Add(out) } else { GemmOut::F32(out) }),
        }
    }

    /// A block-format matrix's weights dequantized for a GEMM (None: bf16, taken as it is):
    /// in f32 for the exact kernel, rounded to bf16 for cuBLAS (the inputs are rounded the same
    /// way), into the engine's `dequantized` buffer.
    fn dequantized_weights(&self, w: MatrixRows, input: &GemmInput) -> Result<Option<DevPtr<f32>>> {
        let Some(f) = w.format else { return Ok(None) };
        let g = &self.gpu;
        let out = g.ptr(&self.dequantized);
        let (f32_out, bf16_out) = match input {
            GemmInput::F32(_) => (out, DevPtr::NULL),
            GemmInput::Bf16(_) => (DevPtr::NULL, out.reinterpret::<u16>()),
        };
        g.launch(blocks::dequantize_kernel(f), Grid::x(w.rows, 256), (w.w.reinterpret::<u8>(), f32_out, bf16_out, w.rows as i32, w.cols as i32))?;
        Ok(Some(out))
    }

    /// Several products of the RMS-normalised input `rms_norm(x[t, k]) * norm`: for decode-sized
    /// t one GEMV for all of them (it normalises as it reads), else the norm into `ws.xn` (or,
    /// for tensor cores, in bf16 into `ws.xb`) and a GEMM each.
    pub(super) fn project(&self, ws: &Workspace, x: DevPtr<f32>, norm: &CudaSlice<f32>, t: usize, mats: &[(MatrixRows, DevPtr<f32>)]) -> Result<()> {
        let g = &self.gpu;
        let k = mats[0].0.cols;
        debug_assert!(mats.iter().all(|(m, _)| m.cols == k));
        if ws.takes_gemv(t) && mats.len() <= 4 {
            return self.gemv(ws, GemvInput::Norm(g.ptr(norm)), mats, x, k, t, GemvOut::Write);
        }
        let input = match self.precision {
            Precision::Exact => {
                let xn = g.ptr(&ws.xn);
                self.rms_norm(x, g.ptr(norm), NormOut::F32(xn), t, k)?;
                GemmInput::F32(xn)
            }
            Precision::TensorCores | Precision::Fast => {
                let xb = g.ptr(&ws.xb);
                self.rms_norm(x, g.ptr(norm), NormOut::Bf16(xb), t, k)?;
                GemmInput::Bf16(xb)
            }
        };
        mats.iter().try_for_each(|&(m, out)| self.gemm(input, t, m, out, false))
    }

    /// `x += input · Wᵀ`: a block's output added to the residual stream (by the GEMV or GEMM
    /// itself).
    pub(super) fn project_residual(&self, ws: &Workspace, input: Input, t: usize, m: &GpuMatrix) -> Result<()> {
        let g = &self.gpu;
        let x = g.ptr(&ws.x);
        let input = match input {
            Input::Bf16Ready => return self.gemm(GemmInput::Bf16(g.ptr(&ws.xb)), t, m.all(g), x, true),
            Input::F32(input) => input,
        };
        if ws.takes_gemv(t) {
            return self.gemv(ws, GemvInput::Plain, &[(m.all(g), x)], input, m.cols, t, GemvOut::Add);
        }
        let input = self.gemm_input(ws, input, t, m.cols)?;
        self.gemm(input, t, m.all(g), x, true)
    }

    /// The DeltaNet block: the input projections for all rows, then per sequence the mixer on
    /// its own state (`deltanet_step` for decode-sized rows, `deltanet_chunked` for a prefill),
    /// then the output projection into the residual stream.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn deltanet(&self, m: &DeltaNet, norm: &CudaSlice<f32>, ws: &Workspace, t: usize, states: &mut [&mut GpuState], rows: &[Rows], li: usize) -> Result<()> {
        let g = &self.gpu;
        let x = g.ptr(&ws.x);
        if ws.batched {
            // The four projections in one product, each sequence's row of the four together.
            self.project(ws, x, norm, t, &[(m.in_proj.all(g), g.ptr(&ws.in_proj))])?;
            self.deltanet_step_batch(m, ws, li, ws.sequences)?;
            return self.project_residual(ws, Input::F32(g.ptr(&ws.core)), t, &m.out_proj);
        }
        let [qkv, z, b, a] = m.in_projs(g, &self.config);
        self.project(ws, x, norm, t, &[(qkv, g.ptr(&ws.qkv)), (z, g.ptr(&ws.z)), (b, g.ptr(&ws.beta)), (a, g.ptr(&ws.alpha))])?;
        // Where every sequence takes the prefill path and the out projection is a tensor-core
        // GEMM, the gated norm writes that GEMM's bf16 operand itself.
        let norm_to_bf16 = t > GEMV_MAX_T && self.precision.tensor_cores() && rows.iter().all(|r| r.count > GEMV_MAX_T);
        if ws.packed {
            self.deltanet_chunked_packed(m, ws, li, rows, norm_to_bf16)?;
            let input = if norm_to_bf16 { Input::Bf16Ready } else { Input::F32(g.ptr(&ws.core)) };
            return self.project_residual(ws, input, t, &m.out_proj);
        }
        for (s, &r) in states.iter_mut().zip(rows) {
            let &GpuLayerState::Linear { conv, recurrent } = &s.layers[li] else { bail!("layer {li}: state kind differs from the model's") };
            if r.count <= GEMV_MAX_T {
                self.deltanet_step(m, ws, r, conv, recurrent)?;
            } else {
                self.deltanet_chunked(m, ws, r, conv, recurrent, norm_to_bf16)?;
            }
        }
        let input = if norm_to_bf16 { Input::Bf16Ready } else { Input::F32(g.ptr(&ws.core)) };
        self.project_residual(ws, input, t, &m.out_proj)
    }

    /// One sequence's decode-sized rows through the mixer in one launch: the conv, the q/k
    /// norms, the delta rule token after token and the gated norm (kernels/deltanet.cu
    /// deltanet_step_*).
    fn deltanet_step(&self, m: &DeltaNet, ws: &Workspace, r: Rows, conv: DevPtr<f32>, recurrent: DevPtr<StateValues>) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (hk, hv, dk, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (vd, cd) = (c.linear_value_dim(), c.linear_conv_dim());
        let kernel = match (dk, self.state_dtype()) {
            (32, StateDtype::F32) => k::DELTANET_STEP_32,
            (64, StateDtype::F32) => k::DELTANET_STEP_64,
            (_, StateDtype::F32) => k::DELTANET_STEP_128,
            (32, StateDtype::Bf16) => k::DELTANET_STEP_32_BF16_STATE,
            (64, StateDtype::Bf16) => k::DELTANET_STEP_64_BF16_STATE,
            (_, StateDtype::Bf16) => k::DELTANET_STEP_128_BF16_STATE,
        };
        let args = (
            conv,
            recurrent,
            g.ptr(&ws.qkv).offset(r.first * cd),
            g.ptr(&ws.z).offset(r.first * vd),
            g.ptr(&ws.beta).offset(r.first * hv),
            g.ptr(&ws.alpha).offset(r.first * hv),
            g.ptr(&m.conv_taps),
            g.ptr(&m.neg_a),
            g.ptr(&m.dt_bias),
            g.ptr(&m.norm),
            g.ptr(&ws.core).offset(r.first * vd),
            g.ptr(&ws.step_ss),
            g.ptr(&ws.step_done),
            r.count as i32,
            hk as i32,
            hv as i32,
            dv as i32,
            cd as i32,
            c.linear_conv_kernel_dim as i32,
            c.rms_norm_eps,
        );
        g.launch(kernel, Grid::x(hv * dv / 32, 512), args)
    }

    /// One token of each of `n` sequences through the mixer in one launch (kernels/deltanet.cu
    /// deltanet_step_batch_*: what `deltanet_step` does for each alone; from `step_heads_from`
    /// sequences deltanet_step_heads_*, the same with a block per value head), their conv
    /// windows and states from the workspace's tables.
    fn deltanet_step_batch(&self, m: &DeltaNet, ws: &Workspace, li: usize, n: usize) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (hk, hv, dk, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (convs, recurrents) = ws.layer_tables(g, li, n);
        // Each sequence's projections: a row of `in_proj`'s product, qkv then z, b and a.
        let starts = DeltaNet::in_proj_starts(c);
        let row = g.ptr(&ws.in_proj);
        let (qkv, z, beta, alpha) = (row, row.offset(starts[1]), row.offset(starts[2]), row.offset(starts[3]));
        let (core, done) = (g.ptr(&ws.core), g.ptr(&ws.step_done));
        let (taps, neg_a, dt_bias, norm) = (g.ptr(&m.conv_taps), g.ptr(&m.neg_a), g.ptr(&m.dt_bias), g.ptr(&m.norm));
        let shape = (hk as i32, hv as i32, dv as i32, c.linear_conv_dim() as i32, starts[4] as i32, c.linear_conv_kernel_dim as i32, c.rms_norm_eps);
        if n >= self.step_heads_from() && step_heads_fit(c) {
            let kernel = match (dk, self.state_dtype()) {
                (32, StateDtype::F32) => k::DELTANET_STEP_HEADS_32,
                (64, StateDtype::F32) => k::DELTANET_STEP_HEADS_64,
                (_, StateDtype::F32) => k::DELTANET_STEP_HEADS_128,
                (32, StateDtype::Bf16) => k::DELTANET_STEP_HEADS_32_BF16_STATE,
                (64, StateDtype::Bf16) => k::DELTANET_STEP_HEADS_64_BF16_STATE,
                (_, StateDtype::Bf16) => k::DELTANET_STEP_HEADS_128_BF16_STATE,
            };
            let args = (convs, recurrents, qkv, z, beta, alpha, taps, neg_a, dt_bias, norm, core, done, shape.0, shape.1, shape.2, shape.3, shape.4, shape.5, shape.6);
            // A block per value head of a sequence, its state through shared memory.
            return g.launch(kernel, Grid::new((hv, n, 1), 2 * dv).with_shared(dk * dv * self.state_dtype().bytes()), args);
        }
        let kernel = match (dk, self.state_dtype()) {
            (32, StateDtype::F32) => k::DELTANET_STEP_BATCH_32,
            (64, StateDtype::F32) => k::DELTANET_STEP_BATCH_64,
            (_, StateDtype::F32) => k::DELTANET_STEP_BATCH_128,
            (32, StateDtype::Bf16) => k::DELTANET_STEP_BATCH_32_BF16_STATE,
            (64, StateDtype::Bf16) => k::DELTANET_STEP_BATCH_64_BF16_STATE,
            (_, StateDtype::Bf16) => k::DELTANET_STEP_BATCH_128_BF16_STATE,
        };
        let args = (convs, recurrents, qkv, z, beta, alpha, taps, neg_a, dt_bias, norm, core, g.ptr(&ws.step_ss), done, shape.0, shape.1, shape.2, shape.3, shape.4, shape.5, shape.6);
        g.launch(kernel, Grid::new((hv * dv / 32, n, 1), 512), args)
    }

    /// One sequence's prefill rows through the mixer: the conv over all rows at once (which also
    /// l2-normalises the q and k heads, q times 1/sqrt(dk)), the chunked delta rule (the
    /// chunks' matrices, then the state through the chunks) and the gated norm, into `ws.xb`
    /// in bf16 where `norm_to_bf16`.
    fn deltanet_chunked(&self, m: &DeltaNet, ws: &Workspace, r: Rows, conv: DevPtr<f32>, recurrent: DevPtr<StateValues>, norm_to_bf16: bool) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (hk, hv, dk, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (vd, cd, kk) = (c.linear_value_dim(), c.linear_conv_dim(), c.linear_conv_kernel_dim);
        let (qkv, z, beta, alpha) = (g.ptr(&ws.qkv).offset(r.first * cd), g.ptr(&ws.z).offset(r.first * vd), g.ptr(&ws.beta).offset(r.first * hv), g.ptr(&ws.alpha).offset(r.first * hv));
        let (conv_out, core) = (g.ptr(&ws.conv_out).offset(r.first * cd), g.ptr(&ws.core).offset(r.first * vd));
        let count = r.count as i32;
        let conv_kernel = if kk <= 4 { k::CONV_SILU_ROWS_4 } else { k::CONV_SILU_ROWS_8 };
        let conv_args = (conv, qkv, g.ptr(&m.conv_taps), conv_out, count, cd as i32, kk as i32, (2 * hk * dk) as i32, dk as i32, 1.0 / (dk as f32).sqrt());
        g.launch(conv_kernel, Grid::new((r.count.div_ceil(CONV_RUN), cd.div_ceil(1024), 1), 256), conv_args)?;
        g.launch(k::CONV_STATE_TAIL, Grid::x(cd.div_ceil(256), 256), (conv, qkv, count, cd as i32, kk as i32))?;
        let (gcum, cu, cw, cp) = (g.ptr(&ws.gcum), g.ptr(&ws.chunk_u), g.ptr(&ws.chunk_w), g.ptr(&ws.chunk_p));
        let (hk, hv, dk, dv, cd) = (hk as i32, hv as i32, dk as i32, dv as i32, cd as i32);
        let ops = ws.walk_operands(self, r.first);
        let prep = (conv_out, beta, alpha, g.ptr(&m.neg_a), g.ptr(&m.dt_bias), gcum, cu, cw, cp, ops.w, ops.q, ops.k, ops.p, count, hk, hv, dk, dv, cd);
        g.launch(k::DELTANET_CHUNK_PREP, Grid::new((r.count.div_ceil(DELTANET_CHUNK), hv as usize, 1), 256), prep)?;
        // 16 value columns per block (kernels/deltanet.cu deltanet_chunk_state): on tensor cores
        // where the precision allows bf16 operands; else in f32, where a grid that fits on the
        // SMs gets the build that spills no registers.
        let grid = |threads| Grid::new((hv as usize, dv as usize / 16, 1), threads);
        let bf16_state = self.state_dtype() == StateDtype::Bf16;
        if self.prefills_on_tensor_cores() {
            let kernel = match (dk, bf16_state) {
                (32, false) => k::DELTANET_CHUNK_STATE_MMA_32,
                (64, false) => k::DELTANET_CHUNK_STATE_MMA_64,
                (_, false) => k::DELTANET_CHUNK_STATE_MMA_128,
                (32, true) => k::DELTANET_CHUNK_STATE_MMA_32_BF16_STATE,
                (64, true) => k::DELTANET_CHUNK_STATE_MMA_64_BF16_STATE,
                (_, true) => k::DELTANET_CHUNK_STATE_MMA_128_BF16_STATE,
            };
            g.launch(kernel, grid(128).with_shared(k::chunk_state_mma_shared(dk as usize)), (recurrent, gcum, cu, ops.w, ops.q, ops.k, ops.p, core, count, hv, dk, dv))?;
        } else {
            let kernel = match ((hv * dv / 16) as u32 <= g.sms, bf16_state) {
                (true, false) => k::DELTANET_CHUNK_STATE_1,
                (false, false) => k::DELTANET_CHUNK_STATE,
                (true, true) => k::DELTANET_CHUNK_STATE_1_BF16_STATE,
                (false, true) => k::DELTANET_CHUNK_STATE_BF16_STATE,
            };
            g.launch(kernel, grid(256), (recurrent, conv_out, gcum, cu, cw, cp, core, count, hk, hv, dk, dv, cd))?;
        }
        let out_bf16 = if norm_to_bf16 { g.ptr(&ws.xb).offset(r.first * vd) } else { DevPtr::NULL };
        let rows = r.count * hv as usize;
        g.launch(k::GATED_RMS_NORM, Grid::x(rows.div_ceil(8), 256), (core, z, g.ptr(&m.norm), out_bf16, rows as i32, dv, c.rms_norm_eps))
    }

    /// The prefill rows of every sequence of a packed prefill through the mixer, each kernel of
    /// `deltanet_chunked` launched once for all of them (kernels/deltanet.cu *_packed: the same
    /// arithmetic on each sequence's rows and state), their states through the workspace's
    /// tables; the gated norm in one launch over every row.
    fn deltanet_chunked_packed(&self, m: &DeltaNet, ws: &Workspace, li: usize, rows: &[Rows], norm_to_bf16: bool) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (hk, hv, dk, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (cd, kk) = (c.linear_conv_dim(), c.linear_conv_kernel_dim);
        let (n, t) = (rows.len(), rows.iter().map(|r| r.count).sum::<usize>());
        let longest = rows.iter().map(|r| r.count).max().unwrap_or(0);
        let (convs, recurrents) = ws.layer_tables(g, li, n);
        let seqs = g.ptr(&ws.seqs);
        let (qkv, conv_out, core) = (g.ptr(&ws.qkv), g.ptr(&ws.conv_out), g.ptr(&ws.core));
        let conv_kernel = if kk <= 4 { k::CONV_SILU_ROWS_PACKED_4 } else { k::CONV_SILU_ROWS_PACKED_8 };
        let conv_args = (convs, seqs, qkv, g.ptr(&m.conv_taps), conv_out, cd as i32, kk as i32, (2 * hk * dk) as i32, dk as i32, 1.0 / (dk as f32).sqrt());
        g.launch(conv_kernel, Grid::new((longest.div_ceil(CONV_RUN), cd.div_ceil(1024), n), 256), conv_args)?;
        g.launch(k::CONV_STATE_TAIL_PACKED, Grid::new((cd.div_ceil(256), 1, n), 256), (convs, seqs, qkv, cd as i32, kk as i32))?;
        let (gcum, cu, cw, cp) = (g.ptr(&ws.gcum), g.ptr(&ws.chunk_u), g.ptr(&ws.chunk_w), g.ptr(&ws.chunk_p));
        let (hk_, hv_, dk_, dv_, cd_) = (hk as i32, hv as i32, dk as i32, dv as i32, cd as i32);
        let ops = ws.walk_operands(self, 0);
        let prep = (seqs, conv_out, g.ptr(&ws.beta), g.ptr(&ws.alpha), g.ptr(&m.neg_a), g.ptr(&m.dt_bias), gcum, cu, cw, cp, ops.w, ops.q, ops.k, ops.p, hk_, hv_, dk_, dv_, cd_);
        g.launch(k::DELTANET_CHUNK_PREP_PACKED, Grid::new((longest.div_ceil(DELTANET_CHUNK), hv, n), 256), prep)?;
        let grid = |threads| Grid::new((hv, dv / 16, n), threads);
        let bf16_state = self.state_dtype() == StateDtype::Bf16;
        if self.prefills_on_tensor_cores() {
            let kernel = match (dk, bf16_state) {
                (32, false) => k::DELTANET_CHUNK_STATE_MMA_PACKED_32,
                (64, false) => k::DELTANET_CHUNK_STATE_MMA_PACKED_64,
                (_, false) => k::DELTANET_CHUNK_STATE_MMA_PACKED_128,
                (32, true) => k::DELTANET_CHUNK_STATE_MMA_PACKED_32_BF16_STATE,
                (64, true) => k::DELTANET_CHUNK_STATE_MMA_PACKED_64_BF16_STATE,
                (_, true) => k::DELTANET_CHUNK_STATE_MMA_PACKED_128_BF16_STATE,
            };
            g.launch(kernel, grid(128).with_shared(k::chunk_state_mma_shared(dk)), (recurrents, seqs, gcum, cu, ops.w, ops.q, ops.k, ops.p, core, hv_, dk_, dv_))?;
        } else {
            let walk = (recurrents, seqs, conv_out, gcum, cu, cw, cp, core, hk_, hv_, dk_, dv_, cd_);
            g.launch(if bf16_state { k::DELTANET_CHUNK_STATE_PACKED_BF16_STATE } else { k::DELTANET_CHUNK_STATE_PACKED }, grid(256), walk)?;
        }
        let out_bf16 = if norm_to_bf16 { g.ptr(&ws.xb) } else { DevPtr::NULL };
        let head_rows = t * hv;
        g.launch(k::GATED_RMS_NORM, Grid::x(head_rows.div_ceil(8), 256), (core, g.ptr(&ws.z), g.ptr(&m.norm), out_bf16, head_rows as i32, dv_, c.rms_norm_eps))
    }

    /// The attention block: q (with its gate), k and v for all rows, then per sequence its
    /// q/k norms and RoPE (the keys and values going into its caches) and attention over its
    /// caches (`attention_decode` or `attention_prefill`), then the output projection into the
    /// residual stream.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(&self, m: &Attention, norm: &CudaSlice<f32>, ws: &Workspace, t: usize, states: &mut [&mut GpuState], rows: &[Rows], li: usize, visible: Option<usize>) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let x = g.ptr(&ws.x);
        let (qg, kp, vp, q, gate, attn) = (g.ptr(&ws.qg), g.ptr(&ws.k), g.ptr(&ws.v), g.ptr(&ws.q), g.ptr(&ws.gate), g.ptr(&ws.attn));
        self.project(ws, x, norm, t, &[(m.q_proj.all(g), qg), (m.k_proj.all(g), kp), (m.v_proj.all(g), vp)])?;
        let row = hkv * d;
        if ws.batched {
            let most = visible.unwrap_or_else(|| states.iter().map(|s| s.position + 1).max().unwrap_or(1));
            self.attention_batch(m, ws, most)?;
            return self.project_residual(ws, Input::F32(attn), t, &m.o_proj);
        }
        if ws.packed && self.attention_packed(m, ws, states, rows)? {
            return self.project_residual(ws, Input::F32(attn), t, &m.o_proj);
        }
        let koff = m.koff as i32;
        for (i, (s, &r)) in states.iter_mut().zip(rows).enumerate() {
            let pos = ws.position_of(g, i);
            let GpuLayerState::Full = &s.layers[li] else { bail!("layer {li}: state kind differs from the model's") };
            let blocks = ws.blocks_of(g, i);
            let (q, gate, attn) = (q.offset(r.first * hq * d), gate.offset(r.first * hq * d), attn.offset(r.first * hq * d));
            let args = (
                qg.offset(r.first * 2 * hq * d),
                q,
                gate,
                kp.offset(r.first * row),
                vp.offset(r.first * row),
                blocks,
                koff,
                g.ptr(&m.q_norm),
                g.ptr(&m.k_norm),
                g.ptr(&self.inv_freq),
                hq as i32,
                hkv as i32,
                d as i32,
                (c.rotary_dim() / 2) as i32,
                pos,
                c.rms_norm_eps,
            );
            g.launch(k::QK_NORM_ROPE, Grid::new((r.count, hq + hkv, 1), d.next_multiple_of(32)), args)?;
            let seq = AttentionRows { q, gate, out: attn, blocks, koff, pos, count: r.count, seen: s.position };
            if r.count > GEMV_MAX_T {
                self.attention_prefill(seq)?;
            } else {
                self.attention_decode(ws, seq, visible)?;
            }
        }
        self.project_residual(ws, Input::F32(attn), t, &m.o_proj)
    }

    /// Decode-sized rows over the caches, the positions split in chunks of at least 64, as
    /// many as the most positions a row can see need (`visible`: a captured step serves every
    /// position up to the cache's capacity).
    fn attention_decode(&self, ws: &Workspace, s: AttentionRows, visible: Option<usize>) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let most = visible.unwrap_or(s.seen + s.count);
        let chunk = most.div_ceil(ATTN_SPLITS).max(64);
        let splits = most.div_ceil(chunk);
        debug_assert!(chunk <= ATTN_CHUNK && splits <= ATTN_SPLITS);
        // (The hand-over buffers serve one sequence at a time: the launches run in order.)
        let args = (s.q, s.blocks, s.koff, s.gate, s.out, g.ptr(&ws.attn_part), g.ptr(&ws.attn_done), hq as i32, hkv as i32, d as i32, chunk as i32, splits as i32, s.pos);
        g.launch(k::ATTENTION, Grid::new((s.count, hkv, splits), 128).with_shared(attention_shared(hq / hkv, chunk)), args)
    }

    /// One token of each sequence of a batched step: its q/k norms and RoPE into its caches,
    /// then attention over them, each a launch for all sequences (the same arithmetic as
    /// `attention_decode` for each alone), the positions split for `most` (at least what the
    /// sequence that sees the most needs).
    fn attention_batch(&self, m: &Attention, ws: &Workspace, most: usize) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let n = ws.sequences;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (blocks, width, koff) = (ws.blocks_of(g, 0), ws.kv_width as i32, m.koff as i32);
        let pos = ws.position_of(g, 0);
        let (q, gate, attn) = (g.ptr(&ws.q), g.ptr(&ws.gate), g.ptr(&ws.attn));
        let (hq_, hkv_, d_) = (hq as i32, hkv as i32, d as i32);
        let args = (g.ptr(&ws.qg), q, gate, g.ptr(&ws.k), g.ptr(&ws.v), blocks, width, koff, g.ptr(&m.q_norm), g.ptr(&m.k_norm), g.ptr(&self.inv_freq), hq_, hkv_, d_, (c.rotary_dim() / 2) as i32, pos, c.rms_norm_eps);
        g.launch(k::QK_NORM_ROPE_BATCH, Grid::new((n, hq + hkv, 1), d.next_multiple_of(32)), args)?;
        let chunk = most.div_ceil(ATTN_SPLITS).max(64);
        let splits = most.div_ceil(chunk);
        debug_assert!(chunk <= ATTN_CHUNK && splits <= ATTN_SPLITS);
        let args = (q, blocks, width, koff, gate, attn, g.ptr(&ws.attn_part), g.ptr(&ws.attn_done), hq_, hkv_, d_, chunk as i32, splits as i32, pos);
        g.launch(k::ATTENTION_BATCH, Grid::new((n, hkv, splits), 128).with_shared(attention_shared(hq / hkv, chunk)), args)
    }

    /// The rows of every sequence of a packed prefill on tensor cores, each kernel of
    /// `attention_prefill` launched once for all of them (attention.cu *_packed: the same
    /// arithmetic on each sequence's rows and caches); false, launching nothing, where the
    /// prefill does not take the tensor cores (the f32 tiles go sequence by sequence).
    fn attention_packed(&self, m: &Attention, ws: &Workspace, states: &[&mut GpuState], rows: &[Rows]) -> Result<bool> {
        let c = &self.config;
        let g = &self.gpu;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let kernel = match d {
            32 => k::ATTENTION_MMA_PACKED_32,
            64 => k::ATTENTION_MMA_PACKED_64,
            128 => k::ATTENTION_MMA_PACKED_128,
            256 => k::ATTENTION_MMA_PACKED_256,
            _ => return Ok(false),
        };
        if !self.prefills_on_tensor_cores() {
            return Ok(false);
        }
        let n = rows.len();
        let longest = rows.iter().map(|r| r.count).max().unwrap_or(0);
        let most = states.iter().zip(rows).map(|(s, r)| s.position + r.count).max().unwrap_or(0);
        let (blocks, width, koff) = (ws.blocks_of(g, 0), ws.kv_width as i32, m.koff as i32);
        let (pos, seqs) = (ws.position_of(g, 0), g.ptr(&ws.seqs));
        let (q, gate, attn) = (g.ptr(&ws.q), g.ptr(&ws.gate), g.ptr(&ws.attn));
        let (hq_, hkv_, d_, row) = (hq as i32, hkv as i32, d as i32, hkv * d);
        let rope = (g.ptr(&ws.qg), q, gate, g.ptr(&ws.k), g.ptr(&ws.v), blocks, width, koff, g.ptr(&m.q_norm), g.ptr(&m.k_norm), g.ptr(&self.inv_freq), hq_, hkv_, d_, (c.rotary_dim() / 2) as i32, pos, seqs, c.rms_norm_eps);
        g.launch(k::QK_NORM_ROPE_PACKED, Grid::new((longest, hq + hkv, n), d.next_multiple_of(32)), rope)?;
        let kv: CudaSlice<u16> = g.scratch(2 * ws.kv_rows * row)?;
        let (kb, vb) = (g.ptr(&kv), g.ptr(&kv).offset(ws.kv_rows * row));
        g.launch(k::KV_TO_BF16_PACKED, Grid::new(((most * row).div_ceil(1024), 1, n), 256), (blocks, width, koff, kb, vb, row as i32, pos, seqs))?;
        g.launch(kernel, Grid::new((longest.div_ceil(64), hq, n), 256), (q, kb, vb, gate, attn, hq_, hkv_, pos, seqs))?;
        Ok(true)
    }

    /// Prefill rows, causal, over the cache: on tensor cores where the precision allows bf16
    /// operands and a build of the kernel exists for the head dim (the cache's rows so far
    /// gathered and rounded to bf16 first); else in f32 tiles.
    fn attention_prefill(&self, s: AttentionRows) -> Result<()> {
        let c = &self.config;
        let g = &self.gpu;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let grid = Grid::new((s.count.div_ceil(64), hq, 1), 256);
        let mma = match d {
            32 => Some(k::ATTENTION_MMA_32),
            64 => Some(k::ATTENTION_MMA_64),
            128 => Some(k::ATTENTION_MMA_128),
            256 => Some(k::ATTENTION_MMA_256),
            _ => None,
        };
        match mma {
            Some(kernel) if self.prefills_on_tensor_cores() => {
                let (rows, row) = (s.seen + s.count, hkv * d);
                let kv: CudaSlice<u16> = g.scratch(2 * rows * row)?;
                let (kb, vb) = (g.ptr(&kv), g.ptr(&kv).offset(rows * row));
                g.launch(k::KV_TO_BF16, Grid::x((rows * row).div_ceil(1024), 256), (s.blocks, s.koff, kb, vb, rows as i32, row as i32))?;
                g.launch(kernel, grid, (s.q, kb, vb, s.gate, s.out, s.count as i32, hq as i32, hkv as i32, s.pos))
            }
            _ => g.launch(k::ATTENTION_TILED, grid, (s.q, s.blocks, s.koff, s.gate, s.out, s.count as i32, hq as i32, hkv as i32, d as i32, s.pos)),
        }
    }

    /// The MLP block, `x += down(silu(gate(n)) * up(n))` with `n` the normalised x: by the GEMV
    /// for decode-sized rows, else on tensor cores or exact as the precision says.
    pub(super) fn mlp(&self, l: &Layer, ws: &Workspace, t: usize) -> Result<()> {
        if ws.takes_gemv(t) {
            return self.mlp_gemv(l, ws, t);
        }
        match self.precision {
            Precision::TensorCores | Precision::Fast => self.mlp_tensor_cores(l, ws, t),
            Precision::Exact => self.mlp_exact(l, ws, t),
        }
    }

    /// One GEMV for gate and up that writes silu(gate) * up itself, one for down.
    fn mlp_gemv(&self, l: &Layer, ws: &Workspace, t: usize) -> Result<()> {
        let g = &self.gpu;
        let [gate, up] = l.gate_up(g);
        let mats = [(gate, g.ptr(&ws.ffn_gate)), (up, g.ptr(&ws.ffn_up))];
        self.gemv(ws, GemvInput::Norm(g.ptr(&l.post_attention_norm)), &mats, g.ptr(&ws.x), gate.cols, t, GemvOut::SwiGlu)?;
        self.project_residual(ws, Input::F32(g.ptr(&ws.ffn_gate)), t, &l.down_proj)
    }

    /// Gate and up in one GEMM of the stacked matrix (a row of both per input row), rounded to
    /// bf16 (as a bf16 model computes them), which halves what it writes and the SwiGLU reads
    /// (its 32 launches of a 9B prefill of 2048 tokens on an H200: 2.0 ms from f32, 1.4 ms
    /// from bf16); the SwiGLU writes the down projection's bf16 operand, which adds into x.
    fn mlp_tensor_cores(&self, l: &Layer, ws: &Workspace, t: usize) -> Result<()> {
        let g = &self.gpu;
        let (x, xb) = (g.ptr(&ws.x), g.ptr(&ws.xb));
        // The f32 gate buffer holds the product's bf16 rows on this path (t x 2f values).
        let gate_up = g.ptr(&ws.ffn_gate).reinterpret::<u16>();
        let (h, f) = (l.gate_up_proj.cols, l.gate_up_proj.rows / 2);
        self.rms_norm(x, g.ptr(&l.post_attention_norm), NormOut::Bf16(xb), t, h)?;
        let gate_up_rows = l.gate_up_proj.all(g);
        let w = self.dequantized_weights(gate_up_rows, &GemmInput::Bf16(xb))?.map_or(gate_up_rows.w, |p| p.reinterpret());
        g.gemm_bf16(xb, t, w, 2 * f, h, GemmOut::Bf16(gate_up))?;
        let n = t * f;
        g.launch(k::SWIGLU_BF16, Grid::x(n.div_ceil(1024), 256), (gate_up, gate_up.offset(f), xb, n as i32, f as i32, 2 * f as i32))?;
        self.gemm(GemmInput::Bf16(xb), t, l.down_proj.all(g), x, true)
    }

    /// Gate and up in f32 (the f32 GEMM), the SwiGLU in place in gate, then down.
    fn mlp_exact(&self, l: &Layer, ws: &Workspace, t: usize) -> Result<()> {
        let g = &self.gpu;
        let (gate, up) = (g.ptr(&ws.ffn_gate), g.ptr(&ws.ffn_up));
        let [gate_rows, up_rows] = l.gate_up(g);
        self.project(ws, g.ptr(&ws.x), &l.post_attention_norm, t, &[(gate_rows, gate), (up_rows, up)])?;
        let n = t * l.down_proj.cols;
        g.launch(k::SWIGLU, Grid::x(n.div_ceil(1024), 256), (gate, up, DevPtr::NULL, n as i32))?;
        self.project_residual(ws, Input::F32(gate), t, &l.down_proj)
    }
}

/// One sequence's rows in an attention launch: its q, gate and output rows, its caches, its
/// position on the GPU, and how many rows it brings on top of the `seen` already cached.
#[derive(Clone, Copy)]
struct AttentionRows {
    q: DevPtr<f32>,
    gate: DevPtr<f32>,
    out: DevPtr<f32>,
    /// The sequence's K/V block table, and this layer's place in a block.
    blocks: DevPtr<DevPtr<f32>>,
    koff: i32,
    pos: DevPtr<u32>,
    count: usize,
    seen: usize,
}

/// The decode attention's shared memory a block: the scores of `group` query heads over a chunk
/// of `chunk` positions.
fn attention_shared(group: usize, chunk: usize) -> usize {
    group * chunk * std::mem::size_of::<f32>()
}
