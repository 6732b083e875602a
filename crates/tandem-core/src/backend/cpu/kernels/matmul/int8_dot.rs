//! The fast precision's prompt products for int8 weights (W8A8): each token's inputs quantized
//! to int8 in blocks of `BLOCK` with a scale each (the block's largest |x| maps to 127, as GGUF's
//! 8-bit activations do), the products of four inputs by four weights summed into i32 by
//! AVX512-VNNI's `vpdpbusd` at four times the rate of f32 FMAs, each block's exact integer sum
//! then scaled and added in f32, the blocks in input order. A token's outputs do not depend on
//! the call's other tokens.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones: a weight goes in as `w + 128` (0..=255,
//! its sign bit flipped as a unit's weight rows are copied, `KC` inputs at a time, into a
//! panel) and x as it is; each block's sums start at `-128 · Σ q_x`,
//! kept with x, which takes the 128s back out. x is packed once per call into blocks of `TB`
//! tokens laid out `[k / 4][TB]`, each 32-bit value four consecutive inputs of one token, with
//! each token's scales and starts laid out `[k / BLOCK][TB]`. A unit of work is `UNIT_COLS`
//! output columns of a group of token blocks, as in the f32 GEMM (gemm.rs), whose tile it sums
//! into.

use std::ops::Range;

use super::gemm::{run_units, store_transposed, Scratch, TB, UNIT_COLS};
use super::*;

/// Inputs per scale: a token's block of `BLOCK` inputs shares one. Per token, one scale for a
/// whole row moved a random-weight 0.8B's logits by up to 2.35 (top-1 agreement with exact 31%
/// on a 133-token prompt); a scale per 64 inputs keeps int8's error near bf16's.
pub const BLOCK: usize = 64;
/// Inputs per pass over a unit's weights (128 quadruples): the unit's weights (24 × 512 = 12 KB)
/// and a token block's x (32 × 512 = 16 KB) stay in L1.
const KC: usize = 512;

/// Whether this kernel runs `w`: int8 weights of rows of whole `BLOCK`s, on a CPU with the
/// dot-product instructions (within the instruction-set cap).
pub(super) fn applies(w: &Matrix) -> bool {
    matches!(w.data, WeightData::Int8 { .. }) && w.cols.is_multiple_of(BLOCK) && crate::backend::cpu::kernels::isa() >= crate::backend::cpu::kernels::Isa::Avx512Dot
}

/// One block of inputs as int8: `(q, scale)` with `x ≈ q · scale`, the largest |x| at ±127
/// (rounded to nearest, ties to even); all zero (scale 0) for a block of zeros, NaN scale where
/// a value is not finite.
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if max == 0.0 || !max.is_finite() || x.iter().any(|v| v.is_nan()) {
        q.iter_mut().for_each(|v| *v = 0);
        return if max == 0.0 && !x.iter().any(|v| v.is_nan()) { 0.0 } else { f32::NAN };
    }
    let scale = max / 127.0;
    for (d, &v) in q.iter_mut().zip(x) {
        *d = (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    scale
}

/// The reference: for each token and output, over the blocks of `BLOCK` inputs in order,
/// `acc = fma(Σ_block q_x · q_w as f32, scale_x(block), acc)` from 0, then `acc · scale_w[r]`,
/// x quantized by `quantize_block`. The kernel gives these bits.
pub fn w8a8_ref(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
    let WeightData::Int8 { q, scales, .. } = &w.data else { panic!("w8a8_ref: int8 weights only") };
    let (n, k) = (w.rows, w.cols);
    let mut qx = vec![0i8; k];
    let mut sx = vec![0f32; k / BLOCK];
    for ti in 0..t {
        for (b, s) in sx.iter_mut().enumerate() {
            *s = quantize_block(&x[ti * k + b * BLOCK..ti * k + (b + 1) * BLOCK], &mut qx[b * BLOCK..(b + 1) * BLOCK]);
        }
        for r in 0..n {
            let row = &q.as_slice()[r * k..(r + 1) * k];
            let mut acc = 0f32;
            for (b, &s) in sx.iter().enumerate() {
                let dot: i32 = (b * BLOCK..(b + 1) * BLOCK).map(|i| qx[i] as i32 * row[i] as i32).sum();
                acc = (dot as f32).mul_add(s, acc);
            }
            out[ti * n + r] = acc * scales.as_slice()[r];
        }
    }
}

/// x packed for the kernel: the quadruples, and each block's scale and where its sums start.
pub struct PackedX {
    quads: Vec<u32>,
    scales: Vec<f32>,
    /// A block's `-128 · Σ q`: the weights go in as `w + 128`, and a sum started here comes
    /// out as `Σ q · w` exactly.
    starts: Vec<i32>,
}

/// `out_j = W8A8(x · W_jᵀ)` for every job (each `applies`).
pub(super) fn gemm_group(pool: &Pool, x: &[f32], t: usize, jobs: &[(&Matrix, OutPtr)]) {
    let k = jobs[0].0.cols;
    let xp = pack_x(pool, x, t, k);
    run_units(pool, t, jobs, k * TB, UNIT_COLS, &|w, out, token_blocks, cols, scratch| {
        // SAFETY: `applies` checked the features; units are disjoint parts of each output.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            unit(&xp, t, w, token_blocks, cols, out.0, scratch)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no dot-product instructions here: {:?} {:?} {:?} {:?}", w.rows, token_blocks, cols, (out.0, &scratch.tile))
    });
}

/// x `[t, k]` (k a multiple of `BLOCK`) quantized per block (`quantize_block`) as `ceil(t / TB)`
/// token blocks of `[k / 4][TB]` quadruples, with their scales and starts as `[k / BLOCK][TB]`;
/// the missing tokens of the last block zero.
pub fn pack_x(pool: &Pool, x: &[f32], t: usize, k: usize) -> PackedX {
    let (blocks, quads, per) = (t.div_ceil(TB), k / 4, k / BLOCK);
    let mut xp = PackedX { quads: vec![0u32; blocks * quads * TB], scales: vec![0f32; blocks * per * TB], starts: vec![0i32; blocks * per * TB] };
    let (dq, ds, dst) = (OutPtr(xp.quads.as_mut_ptr() as *mut f32), OutPtr(xp.scales.as_mut_ptr()), OutPtr(xp.starts.as_mut_ptr() as *mut f32));
    pool.for_ranges(blocks, 1, &|bs| {
        let (dq, ds, dst) = (dq, ds, dst);
        // One token block's rows of quadruples, row-major, then transposed into place.
        let mut rows = vec![0u32; TB * quads];
        let (mut scales, mut sums) = (vec![0f32; per], vec![0i32; per]);
        for b in bs {
            let tokens = TB.min(t - b * TB);
            for m in 0..tokens {
                // SAFETY: a u32 row is 4 × quads bytes, k of them.
                let q = unsafe { std::slice::from_raw_parts_mut(rows.as_mut_ptr().add(m * quads) as *mut i8, k) };
                quantize_row(&x[(b * TB + m) * k..(b * TB + m + 1) * k], q, &mut scales, &mut sums);
                for kb in 0..per {
                    let at = (b * per + kb) * TB + m;
                    // SAFETY: each token block is written by one worker, inside the buffers.
                    unsafe {
                        *ds.0.add(at) = scales[kb];
                        *(dst.0 as *mut i32).add(at) = -128 * sums[kb];
                    }
                }
            }
            // SAFETY: as above.
            let block = unsafe { std::slice::from_raw_parts_mut((dq.0 as *mut u32).add(b * quads * TB), quads * TB) };
            gemm::pack_words(&rows[..tokens * quads], tokens, quads, block);
        }
    });
    xp
}

/// A row of x quantized block by block: `q`, each block's scale (`quantize_block`'s bits) and
/// `Σ q` into `scales` and `sums`.
pub(super) fn quantize_row(x: &[f32], q: &mut [i8], scales: &mut [f32], sums: &mut [i32]) {
    quantize_blocks(x, BLOCK, q, scales);
    for (sum, q) in sums.iter_mut().zip(q.chunks_exact(BLOCK)) {
        *sum = q.iter().map(|&v| v as i32).sum();
    }
}

crate::backend::cpu::kernels::multiversion! {
    /// Each `len` values of `x` (a multiple of `len` long) as `quantize_block` quantizes them
    /// (its bits), their scales into `scales`, in loops the compiler vectorises. The prompt's
    /// W8A8 products and the decode's W4A8 products (blocks_a8.rs) quantize their inputs here.
    pub fn quantize_blocks(x: &[f32], len: usize, q: &mut [i8], scales: &mut [f32]) => quantize_blocks_body
}

#[inline(always)]
fn quantize_blocks_body(x: &[f32], len: usize, q: &mut [i8], scales: &mut [f32]) {
    for ((x, q), scale) in x.chunks_exact(len).zip(q.chunks_exact_mut(len)).zip(scales.iter_mut()) {
        // The largest |x| (exact in any order) and whether any is NaN, 16 lanes at a time.
        let (mut max, mut nan) = ([0f32; 16], [false; 16]);
        let chunks = x.chunks_exact(16);
        for (j, &v) in chunks.remainder().iter().enumerate() {
            max[j] = v.abs();
            nan[j] = v.is_nan();
        }
        for c in chunks {
            for j in 0..16 {
                max[j] = max[j].max(c[j].abs());
                nan[j] |= c[j].is_nan();
            }
        }
        let (max, nan) = (max.iter().fold(0f32, |m, &v| m.max(v)), nan.contains(&true));
        if max == 0.0 || !max.is_finite() || nan {
            q.fill(0);
            *scale = if max == 0.0 && !nan { 0.0 } else { f32::NAN };
            continue;
        }
        *scale = max / 127.0;
        for (d, &v) in q.iter_mut().zip(x) {
            *d = (v / *scale).round_ties_even().clamp(-127.0, 127.0) as i8;
        }
    }
}

/// Token blocks `blocks` × columns `cols` (at most `UNIT_COLS`) of `out[t, w.rows]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn unit(xp: &PackedX, t: usize, w: &Matrix, blocks: Range<usize>, cols: Range<usize>, out: *mut f32, s: &mut Scratch) {
    let WeightData::Int8 { q, scales, .. } = &w.data else { unreachable!("applies: int8 weights") };
    let (n, k) = (w.rows, w.cols);
    let (nc, per) = (cols.len(), k / BLOCK);
    let stride = blocks.len() * TB;
    s.tile[..UNIT_COLS * stride].iter_mut().for_each(|v| *v = 0.0);
    s.quads.resize(KC / 4 * UNIT_COLS, 0);
    let mut k0 = 0;
    while k0 < k {
        let kc = (k - k0).min(KC);
        flip_weights(q.as_slice(), k, cols.clone(), k0, kc, &mut s.quads);
        for (i, b) in blocks.clone().enumerate() {
            let xb = xp.quads.as_ptr().add((b * k + k0) / 4 * TB);
            let at = (b * per + k0 / BLOCK) * TB;
            let (sx, starts) = (xp.scales.as_ptr().add(at), xp.starts.as_ptr().add(at));
            let tile = s.tile.as_mut_ptr().add(i * TB);
            if t - b * TB <= 16 {
                micro_16(xb, sx, starts, kc / BLOCK, s.quads.as_ptr(), tile, stride);
            } else {
                micro_32(xb, sx, starts, kc / BLOCK, s.quads.as_ptr(), tile, stride);
            }
        }
        k0 += kc;
    }
    // Each row's own scale, once, after all blocks.
    for c in 0..nc {
        let sw = scales.as_slice()[cols.start + c];
        s.tile[c * stride..(c + 1) * stride].iter_mut().for_each(|v| *v *= sw);
    }
    let t0 = blocks.start * TB;
    store_transposed(&s.tile, stride, nc, (blocks.end * TB).min(t) - t0, out.add(t0 * n + cols.start), n);
}

/// Inputs `k0..k0 + kc` of the rows `cols` of `q` (rows `k` apart) as `vpdpbusd`'s unsigned
/// operand, `w + 128`, each row `KC` bytes from the last in `panel` (so that a step of the
/// micro-kernel reads its columns at fixed offsets from one pointer); the columns past the
/// matrix weights of 0.
fn flip_weights(q: &[i8], k: usize, cols: Range<usize>, k0: usize, kc: usize, panel: &mut [u32]) {
    // SAFETY: u32 to bytes, the same memory.
    let panel = unsafe { std::slice::from_raw_parts_mut(panel.as_mut_ptr() as *mut u8, panel.len() * 4) };
    for (c, dst) in panel.chunks_exact_mut(KC).enumerate().take(UNIT_COLS) {
        let row = cols.start + c;
        if row < cols.end {
            let src = &q[row * k + k0..row * k + k0 + kc];
            dst[..kc].iter_mut().zip(src).for_each(|(d, &w)| *d = w as u8 ^ 0x80);
        } else {
            dst[..kc].iter_mut().for_each(|d| *d = 0x80);
        }
    }
}

/// One block's sums of one column for 16 tokens (started at `-128 · Σ q_x`, so exact), scaled
/// into the tile: `tile = fma(f32(sum), scale_x, tile)`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn finish_block(acc: std::arch::x86_64::__m512i, sx: std::arch::x86_64::__m512, tile: *mut f32) {
    use std::arch::x86_64::*;
    _mm512_storeu_ps(tile, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sx, _mm512_loadu_ps(tile)));
}

/// 12 columns × 32 tokens of i32 block sums (24 zmm) at a time; per four inputs, two vector
/// loads of x and 12 broadcasts of a weight quadruple, each used by two `vpdpbusd`; each block's
/// sums then scaled into the tile. `blocks_in` blocks of `BLOCK` inputs from `xb`, their scales
/// and starts at `sx` and `starts` (`[block][TB]`), the weights from `flip_weights`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn micro_32(xb: *const u32, sx: *const f32, starts: *const i32, blocks_in: usize, panel: *const u32, tile: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    const C: usize = 12;
    const QUADS: usize = BLOCK / 4;
    for c0 in (0..UNIT_COLS).step_by(C) {
        for kb in 0..blocks_in {
            let (s0, s1) = (_mm512_loadu_si512(starts.add(kb * TB) as *const _), _mm512_loadu_si512(starts.add(kb * TB + 16) as *const _));
            let mut acc0 = [s0; C];
            let mut acc1 = [s1; C];
            for j in kb * QUADS..(kb + 1) * QUADS {
                _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((j + 16) * TB) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((j + 16) * TB + 16) as *const i8);
                let x0 = _mm512_loadu_si512(xb.add(j * TB) as *const _);
                let x1 = _mm512_loadu_si512(xb.add(j * TB + 16) as *const _);
                for c in 0..C {
                    let wv = _mm512_set1_epi32(panel.add((c0 + c) * (KC / 4) + j).read() as i32);
                    acc0[c] = _mm512_dpbusd_epi32(acc0[c], wv, x0);
                    acc1[c] = _mm512_dpbusd_epi32(acc1[c], wv, x1);
                }
            }
            let (sx0, sx1) = (_mm512_loadu_ps(sx.add(kb * TB)), _mm512_loadu_ps(sx.add(kb * TB + 16)));
            for c in 0..C {
                let o = tile.add((c0 + c) * stride);
                finish_block(acc0[c], sx0, o);
                finish_block(acc1[c], sx1, o.add(16));
            }
        }
    }
}

/// A block of at most 16 real tokens: all `UNIT_COLS` columns × 16 tokens at a time, each
/// lane's sums those `micro_32` makes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn micro_16(xb: *const u32, sx: *const f32, starts: *const i32, blocks_in: usize, panel: *const u32, tile: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    const QUADS: usize = BLOCK / 4;
    for kb in 0..blocks_in {
        let mut acc = [_mm512_loadu_si512(starts.add(kb * TB) as *const _); UNIT_COLS];
        for j in kb * QUADS..(kb + 1) * QUADS {
            _mm_prefetch::<_MM_HINT_T0>(xb.wrapping_add((j + 16) * TB) as *const i8);
            let xv = _mm512_loadu_si512(xb.add(j * TB) as *const _);
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm512_dpbusd_epi32(*a, _mm512_set1_epi32(panel.add(c * (KC / 4) + j).read() as i32), xv);
            }
        }
        let s = _mm512_loadu_ps(sx.add(kb * TB));
        for (c, a) in acc.iter().enumerate() {
            finish_block(*a, s, tile.add(c * stride));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{lcg, test_matrices};
    use super::*;

    /// A block's int8 inputs are within half a step of x, the largest at ±127; zeros give a
    /// zero scale, a NaN a NaN one.
    #[test]
    fn quantize_block_is_within_half_a_step() {
        let mut seed = 5;
        let x: Vec<f32> = (0..BLOCK).map(|_| lcg(&mut seed) * 7.0).collect();
        let mut q = vec![0i8; BLOCK];
        let s = quantize_block(&x, &mut q);
        assert!(q.iter().any(|&v| v.abs() == 127));
        for (&v, &qv) in x.iter().zip(&q) {
            assert!((v - qv as f32 * s).abs() <= s * 0.5 + 1e-6, "{v} vs {qv} x {s}");
        }
        assert_eq!(quantize_block(&[0.0; 4], &mut q[..4]), 0.0);
        assert!(q[..4].iter().all(|&v| v == 0));
        assert!(quantize_block(&[1.0, f32::NAN, 0.0, 2.0], &mut q[..4]).is_nan());
    }

    /// A row quantized 16 lanes at a time gives `quantize_block`'s bits on every instruction
    /// set, for blocks of random values, of values half-way between two steps, of zeros,
    /// tiny values, and with an infinity or a NaN.
    #[test]
    fn quantize_row_gives_quantize_blocks_bits() {
        let mut seed = 11;
        let mut x: Vec<f32> = (0..8 * BLOCK).map(|_| lcg(&mut seed) * 5.0).collect();
        // Block 1: multiples of half a step (max 127 → scale 1), so ties at every other value.
        (0..BLOCK).for_each(|i| x[BLOCK + i] = if i == 0 { 127.0 } else { (i as f32 - 32.0) * 0.5 });
        x[2 * BLOCK..3 * BLOCK].iter_mut().for_each(|v| *v = 0.0);
        x[3 * BLOCK..4 * BLOCK].iter_mut().enumerate().for_each(|(i, v)| *v = i as f32 * 1e-40);
        x[4 * BLOCK + 7] = f32::INFINITY;
        x[5 * BLOCK + 9] = f32::NAN;
        x[6 * BLOCK + 3] = -f32::INFINITY;
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let (mut q, mut scales, mut sums) = (vec![0i8; x.len()], vec![0f32; 8], vec![0i32; 8]);
            quantize_row(&x, &mut q, &mut scales, &mut sums);
            for b in 0..8 {
                let mut want = vec![0i8; BLOCK];
                let s = quantize_block(&x[b * BLOCK..(b + 1) * BLOCK], &mut want);
                assert_eq!(scales[b].to_bits(), s.to_bits(), "{isa:?} block {b}: scale");
                assert_eq!(q[b * BLOCK..(b + 1) * BLOCK], want[..], "{isa:?} block {b}");
                assert_eq!(sums[b], want.iter().map(|&v| v as i32).sum::<i32>(), "{isa:?} block {b}: sum");
            }
        });
    }

    /// On a CPU with VNNI: the reference's bits (exact integer sums, the same final scaling),
    /// for full and partial tiles and token blocks, on one and three threads; a token alone
    /// the same bits as in a call of many.
    #[test]
    fn int8_dot_gemm_gives_the_references_bits() {
        let _held = crate::backend::cpu::kernels::hold_isa();
        if crate::backend::cpu::kernels::isa() < crate::backend::cpu::kernels::Isa::Avx512Dot {
            eprintln!("no AVX512-VNNI here: the W8A8 GEMM is not run");
            return;
        }
        let mut seed = 9;
        for threads in [1, 3] {
            let pool = Pool::new(threads);
            for &(t, n, k) in &[(1, 5, 64), (7, 33, 128), (16, 24, 512), (17, 70, 1024), (32, 30, 320), (45, 13, 1088), (70, 49, 576), (40, 390, 128)] {
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
