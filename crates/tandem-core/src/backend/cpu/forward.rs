//! The Qwen3.5 forward pass on CPU cores, top to bottom (docs/qwen35.md has the maths): embed,
//! then per layer an RMSNorm, the mixer (`gated_deltanet` or `gated_attention`), the residual,
//! an RMSNorm, the SwiGLU `mlp` and the residual; then the final norm and the LM head.
//! Activations are f32; weights are read in their stored dtype by the kernels.

use anyhow::{bail, Context, Result};

use crate::backend::cpu::kernels::attention::attention_head;
use crate::backend::cpu::kernels::deltanet;
use crate::backend::cpu::kernels::matmul::{decode_group, decode_group_fast, decode_group_fast_reference, matmul_group, matmul_group_fast, matmul_group_fast_reference};
use crate::backend::cpu::CpuPrecision;
use crate::backend::cpu::kernels::norm::{gated_rms_norm_inplace, l2_normalize, rms_norm, rms_norm_inplace, sigmoid, silu, softplus, swiglu_inplace};
use crate::backend::cpu::kernels::rope::{apply_rope, cos_sin};
use crate::backend::cpu::pool::{Pool, WorkQueue};
use crate::backend::cpu::profile::{time, Phase};
use crate::model::{GatedAttention, GatedDeltaNet, Mixer, Mlp};
use crate::model::tensor::Matrix;
use crate::model::{Logits, Qwen35};
use crate::state::{LayerState, State};

/// The most tokens one pass of `forward` applies: it bounds the activations' memory (a token's
/// bits do not depend on where the pieces start, so any size would do).
pub const MAX_TOKENS_PER_PASS: usize = 128;

impl Qwen35 {

    /// Apply `tokens` to `state` (which covers `[0, state.position)`), and return the logits of
    /// the last token (`Logits::Last`) or of every token (`Logits::All`, `[T, vocab]`).
    /// `state.last_logits` always ends up holding the last token's logits.
    ///
    /// Long inputs run in pieces of `MAX_TOKENS_PER_PASS`, which bounds the activations' memory
    /// and changes no result: a token's products, its delta-rule step and its attention row
    /// have the same bits in a call of any size, so `tokens` applied in any pieces (here, or a
    /// prompt continued from a cached state) give what one pass gives.
    pub fn forward(&self, pool: &Pool, tokens: &[u32], state: &mut State, which: Logits) -> Result<Vec<f32>> {
        self.check(tokens, state, tokens.len())?;
        let mut logits = Vec::new();
        // One pass for all pieces: its buffers serve every piece.
        let pass = self.pass(pool, Kernels::Prompt);
        let pieces = tokens.len().div_ceil(MAX_TOKENS_PER_PASS);
        for (i, piece) in tokens.chunks(MAX_TOKENS_PER_PASS).enumerate() {
            let rows = piece.len();
            // The last token's logits: from the last piece alone.
            let which = if which == Logits::Last && i + 1 < pieces { Logits::Skip } else { which };
            let out = self.forward_pass(&pass, piece, &mut [Segment { state: &mut *state, rows: 0..rows, valid: rows }], which);
            logits.extend_from_slice(&out);
        }
        if which == Logits::Last {
            logits = state.last_logits.clone();
        }
        Ok(logits)
    }

    /// One static-shape dispatch: `tokens.len()` rows of which the first `valid` are real and
    /// the rest padding (any ids). Pads are masked: they neither decay nor write the recurrent
    /// state, do not enter the conv window or the KV cache, and are attended by nobody, so the
    /// state and `last_logits` come out equal to those of the unpadded dispatch
    /// `tokens[..valid]` (the products of real rows do not depend on the other rows).
    /// `which`: `Last` (the last real token's logits into `last_logits`) or `Skip`.
    pub fn forward_padded(&self, pool: &Pool, tokens: &[u32], valid: usize, state: &mut State, which: Logits) -> Result<()> {
        if valid == 0 || valid > tokens.len() {
            bail!("a dispatch of {} rows needs 1..={} real tokens, not {valid}", tokens.len(), tokens.len());
        }
        if which == Logits::All {
            bail!("a padded dispatch gives the last real token's logits or none, not every row's");
        }
        self.check(tokens, state, valid)?;
        let rows = tokens.len();
        self.forward_pass(&self.pass(pool, Kernels::Prompt), tokens, &mut [Segment { state, rows: 0..rows, valid }], which);
        Ok(())
    }

    /// One decode step for many sequences at once: `tokens[i]` is applied to `states[i]`, and
    /// each state's `last_logits` is updated. The weights are streamed once for the whole
    /// batch; the mixers run per sequence, each at its own position. Every sequence comes out
    /// bit for bit as if it had stepped alone (float weights), whatever the batch's size.
    pub fn decode_batch(&self, pool: &Pool, tokens: &[u32], states: &mut [&mut State]) -> Result<()> {
        if tokens.len() != states.len() || tokens.is_empty() {
            bail!("decode_batch needs one token per state ({} tokens, {} states)", tokens.len(), states.len());
        }
        for (i, state) in states.iter().enumerate() {
            self.check(&tokens[i..i + 1], state, 1).with_context(|| format!("sequence {i} of the batch"))?;
        }
        let mut segs: Vec<Segment> = states.iter_mut().enumerate().map(|(i, st)| Segment { state: &mut **st, rows: i..i + 1, valid: 1 }).collect();
        self.forward_pass(&self.pass(pool, Kernels::Decode), tokens, &mut segs, Logits::Last);
        Ok(())
    }

    /// Everything is checked before the first token is applied: a failed call leaves the
    /// state as it was.
    fn check(&self, tokens: &[u32], state: &State, applied: usize) -> Result<()> {
        self.config.check_input(tokens, state.position, applied, self.config.max_position_embeddings, "the model's")?;
        state.check_shape(&self.config)
    }

    /// The layers over `tokens` (all rows of all segments, `[T, hidden]`), then the final norm
    /// and LM head for the rows whose logits are wanted: each segment's last real row
    /// (`Logits::Last`; each into its state's `last_logits`, nothing returned) or every row of
    /// a single segment (`Logits::All`, returned), or none (`Logits::Skip`: each state's
    /// `last_logits` emptied). Inputs were checked by the caller.
    fn forward_pass(&self, pass: &Pass, tokens: &[u32], segs: &mut [Segment], which: Logits) -> Vec<f32> {
        let c = &self.config;
        let (t, h) = (tokens.len(), c.hidden_size);
        let mut x = vec![0f32; t * h];
        let embed = time(Phase::NormsResidual);
        for (i, &id) in tokens.iter().enumerate() {
            self.embed_tokens.row_to_f32(id as usize, &mut x[i * h..(i + 1) * h]);
        }
        let mut xn = vec![0f32; t * h];
        let mut mixed = vec![0f32; t * h];
        drop(embed);
        for (li, layer) in self.layers.iter().enumerate() {
            time(Phase::NormsResidual).run(|| norm_rows(pass.pool, &x, &layer.input_norm, c.rms_norm_eps, &mut xn));
            match &layer.mixer {
                Mixer::DeltaNet(m) => self.gated_deltanet(pass, m, &xn, t, segs, li, &mut mixed),
                Mixer::Attention(m) => self.gated_attention(pass, m, &xn, t, segs, li, &mut mixed),
            }
            time(Phase::NormsResidual).run(|| {
                add_rows(pass.pool, &mut x, &mixed, h);
                norm_rows(pass.pool, &x, &layer.post_attention_norm, c.rms_norm_eps, &mut xn);
            });
            self.mlp(pass, &layer.mlp, &xn, t, &mut mixed);
            time(Phase::NormsResidual).run(|| add_rows(pass.pool, &mut x, &mixed, h));
        }

        for seg in segs.iter_mut() {
            seg.state.position += seg.valid;
        }
        let rows: Vec<usize> = match which {
            Logits::All => segs[0].rows.clone().take(segs[0].valid).collect(),
            Logits::Last => segs.iter().map(|s| s.rows.start + s.valid - 1).collect(),
            Logits::Skip => {
                segs.iter_mut().for_each(|seg| seg.state.last_logits.clear());
                return Vec::new();
            }
        };
        let mut final_x = vec![0f32; rows.len() * h];
        for (dst, &r) in final_x.chunks_exact_mut(h).zip(&rows) {
            dst.copy_from_slice(&x[r * h..(r + 1) * h]);
        }
        rms_norm_inplace(&mut final_x, &self.final_norm, c.rms_norm_eps);
        let (n, v) = (rows.len(), c.vocab_size);
        // Each row's logits in the one-token order, as a decode step computes them: a token's
        // logits then have the same bits whichever call and kernels produced its hidden state.
        let lm_head = |out: &mut [f32]| {
            let _lm_head = time(Phase::LmHead);
            pass.with_kernels(Kernels::Decode).unprofiled_products(&final_x, n, &mut [(&self.lm_head, out)]);
        };
        if let ([seg], Logits::Last) = (&mut *segs, which) {
            // One sequence's step: straight into its state (no buffer to allocate, zero and
            // copy on every token; the vocabulary's logits are a megabyte).
            seg.state.last_logits.resize(v, 0.0);
            lm_head(&mut seg.state.last_logits);
            return Vec::new();
        }
        let mut logits = vec![0f32; n * v];
        lm_head(&mut logits);
        // All: one segment, its last row; Last: each segment's one row.
        let all = which == Logits::All;
        let last_rows: Vec<&[f32]> = if all { vec![&logits[(n - 1) * v..]] } else { logits.chunks_exact(v).collect() };
        for (seg, row) in segs.iter_mut().zip(last_rows) {
            seg.state.last_logits.clear();
            seg.state.last_logits.extend_from_slice(row);
        }
        if all {
            logits
        } else {
            Vec::new()
        }
    }

    /// Gated DeltaNet (spec §2.4): projections, causal conv over the raw qkv columns, l2-normed
    /// q/k, the gated delta rule per value head, gated RMSNorm, output projection. Each segment
    /// runs its conv and delta rule on its own state (layer `li`); pad rows are masked.
    #[allow(clippy::too_many_arguments)]
    fn gated_deltanet(&self, pass: &Pass, m: &GatedDeltaNet, xn: &[f32], t: usize, segs: &mut [Segment], li: usize, out: &mut [f32]) {
        let c = &self.config;
        let (hv, vd, cd) = (c.linear_num_value_heads, c.linear_value_dim(), c.linear_conv_dim());
        let (mut qkv, mut z, mut b, mut a) = (pass.buffer(t * cd), pass.buffer(t * vd), pass.buffer(t * hv), pass.buffer(t * hv));
        pass.products(xn, t, &mut [(&m.in_proj_qkv, &mut qkv), (&m.in_proj_z, &mut z), (&m.in_proj_b, &mut b), (&m.in_proj_a, &mut a)]);

        let mut core = pass.buffer(t * vd);
        // Pad rows: zero, as the norm and the out projection see them (the delta rule writes
        // the real rows).
        for seg in segs.iter() {
            core[(seg.rows.start + seg.valid) * vd..seg.rows.end * vd].iter_mut().for_each(|v| *v = 0.0);
        }
        if segs.iter().all(|s| s.valid < POOL_FROM_ROWS) {
            self.deltanet_by_key_head(pass, m, &qkv, &z, &b, &a, segs, li, &mut core);
        } else {
            self.deltanet_by_phase(pass, m, &qkv, &z, &b, &a, segs, li, &mut core);
        }
        pass.products(&core, t, &mut [(&m.out_proj, out)]);
    }

    /// A prompt's DeltaNet between its projections, phase by phase over all its rows: the
    /// causal depthwise conv + SiLU over the window (K raw columns before this call) ++ the
    /// segment's rows and the q/k norms split by rows, the delta rule by (segment, value head),
    /// the gated RMSNorm by rows; the outputs into `core` (`[t, Hv·Dv]`).
    #[allow(clippy::too_many_arguments)]
    fn deltanet_by_phase(&self, pass: &Pass, m: &GatedDeltaNet, qkv: &[f32], z: &[f32], b: &[f32], a: &[f32], segs: &mut [Segment], li: usize, core: &mut [f32]) {
        let c = &self.config;
        let (hk, hv, dk, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (kd, vd, cd, kk) = (c.linear_key_dim(), c.linear_value_dim(), c.linear_conv_dim(), c.linear_conv_kernel_dim);
        let t = core.len() / vd;
        // Pad rows of `mixed_qkv` are neither written nor read.
        let conv_norms = time(Phase::DeltaNetConvNorms);
        let mut mixed_qkv = pass.buffer(t * cd);
        let mut recurrent_of = Vec::with_capacity(segs.len());
        for seg in segs.iter_mut() {
            let LayerState::Linear { conv, recurrent } = &mut seg.state.layers[li] else { unreachable!("layer kinds were checked") };
            let new = &qkv[seg.rows.start * cd..(seg.rows.start + seg.valid) * cd];
            // A prompt's rows split over the pool (each row's sums as alone, so the same bits).
            rows_mut_on(pass.pool, &mut mixed_qkv[seg.rows.start * cd..], cd, seg.valid, &|r, out| {
                causal_conv_silu(conv, new, &m.conv_taps, kk, cd, r.start, out);
            });
            shift_conv_state(conv, new, kk, cd);
            recurrent_of.push(SharedMut(recurrent.as_mut_ptr()));
        }

        // q, k: l2-normalised per key head, q scaled by 1/√Dk; rows split over the pool.
        let q_scale = 1.0 / (dk as f32).sqrt();
        for seg in segs.iter() {
            rows_mut_on(pass.pool, &mut mixed_qkv[seg.rows.start * cd..], cd, seg.valid, &|_, rows| {
                for row in rows.chunks_exact_mut(cd) {
                    for head in row[..kd].chunks_exact_mut(dk) {
                        l2_normalize(head);
                        head.iter_mut().for_each(|v| *v *= q_scale);
                    }
                    for head in row[kd..2 * kd].chunks_exact_mut(dk) {
                        l2_normalize(head);
                    }
                }
            });
        }

        // The delta rule, (segment, value head) pairs split over the pool. Value head h reads
        // key head h / (Hv/Hk); each pair owns its slice of a recurrent state and of `core`.
        // Token by token, in prefill too: the state after a token then has the same bits
        // however the prompt was cut into calls (the chunked form, `deltanet::chunked`, groups
        // 64 tokens into one update, so a prompt continued from a cached state part way into
        // a chunk would round differently from a cold prefill). On these cores the recurrence
        // costs a few per cent of a prefill token's products. Pad rows are skipped.
        drop(conv_norms);
        let recurrence = time(Phase::DeltaNetRecurrence);
        let group = hv / hk;
        let core_ptr = SharedMut(core.as_mut_ptr());
        let seg_rows: Vec<(usize, usize)> = segs.iter().map(|s| (s.rows.start, s.valid)).collect();
        pass.pool.for_ranges(segs.len() * hv, 1, &|tasks| {
            let core_ptr = core_ptr;
            // A worker's buffers, reused by its tasks (a decode step has one per sequence and head).
            let (mut steps, mut outs) = (Vec::new(), Vec::new());
            for task in tasks {
                let (si, head) = (task / hv, task % hv);
                let (row0, valid) = seg_rows[si];
                let kh = head / group;
                // SAFETY: (segment, head) slices of the states and of `core` are disjoint
                // between tasks.
                let s = unsafe { std::slice::from_raw_parts_mut(recurrent_of[si].0.add(head * dk * dv), dk * dv) };
                steps.clear();
                steps.extend((row0..row0 + valid).map(|r| {
                    let row = &mixed_qkv[r * cd..(r + 1) * cd];
                    deltanet::StepInput {
                        q: &row[kh * dk..(kh + 1) * dk],
                        k: &row[kd + kh * dk..kd + (kh + 1) * dk],
                        v: &row[2 * kd + head * dv..2 * kd + (head + 1) * dv],
                        beta: sigmoid(b[r * hv + head]),
                        g: m.neg_a[head] * softplus(a[r * hv + head] + m.dt_bias[head]),
                    }
                }));
                outs.resize(valid * dv, 0f32);
                deltanet::recurrent_steps(s, &steps, &mut outs);
                for (r, o) in (row0..row0 + valid).zip(outs.chunks_exact(dv)) {
                    // SAFETY: as above.
                    unsafe { std::slice::from_raw_parts_mut(core_ptr.0.add(r * vd + head * dv), dv) }.copy_from_slice(o);
                }
            }
        });
        drop(recurrence);
        time(Phase::DeltaNetConvNorms).run(|| {
            rows_mut_on(pass.pool, core, vd, t, &|r, rows| gated_rms_norm_inplace(rows, &z[r.start * vd..r.end * vd], &m.norm, c.rms_norm_eps))
        });
    }

    /// A decode step's DeltaNet between its projections (a few rows per segment): one pool
    /// task per (segment, key head), each running the whole chain on the columns it alone
    /// touches: the conv + SiLU of its q, k and value heads' v columns (their conv state read
    /// and shifted in place of the task), the q/k norms, the delta rule of each value head
    /// that reads this key head, and their gated RMSNorm. Phase by phase, one core ran the conv
    /// and norms of a step's few rows while the others waited: 1.5-1.9 ms of a 16-21 ms step
    /// of the 0.8B on 16 Xeon cores (`examples/decode_bandwidth.rs`). Each value is computed by
    /// the same operations in the same order as `deltanet_by_phase` computes it, so the bits
    /// are the same. Timed as the recurrence.
    #[allow(clippy::too_many_arguments)]
    fn deltanet_by_key_head(&self, pass: &Pass, m: &GatedDeltaNet, qkv: &[f32], z: &[f32], b: &[f32], a: &[f32], segs: &mut [Segment], li: usize, core: &mut [f32]) {
        let c = &self.config;
        let (hk, hv, dk, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (kd, vd, cd, kk) = (c.linear_key_dim(), c.linear_value_dim(), c.linear_conv_dim(), c.linear_conv_kernel_dim);
        let group = hv / hk;
        let q_scale = 1.0 / (dk as f32).sqrt();
        let _recurrence = time(Phase::DeltaNetRecurrence);
        // Per segment: its conv and recurrent states, first row and real rows.
        let seg_states: Vec<(SharedMut, SharedMut, usize, usize)> = segs
            .iter_mut()
            .map(|seg| {
                let LayerState::Linear { conv, recurrent } = &mut seg.state.layers[li] else { unreachable!("layer kinds were checked") };
                (SharedMut(conv.as_mut_ptr()), SharedMut(recurrent.as_mut_ptr()), seg.rows.start, seg.valid)
            })
            .collect();
        // A key head's columns of a qkv row: its q, its k, its value heads' v.
        let col_ranges = |kh: usize| [kh * dk..(kh + 1) * dk, kd + kh * dk..kd + (kh + 1) * dk, 2 * kd + kh * group * dv..2 * kd + (kh + 1) * group * dv];
        let width = 2 * dk + group * dv;
        let core_ptr = SharedMut(core.as_mut_ptr());
        pass.pool.for_ranges(segs.len() * hk, 1, &|tasks| {
            let core_ptr = core_ptr;
            let (mut state, mut new, mut taps, mut mixed) = (vec![0f32; kk * width], Vec::new(), vec![0f32; kk * width], Vec::new());
            let mut outs = Vec::new();
            for task in tasks {
                let (si, kh) = (task / hk, task % hk);
                let (conv_p, rec_p, row0, valid) = seg_states[si];
                let cols = col_ranges(kh);
                // This task's columns, gathered: the conv state's K rows, the call's rows, the taps.
                let gather = |dst: &mut [f32], src: &dyn Fn(usize) -> *const f32, rows: usize| {
                    for (r, d) in (0..rows).zip(dst.chunks_exact_mut(width)) {
                        let mut at = 0;
                        for range in &cols {
                            // SAFETY: `src(r)` points at a row of `cd` values; only this task's
                            // columns of it are read (other tasks write theirs of a conv state).
                            d[at..at + range.len()].copy_from_slice(unsafe { std::slice::from_raw_parts(src(r).add(range.start), range.len()) });
                            at += range.len();
                        }
                    }
                };
                gather(&mut state, &|r| conv_p.0.wrapping_add(r * cd) as *const f32, kk);
                gather(&mut taps, &|r| m.conv_taps[r * cd..].as_ptr(), kk);
                new.resize(valid * width, 0.0);
                gather(&mut new, &|r| qkv[(row0 + r) * cd..].as_ptr(), valid);
                mixed.resize(valid * width, 0.0);
                causal_conv_silu(&state, &new, &taps, kk, width, 0, &mut mixed);
                shift_conv_state(&mut state, &new, kk, width);
                for r in 0..kk {
                    let mut at = 0;
                    for range in &cols {
                        // SAFETY: the conv state's columns of this key head belong to this task
                        // alone (tasks are distinct (segment, key head) pairs).
                        unsafe { std::slice::from_raw_parts_mut(conv_p.0.add(r * cd + range.start), range.len()) }.copy_from_slice(&state[r * width + at..r * width + at + range.len()]);
                        at += range.len();
                    }
                }
                for row in mixed.chunks_exact_mut(width) {
                    l2_normalize(&mut row[..dk]);
                    row[..dk].iter_mut().for_each(|v| *v *= q_scale);
                    l2_normalize(&mut row[dk..2 * dk]);
                }
                for head in kh * group..(kh + 1) * group {
                    let vo = 2 * dk + (head - kh * group) * dv;
                    let steps: Vec<deltanet::StepInput> = mixed.chunks_exact(width).enumerate().map(|(i, row)| {
                        let r = row0 + i;
                        deltanet::StepInput {
                            q: &row[..dk],
                            k: &row[dk..2 * dk],
                            v: &row[vo..vo + dv],
                            beta: sigmoid(b[r * hv + head]),
                            g: m.neg_a[head] * softplus(a[r * hv + head] + m.dt_bias[head]),
                        }
                    }).collect();
                    outs.resize(valid * dv, 0f32);
                    // SAFETY: (segment, value head) slices of the recurrent states belong to
                    // one task.
                    let s = unsafe { std::slice::from_raw_parts_mut(rec_p.0.add(head * dk * dv), dk * dv) };
                    deltanet::recurrent_steps(s, &steps, &mut outs);
                    for (r, o) in (row0..row0 + valid).zip(outs.chunks_exact_mut(dv)) {
                        gated_rms_norm_inplace(o, &z[r * vd + head * dv..r * vd + (head + 1) * dv], &m.norm, c.rms_norm_eps);
                        // SAFETY: each (row, value head) slice of `core` is written by one task.
                        unsafe { std::slice::from_raw_parts_mut(core_ptr.0.add(r * vd + head * dv), dv) }.copy_from_slice(o);
                    }
                }
            }
        });
    }

    /// Gated full attention (spec §2.5): per-head query/gate split, zero-centred q/k norms,
    /// partial NeoX RoPE, KV-cache append, causal GQA softmax, sigmoid output gate. Each
    /// segment attends over its own cache (layer `li`) from its own position; pad rows are
    /// neither cached nor attended.
    #[allow(clippy::too_many_arguments)]
    fn gated_attention(&self, pass: &Pass, m: &GatedAttention, xn: &[f32], t: usize, segs: &mut [Segment], li: usize, out: &mut [f32]) {
        let c = &self.config;
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (mut qg, mut k, mut v) = (pass.buffer(t * hq * 2 * d), pass.buffer(t * hkv * d), pass.buffer(t * hkv * d));
        pass.products(xn, t, &mut [(&m.q_proj, &mut qg), (&m.k_proj, &mut k), (&m.v_proj, &mut v)]);

        let prep = time(Phase::AttentionPrep);
        let half = c.rotary_dim() / 2;
        // Rows of real tokens only: pads are neither cached nor attended.
        let (mut q, mut gate) = (pass.buffer(t * hq * d), pass.buffer(t * hq * d));
        let pads: Vec<std::ops::Range<usize>> = segs.iter().map(|s| s.rows.start + s.valid..s.rows.end).collect();
        let mut caches = Vec::with_capacity(segs.len());
        for seg in segs.iter_mut() {
            let pos0 = seg.state.position;
            let row0 = seg.rows.start;
            let (q_p, gate_p, k_p) = (SharedMut(q.as_mut_ptr()), SharedMut(gate.as_mut_ptr()), SharedMut(k.as_mut_ptr()));
            // A prompt's rows split over the pool.
            rows_on(pass.pool, seg.valid, &|rows| {
                let (q_p, gate_p, k_p) = (q_p, gate_p, k_p);
                let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
                for r in row0 + rows.start..row0 + rows.end {
                    // SAFETY: row r of q, gate and k is written by the one task that has r.
                    let (q, gate, k) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(q_p.0.add(r * hq * d), hq * d),
                            std::slice::from_raw_parts_mut(gate_p.0.add(r * hq * d), hq * d),
                            std::slice::from_raw_parts_mut(k_p.0.add(r * hkv * d), hkv * d),
                        )
                    };
                    cos_sin(pos0 + r - row0, &self.inv_freq, &mut cos, &mut sin);
                    for head in 0..hq {
                        let src = &qg[(r * hq + head) * 2 * d..(r * hq + head + 1) * 2 * d];
                        let qh = &mut q[head * d..(head + 1) * d];
                        rms_norm(&src[..d], &m.q_norm, c.rms_norm_eps, qh);
                        apply_rope(qh, &cos, &sin);
                        gate[head * d..(head + 1) * d].copy_from_slice(&src[d..]);
                    }
                    for head in k.chunks_exact_mut(d) {
                        rms_norm_inplace(head, &m.k_norm, c.rms_norm_eps);
                        apply_rope(head, &cos, &sin);
                    }
                }
            });
            let LayerState::Full { k: k_cache, v: v_cache } = &mut seg.state.layers[li] else { unreachable!("layer kinds were checked") };
            let real = seg.rows.start * hkv * d..(seg.rows.start + seg.valid) * hkv * d;
            k_cache.extend_from_slice(&k[real.clone()]);
            v_cache.extend_from_slice(&v[real]);
            caches.push((&k_cache[..], &v_cache[..], pos0, seg.rows.start, seg.valid));
        }

        drop(prep);
        let attention = time(Phase::Attention);
        // (segment, query head, block of a prompt's queries) tasks taken from a queue by the
        // pool's workers, the latest queries (which see the most keys) first; each writes its
        // own head's columns of its own rows of `attn`. A query's output does not depend on
        // which other queries share its call, so the split leaves the bits as they are; with
        // one task per head, a prompt kept 8 of 16 workers waiting.
        let mut attn = pass.buffer(t * hq * d);
        // Pad rows: zero, as the output projection sees them.
        for pad in &pads {
            attn[pad.start * hq * d..pad.end * hq * d].iter_mut().for_each(|x| *x = 0.0);
        }
        let shared = SharedMut(attn.as_mut_ptr());
        let q = &q;
        let mut tasks: Vec<(usize, usize, usize, usize)> = Vec::new();
        for (si, &(_, _, _, _, valid)) in caches.iter().enumerate() {
            for start in (0..valid).step_by(ATTENTION_TASK_QUERIES) {
                let len = ATTENTION_TASK_QUERIES.min(valid - start);
                tasks.extend((0..hq).map(|h| (si, h, start, len)));
            }
        }
        tasks.sort_by_key(|&(_, _, start, _)| std::cmp::Reverse(start));
        let queue = WorkQueue::new(tasks.len());
        pass.pool.run(&|_| {
            let shared = shared;
            let mut scores = Vec::new();
            while let Some(i) = queue.take() {
                let (si, h, start, len) = tasks[i];
                let (kc, vc, pos0, row0, _) = caches[si];
                let row = row0 + start;
                // SAFETY: every task writes only its own head's d columns of its own rows.
                let out = unsafe { std::slice::from_raw_parts_mut(shared.0.add(row * hq * d), len * hq * d) };
                attention_head(&q[row * hq * d..(row + len) * hq * d], len, pos0 + start, kc, vc, hq, hkv, d, h, &mut scores, out);
                // The output gate of this task's columns, while they are in cache.
                for ti in 0..len {
                    let at = (ti * hq + h) * d;
                    sigmoid_gate(&mut out[at..at + d], &gate[row * hq * d + at..][..d]);
                }
            }
        });
        drop(attention);
        pass.products(&attn, t, &mut [(&m.o_proj, out)]);
    }

    /// SwiGLU: `down(silu(gate(x)) * up(x))`.
    fn mlp(&self, pass: &Pass, m: &Mlp, xn: &[f32], t: usize, out: &mut [f32]) {
        let f = self.config.intermediate_size;
        let (mut gate, mut up) = (pass.buffer(t * f), pass.buffer(t * f));
        pass.products(xn, t, &mut [(&m.gate_proj, &mut gate), (&m.up_proj, &mut up)]);
        let swiglu = time(Phase::SwiGlu);
        let g = SharedMut(gate.as_mut_ptr());
        pass.pool.for_ranges(gate.len(), 16, &|r| {
            let g = g;
            // SAFETY: the ranges are disjoint parts of `gate`.
            let gate = unsafe { std::slice::from_raw_parts_mut(g.0.add(r.start), r.len()) };
            swiglu_inplace(gate, &up[r]);
        });
        drop(swiglu);
        pass.products(&gate, t, &mut [(&m.down_proj, out)]);
    }

    fn pass<'p>(&self, pool: &'p Pool, kernels: Kernels) -> Pass<'p> {
        Pass::new(pool, kernels, self.cpu_precision)
    }
}

/// Which product kernels a pass takes.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Kernels {
    /// A prompt or a static-shape dispatch: the GEMM's sums whatever the row count, so that a
    /// row computes the same bits in a call of any size (a prompt in pieces, a padded dispatch,
    /// a prefill that continues a cached state).
    Prompt,
    /// A decode step of a batch: the GEMV whatever the row count, so that each sequence gets
    /// the bits it would get alone.
    Decode,
}

/// How a pass multiplies: its pool, its kernels, and its arithmetic; and the activation
/// buffers its layers take in turn.
struct Pass<'p> {
    pool: &'p Pool,
    kernels: Kernels,
    precision: CpuPrecision,
    /// Buffers given back by the layers before (`buffer`).
    free: std::sync::Mutex<Vec<Vec<f32>>>,
}

impl<'p> Pass<'p> {
    fn new(pool: &'p Pool, kernels: Kernels, precision: CpuPrecision) -> Pass<'p> {
        Pass { pool, kernels, precision, free: std::sync::Mutex::new(Vec::new()) }
    }

    fn with_kernels(&self, kernels: Kernels) -> Pass<'p> {
        Pass::new(self.pool, kernels, self.precision)
    }

    /// `len` values for a layer's activations, holding whatever an earlier layer left there:
    /// the caller writes every value it reads. Given back to the pass when dropped, so that
    /// the next layer reuses it: each layer allocated and zeroed its own (a dozen buffers of
    /// up to 3 MB a layer for 128 tokens of the 0.8B), on one thread while the others waited.
    fn buffer(&self, len: usize) -> PassBuffer<'_> {
        let mut free = self.free.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // The smallest that holds `len`, else the largest (grown).
        let fits = free.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
        let pick = fits.or_else(|| free.iter().enumerate().max_by_key(|(_, b)| b.capacity()).map(|(i, _)| i));
        let mut buf = pick.map(|i| free.swap_remove(i)).unwrap_or_default();
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        PassBuffer { buf, len, home: &self.free }
    }

    /// The layers' products (timed as such when profiling).
    fn products(&self, x: &[f32], t: usize, jobs: &mut [(&Matrix, &mut [f32])]) {
        let _timer = time(Phase::Products);
        self.unprofiled_products(x, t, jobs)
    }

    fn unprofiled_products(&self, x: &[f32], t: usize, jobs: &mut [(&Matrix, &mut [f32])]) {
        let rounded: Vec<f32>;
        let x = if self.precision == CpuPrecision::Bf16Inputs {
            rounded = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
            &rounded
        } else {
            x
        };
        match (self.kernels, self.precision) {
            (Kernels::Prompt, CpuPrecision::Fast) => matmul_group_fast(self.pool, x, t, jobs),
            (Kernels::Prompt, CpuPrecision::FastReference) => matmul_group_fast_reference(self.pool, x, t, jobs),
            // The fast decode products: bf16 weights on rounded inputs, k-quants on int8 inputs.
            (Kernels::Decode, CpuPrecision::Fast) => decode_group_fast(self.pool, x, t, jobs),
            (Kernels::Decode, CpuPrecision::FastReference) => decode_group_fast_reference(self.pool, x, t, jobs),
            (Kernels::Prompt, _) => matmul_group(self.pool, x, t, jobs),
            (Kernels::Decode, _) => decode_group(self.pool, x, t, jobs),
        }
    }
}

/// A buffer of a pass (`Pass::buffer`): `len` values, back to the pass when dropped.
struct PassBuffer<'a> {
    buf: Vec<f32>,
    len: usize,
    home: &'a std::sync::Mutex<Vec<Vec<f32>>>,
}

impl std::ops::Deref for PassBuffer<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[..self.len]
    }
}

impl std::ops::DerefMut for PassBuffer<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[..self.len]
    }
}

impl Drop for PassBuffer<'_> {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        self.home.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(buf);
    }
}

/// Rows `rows` of a pass belong to one sequence: its state, and how many of those rows are
/// real tokens (the rest pad a static-shape dispatch).
struct Segment<'s> {
    state: &'s mut State,
    rows: std::ops::Range<usize>,
    valid: usize,
}

/// Pointers into buffers whose disjoint parts are written by different pool workers.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

crate::backend::cpu::kernels::multiversion! {
    /// `out[i] = silu(Σ_j taps[j] ⊙ window[first + i + 1 + j])` for the `out.len() / cd`
    /// tokens from `first` on: the depthwise causal conv over a window of the conv state's K
    /// stored rows `conv` followed by this call's rows `new` (`[rows, cd]` each), each row read
    /// where it lies (not copied into one window first).
    fn causal_conv_silu(conv: &[f32], new: &[f32], taps: &[f32], kk: usize, cd: usize, first: usize, out: &mut [f32]) => causal_conv_silu_body
}

#[inline(always)]
fn causal_conv_silu_body(conv: &[f32], new: &[f32], taps: &[f32], kk: usize, cd: usize, first: usize, out: &mut [f32]) {
    let window_row = |w: usize| if w < kk { &conv[w * cd..(w + 1) * cd] } else { &new[(w - kk) * cd..(w - kk + 1) * cd] };
    for (i, o) in out.chunks_exact_mut(cd).enumerate() {
        o.iter_mut().for_each(|v| *v = 0.0);
        for j in 0..kk {
            let src = window_row(first + i + 1 + j);
            let w = &taps[j * cd..(j + 1) * cd];
            for ((ov, &x), &wv) in o.iter_mut().zip(src).zip(w) {
                *ov = wv.mul_add(x, *ov);
            }
        }
        o.iter_mut().for_each(|v| *v = silu(*v));
    }
}

crate::backend::cpu::kernels::multiversion! {
    /// `x[i] *= sigmoid(gate[i])`: attention's output gate.
    fn sigmoid_gate(x: &mut [f32], gate: &[f32]) => sigmoid_gate_body
}

#[inline(always)]
fn sigmoid_gate_body(x: &mut [f32], gate: &[f32]) {
    for (o, &g) in x.iter_mut().zip(gate) {
        *o *= sigmoid(g);
    }
}

/// The conv state after this call's rows `new`: the window's last K rows, in place.
fn shift_conv_state(conv: &mut [f32], new: &[f32], kk: usize, cd: usize) {
    let valid = new.len() / cd;
    if valid >= kk {
        conv.copy_from_slice(&new[(valid - kk) * cd..]);
    } else {
        conv.copy_within(valid * cd.., 0);
        conv[(kk - valid) * cd..].copy_from_slice(new);
    }
}

/// Queries per attention task of a prompt: a multiple of the kernel's query block, so that a
/// task's keys are read once per 32 queries as in one call.
const ATTENTION_TASK_QUERIES: usize = 64;

/// Rows of a segment from which its row-wise work is split over the pool.
const POOL_FROM_ROWS: usize = 16;

/// `f(rows)` for rows `0..n`: split over the pool for a prompt's many rows, on this thread for
/// a few (a decode step's segment, where a fork and join would cost more than the work).
fn rows_on(pool: &Pool, n: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    if n >= POOL_FROM_ROWS && pool.threads() > 1 {
        pool.for_ranges(n, 1, f);
    } else if n > 0 {
        f(0..n);
    }
}

/// `f(rows, &mut buf[rows])` for rows `0..n` of `row_len` values, split as `rows_on` splits
/// them, each worker handed the rows it alone writes.
fn rows_mut_on(pool: &Pool, buf: &mut [f32], row_len: usize, n: usize, f: &(dyn Fn(std::ops::Range<usize>, &mut [f32]) + Sync)) {
    assert!(buf.len() >= n * row_len, "rows_mut_on: {n} rows of {row_len} past a buffer of {}", buf.len());
    let p = SharedMut(buf.as_mut_ptr());
    rows_on(pool, n, &|r| {
        let p = p;
        // SAFETY: the ranges `rows_on` hands out are disjoint and within `0..n`, so their rows
        // are disjoint parts of `buf`.
        f(r.clone(), unsafe { std::slice::from_raw_parts_mut(p.0.add(r.start * row_len), r.len() * row_len) })
    });
}

/// `rms_norm` of every row of `x` into `out`, a prompt's rows split over the pool.
fn norm_rows(pool: &Pool, x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) {
    let h = scale.len();
    rows_mut_on(pool, out, h, x.len() / h, &|r, out| rms_norm(&x[r.start * h..r.end * h], scale, eps, out));
}

/// `x += y` for rows of `h` values, a prompt's rows split over the pool.
fn add_rows(pool: &Pool, x: &mut [f32], y: &[f32], h: usize) {
    let n = x.len() / h;
    rows_mut_on(pool, x, h, n, &|r, x| add_inplace(x, &y[r.start * h..r.end * h]));
}

fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensor-core emulation rounds the inputs of every product (a decode-sized one too, as
    /// the GPU's GEMV does with tensor-core precision): the product of the rounded input.
    #[test]
    fn bf16_gemm_inputs_round_every_product() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        let mut m = crate::model::load::LoadedModel::load(dir.to_str().unwrap()).unwrap();
        let pool = Pool::new(1);
        let _same_kernels = crate::backend::cpu::kernels::hold_isa();
        let w = &m.net.lm_head;
        let k = w.cols;
        let x: Vec<f32> = (0..9 * k).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 1.37).collect();
        let rounded: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        assert!(rounded != x);
        let run = |bf16_inputs: bool, x: &[f32], t: usize| {
            let mut out = vec![0f32; t * w.rows];
            let precision = if bf16_inputs { CpuPrecision::Bf16Inputs } else { CpuPrecision::Exact };
            Pass::new(&pool, Kernels::Prompt, precision).products(&x[..t * k], t, &mut [(w, &mut out)]);
            out
        };
        for t in [1, 8, 9] {
            assert!(run(true, &x, t) == run(false, &rounded, t), "{t} rows: not the product of the rounded input");
            assert!(run(true, &x, t) != run(false, &x, t), "{t} rows: the input was not rounded");
        }

        let tokens = [3u32, 141, 59, 26, 535];
        let plain = m.net.forward(&pool, &tokens, &mut State::new(&m.net.config), Logits::All).unwrap();
        m.net.set_cpu_precision(CpuPrecision::Bf16Inputs);
        let emulated = m.net.forward(&pool, &tokens, &mut State::new(&m.net.config), Logits::All).unwrap();
        assert!(plain != emulated, "a 5-token pass did not change under the tensor-core emulation");
    }

    /// `forward` applies long inputs in pieces; the pieces start on DeltaNet chunk boundaries,
    /// so the result is bit for bit that of one pass.
    #[test]
    fn pieces_of_a_long_input_equal_one_pass_exactly() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        let m = crate::model::load::LoadedModel::load(dir.to_str().unwrap()).unwrap();
        let pool = Pool::new(2);
        let tokens: Vec<u32> = (0..300).map(|i| (i * 37 + 11) % 1024).collect();
        assert!(tokens.len() > 2 * MAX_TOKENS_PER_PASS);
        let _same_kernels = crate::backend::cpu::kernels::hold_isa();
        let (mut one, mut pieces) = (State::new(&m.net.config), State::new(&m.net.config));
        let rows = tokens.len();
        let want = m.net.forward_pass(&m.net.pass(&pool, Kernels::Prompt), &tokens, &mut [Segment { state: &mut one, rows: 0..rows, valid: rows }], Logits::All);
        let got = m.net.forward(&pool, &tokens, &mut pieces, Logits::All).unwrap();
        assert!(want == got, "logits differ");
        assert!(one == pieces, "states differ");
    }

    /// A prompt applied in pieces cut anywhere (a cached prefix continued, a turn prefilled in
    /// parts, pieces of one token to past a pass) reaches the state and the last logits of one
    /// call, bit for bit, with the weights as stored and quantized to int8, and with the fast
    /// precision on both; pieces that skip their logits leave none behind and change nothing
    /// else.
    #[test]
    fn a_prompt_cut_anywhere_equals_one_call_exactly() {
        let pool = Pool::new(2);
        let _same_kernels = crate::backend::cpu::kernels::hold_isa();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        let tokens: Vec<u32> = (0..300u32).map(|i| (i * 211 + 7) % 1024).collect();
        let mut seed = 0x5eed_u64;
        for m in [tiny(), crate::model::load::LoadedModel::load_int8(dir.to_str().unwrap(), &pool).unwrap(), tiny_fast(), tiny_int8_fast(&pool)] {
            let mut whole = State::new(&m.net.config);
            m.net.forward(&pool, &tokens, &mut whole, Logits::Last).unwrap();
            for trial in 0..5 {
                let mut st = State::new(&m.net.config);
                let mut at = 0;
                let mut cuts = Vec::new();
                while at < tokens.len() {
                    // Mostly short pieces (the narrow kernel's sizes), now and then a long one.
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let r = (seed >> 33) as usize;
                    let len = if r.is_multiple_of(4) { 1 + r % 150 } else { 1 + r % 9 };
                    let end = (at + len).min(tokens.len());
                    let which = if end < tokens.len() && r.is_multiple_of(3) { Logits::Skip } else { Logits::Last };
                    m.net.forward(&pool, &tokens[at..end], &mut st, which).unwrap();
                    assert_eq!(st.last_logits.is_empty(), which == Logits::Skip, "trial {trial}: logits after {which:?}");
                    cuts.push(end);
                    at = end;
                }
                assert!(st == whole, "trial {trial}: pieces ending at {cuts:?} reach another state than one call");
            }
        }
    }

    /// A checkpoint's weights copied out of the file's pages (as CPU engines do) give the same
    /// bits, hold the same bytes (a tied embedding stays one copy), and none stays in the file.
    #[test]
    fn weights_copied_out_of_the_file_give_the_same_bits() {
        let pool = Pool::new(2);
        let mut m = tiny();
        let weights = m.net.weight_bytes();
        let tokens: Vec<u32> = (0..40).map(|i| (i * 7919 % 1000) as u32).collect();
        let run = |m: &crate::model::load::LoadedModel| {
            let mut st = State::new(&m.net.config);
            let logits = m.net.forward(&pool, &tokens, &mut st, Logits::All).unwrap();
            (logits.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), st)
        };
        let before = run(&m);
        let in_file = |m: &mut crate::model::load::LoadedModel| {
            let n = std::cell::Cell::new(0);
            m.net.map_matrices(|w| {
                let file = match &w.data {
                    crate::model::tensor::WeightData::Bf16(b) | crate::model::tensor::WeightData::F16(b) => b.is_file(),
                    crate::model::tensor::WeightData::F32(b) => b.is_file(),
                    crate::model::tensor::WeightData::Int8 { q, .. } => q.is_file(),
                    crate::model::tensor::WeightData::Blocks { data, .. } => data.is_file(),
                };
                n.set(n.get() + file as usize);
                w.clone()
            });
            n.get()
        };
        assert!(in_file(&mut m) > 0, "the fixture's weights should be a file's pages to begin with");
        m.net.copy_file_weights_into_huge_pages();
        assert_eq!(in_file(&mut m), 0);
        assert_eq!(m.net.weight_bytes(), weights);
        let after = run(&m);
        assert!(before.0 == after.0 && before.1 == after.1, "copied weights changed the logits or the state");
    }

    fn tiny() -> crate::model::load::LoadedModel {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        crate::model::load::LoadedModel::load(dir.to_str().unwrap()).unwrap()
    }

    /// The tiny model (bf16 weights) with the fast precision.
    fn tiny_fast() -> crate::model::load::LoadedModel {
        let mut m = tiny();
        m.net.set_cpu_precision(CpuPrecision::Fast);
        m
    }

    /// The tiny model quantized to int8, with the fast precision (W8A8 prompts).
    fn tiny_int8_fast(pool: &Pool) -> crate::model::load::LoadedModel {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        let mut m = crate::model::load::LoadedModel::load_int8(dir.to_str().unwrap(), pool).unwrap();
        m.net.set_cpu_precision(CpuPrecision::Fast);
        m
    }

    /// The tiny model quantized to Q4_K (its matrices of whole 256-value blocks; Q8_0 the
    /// others), with the fast precision (W4A8 decode on AVX2 and AVX-512).
    fn tiny_q4_k_fast(pool: &Pool) -> crate::model::load::LoadedModel {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        let mut m = crate::model::load::LoadedModel::load_quantized(dir.to_str().unwrap(), crate::model::quant::Quant::parse("q4_k").unwrap(), pool).unwrap();
        m.net.set_cpu_precision(CpuPrecision::Fast);
        m
    }

    /// With k-quant weights, the fast precision's decode steps are its plain reference's bits
    /// (what `verify --precision fast` holds them to) on every instruction set, and where the
    /// CPU has the W4A8 kernels they differ from the exact precision's (the inputs are
    /// quantized to int8).
    #[test]
    fn the_fast_decode_of_k_quants_is_its_reference() {
        crate::backend::cpu::kernels::for_each_isa(fast_decode_of_k_quants_is_its_reference);
    }

    fn fast_decode_of_k_quants_is_its_reference(isa: crate::backend::cpu::kernels::Isa) {
        let pool = Pool::new(2);
        let prompt: Vec<u32> = (0..13u32).map(|i| (i * 211 + 7) % 1024).collect();
        let run = |p: CpuPrecision| {
            let mut m = tiny_q4_k_fast(&pool);
            m.net.set_cpu_precision(p);
            let mut st = State::new(&m.net.config);
            m.net.forward(&pool, &prompt, &mut st, Logits::Last).unwrap();
            let mut logits = Vec::new();
            for t in 0..6u32 {
                m.net.decode_batch(&pool, &[(t * 97 + 3) % 1024], &mut [&mut st]).unwrap();
                logits.extend_from_slice(&st.last_logits);
            }
            logits
        };
        let (exact, fast, reference) = (run(CpuPrecision::Exact), run(CpuPrecision::Fast), run(CpuPrecision::FastReference));
        assert!(fast.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?}: the fast decode is not its reference's bits");
        if isa >= crate::backend::cpu::kernels::Isa::Avx2 {
            let worst = exact.iter().zip(&fast).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(worst > 0.0, "{isa:?}: the W4A8 kernel changed nothing");
            assert!(worst < 0.5, "{isa:?}: W4A8 moved a logit by {worst}");
        }
    }

    /// The fast precision computes other logits than the exact one (its products take bf16
    /// inputs): the tensor-core emulation's (the same arithmetic summed in another order) up to
    /// summation-order differences, which are much smaller than bf16's own.
    #[test]
    fn the_fast_precision_is_the_tensor_core_arithmetic() {
        let pool = Pool::new(2);
        let tokens: Vec<u32> = (0..40u32).map(|i| (i * 211 + 7) % 1024).collect();
        let run = |p: CpuPrecision| {
            let mut m = tiny();
            m.net.set_cpu_precision(p);
            m.net.forward(&pool, &tokens, &mut State::new(&m.net.config), Logits::All).unwrap()
        };
        let (exact, emulated, fast) = (run(CpuPrecision::Exact), run(CpuPrecision::Bf16Inputs), run(CpuPrecision::Fast));
        let worst = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        let (from_exact, from_emulated) = (worst(&exact, &fast), worst(&emulated, &fast));
        eprintln!("fast: {from_exact} from exact, {from_emulated} from the tensor-core emulation");
        assert!(from_exact > 0.0, "the fast precision changed nothing");
        assert!(from_emulated <= from_exact / 4.0, "fast is {from_emulated} from the emulation, {from_exact} from exact");
    }

    /// A static-shape dispatch padded on the right gives exactly the state and logits of the
    /// unpadded one: pads neither decay nor write the recurrent state, nor enter the conv
    /// window, the KV cache or attention. From an empty state and from one mid-sequence, for
    /// one real token, a partial chunk, a whole chunk and more.
    #[test]
    fn a_padded_dispatch_equals_the_unpadded_one_exactly() {
        let m = tiny();
        let pool = Pool::new(2);
        let _same_kernels = crate::backend::cpu::kernels::hold_isa();
        let prefix: Vec<u32> = (0..37).map(|i| (i * 13 + 5) % 1024).collect();
        for start in [0usize, 37] {
            let mut base = State::new(&m.net.config);
            if start > 0 {
                m.net.forward(&pool, &prefix, &mut base, Logits::Last).unwrap();
            }
            for (valid, rows) in [(1usize, 32usize), (10, 32), (64, 96), (65, 128), (100, 160)] {
                let mut tokens: Vec<u32> = (0..valid as u32).map(|i| (i * 101 + 7) % 1024).collect();
                let (mut unpadded, mut padded) = (base.clone(), base.clone());
                m.net.forward_padded(&pool, &tokens, valid, &mut unpadded, Logits::Last).unwrap();
                tokens.resize(rows, 0);
                m.net.forward_padded(&pool, &tokens, valid, &mut padded, Logits::Last).unwrap();
                assert!(padded == unpadded, "start {start}, {valid} real of {rows} rows: states or logits differ");
                assert_eq!(padded.position, start + valid);
                // Without logits: the same state, none left behind.
                let mut skipped = base.clone();
                m.net.forward_padded(&pool, &tokens, valid, &mut skipped, Logits::Skip).unwrap();
                assert!(skipped.last_logits.is_empty() && skipped.layers == padded.layers && skipped.position == padded.position);
            }
        }
    }

    /// One batched decode step over sequences at different positions equals stepping each
    /// alone, bit for bit, for batches of up to 8 rows and past them, with the weights as
    /// stored and quantized to int8, and with the fast precision on both and on Q4_K weights.
    #[test]
    fn a_batched_decode_step_equals_one_sequence_at_a_time() {
        let pool = Pool::new(2);
        let _same_kernels = crate::backend::cpu::kernels::hold_isa();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        for m in [tiny(), crate::model::load::LoadedModel::load_int8(dir.to_str().unwrap(), &pool).unwrap(), tiny_fast(), tiny_int8_fast(&pool), tiny_q4_k_fast(&pool)] {
            for lengths in [&[3usize, 70, 130][..], &[1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144]] {
                let tokens: Vec<u32> = (0..lengths.len() as u32).map(|i| (i * 397 + 5) % 1024).collect();
                batched_step_equals_steps_alone(&m, &pool, lengths, &tokens);
            }
        }
        let m = tiny();
        // A batch whose tokens and states do not pair up is refused.
        let mut st = State::new(&m.net.config);
        assert!(m.net.decode_batch(&pool, &[1, 2], &mut [&mut st]).is_err());
    }

    fn batched_step_equals_steps_alone(m: &crate::model::load::LoadedModel, pool: &Pool, lengths: &[usize], tokens: &[u32]) {
        let mut states: Vec<State> = lengths
            .iter()
            .map(|&n| {
                let mut st = State::new(&m.net.config);
                let p: Vec<u32> = (0..n as u32).map(|i| (i * 31 + n as u32) % 1024).collect();
                m.net.forward(pool, &p, &mut st, Logits::Last).unwrap();
                st
            })
            .collect();
        let mut alone = states.clone();
        for (st, &tok) in alone.iter_mut().zip(tokens) {
            m.net.decode_batch(pool, &[tok], &mut [st]).unwrap();
        }
        let mut refs: Vec<&mut State> = states.iter_mut().collect();
        m.net.decode_batch(pool, tokens, &mut refs).unwrap();
        for (i, (b, a)) in states.iter().zip(&alone).enumerate() {
            assert!(b == a, "a batch of {}: sequence {i} (position {}) differs from its step alone", lengths.len(), a.position);
        }
    }

    /// A call that fails leaves the state untouched (no part of the input is applied).
    #[test]
    fn a_rejected_input_leaves_the_state_as_it_was() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        let m = crate::model::load::LoadedModel::load(dir.to_str().unwrap()).unwrap();
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
