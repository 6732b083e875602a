//! The decode GEMV: up to `GEMV_MAX_TOKENS` tokens, each weight row read once for all of
//! them, in units that the pool's workers take from a queue; the int8 rows by VNNI.

use super::*;

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
pub(super) fn gemv_group(pool: &Pool, x: &[f32], t: usize, jobs: &[(&Matrix, OutPtr)]) {
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
    if crate::backend::cpu::kernels::isa() == crate::backend::cpu::kernels::Isa::Avx512 && k % 16 == 0 {
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
            && crate::backend::cpu::kernels::isa() == crate::backend::cpu::kernels::Isa::Avx512
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
        QuantizedX { lo, hi, scale }
    }
}

/// Rows `rows` of the one-token product.
///
/// # Safety
/// `out` must be valid for writes at every row of `rows`.
pub unsafe fn gemv_rows(x: &[f32], w: &Matrix, rows: &RowSet, out: *mut f32) {
    #[cfg(target_arch = "x86_64")]
    match crate::backend::cpu::kernels::isa() {
        crate::backend::cpu::kernels::Isa::Avx512 if w.cols % 16 == 0 => return avx512::gemv_rows(x, w, rows, out),
        crate::backend::cpu::kernels::Isa::Avx512 | crate::backend::cpu::kernels::Isa::Avx2 => return gemv_rows_avx2(x, w, rows, out),
        crate::backend::cpu::kernels::Isa::Portable => {}
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
