//! The fast precision's decode GEMV for k-quant weights (Q4_K, Q5_K, Q6_K): the block's
//! unsigned integers multiplied by each token's inputs quantized to int8 (W4A8 / W6A8), as the
//! local runners multiply them.
//!
//! A token's inputs are quantized in blocks of `XBLOCK` (one weight block), the block's largest
//! |x| at ±127 (`int8_dot::quantize_block`), with the sums of each 16 of those integers kept
//! beside them. A weight block of 256 values is taken as four registers of 64 values, each the
//! two runs of 32 that its bytes hold together (`pairs`); `vpmaddubsw` multiplies a register's
//! unsigned weights by the signed inputs, pairs summed into 16 bits (at most 2 · 63 · 127), and
//! `vpmaddwd` multiplies those by the integer scales of their 16 values and sums pairs into
//! 32-bit lane `l` (values `4l..4l + 4` of the register's first run for `l < 8`, of its second
//! for `l ≥ 8`). The four registers' lanes are added as integers (exact: under 2^24 in every
//! lane, so also exact in f32), and then scaled into 16 f32 sums by one FMA with `d · s_x`.
//! The term that the unsigned integers leave out (Q4_K/Q5_K: the minimums `-dmin · m_r`;
//! Q6_K: the offset `-32 · d · sc`) is the scale's integers times the input sums, 8 lanes by
//! one `vpmaddwd`, added to sums 0..8 by one more FMA. At the end the 16 sums are added
//! pairwise. `dot_ref` is that arithmetic written plainly; the kernels give its bits, whatever
//! tokens share a step.
//!
//! The kernels are AVX-512 (BW; with VNNI `vpdpwssd` fuses the scales' multiply and add) and
//! AVX2 (a register's two runs in two halves); on a CPU with neither, the fast precision's
//! products with these weights are the exact precision's (blocks.rs).

use super::gemv::RowSet;
use super::int8_dot::quantize_blocks;
use crate::model::blocks::{self, BlockFormat};
use crate::model::tensor::{Matrix, WeightData};

/// Inputs per scale: one weight block.
pub const XBLOCK: usize = 256;

/// One token's inputs for the kernel: `x ≈ q · scales[b]` in block `b` of `XBLOCK`, and the
/// sum of `q` over each 16.
pub struct BlockX8 {
    pub q: Vec<i8>,
    pub scales: Vec<f32>,
    pub sums: Vec<i16>,
}

impl BlockX8 {
    /// `x.len()` must be a multiple of `XBLOCK` (a k-quant row's length is).
    pub fn new(x: &[f32]) -> BlockX8 {
        assert!(x.len().is_multiple_of(XBLOCK), "{} inputs are not whole blocks of {XBLOCK}", x.len());
        let mut q = vec![0i8; x.len()];
        let mut scales = vec![0f32; x.len() / XBLOCK];
        quantize_blocks(x, XBLOCK, &mut q, &mut scales);
        let sums = q.chunks_exact(16).map(|c| c.iter().map(|&v| v as i16).sum()).collect();
        BlockX8 { q, scales, sums }
    }
}

/// Whether the fast precision's decode takes `w` by this kernel: k-quant blocks, on a CPU with
/// AVX2 or AVX-512 (within the instruction-set cap).
pub(super) fn applies(w: &Matrix) -> bool {
    let WeightData::Blocks { format, .. } = &w.data else { return false };
    takes(*format) && cfg!(target_arch = "x86_64") && crate::backend::cpu::kernels::isa() >= crate::backend::cpu::kernels::Isa::Avx2
}

/// The formats this kernel is for.
pub fn takes(f: BlockFormat) -> bool {
    matches!(f, BlockFormat::Q4_K | BlockFormat::Q5_K | BlockFormat::Q6_K)
}

/// The two runs of 32 values (of a block's eight) in each of a block's four registers, as the
/// format's bytes hold them: a k-quant's low and high nibbles of 64 bytes are runs `v` and
/// `v + 2` (Q4_K, Q5_K) or `v` and `v + 1` (Q6_K, whose 64 bytes of low bits hold two runs'
/// low nibbles side by side).
fn pairs(f: BlockFormat) -> [(usize, usize); 4] {
    if f == BlockFormat::Q6_K {
        [(0, 1), (2, 3), (4, 5), (6, 7)]
    } else {
        [(0, 2), (1, 3), (4, 6), (5, 7)]
    }
}

/// `out ≈ x · row` for one row of blocks, as the kernel computes it (see the module's notes).
pub fn dot_ref(f: BlockFormat, row: &[u8], x: &BlockX8) -> f32 {
    assert!(takes(f), "{f}: not a k-quant this kernel takes");
    let mut acc = [0f32; 16];
    for (b, block) in row.chunks_exact(f.bytes()).enumerate() {
        let form = blocks::integer_form(f, block);
        let (xq, sums, s) = (&x.q[b * XBLOCK..(b + 1) * XBLOCK], &x.sums[b * 16..(b + 1) * 16], x.scales[b]);
        // Q6_K's scale of each 16 values: `integer_form` holds `sc · (q - 32)`, the kernel `sc · q`.
        let q6_scale = |i: usize| if f == BlockFormat::Q6_K { block[192 + i / 16] as i8 as i32 } else { 0 };
        let mut lanes = [0i32; 16];
        for (first, second) in pairs(f) {
            for (l, lane) in lanes.iter_mut().enumerate() {
                let run = if l < 8 { first } else { second };
                let v0 = 32 * run + 4 * (l % 8);
                *lane += (v0..v0 + 4).map(|i| (form.w[i] as i32 + 32 * q6_scale(i)) * xq[i] as i32).sum::<i32>();
            }
        }
        let ds = form.d * s;
        for (a, &lane) in acc.iter_mut().zip(&lanes) {
            *a = ds.mul_add(lane as f32, *a);
        }
        // The left-out term, in lanes 0..8.
        let (factor, terms): (f32, [i32; 8]) = if f == BlockFormat::Q6_K {
            ((form.d * -32.0) * s, std::array::from_fn(|l| q6_scale(32 * l) * sums[2 * l] as i32 + q6_scale(32 * l + 16) * sums[2 * l + 1] as i32))
        } else {
            (form.c * s, std::array::from_fn(|r| form.m[r] * (sums[2 * r] as i32 + sums[2 * r + 1] as i32)))
        };
        for (a, &term) in acc.iter_mut().zip(&terms) {
            *a = factor.mul_add(term as f32, *a);
        }
    }
    reduce(&mut acc)
}

/// Lanes `j` and `j + len / 2` added, then halves again (the kernel's order).
fn reduce(a: &mut [f32]) -> f32 {
    let mut width = a.len() / 2;
    while width > 0 {
        for j in 0..width {
            a[j] += a[j + width];
        }
        width /= 2;
    }
    a[0]
}

/// Rows `rows` of the GEMV of every token of `xs` (outputs `w.rows` apart).
///
/// # Safety
/// `applies(w)`; `out` must be valid for writes at `m · w.rows + r` for every token `m` and
/// row `r` of `rows`.
pub(super) unsafe fn gemv_rows(xs: &[BlockX8], w: &Matrix, rows: &RowSet, out: *mut f32) {
    let WeightData::Blocks { format, data } = &w.data else { unreachable!("block formats only") };
    #[cfg(target_arch = "x86_64")]
    if crate::backend::cpu::kernels::isa() >= crate::backend::cpu::kernels::Isa::Avx512 {
        avx512::gemv_rows(xs, *format, data.as_slice(), w.rows, w.cols, rows, out)
    } else {
        avx2::gemv_rows(xs, *format, data.as_slice(), w.rows, w.cols, rows, out)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (xs, data, rows, out);
        unreachable!("applies() is false off x86-64 ({format})");
    }
}

/// `dot_ref` for rows `rows` of every token (the fast reference precision's decode products).
///
/// # Safety
/// As `gemv_rows`, without the CPU's instructions.
pub(super) unsafe fn gemv_rows_ref(xs: &[BlockX8], w: &Matrix, rows: std::ops::Range<usize>, out: *mut f32) {
    let WeightData::Blocks { format, data } = &w.data else { unreachable!("block formats only") };
    let rb = format.bytes_of(w.cols);
    for r in rows {
        for (m, x) in xs.iter().enumerate() {
            *out.add(m * w.rows + r) = dot_ref(*format, &data.as_slice()[r * rb..(r + 1) * rb], x);
        }
    }
}

/// How a Q4_K/Q5_K header's 16 bytes (d and dmin as f16, then the 12 bytes of 6-bit scales
/// and minimums, `blocks::scale_min_k4`) unpack into the eight scales (bytes 0..8) and eight
/// minimums (8..16): the byte shuffle of each one's low bits and of its top two bits, then the
/// masks of the low bits taken from low nibbles and from high nibbles.
#[cfg(target_arch = "x86_64")]
const K4_UNPACK: [[i8; 16]; 4] = [
    [4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15],
    [-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11],
    [63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15],
];

/// The byte shuffle that makes, from the unpacked header in both 128-bit lanes, the minimums'
/// words for the input sums of each 16 (minimum `r` twice, zero-extended).
#[cfg(target_arch = "x86_64")]
const MINS_CONTROL: [i8; 32] = [8, -1, 8, -1, 9, -1, 9, -1, 10, -1, 10, -1, 11, -1, 11, -1, 12, -1, 12, -1, 13, -1, 13, -1, 14, -1, 14, -1, 15, -1, 15, -1];

/// One Q4_K/Q5_K header unpacked (see `K4_UNPACK`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn unpack_k4(h: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m128i {
    use std::arch::x86_64::*;
    // Not `K4_UNPACK.map`: a closure in `map` is left as a call in the kernels.
    let c = |i: usize| _mm_loadu_si128(K4_UNPACK[i].as_ptr() as *const __m128i);
    let (low, top) = (_mm_shuffle_epi8(h, c(0)), _mm_shuffle_epi8(h, c(1)));
    let low = _mm_or_si128(_mm_and_si128(low, c(2)), _mm_and_si128(_mm_srli_epi16::<4>(low), c(3)));
    _mm_or_si128(low, _mm_srli_epi16::<2>(_mm_and_si128(top, _mm_set1_epi8(-64))))
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::super::blocks::x86::{f16_at, format, prefetch_rows, reduce8, walk, Tile, Q4_K, Q5_K, Q6_K};
    use super::{pairs, unpack_k4, BlockFormat, BlockX8, RowSet, K4_UNPACK, MINS_CONTROL, XBLOCK};

    pub unsafe fn gemv_rows(xs: &[BlockX8], f: BlockFormat, data: &[u8], n: usize, k: usize, rows: &RowSet, out: *mut f32) {
        use crate::backend::cpu::kernels::{isa, Isa};
        let vnni = isa() >= Isa::Avx512Dot;
        match (f, vnni) {
            (BlockFormat::Q4_K, false) => gemv_rows_of::<Q4_K>(xs, data, n, k, rows, out),
            (BlockFormat::Q5_K, false) => gemv_rows_of::<Q5_K>(xs, data, n, k, rows, out),
            (BlockFormat::Q6_K, false) => gemv_rows_of::<Q6_K>(xs, data, n, k, rows, out),
            (BlockFormat::Q4_K, true) => gemv_rows_vnni::<Q4_K>(xs, data, n, k, rows, out),
            (BlockFormat::Q5_K, true) => gemv_rows_vnni::<Q5_K>(xs, data, n, k, rows, out),
            (BlockFormat::Q6_K, true) => gemv_rows_vnni::<Q6_K>(xs, data, n, k, rows, out),
            _ => unreachable!("takes() lists the formats"),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    unsafe fn gemv_rows_of<const F: u8>(xs: &[BlockX8], data: &[u8], n: usize, k: usize, rows: &RowSet, out: *mut f32) {
        walk::<Kernel<F, false>>(xs, data, format::<F>().bytes_of(k), n, k, rows, out)
    }

    /// With AVX512-VNNI: `vpdpwssd` multiplies the 16-bit sums by their scales and adds them to
    /// the lanes in one instruction (the same integers).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    unsafe fn gemv_rows_vnni<const F: u8>(xs: &[BlockX8], data: &[u8], n: usize, k: usize, rows: &RowSet, out: *mut f32) {
        walk::<Kernel<F, true>>(xs, data, format::<F>().bytes_of(k), n, k, rows, out)
    }

    struct Kernel<const F: u8, const VNNI: bool>;

    impl<const F: u8, const VNNI: bool> Tile for Kernel<F, VNNI> {
        type X = BlockX8;
        #[inline(always)]
        unsafe fn tile<const R: usize, const G: usize>(p: [*const u8; 4], k: usize, xs: &[BlockX8], first: bool, done: impl FnMut(usize, usize, f32)) {
            tile::<F, VNNI, R, G>(p, k, xs, first, done)
        }
    }

    /// The headers of block `b` of `R` Q4_K/Q5_K rows (16 bytes each: d and dmin as f16, then
    /// the 12 bytes of 6-bit scales and minimums, `blocks::scale_min_k4`), each as its eight
    /// scales and eight minimums in bytes 0..16 of every 128-bit lane, and `[d, -dmin]`. Four
    /// rows are unpacked together, a header per lane.
    #[inline(always)]
    unsafe fn headers_k4<const R: usize>(p: &[*const u8; 4], at: usize) -> [(__m512i, __m128); R] {
        let header = |j: usize| _mm_loadu_si128(p[j].add(at) as *const __m128i);
        let lanes = |c: __m128i| _mm512_broadcast_i32x4(c);
        // dmin's sign bit, in the first 32-bit word of each header.
        let negate = lanes(_mm_setr_epi32(0x8000_0000u32 as i32, 0, 0, 0));
        let unpack = |h: __m512i| {
            let c = |i: usize| lanes(_mm_loadu_si128(K4_UNPACK[i].as_ptr() as *const __m128i));
            let (low, top) = (_mm512_shuffle_epi8(h, c(0)), _mm512_shuffle_epi8(h, c(1)));
            let low = _mm512_or_si512(_mm512_and_si512(low, c(2)), _mm512_and_si512(_mm512_srli_epi16::<4>(low), c(3)));
            _mm512_or_si512(low, _mm512_srli_epi16::<2>(_mm512_and_si512(top, _mm512_set1_epi8(-64))))
        };
        let mut out = [(_mm512_setzero_si512(), _mm_setzero_ps()); R];
        if R == 4 {
            let h = _mm512_inserti32x4::<3>(_mm512_inserti32x4::<2>(_mm512_inserti32x4::<1>(_mm512_castsi128_si512(header(0)), header(1)), header(2)), header(3));
            let bytes = unpack(h);
            // [d, -dmin] of the four rows, side by side.
            let halves = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_xor_si512(h, negate));
            let factors = _mm256_cvtph_ps(_mm512_castsi512_si128(halves));
            let row = |j: i32| _mm256_castps256_ps128(_mm256_permutevar8x32_ps(factors, _mm256_setr_epi32(2 * j, 2 * j + 1, 0, 0, 0, 0, 0, 0)));
            out[0] = (_mm512_shuffle_i32x4::<0x00>(bytes, bytes), row(0));
            out[1] = (_mm512_shuffle_i32x4::<0x55>(bytes, bytes), row(1));
            out[2] = (_mm512_shuffle_i32x4::<0xaa>(bytes, bytes), row(2));
            out[3] = (_mm512_shuffle_i32x4::<0xff>(bytes, bytes), row(3));
        } else {
            for (j, o) in out.iter_mut().enumerate() {
                let h = header(j);
                *o = (lanes(unpack_k4(h)), _mm_cvtph_ps(_mm_xor_si128(h, _mm512_castsi512_si128(negate))));
            }
        }
        out
    }

    /// A block's four registers of unsigned integers (in `pairs` order), each register's
    /// integer scales as 16-bit words (word `w` the scale of its values `2w`, `2w + 1`), the
    /// words that multiply the input sums of each 16 for the left-out term, and `[d, that
    /// term's factor]` (before the inputs' scale). Q4_K/Q5_K take their header unpacked
    /// (`headers_k4`); Q6_K reads its own.
    #[inline(always)]
    unsafe fn block<const F: u8>(p: *const u8, header: (__m512i, __m128)) -> ([__m512i; 4], [__m512i; 4], __m256i, __m128) {
        let low4 = _mm512_set1_epi8(0x0f);
        let nibbles = |q: __m512i| (_mm512_and_si512(q, low4), _mm512_and_si512(_mm512_srli_epi16::<4>(q), low4));
        match F {
            Q4_K | Q5_K => {
                // Each register's scale words and the minimums' by byte shuffles of the
                // header's unpacked bytes, in every 128-bit lane (cheaper here than shuffles of
                // 16-bit words).
                let (all, factors) = header;
                let control = |j: usize| _mm512_shuffle_epi8(all, load(&SCALE_CONTROL[j]));
                let scales = [control(0), control(1), control(2), control(3)];
                let mins = _mm256_shuffle_epi8(_mm512_castsi512_si256(all), _mm256_loadu_si256(MINS_CONTROL.as_ptr() as *const __m256i));
                let qs = if F == Q5_K { p.add(48) } else { p.add(16) };
                let (a0, a1) = nibbles(_mm512_loadu_si512(qs as *const _));
                let (b0, b1) = nibbles(_mm512_loadu_si512(qs.add(64) as *const _));
                let mut w = [a0, a1, b0, b1];
                if F == Q5_K {
                    // The fifth bits: bit v of each of qh's 32 bytes for run v.
                    let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(16) as *const __m256i));
                    for (j, (r0, r1)) in pairs(BlockFormat::Q5_K).into_iter().enumerate() {
                        let bits = _mm512_inserti64x4::<1>(_mm512_set1_epi8((1u8 << r0) as i8), _mm256_set1_epi8((1u8 << r1) as i8));
                        w[j] = _mm512_mask_add_epi8(w[j], _mm512_test_epi8_mask(qh, bits), w[j], _mm512_set1_epi8(16));
                    }
                }
                (w, scales, mins, factors)
            }
            _ => {
                // Q6_K: half h holds runs 4h..4h + 4; their low bits in 64 bytes of ql (runs
                // 4h, 4h + 1 in the low nibbles, 4h + 2, 4h + 3 in the high), their high two
                // bits in 32 bytes of qh at bit 2·(run - 4h).
                let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192) as *const __m128i));
                let shifts = |a: i16, b: i16| _mm512_inserti64x4::<1>(_mm512_set1_epi16(a), _mm256_set1_epi16(b));
                let high = |qh: __m512i, s: __m512i| _mm512_and_si512(_mm512_slli_epi16::<4>(_mm512_srlv_epi16(qh, s)), _mm512_set1_epi8(0x30));
                let mut w = [_mm512_setzero_si512(); 4];
                for h in 0..2 {
                    let (lo, hi) = nibbles(_mm512_loadu_si512(p.add(64 * h) as *const _));
                    let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i));
                    w[2 * h] = _mm512_or_si512(lo, high(qh, shifts(0, 2)));
                    w[2 * h + 1] = _mm512_or_si512(hi, high(qh, shifts(4, 6)));
                }
                let d = f16_at(p.add(208));
                let words = _mm512_zextsi256_si512(scales16);
                let index = |j: usize| _mm512_permutexvar_epi16(load(&SCALE_INDEX[j]), words);
                let scales = [index(0), index(1), index(2), index(3)];
                (w, scales, scales16, _mm_setr_ps(d, d * -32.0, 0.0, 0.0))
            }
        }
    }

    /// For each Q4_K/Q5_K register (runs `pairs`), the byte shuffle that makes its scale words
    /// from a block's scale bytes: words 0..16 the first run's, 16..32 the second's, each
    /// zero-extended.
    const SCALE_CONTROL: [[i8; 64]; 4] = [scale_control(0, 2), scale_control(1, 3), scale_control(4, 6), scale_control(5, 7)];

    const fn scale_control(r0: usize, r1: usize) -> [i8; 64] {
        let mut c = [-1i8; 64];
        let mut word = 0;
        while word < 32 {
            c[2 * word] = if word < 16 { r0 as i8 } else { r1 as i8 };
            word += 1;
        }
        c
    }

    /// For each Q6_K register (runs `2j`, `2j + 1`), which of the 16 scale words each of its 32
    /// words takes (one per 16 values).
    const SCALE_INDEX: [[i16; 32]; 4] = [scale_index(0), scale_index(1), scale_index(2), scale_index(3)];

    const fn scale_index(j: usize) -> [i16; 32] {
        let mut idx = [0i16; 32];
        let mut word = 0;
        while word < 32 {
            idx[word] = (4 * j + word / 8) as i16;
            word += 1;
        }
        idx
    }

    #[inline(always)]
    unsafe fn load<T>(v: &T) -> __m512i {
        _mm512_loadu_si512(v as *const T as *const _)
    }

    /// `R` rows of blocks (at `p`) × `G` tokens: `done(j, m, Σ)` for row j and token m, each
    /// sum `dot_ref`'s bits. The rows are prefetched on the `first` pass over them.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // j and m index the rows, the tokens and the sums together
    unsafe fn tile<const F: u8, const VNNI: bool, const R: usize, const G: usize>(p: [*const u8; 4], k: usize, xs: &[BlockX8], first: bool, mut done: impl FnMut(usize, usize, f32)) {
        let bb = format::<F>().bytes();
        let mut acc = [[_mm512_setzero_ps(); G]; R];
        let mut prefetched = 0;
        for b in 0..k / XBLOCK {
            if first {
                prefetch_rows(&p[..R], &mut prefetched, (b + 1) * bb);
            }
            // The tokens' inputs of this block in the registers' order, their sums and scale.
            let mut xv = [[_mm512_setzero_si512(); 4]; G];
            let mut sums = [_mm256_setzero_si256(); G];
            let mut s = [_mm_setzero_ps(); G];
            for m in 0..G {
                let q = xs[m].q.as_ptr().add(b * XBLOCK);
                for (j, (r0, r1)) in pairs(format::<F>()).into_iter().enumerate() {
                    let first = _mm256_loadu_si256(q.add(32 * r0) as *const __m256i);
                    xv[m][j] = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), _mm256_loadu_si256(q.add(32 * r1) as *const __m256i));
                }
                sums[m] = _mm256_loadu_si256(xs[m].sums.as_ptr().add(16 * b) as *const __m256i);
                s[m] = _mm_set1_ps(xs[m].scales[b]);
            }
            let headers = if F == Q6_K { [(_mm512_setzero_si512(), _mm_setzero_ps()); R] } else { headers_k4::<R>(&p, b * bb) };
            for j in 0..R {
                let (w, sc, rest_words, factors) = block::<F>(p[j].add(b * bb), headers[j]);
                for m in 0..G {
                    let mut lanes = _mm512_setzero_si512();
                    for i in 0..4 {
                        let pairs = _mm512_maddubs_epi16(w[i], xv[m][i]);
                        lanes = if VNNI { _mm512_dpwssd_epi32(lanes, pairs, sc[i]) } else { _mm512_add_epi32(lanes, _mm512_madd_epi16(pairs, sc[i])) };
                    }
                    // [d · s, factor · s], each product rounded once as dot_ref rounds it.
                    let f = _mm_mul_ps(factors, s[m]);
                    acc[j][m] = _mm512_fmadd_ps(_mm512_broadcastss_ps(f), _mm512_cvtepi32_ps(lanes), acc[j][m]);
                    let terms = _mm512_castps256_ps512(_mm256_cvtepi32_ps(_mm256_madd_epi16(rest_words, sums[m])));
                    let factor = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
                    acc[j][m] = _mm512_mask3_fmadd_ps(factor, terms, acc[j][m], 0x00ff);
                }
            }
        }
        for j in 0..R {
            for m in 0..G {
                let a = acc[j][m];
                let halves = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a))));
                done(j, m, reduce8(halves));
            }
        }
    }
}

/// The same arithmetic on AVX2: a block's register of 64 values in two halves of 256 bits, its
/// first run's 8 lanes and its second's.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::super::blocks::x86::{f16_at, format, k_quant_run, prefetch_rows, reduce8, walk, Tile, Q4_K, Q5_K, Q6_K};
    use super::{pairs, unpack_k4, BlockFormat, BlockX8, RowSet, MINS_CONTROL, XBLOCK};

    pub unsafe fn gemv_rows(xs: &[BlockX8], f: BlockFormat, data: &[u8], n: usize, k: usize, rows: &RowSet, out: *mut f32) {
        match f {
            BlockFormat::Q4_K => gemv_rows_of::<Q4_K>(xs, data, n, k, rows, out),
            BlockFormat::Q5_K => gemv_rows_of::<Q5_K>(xs, data, n, k, rows, out),
            BlockFormat::Q6_K => gemv_rows_of::<Q6_K>(xs, data, n, k, rows, out),
            _ => unreachable!("takes() lists the formats"),
        }
    }

    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn gemv_rows_of<const F: u8>(xs: &[BlockX8], data: &[u8], n: usize, k: usize, rows: &RowSet, out: *mut f32) {
        walk::<Kernel<F>>(xs, data, format::<F>().bytes_of(k), n, k, rows, out)
    }

    struct Kernel<const F: u8>;

    impl<const F: u8> Tile for Kernel<F> {
        type X = BlockX8;
        #[inline(always)]
        unsafe fn tile<const R: usize, const G: usize>(p: [*const u8; 4], k: usize, xs: &[BlockX8], first: bool, done: impl FnMut(usize, usize, f32)) {
            tile::<F, R, G>(p, k, xs, first, done)
        }
    }

    /// Run `r`'s integer scales as 16 words (word `w` the scale of its values `2w`, `2w + 1`),
    /// from the header's unpacked bytes in both 128-bit lanes (Q4_K/Q5_K) or the 16 scale
    /// bytes there (Q6_K: each in a word's high byte, then shifted down with its sign).
    #[inline(always)]
    unsafe fn scale_words<const F: u8>(bytes: __m256i, r: usize) -> __m256i {
        if F == Q6_K {
            let (a, b) = ((((2 * r) as i16) << 8) | 0x80, (((2 * r + 1) as i16) << 8) | 0x80);
            let control = _mm256_setr_epi16(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
            _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(bytes, control))
        } else {
            _mm256_shuffle_epi8(bytes, _mm256_set1_epi16(r as i16 | (0x80u16 << 8) as i16))
        }
    }

    /// A block's scale bytes in both lanes, the words that multiply the input sums of each 16
    /// for the left-out term, and `[d, that term's factor]` (before the inputs' scale).
    #[inline(always)]
    unsafe fn header<const F: u8>(p: *const u8) -> (__m256i, __m256i, __m128) {
        if F == Q6_K {
            let scales = _mm_loadu_si128(p.add(192) as *const __m128i);
            let d = f16_at(p.add(208));
            (_mm256_broadcastsi128_si256(scales), _mm256_cvtepi8_epi16(scales), _mm_setr_ps(d, d * -32.0, 0.0, 0.0))
        } else {
            let h = _mm_loadu_si128(p as *const __m128i);
            let bytes = _mm256_broadcastsi128_si256(unpack_k4(h));
            let mins = _mm256_shuffle_epi8(bytes, _mm256_loadu_si256(MINS_CONTROL.as_ptr() as *const __m256i));
            let factors = _mm_cvtph_ps(_mm_xor_si128(h, _mm_setr_epi32(0x8000_0000u32 as i32, 0, 0, 0)));
            (bytes, mins, factors)
        }
    }

    /// `R` rows of blocks (at `p`) × `G` tokens: `done(j, m, Σ)` for row j and token m, each
    /// sum `dot_ref`'s bits (its lanes 0..8 in `first`, 8..16 in `second`).
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // j and m index the rows, the tokens and the sums together
    unsafe fn tile<const F: u8, const R: usize, const G: usize>(p: [*const u8; 4], k: usize, xs: &[BlockX8], first: bool, mut done: impl FnMut(usize, usize, f32)) {
        let bb = format::<F>().bytes();
        let order = pairs(format::<F>());
        let mut acc = [[[_mm256_setzero_ps(); 2]; G]; R];
        let mut prefetched = 0;
        for b in 0..k / XBLOCK {
            if first {
                prefetch_rows(&p[..R], &mut prefetched, (b + 1) * bb);
            }
            for j in 0..R {
                let blk = p[j].add(b * bb);
                let (bytes, rest_words, factors) = header::<F>(blk);
                for m in 0..G {
                    let q = xs[m].q.as_ptr().add(b * XBLOCK);
                    let mut lanes = [_mm256_setzero_si256(); 2];
                    for (r0, r1) in order {
                        for (half, r) in [r0, r1].into_iter().enumerate() {
                            let x = _mm256_loadu_si256(q.add(32 * r) as *const __m256i);
                            let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(k_quant_run::<F>(blk, r), x), scale_words::<F>(bytes, r));
                            lanes[half] = _mm256_add_epi32(lanes[half], sums);
                        }
                    }
                    let f = _mm_mul_ps(factors, _mm_set1_ps(xs[m].scales[b]));
                    let ds = _mm256_broadcastss_ps(f);
                    acc[j][m][0] = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(lanes[0]), acc[j][m][0]);
                    acc[j][m][1] = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(lanes[1]), acc[j][m][1]);
                    let sums = _mm256_loadu_si256(xs[m].sums.as_ptr().add(16 * b) as *const __m256i);
                    let terms = _mm256_cvtepi32_ps(_mm256_madd_epi16(rest_words, sums));
                    acc[j][m][0] = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(f)), terms, acc[j][m][0]);
                }
            }
        }
        for j in 0..R {
            for m in 0..G {
                done(j, m, reduce8(_mm256_add_ps(acc[j][m][0], acc[j][m][1])));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::kernels::matmul::int8_dot::quantize_block;
    use crate::backend::cpu::kernels::matmul::blocks::tests::random_matrix;
    use crate::backend::cpu::kernels::matmul::tests::lcg;
    use crate::backend::cpu::kernels::matmul::{decode_group_fast, decode_group_fast_reference, matmul_ref, weight};
    use crate::backend::cpu::pool::Pool;

    /// The quantized inputs: each block's largest |x| at ±127, every value within half a step,
    /// the sums those of the integers; `quantize_block`'s bits on every instruction set (blocks
    /// of zeros and with a NaN too).
    #[test]
    fn inputs_are_int8_blocks_with_their_sums() {
        let mut seed = 3;
        let mut x: Vec<f32> = (0..768).map(|_| lcg(&mut seed)).collect();
        x[300] = 40.0; // a block with an outlier gets a coarser step than the others
        let q = BlockX8::new(&x);
        assert!(q.scales[1] > 10.0 * q.scales[0], "scales {:?}", q.scales);
        for (i, &v) in x.iter().enumerate() {
            let s = q.scales[i / XBLOCK];
            assert!((q.q[i] as f32 * s - v).abs() <= 0.5 * s * 1.0001, "input {i}: {v} as {} · {s}", q.q[i]);
        }
        for b in 0..3 {
            assert_eq!(q.q[b * XBLOCK..(b + 1) * XBLOCK].iter().map(|v| v.unsigned_abs()).max(), Some(127));
        }
        x[600] = f32::NAN;
        x[0..256].fill(0.0);
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let q2 = BlockX8::new(&x);
            for b in 0..3 {
                let mut want = [0i8; XBLOCK];
                let scale = quantize_block(&x[b * XBLOCK..(b + 1) * XBLOCK], &mut want);
                assert_eq!(q2.scales[b].to_bits(), scale.to_bits(), "{isa:?} block {b}: scale {} vs quantize_block's {scale}", q2.scales[b]);
                assert_eq!(&q2.q[b * XBLOCK..(b + 1) * XBLOCK], &want[..], "{isa:?} block {b}: not quantize_block's integers");
            }
        });
        for (g, &sum) in q.sums.iter().enumerate() {
            assert_eq!(sum as i32, q.q[16 * g..16 * g + 16].iter().map(|&v| v as i32).sum::<i32>());
        }
    }

    /// The kernel gives `dot_ref`'s bits for every k-quant, one token and several (each token
    /// the bits it gets alone), sets whose last streams run short, and the fast reference
    /// precision's products are `dot_ref`; `dot_ref` is the f64 product of the dequantized
    /// weights up to rounding x to int8 in blocks of 256.
    #[test]
    fn the_w4a8_gemv_is_its_reference_and_near_the_exact_product() {
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let mut seed = 9;
            let pool = Pool::new(3);
            for f in [BlockFormat::Q4_K, BlockFormat::Q5_K, BlockFormat::Q6_K] {
                for &(t, n, k) in &[(1, 37, 256), (1, 9, 1024), (2, 13, 512), (3, 21, 256), (5, 8, 768)] {
                    let w = random_matrix(f, n, k, &mut seed);
                    let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed)).collect();
                    let xs: Vec<BlockX8> = x.chunks(k).map(BlockX8::new).collect();
                    let (mut fast, mut plain) = (vec![f32::NAN; t * n], vec![f32::NAN; t * n]);
                    decode_group_fast(&pool, &x, t, &mut [(&w, &mut fast)]);
                    decode_group_fast_reference(&pool, &x, t, &mut [(&w, &mut plain)]);
                    let WeightData::Blocks { data, .. } = &w.data else { unreachable!() };
                    let rb = f.bytes_of(k);
                    let mut exact = vec![0f32; t * n];
                    matmul_ref(&x, t, &w, &mut exact);
                    let kernel = applies(&w);
                    for m in 0..t {
                        for r in 0..n {
                            let reference = dot_ref(f, &data.as_slice()[r * rb..(r + 1) * rb], &xs[m]);
                            let (g, p) = (fast[m * n + r], plain[m * n + r]);
                            if kernel {
                                assert_eq!(g.to_bits(), reference.to_bits(), "{isa:?} {f} t={t} n={n} k={k} token {m} row {r}: {g} vs dot_ref {reference}");
                                assert_eq!(p.to_bits(), reference.to_bits(), "{isa:?} {f} fast reference, token {m} row {r}: {p} vs dot_ref {reference}");
                            }
                            // Each input moves by at most half its block's step.
                            let tol: f32 = (0..k).map(|c| weight(&w, r, c).abs() * 0.5 * xs[m].scales[c / XBLOCK]).sum::<f32>() * 1.001 + 1e-5;
                            assert!((reference - exact[m * n + r]).abs() <= tol, "{f} token {m} row {r}: dot_ref {reference} vs exact {} (tolerance {tol})", exact[m * n + r]);
                            assert!((g - exact[m * n + r]).abs() <= tol.max(1e-3 * exact[m * n + r].abs()), "{isa:?} {f} token {m} row {r}: {g} vs exact {}", exact[m * n + r]);
                        }
                    }
                }
            }
        });
    }
}
