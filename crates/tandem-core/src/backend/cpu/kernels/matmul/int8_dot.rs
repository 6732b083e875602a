//! The fast precision's prompt products for int8 weights (W8A8): each token's inputs quantized
//! to int8 with one scale per token (its largest |x| maps to 127), and the products of four
//! inputs by four weights summed into i32 by AVX512-VNNI's `vpdpbusd`, at four times the rate of
//! f32 FMAs. The sums are exact integers; only the final scaling rounds, so a token's outputs do
//! not depend on the order of anything, nor on the call's other tokens.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones: x goes in as `q + 128` (0..=255), and
//! the weight row's sum (kept with the int8 weights for the GEMV) takes the 128s back out.
//! x is packed once per call into blocks of `TB` tokens laid out `[k / 4][TB]`, each 32-bit
//! value four consecutive inputs of one token; a weight row's quadruples are consecutive in
//! memory already and each is broadcast from where it is stored. A unit of work is `UNIT_COLS`
//! output columns of a group of token blocks, as in the f32 GEMM (gemm.rs).

use std::ops::Range;

use super::gemm::{store_transposed, Scratch, TB, UNIT_COLS};
use super::*;

/// Inputs per block (128 quadruples): a unit's weights (24 × 512 = 12 KB) and a token block's
/// x (32 × 512 = 16 KB) stay in L1.
const KC: usize = 512;

/// Whether this kernel runs `w`: int8 weights of rows of whole quadruples, short enough that
/// the i32 sums cannot overflow (|Σ| ≤ cols · 255 · 127 < 2^31), on a CPU with the
/// dot-product instructions (within the instruction-set cap).
pub(super) fn applies(w: &Matrix) -> bool {
    matches!(w.data, WeightData::Int8 { .. }) && w.cols.is_multiple_of(4) && w.cols < 65536 && crate::backend::cpu::kernels::isa() == crate::backend::cpu::kernels::Isa::Avx512Dot
}

/// One token's inputs as int8: `(q, scale)` with `x ≈ q · scale`, the largest |x| at ±127
/// (rounded to nearest, ties to even); all zero (scale 0) for a row of zeros.
pub fn quantize_row(x: &[f32], q: &mut [i8]) -> f32 {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if max == 0.0 || !max.is_finite() {
        q.iter_mut().for_each(|v| *v = 0);
        return if max.is_finite() { 0.0 } else { f32::NAN };
    }
    let scale = max / 127.0;
    for (d, &v) in q.iter_mut().zip(x) {
        *d = (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    scale
}

/// The reference: `out[ti * n + r] = (Σ_k q_x[ti, k] · q_w[r, k]) · scale_x[ti] · scale_w[r]`
/// with x quantized by `quantize_row`, the sum in i64. The kernel gives these bits.
pub fn w8a8_ref(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
    let WeightData::Int8 { q, scales, .. } = &w.data else { panic!("w8a8_ref: int8 weights only") };
    let (n, k) = (w.rows, w.cols);
    let mut qx = vec![0i8; k];
    for ti in 0..t {
        let sx = quantize_row(&x[ti * k..(ti + 1) * k], &mut qx);
        for r in 0..n {
            let dot: i64 = qx.iter().zip(&q.as_slice()[r * k..(r + 1) * k]).map(|(&a, &b)| a as i64 * b as i64).sum();
            out[ti * n + r] = dot as i32 as f32 * sx * scales.as_slice()[r];
        }
    }
}

/// `out_j = W8A8(x · W_jᵀ)` for every job (each `applies`).
pub(super) fn gemm_group(pool: &Pool, x: &[f32], t: usize, jobs: &[(&Matrix, OutPtr)]) {
    let k = jobs[0].0.cols;
    let (xp, scales) = pack_x(pool, x, t, k);
    let blocks = t.div_ceil(TB);
    let group = ((64 << 20) / (k * TB)).clamp(1, blocks);
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
            // SAFETY: `applies` checked the features; units are disjoint parts of each output.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                unit(&xp, &scales, t, w, token_blocks, cols, out.0, &mut scratch)
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("no dot-product instructions here: {:?} {:?} {:?}", token_blocks, cols, out.0)
        }
    });
}

/// x `[t, k]` (k a multiple of 4) quantized per token (`quantize_row`) as `ceil(t / TB)` blocks
/// of `[k / 4][TB]` quadruples of `q + 128`, the missing tokens of the last block zero; and
/// each token's scale.
pub fn pack_x(pool: &Pool, x: &[f32], t: usize, k: usize) -> (Vec<u32>, Vec<f32>) {
    let (blocks, quads) = (t.div_ceil(TB), k / 4);
    let mut xp = vec![0u32; blocks * quads * TB];
    let mut scales = vec![0f32; t];
    let (dst, sdst) = (OutPtr(xp.as_mut_ptr() as *mut f32), OutPtr(scales.as_mut_ptr()));
    pool.for_ranges(blocks, 1, &|bs| {
        let (dst, sdst) = (dst, sdst);
        let mut q = vec![0i8; k];
        for b in bs {
            // SAFETY: each block (and its tokens' scales) is written by one worker, inside xp.
            let block = unsafe { std::slice::from_raw_parts_mut((dst.0 as *mut u32).add(b * quads * TB), quads * TB) };
            for m in 0..TB.min(t - b * TB) {
                let ti = b * TB + m;
                let s = quantize_row(&x[ti * k..(ti + 1) * k], &mut q);
                unsafe { *sdst.0.add(ti) = s };
                for (j, quad) in q.chunks_exact(4).enumerate() {
                    block[j * TB + m] = u32::from_le_bytes([quad[0] as u8 ^ 0x80, quad[1] as u8 ^ 0x80, quad[2] as u8 ^ 0x80, quad[3] as u8 ^ 0x80]);
                }
            }
        }
    });
    (xp, scales)
}

/// Token blocks `blocks` × columns `cols` (at most `UNIT_COLS`) of `out[t, w.rows]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn unit(xp: &[u32], x_scales: &[f32], t: usize, w: &Matrix, blocks: Range<usize>, cols: Range<usize>, out: *mut f32, s: &mut Scratch) {
    let WeightData::Int8 { q, scales, sums } = &w.data else { unreachable!("applies: int8 weights") };
    let (n, k) = (w.rows, w.cols);
    let nc = cols.len();
    let stride = blocks.len() * TB;
    // The tile holds i32 sums until the end (exact, whatever the order).
    let tile_f32 = s.tile.as_mut_ptr();
    let tile = tile_f32 as *mut i32;
    std::slice::from_raw_parts_mut(tile, UNIT_COLS * stride).iter_mut().for_each(|v| *v = 0);
    let zeros = [0u32; KC / 4];
    let mut k0 = 0;
    while k0 < k {
        let kc = (k - k0).min(KC);
        let mut rows = [zeros.as_ptr(); UNIT_COLS];
        for (c, r) in rows.iter_mut().enumerate().take(nc) {
            *r = q.as_slice().as_ptr().add((cols.start + c) * k + k0) as *const u32;
        }
        for (i, b) in blocks.clone().enumerate() {
            let xb = xp.as_ptr().add((b * k + k0) / 4 * TB);
            if t - b * TB <= 16 {
                micro_16(xb, kc / 4, &rows, tile.add(i * TB), stride);
            } else {
                micro_32(xb, kc / 4, &rows, tile.add(i * TB), stride);
            }
        }
        k0 += kc;
    }
    // q + 128 went in: take 128 · Σ_k w back out, then scale by the token's and the row's.
    let t0 = blocks.start * TB;
    let tokens = (blocks.end * TB).min(t) - t0;
    for c in 0..nc {
        let r = cols.start + c;
        let (correction, sw) = (128 * sums.as_slice()[r], scales.as_slice()[r]);
        for i in 0..tokens {
            let at = c * stride + i;
            *tile_f32.add(at) = (*tile.add(at) - correction) as f32 * x_scales[t0 + i] * sw;
        }
    }
    store_transposed(&s.tile, stride, nc, tokens, out.add(t0 * n + cols.start), n);
}

/// 12 columns × 32 tokens = 24 zmm accumulators; per four inputs, two vector loads of x and 12
/// broadcasts of a weight quadruple, each used by two `vpdpbusd`. `tile[c][m] += Σ` over
/// `quads` quadruples (tile rows `stride` apart).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn micro_32(xb: *const u32, quads: usize, rows: &[*const u32; UNIT_COLS], tile: *mut i32, stride: usize) {
    use std::arch::x86_64::*;
    const C: usize = 12;
    for c0 in (0..UNIT_COLS).step_by(C) {
        let mut acc0 = [_mm512_setzero_si512(); C];
        let mut acc1 = [_mm512_setzero_si512(); C];
        for j in 0..quads {
            _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((j + 16) * TB) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((j + 16) * TB + 16) as *const i8);
            let x0 = _mm512_loadu_si512(xb.add(j * TB) as *const _);
            let x1 = _mm512_loadu_si512(xb.add(j * TB + 16) as *const _);
            for c in 0..C {
                let wv = _mm512_set1_epi32(rows[c0 + c].add(j).read_unaligned() as i32);
                acc0[c] = _mm512_dpbusd_epi32(acc0[c], x0, wv);
                acc1[c] = _mm512_dpbusd_epi32(acc1[c], x1, wv);
            }
        }
        for c in 0..C {
            let o = tile.add((c0 + c) * stride);
            _mm512_storeu_si512(o as *mut _, _mm512_add_epi32(_mm512_loadu_si512(o as *const _), acc0[c]));
            _mm512_storeu_si512(o.add(16) as *mut _, _mm512_add_epi32(_mm512_loadu_si512(o.add(16) as *const _), acc1[c]));
        }
    }
}

/// A block of at most 16 real tokens: 24 columns × 16 tokens.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn micro_16(xb: *const u32, quads: usize, rows: &[*const u32; UNIT_COLS], tile: *mut i32, stride: usize) {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); UNIT_COLS];
    for j in 0..quads {
        _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((j + 16) * TB) as *const i8);
        let xv = _mm512_loadu_si512(xb.add(j * TB) as *const _);
        for (c, a) in acc.iter_mut().enumerate() {
            *a = _mm512_dpbusd_epi32(*a, xv, _mm512_set1_epi32(rows[c].add(j).read_unaligned() as i32));
        }
    }
    for (c, a) in acc.iter().enumerate() {
        let o = tile.add(c * stride);
        _mm512_storeu_si512(o as *mut _, _mm512_add_epi32(_mm512_loadu_si512(o as *const _), *a));
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{lcg, test_matrices};
    use super::*;

    /// A token's int8 inputs are within half a step of x, the largest at ±127.
    #[test]
    fn quantize_row_is_within_half_a_step() {
        let mut seed = 5;
        let x: Vec<f32> = (0..300).map(|_| lcg(&mut seed) * 7.0).collect();
        let mut q = vec![0i8; 300];
        let s = quantize_row(&x, &mut q);
        assert!(q.iter().any(|&v| v.abs() == 127));
        for (&v, &qv) in x.iter().zip(&q) {
            assert!((v - qv as f32 * s).abs() <= s * 0.5 + 1e-6, "{v} vs {qv} x {s}");
        }
        assert_eq!(quantize_row(&[0.0; 4], &mut q[..4]), 0.0);
        assert!(q[..4].iter().all(|&v| v == 0));
    }

    /// On a CPU with VNNI: the reference's bits (exact integer sums, the same final scaling),
    /// for full and partial tiles and token blocks, on one and three threads; a token alone
    /// the same bits as in a call of many.
    #[test]
    fn int8_dot_gemm_gives_the_references_bits() {
        let _held = crate::backend::cpu::kernels::hold_isa();
        if crate::backend::cpu::kernels::isa() != crate::backend::cpu::kernels::Isa::Avx512Dot {
            eprintln!("no AVX512-VNNI here: the W8A8 GEMM is not run");
            return;
        }
        let mut seed = 9;
        for threads in [1, 3] {
            let pool = Pool::new(threads);
            for &(t, n, k) in &[(1, 5, 16), (7, 33, 96), (16, 24, 512), (17, 70, 1024), (32, 30, 300), (45, 13, 1028), (70, 49, 600)] {
                let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed) * 3.0).collect();
                let w = test_matrices(n, k, &mut seed).swap_remove(3);
                assert!(applies(&w));
                let mut want = vec![0f32; t * n];
                w8a8_ref(&x, t, &w, &mut want);
                let mut got = vec![0f32; t * n];
                gemm_group(&pool, &x, t, &[(&w, OutPtr(got.as_mut_ptr()))]);
                assert!(got == want, "t={t} n={n} k={k}: not the reference's bits");
                let m = t - 1;
                let mut alone = vec![0f32; n];
                gemm_group(&pool, &x[m * k..(m + 1) * k], 1, &[(&w, OutPtr(alone.as_mut_ptr()))]);
                assert!(alone == got[m * n..(m + 1) * n], "t={t}: the last token alone differs");
            }
        }
    }
}
