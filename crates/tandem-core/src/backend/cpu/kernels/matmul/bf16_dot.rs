//! The fast precision's prompt products for bf16 weights: the inputs rounded to bf16, and each
//! pair of products summed into f32 by AVX512-BF16's `vdpbf16ps` (a bf16 × bf16 product is exact
//! in f32; only the sums round). That is a GPU tensor core's arithmetic (bf16 inputs, f32 sums),
//! at twice the rate of f32 FMAs on widened weights, and reading the weights as stored.
//!
//! x is packed once per call into blocks of `TB` tokens laid out `[k / 2][TB]`, each 32-bit
//! value a pair of consecutive inputs of one token (the low half the first), so that one vector
//! load takes one pair of 16 tokens; a weight row's pairs are consecutive in memory already,
//! and each is broadcast from where it is stored. A unit of work is `UNIT_COLS` output columns
//! of a group of token blocks, as in the f32 GEMM (gemm.rs), whose output tiles it shares.
//!
//! Each output sums its pairs in input order within a `KC`-input block (one vector lane per
//! token, so a token's sums do not depend on the other tokens of the call: a prompt in pieces
//! gets the bits of one call), and the blocks are added in order.

use std::ops::Range;

use super::gemm::{run_units, store_transposed, Scratch, TB, UNIT_COLS};
use super::*;

/// Inputs per block (128 pairs): a unit's weights (24 × 256 × 2 = 12 KB) and a token block's
/// x (32 × 256 × 2 = 16 KB) stay in L1.
const KC: usize = 256;

/// Whether this kernel runs `w`: bf16 weights of rows of whole pairs, on a CPU with the
/// dot-product instructions (within the instruction-set cap).
pub(super) fn applies(w: &Matrix) -> bool {
    matches!(w.data, WeightData::Bf16(_)) && w.cols.is_multiple_of(2) && crate::backend::cpu::kernels::isa() >= crate::backend::cpu::kernels::Isa::Avx512Dot
}

/// `out_j = bf16(x) · W_jᵀ` for every job (each `applies`).
pub(super) fn gemm_group(pool: &Pool, x: &[f32], t: usize, jobs: &[(&Matrix, OutPtr)]) {
    let k = jobs[0].0.cols;
    let xp = pack_x(pool, x, t, k);
    run_units(pool, t, jobs, k * TB * 2, UNIT_COLS, &|w, out, token_blocks, cols, scratch| {
        // SAFETY: `applies` checked the features; units are disjoint parts of each output.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            unit(&xp, t, w, token_blocks, cols, out.0, scratch)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no dot-product instructions here: {:?} {:?} {:?} {:?}", w.rows, token_blocks, cols, (out.0, &scratch.tile))
    });
}

/// x `[t, k]` (k even) rounded to bf16 (to nearest, ties to even) as `ceil(t / TB)` blocks of
/// `[k / 2][TB]` 32-bit pairs of consecutive inputs (the first in the low half), the missing
/// tokens of the last block zero: one vector load takes a pair of 16 tokens, and an AMX tile
/// row (amx_gemm.rs) is one.
pub fn pack_x(pool: &Pool, x: &[f32], t: usize, k: usize) -> Vec<u32> {
    let (blocks, pairs) = (t.div_ceil(TB), k / 2);
    let mut xp = vec![0u32; blocks * pairs * TB];
    let dst = OutPtr(xp.as_mut_ptr() as *mut f32);
    pool.for_ranges(blocks, 1, &|bs| {
        let dst: OutPtr = dst;
        let mut rows = vec![0u32; TB * pairs];
        for b in bs {
            let tokens = TB.min(t - b * TB);
            for m in 0..tokens {
                // SAFETY: a row of `pairs` u32 is `k` u16.
                let row = unsafe { std::slice::from_raw_parts_mut(rows.as_mut_ptr().add(m * pairs) as *mut u16, k) };
                round_to_bf16(&x[(b * TB + m) * k..(b * TB + m + 1) * k], row);
            }
            // SAFETY: each block is written by one worker, inside xp.
            let block = unsafe { std::slice::from_raw_parts_mut((dst.0 as *mut u32).add(b * pairs * TB), pairs * TB) };
            super::gemm::pack_words(&rows[..tokens * pairs], tokens, pairs, block);
        }
    });
    xp
}

crate::backend::cpu::kernels::multiversion! {
    /// `x` rounded to bf16 bits into `out`: `half::bf16::from_f32`'s bits (to nearest, ties to
    /// even; a NaN stays a NaN, made quiet), without its branches, so that it runs 16 lanes at
    /// a time.
    pub fn round_to_bf16(x: &[f32], out: &mut [u16]) => round_to_bf16_body
}

#[inline(always)]
fn round_to_bf16_body(x: &[f32], out: &mut [u16]) {
    for (d, &v) in out.iter_mut().zip(x) {
        let b = v.to_bits();
        // Adding 0x7fff and the lowest kept bit carries into the kept bits exactly when the
        // dropped half is above a half step, or at it with an odd kept part.
        let rounded = b.wrapping_add(0x7fff + (b >> 16 & 1)) >> 16;
        let nan = b & 0x7fff_ffff > 0x7f80_0000;
        *d = if nan { (b >> 16 | 0x40) as u16 } else { rounded as u16 };
    }
}

/// Token blocks `blocks` × columns `cols` (at most `UNIT_COLS`) of `out[t, w.rows]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn unit(xp: &[u32], t: usize, w: &Matrix, blocks: Range<usize>, cols: Range<usize>, out: *mut f32, s: &mut Scratch) {
    let WeightData::Bf16(wd) = &w.data else { unreachable!("applies: bf16 weights") };
    let (n, k) = (w.rows, w.cols);
    let nc = cols.len();
    let stride = blocks.len() * TB;
    s.tile[..UNIT_COLS * stride].iter_mut().for_each(|v| *v = 0.0);
    // Each column's weight row as pairs; a column past the matrix reads a row of zeros.
    let zeros = [0u32; KC / 2];
    let mut k0 = 0;
    while k0 < k {
        let kc = (k - k0).min(KC);
        let mut rows = [zeros.as_ptr(); UNIT_COLS];
        for (c, r) in rows.iter_mut().enumerate().take(nc) {
            *r = wd.as_slice().as_ptr().add((cols.start + c) * k + k0) as *const u32;
        }
        for (i, b) in blocks.clone().enumerate() {
            let xb = xp.as_ptr().add((b * k + k0) / 2 * TB);
            let tile = s.tile.as_mut_ptr().add(i * TB);
            if t - b * TB <= 16 {
                micro_16(xb, kc / 2, &rows, tile, stride);
            } else {
                micro_32(xb, kc / 2, &rows, tile, stride);
            }
        }
        k0 += kc;
    }
    let t0 = blocks.start * TB;
    store_transposed(&s.tile, stride, nc, (blocks.end * TB).min(t) - t0, out.add(t0 * n + cols.start), n);
}

/// 12 columns × 32 tokens = 24 zmm accumulators; per pair of inputs, two vector loads of x and
/// 12 broadcasts of a weight pair, each used by two `vdpbf16ps`. `tile[c][m] += Σ` over
/// `pairs` pairs (tile rows `stride` apart).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn micro_32(xb: *const u32, pairs: usize, rows: &[*const u32; UNIT_COLS], tile: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    const C: usize = 12;
    for c0 in (0..UNIT_COLS).step_by(C) {
        let mut acc0 = [_mm512_setzero_ps(); C];
        let mut acc1 = [_mm512_setzero_ps(); C];
        for j in 0..pairs {
            _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((j + 16) * TB) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((j + 16) * TB + 16) as *const i8);
            let x0: __m512bh = std::mem::transmute(_mm512_loadu_si512(xb.add(j * TB) as *const _));
            let x1: __m512bh = std::mem::transmute(_mm512_loadu_si512(xb.add(j * TB + 16) as *const _));
            for c in 0..C {
                let wv: __m512bh = std::mem::transmute(_mm512_set1_epi32(rows[c0 + c].add(j).read_unaligned() as i32));
                acc0[c] = _mm512_dpbf16_ps(acc0[c], x0, wv);
                acc1[c] = _mm512_dpbf16_ps(acc1[c], x1, wv);
            }
        }
        for c in 0..C {
            let o = tile.add((c0 + c) * stride);
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc0[c]));
            _mm512_storeu_ps(o.add(16), _mm512_add_ps(_mm512_loadu_ps(o.add(16)), acc1[c]));
        }
    }
}

/// A block of at most 16 real tokens (short prompts, the last block): 24 columns × 16 tokens,
/// each lane's sums those `micro_32` makes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn micro_16(xb: *const u32, pairs: usize, rows: &[*const u32; UNIT_COLS], tile: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); UNIT_COLS];
    for j in 0..pairs {
        _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((j + 16) * TB) as *const i8);
        let xv: __m512bh = std::mem::transmute(_mm512_loadu_si512(xb.add(j * TB) as *const _));
        for (c, a) in acc.iter_mut().enumerate() {
            let wv: __m512bh = std::mem::transmute(_mm512_set1_epi32(rows[c].add(j).read_unaligned() as i32));
            *a = _mm512_dpbf16_ps(*a, xv, wv);
        }
    }
    for (c, a) in acc.iter().enumerate() {
        let o = tile.add(c * stride);
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), *a));
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{lcg, test_matrices};
    use super::*;

    /// The branch-free rounding gives `half`'s bits on every instruction set: ties both ways,
    /// the largest finite values (to infinity), infinities, NaNs of both signs, subnormals, and
    /// a million random bit patterns.
    #[test]
    fn round_to_bf16_gives_halfs_bits() {
        let mut bits: Vec<u32> = vec![0, 0x8000_0000, 0x3f80_8000, 0x3f81_8000, 0x3f80_8001, 0x7f7f_ffff, 0xff7f_ffff, 0x7f80_0000, 0xff80_0000, 0x7fc0_0000, 0xffc0_0001, 0x7f80_0001, 0x0000_8000, 0x0001_8000, 0x807f_ffff];
        let mut seed = 1u64;
        bits.extend((0..1 << 20).map(|_| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 32) as u32
        }));
        let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let mut got = vec![0u16; x.len()];
            round_to_bf16(&x, &mut got);
            for (i, (&g, &v)) in got.iter().zip(&x).enumerate() {
                assert_eq!(g, half::bf16::from_f32(v).to_bits(), "{isa:?}: {:#010x} (value {i})", bits[i]);
            }
        });
    }

    /// On a CPU with the dot products: against the f64 reference of the rounded inputs (the
    /// products are exact, so only the f32 sums differ), for full and partial tiles and token
    /// blocks; each token's outputs the same bits whatever the call's other tokens; the packed
    /// layout as defined.
    #[test]
    fn bf16_dot_gemm_matches_the_reference_of_rounded_inputs() {
        let _held = crate::backend::cpu::kernels::hold_isa();
        if crate::backend::cpu::kernels::isa() < crate::backend::cpu::kernels::Isa::Avx512Dot {
            eprintln!("no AVX512-BF16 here: the dot-product GEMM is not run (its fallback is tested in matmul_fast_*)");
            return;
        }
        let mut seed = 3;
        for threads in [1, 3] {
            let pool = Pool::new(threads);
            for &(t, n, k) in &[(1, 5, 16), (7, 33, 96), (16, 24, 512), (17, 70, 1024), (32, 30, 300), (45, 13, 258), (70, 49, 600), (40, 390, 96)] {
                let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed) * 3.0).collect();
                let rounded: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
                let w = test_matrices(n, k, &mut seed).swap_remove(1);
                assert!(applies(&w));
                let mut want = vec![0f32; t * n];
                matmul_ref(&rounded, t, &w, &mut want);
                let mut got = vec![0f32; t * n];
                gemm_group(&pool, &x, t, &[(&w, OutPtr(got.as_mut_ptr()))]);
                let tol = 2e-6 * (k as f32).sqrt() * 4.0 * 3.0;
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() <= tol, "t={t} n={n} k={k} [{i}]: {a} vs {b}");
                }
                for m in [0, t / 2, t - 1] {
                    let mut alone = vec![0f32; n];
                    gemm_group(&pool, &x[m * k..(m + 1) * k], 1, &[(&w, OutPtr(alone.as_mut_ptr()))]);
                    assert!(alone == got[m * n..(m + 1) * n], "t={t} n={n} k={k}: token {m} alone differs");
                }
                let xp = pack_x(&pool, &x, t, k);
                for (ti, kk) in [(0, 0), (t - 1, k - 1), (t / 2, k / 2)] {
                    let v = xp[((ti / TB) * k / 2 + kk / 2) * TB + ti % TB];
                    let half = if kk % 2 == 0 { v & 0xffff } else { v >> 16 };
                    assert_eq!(half as u16, half::bf16::from_f32(x[ti * k + kk]).to_bits(), "packed x, token {ti} input {kk}");
                }
            }
        }
    }
}
