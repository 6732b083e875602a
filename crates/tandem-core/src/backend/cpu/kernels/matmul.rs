//! `out = x · Wᵀ` for a weight matrix in its stored dtype: the GEMV of decode (one token:
//! bound by how fast the weights stream from memory) and the GEMM of prefill (many tokens:
//! bound by FMA throughput). `matmul_ref` is the plain definition the fast paths are tested
//! against.
//!
//! Work is cut into units (a few rows of a GEMV, a few output columns of a GEMM) that the
//! pool's workers take in turn from a queue, and the products that read the same input (q, k
//! and v; gate and up) are run as one group: one fork/join for the group, and no worker waits
//! for a slower one at the end of each matrix.
//!
//! Activations stay f32 and every floating-point product is an f32 FMA (weights are widened
//! on the fly), so the fast paths differ from the reference only in summation order. The one
//! exception is the int8 GEMV, which multiplies int8 weights by `x` rounded to int16 in exact
//! integer arithmetic (relative rounding of x below 2e-5).

use crate::backend::cpu::pool::{Pool, WorkQueue};
use crate::model::tensor::{bf16_to_f32, f16_to_f32, Matrix, WeightData};

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
        WeightData::Int8 { q, scales, .. } => q.as_slice()[r * k + i] as f32 * scales.as_slice()[r],
    }
}

/// A raw output pointer that worker threads may write disjoint parts of.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Most tokens that take the GEMV path (a decode step of a batch of sequences): each weight row
/// is read once for all of them. Past this, the packed GEMM.
pub const GEMV_MAX_TOKENS: usize = 8;

/// `out = x · Wᵀ` on the pool: GEMV for up to `GEMV_MAX_TOKENS` tokens, packed GEMM for more.
pub fn matmul(pool: &Pool, x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
    matmul_group(pool, x, t, &mut [(w, out)]);
}

/// `out_i = x · W_iᵀ` for every `(W_i, out_i)` of the group, all in one pool call.
pub fn matmul_group(pool: &Pool, x: &[f32], t: usize, products: &mut [(&Matrix, &mut [f32])]) {
    let jobs = checked_jobs(x, t, products);
    if t <= GEMV_MAX_TOKENS {
        gemv_group(pool, x, t, &jobs);
    } else {
        gemm::gemm_group(pool, x, t, &jobs);
    }
}

/// `out_i = x · W_iᵀ` for every product of the group as a GEMM, whatever `t` (a static-shape
/// dispatch: its rows compute the same whether or not other rows come with them).
pub fn gemm_group(pool: &Pool, x: &[f32], t: usize, products: &mut [(&Matrix, &mut [f32])]) {
    let jobs = checked_jobs(x, t, products);
    gemm::gemm_group(pool, x, t, &jobs);
}

fn checked_jobs<'m>(x: &[f32], t: usize, products: &mut [(&'m Matrix, &mut [f32])]) -> Vec<(&'m Matrix, OutPtr)> {
    products
        .iter_mut()
        .map(|(w, out)| {
            assert_eq!(x.len(), t * w.cols, "matmul input has the wrong length");
            assert_eq!(out.len(), t * w.rows, "matmul output has the wrong length");
            (*w, OutPtr(out.as_mut_ptr()))
        })
        .collect()
}

/// Unit `u` of a group whose job `j` is cut into `units[j]` units: (job, unit within the job).
fn locate(units: &[usize], mut u: usize) -> (usize, usize) {
    for (j, &n) in units.iter().enumerate() {
        if u < n {
            return (j, u);
        }
        u -= n;
    }
    unreachable!("unit index past the group's work")
}

/// The rows of one GEMV unit. A matrix is read as four streams far apart (rows
/// `j · stride + o`, j = 0..4): one core reads four distant streams about 25% faster than four
/// adjacent rows (`examples/gemv_streams.rs`: 12.0 vs 9.5 GB/s here), as the DRAM pages and
/// prefetch streams are then independent. A unit is a run of offsets `o` in all four streams.
#[derive(Clone, Debug)]
pub struct RowSet {
    pub offsets: std::ops::Range<usize>,
    pub stride: usize,
    pub rows: usize,
}

impl RowSet {
    /// The whole matrix of `rows` rows as one set.
    pub fn all(rows: usize) -> RowSet {
        let stride = rows.div_ceil(4);
        RowSet { offsets: 0..stride, stride, rows }
    }

    /// Every row of the set, stream by stream.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..4).flat_map(move |j| self.offsets.clone().map(move |o| j * self.stride + o)).filter(move |&r| r < self.rows)
    }
}

/// How a GEMV over `w` is cut: (stream stride, offsets per unit). A unit reads about 16 KB of
/// each stream (a few microseconds, so the queue costs little).
fn gemv_units(w: &Matrix) -> (usize, usize) {
    let stride = w.rows.div_ceil(4);
    let row_bytes = w.cols * w.dtype().size();
    (stride, (16384 / row_bytes.max(1)).max(1))
}

/// The GEMV of `t` tokens (1..=GEMV_MAX_TOKENS), `x` and the outputs row-major.
fn gemv_group(pool: &Pool, x: &[f32], t: usize, jobs: &[(&Matrix, OutPtr)]) {
    let cuts: Vec<(usize, usize)> = jobs.iter().map(|(w, _)| gemv_units(w)).collect();
    let units: Vec<usize> = cuts.iter().map(|&(stride, per)| stride.div_ceil(per)).collect();
    // One token's int8 weights are multiplied by x rounded to int16, split into bytes for VNNI.
    let xq = (t == 1 && jobs.iter().any(|(w, _)| int8_vnni_applies(w))).then(|| QuantizedX::new(x));
    let queue = WorkQueue::new(units.iter().sum());
    pool.run(&|_| {
        while let Some(u) = queue.take() {
            let (j, u) = locate(&units, u);
            let (w, out) = jobs[j];
            let (stride, per) = cuts[j];
            let set = RowSet { offsets: u * per..((u + 1) * per).min(stride), stride, rows: w.rows };
            if t > 1 {
                // SAFETY: units are disjoint sets of rows inside every token's output row.
                unsafe { gemv_rows_multi(x, t, w, &set, out.0) };
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            if let (Some(xq), true) = (&xq, int8_vnni_applies(w)) {
                // SAFETY: int8_vnni_applies checked the CPU features; units are disjoint rows.
                unsafe { avx512::gemv_i8_vnni(xq, w, &set, out.0) };
                continue;
            }
            // SAFETY: units are disjoint sets of rows inside out.
            unsafe { gemv_rows(x, w, &set, out.0) }
        }
    });
}

/// Rows `rows` of the product for `t` tokens (`x` and `out` row-major, `[t, k]` and `[t, n]`).
///
/// # Safety
/// `out` must be valid for writes at `m · n + r` for every token `m` and row `r` of `rows`.
pub unsafe fn gemv_rows_multi(x: &[f32], t: usize, w: &Matrix, rows: &RowSet, out: *mut f32) {
    let (n, k) = (w.rows, w.cols);
    #[cfg(target_arch = "x86_64")]
    if super::isa() == super::Isa::Avx512 && k % 16 == 0 {
        macro_rules! tokens {
            ($($t:literal)*) => {
                match t {
                    $($t => return avx512::gemv_rows_multi::<$t>(x, w, rows, out),)*
                    _ => {}
                }
            };
        }
        tokens!(2 3 4 5 6 7 8);
    }
    // Elsewhere: token by token (each reads the weights again; correct, not the fast path).
    for m in 0..t {
        gemv_rows(&x[m * k..(m + 1) * k], w, rows, out.add(m * n));
    }
}

/// Whether the int8 × int16 VNNI GEMV runs this matrix (AVX-512 VNNI, rows of whole 64-byte
/// lines, and short enough that the i32 sums cannot overflow: |Σ| ≤ cols · 255 · 127 < 2^31).
fn int8_vnni_applies(w: &Matrix) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(w.data, WeightData::Int8 { .. })
            && w.cols % 64 == 0
            && w.cols < 65536
            && super::isa() == super::Isa::Avx512
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = w;
        false
    }
}

/// `x ≈ q · scale` with `q` in i16 (`scale = max|x| / 32767`; relative error below 2e-5), and
/// `q = 256 · (hi − 128) + lo` with `lo`, `hi` unsigned bytes: the operands of `vpdpbusd`
/// (unsigned bytes × signed bytes), which then needs no widening of the weights at all.
pub struct QuantizedX {
    pub q: Vec<i16>,
    pub lo: Vec<u8>,
    pub hi: Vec<u8>,
    pub scale: f32,
}

impl QuantizedX {
    pub fn new(x: &[f32]) -> QuantizedX {
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = if max > 0.0 { max / 32767.0 } else { 1.0 };
        let inv = 1.0 / scale;
        // Adding and subtracting 1.5 · 2^23 rounds to the nearest integer, ties to even, for
        // |v| < 2^22 (here ≤ 32767), in two vectorisable adds instead of a call per element.
        const ROUND: f32 = 12582912.0;
        let q: Vec<i16> = x.iter().map(|v| ((v * inv + ROUND) - ROUND) as i16).collect();
        let lo = q.iter().map(|&v| (v as u16 & 0xff) as u8).collect();
        let hi = q.iter().map(|&v| ((v >> 8) + 128) as u8).collect();
        QuantizedX { q, lo, hi, scale }
    }
}

/// Rows `rows` of the one-token product.
///
/// # Safety
/// `out` must be valid for writes at every row of `rows`.
pub unsafe fn gemv_rows(x: &[f32], w: &Matrix, rows: &RowSet, out: *mut f32) {
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
unsafe fn gemv_rows_avx2(x: &[f32], w: &Matrix, rows: &RowSet, out: *mut f32) {
    gemv_rows_portable(x, w, rows, out)
}

/// Portable body (vectorised by the compiler for the caller's target features): widen a row to
/// f32 into an L1-resident buffer, then dot it with x.
#[inline(always)]
unsafe fn gemv_rows_portable(x: &[f32], w: &Matrix, rows: &RowSet, out: *mut f32) {
    let k = w.cols;
    let mut row = vec![0f32; k];
    for r in rows.iter() {
        let scale = widen_row_range(w, r, 0, k, &mut row);
        *out.add(r) = dot(x, &row) * scale;
    }
}

/// Columns `k0..k0 + kc` of row `r` as f32 into `buf`; returns the factor to apply to a dot
/// with them (the int8 row scale, else 1).
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
        WeightData::Int8 { q, scales, .. } => {
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

    use super::{QuantizedX, RowSet};
    use crate::model::tensor::{Matrix, WeightData};

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

    /// int8 rows · int16 x, four rows at a time: per 64 weights of a row, two `vpdpbusd`
    /// (x's low and high bytes, unsigned, times the signed weights) and no widening. With
    /// `x = 256 · (hi − 128) + lo`: `Σ w·x = 256 · (Σ w·hi − 128 · Σ w) + Σ w·lo`, exact in
    /// integers (`Σ w` is stored with the weights).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn gemv_i8_vnni(x: &QuantizedX, w: &Matrix, rows: &RowSet, out: *mut f32) {
        let WeightData::Int8 { q, scales, sums } = &w.data else { unreachable!("int8 weights only") };
        let k = w.cols;
        let (qp, lo, hi) = (q.as_slice().as_ptr(), x.lo.as_ptr(), x.hi.as_ptr());
        let (scales, sums) = (scales.as_slice(), sums.as_slice());
        let finish = |r: usize, dot_lo: i32, dot_hi: i32| {
            let exact = 256 * (dot_hi as i64 - 128 * sums[r] as i64) + dot_lo as i64;
            *out.add(r) = exact as f32 * scales[r] * x.scale;
        };
        for_row_quads(rows, |quad| match quad {
            Ok(r) => {
                let p = r.map(|r| qp.add(r * k));
                let mut acc_lo = [_mm512_setzero_si512(); 4];
                let mut acc_hi = [_mm512_setzero_si512(); 4];
                let mut i = 0;
                while i < k {
                    let (xl, xh) = (_mm512_loadu_si512(lo.add(i) as *const _), _mm512_loadu_si512(hi.add(i) as *const _));
                    for j in 0..4 {
                        _mm_prefetch::<_MM_HINT_T0>(p[j].wrapping_add(i + PREFETCH_BYTES) as *const i8);
                        let wv = _mm512_loadu_si512(p[j].add(i) as *const _);
                        acc_lo[j] = _mm512_dpbusd_epi32(acc_lo[j], xl, wv);
                        acc_hi[j] = _mm512_dpbusd_epi32(acc_hi[j], xh, wv);
                    }
                    i += 64;
                }
                for j in 0..4 {
                    finish(r[j], _mm512_reduce_add_epi32(acc_lo[j]), _mm512_reduce_add_epi32(acc_hi[j]));
                }
            }
            Err(r) => {
                let p = qp.add(r * k);
                let (mut acc_lo, mut acc_hi) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                let mut i = 0;
                while i < k {
                    let wv = _mm512_loadu_si512(p.add(i) as *const _);
                    acc_lo = _mm512_dpbusd_epi32(acc_lo, _mm512_loadu_si512(lo.add(i) as *const _), wv);
                    acc_hi = _mm512_dpbusd_epi32(acc_hi, _mm512_loadu_si512(hi.add(i) as *const _), wv);
                    i += 64;
                }
                finish(r, _mm512_reduce_add_epi32(acc_lo), _mm512_reduce_add_epi32(acc_hi));
            }
        });
    }

    /// How far ahead of each stream to prefetch (about 20 lines: enough in flight to cover
    /// the memory latency, measured best among 2, 4 and 8 KB).
    const PREFETCH_BYTES: usize = 4096;

    /// Call `f(Ok([r0, r1, r2, r3]))` for each offset whose four stream rows all exist, and
    /// `f(Err(r))` for the rows of the last offsets whose later streams run past the matrix.
    #[inline(always)]
    unsafe fn for_row_quads(rows: &RowSet, mut f: impl FnMut(Result<[usize; 4], usize>)) {
        for o in rows.offsets.clone() {
            let quad = [o, rows.stride + o, 2 * rows.stride + o, 3 * rows.stride + o];
            if quad[3] < rows.rows {
                f(Ok(quad));
            } else {
                quad.iter().filter(|&&r| r < rows.rows).for_each(|&r| f(Err(r)));
            }
        }
    }

    /// `T` tokens at once, two rows at a time: each weight is loaded once for all tokens. Per
    /// (row, token) the sum runs exactly as in `gemv_rows` (16 lanes over k in order, reduced at
    /// the end), so a decode step of a batch gives each sequence the bits it would get alone
    /// (bf16/f16/f32 weights; int8 rows here use f32 arithmetic, not the one-token VNNI path).
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    pub unsafe fn gemv_rows_multi<const T: usize>(x: &[f32], w: &Matrix, rows: &RowSet, out: *mut f32) {
        let (n, k) = (w.rows, w.cols);
        let xp = x.as_ptr();
        macro_rules! kernel {
            ($ptr:expr, $elem:ty, $load:ident, $scale:expr) => {{
                let base = $ptr;
                let line = 64 / std::mem::size_of::<$elem>();
                let ahead = PREFETCH_BYTES / std::mem::size_of::<$elem>();
                let all: Vec<usize> = rows.iter().collect();
                for pair in all.chunks(2) {
                    let p: [*const $elem; 2] = [base.add(pair[0] * k), base.add(pair[pair.len() - 1] * k)];
                    let mut a = [[_mm512_setzero_ps(); T]; 2];
                    let mut i = 0;
                    while i < k {
                        if i % line == 0 {
                            for pj in p {
                                _mm_prefetch::<_MM_HINT_T0>(pj.wrapping_add(i + ahead) as *const i8);
                            }
                        }
                        let wv = [$load(p[0].add(i)), $load(p[1].add(i))];
                        for m in 0..T {
                            let xv = _mm512_loadu_ps(xp.add(m * k + i));
                            a[0][m] = _mm512_fmadd_ps(wv[0], xv, a[0][m]);
                            a[1][m] = _mm512_fmadd_ps(wv[1], xv, a[1][m]);
                        }
                        i += 16;
                    }
                    for (j, &r) in pair.iter().enumerate() {
                        for m in 0..T {
                            *out.add(m * n + r) = _mm512_reduce_add_ps(a[j][m]) * $scale(r);
                        }
                    }
                }
            }};
        }
        let one = |_r: usize| 1.0f32;
        match &w.data {
            WeightData::Bf16(b) => kernel!(b.as_slice().as_ptr(), u16, load_bf16, one),
            WeightData::F16(b) => kernel!(b.as_slice().as_ptr(), u16, load_f16, one),
            WeightData::F32(b) => kernel!(b.as_slice().as_ptr(), f32, _mm512_loadu_ps, one),
            WeightData::Int8 { q, scales, .. } => {
                let s = scales.as_slice();
                kernel!(q.as_slice().as_ptr(), i8, load_i8, |r: usize| s[r])
            }
        }
    }

    /// Four rows (one per stream) at a time: each x chunk is loaded once for four weight rows.
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    pub unsafe fn gemv_rows(x: &[f32], w: &Matrix, rows: &RowSet, out: *mut f32) {
        let k = w.cols;
        let xp = x.as_ptr();
        macro_rules! kernel {
            ($ptr:expr, $elem:ty, $load:ident, $scale:expr) => {{
                let base = $ptr;
                // Weights per 64-byte line (prefetched once per line) and per prefetch distance.
                let line = 64 / std::mem::size_of::<$elem>();
                let ahead = PREFETCH_BYTES / std::mem::size_of::<$elem>();
                for_row_quads(rows, |quad| match quad {
                    Ok(r) => {
                        let p = r.map(|r| base.add(r * k));
                        let mut a = [_mm512_setzero_ps(); 4];
                        let mut i = 0;
                        while i < k {
                            if i % line == 0 {
                                for j in 0..4 {
                                    _mm_prefetch::<_MM_HINT_T0>(p[j].wrapping_add(i + ahead) as *const i8);
                                }
                            }
                            let xv = _mm512_loadu_ps(xp.add(i));
                            for j in 0..4 {
                                a[j] = _mm512_fmadd_ps($load(p[j].add(i)), xv, a[j]);
                            }
                            i += 16;
                        }
                        for j in 0..4 {
                            *out.add(r[j]) = _mm512_reduce_add_ps(a[j]) * $scale(r[j]);
                        }
                    }
                    Err(r) => {
                        let p0 = base.add(r * k);
                        let mut a0 = _mm512_setzero_ps();
                        let mut i = 0;
                        while i < k {
                            a0 = _mm512_fmadd_ps($load(p0.add(i)), _mm512_loadu_ps(xp.add(i)), a0);
                            i += 16;
                        }
                        *out.add(r) = _mm512_reduce_add_ps(a0) * $scale(r);
                    }
                })
            }};
        }
        let one = |_r: usize| 1.0f32;
        match &w.data {
            WeightData::Bf16(b) => kernel!(b.as_slice().as_ptr(), u16, load_bf16, one),
            WeightData::F16(b) => kernel!(b.as_slice().as_ptr(), u16, load_f16, one),
            WeightData::F32(b) => kernel!(b.as_slice().as_ptr(), f32, _mm512_loadu_ps, one),
            WeightData::Int8 { q, scales, .. } => {
                let s = scales.as_slice();
                kernel!(q.as_slice().as_ptr(), i8, load_i8, |r: usize| s[r])
            }
        }
    }
}

/// The prefill GEMM. x is packed once per call into blocks of `TB` tokens laid out
/// `[k][TB]`, so that one vector load takes 16 tokens of one input; each unit of work is
/// `UNIT_COLS` output columns for all tokens: their weight rows are widened to f32 (a plain
/// contiguous copy, no transpose) `KC` inputs at a time, and a register-blocked micro-kernel
/// multiplies each weight by a 16-token vector of x with a broadcast FMA. The tile comes out
/// transposed (columns × tokens) and is written to the row-major output once, at the end.
///
/// Summation order per output (over `KC`-input blocks, sequentially within each, the blocks
/// added in order) is the same on every instruction set.
pub mod gemm {
    use std::ops::Range;

    use super::*;

    /// Tokens per packed block of x (two AVX-512 vectors).
    pub const TB: usize = 32;
    /// Output columns per unit of work.
    pub const UNIT_COLS: usize = 24;
    /// Inputs per block: a unit's widened weights (24 × 256 × 4 = 24 KB) stay in L1.
    pub const KC: usize = 256;
    /// Packed x one unit works on (see `gemm_group`).
    const X_BYTES_PER_UNIT: usize = 64 << 20;

    pub(super) fn gemm_group(pool: &Pool, x: &[f32], t: usize, jobs: &[(&Matrix, OutPtr)]) {
        let k = jobs[0].0.cols;
        let xp = pack_x(pool, x, t, k);
        // Token blocks per unit: about 512 KB of packed x, so that the units that follow one
        // another (the same tokens, the next columns) find it in L2.
        let blocks = t.div_ceil(TB);
        let group = (X_BYTES_PER_UNIT / (k * TB * 4)).clamp(1, blocks);
        let groups = blocks.div_ceil(group);
        let units: Vec<usize> = jobs.iter().map(|(w, _)| w.rows.div_ceil(UNIT_COLS) * groups).collect();
        let queue = WorkQueue::new(units.iter().sum());
        pool.run(&|_| {
            let mut scratch = Scratch::new(group * TB);
            while let Some(u) = queue.take() {
                let (j, u) = locate(&units, u);
                let (w, out) = jobs[j];
                let col_blocks = w.rows.div_ceil(UNIT_COLS);
                let (g, c) = (u / col_blocks, u % col_blocks);
                let cols = c * UNIT_COLS..((c + 1) * UNIT_COLS).min(w.rows);
                let token_blocks = g * group..((g + 1) * group).min(blocks);
                // SAFETY: units are disjoint (tokens × columns) parts of each output.
                unsafe { unit(&xp, t, w, token_blocks, cols, out.0, &mut scratch) }
            }
        });
    }

    /// x `[t, k]` as `ceil(t / TB)` blocks of `[k][TB]`, the missing tokens of the last
    /// block zero.
    pub fn pack_x(pool: &Pool, x: &[f32], t: usize, k: usize) -> Vec<f32> {
        let blocks = t.div_ceil(TB);
        let mut xp = vec![0f32; blocks * k * TB];
        let dst = OutPtr(xp.as_mut_ptr());
        pool.for_ranges(blocks, 1, &|bs| {
            let dst = dst;
            for b in bs {
                let tokens = TB.min(t - b * TB);
                // SAFETY: each block is written by one worker, inside xp.
                let block = unsafe { std::slice::from_raw_parts_mut(dst.0.add(b * k * TB), k * TB) };
                pack_block(&x[b * TB * k..(b * TB + tokens) * k], tokens, k, block);
            }
        });
        xp
    }

    /// One block: `block[kk * TB + m] = x[m * k + kk]` for the block's `tokens` rows of x.
    fn pack_block(x: &[f32], tokens: usize, k: usize, block: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if crate::backend::cpu::kernels::isa() == crate::backend::cpu::kernels::Isa::Avx512 {
            // SAFETY: feature checked; the transposed part stays inside both slices.
            let done = unsafe { pack_block_avx512(x, tokens, k, block) };
            return pack_block_plain(x, tokens, k, done, block);
        }
        pack_block_plain(x, tokens, k, 0, block)
    }

    /// Inputs `from..k` of a block, one value at a time.
    fn pack_block_plain(x: &[f32], tokens: usize, k: usize, from: usize, block: &mut [f32]) {
        for kk in from..k {
            for m in 0..tokens {
                block[kk * TB + m] = x[m * k + kk];
            }
        }
    }

    /// The whole 16-input groups of a block, as 16 × 16 transposes in registers (a scattered
    /// write per value costs more than the GEMM's own arithmetic on it). Returns how many
    /// inputs it packed.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_block_avx512(x: &[f32], tokens: usize, k: usize, block: &mut [f32]) -> usize {
        use std::arch::x86_64::*;
        let whole = k / 16 * 16;
        for m0 in (0..tokens).step_by(16) {
            for kk0 in (0..whole).step_by(16) {
                let mut rows = [_mm512_setzero_ps(); 16];
                for (i, r) in rows.iter_mut().enumerate().take(tokens - m0) {
                    *r = _mm512_loadu_ps(x.as_ptr().add((m0 + i) * k + kk0));
                }
                let cols = transpose16(rows);
                for (c, v) in cols.iter().enumerate() {
                    _mm512_storeu_ps(block.as_mut_ptr().add((kk0 + c) * TB + m0), *v);
                }
            }
        }
        whole
    }

    /// 16 × 16 f32 transpose: `out[c]` lane `r` = `rows[r]` lane `c`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn transpose16(r: [std::arch::x86_64::__m512; 16]) -> [std::arch::x86_64::__m512; 16] {
        use std::arch::x86_64::*;
        let z = _mm512_setzero_ps();
        // 32-bit interleave of row pairs: t[2i] lane L = r2i[4L], r2i+1[4L], r2i[4L+1], r2i+1[4L+1].
        let mut t = [z; 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // 64-bit interleave: u[4j + e] lane L = rows 4j..4j+4 at column 4L + e.
        let mut u = [z; 16];
        for j in 0..4 {
            let pd = |v: __m512| _mm512_castps_pd(v);
            u[4 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * j]), pd(t[4 * j + 2])));
            u[4 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * j]), pd(t[4 * j + 2])));
            u[4 * j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * j + 1]), pd(t[4 * j + 3])));
            u[4 * j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * j + 1]), pd(t[4 * j + 3])));
        }
        // 128-bit lanes: gather the four row groups of each column.
        let mut out = [z; 16];
        for e in 0..4 {
            let even = _mm512_shuffle_f32x4::<0x88>(u[e], u[4 + e]);
            let even2 = _mm512_shuffle_f32x4::<0x88>(u[8 + e], u[12 + e]);
            let odd = _mm512_shuffle_f32x4::<0xdd>(u[e], u[4 + e]);
            let odd2 = _mm512_shuffle_f32x4::<0xdd>(u[8 + e], u[12 + e]);
            out[e] = _mm512_shuffle_f32x4::<0x88>(even, even2);
            out[8 + e] = _mm512_shuffle_f32x4::<0xdd>(even, even2);
            out[4 + e] = _mm512_shuffle_f32x4::<0x88>(odd, odd2);
            out[12 + e] = _mm512_shuffle_f32x4::<0xdd>(odd, odd2);
        }
        out
    }

    /// A worker's buffers: the widened weights of one unit and one `KC` block, and the unit's
    /// transposed output tile.
    pub struct Scratch {
        panel: Vec<f32>,
        tile: Vec<f32>,
    }

    impl Scratch {
        /// For units of up to `tokens` tokens.
        pub fn new(tokens: usize) -> Scratch {
            Scratch { panel: vec![0f32; UNIT_COLS * KC], tile: vec![0f32; UNIT_COLS * tokens.div_ceil(TB) * TB] }
        }
    }

    /// Token blocks `blocks` × columns `cols` (at most `UNIT_COLS`) of
    /// `out[t, w.rows] = x · Wᵀ`, x packed by `pack_x`.
    ///
    /// # Safety
    /// `out` must be valid for writes at `ti * w.rows + c` for `ti < t`, `c` in `cols`.
    pub unsafe fn unit(xp: &[f32], t: usize, w: &Matrix, blocks: Range<usize>, cols: Range<usize>, out: *mut f32, s: &mut Scratch) {
        #[cfg(target_arch = "x86_64")]
        match crate::backend::cpu::kernels::isa() {
            crate::backend::cpu::kernels::Isa::Avx512 => return unit_avx512(xp, t, w, blocks, cols, out, s),
            crate::backend::cpu::kernels::Isa::Avx2 => return unit_avx2(xp, t, w, blocks, cols, out, s),
            crate::backend::cpu::kernels::Isa::Portable => {}
        }
        unit_body(xp, t, w, blocks, cols, out, s, |xb, kc, p, tile, st, m| micro_generic::<6, 8>(xb, kc, p, tile, st, m))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,f16c,fma")]
    unsafe fn unit_avx512(xp: &[f32], t: usize, w: &Matrix, blocks: Range<usize>, cols: Range<usize>, out: *mut f32, s: &mut Scratch) {
        unit_body(xp, t, w, blocks, cols, out, s, |xb, kc, p, tile, st, m| {
            if m <= 16 {
                micro_avx512_16(xb, kc, p, tile, st)
            } else {
                micro_avx512(xb, kc, p, tile, st)
            }
        })
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unit_avx2(xp: &[f32], t: usize, w: &Matrix, blocks: Range<usize>, cols: Range<usize>, out: *mut f32, s: &mut Scratch) {
        unit_body(xp, t, w, blocks, cols, out, s, |xb, kc, p, tile, st, m| micro_generic::<6, 16>(xb, kc, p, tile, st, m))
    }

    /// `micro(xb, kc, panel, tile, stride, tokens)`: `tile[c][m] += Σ_kk panel[c][kk] · xb[kk][m]`
    /// for the unit's `UNIT_COLS` columns and one block of `TB` tokens, of which the first
    /// `tokens` are real (`tile` rows `stride` apart, `panel` rows `KC` apart). A closure, so
    /// that it is inlined into each instruction set's copy.
    #[inline(always)]
    unsafe fn unit_body(
        xp: &[f32],
        t: usize,
        w: &Matrix,
        blocks: Range<usize>,
        cols: Range<usize>,
        out: *mut f32,
        s: &mut Scratch,
        micro: impl Fn(*const f32, usize, *const f32, *mut f32, usize, usize),
    ) {
        let (n, k) = (w.rows, w.cols);
        let nc = cols.len();
        let stride = blocks.len() * TB;
        s.tile[..UNIT_COLS * stride].iter_mut().for_each(|v| *v = 0.0);
        let mut scales = [1f32; UNIT_COLS];
        let mut k0 = 0;
        while k0 < k {
            let kc = (k - k0).min(KC);
            for c in 0..UNIT_COLS {
                let row = &mut s.panel[c * KC..c * KC + kc];
                if c < nc {
                    scales[c] = widen_row_range(w, cols.start + c, k0, kc, row);
                } else {
                    row.iter_mut().for_each(|v| *v = 0.0);
                }
            }
            for (i, b) in blocks.clone().enumerate() {
                micro(xp.as_ptr().add((b * k + k0) * TB), kc, s.panel.as_ptr(), s.tile.as_mut_ptr().add(i * TB), stride, (t - b * TB).min(TB));
            }
            k0 += kc;
        }
        // Int8 rows: each column's scale once, after all k-blocks.
        for (c, &scale) in scales.iter().enumerate().take(nc) {
            s.tile[c * stride..(c + 1) * stride].iter_mut().for_each(|v| *v *= scale);
        }
        let t0 = blocks.start * TB;
        store_transposed(&s.tile, stride, nc, (blocks.end * TB).min(t) - t0, out.add(t0 * n + cols.start), n);
    }

    /// `out[i * n + c] = tile[c * stride + i]` for `c < nc`, `i < tokens`: the unit's
    /// columns-major tile into the row-major output.
    #[inline(always)]
    unsafe fn store_transposed(tile: &[f32], stride: usize, nc: usize, tokens: usize, out: *mut f32, n: usize) {
        #[cfg(target_arch = "x86_64")]
        if crate::backend::cpu::kernels::isa() == crate::backend::cpu::kernels::Isa::Avx512 {
            return store_transposed_avx512(tile, stride, nc, tokens, out, n);
        }
        for c in 0..nc {
            for i in 0..tokens {
                *out.add(i * n + c) = tile[c * stride + i];
            }
        }
    }

    /// In 16 × 16 register transposes: one 64-byte store per token and 16 columns, instead of
    /// a scalar store per value, each to another cache line (measured: 16% of a unit's time).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn store_transposed_avx512(tile: &[f32], stride: usize, nc: usize, tokens: usize, out: *mut f32, n: usize) {
        use std::arch::x86_64::*;
        for c0 in (0..nc).step_by(16) {
            let cols = (nc - c0).min(16);
            let mask: __mmask16 = ((1u32 << cols) - 1) as u16;
            for i0 in (0..tokens).step_by(16) {
                let mut rows = [_mm512_setzero_ps(); 16];
                for (c, r) in rows.iter_mut().enumerate().take(cols) {
                    *r = _mm512_loadu_ps(tile.as_ptr().add((c0 + c) * stride + i0));
                }
                let by_token = transpose16(rows);
                for (i, v) in by_token.iter().enumerate().take(tokens - i0) {
                    _mm512_mask_storeu_ps(out.add((i0 + i) * n + c0), mask, *v);
                }
            }
        }
    }

    /// Any instruction set: `C` columns × `M` tokens of accumulators (`C · M` floats in
    /// registers: 6 × 16 = 12 ymm for AVX2), over the unit's columns and the block's tokens.
    #[inline(always)]
    unsafe fn micro_generic<const C: usize, const M: usize>(xb: *const f32, kc: usize, panel: *const f32, tile: *mut f32, stride: usize, tokens: usize) {
        for c0 in (0..UNIT_COLS).step_by(C) {
            for m0 in (0..tokens).step_by(M) {
                let mut acc = [[0f32; M]; C];
                for kk in 0..kc {
                    let xv: &[f32; M] = &*(xb.add(kk * TB + m0) as *const [f32; M]);
                    for c in 0..C {
                        let wv = *panel.add((c0 + c) * KC + kk);
                        for m in 0..M {
                            acc[c][m] = wv.mul_add(xv[m], acc[c][m]);
                        }
                    }
                }
                for c in 0..C {
                    let o = tile.add((c0 + c) * stride + m0);
                    for m in 0..M {
                        *o.add(m) += acc[c][m];
                    }
                }
            }
        }
    }

    /// AVX-512: 12 columns × 32 tokens = 24 zmm accumulators; per input, two vector loads of
    /// x and 12 broadcasts of a weight, each used by two FMAs.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn micro_avx512(xb: *const f32, kc: usize, panel: *const f32, tile: *mut f32, stride: usize) {
        use std::arch::x86_64::*;
        const C: usize = 12;
        for c0 in (0..UNIT_COLS).step_by(C) {
            let mut acc0 = [_mm512_setzero_ps(); C];
            let mut acc1 = [_mm512_setzero_ps(); C];
            let p = panel.add(c0 * KC);
            for kk in 0..kc {
                // x streams from L2: fetch 16 inputs (two lines each) ahead, about 200 cycles.
                _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((kk + 16) * TB) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((kk + 16) * TB + 16) as *const i8);
                let x0 = _mm512_loadu_ps(xb.add(kk * TB));
                let x1 = _mm512_loadu_ps(xb.add(kk * TB + 16));
                for c in 0..C {
                    let wv = _mm512_set1_ps(*p.add(c * KC + kk));
                    acc0[c] = _mm512_fmadd_ps(wv, x0, acc0[c]);
                    acc1[c] = _mm512_fmadd_ps(wv, x1, acc1[c]);
                }
            }
            for c in 0..C {
                let o = tile.add((c0 + c) * stride);
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc0[c]));
                _mm512_storeu_ps(o.add(16), _mm512_add_ps(_mm512_loadu_ps(o.add(16)), acc1[c]));
            }
        }
    }

    /// AVX-512 for a block of at most 16 real tokens (short prompts, the last block): 24
    /// columns × 16 tokens, rather than computing 16 padding tokens.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn micro_avx512_16(xb: *const f32, kc: usize, panel: *const f32, tile: *mut f32, stride: usize) {
        use std::arch::x86_64::*;
        let mut acc = [_mm512_setzero_ps(); UNIT_COLS];
        for kk in 0..kc {
            _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((kk + 16) * TB) as *const i8);
            let xv = _mm512_loadu_ps(xb.add(kk * TB));
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_set1_ps(*panel.add(c * KC + kk)), xv, *a);
            }
        }
        for (c, a) in acc.iter().enumerate() {
            let o = tile.add(c * stride);
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), *a));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tensor::{f32_to_bf16, Buf};

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
            crate::model::quant::quantize_int8(&Matrix { rows: n, cols: k, data: WeightData::F32(Buf::from_vec(wf)) }),
        ]
    }

    /// The packed layout of x, AVX-512 transposes and plain copies alike, against its definition.
    #[test]
    fn pack_x_matches_its_definition() {
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let pool = Pool::new(2);
            for &(t, k) in &[(1, 16), (13, 40), (32, 48), (45, 300), (70, 33)] {
                let x: Vec<f32> = (0..t * k).map(|i| i as f32).collect();
                let xp = gemm::pack_x(&pool, &x, t, k);
                assert_eq!(xp.len(), t.div_ceil(gemm::TB) * k * gemm::TB);
                for b in 0..t.div_ceil(gemm::TB) {
                    for kk in 0..k {
                        for m in 0..gemm::TB {
                            let ti = b * gemm::TB + m;
                            let want = if ti < t { x[ti * k + kk] } else { 0.0 };
                            assert_eq!(xp[(b * k + kk) * gemm::TB + m], want, "{isa:?} t={t} k={k} token {ti} input {kk}");
                        }
                    }
                }
            }
        });
    }

    /// Every path (GEMV, GEMM with full and partial tiles) on every instruction set this CPU
    /// has, against the f64 reference, for every weight dtype, on one and on three threads.
    #[test]
    fn matmul_matches_reference_for_every_isa_dtype_and_shape() {
        crate::backend::cpu::kernels::for_each_isa(|_| matmul_cases());
    }

    fn matmul_cases() {
        let mut seed = 7;
        for threads in [1, 3] {
            let pool = Pool::new(threads);
            for &(t, n, k) in &[(1, 5, 16), (1, 33, 96), (1, 70, 1024), (1, 7, 800), (2, 17, 48), (3, 9, 64), (8, 70, 1024), (5, 7, 800), (13, 64, 256), (25, 100, 300), (12, 32, 600)] {
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
                        if w.dtype() == crate::model::tensor::DType::I8 && t == 1 {
                            tol += (0..k).map(|c| weight(w, r, c).abs()).sum::<f32>() * x_max / 65534.0;
                        }
                        assert!((a - b).abs() <= tol, "{} t={t} n={n} k={k} [{i}]: {a} vs {b}", w.dtype());
                    }
                    // Each token of a multi-token GEMV gets the one-token GEMV's bits (float weights).
                    if (2..=GEMV_MAX_TOKENS).contains(&t) && w.dtype() != crate::model::tensor::DType::I8 {
                        for m in 0..t {
                            let mut alone = vec![0f32; n];
                            matmul(&pool, &x[m * k..(m + 1) * k], 1, w, &mut alone);
                            assert!(alone == got[m * n..(m + 1) * n], "{} t={t}: token {m} differs from its one-token product", w.dtype());
                        }
                    }
                    // The GEMM also runs single rows (static-shape dispatches).
                    let mut gemm_out = vec![0f32; t * n];
                    gemm_group(&pool, &x, t, &mut [(w, &mut gemm_out)]);
                    for (i, (a, b)) in gemm_out.iter().zip(&want).enumerate() {
                        assert!((a - b).abs() <= 2e-6 * (k as f32).sqrt() * 4.0, "GEMM {} t={t} n={n} k={k} [{i}]: {a} vs {b}", w.dtype());
                    }
                }
            }
        }
    }
}
