//! The layers on the GPU: norms, projections (GEMV, exact GEMM or tensor cores), the DeltaNet
//! mixer, attention and the MLP, each enqueued on the engine's stream.

use super::*;

impl GpuQwen35 {
    /// `rms_norm(x[rows, d]) * w` into `out` (f32), or rounded to bf16 into `out_bf16` where
    /// that is not 0.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm(&self, x: u64, w: u64, out: u64, out_bf16: u64, rows: usize, d: usize) -> Result<()> {
        // Sixteen values a thread (kept in registers between the sum and the scaling), up to
        // 1024 threads: a row is one block.
        let threads = d.div_ceil(16).next_multiple_of(32).clamp(32, 1024) as u32;
        self.gpu.launch("rms_norm", (rows as u32, 1, 1), threads, 0, &[Arg::Ptr(x), Arg::Ptr(w), Arg::Ptr(out), Arg::Ptr(out_bf16), Arg::I32(d as i32), Arg::F32(self.config.rms_norm_eps)])
    }

    /// `out[t, n] = x[t, k] · W[n, k]ᵀ` (W at device address `w`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_raw(&self, ws: &Workspace, x: u64, t: usize, w: u64, n: usize, k: usize, out: u64) -> Result<()> {
        if t <= GEMV_MAX_T {
            return self.gemv(ws, GemvInput::Plain, &[(w, out, n)], x, k, t, GemvOut::Write);
        }
        let input = self.gemm_input(ws, x, t, k)?;
        self.gemm(input, t, w, n, k, out, false)
    }

    /// The input of prefill GEMMs, `x[t, k]` (f32): for tensor cores rounded to bf16 into
    /// `ws.xb` (once for all the products of that input).
    pub(super) fn gemm_input(&self, ws: &Workspace, x: u64, t: usize, k: usize) -> Result<u64> {
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
    pub(super) fn gemm(&self, input: u64, t: usize, w: u64, n: usize, k: usize, out: u64, accumulate: bool) -> Result<()> {
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
    pub(super) fn project(&self, ws: &Workspace, x: u64, norm: &CudaSlice<f32>, t: usize, mats: &[(&GpuMatrix, u64)]) -> Result<()> {
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
    pub(super) fn project_residual(&self, ws: &Workspace, input: Input, t: usize, m: &GpuMatrix) -> Result<()> {
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
    pub(super) fn deltanet(&self, m: &DeltaNet, norm: &CudaSlice<f32>, ws: &Workspace, t: usize, states: &mut [&mut GpuState], rows: &[Rows], li: usize) -> Result<()> {
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
            // 16 value columns per block (kernels/deltanet.cu deltanet_chunk_state): on tensor cores where
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
    pub(super) fn attention(&self, m: &Attention, norm: &CudaSlice<f32>, ws: &Workspace, t: usize, states: &mut [&mut GpuState], rows: &[Rows], li: usize, visible: Option<usize>) -> Result<()> {
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

    pub(super) fn mlp(&self, l: &Layer, ws: &Workspace, t: usize) -> Result<()> {
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
