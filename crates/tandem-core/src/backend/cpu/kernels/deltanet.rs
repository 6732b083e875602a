//! The gated delta rule of one value head (docs/qwen35.md §2.4.1-2.4.2), in f32.
//!
//! State `S` is `[Dk, Dv]` row-major (row = key channel). Inputs per token: `q`, `k` (already
//! l2-normalised, q scaled by 1/√Dk), `v`, the write strength `beta` and the log-decay `g ≤ 0`.
//! `recurrent_step` is the per-token definition, which the CPU engine runs for decode and
//! prefill alike (`forward.rs` says why); `chunked` is the WY/UT-transform form that the
//! reference implementation and the GPU's prefill use; the test below holds them to each other.


/// Chunk length of the chunked algorithm (the reference's, so rounding follows the same grouping).
pub const CHUNK: usize = 64;

super::multiversion! {
    /// One decode step: decay, delta-rule write, read.
    pub fn recurrent_step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], beta: f32, g: f32, out: &mut [f32]) => recurrent_step_body
}

/// One token's inputs to one head's delta rule.
#[derive(Clone, Copy)]
pub struct StepInput<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub beta: f32,
    pub g: f32,
}

super::multiversion! {
    /// `recurrent_step` for each of `steps` in turn, token t's output at `out[t * dv..]`, with
    /// the same bits: every state element and every sum takes the same operations in the same
    /// order. Token t's write and read pass over the state and token t + 1's decay and `Sᵀk`
    /// pass are one pass (row by row), which halves the state's traffic through the cache.
    pub fn recurrent_steps(s: &mut [f32], steps: &[StepInput], out: &mut [f32]) => recurrent_steps_body
}

super::multiversion! {
    /// Process `L = beta.len()` tokens of one head. `q`, `k`: `[L, Dk]`; `v`, `out`: `[L, Dv]`.
    pub fn chunked(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], beta: &[f32], g: &[f32], out: &mut [f32], scratch: &mut ChunkScratch) => chunked_body
}

#[inline(always)]
fn recurrent_step_body(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], beta: f32, g: f32, out: &mut [f32]) {
    let (dk, dv) = (k.len(), v.len());
    debug_assert_eq!(s.len(), dk * dv);
    let alpha = g.exp();
    // Pass 1: S ← α S, and kv_mem = Sᵀ k on the decayed state.
    let mut kv_mem = [0f32; 512];
    let kv_mem = &mut kv_mem[..dv];
    for i in 0..dk {
        let row = &mut s[i * dv..(i + 1) * dv];
        let ki = k[i];
        for (sv, m) in row.iter_mut().zip(kv_mem.iter_mut()) {
            *sv *= alpha;
            *m = sv.mul_add(ki, *m);
        }
    }
    // u = β (v − Sᵀk)
    for (m, &vv) in kv_mem.iter_mut().zip(v) {
        *m = beta * (vv - *m);
    }
    // Pass 2: S ← S + k ⊗ u, and out = Sᵀ q on the updated state.
    out.iter_mut().for_each(|o| *o = 0.0);
    for i in 0..dk {
        let row = &mut s[i * dv..(i + 1) * dv];
        let (ki, qi) = (k[i], q[i]);
        for ((sv, &u), o) in row.iter_mut().zip(kv_mem.iter()).zip(out.iter_mut()) {
            *sv = ki.mul_add(u, *sv);
            *o = sv.mul_add(qi, *o);
        }
    }
}

/// Value channels per pass of `recurrent_steps`: every element of the state, of `u`, of
/// `Sᵀk` and of the output belongs to one value channel and is computed from that channel
/// alone, so the channels can be taken a block at a time, each block through all the call's
/// tokens. A block of 64 channels of the state (128 key rows × 64 × 4 B = 32 KB) stays in L1
/// from token to token, and the block's `u`, output and next `Sᵀk` stay in registers.
const COLS: usize = 64;

#[inline(always)]
fn recurrent_steps_body(s: &mut [f32], steps: &[StepInput], out: &mut [f32]) {
    let Some(first) = steps.first() else { return };
    let (dk, dv) = (first.k.len(), first.v.len());
    debug_assert_eq!(s.len(), dk * dv);
    debug_assert_eq!(out.len(), steps.len() * dv);
    for c0 in (0..dv).step_by(COLS) {
        let cols = c0..(c0 + COLS).min(dv);
        #[cfg(target_arch = "x86_64")]
        if cols.len() == COLS && crate::backend::cpu::kernels::isa() >= crate::backend::cpu::kernels::Isa::Avx512 {
            // SAFETY: feature checked; the block's columns lie inside every row of `s`, of
            // each step's `v` and of each token's part of `out` (lengths asserted above).
            unsafe { steps_on_columns_avx512(s.as_mut_ptr(), dv, steps, out.as_mut_ptr(), c0) };
            continue;
        }
        steps_on_columns(s, dv, steps, out, cols);
    }
}

/// `recurrent_steps` for the value channels `cols` (at most `COLS`): token t's write and
/// read pass over the state and token t + 1's decay and `Sᵀk` pass are one pass, row by row.
#[inline(always)]
fn steps_on_columns(s: &mut [f32], dv: usize, steps: &[StepInput], out: &mut [f32], cols: std::ops::Range<usize>) {
    let (dk, w) = (steps[0].k.len(), cols.len());
    let row = |i: usize| i * dv + cols.start..i * dv + cols.end;
    // Token 0's pass 1: S ← α S, kv_mem = Sᵀ k.
    let (mut kv_mem, mut next_mem, mut o) = ([0f32; COLS], [0f32; COLS], [0f32; COLS]);
    let alpha = steps[0].g.exp();
    for i in 0..dk {
        let ki = steps[0].k[i];
        for (sv, m) in s[row(i)].iter_mut().zip(&mut kv_mem[..w]) {
            *sv *= alpha;
            *m = sv.mul_add(ki, *m);
        }
    }
    for (t, step) in steps.iter().enumerate() {
        // u = β (v − Sᵀk)
        for (m, &vv) in kv_mem[..w].iter_mut().zip(&step.v[cols.clone()]) {
            *m = step.beta * (vv - *m);
        }
        let u = &kv_mem[..w];
        o[..w].iter_mut().for_each(|x| *x = 0.0);
        match steps.get(t + 1) {
            // Pass 2 of token t (S ← S + k ⊗ u, out = Sᵀ q), then pass 1 of token t + 1 on
            // the same row.
            Some(next) => {
                let alpha = next.g.exp();
                next_mem[..w].iter_mut().for_each(|x| *x = 0.0);
                for i in 0..dk {
                    let (ki, qi, kn) = (step.k[i], step.q[i], next.k[i]);
                    for (((sv, &uj), oj), mj) in s[row(i)].iter_mut().zip(u).zip(&mut o[..w]).zip(&mut next_mem[..w]) {
                        *sv = ki.mul_add(uj, *sv);
                        *oj = sv.mul_add(qi, *oj);
                        *sv *= alpha;
                        *mj = sv.mul_add(kn, *mj);
                    }
                }
                std::mem::swap(&mut kv_mem, &mut next_mem);
            }
            None => {
                for i in 0..dk {
                    let (ki, qi) = (step.k[i], step.q[i]);
                    for ((sv, &uj), oj) in s[row(i)].iter_mut().zip(u).zip(&mut o[..w]) {
                        *sv = ki.mul_add(uj, *sv);
                        *oj = sv.mul_add(qi, *oj);
                    }
                }
            }
        }
        out[t * dv + cols.start..t * dv + cols.end].copy_from_slice(&o[..w]);
    }
}

/// `steps_on_columns` for the `COLS` channels from `c0`, the block's `Sᵀk`, `u`, output and
/// next `Sᵀk` held in registers: the same operations on each value in the same order, so
/// the same bits.
///
/// # Safety
/// AVX-512F; `s` holds `dk` rows of `dv`, `out` `steps.len()` rows of `dv`, and
/// `c0 + COLS <= dv`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn steps_on_columns_avx512(s: *mut f32, dv: usize, steps: &[StepInput], out: *mut f32, c0: usize) {
    use std::arch::x86_64::*;
    const V: usize = COLS / 16;
    let dk = steps[0].k.len();
    let row = |i: usize| s.add(i * dv + c0);
    let zero = _mm512_setzero_ps();
    let mut kv_mem = [zero; V];
    let alpha = _mm512_set1_ps(steps[0].g.exp());
    for i in 0..dk {
        let (p, ki) = (row(i), _mm512_set1_ps(steps[0].k[i]));
        for (j, m) in kv_mem.iter_mut().enumerate() {
            let sv = _mm512_mul_ps(_mm512_loadu_ps(p.add(16 * j)), alpha);
            _mm512_storeu_ps(p.add(16 * j), sv);
            *m = _mm512_fmadd_ps(sv, ki, *m);
        }
    }
    for (t, step) in steps.iter().enumerate() {
        let beta = _mm512_set1_ps(step.beta);
        let u: [__m512; V] = std::array::from_fn(|j| _mm512_mul_ps(beta, _mm512_sub_ps(_mm512_loadu_ps(step.v.as_ptr().add(c0 + 16 * j)), kv_mem[j])));
        let mut o = [zero; V];
        match steps.get(t + 1) {
            Some(next) => {
                let alpha = _mm512_set1_ps(next.g.exp());
                kv_mem = [zero; V];
                for i in 0..dk {
                    let (p, ki, qi, kn) = (row(i), _mm512_set1_ps(step.k[i]), _mm512_set1_ps(step.q[i]), _mm512_set1_ps(next.k[i]));
                    for j in 0..V {
                        let sv = _mm512_fmadd_ps(ki, u[j], _mm512_loadu_ps(p.add(16 * j)));
                        o[j] = _mm512_fmadd_ps(sv, qi, o[j]);
                        let sv = _mm512_mul_ps(sv, alpha);
                        _mm512_storeu_ps(p.add(16 * j), sv);
                        kv_mem[j] = _mm512_fmadd_ps(sv, kn, kv_mem[j]);
                    }
                }
            }
            None => {
                for i in 0..dk {
                    let (p, ki, qi) = (row(i), _mm512_set1_ps(step.k[i]), _mm512_set1_ps(step.q[i]));
                    for j in 0..V {
                        let sv = _mm512_fmadd_ps(ki, u[j], _mm512_loadu_ps(p.add(16 * j)));
                        _mm512_storeu_ps(p.add(16 * j), sv);
                        o[j] = _mm512_fmadd_ps(sv, qi, o[j]);
                    }
                }
            }
        }
        for (j, &v) in o.iter().enumerate() {
            _mm512_storeu_ps(out.add(t * dv + c0 + 16 * j), v);
        }
    }
}

/// Scratch buffers of `chunked`, reused across heads and calls.
#[derive(Default)]
pub struct ChunkScratch {
    g_cum: Vec<f32>,
    /// exp(G_i − G_j) for j ≤ i, else 0: the decay between two tokens of a chunk.
    decay: Vec<f32>,
    a: Vec<f32>,
    p: Vec<f32>,
    u: Vec<f32>,
    w: Vec<f32>,
    kb: Vec<f32>,
    k_t: Vec<f32>,
    q_e: Vec<f32>,
    kd_t: Vec<f32>,
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn chunked_body(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], beta: &[f32], g: &[f32], out: &mut [f32], scratch: &mut ChunkScratch) {
    let l = beta.len();
    let dk = k.len() / l.max(1);
    let dv = v.len() / l.max(1);
    debug_assert_eq!(s.len(), dk * dv);
    let sc = scratch;
    sc.g_cum.resize(CHUNK, 0.0);
    sc.decay.resize(CHUNK * CHUNK, 0.0);
    sc.a.resize(CHUNK * CHUNK, 0.0);
    sc.p.resize(CHUNK * CHUNK, 0.0);
    sc.u.resize(CHUNK * dv, 0.0);
    sc.w.resize(CHUNK * dk, 0.0);
    sc.kb.resize(CHUNK * dk, 0.0);
    sc.k_t.resize(dk * CHUNK, 0.0);
    sc.q_e.resize(CHUNK * dk, 0.0);
    sc.kd_t.resize(dk * CHUNK, 0.0);

    let mut c0 = 0;
    while c0 < l {
        // The reference pads the last chunk with zeros (β = 0, g = 0, k = 0): those rows change
        // neither the state nor the real rows, so working on the real rows alone is identical.
        let n = (l - c0).min(CHUNK);
        let (qc, kc, vc) = (&q[c0 * dk..(c0 + n) * dk], &k[c0 * dk..(c0 + n) * dk], &v[c0 * dv..(c0 + n) * dv]);
        let (bc, gc) = (&beta[c0..c0 + n], &g[c0..c0 + n]);
        let oc = &mut out[c0 * dv..(c0 + n) * dv];

        let gcum = &mut sc.g_cum[..n];
        let mut acc = 0f32;
        for (gi, &x) in gcum.iter_mut().zip(gc) {
            acc += x;
            *gi = acc;
        }
        for i in 0..n {
            for j in 0..n {
                sc.decay[i * CHUNK + j] = if j <= i { (gcum[i] - gcum[j]).exp() } else { 0.0 };
            }
        }
        for i in 0..n {
            for d in 0..dk {
                sc.kb[i * dk + d] = bc[i] * kc[i * dk + d];
                sc.k_t[d * CHUNK + i] = kc[i * dk + d];
            }
        }
        // A = (kβ · kᵀ) ⊙ decay (strictly lower part used); P = (q · kᵀ) ⊙ decay (diagonal too).
        sc.a[..n * CHUNK].iter_mut().for_each(|x| *x = 0.0);
        sc.p[..n * CHUNK].iter_mut().for_each(|x| *x = 0.0);
        gemm_acc(n, n, dk, &sc.kb, dk, &sc.k_t, CHUNK, &mut sc.a, CHUNK, 1.0);
        gemm_acc(n, n, dk, qc, dk, &sc.k_t, CHUNK, &mut sc.p, CHUNK, 1.0);
        for i in 0..n {
            for j in 0..n {
                sc.a[i * CHUNK + j] *= sc.decay[i * CHUNK + j];
                sc.p[i * CHUNK + j] *= sc.decay[i * CHUNK + j];
            }
        }
        // (I + A) U = β v  and  (I + A) W = kβ exp(G), by forward substitution.
        for i in 0..n {
            let eg = gcum[i].exp();
            for d in 0..dv {
                sc.u[i * dv + d] = bc[i] * vc[i * dv + d];
            }
            for d in 0..dk {
                sc.w[i * dk + d] = sc.kb[i * dk + d] * eg;
            }
            for j in 0..i {
                let aij = sc.a[i * CHUNK + j];
                let (u_done, u_rest) = sc.u.split_at_mut(i * dv);
                axpy(-aij, &u_done[j * dv..(j + 1) * dv], &mut u_rest[..dv]);
                let (w_done, w_rest) = sc.w.split_at_mut(i * dk);
                axpy(-aij, &w_done[j * dk..(j + 1) * dk], &mut w_rest[..dk]);
            }
        }
        // V' = U − W S  (stored back into U).
        gemm_acc(n, dv, dk, &sc.w, dk, s, dv, &mut sc.u, dv, -1.0);
        // O = (q ⊙ exp(G)) S + P V'
        for i in 0..n {
            let eg = gcum[i].exp();
            for d in 0..dk {
                sc.q_e[i * dk + d] = qc[i * dk + d] * eg;
            }
        }
        oc.iter_mut().for_each(|x| *x = 0.0);
        gemm_acc(n, dv, dk, &sc.q_e, dk, s, dv, oc, dv, 1.0);
        gemm_acc(n, dv, n, &sc.p, CHUNK, &sc.u, dv, oc, dv, 1.0);
        // S ← exp(G_last) S + (k ⊙ exp(G_last − G))ᵀ V'
        let g_last = gcum[n - 1];
        let e_last = g_last.exp();
        s.iter_mut().for_each(|x| *x *= e_last);
        for i in 0..n {
            let e = (g_last - gcum[i]).exp();
            for d in 0..dk {
                sc.kd_t[d * CHUNK + i] = kc[i * dk + d] * e;
            }
        }
        gemm_acc(dk, dv, n, &sc.kd_t, CHUNK, &sc.u, dv, s, dv, 1.0);
        c0 += n;
    }
}

/// `c[i][j] += alpha · Σ_k a[i][k] · b[k][j]` for `i < m`, `j < n`, row-major with leading
/// dimensions `lda`, `ldb`, `ldc`: the small matrix products of a chunk (64 × 128 × 128 at
/// most). Called from `chunked_body`, so it is compiled into each of its instruction-set copies.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gemm_acc(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize, alpha: f32) {
    assert!(m == 0 || n == 0 || ((m - 1) * lda + k <= a.len() && (k.max(1) - 1) * ldb + n <= b.len() && (m - 1) * ldc + n <= c.len()));
    #[cfg(target_arch = "x86_64")]
    if super::isa() >= super::Isa::Avx512 {
        // SAFETY: feature checked; bounds asserted above.
        return unsafe { gemm_acc_avx512(m, n, k, a.as_ptr(), lda, b.as_ptr(), ldb, c.as_mut_ptr(), ldc, alpha) };
    }
    gemm_acc_portable(m, n, k, a, lda, b, ldb, c, ldc, alpha)
}

/// The plain definition (also the fallback): axpy over rows of `b`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gemm_acc_portable(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], ldc: usize, alpha: f32) {
    for i in 0..m {
        let crow = &mut c[i * ldc..i * ldc + n];
        for kk in 0..k {
            axpy(alpha * a[i * lda + kk], &b[kk * ldb..kk * ldb + n], crow);
        }
    }
}

/// 4 rows × 32 columns of accumulators in registers; partial tiles use masked loads/stores.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_acc_avx512(m: usize, n: usize, k: usize, a: *const f32, lda: usize, b: *const f32, ldb: usize, c: *mut f32, ldc: usize, alpha: f32) {
    use std::arch::x86_64::*;

    /// One tile of R rows (a const, so the R accumulator pairs stay independent FMA chains
    /// interleaved in one loop).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize>(k: usize, a: *const f32, lda: usize, b: *const f32, ldb: usize, c: *mut f32, ldc: usize, alpha: __m512, m0: __mmask16, m1: __mmask16) {
        let mut acc0 = [_mm512_setzero_ps(); R];
        let mut acc1 = [_mm512_setzero_ps(); R];
        for kk in 0..k {
            let bp = b.add(kk * ldb);
            let b0 = _mm512_maskz_loadu_ps(m0, bp);
            let b1 = _mm512_maskz_loadu_ps(m1, bp.add(16));
            for r in 0..R {
                let av = _mm512_set1_ps(*a.add(r * lda + kk));
                acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
            }
        }
        for r in 0..R {
            let cp = c.add(r * ldc);
            _mm512_mask_storeu_ps(cp, m0, _mm512_fmadd_ps(alpha, acc0[r], _mm512_maskz_loadu_ps(m0, cp)));
            _mm512_mask_storeu_ps(cp.add(16), m1, _mm512_fmadd_ps(alpha, acc1[r], _mm512_maskz_loadu_ps(m1, cp.add(16))));
        }
    }

    let alpha_v = _mm512_set1_ps(alpha);
    let mut j = 0;
    while j < n {
        let cols = (n - j).min(32);
        let m0: __mmask16 = if cols >= 16 { 0xFFFF } else { ((1u32 << cols) - 1) as u16 };
        let m1: __mmask16 = if cols >= 32 { 0xFFFF } else if cols > 16 { ((1u32 << (cols - 16)) - 1) as u16 } else { 0 };
        let mut i = 0;
        while i < m {
            let (ap, bp, cp) = (a.add(i * lda), b.add(j), c.add(i * ldc + j));
            match (m - i).min(4) {
                4 => tile::<4>(k, ap, lda, bp, ldb, cp, ldc, alpha_v, m0, m1),
                3 => tile::<3>(k, ap, lda, bp, ldb, cp, ldc, alpha_v, m0, m1),
                2 => tile::<2>(k, ap, lda, bp, ldb, cp, ldc, alpha_v, m0, m1),
                _ => tile::<1>(k, ap, lda, bp, ldb, cp, ldc, alpha_v, m0, m1),
            }
            i += 4;
        }
        j += 32;
    }
}

#[inline(always)]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yv, &xv) in y.iter_mut().zip(x) {
        *yv = a.mul_add(xv, *yv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand_vec(seed: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn normalize_rows(x: &mut [f32], d: usize, scale: f32) {
        for r in x.chunks_exact_mut(d) {
            crate::backend::cpu::kernels::norm::l2_normalize(r);
            r.iter_mut().for_each(|v| *v *= scale);
        }
    }

    /// On every instruction set: the blocked kernel against the plain definition.
    #[test]
    fn gemm_acc_matches_its_plain_definition() {
        crate::backend::cpu::kernels::for_each_isa(|_| gemm_acc_cases());
    }

    fn gemm_acc_cases() {
        let mut seed = 3;
        for &(m, n, k) in &[(1, 1, 1), (5, 17, 9), (64, 128, 128), (3, 40, 64), (64, 64, 128)] {
            let (lda, ldb, ldc) = (k + 3, n + 5, n + 1);
            let a = rand_vec(&mut seed, m * lda);
            let b = rand_vec(&mut seed, k * ldb);
            let c0 = rand_vec(&mut seed, m * ldc);
            let (mut c1, mut c2) = (c0.clone(), c0.clone());
            gemm_acc(m, n, k, &a, lda, &b, ldb, &mut c1, ldc, -0.5);
            gemm_acc_portable(m, n, k, &a, lda, &b, ldb, &mut c2, ldc, -0.5);
            let err = c1.iter().zip(&c2).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(err < 1e-4, "{m}x{n}x{k}: {err}");
            assert_eq!(c1[ldc - 1], c0[ldc - 1], "padding columns untouched");
        }
    }

    /// Many tokens through `recurrent_steps` give the bits of `recurrent_step` token by token:
    /// the state and every output (value channels in whole blocks, which AVX-512 runs in
    /// registers, and in a part block).
    #[test]
    fn recurrent_steps_give_the_bits_of_steps_one_by_one() {
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let mut r = crate::rng::Rng::new(7);
            let mut rnd = |n: usize| -> Vec<f32> { (0..n).map(|_| (r.next_f64() * 2.0 - 1.0) as f32).collect() };
            for (n, dk, dv) in [(1usize, 16, 24), (2, 16, 24), (5, 16, 24), (1, 8, 2 * COLS + 24), (6, 8, 2 * COLS + 24), (3, 128, 128)] {
                let s0 = rnd(dk * dv);
                let (q, k, v) = (rnd(n * dk), rnd(n * dk), rnd(n * dv));
                let (beta, g): (Vec<f32>, Vec<f32>) = (0..n).map(|i| (0.3 + 0.1 * i as f32, -0.05 * (i + 1) as f32)).unzip();
                let steps: Vec<StepInput> = (0..n).map(|i| StepInput { q: &q[i * dk..][..dk], k: &k[i * dk..][..dk], v: &v[i * dv..][..dv], beta: beta[i], g: g[i] }).collect();
                let (mut s1, mut out1) = (s0.clone(), vec![0f32; n * dv]);
                recurrent_steps(&mut s1, &steps, &mut out1);
                let (mut s2, mut out2) = (s0.clone(), vec![0f32; n * dv]);
                for (i, st) in steps.iter().enumerate() {
                    recurrent_step(&mut s2, st.q, st.k, st.v, st.beta, st.g, &mut out2[i * dv..(i + 1) * dv]);
                }
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&s1), bits(&s2), "{isa:?} {n} tokens, {dk}x{dv}: states differ");
                assert_eq!(bits(&out1), bits(&out2), "{isa:?} {n} tokens, {dk}x{dv}: outputs differ");
            }
        });
    }

    /// Chunked and recurrent forms agree, across chunk boundaries and from a non-zero state, on
    /// every instruction set.
    #[test]
    fn chunked_equals_recurrent() {
        crate::backend::cpu::kernels::for_each_isa(|_| chunked_vs_recurrent_cases());
    }

    fn chunked_vs_recurrent_cases() {
        let mut seed = 42;
        let (dk, dv) = (32, 16);
        for &l in &[1usize, 5, 64, 65, 150] {
            let mut q = rand_vec(&mut seed, l * dk);
            let mut k = rand_vec(&mut seed, l * dk);
            normalize_rows(&mut q, dk, 1.0 / (dk as f32).sqrt());
            normalize_rows(&mut k, dk, 1.0);
            let v = rand_vec(&mut seed, l * dv);
            let beta: Vec<f32> = rand_vec(&mut seed, l).iter().map(|x| 0.5 + 0.5 * x).collect();
            let g: Vec<f32> = rand_vec(&mut seed, l).iter().map(|x| -0.3 * (1.0 + x)).collect();
            let s0 = rand_vec(&mut seed, dk * dv);

            let mut s_rec = s0.clone();
            let mut o_rec = vec![0f32; l * dv];
            for t in 0..l {
                recurrent_step(
                    &mut s_rec,
                    &q[t * dk..(t + 1) * dk],
                    &k[t * dk..(t + 1) * dk],
                    &v[t * dv..(t + 1) * dv],
                    beta[t],
                    g[t],
                    &mut o_rec[t * dv..(t + 1) * dv],
                );
            }
            let mut s_chk = s0.clone();
            let mut o_chk = vec![0f32; l * dv];
            chunked(&mut s_chk, &q, &k, &v, &beta, &g, &mut o_chk, &mut ChunkScratch::default());
            let err_o = o_rec.iter().zip(&o_chk).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let err_s = s_rec.iter().zip(&s_chk).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err_o < 1e-4 && err_s < 1e-4, "L={l}: out err {err_o}, state err {err_s}");
        }
    }
}
