//! The decode GEMV: any number of tokens (a decode step of a batch), each weight row read from
//! memory once for all of them and each token's sums in the one-token order, in units that the
//! pool's workers take from a queue; one token's int8 rows by VNNI; rows of GGML blocks by
//! blocks.rs.

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

/// How a GEMV group is cut among `threads` workers: units of (job, offsets), the largest
/// first. A job's units shrink as its rows run out (each a `2·threads`-th of what is left,
/// guided self-scheduling), so that the workers start on long runs, where the four streams'
/// prefetchers stay on (each new unit moves them elsewhere, where they start again), and end
/// together on short ones; none reads less than 16 KB of each stream (a few microseconds, so
/// the queue costs little). With 16 KB units the LM head's GEMV (508 MB) read at 77% of a
/// plain read's rate; in eighths of a worker's share at 97%, and a whole decode step of the
/// 0.8B took 18% less time (`examples/decode_bandwidth.rs`, 2 threads). Shrinking units and
/// `prefetch_unit_start` then took the 0.8B's matrices, one GEMV each, from 16.3 to 15.3 ms
/// in bf16 and from 9.0 to 8.8 ms in int8 on 16 Xeon cores (medians of 5 interleaved runs).
fn gemv_units(jobs: &[(&Matrix, OutPtr)], threads: usize) -> Vec<(usize, RowSet)> {
    let mut units = Vec::new();
    for (j, (w, _)) in jobs.iter().enumerate() {
        let stride = w.rows.div_ceil(4);
        let least = (16384 / w.row_bytes().max(1)).max(1);
        let mut start = 0;
        while start < stride {
            let len = (stride - start).div_ceil(2 * threads.max(1)).max(least).min(stride - start);
            units.push((j, RowSet { offsets: start..start + len, stride, rows: w.rows }));
            start += len;
        }
    }
    // Stable: a job's units stay in row order among those of one size.
    units.sort_by_key(|(_, set)| std::cmp::Reverse(set.offsets.len()));
    units
}

/// The GEMV of `t` tokens, `x` and the outputs row-major; k-quant blocks by int8 inputs
/// (blocks_a8.rs) where `w4a8` and the CPU has the kernel.
pub(super) fn gemv_group(pool: &Pool, x: &[f32], t: usize, jobs: &[(&Matrix, OutPtr)], w4a8: bool) {
    let units = gemv_units(jobs, pool.threads());
    // int8 weights are multiplied by each token's x rounded to int16, split into bytes for VNNI.
    let k = jobs[0].0.cols;
    let xq: Vec<QuantizedX> = if jobs.iter().any(|(w, _)| int8_vnni_applies(w)) { x.chunks_exact(k).map(QuantizedX::new).collect() } else { Vec::new() };
    // Block formats by 16-bit integer x with the sums of its runs (blocks.rs).
    let a8 = |w: &Matrix| w4a8 && blocks_a8::applies(w);
    let bx: Vec<blocks::BlockX> = if jobs.iter().any(|(w, _)| blocks::applies(w) && !a8(w)) { x.chunks_exact(k).map(blocks::BlockX::new).collect() } else { Vec::new() };
    let bx8: Vec<blocks_a8::BlockX8> = if jobs.iter().any(|(w, _)| a8(w)) { x.chunks_exact(k).map(blocks_a8::BlockX8::new).collect() } else { Vec::new() };
    let queue = WorkQueue::new(units.len());
    pool.run(&|_| {
        while let Some(u) = queue.take() {
            let (j, set) = &units[u];
            let (w, out) = jobs[*j];
            let set = set.clone();
            #[cfg(target_arch = "x86_64")]
            prefetch_unit_start(w, &set);
            if a8(w) {
                // SAFETY: applies() checked the CPU features; units are disjoint sets of rows
                // inside every token's output row.
                unsafe { blocks_a8::gemv_rows(&bx8, w, &set, out.0) };
                continue;
            }
            if blocks::applies(w) {
                // SAFETY: units are disjoint sets of rows inside every token's output row.
                unsafe { blocks::gemv_rows(&bx, w, &set, out.0) };
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            if int8_vnni_applies(w) {
                // SAFETY: int8_vnni_applies checked the CPU features; units are disjoint sets
                // of rows inside every token's output row.
                unsafe { avx512::gemv_i8_vnni(&xq, w, &set, out.0) };
                continue;
            }
            // SAFETY: as above.
            unsafe {
                if t > 1 {
                    gemv_rows_multi(x, t, w, &set, out.0)
                } else {
                    gemv_rows(x, w, &set, out.0)
                }
            }
        }
    });
}

/// How far ahead of where they read the GEMV kernels prefetch each stream (about 20 lines:
/// enough in flight to cover the memory latency, measured best among 2, 4 and 8 KB).
pub(super) const PREFETCH_BYTES: usize = 4096;

/// Prefetch the line at `p` into the core's L2 (and the levels beyond), not into L1. On a
/// 2-vCPU EPYC (Zen 5) the int8 GEMV read the LM head (256 MB) at 77-79% of a plain read of
/// as many bytes when it prefetched into L1 and at 92-97% into L2 (a trial build choosing the
/// hint at run time: medians of 15 interleaved calls, seven times); the bf16 GEMV read at
/// 90-97% either way; on 16 Xeon cores neither hint was ahead beyond the machine's spread
/// (docs/results/2026-11-29-cpu-decode-prefetch-and-ceiling.md).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn prefetch_weights(p: *const i8) {
    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p);
}

/// Prefetch the first `PREFETCH_BYTES` of each of a unit's four streams. The kernels prefetch
/// that far ahead of where they read, so a unit's first lines would otherwise come one miss
/// at a time on each stream.
#[cfg(target_arch = "x86_64")]
fn prefetch_unit_start(w: &Matrix, set: &RowSet) {
    let base = w.data_ptr();
    let row_bytes = w.row_bytes();
    for j in 0..4 {
        let first = j * set.stride + set.offsets.start;
        if first >= set.rows {
            break;
        }
        let end = ((j * set.stride + set.offsets.end).min(set.rows) * row_bytes).min((first * row_bytes).saturating_add(PREFETCH_BYTES));
        for at in (first * row_bytes..end).step_by(64) {
            // SAFETY: a prefetch does not fault, and `at` lies inside the matrix anyway.
            unsafe { prefetch_weights(base.wrapping_add(at) as *const i8) };
        }
    }
}

/// Rows `rows` of the product for `t` tokens (`x` and `out` row-major, `[t, k]` and `[t, n]`).
///
/// # Safety
/// `out` must be valid for writes at `m · n + r` for every token `m` and row `r` of `rows`.
pub unsafe fn gemv_rows_multi(x: &[f32], t: usize, w: &Matrix, rows: &RowSet, out: *mut f32) {
    let (n, k) = (w.rows, w.cols);
    #[cfg(target_arch = "x86_64")]
    match crate::backend::cpu::kernels::isa() {
        crate::backend::cpu::kernels::Isa::Avx512 | crate::backend::cpu::kernels::Isa::Avx512Dot | crate::backend::cpu::kernels::Isa::Amx if k % 16 == 0 => return avx512::gemv_rows_multi(x, t, w, rows, out),
        crate::backend::cpu::kernels::Isa::Avx512 | crate::backend::cpu::kernels::Isa::Avx512Dot | crate::backend::cpu::kernels::Isa::Amx | crate::backend::cpu::kernels::Isa::Avx2 => return avx2::gemv_rows_multi(x, t, w, rows, out),
        crate::backend::cpu::kernels::Isa::Portable => {}
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
            && w.cols.is_multiple_of(64)
            && w.cols < 65536
            && crate::backend::cpu::kernels::isa() >= crate::backend::cpu::kernels::Isa::Avx512Dot
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

/// `x ≈ q · scale` with `q` in i16: `scale = max|x| / 32767`, each value rounded to nearest,
/// ties to even (relative error below 2e-5).
pub(super) fn round_to_i16(x: &[f32]) -> (Vec<i16>, f32) {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = if max > 0.0 { max / 32767.0 } else { 1.0 };
    let inv = 1.0 / scale;
    // Adding and subtracting 1.5 · 2^23 rounds to the nearest integer, ties to even, for
    // |v| < 2^22 (here ≤ 32767), in two vectorisable adds instead of a call per element.
    const ROUND: f32 = 12582912.0;
    (x.iter().map(|v| ((v * inv + ROUND) - ROUND) as i16).collect(), scale)
}

impl QuantizedX {
    pub fn new(x: &[f32]) -> QuantizedX {
        let (q, scale) = round_to_i16(x);
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
        crate::backend::cpu::kernels::Isa::Avx512 | crate::backend::cpu::kernels::Isa::Avx512Dot | crate::backend::cpu::kernels::Isa::Amx if w.cols.is_multiple_of(16) => return avx512::gemv_rows(x, w, rows, out),
        crate::backend::cpu::kernels::Isa::Avx512 | crate::backend::cpu::kernels::Isa::Avx512Dot | crate::backend::cpu::kernels::Isa::Amx | crate::backend::cpu::kernels::Isa::Avx2 => return avx2::gemv_rows_multi(x, 1, w, rows, out),
        crate::backend::cpu::kernels::Isa::Portable => {}
    }
    gemv_rows_portable(x, w, rows, out)
}

/// Portable body (vectorised by the compiler for the caller's target features): widen a row to
/// f32 into an L1-resident buffer, then dot it with x. The AVX2 kernels give its bits.
#[inline(always)]
unsafe fn gemv_rows_portable(x: &[f32], w: &Matrix, rows: &RowSet, out: *mut f32) {
    let k = w.cols;
    let mut row = vec![0f32; k];
    for r in rows.iter() {
        let scale = widen_row_range(w, r, 0, k, &mut row);
        *out.add(r) = dot(x, &row) * scale;
    }
}

/// A SIMD GEMV's dispatch on `$w`'s weight dtype: `$kernel!(first weight, element type, load,
/// scale of row r)` with the calling module's `load_bf16`, `load_f16`, `load_i8` and `$load_f32`
/// (int8 rows scaled by their factor, the others by 1).
#[cfg(target_arch = "x86_64")]
macro_rules! by_weight_dtype {
    ($w:expr, $kernel:ident, $load_f32:ident) => {{
        let one = |_r: usize| 1.0f32;
        match &$w.data {
            WeightData::Bf16(b) => $kernel!(b.as_slice().as_ptr(), u16, load_bf16, one),
            WeightData::F16(b) => $kernel!(b.as_slice().as_ptr(), u16, load_f16, one),
            WeightData::F32(b) => $kernel!(b.as_slice().as_ptr(), f32, $load_f32, one),
            WeightData::Int8 { q, scales, .. } => {
                let s = scales.as_slice();
                $kernel!(q.as_slice().as_ptr(), i8, load_i8, |r: usize| s[r])
            }
            WeightData::Blocks { .. } => unreachable!("block formats take blocks.rs"),
        }
    }};
}

/// The GEMV on AVX2 (and on AVX-512 for rows that are not whole 16-lane pieces): the
/// arithmetic of `gemv_rows_portable` (matmul `dot`: 16 lanes over k in order, as two 8-lane
/// registers, the same pairwise reduction, the tail of k after it one by one), so that its
/// bits are the portable path's, with the weights widened in registers and every row read
/// once for all the tokens of a step. Before it, a step of n tokens on AVX2 read the weights
/// n times: 32 sequences of the 0.8B decoded 1.2-1.4x one sequence's rate on a 2-core EPYC.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{widen_row_range, RowSet};
    use crate::model::tensor::{Matrix, WeightData};

    /// 8 weights at `p` widened to f32.
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }

    /// `dot`'s end: lanes j and j + 8, then j + 4, j + 2, j + 1 added pairwise (the caller adds
    /// the tail's sum to lane 0).
    #[inline(always)]
    unsafe fn reduce(lo: __m256, hi: __m256) -> f32 {
        let v8 = _mm256_add_ps(lo, hi);
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        let v1 = _mm_add_ss(v2, _mm_movehdup_ps(v2));
        _mm_cvtss_f32(v1)
    }

    use super::{prefetch_weights, PREFETCH_BYTES};

    /// Rows `rows` of the product for `t` tokens (x and out row-major). One token: four rows at a
    /// time, one from each of the set's four distant streams (bound by reading the weights);
    /// more: two neighbouring rows by two tokens (eight accumulators of AVX2's 16 registers;
    /// bound by the FMAs), the rows read from memory while the first two tokens pass and from
    /// cache for the next ones. Tried on a 2-core Zen 3 and not faster (its timings vary by a
    /// quarter from run to run): six rows widened to f32 in L1, one token at a time with the
    /// weights loaded by the FMAs; token pairs outside the rows rather than inside.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn gemv_rows_multi(x: &[f32], t: usize, w: &Matrix, rows: &RowSet, out: *mut f32) {
        let (n, k) = (w.rows, w.cols);
        let xp = x.as_ptr();
        let (per, order): (usize, Vec<usize>) = if t == 1 {
            (4, rows.offsets.clone().flat_map(|o| (0..4).map(move |j| j * rows.stride + o)).filter(|&r| r < rows.rows).collect())
        } else {
            (2, rows.iter().collect())
        };
        // The tail of k (past its last whole 16) by the portable path's arithmetic.
        let k16 = k / 16 * 16;
        let mut tail_row = vec![0f32; k - k16];
        let mut tail = |r: usize, m: usize| -> f32 {
            if k16 == k {
                return 0.0;
            }
            widen_row_range(w, r, k16, k - k16, &mut tail_row);
            let xm = &x[m * k + k16..(m + 1) * k];
            tail_row.iter().zip(xm).fold(0f32, |s, (&wv, &xv)| xv.mul_add(wv, s))
        };
        macro_rules! kernel {
            ($ptr:expr, $elem:ty, $load:ident, $scale:expr) => {{
                let base: *const $elem = $ptr;
                let mut at = 0;
                while at < order.len() {
                    let rs = (order.len() - at).min(per);
                    let r: [usize; 4] = std::array::from_fn(|j| order[at + j.min(rs - 1)]);
                    let p = r.map(|r| base.add(r * k));
                    let mut m0 = 0;
                    while m0 < t {
                        let g = (t - m0).min(2);
                        let o = out.add(m0 * n);
                        let x0 = xp.add(m0 * k);
                        let first = m0 == 0;
                        let mut done = |j: usize, m: usize, lanes: f32| {
                            if j < rs {
                                *o.add(m * n + r[j]) = (lanes + tail(r[j], m0 + m)) * $scale(r[j]);
                            }
                        };
                        match (rs, g) {
                            (4, _) => tile::<$elem, 4, 1>(p, k16, k, x0, first, |q| $load(q), &mut done),
                            (3, _) => tile::<$elem, 3, 1>(p, k16, k, x0, first, |q| $load(q), &mut done),
                            (2, 2) => tile::<$elem, 2, 2>(p, k16, k, x0, first, |q| $load(q), &mut done),
                            (2, _) => tile::<$elem, 2, 1>(p, k16, k, x0, first, |q| $load(q), &mut done),
                            (_, 2) => tile::<$elem, 1, 2>(p, k16, k, x0, first, |q| $load(q), &mut done),
                            _ => tile::<$elem, 1, 1>(p, k16, k, x0, first, |q| $load(q), &mut done),
                        }
                        m0 += g;
                    }
                    at += rs;
                }
            }};
        }
        by_weight_dtype!(w, kernel, _mm256_loadu_ps)
    }

    /// `R` weight rows (at `p`) × `G` tokens (x rows at `x`, `k` apart), over the first `k16`
    /// columns: `done(j, m, Σ)` for row j and token m, the 16 lanes reduced as `dot` does (the
    /// tail added by the caller). The rows are prefetched on the `first` pass over them.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // m and j index x and the accumulators together
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<E, const R: usize, const G: usize>(p: [*const E; 4], k16: usize, k: usize, x: *const f32, first: bool, load: impl Fn(*const E) -> __m256, done: &mut impl FnMut(usize, usize, f32)) {
        let line = 64 / std::mem::size_of::<E>();
        let ahead = PREFETCH_BYTES / std::mem::size_of::<E>();
        let mut lo = [[_mm256_setzero_ps(); G]; R];
        let mut hi = [[_mm256_setzero_ps(); G]; R];
        let mut i = 0;
        while i < k16 {
            if first && i % line == 0 {
                for pj in &p[..R] {
                    prefetch_weights(pj.wrapping_add(i + ahead) as *const i8);
                }
            }
            let w0: [__m256; R] = std::array::from_fn(|j| load(p[j].add(i)));
            let w1: [__m256; R] = std::array::from_fn(|j| load(p[j].add(i + 8)));
            for m in 0..G {
                let (x0, x1) = (_mm256_loadu_ps(x.add(m * k + i)), _mm256_loadu_ps(x.add(m * k + i + 8)));
                for j in 0..R {
                    lo[j][m] = _mm256_fmadd_ps(x0, w0[j], lo[j][m]);
                    hi[j][m] = _mm256_fmadd_ps(x1, w1[j], hi[j][m]);
                }
            }
            i += 16;
        }
        for j in 0..R {
            for m in 0..G {
                done(j, m, reduce(lo[j][m], hi[j][m]));
            }
        }
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

    /// int8 rows · int16 x for every token of `xs` (outputs `w.rows` apart), four rows × two
    /// tokens at a time: per 64 weights of a row and token, two `vpdpbusd` (x's low and high
    /// bytes, unsigned, times the signed weights) and no widening. With
    /// `x = 256 · (hi − 128) + lo`: `Σ w·x = 256 · (Σ w·hi − 128 · Σ w) + Σ w·lo`, exact in
    /// integers (`Σ w` is stored with the weights), so that a token's outputs are the same bits
    /// whichever tokens come with it.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn gemv_i8_vnni(xs: &[QuantizedX], w: &Matrix, rows: &RowSet, out: *mut f32) {
        let WeightData::Int8 { q, scales, sums } = &w.data else { unreachable!("int8 weights only") };
        let (n, k) = (w.rows, w.cols);
        let qp = q.as_slice().as_ptr();
        let (scales, sums) = (scales.as_slice(), sums.as_slice());
        for_row_quads(rows, |quad| {
            let (r, four) = match quad {
                Ok(r) => (r, true),
                Err(r) => ([r; 4], false),
            };
            let p = r.map(|r| qp.add(r * k));
            let mut m0 = 0;
            while m0 < xs.len() {
                let g = (xs.len() - m0).min(2);
                let tokens = &xs[m0..m0 + g];
                let done = |j: usize, m: usize, dot_lo: i32, dot_hi: i32| {
                    let exact = 256 * (dot_hi as i64 - 128 * sums[r[j]] as i64) + dot_lo as i64;
                    *out.add((m0 + m) * n + r[j]) = exact as f32 * scales[r[j]] * tokens[m].scale;
                };
                match (four, g) {
                    (true, 2) => vnni_tile::<4, 2>(p, k, tokens, m0 == 0, done),
                    (true, _) => vnni_tile::<4, 1>(p, k, tokens, m0 == 0, done),
                    (false, 2) => vnni_tile::<1, 2>(p, k, tokens, m0 == 0, done),
                    (false, _) => vnni_tile::<1, 1>(p, k, tokens, m0 == 0, done),
                }
                m0 += g;
            }
        });
    }

    /// `R` int8 rows (at `p`) × `G` tokens: `done(j, m, Σ w·lo, Σ w·hi)` for row j and token m.
    /// The rows are prefetched on the `first` pass over them.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // m and j index the tokens and the accumulators together
    unsafe fn vnni_tile<const R: usize, const G: usize>(p: [*const i8; 4], k: usize, xs: &[QuantizedX], first: bool, mut done: impl FnMut(usize, usize, i32, i32)) {
        let mut lo = [[_mm512_setzero_si512(); G]; R];
        let mut hi = [[_mm512_setzero_si512(); G]; R];
        let mut i = 0;
        while i < k {
            if first {
                for pj in &p[..R] {
                    prefetch_weights(pj.wrapping_add(i + PREFETCH_BYTES) as *const i8);
                }
            }
            let wv: [__m512i; R] = std::array::from_fn(|j| _mm512_loadu_si512(p[j].add(i) as *const _));
            for m in 0..G {
                let (xl, xh) = (_mm512_loadu_si512(xs[m].lo.as_ptr().add(i) as *const _), _mm512_loadu_si512(xs[m].hi.as_ptr().add(i) as *const _));
                for j in 0..R {
                    lo[j][m] = _mm512_dpbusd_epi32(lo[j][m], xl, wv[j]);
                    hi[j][m] = _mm512_dpbusd_epi32(hi[j][m], xh, wv[j]);
                }
            }
            i += 64;
        }
        for j in 0..R {
            for m in 0..G {
                done(j, m, _mm512_reduce_add_epi32(lo[j][m]), _mm512_reduce_add_epi32(hi[j][m]));
            }
        }
    }

    use super::{prefetch_weights, PREFETCH_BYTES};

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

    /// Tokens per tile: four rows × four tokens are 16 accumulators (six tokens, 24
    /// accumulators, measured no faster and slower for k = 1024).
    const TILE_TOKENS: usize = 4;
    /// Up to this many tokens, a tile's four rows come from four distant streams.
    const FAR_QUADS_UP_TO: usize = 8;

    /// Any number of tokens, four rows × four tokens at a time: the four rows' weights are read
    /// from memory once (while the first four tokens pass over them) and from cache for the
    /// next four, and so on. Each (row, token) sum runs exactly as in `gemv_rows` (16 lanes
    /// over k in order, reduced at the end), so that a sequence in a decode step of any size
    /// gets the bits it would get alone (int8 rows come here only where VNNI does not apply:
    /// then one token's take `gemv_rows`, in the same order).
    // avx512vl: without it the reductions at the end can use only the first 16 registers,
    // and the compiler keeps one of the 16 accumulators on the stack.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    pub unsafe fn gemv_rows_multi(x: &[f32], t: usize, w: &Matrix, rows: &RowSet, out: *mut f32) {
        let (n, k) = (w.rows, w.cols);
        let xp = x.as_ptr();
        // Which rows go together. A step of a few tokens is bound by reading the weights, and
        // four distant streams read faster (see `RowSet`); of more, by the FMAs, where four
        // adjacent rows do better (`examples/gemv_multi.rs` on 2 threads: distant streams twice
        // as fast at 2 tokens, adjacent rows 8-26% faster from 16 tokens on).
        let order: Vec<usize> = if t <= FAR_QUADS_UP_TO {
            rows.offsets.clone().flat_map(|o| (0..4).map(move |j| j * rows.stride + o)).filter(|&r| r < rows.rows).collect()
        } else {
            rows.iter().collect()
        };
        let whole = order.len() / 4 * 4;
        let groups = order[..whole].chunks_exact(4).map(|c| (true, [c[0], c[1], c[2], c[3]])).chain(order[whole..].iter().map(|&r| (false, [r; 4])));
        macro_rules! kernel {
            ($ptr:expr, $elem:ty, $load:ident, $scale:expr) => {{
                let base: *const $elem = $ptr;
                for (quad, r) in groups {
                    let p = r.map(|r| base.add(r * k));
                    let mut m0 = 0;
                    while m0 < t {
                        let g = (t - m0).min(TILE_TOKENS);
                        let o = out.add(m0 * n);
                        tile_of(quad, g, p, k, xp.add(m0 * k), m0 == 0, |q| $load(q), |j, m, v| *o.add(m * n + r[j]) = v * $scale(r[j]));
                        m0 += g;
                    }
                }
            }};
        }
        by_weight_dtype!(w, kernel, _mm512_loadu_ps)
    }

    /// A tile of four rows (`quad`) or one, and `g` (1..=TILE_TOKENS) tokens.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_of<E>(quad: bool, g: usize, p: [*const E; 4], k: usize, x: *const f32, first: bool, load: impl Fn(*const E) -> __m512, done: impl FnMut(usize, usize, f32)) {
        match (quad, g) {
            (true, 1) => tile::<E, 4, 1>(p, k, x, first, load, done),
            (true, 2) => tile::<E, 4, 2>(p, k, x, first, load, done),
            (true, 3) => tile::<E, 4, 3>(p, k, x, first, load, done),
            (true, 4) => tile::<E, 4, 4>(p, k, x, first, load, done),
            (false, 1) => tile::<E, 1, 1>(p, k, x, first, load, done),
            (false, 2) => tile::<E, 1, 2>(p, k, x, first, load, done),
            (false, 3) => tile::<E, 1, 3>(p, k, x, first, load, done),
            (false, 4) => tile::<E, 1, 4>(p, k, x, first, load, done),
            _ => unreachable!("a tile has 1..={TILE_TOKENS} tokens"),
        }
    }

    /// `R` weight rows (at `p`) × `G` tokens (x rows at `x`, `k` apart): `done(j, m, Σ)` for
    /// row j and token m. The rows' weights are prefetched on the `first` pass over them.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // m and j index x and the accumulators together
    unsafe fn tile<E, const R: usize, const G: usize>(p: [*const E; 4], k: usize, x: *const f32, first: bool, load: impl Fn(*const E) -> __m512, mut done: impl FnMut(usize, usize, f32)) {
        let line = 64 / std::mem::size_of::<E>();
        let ahead = PREFETCH_BYTES / std::mem::size_of::<E>();
        let mut a = [[_mm512_setzero_ps(); G]; R];
        let mut i = 0;
        while i < k {
            if first && i % line == 0 {
                for pj in &p[..R] {
                    prefetch_weights(pj.wrapping_add(i + ahead) as *const i8);
                }
            }
            let wv: [__m512; R] = std::array::from_fn(|j| load(p[j].add(i)));
            for m in 0..G {
                let xv = _mm512_loadu_ps(x.add(m * k + i));
                for j in 0..R {
                    a[j][m] = _mm512_fmadd_ps(wv[j], xv, a[j][m]);
                }
            }
            i += 16;
        }
        for (j, row) in a.iter().enumerate() {
            for (m, acc) in row.iter().enumerate() {
                done(j, m, _mm512_reduce_add_ps(*acc));
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
                                    prefetch_weights(p[j].wrapping_add(i + ahead) as *const i8);
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
        by_weight_dtype!(w, kernel, _mm512_loadu_ps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::kernels::matmul::tests::{lcg, test_matrices};

    /// The AVX2 GEMV gives the portable path's bits (widen a row, `dot`), one token and many,
    /// every weight dtype, k a multiple of 16 and not, sets whose last streams run short.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx2_gemv_gives_the_portable_bits() {
        if !(std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("f16c")) {
            return;
        }
        let mut seed = 11;
        for &(t, n, k) in &[(1, 37, 64), (1, 9, 40), (2, 13, 1024), (3, 21, 48), (5, 8, 100), (8, 33, 256), (33, 18, 80), (4, 30, 2100), (2, 7, 12)] {
            let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed)).collect();
            // (Block formats take blocks.rs, tested there.)
            for w in test_matrices(n, k, &mut seed).iter().filter(|w| !blocks::applies(w)) {
                let stride = n.div_ceil(4);
                // Two units, as gemv_group cuts a matrix (the second's last streams short).
                let sets = [RowSet { offsets: 0..stride / 2, stride, rows: n }, RowSet { offsets: stride / 2..stride, stride, rows: n }];
                let mut got = vec![f32::NAN; t * n];
                let mut want = vec![f32::NAN; t * n];
                for set in &sets {
                    // SAFETY: the sets cover rows below n; out holds t rows of n.
                    unsafe {
                        avx2::gemv_rows_multi(&x, t, w, set, got.as_mut_ptr());
                        for m in 0..t {
                            gemv_rows_portable(&x[m * k..(m + 1) * k], w, set, want.as_mut_ptr().add(m * n));
                        }
                    }
                }
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} t={t} n={n} k={k}: the AVX2 GEMV differs from the portable path", w.dtype());
            }
        }
    }
}
