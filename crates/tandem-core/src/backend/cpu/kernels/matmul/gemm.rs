//! The prefill GEMM. x is packed once per call into blocks of `TB` tokens laid out
//! `[k][TB]`, so that one vector load takes 16 tokens of one input; each unit of work is
//! `UNIT_COLS` output columns for all tokens: their weight rows are widened to f32 (a plain
//! contiguous copy, no transpose) `KC` inputs at a time, and a register-blocked micro-kernel
//! multiplies each weight by a 16-token vector of x with a broadcast FMA. The tile comes out
//! transposed (columns × tokens) and is written to the row-major output once, at the end.
//!
//! Summation order per output (over `KC`-input blocks, sequentially within each, the blocks
//! added in order) is the same on every instruction set.

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
    run_units(pool, t, jobs, k * TB * 4, UNIT_COLS, &|w, out, token_blocks, cols, scratch| {
        // SAFETY: units are disjoint (tokens × columns) parts of each output.
        unsafe { unit(&xp, t, w, token_blocks, cols, out.0, scratch) }
    });
}

/// One unit of a GEMM: `(w, out, token_blocks, columns, scratch)`.
pub(super) type UnitFn<'a> = dyn Fn(&Matrix, OutPtr, Range<usize>, Range<usize>, &mut Scratch) + Sync + 'a;

/// A prompt's products cut into units that the pool's workers take from one queue (one or
/// two at a time): for each job, `unit_cols` output columns of a group of token blocks (of
/// `TB`), each passed to `unit(w, out, token_blocks, columns, scratch)` with a scratch of the
/// worker's own. A group is about `X_BYTES_PER_UNIT` of packed x (`block_bytes` a token
/// block), so that the units that follow one another (the same tokens, the next columns) find
/// it in L2. The GEMMs of every arithmetic share it (gemm.rs, bf16_dot.rs, int8_dot.rs with
/// `UNIT_COLS`, amx_gemm.rs with its tiles' 32).
pub(super) fn run_units(pool: &Pool, t: usize, jobs: &[(&Matrix, OutPtr)], block_bytes: usize, unit_cols: usize, unit: &UnitFn) {
    let blocks = t.div_ceil(TB);
    let group = (X_BYTES_PER_UNIT / block_bytes.max(1)).clamp(1, blocks);
    let groups = blocks.div_ceil(group);
    // Column blocks per item of the queue: two where each worker gets many items, so that
    // two workers' items never share a cache line of an output row (48 f32 columns are three
    // whole lines; 24 are one and a half, and workers taking turns wrote the same line at
    // every other boundary), else one, so that many workers still find work.
    let single: usize = jobs.iter().map(|(w, _)| w.rows.div_ceil(unit_cols) * groups).sum();
    let span = if single >= 16 * pool.threads() { 2 } else { 1 };
    let items: Vec<usize> = jobs.iter().map(|(w, _)| w.rows.div_ceil(unit_cols * span) * groups).collect();
    let queue = WorkQueue::new(items.iter().sum());
    pool.run(&|_| {
        let mut scratch = Scratch::new(group * TB);
        while let Some(u) = queue.take() {
            let (j, u) = locate(&items, u);
            let (w, out) = jobs[j];
            let col_items = w.rows.div_ceil(unit_cols * span);
            let (g, c) = (u / col_items, u % col_items);
            for c in c * span..((c + 1) * span).min(w.rows.div_ceil(unit_cols)) {
                let cols = c * unit_cols..((c + 1) * unit_cols).min(w.rows);
                unit(w, out, g * group..((g + 1) * group).min(blocks), cols, &mut scratch);
            }
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

/// 32-bit words packed as `pack_block` packs f32 (the int8 kernel's quadruples): the
/// transposes and copies move bits and never compute with them, so any pattern comes through.
pub(super) fn pack_words(x: &[u32], tokens: usize, k: usize, block: &mut [u32]) {
    // SAFETY: u32 and f32 have one size and alignment; every bit pattern is a valid f32.
    let (x, block) = unsafe { (std::slice::from_raw_parts(x.as_ptr() as *const f32, x.len()), std::slice::from_raw_parts_mut(block.as_mut_ptr() as *mut f32, block.len())) };
    pack_block(x, tokens, k, block)
}

/// One block: `block[kk * TB + m] = x[m * k + kk]` for the block's `tokens` rows of x.
fn pack_block(x: &[f32], tokens: usize, k: usize, block: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::backend::cpu::kernels::isa() >= crate::backend::cpu::kernels::Isa::Avx512 {
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
    let whole = k / 16 * 16;
    for m0 in (0..tokens).step_by(16) {
        for kk0 in (0..whole).step_by(16) {
            transpose16_at(x.as_ptr().add(m0 * k + kk0), k, tokens - m0, block.as_mut_ptr().add(kk0 * TB + m0), TB);
        }
    }
    whole
}

/// 16 values of each of `rows` rows (at most 16; the rest taken as zero) at `src`, rows
/// `src_stride` apart, written transposed: value `c` of row `r` to `dst[c * dst_stride + r]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose16_at(src: *const f32, src_stride: usize, rows: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::*;
    let mut r = [_mm512_setzero_ps(); 16];
    for (i, v) in r.iter_mut().enumerate().take(rows) {
        *v = _mm512_loadu_ps(src.add(i * src_stride));
    }
    for (c, v) in transpose16(r).iter().enumerate() {
        _mm512_storeu_ps(dst.add(c * dst_stride), *v);
    }
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

/// A worker's buffers: the widened weights of one unit and one `KC` block (and the W8A8
/// kernel's weight quadruples, int8_dot.rs), and the unit's transposed output tile.
pub struct Scratch {
    panel: Vec<f32>,
    pub(super) quads: Vec<u32>,
    pub(super) tile: Vec<f32>,
}

impl Scratch {
    /// For units of up to `tokens` tokens.
    pub fn new(tokens: usize) -> Scratch {
        Scratch { panel: vec![0f32; UNIT_COLS * KC], quads: Vec::new(), tile: vec![0f32; UNIT_COLS * tokens.div_ceil(TB) * TB] }
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
        crate::backend::cpu::kernels::Isa::Avx512 | crate::backend::cpu::kernels::Isa::Avx512Dot | crate::backend::cpu::kernels::Isa::Amx => return unit_avx512(xp, t, w, blocks, cols, out, s),
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
pub(super) unsafe fn store_transposed(tile: &[f32], stride: usize, nc: usize, tokens: usize, out: *mut f32, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::backend::cpu::kernels::isa() >= crate::backend::cpu::kernels::Isa::Avx512 {
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
