//! `out = x · Wᵀ` for a weight matrix in its stored dtype: the GEMV of decode (one token:
//! bound by how fast the weights stream from memory) and the GEMM of prefill (many tokens:
//! bound by FMA throughput). `matmul_ref` is the plain definition the fast paths are tested
//! against. Work is split over the pool by output rows.
//!
//! Activations stay f32 and every product is an f32 FMA (weights are widened on the fly), so
//! the fast paths differ from the reference only in summation order.

use crate::pool::Pool;
use crate::tensor::{bf16_to_f32, f16_to_f32, Matrix, WeightData};

/// Reference: `out[ti * w.rows + r] = Σ_k x[ti * w.cols + k] · w[r, k]`, summed in f64.
pub fn matmul_ref(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), t * k);
    assert_eq!(out.len(), t * n);
    for ti in 0..t {
        for r in 0..n {
            let mut acc = 0f64;
            for i in 0..k {
                acc += x[ti * k + i] as f64 * weight(w, r, i) as f64;
            }
            out[ti * n + r] = acc as f32;
        }
    }
}

/// One weight as f32 (int8: dequantized with its row scale).
pub fn weight(w: &Matrix, r: usize, i: usize) -> f32 {
    let k = w.cols;
    match &w.data {
        WeightData::Bf16(b) => bf16_to_f32(b.as_slice()[r * k + i]),
        WeightData::F16(b) => f16_to_f32(b.as_slice()[r * k + i]),
        WeightData::F32(b) => b.as_slice()[r * k + i],
        WeightData::Int8 { q, scales } => q.as_slice()[r * k + i] as f32 * scales.as_slice()[r],
    }
}

/// A raw output pointer that worker threads may write disjoint parts of.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out = x · Wᵀ` on the pool: GEMV for one token, packed GEMM for more.
pub fn matmul(pool: &Pool, x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
    assert_eq!(x.len(), t * w.cols, "matmul input has the wrong length");
    assert_eq!(out.len(), t * w.rows, "matmul output has the wrong length");
    let o = OutPtr(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if t == 1 && matches!(w.data, WeightData::Int8 { .. }) && w.cols % 32 == 0 && super::isa() == super::Isa::Avx512 {
        // int8 weights × x rounded to int16 (one scale per call): integer multiply-adds,
        // half the instructions of widening every weight to f32 (see avx512::gemv_i8_rows).
        let (x16, x_scale) = quantize_i16(x);
        pool.for_ranges(w.rows, 16, &|rows| {
            let o = o;
            // SAFETY: feature checked; ranges are disjoint and inside out.
            unsafe { avx512::gemv_i8_rows(&x16, x_scale, w, rows, o.0) }
        });
        return;
    }
    if t == 1 {
        // Row blocks of 16 keep each worker's rows on whole cache lines of the output.
        pool.for_ranges(w.rows, 16, &|rows| {
            let o = o;
            // SAFETY: ranges are disjoint and inside out.
            unsafe { gemv_rows(x, w, rows, o.0) }
        });
    } else {
        pool.for_ranges(w.rows, gemm::NR, &|rows| {
            let o = o;
            // SAFETY: as above; each worker writes columns `rows` of every output row.
            unsafe { gemm::gemm_rows(x, t, w, rows, o.0) }
        });
    }
}

/// `x ≈ q · scale` with `q` in i16 (`scale = max|x| / 32767`; relative error below 2e-5).
pub fn quantize_i16(x: &[f32]) -> (Vec<i16>, f32) {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = if max > 0.0 { max / 32767.0 } else { 1.0 };
    (x.iter().map(|v| (v / scale).round() as i16).collect(), scale)
}

/// Rows `rows` of the one-token product.
///
/// # Safety
/// `out` must be valid for writes at every index in `rows`.
pub unsafe fn gemv_rows(x: &[f32], w: &Matrix, rows: std::ops::Range<usize>, out: *mut f32) {
    #[cfg(target_arch = "x86_64")]
    match super::isa() {
        super::Isa::Avx512 if w.cols % 16 == 0 => return avx512::gemv_rows(x, w, rows, out),
        super::Isa::Avx512 | super::Isa::Avx2 => return gemv_rows_avx2(x, w, rows, out),
        super::Isa::Portable => {}
    }
    gemv_rows_portable(x, w, rows, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_rows_avx2(x: &[f32], w: &Matrix, rows: std::ops::Range<usize>, out: *mut f32) {
    gemv_rows_portable(x, w, rows, out)
}

/// Portable body (vectorised by the compiler for the caller's target features): widen a row to
/// f32 into an L1-resident buffer, then dot it with x.
#[inline(always)]
unsafe fn gemv_rows_portable(x: &[f32], w: &Matrix, rows: std::ops::Range<usize>, out: *mut f32) {
    let k = w.cols;
    let mut row = vec![0f32; k];
    for r in rows {
        let scale = widen_row(w, r, &mut row);
        *out.add(r) = dot(x, &row) * scale;
    }
}

/// Row `r` of `w` as f32 into `buf`; returns the factor to apply to a dot with it (the int8
/// row scale, else 1).
#[inline(always)]
fn widen_row(w: &Matrix, r: usize, buf: &mut [f32]) -> f32 {
    widen_row_range(w, r, 0, w.cols, buf)
}

/// Columns `k0..k0 + kc` of row `r` as f32; returns the row's int8 scale (else 1).
#[inline(always)]
fn widen_row_range(w: &Matrix, r: usize, k0: usize, kc: usize, buf: &mut [f32]) -> f32 {
    let base = r * w.cols + k0;
    match &w.data {
        WeightData::Bf16(b) => {
            for (d, &s) in buf.iter_mut().zip(&b.as_slice()[base..base + kc]) {
                *d = bf16_to_f32(s);
            }
            1.0
        }
        WeightData::F16(b) => {
            for (d, &s) in buf.iter_mut().zip(&b.as_slice()[base..base + kc]) {
                *d = f16_to_f32(s);
            }
            1.0
        }
        WeightData::F32(b) => {
            buf[..kc].copy_from_slice(&b.as_slice()[base..base + kc]);
            1.0
        }
        WeightData::Int8 { q, scales } => {
            for (d, &s) in buf.iter_mut().zip(&q.as_slice()[base..base + kc]) {
                *d = s as f32;
            }
            scales.as_slice()[r]
        }
    }
}

/// f32 dot product with 16 independent accumulators (vectorises to 1-2 FMA chains per lane).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 16];
    let chunks = n / 16;
    for c in 0..chunks {
        let (pa, pb) = (&a[c * 16..c * 16 + 16], &b[c * 16..c * 16 + 16]);
        for j in 0..16 {
            acc[j] = pa[j].mul_add(pb[j], acc[j]);
        }
    }
    let mut s = 0f32;
    for i in chunks * 16..n {
        s = a[i].mul_add(b[i], s);
    }
    // Pairwise reduction keeps the rounding error of long rows small.
    for width in [8, 4, 2, 1] {
        for j in 0..width {
            acc[j] += acc[j + width];
        }
    }
    acc[0] + s
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use crate::tensor::{Matrix, WeightData};

    /// 16 weights at `p` widened to f32.
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i))))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
    }

    /// int8 rows · int16 x: 32 weights per step widened to i16 (one shuffle) and multiplied
    /// pairwise into i32 by `vpmaddwd`; the i32 sums go to f32 every 256 inputs, well before
    /// they could overflow (|sum| < 256 · 127 · 32767 < 2^31).
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn gemv_i8_rows(x: &[i16], x_scale: f32, w: &Matrix, rows: std::ops::Range<usize>, out: *mut f32) {
        let WeightData::Int8 { q, scales } = &w.data else { unreachable!("int8 weights only") };
        let k = w.cols;
        let (qp, xp, sc) = (q.as_slice().as_ptr(), x.as_ptr(), scales.as_slice());
        let mut r = rows.start;
        while r + 4 <= rows.end {
            rows_i8::<4>(qp.add(r * k), k, xp, x_scale, &sc[r..r + 4], out.add(r));
            r += 4;
        }
        while r < rows.end {
            rows_i8::<1>(qp.add(r * k), k, xp, x_scale, &sc[r..r + 1], out.add(r));
            r += 1;
        }
    }

    /// R rows (a const: the R accumulators stay independent chains of one loop).
    #[inline(always)]
    unsafe fn rows_i8<const R: usize>(q: *const i8, k: usize, x: *const i16, x_scale: f32, scales: &[f32], out: *mut f32) {
        const BLOCK: usize = 256;
        let mut accf = [_mm512_setzero_ps(); R];
        let mut k0 = 0;
        while k0 < k {
            let kend = (k0 + BLOCK).min(k);
            let mut acci = [_mm512_setzero_si512(); R];
            let mut i = k0;
            while i < kend {
                let xv = _mm512_loadu_si512(x.add(i) as *const _);
                // The next row group starts a new page: fetch it ahead of the hardware prefetcher.
                for j in 0..R {
                    _mm_prefetch::<_MM_HINT_T0>(q.add((j + R) * k + i) as *const i8);
                }
                for j in 0..R {
                    let wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(q.add(j * k + i) as *const __m256i));
                    acci[j] = _mm512_add_epi32(acci[j], _mm512_madd_epi16(wv, xv));
                }
                i += 32;
            }
            for j in 0..R {
                accf[j] = _mm512_add_ps(accf[j], _mm512_cvtepi32_ps(acci[j]));
            }
            k0 = kend;
        }
        for j in 0..R {
            *out.add(j) = _mm512_reduce_add_ps(accf[j]) * scales[j] * x_scale;
        }
    }

    /// Four rows at a time: each x chunk is loaded once for four weight streams.
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    pub unsafe fn gemv_rows(x: &[f32], w: &Matrix, rows: std::ops::Range<usize>, out: *mut f32) {
        let k = w.cols;
        let xp = x.as_ptr();
        macro_rules! kernel {
            ($ptr:expr, $load:ident, $scale:expr) => {{
                let base = $ptr;
                let mut r = rows.start;
                while r + 4 <= rows.end {
                    let (p0, p1, p2, p3) = (base.add(r * k), base.add((r + 1) * k), base.add((r + 2) * k), base.add((r + 3) * k));
                    let (mut a0, mut a1, mut a2, mut a3) = (_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps());
                    let mut i = 0;
                    while i < k {
                        let xv = _mm512_loadu_ps(xp.add(i));
                        // Next row group, ahead of the hardware prefetcher (rows are 1-8 KB).
                        _mm_prefetch::<_MM_HINT_T0>(p3.add(k + i) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(p3.add(2 * k + i) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(p3.add(3 * k + i) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(p3.add(4 * k + i) as *const i8);
                        a0 = _mm512_fmadd_ps($load(p0.add(i)), xv, a0);
                        a1 = _mm512_fmadd_ps($load(p1.add(i)), xv, a1);
                        a2 = _mm512_fmadd_ps($load(p2.add(i)), xv, a2);
                        a3 = _mm512_fmadd_ps($load(p3.add(i)), xv, a3);
                        i += 16;
                    }
                    *out.add(r) = _mm512_reduce_add_ps(a0) * $scale(r);
                    *out.add(r + 1) = _mm512_reduce_add_ps(a1) * $scale(r + 1);
                    *out.add(r + 2) = _mm512_reduce_add_ps(a2) * $scale(r + 2);
                    *out.add(r + 3) = _mm512_reduce_add_ps(a3) * $scale(r + 3);
                    r += 4;
                }
                while r < rows.end {
                    let p0 = base.add(r * k);
                    let mut a0 = _mm512_setzero_ps();
                    let mut i = 0;
                    while i < k {
                        a0 = _mm512_fmadd_ps($load(p0.add(i)), _mm512_loadu_ps(xp.add(i)), a0);
                        i += 16;
                    }
                    *out.add(r) = _mm512_reduce_add_ps(a0) * $scale(r);
                    r += 1;
                }
            }};
        }
        let one = |_r: usize| 1.0f32;
        match &w.data {
            WeightData::Bf16(b) => kernel!(b.as_slice().as_ptr(), load_bf16, one),
            WeightData::F16(b) => kernel!(b.as_slice().as_ptr(), load_f16, one),
            WeightData::F32(b) => kernel!(b.as_slice().as_ptr(), _mm512_loadu_ps, one),
            WeightData::Int8 { q, scales } => {
                let s = scales.as_slice();
                kernel!(q.as_slice().as_ptr(), load_i8, |r: usize| s[r])
            }
        }
    }
}

/// The prefill GEMM: weights are widened to f32 into packed panels of `NR` output columns ×
/// `KC` inputs (amortised over all tokens), then a register-blocked micro-kernel computes
/// `MR` tokens × `NR` outputs with broadcast FMAs.
pub mod gemm {
    use super::*;

    pub const NR: usize = 32;
    pub const MR: usize = 12;
    pub const KC: usize = 256;

    /// Columns `cols` of `out[t, w.rows] = x · Wᵀ`.
    ///
    /// # Safety
    /// `out` must be valid for writes at `ti * w.rows + c` for `ti < t`, `c` in `cols`.
    pub unsafe fn gemm_rows(x: &[f32], t: usize, w: &Matrix, cols: std::ops::Range<usize>, out: *mut f32) {
        #[cfg(target_arch = "x86_64")]
        match crate::kernels::isa() {
            crate::kernels::Isa::Avx512 => return gemm_avx512(x, t, w, cols, out),
            crate::kernels::Isa::Avx2 => return gemm_avx2(x, t, w, cols, out),
            crate::kernels::Isa::Portable => {}
        }
        gemm_portable(x, t, w, cols, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    unsafe fn gemm_avx512(x: &[f32], t: usize, w: &Matrix, cols: std::ops::Range<usize>, out: *mut f32) {
        gemm_portable(x, t, w, cols, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn gemm_avx2(x: &[f32], t: usize, w: &Matrix, cols: std::ops::Range<usize>, out: *mut f32) {
        gemm_portable(x, t, w, cols, out)
    }

    /// Written so that the micro-kernel's `MR × NR` accumulator block stays in registers when
    /// compiled for AVX-512 (24 zmm accumulators, one broadcast and two loads per k).
    #[inline(always)]
    unsafe fn gemm_portable(x: &[f32], t: usize, w: &Matrix, cols: std::ops::Range<usize>, out: *mut f32) {
        let (n, k) = (w.rows, w.cols);
        let mut panel = vec![0f32; KC * NR];
        let mut rowbuf = vec![0f32; k];
        let mut scales = [1f32; NR];
        let mut c0 = cols.start;
        while c0 < cols.end {
            let nc = (cols.end - c0).min(NR);
            // Zero the output block; k-blocks accumulate into it.
            for ti in 0..t {
                for c in 0..nc {
                    *out.add(ti * n + c0 + c) = 0.0;
                }
            }
            let mut k0 = 0;
            while k0 < k {
                let kc = (k - k0).min(KC);
                // Pack panel[kk][c] = W[c0 + c, k0 + kk] (zero for missing columns).
                for c in 0..NR {
                    if c < nc {
                        scales[c] = widen_row_range(w, c0 + c, k0, kc, &mut rowbuf[..kc]);
                        for kk in 0..kc {
                            panel[kk * NR + c] = rowbuf[kk];
                        }
                    } else {
                        for kk in 0..kc {
                            panel[kk * NR + c] = 0.0;
                        }
                    }
                }
                let mut t0 = 0;
                while t0 < t {
                    let mr = (t - t0).min(MR);
                    #[cfg(target_arch = "x86_64")]
                    if crate::kernels::isa() == crate::kernels::Isa::Avx512 {
                        micro_avx512_dyn(x, k, t0, mr, k0, kc, &panel, out, n, c0, nc);
                        t0 += mr;
                        continue;
                    }
                    match mr {
                        MR => micro::<MR>(x, k, t0, k0, kc, &panel, out, n, c0, nc),
                        _ => micro_dyn(x, k, t0, mr, k0, kc, &panel, out, n, c0, nc),
                    }
                    t0 += mr;
                }
                k0 += kc;
            }
            // Int8 rows: apply each output column's scale once, after all k-blocks.
            if matches!(w.data, WeightData::Int8 { .. }) {
                for ti in 0..t {
                    for c in 0..nc {
                        *out.add(ti * n + c0 + c) *= scales[c];
                    }
                }
            }
            c0 += nc;
        }
    }

    /// `acc[m][c] += Σ_kk x[t0 + m, k0 + kk] · panel[kk][c]` for M tokens, added to `out`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro<const M: usize>(x: &[f32], k: usize, t0: usize, k0: usize, kc: usize, panel: &[f32], out: *mut f32, n: usize, c0: usize, nc: usize) {
        let mut acc = [[0f32; NR]; M];
        let xp = x.as_ptr();
        for kk in 0..kc {
            let prow: &[f32; NR] = &*(panel.as_ptr().add(kk * NR) as *const [f32; NR]);
            for m in 0..M {
                let xv = *xp.add((t0 + m) * k + k0 + kk);
                for c in 0..NR {
                    acc[m][c] = xv.mul_add(prow[c], acc[m][c]);
                }
            }
        }
        for m in 0..M {
            let o = out.add((t0 + m) * n + c0);
            for c in 0..nc {
                *o.add(c) += acc[m][c];
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn micro_dyn(x: &[f32], k: usize, t0: usize, mr: usize, k0: usize, kc: usize, panel: &[f32], out: *mut f32, n: usize, c0: usize, nc: usize) {
        match mr {
            1 => micro::<1>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            2 => micro::<2>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            3 => micro::<3>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            4 => micro::<4>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            5 => micro::<5>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            6 => micro::<6>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            7 => micro::<7>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            8 => micro::<8>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            9 => micro::<9>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            10 => micro::<10>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            _ => micro::<11>(x, k, t0, k0, kc, panel, out, n, c0, nc),
        }
    }

    /// The micro-kernel in AVX-512 intrinsics: M tokens × 32 outputs = 2M zmm accumulators,
    /// two panel loads and M broadcasts per k (the broadcasts fold into the FMAs).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro_avx512<const M: usize>(x: &[f32], k: usize, t0: usize, k0: usize, kc: usize, panel: &[f32], out: *mut f32, n: usize, c0: usize, nc: usize) {
        use std::arch::x86_64::*;
        let mut acc0 = [_mm512_setzero_ps(); M];
        let mut acc1 = [_mm512_setzero_ps(); M];
        let xp = x.as_ptr().add(t0 * k + k0);
        let pp = panel.as_ptr();
        for kk in 0..kc {
            let b0 = _mm512_loadu_ps(pp.add(kk * NR));
            let b1 = _mm512_loadu_ps(pp.add(kk * NR + 16));
            for m in 0..M {
                let a = _mm512_set1_ps(*xp.add(m * k + kk));
                acc0[m] = _mm512_fmadd_ps(a, b0, acc0[m]);
                acc1[m] = _mm512_fmadd_ps(a, b1, acc1[m]);
            }
        }
        let m0: __mmask16 = if nc >= 16 { 0xFFFF } else { ((1u32 << nc) - 1) as u16 };
        let m1: __mmask16 = if nc >= 32 { 0xFFFF } else if nc > 16 { ((1u32 << (nc - 16)) - 1) as u16 } else { 0 };
        for m in 0..M {
            let o = out.add((t0 + m) * n + c0);
            _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(acc0[m], _mm512_maskz_loadu_ps(m0, o)));
            _mm512_mask_storeu_ps(o.add(16), m1, _mm512_add_ps(acc1[m], _mm512_maskz_loadu_ps(m1, o.add(16))));
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro_avx512_dyn(x: &[f32], k: usize, t0: usize, mr: usize, k0: usize, kc: usize, panel: &[f32], out: *mut f32, n: usize, c0: usize, nc: usize) {
        match mr {
            12 => micro_avx512::<12>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            11 => micro_avx512::<11>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            10 => micro_avx512::<10>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            9 => micro_avx512::<9>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            8 => micro_avx512::<8>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            7 => micro_avx512::<7>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            6 => micro_avx512::<6>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            5 => micro_avx512::<5>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            4 => micro_avx512::<4>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            3 => micro_avx512::<3>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            2 => micro_avx512::<2>(x, k, t0, k0, kc, panel, out, n, c0, nc),
            _ => micro_avx512::<1>(x, k, t0, k0, kc, panel, out, n, c0, nc),
        }
    }

}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{f32_to_bf16, Buf};

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn test_matrices(n: usize, k: usize, seed: &mut u64) -> Vec<Matrix> {
        let wf: Vec<f32> = (0..n * k).map(|_| lcg(seed)).collect();
        vec![
            Matrix { rows: n, cols: k, data: WeightData::F32(Buf::from_vec(wf.clone())) },
            Matrix { rows: n, cols: k, data: WeightData::Bf16(Buf::from_vec(wf.iter().map(|&v| f32_to_bf16(v)).collect())) },
            Matrix { rows: n, cols: k, data: WeightData::F16(Buf::from_vec(wf.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect())) },
            crate::quant::quantize_int8(&Matrix { rows: n, cols: k, data: WeightData::F32(Buf::from_vec(wf)) }),
        ]
    }

    /// Every path (GEMV, GEMM with full and partial tiles) on every instruction set this CPU
    /// has, against the f64 reference, for every weight dtype, on one and on three threads.
    #[test]
    fn matmul_matches_reference_for_every_isa_dtype_and_shape() {
        crate::kernels::for_each_isa(|_| matmul_cases());
    }

    fn matmul_cases() {
        let mut seed = 7;
        for threads in [1, 3] {
            let pool = Pool::new(threads);
            for &(t, n, k) in &[(1, 5, 16), (1, 33, 96), (1, 70, 1024), (1, 7, 800), (2, 17, 48), (13, 64, 256), (25, 100, 300), (12, 32, 600)] {
                let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed)).collect();
                for w in &test_matrices(n, k, &mut seed) {
                    let mut want = vec![0f32; t * n];
                    let mut got = vec![0f32; t * n];
                    matmul_ref(&x, t, w, &mut want);
                    matmul(&pool, &x, t, w, &mut got);
                    // int8 decode rounds x to int16: at most half a step (max|x| / 65534) per input.
                    let x_max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        let r = i % n;
                        let mut tol = 2e-6 * (k as f32).sqrt() * 4.0;
                        if w.dtype() == crate::tensor::DType::I8 && t == 1 {
                            tol += (0..k).map(|c| weight(w, r, c).abs()).sum::<f32>() * x_max / 65534.0;
                        }
                        assert!((a - b).abs() <= tol, "{} t={t} n={n} k={k} [{i}]: {a} vs {b}", w.dtype());
                    }
                }
            }
        }
    }
}
