//! The prefill GEMM's sums for a few tokens. The packed GEMM (`gemm.rs`) puts tokens in the
//! vector lanes, so for one token it computes fifteen lanes of padding; the GEMV puts the
//! inputs in the lanes, which sums in another order. This kernel puts output columns in the
//! lanes (the unit's widened weights transposed to `[input][column]`) and sums each output
//! exactly as the GEMM does: a fused multiply-add chain from zero over each `KC`-input block,
//! the blocks added to the output in order, an int8 row's scale applied last. So a prompt's
//! product has the same bits whether its tokens come in one call or in several, of any size:
//! a prefix reused from a cached state continues exactly as a cold prefill of the whole
//! prompt (`forward.rs`).

use super::gemm::KC;
use super::*;

/// Most tokens of a call that take this kernel; past this, the packed GEMM. The two give the
/// same bits; this one is faster up to 8 tokens (at one, about 1.5x faster than the packed
/// GEMM, still about 3x the decode GEMV: `examples/gemm_small.rs`), the packed GEMM uses its
/// lanes fully from 16.
pub const NARROW_MAX_TOKENS: usize = 8;

/// Output columns per unit: two AVX-512 vectors.
pub const NARROW_COLS: usize = 32;

pub(super) fn narrow_group(pool: &Pool, x: &[f32], t: usize, jobs: &[(&Matrix, OutPtr)]) {
    assert!((1..=NARROW_MAX_TOKENS).contains(&t), "the narrow GEMM takes 1..={NARROW_MAX_TOKENS} tokens, not {t}");
    let units: Vec<usize> = jobs.iter().map(|(w, _)| w.rows.div_ceil(NARROW_COLS)).collect();
    let queue = WorkQueue::new(units.iter().sum());
    pool.run(&|_| {
        PANEL.with_borrow_mut(|panel| {
            while let Some(u) = queue.take() {
                let (j, c) = locate(&units, u);
                let (w, out) = jobs[j];
                let cols = c * NARROW_COLS..((c + 1) * NARROW_COLS).min(w.rows);
                // Units are disjoint column ranges of each output.
                narrow_unit(x, t, w, cols, out, panel)
            }
        })
    });
}

thread_local! {
    /// Each worker's buffers, kept between calls (a prefill of a few tokens makes hundreds of
    /// calls; fresh buffers of this size cost a page fault per 4 KB each time).
    static PANEL: std::cell::RefCell<NarrowPanel> = std::cell::RefCell::new(NarrowPanel::new());
}

/// A worker's buffers: the unit's rows widened (`[NARROW_COLS][k]`), a `KC` block of them
/// transposed, and the sums.
struct NarrowPanel {
    rows: Vec<f32>,
    by_input: Vec<f32>,
    tile: [[f32; NARROW_COLS]; NARROW_MAX_TOKENS],
}

impl NarrowPanel {
    fn new() -> NarrowPanel {
        NarrowPanel { rows: Vec::new(), by_input: vec![0f32; KC * NARROW_COLS], tile: [[0f32; NARROW_COLS]; NARROW_MAX_TOKENS] }
    }
}

crate::backend::cpu::kernels::multiversion! {
    /// Columns `cols` (at most `NARROW_COLS`) of `out[t, w.rows] = x · Wᵀ`, into `out` (rows
    /// `w.rows` apart), which no other unit writes at these columns.
    fn narrow_unit(x: &[f32], t: usize, w: &Matrix, cols: std::ops::Range<usize>, out: OutPtr, p: &mut NarrowPanel) => narrow_unit_body
}

#[inline(always)]
fn narrow_unit_body(x: &[f32], t: usize, w: &Matrix, cols: std::ops::Range<usize>, out: OutPtr, p: &mut NarrowPanel) {
    let (n, k) = (w.rows, w.cols);
    let nc = cols.len();
    for row in p.tile.iter_mut().take(t) {
        *row = [0f32; NARROW_COLS];
    }
    // The unit's rows are one run of memory: widened whole, one after another, they are read
    // in order (a KC block of every row at a time reads 32 strips, which the prefetchers
    // follow badly: measured 1.4x slower). They stay in L2 for the transposes, a line of
    // padding apart (rows a multiple of 4 KB apart would share L1 sets when the transposes
    // read eight of them at once).
    let stride = k.next_multiple_of(16) + 16;
    p.rows.resize(NARROW_COLS * stride, 0.0);
    let mut scales = [1f32; NARROW_COLS];
    for (c, (row, scale)) in p.rows.chunks_exact_mut(stride).zip(&mut scales).enumerate() {
        let row = &mut row[..k];
        if c < nc {
            *scale = widen_row_range(w, cols.start + c, 0, k, row);
        } else {
            row.iter_mut().for_each(|v| *v = 0.0);
        }
    }
    let mut k0 = 0;
    while k0 < k {
        let kc = (k - k0).min(KC);
        transpose_panel(&p.rows[k0..], stride, kc, &mut p.by_input);
        block_sums_body(x, t, k, k0, kc, &p.by_input, &mut p.tile);
        k0 += kc;
    }
    for (ti, row) in p.tile.iter().enumerate().take(t) {
        for (c, (&v, &scale)) in row.iter().zip(&scales).enumerate().take(nc) {
            // SAFETY: the caller's unit owns these columns of `out`, which holds t rows of n.
            unsafe { *out.0.add(ti * n + cols.start + c) = v * scale };
        }
    }
}

/// `by_input[kk * NARROW_COLS + c] = rows[c * stride + kk]` for `kk < kc`.
#[inline(always)]
fn transpose_panel(rows: &[f32], stride: usize, kc: usize, by_input: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::backend::cpu::kernels::{isa, Isa};
        // SAFETY: features checked; whole blocks inside both buffers.
        let done = match isa() {
            Isa::Avx512 | Isa::Avx512Dot | Isa::Amx => unsafe { transpose_panel_avx512(rows, stride, kc, by_input) },
            Isa::Avx2 => unsafe { transpose_panel_avx2(rows, stride, kc, by_input) },
            Isa::Portable => 0,
        };
        return transpose_panel_plain(rows, stride, done..kc, by_input);
    }
    #[allow(unreachable_code)]
    transpose_panel_plain(rows, stride, 0..kc, by_input)
}

fn transpose_panel_plain(rows: &[f32], stride: usize, inputs: std::ops::Range<usize>, by_input: &mut [f32]) {
    for kk in inputs {
        for c in 0..NARROW_COLS {
            by_input[kk * NARROW_COLS + c] = rows[c * stride + kk];
        }
    }
}

/// Whole 16-input groups as 16 x 16 register transposes; returns how many inputs it did.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_panel_avx512(rows: &[f32], stride: usize, kc: usize, by_input: &mut [f32]) -> usize {
    let whole = kc / 16 * 16;
    for c0 in (0..NARROW_COLS).step_by(16) {
        for kk0 in (0..whole).step_by(16) {
            super::gemm::transpose16_at(rows.as_ptr().add(c0 * stride + kk0), stride, 16, by_input.as_mut_ptr().add(kk0 * NARROW_COLS + c0), NARROW_COLS);
        }
    }
    whole
}

/// Whole 8-input groups as 8 x 8 register transposes; returns how many inputs it did.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_panel_avx2(rows: &[f32], stride: usize, kc: usize, by_input: &mut [f32]) -> usize {
    use std::arch::x86_64::*;
    let whole = kc / 8 * 8;
    for c0 in (0..NARROW_COLS).step_by(8) {
        for kk0 in (0..whole).step_by(8) {
            let mut r = [_mm256_setzero_ps(); 8];
            for (i, v) in r.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(rows.as_ptr().add((c0 + i) * stride + kk0));
            }
            // Pairs of rows interleaved; then quads, each 128-bit half holding one input of
            // four rows (input j in the low half, j + 4 in the high); then the halves of rows
            // 0-3 and 4-7 joined.
            let mut t = [_mm256_setzero_ps(); 8];
            for i in (0..8).step_by(2) {
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
            let mut q = [_mm256_setzero_ps(); 8];
            for (half, base) in [(0, 0), (4, 4)] {
                q[half] = _mm256_shuffle_ps::<0x44>(t[base], t[base + 2]);
                q[half + 1] = _mm256_shuffle_ps::<0xEE>(t[base], t[base + 2]);
                q[half + 2] = _mm256_shuffle_ps::<0x44>(t[base + 1], t[base + 3]);
                q[half + 3] = _mm256_shuffle_ps::<0xEE>(t[base + 1], t[base + 3]);
            }
            for j in 0..4 {
                let lo = _mm256_permute2f128_ps::<0x20>(q[j], q[4 + j]);
                let hi = _mm256_permute2f128_ps::<0x31>(q[j], q[4 + j]);
                _mm256_storeu_ps(by_input.as_mut_ptr().add((kk0 + j) * NARROW_COLS + c0), lo);
                _mm256_storeu_ps(by_input.as_mut_ptr().add((kk0 + j + 4) * NARROW_COLS + c0), hi);
            }
        }
    }
    whole
}

/// `tile[ti][c] += Σ_kk by_input[kk][c] · x[ti][k0 + kk]` over one block, each sum a fused
/// multiply-add chain from zero in input order (the GEMM's micro-kernel order).
#[inline(always)]
fn block_sums_body(x: &[f32], t: usize, k: usize, k0: usize, kc: usize, by_input: &[f32], tile: &mut [[f32; NARROW_COLS]; NARROW_MAX_TOKENS]) {
    // Two tokens at a time: four independent chains a column pair, enough to keep the FMA
    // units busy behind their latency, with every weight row loaded once for both.
    let mut ti = 0;
    while ti < t {
        let two = t - ti >= 2;
        let (mut a, mut b) = ([0f32; NARROW_COLS], [0f32; NARROW_COLS]);
        let xa = &x[ti * k + k0..ti * k + k0 + kc];
        let xb = if two { &x[(ti + 1) * k + k0..(ti + 1) * k + k0 + kc] } else { xa };
        for (kk, w) in by_input[..kc * NARROW_COLS].chunks_exact(NARROW_COLS).enumerate() {
            let (va, vb) = (xa[kk], xb[kk]);
            for c in 0..NARROW_COLS {
                a[c] = w[c].mul_add(va, a[c]);
                b[c] = w[c].mul_add(vb, b[c]);
            }
        }
        for c in 0..NARROW_COLS {
            tile[ti][c] += a[c];
        }
        if two {
            for c in 0..NARROW_COLS {
                tile[ti + 1][c] += b[c];
            }
        }
        ti += 2;
    }
}
