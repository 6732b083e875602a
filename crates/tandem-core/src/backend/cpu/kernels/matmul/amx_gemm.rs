//! The fast precision's prompt products on AMX tiles (kernels/amx.rs), where the CPU has them:
//! the same arithmetic as the dot-product kernels at several times their rate.
//!
//! - int8 weights (W8A8): each token's inputs quantized in blocks of `BLOCK` as int8_dot.rs
//!   does; one `tdpbssd` per block multiplies 16 tokens' blocks by 16 columns' (signed × signed,
//!   so no offset to take back out), its exact i32 sums then scaled into the f32 sums in block
//!   order, as `int8_dot::w8a8_ref` defines: the reference's bits.
//! - bf16 weights: the inputs rounded to bf16, each `tdpbf16ps` adding 32 products per output
//!   into f32 sums that stay in the tiles through all of a row's inputs (a GPU tensor core's
//!   arithmetic, in another summation order than `vdpbf16ps`'s). The weights are the first
//!   operand, read by the tiles straight from the matrix (a weight row is a tile row), and x,
//!   packed once per call as bf16_dot.rs packs it (pairs of inputs for 16 tokens a tile row),
//!   the second.
//!
//! What limits the int8 kernel is getting each block's sums out of the tiles: vector loads of
//! what `tilestored` wrote are slow on the Xeons measured, however late they come, so int8
//! reaches about 0.4 TOP/s a core against the unit's 4 (`examples/gemm_fast.rs` at one thread),
//! still above `vpdpbusd`'s rate there. bf16 pays this once per unit and token block.
//!
//! A unit is `COLS` output columns (two tiles of 16) of a group of token blocks. For int8 its
//! weights are laid out as the tiles want them (`pack_weights`: for each 64 bytes of inputs, 16
//! rows of 16 columns' 32-bit words), a block of inputs at a time, and read from L1 by every
//! token block of the group; a token block is two tiles of 16 tokens. Each token's outputs
//! depend on its own row of x only (a tile's rows, or columns, are independent), so a prompt in
//! pieces gets the bits of one call.

use std::ops::Range;

use super::gemm::{run_units, Scratch, TB};
use super::int8_dot::{quantize_row, BLOCK};
use super::*;
use crate::backend::cpu::kernels::{amx, isa, Isa};

/// Output columns per unit: two tiles of 16.
const COLS: usize = 32;
/// Inputs of int8 weights per pass over a unit's weights: their tiles (32 × 512 = 16 KB) and a
/// token block's (the same) stay in L1.
const KC_I8: usize = 512;
/// bf16 inputs per tile row (64 bytes).
const BF16_STEP: usize = 32;

/// Whether these kernels run `w`: int8 weights of rows of whole `BLOCK`s, or bf16 weights of
/// rows of whole tile rows (32 inputs), on a CPU with AMX (within the instruction-set cap).
pub(super) fn applies(w: &Matrix) -> bool {
    isa() == Isa::Amx
        && match &w.data {
            WeightData::Int8 { .. } => w.cols.is_multiple_of(BLOCK),
            WeightData::Bf16(_) => w.cols.is_multiple_of(BF16_STEP),
            _ => false,
        }
}

/// `out_j = W8A8(x · W_jᵀ)` for every job (int8 weights that `applies`): the bits of
/// `int8_dot::w8a8_ref`.
pub(super) fn int8_group(pool: &Pool, x: &[f32], t: usize, jobs: &[(&Matrix, OutPtr)]) {
    let k = jobs[0].0.cols;
    let xq = quantize_x(pool, x, t, k);
    run_units(pool, t, jobs, k * TB, COLS, &|w, out, token_blocks, cols, scratch| {
        // SAFETY: `applies` checked the CPU; units are disjoint parts of each output.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            int8_unit(&xq, t, w, token_blocks, cols, out.0, scratch)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no AMX here: {:?} {:?} {:?} {:?} {}", w.rows, token_blocks, cols, (out.0, &scratch.tile), xq.q.len())
    });
}

/// `out_j = bf16(x) · W_jᵀ` for every job (bf16 weights that `applies`).
pub(super) fn bf16_group(pool: &Pool, x: &[f32], t: usize, jobs: &[(&Matrix, OutPtr)]) {
    let k = jobs[0].0.cols;
    let xb = super::bf16_dot::pack_x(pool, x, t, k);
    run_units(pool, t, jobs, k * TB * 2, COLS, &|w, out, token_blocks, cols, scratch| {
        // SAFETY: as in `int8_group`.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            bf16_unit(&xb, t, w, token_blocks, cols, out.0, scratch)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("no AMX here: {:?} {:?} {:?} {:?} {}", w.rows, token_blocks, cols, (out.0, &scratch.tile), xb.len())
    });
}

/// Bytes of one tile row: 64 int8 or 32 bf16 inputs.
const ROW: usize = 64;

/// Quantized x as the int8 tiles read it: for each block of `TB` tokens and each `BLOCK` of
/// inputs, the block's `TB` rows of `ROW` bytes one after another, so that a tile of 16 tokens
/// is 1 KB in one run of memory (`[t / TB][k / BLOCK][TB][ROW]`), not 16 lines `k` bytes apart
/// that a power-of-two `k` maps to a few L1 sets. Tokens past t are zero.
fn tile_rows(t: usize, k: usize) -> Vec<i8> {
    vec![0; t.next_multiple_of(TB) * k]
}

/// Where input `i` of token `m` goes in `tile_rows`'s layout.
#[inline(always)]
fn tile_row_at(m: usize, i: usize, k: usize) -> usize {
    ((m / TB * (k / BLOCK) + i / BLOCK) * TB + m % TB) * BLOCK + i % BLOCK
}

/// x quantized for the tiles: `q` in `tile_rows`'s layout, and the block scales
/// `[t / TB][k / BLOCK][TB]` (a block's scales for a token block side by side).
struct QuantizedX {
    q: Vec<i8>,
    scales: Vec<f32>,
}

fn quantize_x(pool: &Pool, x: &[f32], t: usize, k: usize) -> QuantizedX {
    let per = k / BLOCK;
    let mut xq = QuantizedX { q: tile_rows(t, k), scales: vec![0.0; t.next_multiple_of(TB) * per] };
    let (q, scales) = (OutPtr(xq.q.as_mut_ptr() as *mut f32), OutPtr(xq.scales.as_mut_ptr()));
    pool.for_ranges(t, 1, &|tokens| {
        let (q, scales) = (q, scales);
        let (mut row, mut s, mut sums) = (vec![0i8; k], vec![0f32; per], vec![0i32; per]);
        for m in tokens {
            quantize_row(&x[m * k..(m + 1) * k], &mut row, &mut s, &mut sums);
            for (b, chunk) in row.chunks_exact(BLOCK).enumerate() {
                // SAFETY: each token's bytes and scales are written by one worker, inside the
                // buffers.
                unsafe {
                    std::ptr::copy_nonoverlapping(chunk.as_ptr(), (q.0 as *mut i8).add(tile_row_at(m, b * BLOCK, k)), BLOCK);
                    *scales.0.add((m / TB * per + b) * TB + m % TB) = s[b];
                }
            }
        }
    });
    xq
}

/// The weights of columns `cols` (rows of `row_words` 32-bit words at `w`), `steps` tile rows'
/// worth from word `w0`, as the tiles read them: for each step two tiles (columns 0-15 and
/// 16-31 of the unit), row `j` of a tile the columns' word `w0 + 16 · step + j`:
/// `panel[(2 · step + h) · 256 + 16 · j + c]`. Columns past `cols` are zero.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_weights(w: *const u32, row_words: usize, cols: Range<usize>, w0: usize, steps: usize, panel: *mut u32) {
    for step in 0..steps {
        for h in 0..2 {
            let c0 = cols.start + 16 * h;
            let rows = cols.end.saturating_sub(c0).min(16);
            let src = w.wrapping_add(c0 * row_words + w0 + 16 * step) as *const f32;
            super::gemm::transpose16_at(src, row_words, rows, panel.add((2 * step + h) * 256) as *mut f32, 16);
        }
    }
}

/// Part `part` of `parts` of the weights the next pass repacks (bytes `from..from + len` of
/// the rows `cols`, rows `row_bytes` apart) fetched into L2, a few lines at each step of this
/// pass, so that the repacking finds them there instead of waiting on memory between passes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_next_pass(w: *const u8, row_bytes: usize, cols: &Range<usize>, from: usize, len: usize, part: usize, parts: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    let per_row = len.div_ceil(64);
    let lines = cols.len() * per_row;
    for line in lines * part / parts..lines * (part + 1) / parts {
        let (r, c) = (line / per_row, line % per_row);
        _mm_prefetch::<_MM_HINT_T1>(w.add((cols.start + r) * row_bytes + from + 64 * c) as *const i8);
    }
}

/// i32 sums of one block for a token block: `[TB][COLS]`, 64-byte aligned.
#[repr(C, align(64))]
struct BlockSums([[i32; COLS]; TB]);

/// Token blocks `blocks` × columns `cols` (at most `COLS`) of `out[t, w.rows]`, int8 weights.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn int8_unit(xq: &QuantizedX, t: usize, w: &Matrix, blocks: Range<usize>, cols: Range<usize>, out: *mut f32, s: &mut Scratch) {
    use amx::{tile_dot_i8, tile_load, tile_store, tile_zero};
    let WeightData::Int8 { q, scales, .. } = &w.data else { unreachable!("applies: int8 weights") };
    let (n, k, per) = (w.rows, w.cols, w.cols / BLOCK);
    // The unit's f32 sums, `[token][COLS]` for its token blocks.
    let tokens = blocks.len() * TB;
    s.tile.resize(tokens * COLS, 0.0);
    s.tile[..tokens * COLS].fill(0.0);
    s.quads.resize(KC_I8 / 4 * COLS, 0);
    // Two buffers of i32 sums, used in turn, so that the scaling of one block's sums need
    // not wait for the next block's tiles to be stored.
    let mut sums = [BlockSums([[0; COLS]; TB]), BlockSums([[0; COLS]; TB])];
    let mut turn = 0;
    let _tiles = amx::Tiles::configure();
    let mut k0 = 0;
    while k0 < k {
        let kc = (k - k0).min(KC_I8);
        pack_weights(q.as_slice().as_ptr() as *const u32, k / 4, cols.clone(), k0 / 4, kc / BLOCK, s.quads.as_mut_ptr());
        for (i, b) in blocks.clone().enumerate() {
            let two = t - b * TB > 16;
            // The token block's tile rows of this pass's first block, and their scales.
            let a = xq.q.as_ptr().add(tile_row_at(b * TB, k0, k));
            let sx = xq.scales.as_ptr().add((b * per + k0 / BLOCK) * TB);
            let acc = s.tile.as_mut_ptr().add(i * TB * COLS);
            let steps = kc / BLOCK;
            for j in 0..steps {
                if k0 + kc < k {
                    prefetch_next_pass(q.as_slice().as_ptr() as *const u8, k, &cols, k0 + kc, (k - k0 - kc).min(KC_I8), i * steps + j, blocks.len() * steps);
                }
                let panel = s.quads.as_ptr().add(j * 2 * 256);
                let buf = sums[turn].0.as_mut_ptr() as *mut i32;
                turn ^= 1;
                tile_zero!(0);
                tile_zero!(1);
                let a = a.add(j * TB * ROW);
                tile_load!(4, a, ROW);
                tile_load!(6, panel, 64);
                tile_load!(7, panel.add(256), 64);
                tile_dot_i8!(0, 4, 6);
                tile_dot_i8!(1, 4, 7);
                tile_store!(0, buf, COLS * 4);
                tile_store!(1, buf.add(16), COLS * 4);
                if two {
                    tile_zero!(2);
                    tile_zero!(3);
                    tile_load!(5, a.add(16 * ROW), ROW);
                    tile_dot_i8!(2, 5, 6);
                    tile_dot_i8!(3, 5, 7);
                    tile_store!(2, buf.add(16 * COLS), COLS * 4);
                    tile_store!(3, buf.add(16 * COLS + 16), COLS * 4);
                }
                scale_block_sums(buf, sx.add(j * TB), acc, if two { TB } else { 16 });
            }
        }
        k0 += kc;
    }
    // Each column's own scale, once, after all blocks.
    let sw = scales.as_slice().as_ptr().add(cols.start);
    store_rows(s.tile.as_ptr(), blocks, t, cols.len(), sw, out.add(cols.start), n);
}

/// `acc[m][c] = fma(f32(sums[m][c]), sx[m], acc[m][c])` for the first `rows` tokens of a
/// token block: `w8a8_ref`'s step for one block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scale_block_sums(sums: *const i32, sx: *const f32, acc: *mut f32, rows: usize) {
    use std::arch::x86_64::*;
    for m in 0..rows {
        let s = _mm512_set1_ps(*sx.add(m));
        for h in 0..COLS / 16 {
            let (sum, a) = (sums.add(m * COLS + 16 * h), acc.add(m * COLS + 16 * h));
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(sum as *const _)), s, _mm512_loadu_ps(a)));
        }
    }
}

/// Token blocks `blocks` × columns `cols` (at most `COLS`) of `out[t, w.rows]`, bf16 weights.
/// Here the weights are the first operand, read by the tiles straight from the matrix (a
/// weight row is a tile row: 32 inputs of one output column), and x the second: no repacking
/// of weights by vector stores, and each token block's sums stay in the tiles through all of
/// k. The tiles hold the sums transposed (columns × tokens).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn bf16_unit(xp: &[u32], t: usize, w: &Matrix, blocks: Range<usize>, cols: Range<usize>, out: *mut f32, s: &mut Scratch) {
    use amx::{tile_dot_bf16, tile_load, tile_store, tile_zero};
    let WeightData::Bf16(wd) = &w.data else { unreachable!("applies: bf16 weights") };
    let (n, k, nc) = (w.rows, w.cols, cols.len());
    let row_bytes = 2 * k;
    // The unit's weight rows: in place, or for the last columns of a matrix copied beside
    // rows of zeros (a tile always reads 32 rows).
    let weights: *const u8 = if nc == COLS {
        wd.as_slice().as_ptr().add(cols.start * k) as *const u8
    } else {
        s.quads.resize(COLS * k / 2, 0);
        let rows = std::slice::from_raw_parts_mut(s.quads.as_mut_ptr() as *mut u16, COLS * k);
        rows[..nc * k].copy_from_slice(&wd.as_slice()[cols.start * k..cols.end * k]);
        rows[nc * k..].fill(0);
        rows.as_ptr() as *const u8
    };
    s.tile.resize(COLS * TB, 0.0);
    let sums = s.tile.as_mut_ptr();
    let (steps, pairs) = (k / BF16_STEP, k / 2);
    let _tiles = amx::Tiles::configure();
    for b in blocks {
        let tokens = TB.min(t - b * TB);
        let two = tokens > 16;
        let xb = xp.as_ptr().add(b * pairs * TB);
        tile_zero!(0);
        tile_zero!(1);
        tile_zero!(2);
        tile_zero!(3);
        for j in 0..steps {
            let a = weights.add(j * ROW);
            let xj = xb.add(j * 16 * TB);
            tile_load!(4, a, row_bytes);
            tile_load!(5, a.add(16 * row_bytes), row_bytes);
            tile_load!(6, xj, TB * 4);
            tile_dot_bf16!(0, 4, 6);
            tile_dot_bf16!(2, 5, 6);
            if two {
                tile_load!(7, xj.add(16), TB * 4);
                tile_dot_bf16!(1, 4, 7);
                tile_dot_bf16!(3, 5, 7);
            }
        }
        // `sums[c][m]`, columns × tokens, TB apart.
        tile_store!(0, sums, TB * 4);
        tile_store!(2, sums.add(16 * TB), TB * 4);
        if two {
            tile_store!(1, sums.add(16), TB * 4);
            tile_store!(3, sums.add(16 * TB + 16), TB * 4);
        }
        super::gemm::store_transposed(&s.tile, TB, nc, tokens, out.add(b * TB * n + cols.start), n);
    }
}

/// The int8 unit's sums (`[token][COLS]` from the first token of `blocks`) to the real tokens'
/// rows of `out` (rows `n` apart, from the unit's first column), `nc` columns, each times its
/// column's scale.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store_rows(acc: *const f32, blocks: Range<usize>, t: usize, nc: usize, scales: *const f32, out: *mut f32, n: usize) {
    use std::arch::x86_64::*;
    let t0 = blocks.start * TB;
    let tokens = (blocks.end * TB).min(t) - t0;
    for h in 0..nc.div_ceil(16) {
        let mask: __mmask16 = if nc - 16 * h >= 16 { 0xffff } else { (1u16 << (nc - 16 * h)) - 1 };
        let scale = _mm512_maskz_loadu_ps(mask, scales.add(16 * h));
        for m in 0..tokens {
            let v = _mm512_mul_ps(_mm512_loadu_ps(acc.add(m * COLS + 16 * h)), scale);
            _mm512_mask_storeu_ps(out.add((t0 + m) * n + 16 * h), mask, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{lcg, test_matrices};
    use super::*;

    /// On a CPU with AMX: int8 weights give `w8a8_ref`'s bits; bf16 weights the f64 reference
    /// of the bf16-rounded inputs within f32 summation error; for whole and partial tiles of
    /// tokens and columns, inputs across several passes over the weights, one and three
    /// threads; each token's outputs the same bits alone as in a call of many.
    #[test]
    fn amx_gemms_match_their_references() {
        let _held = crate::backend::cpu::kernels::hold_isa();
        if isa() != Isa::Amx {
            eprintln!("no AMX here: the tile GEMMs are not run (the dot-product kernels are tested in int8_dot and bf16_dot)");
            return;
        }
        let mut seed = 13;
        for threads in [1, 3] {
            let pool = Pool::new(threads);
            for &(t, n, k) in &[(1, 5, 64), (7, 33, 128), (16, 32, 512), (17, 70, 1024), (32, 30, 576), (45, 13, 1088), (70, 49, 640), (410, 96, 1024), (40, 390, 192)] {
                let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed) * 3.0).collect();
                let mut ws = test_matrices(n, k, &mut seed);
                let (int8, bf16) = (ws.swap_remove(3), ws.swap_remove(1));
                for w in [&int8, &bf16] {
                    assert!(applies(w));
                    let mut got = vec![0f32; t * n];
                    let group = |x: &[f32], t: usize, out: &mut [f32]| {
                        let jobs = [(w, OutPtr(out.as_mut_ptr()))];
                        if matches!(w.data, WeightData::Int8 { .. }) {
                            int8_group(&pool, x, t, &jobs)
                        } else {
                            bf16_group(&pool, x, t, &jobs)
                        }
                    };
                    group(&x, t, &mut got);
                    let mut want = vec![0f32; t * n];
                    if matches!(w.data, WeightData::Int8 { .. }) {
                        int8_dot::w8a8_ref(&x, t, w, &mut want);
                        assert!(got == want, "int8 t={t} n={n} k={k}: not the reference's bits");
                    } else {
                        let rounded: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
                        matmul_ref(&rounded, t, w, &mut want);
                        let tol = 2e-6 * (k as f32).sqrt() * 4.0 * 3.0;
                        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                            assert!((a - b).abs() <= tol, "bf16 t={t} n={n} k={k} [{i}]: {a} vs {b}");
                        }
                    }
                    for m in [0, t / 2, t - 1] {
                        let mut alone = vec![0f32; n];
                        group(&x[m * k..(m + 1) * k], 1, &mut alone);
                        assert!(alone == got[m * n..(m + 1) * n], "{} t={t} n={n} k={k}: token {m} alone differs", w.dtype());
                    }
                }
            }
        }
    }
}
