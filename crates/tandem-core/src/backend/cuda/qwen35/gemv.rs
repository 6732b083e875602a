//! The decode GEMV: the launch that picks its kernel by shape, and its timing by kind for the
//! bench.

use super::*;

impl GpuQwen35 {
    /// The decode GEMV (kernels/gemv.cu gemv_*): `out_j[t, n_j] (+)= input(x)[t, k] · W_jᵀ` for t <= 8
    /// and up to four matrices `(W_j, out_j)` of the same input, in one launch where they are
    /// of one format (bf16, or one block format), else one launch per format.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemv(&self, ws: &Workspace, input: GemvInput, mats: &[(MatrixRows, DevPtr<f32>)], x: DevPtr<f32>, k: usize, t: usize, output: GemvOut) -> Result<()> {
        debug_assert!(!mats.is_empty() && mats.len() <= 4);
        if t > GEMV_MAX_T {
            // A decode batch of a model with block-format weights (`Workspace::batched`): in
            // launches of GEMV_MAX_T tokens, each token's products as they are alone.
            debug_assert!(mats.iter().any(|(m, _)| m.format.is_some()));
            for c0 in (0..t).step_by(GEMV_MAX_T) {
                let part: Vec<(MatrixRows, DevPtr<f32>)> = mats.iter().map(|&(m, out)| (m, out.offset(c0 * m.rows))).collect();
                self.gemv(ws, input, &part, x.offset(c0 * k), k, (t - c0).min(GEMV_MAX_T), output)?;
            }
            return Ok(());
        }
        let glu = output == GemvOut::SwiGlu;
        debug_assert!(!glu || (mats.len() == 2 && mats[0].0.rows == mats[1].0.rows && matches!(input, GemvInput::Norm(_))));
        let format = mats[0].0.format;
        if mats.iter().any(|(m, _)| m.format != format) {
            // Matrices of several formats (a GGUF file may store a layer's projections in
            // different ones): a launch each; the SwiGLU after gate and up, as the GEMM path does.
            let g = &self.gpu;
            let each = if glu { GemvOut::Write } else { output };
            for &(m, out) in mats {
                self.gemv(ws, input, &[(m, out)], x, k, t, each)?;
            }
            if glu {
                // (With the GLU, matrix 1's output is up's own buffer: mlp_gemv's ffn_up.)
                let n = t * mats[0].0.rows;
                g.launch(k::SWIGLU, Grid::x(n.div_ceil(1024), 256), (mats[0].1, mats[1].1, DevPtr::NULL, n as i32))?;
            }
            return Ok(());
        }
        if let Some(f) = format {
            return self.gemv_blocks(ws, input, f, mats, x, k, t, output);
        }
        let mats: Vec<(DevPtr<u16>, DevPtr<f32>, usize)> = mats.iter().map(|&(m, out)| (m.w, out, m.rows)).collect();
        let g = &self.gpu;
        let mut inv = DevPtr::NULL;
        let x2 = match input {
            GemvInput::Plain => DevPtr::NULL,
            GemvInput::Norm(scale) => {
                // The 1/rms of a short row is found by every block of the GEMV itself; of a
                // long one by a kernel before it. Measured on an H100 (interleaved runs of
                // whole decode steps): in the GEMV, the 0.8B model's (rows of 1024) steps were
                // 1.5% faster and the 9B's (4096) 1% slower.
                if k > RMS_IN_GEMV_MAX_K {
                    inv = g.ptr(&ws.rms_inv);
                    g.launch(k::RMS_INV, Grid::x(t, 256), (x, inv, k as i32, self.config.rms_norm_eps))?;
                }
                scale
            }
        };
        let norm = matches!(input, GemvInput::Norm(_));
        let m = |j: usize| mats.get(j).map_or((DevPtr::NULL, DevPtr::NULL, 0), |&(w, out, n)| (w, out, n as i32));
        let (m0, m1, m2, m3) = (m(0), m(1), m(2), m(3));
        let (accumulate, eps) = ((output == GemvOut::Add) as i32, self.config.rms_norm_eps);
        // With tensor-core precision the GEMV multiplies the bf16-rounded inputs, as the GEMM
        // does (kernels/gemv.cu): a sequence's products do not depend on which one its step takes.
        let round_in = self.precision.tensor_cores() as i32;
        if t == 1 && k == GEMV_STREAM_K {
            // One token, rows of 1024: every warp streams through rows (as many blocks as run
            // at once, fewer where the rows run out first). On an H200 (bench's GEMV table) the
            // 0.8B model's DeltaNet input projection went from 9.0 to 7.0 us, its gate and up
            // with the SwiGLU from 9.5 to 5.8 us and its LM head from 168 to 119 us.
            let kernel = match (glu, norm) {
                (true, _) => k::GEMV_STREAM_GLU,
                (false, true) => k::GEMV_STREAM_NORM,
                (false, false) => k::GEMV_STREAM_PLAIN,
            };
            let rows = if glu { mats[0].2 } else { mats.iter().map(|m| m.2).sum() };
            let blocks = (g.resident_blocks(kernel)? as usize).min(rows.div_ceil(8));
            let args = (m0.0, m0.1, m0.2, m1.0, m1.1, m1.2, m2.0, m2.1, m2.2, m3.0, m3.1, m3.2, x, x2, inv, k as i32, accumulate, eps, round_in);
            return g.launch(kernel, Grid::x(blocks, 256), args);
        }
        let kernels = match t {
            1 => [k::GEMV_T1_GLU, k::GEMV_T1_NORM, k::GEMV_T1_PLAIN],
            2 => [k::GEMV_T2_GLU, k::GEMV_T2_NORM, k::GEMV_T2_PLAIN],
            3 | 4 => [k::GEMV_T4_GLU, k::GEMV_T4_NORM, k::GEMV_T4_PLAIN],
            _ => [k::GEMV_T8_GLU, k::GEMV_T8_NORM, k::GEMV_T8_PLAIN],
        };
        let kernel = kernels[if glu { 0 } else if norm { 1 } else { 2 }];
        // Rows per block: the most (of 8, 4, 2, 1) whose blocks still fill at least half of
        // what the GPU runs at once, so that a matrix of few rows gets several warps per row
        // and its loads are spread over the GPU (as long as every lane of a row's warps has 8
        // columns to read). Measured on an H100, every rows-per-block for every decode GEMV of
        // the 0.8B and 9B models (bench's GEMV table): this picks the fastest or within 4% of
        // it; choosing instead by how full the last round of blocks is made the 0.8B model's
        // DeltaNet input projection 1.5x slower (2 rows per block, 6 rounds of small blocks).
        let resident = g.resident_blocks(kernel)? as usize;
        // (With the SwiGLU a unit's rows are gate and up rows in turn: an even count.)
        let units = |rb: usize| if glu { (2 * mats[0].2).div_ceil(rb) } else { mats.iter().map(|m| m.2.div_ceil(rb)).sum::<usize>() };
        let allowed = [8usize, 4, 2, 1].into_iter().filter(|&rb| (rb == 8 || (8 / rb) * 256 <= k) && !(glu && rb == 1));
        let rb = allowed.clone().find(|&rb| 2 * units(rb) >= resident).unwrap_or_else(|| allowed.last().unwrap_or(8));
        let args = (m0.0, m0.1, m0.2, m1.0, m1.1, m1.2, m2.0, m2.1, m2.2, m3.0, m3.1, m3.2, x, x2, inv, k as i32, t as i32, rb as i32, accumulate, eps, round_in);
        // A block per unit: the GPU's block scheduler evens out the last round.
        g.launch(kernel, Grid::x(units(rb), 256), args)
    }

    /// `gemv` of matrices of block format `f` (gemv.cu gemv_<format>_*): the same inputs and
    /// outputs as the bf16 kernels, the inputs first made integers by block_input (normalised
    /// there with `GemvInput::Norm`), each lane's chunk 32 values.
    #[allow(clippy::too_many_arguments)]
    fn gemv_blocks(&self, ws: &Workspace, input: GemvInput, f: BlockFormat, mats: &[(MatrixRows, DevPtr<f32>)], x: DevPtr<f32>, k: usize, t: usize, output: GemvOut) -> Result<()> {
        let g = &self.gpu;
        let glu = output == GemvOut::SwiGlu;
        // (Fast keeps Q4_0's and Q8_0's inputs f32, as the CPU engine's fast keeps those exact.)
        let (eps, round_in) = (self.config.rms_norm_eps, (self.precision == Precision::TensorCores) as i32);
        let scale = match input {
            GemvInput::Norm(scale) => scale,
            GemvInput::Plain => DevPtr::NULL,
        };
        let (q, sums) = (g.ptr(&ws.block_q), g.ptr(&ws.block_sums));
        let m = |j: usize| mats.get(j).map_or((DevPtr::NULL, DevPtr::NULL, 0), |&(w, out)| (w.w.reinterpret::<u8>(), out, w.rows as i32));
        let (m0, m1, m2, m3) = (m(0), m(1), m(2), m(3));
        let accumulate = (output == GemvOut::Add) as i32;
        let (xq, x2) = (q.reinterpret::<f32>(), sums.reinterpret::<f32>());
        if let Some(([glu_kernel, plain_kernel], rows_per_block)) = (self.precision == Precision::Fast).then(|| blocks::gemv_a8_kernels(f, t)).flatten() {
            // Int8 inputs (the CPU engine's precision=fast for these blocks, which does not
            // round them to bf16 first): a block per `rows_per_block` rows of one matrix (of gate
            // and up rows in turn with the SwiGLU).
            g.launch(k::BLOCK_INPUT8, Grid::x(t * blocks::BLOCK_INPUT_PARTS, 256), (x, scale, k as i32, eps, 0, blocks::index(f) as i32, q.reinterpret::<u8>(), sums))?;
            let grid = if glu { (2 * mats[0].0.rows).div_ceil(rows_per_block) } else { mats.iter().map(|m| m.0.rows.div_ceil(rows_per_block)).sum() };
            let args = (m0.0, m0.1, m0.2, m1.0, m1.1, m1.2, m2.0, m2.1, m2.2, m3.0, m3.1, m3.2, xq, x2, DevPtr::NULL, k as i32, t as i32, rows_per_block as i32, accumulate, eps, 0);
            return g.launch(if glu { glu_kernel } else { plain_kernel }, Grid::x(grid, 256), args);
        }
        g.launch(k::BLOCK_INPUT, Grid::x(t * blocks::BLOCK_INPUT_PARTS, 256), (x, scale, k as i32, eps, round_in, blocks::index(f) as i32, q, sums))?;
        let [glu_kernel, plain_kernel] = blocks::gemv_kernels(f, t);
        let kernel = if glu { glu_kernel } else { plain_kernel };
        // Rows per block as the bf16 GEMV chooses them, each warp's lanes taking a unit of the
        // format's values at a time (more warps per row only while each lane has one).
        let resident = g.resident_blocks(kernel)? as usize;
        let units = |rb: usize| if glu { (2 * mats[0].0.rows).div_ceil(rb) } else { mats.iter().map(|m| m.0.rows.div_ceil(rb)).sum::<usize>() };
        let unit = blocks::unit_values(f);
        let allowed = [8usize, 4, 2, 1].into_iter().filter(|&rb| (rb == 8 || (8 / rb) * 32 * unit <= k) && !(glu && rb == 1));
        let rb = allowed.clone().find(|&rb| 2 * units(rb) >= resident).unwrap_or_else(|| allowed.last().unwrap_or(8));
        let args = (m0.0, m0.1, m0.2, m1.0, m1.1, m1.2, m2.0, m2.1, m2.2, m3.0, m3.1, m3.2, xq, x2, DevPtr::NULL, k as i32, t as i32, rb as i32, accumulate, eps, round_in);
        g.launch(kernel, Grid::x(units(rb), 256), args)
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
        type Launch<'a> = (Option<&'a CudaSlice<f32>>, Vec<(MatrixRows, DevPtr<f32>)>, DevPtr<f32>);
        let mut kinds: Vec<(&str, Vec<Launch>)> = ["DeltaNet in (qkv, z, b, a)", "DeltaNet out (+ residual)", "attention in (q + gate, k, v)", "attention out (+ residual)", "MLP gate, up (+ SwiGLU)", "MLP down (+ residual)"]
            .into_iter()
            .map(|what| (what, Vec::new()))
            .collect();
        for l in &self.layers {
            match &l.mixer {
                GpuMixer::DeltaNet(m) => {
                    let [qkv, z, b, a] = m.in_projs(g, &self.config);
                    kinds[0].1.push((Some(&l.input_norm), vec![(qkv, g.ptr(&ws.qkv)), (z, g.ptr(&ws.z)), (b, g.ptr(&ws.beta)), (a, g.ptr(&ws.alpha))], x));
                    kinds[1].1.push((None, vec![(m.out_proj.all(g), x)], g.ptr(&ws.core)));
                }
                GpuMixer::Attention(m) => {
                    kinds[2].1.push((Some(&l.input_norm), vec![(m.q_proj.all(g), g.ptr(&ws.qg)), (m.k_proj.all(g), g.ptr(&ws.k)), (m.v_proj.all(g), g.ptr(&ws.v))], x));
                    kinds[3].1.push((None, vec![(m.o_proj.all(g), x)], g.ptr(&ws.attn)));
                }
            }
            let [gate, up] = l.gate_up(g);
            kinds[4].1.push((Some(&l.post_attention_norm), vec![(gate, g.ptr(&ws.ffn_gate)), (up, g.ptr(&ws.ffn_up))], x));
            kinds[5].1.push((None, vec![(l.down_proj.all(g), x)], g.ptr(&ws.ffn_gate)));
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
            let bytes = mats.iter().map(|m| m.0.bytes()).sum::<usize>();
            time(what, rows, cols, bytes, list.len(), &|| {
                list.iter().try_for_each(|(norm, mats, input)| match norm {
                    Some(n) => self.gemv(ws, GemvInput::Norm(g.ptr(n)), mats, *input, cols, 1, output),
                    None => self.gemv(ws, GemvInput::Plain, mats, *input, cols, 1, output),
                })
            })?;
        }
        let (head, v) = (self.lm_head_rows(), self.config.vocab_size);
        time("LM head", v, h, head.bytes(), 1, &|| self.gemv(ws, GemvInput::Norm(g.ptr(&self.final_norm)), &[(head, g.ptr(&ws.logits))], x, h, 1, GemvOut::Write))?;
        let (gate, up) = (g.ptr(&ws.ffn_gate), g.ptr(&ws.ffn_up));
        time("SwiGLU of one row (what a launch costs)", 1, h, 0, 1, &|| g.launch(k::SWIGLU, Grid::x(h.div_ceil(1024), 256), (gate, up, DevPtr::NULL, h as i32)))?;
        Ok(out)
    }
}
