//! Products with weights in GGML's block formats (model/blocks: a GGUF file's Q4_K and its
//! kin, or `--quant q4_k`).
//!
//! The decode GEMV multiplies each block in its integer form (`blocks::integer_form`:
//! `value_i = d · w_i + c · m_s`) by the token's inputs rounded to 16-bit integers (`BlockX`,
//! one scale per token, as the int8 GEMV rounds them: relative error below 2e-5), so that a
//! block's sum is exact integer arithmetic in 8 lanes: lane `l` sums, in every run of 32
//! values, values `2l`, `2l + 1`, `2l + 16` and `2l + 17` (two `vpmaddwd`, or one of 512 bits
//! folded in half). A group of runs (a whole block; half of one for Q6_K, whose larger
//! integers would overflow 32 bits over a whole block) is then scaled by `d` into 8 f32 sums
//! by one FMA each, and where the format has minimums, lane `s` also takes `c · m_s` times the
//! sum of run `s`'s inputs (`c · m_s` exact in f32; the sum exact), by one more FMA. The 8
//! lanes are added pairwise at the end. `dot_ref` is that arithmetic written plainly; the AVX2
//! and AVX-512 kernels give its bits, whatever tokens share a step. No integer sum overflows:
//! a lane gathers at most 32 products of |w| ≤ 1953 (Q5_K) or 16 of |w| ≤ 4096 (Q6_K) and
//! |x| ≤ 32767, under 2^31.
//!
//! A prompt's kernels (gemm.rs, narrow.rs) take the weights dequantized to f32, a panel at a
//! time (`dequantize_range`: the plain dequantizer's bits, in loops the compiler vectorises),
//! so that a prompt computes exactly what f32 weights of those values would.

use super::gemv::{round_to_i16, RowSet};
use crate::model::blocks::{self, BlockFormat};
use crate::model::tensor::{Matrix, WeightData};

/// One token's inputs for the block GEMV: `x ≈ q · scale` in 16-bit integers, and the sum of
/// `q` over each run of 32 (the minimums' term; exact in f32, at most 32 · 32767).
pub struct BlockX {
    pub q: Vec<i16>,
    pub sums: Vec<f32>,
    pub scale: f32,
}

impl BlockX {
    pub fn new(x: &[f32]) -> BlockX {
        let (q, scale) = round_to_i16(x);
        let sums = q.chunks(32).map(|c| c.iter().map(|&v| v as i32).sum::<i32>() as f32).collect();
        BlockX { q, sums, scale }
    }
}

/// Whether `w` is in a block format (every block-format matrix takes these kernels).
pub(super) fn applies(w: &Matrix) -> bool {
    matches!(w.data, WeightData::Blocks { .. })
}

/// Runs of 32 values summed in integers before one FMA scales them by `d`.
fn runs_per_group(f: BlockFormat) -> usize {
    if f == BlockFormat::Q6_K {
        4
    } else {
        f.elements() / 32
    }
}

/// `out ≈ x · row` for one row of blocks, as the kernels compute it (see the module's notes).
pub fn dot_ref(f: BlockFormat, row: &[u8], x: &BlockX) -> f32 {
    let mut acc = [0f32; 8];
    let (e, group) = (f.elements(), runs_per_group(f));
    for (b, block) in row.chunks_exact(f.bytes()).enumerate() {
        let form = blocks::integer_form(f, block);
        let xq = &x.q[b * e..(b + 1) * e];
        for g in (0..e / 32).step_by(group) {
            let mut lanes = [0i32; 8];
            for v in g..g + group {
                for (l, lane) in lanes.iter_mut().enumerate() {
                    for i in [2 * l, 2 * l + 1, 2 * l + 16, 2 * l + 17] {
                        *lane += form.w[32 * v + i] as i32 * xq[32 * v + i] as i32;
                    }
                }
            }
            for (a, &lane) in acc.iter_mut().zip(&lanes) {
                *a = form.d.mul_add(lane as f32, *a);
            }
        }
        for (s, &m) in form.m.iter().enumerate() {
            acc[s] = (form.c * m as f32).mul_add(x.sums[b * e / 32 + s], acc[s]);
        }
    }
    reduce8(acc) * x.scale
}

/// Lanes `j` and `j + 4` added, then `j + 2`, `j + 1` (the kernels' order).
fn reduce8(mut a: [f32; 8]) -> f32 {
    for width in [4, 2, 1] {
        for j in 0..width {
            a[j] += a[j + width];
        }
    }
    a[0]
}

/// Rows `rows` of the GEMV of every token of `xs` (outputs `w.rows` apart).
///
/// # Safety
/// `out` must be valid for writes at `m · w.rows + r` for every token `m` and row `r` of `rows`.
pub(super) unsafe fn gemv_rows(xs: &[BlockX], w: &Matrix, rows: &RowSet, out: *mut f32) {
    let WeightData::Blocks { format, data } = &w.data else { unreachable!("block formats only") };
    #[cfg(target_arch = "x86_64")]
    if x86::takes(*format) {
        use crate::backend::cpu::kernels::{isa, Isa};
        match isa() {
            Isa::Avx512 | Isa::Avx512Dot | Isa::Amx => return avx512::gemv_rows(xs, *format, data.as_slice(), w.rows, w.cols, rows, out),
            Isa::Avx2 => return avx2::gemv_rows(xs, *format, data.as_slice(), w.rows, w.cols, rows, out),
            Isa::Portable => {}
        }
    }
    let rb = format.bytes_of(w.cols);
    for r in rows.iter() {
        let row = &data.as_slice()[r * rb..(r + 1) * rb];
        for (m, x) in xs.iter().enumerate() {
            *out.add(m * w.rows + r) = dot_ref(*format, row, x);
        }
    }
}

/// Values `k0..k0 + buf.len()` of a row of blocks as f32 into `buf`: the plain dequantizer's
/// bits (vectorised for the formats a GGUF file's matrices mostly hold).
pub(super) fn dequantize_range(f: BlockFormat, row: &[u8], k0: usize, buf: &mut [f32]) {
    let e = f.elements();
    let (first, last) = (k0 / e, (k0 + buf.len()).div_ceil(e));
    if k0.is_multiple_of(e) && buf.len().is_multiple_of(e) {
        return dequantize_blocks(f, &row[first * f.bytes()..last * f.bytes()], buf);
    }
    // A range that cuts a block (no kernel asks for one today: their panels are 256 wide).
    let mut whole = vec![0f32; (last - first) * e];
    dequantize_blocks(f, &row[first * f.bytes()..last * f.bytes()], &mut whole);
    let skip = k0 - first * e;
    buf.copy_from_slice(&whole[skip..skip + buf.len()]);
}

crate::backend::cpu::kernels::multiversion! {
    /// Whole blocks into `out`, each value as `blocks::dequantize_block` computes it, in loops
    /// over a run's values that the compiler vectorises (one copy per instruction set).
    fn dequantize_blocks(f: BlockFormat, bytes: &[u8], out: &mut [f32]) => dequantize_blocks_body
}

#[inline(always)]
fn dequantize_blocks_body(f: BlockFormat, bytes: &[u8], out: &mut [f32]) {
    let (e, bb) = (f.elements(), f.bytes());
    assert!(out.len().is_multiple_of(e) && bytes.len() == out.len() / e * bb);
    let f16 = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    for (b, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(e)) {
        match f {
            BlockFormat::Q8_0 => {
                let d = f16(b, 0);
                for (y, &q) in y.iter_mut().zip(&b[2..34]) {
                    *y = (q as i8) as f32 * d;
                }
            }
            BlockFormat::Q4_0 => {
                let d = f16(b, 0);
                let (lo, hi) = y.split_at_mut(16);
                for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..18]) {
                    *l = ((q & 0xf) as i32 - 8) as f32 * d;
                    *h = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
            BlockFormat::Q4_K | BlockFormat::Q5_K => {
                let (d, dmin) = (f16(b, 0), f16(b, 2));
                let q5 = f == BlockFormat::Q5_K;
                let qs = if q5 { &b[48..176] } else { &b[16..144] };
                for v in 0..8 {
                    let (sc, m) = blocks::scale_min_k4(v, &b[4..16]);
                    let (step, min) = (d * sc as f32, dmin * m as f32);
                    let q = &qs[32 * (v / 2)..32 * (v / 2) + 32];
                    let y = &mut y[32 * v..32 * v + 32];
                    if q5 {
                        for ((y, &q), &h) in y.iter_mut().zip(q).zip(&b[16..48]) {
                            *y = step * ((q >> (4 * (v % 2))) & 0xf | ((h >> v) & 1) << 4) as f32 - min;
                        }
                    } else {
                        for (y, &q) in y.iter_mut().zip(q) {
                            *y = step * ((q >> (4 * (v % 2))) & 0xf) as f32 - min;
                        }
                    }
                }
            }
            BlockFormat::Q6_K => {
                let d = f16(b, 208);
                for v in 0..8 {
                    let (half, part) = (v / 4, v % 4);
                    let ql = &b[64 * half + 32 * (part % 2)..][..32];
                    let qh = &b[128 + 32 * half..][..32];
                    for i in 0..2 {
                        let s = d * (b[192 + 2 * v + i] as i8) as f32;
                        let y = &mut y[32 * v + 16 * i..32 * v + 16 * i + 16];
                        for ((y, &l), &h) in y.iter_mut().zip(&ql[16 * i..16 * i + 16]).zip(&qh[16 * i..16 * i + 16]) {
                            let q = ((l >> (4 * (part / 2))) & 0xf) | (((h >> (2 * part)) & 3) << 4);
                            *y = s * (q as i32 - 32) as f32;
                        }
                    }
                }
            }
            _ => blocks::dequantize_block(f, b, y),
        }
    }
}

/// What the x86 kernels share: the formats they are built for, and a block's scalar parts
/// and integers as bytes.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::{BlockFormat, RowSet};
    use crate::backend::cpu::kernels::matmul::gemv::{prefetch_weights, PREFETCH_BYTES};

    /// The formats with kernels of their own (the others take `dot_ref`), each a constant that
    /// the kernels are built for one by one, so that a format's branches fold away.
    pub const Q4_0: u8 = 0;
    pub const Q8_0: u8 = 1;
    pub const Q4_K: u8 = 2;
    pub const Q5_K: u8 = 3;
    pub const Q6_K: u8 = 4;

    pub fn takes(f: BlockFormat) -> bool {
        id(f).is_some()
    }

    pub fn id(f: BlockFormat) -> Option<u8> {
        Some(match f {
            BlockFormat::Q4_0 => Q4_0,
            BlockFormat::Q8_0 => Q8_0,
            BlockFormat::Q4_K => Q4_K,
            BlockFormat::Q5_K => Q5_K,
            BlockFormat::Q6_K => Q6_K,
            _ => return None,
        })
    }

    #[inline(always)]
    pub fn format<const F: u8>() -> BlockFormat {
        match F {
            Q4_0 => BlockFormat::Q4_0,
            Q8_0 => BlockFormat::Q8_0,
            Q4_K => BlockFormat::Q4_K,
            Q5_K => BlockFormat::Q5_K,
            _ => BlockFormat::Q6_K,
        }
    }

    /// Whether a format's runs carry integer scales (which multiply its integers).
    #[inline(always)]
    pub fn scaled<const F: u8>() -> bool {
        matches!(F, Q4_K | Q5_K | Q6_K)
    }

    #[inline(always)]
    pub unsafe fn f16_at(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const u16) as i32)))
    }

    /// A k-quant's eight 6-bit scales and minimums from its 12 bytes (`blocks::scale_min_k4`,
    /// four at a time in 32-bit words).
    #[inline(always)]
    pub unsafe fn scales_k4(p: *const u8) -> ([u8; 8], [u8; 8]) {
        let w = |i: usize| std::ptr::read_unaligned(p.add(4 * i) as *const u32);
        let (a, b, c) = (w(0), w(1), w(2));
        let sc_lo = a & 0x3f3f_3f3f;
        let m_lo = b & 0x3f3f_3f3f;
        let sc_hi = (c & 0x0f0f_0f0f) | (((a >> 6) & 0x0303_0303) << 4);
        let m_hi = ((c >> 4) & 0x0f0f_0f0f) | (((b >> 6) & 0x0303_0303) << 4);
        let join = |lo: u32, hi: u32| ((hi as u64) << 32 | lo as u64).to_le_bytes();
        (join(sc_lo, sc_hi), join(m_lo, m_hi))
    }

    /// What a block's runs share: its scale `d`, the factor `c` of its minimums and their
    /// integers, and the integer scale of each 16 values (`sc[2v]` and `sc[2v + 1]` for run
    /// `v`). Filled by plain loops: `std::array::from_fn` and `map` were left as calls in the
    /// kernels, each with a `vzeroupper`, once per block; the scales kept as bytes of one
    /// integer instead, each taken by a shift, measured slower.
    #[derive(Clone, Copy)]
    pub struct Header {
        pub d: f32,
        pub c: f32,
        pub m: [i32; 8],
        pub sc: [i16; 16],
    }

    impl Header {
        pub const ZERO: Header = Header { d: 0.0, c: 0.0, m: [0; 8], sc: [0; 16] };

        /// The integer scales of run `v`'s first and last 16 values.
        #[inline(always)]
        pub fn scales(&self, v: usize) -> (i16, i16) {
            (self.sc[2 * v], self.sc[2 * v + 1])
        }
    }

    #[inline(always)]
    pub unsafe fn header<const F: u8>(p: *const u8) -> Header {
        let mut h = Header::ZERO;
        match F {
            Q4_K | Q5_K => {
                let (sc, m) = scales_k4(p.add(4));
                (h.d, h.c) = (f16_at(p), -f16_at(p.add(2)));
                for i in 0..8 {
                    h.m[i] = m[i] as i32;
                    h.sc[2 * i] = sc[i] as i16;
                    h.sc[2 * i + 1] = sc[i] as i16;
                }
            }
            Q6_K => {
                h.d = f16_at(p.add(208));
                for i in 0..16 {
                    h.sc[i] = *(p.add(192 + i) as *const i8) as i16;
                }
            }
            _ => h.d = f16_at(p),
        }
        h
    }

    /// The addresses of block `b` of each of `R` rows and their headers.
    #[inline(always)]
    pub unsafe fn blocks_at<const F: u8, const R: usize>(p: &[*const u8], b: usize) -> ([*const u8; R], [Header; R]) {
        let bb = format::<F>().bytes();
        let (mut at, mut h) = ([std::ptr::null(); R], [Header::ZERO; R]);
        for j in 0..R {
            at[j] = p[j].add(b * bb);
            h[j] = header::<F>(at[j]);
        }
        (at, h)
    }

    /// Run `v`'s 32 integers (before their scales; `integer_form`'s `w` divided by them) as
    /// signed bytes, in order.
    #[inline(always)]
    pub unsafe fn run_bytes<const F: u8>(p: *const u8, v: usize) -> __m256i {
        match F {
            Q8_0 => _mm256_loadu_si256(p.add(2) as *const __m256i),
            Q4_0 => {
                let q = _mm_loadu_si128(p.add(2) as *const __m128i);
                let lo = _mm_and_si128(q, _mm_set1_epi8(0x0f));
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), _mm_set1_epi8(0x0f));
                _mm256_sub_epi8(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi), _mm256_set1_epi8(8))
            }
            Q4_K | Q5_K => k_quant_run::<F>(p, v),
            // Q6_K's integers are stored 32 above their values.
            _ => _mm256_sub_epi8(k_quant_run::<F>(p, v), _mm256_set1_epi8(32)),
        }
    }

    /// A k-quant's run `v` as its stored unsigned integers (Q4_K 0..16, Q5_K 0..32, Q6_K 0..64:
    /// 32 above the signed value).
    #[inline(always)]
    pub unsafe fn k_quant_run<const F: u8>(p: *const u8, v: usize) -> __m256i {
        let low4 = _mm256_set1_epi8(0x0f);
        match F {
            Q4_K | Q5_K => {
                let qs = if F == Q5_K { p.add(48) } else { p.add(16) };
                let q = _mm256_loadu_si256(qs.add(32 * (v / 2)) as *const __m256i);
                let nib = if v % 2 == 0 { _mm256_and_si256(q, low4) } else { _mm256_and_si256(_mm256_srli_epi16::<4>(q), low4) };
                if F == Q5_K {
                    // The fifth bits: bit v of each byte of qh.
                    let qh = _mm256_loadu_si256(p.add(16) as *const __m256i);
                    let bit = _mm256_set1_epi8(1i8.wrapping_shl(v as u32));
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                    _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(16)))
                } else {
                    nib
                }
            }
            _ => {
                // Q6_K run v: half v / 4 of the block, part v % 4 of the half (see
                // dequantize_block): four bits of ql and two of qh.
                let (half, part) = (v / 4, v % 4);
                let ql = _mm256_loadu_si256(p.add(64 * half + 32 * (part % 2)) as *const __m256i);
                let qh = _mm256_loadu_si256(p.add(128 + 32 * half) as *const __m256i);
                let low = if part < 2 { _mm256_and_si256(ql, low4) } else { _mm256_and_si256(_mm256_srli_epi16::<4>(ql), low4) };
                let high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * part as i32)), _mm256_set1_epi8(3));
                _mm256_or_si256(low, _mm256_slli_epi16::<4>(high))
            }
        }
    }

    /// On a tile's first pass over its rows: prefetch every line up to `PREFETCH_BYTES` past
    /// byte `upto` of each row, once (`done` counts what was).
    #[inline(always)]
    pub unsafe fn prefetch_rows(p: &[*const u8], done: &mut usize, upto: usize) {
        while *done < upto {
            for pj in p {
                prefetch_weights(pj.wrapping_add(*done + PREFETCH_BYTES) as *const i8);
            }
            *done += 64;
        }
    }

    /// Whether a format has minimums (one per run of 32, lane `s` taking run `s`'s).
    #[inline(always)]
    pub fn has_minimums<const F: u8>() -> bool {
        matches!(F, Q4_K | Q5_K)
    }

    /// `c · m_s` of a block's eight runs, each exact in f32 (an f16 times a 6-bit integer).
    #[inline(always)]
    pub unsafe fn minimums(h: &Header) -> __m256 {
        let m = _mm256_cvtepi32_ps(_mm256_loadu_si256(h.m.as_ptr() as *const __m256i));
        _mm256_mul_ps(_mm256_set1_ps(h.c), m)
    }

    /// The integer lanes of a group, as f32 sums: `acc + d · lanes`.
    #[inline(always)]
    pub unsafe fn scale_group(acc: __m256, d: f32, lanes: __m256i) -> __m256 {
        _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc)
    }

    /// The 8 lanes added as `reduce8` adds them.
    #[inline(always)]
    pub unsafe fn reduce8(a: __m256) -> f32 {
        let v4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)))
    }

    /// A kernel's tile: `R` rows of blocks (at `p`) × `G` tokens, `done(j, m, Σ)` for row j and
    /// token m; the rows prefetched on the `first` pass over them.
    pub trait Tile {
        type X;
        unsafe fn tile<const R: usize, const G: usize>(p: [*const u8; 4], k: usize, xs: &[Self::X], first: bool, done: impl FnMut(usize, usize, f32));
    }

    /// Rows `rows` of the GEMV of every token of `xs` by `T`'s tiles: four rows (one per
    /// stream) × up to two tokens at a time, a set's rows one at a time where its last streams
    /// run short.
    #[inline(always)]
    pub unsafe fn walk<T: Tile>(xs: &[T::X], data: &[u8], rb: usize, n: usize, k: usize, rows: &RowSet, out: *mut f32) {
        let base = data.as_ptr();
        for o in rows.offsets.clone() {
            let quad = [o, rows.stride + o, 2 * rows.stride + o, 3 * rows.stride + o];
            let mut m0 = 0;
            while m0 < xs.len() {
                let g = (xs.len() - m0).min(2);
                let x = &xs[m0..m0 + g];
                let first = m0 == 0;
                if quad[3] < rows.rows {
                    let p = [base.add(quad[0] * rb), base.add(quad[1] * rb), base.add(quad[2] * rb), base.add(quad[3] * rb)];
                    let done = |j: usize, m: usize, v: f32| *out.add((m0 + m) * n + quad[j]) = v;
                    if g == 2 { T::tile::<4, 2>(p, k, x, first, done) } else { T::tile::<4, 1>(p, k, x, first, done) }
                } else {
                    for &r in quad.iter().filter(|&&r| r < rows.rows) {
                        let done = |_: usize, m: usize, v: f32| *out.add((m0 + m) * n + r) = v;
                        let p = [base.add(r * rb); 4];
                        if g == 2 { T::tile::<1, 2>(p, k, x, first, done) } else { T::tile::<1, 1>(p, k, x, first, done) }
                    }
                }
                m0 += g;
            }
        }
    }

    /// How many runs of 32 a group sums in integers (`super::runs_per_group`).
    #[inline(always)]
    pub fn group<const F: u8>() -> usize {
        super::runs_per_group(format::<F>())
    }
}

/// The block GEMV on AVX-512: four rows (one per stream) × up to two tokens at a time, a run's
/// 32 integers in one register.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::x86::*;
    use super::{BlockFormat, BlockX, RowSet};

    /// Rows `rows` of the GEMV of every token of `xs` for a format that `takes`.
    pub unsafe fn gemv_rows(xs: &[BlockX], f: BlockFormat, data: &[u8], n: usize, k: usize, rows: &RowSet, out: *mut f32) {
        match id(f) {
            Some(Q4_0) => gemv_rows_of::<Q4_0>(xs, data, n, k, rows, out),
            Some(Q8_0) => gemv_rows_of::<Q8_0>(xs, data, n, k, rows, out),
            Some(Q4_K) => gemv_rows_of::<Q4_K>(xs, data, n, k, rows, out),
            Some(Q5_K) => gemv_rows_of::<Q5_K>(xs, data, n, k, rows, out),
            Some(Q6_K) => gemv_rows_of::<Q6_K>(xs, data, n, k, rows, out),
            _ => unreachable!("takes() lists the formats"),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    unsafe fn gemv_rows_of<const F: u8>(xs: &[BlockX], data: &[u8], n: usize, k: usize, rows: &RowSet, out: *mut f32) {
        walk::<Kernel<F>>(xs, data, format::<F>().bytes_of(k), n, k, rows, out)
    }

    struct Kernel<const F: u8>;

    impl<const F: u8> Tile for Kernel<F> {
        type X = BlockX;
        #[inline(always)]
        unsafe fn tile<const R: usize, const G: usize>(p: [*const u8; 4], k: usize, xs: &[BlockX], first: bool, done: impl FnMut(usize, usize, f32)) {
            tile::<F, R, G>(p, k, xs, first, done)
        }
    }

    /// `R` rows of blocks (at `p`) × `G` tokens: `done(j, m, Σ)` for row j and token m, each
    /// sum in `dot_ref`'s order. The rows are prefetched on the `first` pass over them.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // j and m index the rows, the tokens and the sums together
    unsafe fn tile<const F: u8, const R: usize, const G: usize>(p: [*const u8; 4], k: usize, xs: &[BlockX], first: bool, mut done: impl FnMut(usize, usize, f32)) {
        let f = format::<F>();
        let (e, bb) = (f.elements(), f.bytes());
        let mut acc = [[_mm256_setzero_ps(); G]; R];
        let mut prefetched = 0;
        for b in 0..k / e {
            if first {
                prefetch_rows(&p[..R], &mut prefetched, (b + 1) * bb);
            }
            let (blk, h) = blocks_at::<F, R>(&p, b);
            for g in (0..e / 32).step_by(group::<F>()) {
                let mut lanes = [[_mm512_setzero_si512(); G]; R];
                for v in g..g + group::<F>() {
                    for j in 0..R {
                        let mut wv = _mm512_cvtepi8_epi16(run_bytes::<F>(blk[j], v));
                        if scaled::<F>() {
                            let (s0, s1) = h[j].scales(v);
                            let sc = if F == Q6_K { _mm512_inserti64x4::<1>(_mm512_set1_epi16(s0), _mm256_set1_epi16(s1)) } else { _mm512_set1_epi16(s0) };
                            wv = _mm512_mullo_epi16(wv, sc);
                        }
                        for m in 0..G {
                            let xv = _mm512_loadu_si512(xs[m].q.as_ptr().add(b * e + 32 * v) as *const _);
                            lanes[j][m] = _mm512_add_epi32(lanes[j][m], _mm512_madd_epi16(wv, xv));
                        }
                    }
                }
                for j in 0..R {
                    for m in 0..G {
                        // Values 2l, 2l + 1 of each run in lane l, 2l + 16, 2l + 17 in lane l + 8.
                        let l = lanes[j][m];
                        let folded = _mm256_add_epi32(_mm512_castsi512_si256(l), _mm512_extracti64x4_epi64::<1>(l));
                        acc[j][m] = scale_group(acc[j][m], h[j].d, folded);
                    }
                }
            }
            if has_minimums::<F>() {
                for j in 0..R {
                    let cm = minimums(&h[j]);
                    for m in 0..G {
                        acc[j][m] = _mm256_fmadd_ps(cm, _mm256_loadu_ps(xs[m].sums.as_ptr().add(b * 8)), acc[j][m]);
                    }
                }
            }
        }
        for j in 0..R {
            for m in 0..G {
                done(j, m, reduce8(acc[j][m]) * xs[m].scale);
            }
        }
    }
}

/// The block GEMV on AVX2: four rows (one per stream) × one token at a time, a run's 32
/// integers in two registers.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::x86::*;
    use super::{BlockFormat, BlockX, RowSet};

    pub unsafe fn gemv_rows(xs: &[BlockX], f: BlockFormat, data: &[u8], n: usize, k: usize, rows: &RowSet, out: *mut f32) {
        match id(f) {
            Some(Q4_0) => gemv_rows_of::<Q4_0>(xs, data, n, k, rows, out),
            Some(Q8_0) => gemv_rows_of::<Q8_0>(xs, data, n, k, rows, out),
            Some(Q4_K) => gemv_rows_of::<Q4_K>(xs, data, n, k, rows, out),
            Some(Q5_K) => gemv_rows_of::<Q5_K>(xs, data, n, k, rows, out),
            Some(Q6_K) => gemv_rows_of::<Q6_K>(xs, data, n, k, rows, out),
            _ => unreachable!("takes() lists the formats"),
        }
    }

    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn gemv_rows_of<const F: u8>(xs: &[BlockX], data: &[u8], n: usize, k: usize, rows: &RowSet, out: *mut f32) {
        let rb = format::<F>().bytes_of(k);
        let base = data.as_ptr();
        for o in rows.offsets.clone() {
            let quad = [o, rows.stride + o, 2 * rows.stride + o, 3 * rows.stride + o];
            for (m, x) in xs.iter().enumerate() {
                if quad[3] < rows.rows {
                    let p = [base.add(quad[0] * rb), base.add(quad[1] * rb), base.add(quad[2] * rb), base.add(quad[3] * rb)];
                    tile::<F, 4>(p, k, x, m == 0, |j, v| *out.add(m * n + quad[j]) = v);
                } else {
                    for &r in quad.iter().filter(|&&r| r < rows.rows) {
                        tile::<F, 1>([base.add(r * rb); 4], k, x, m == 0, |_, v| *out.add(m * n + r) = v);
                    }
                }
            }
        }
    }

    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // j indexes the rows and the sums together
    unsafe fn tile<const F: u8, const R: usize>(p: [*const u8; 4], k: usize, x: &BlockX, first: bool, mut done: impl FnMut(usize, f32)) {
        let f = format::<F>();
        let (e, bb) = (f.elements(), f.bytes());
        let mut acc = [_mm256_setzero_ps(); R];
        let mut prefetched = 0;
        for b in 0..k / e {
            if first {
                prefetch_rows(&p[..R], &mut prefetched, (b + 1) * bb);
            }
            let (blk, h) = blocks_at::<F, R>(&p, b);
            for g in (0..e / 32).step_by(group::<F>()) {
                let mut lanes = [_mm256_setzero_si256(); R];
                for v in g..g + group::<F>() {
                    let xq = x.q.as_ptr().add(b * e + 32 * v);
                    let (x0, x1) = (_mm256_loadu_si256(xq as *const __m256i), _mm256_loadu_si256(xq.add(16) as *const __m256i));
                    for j in 0..R {
                        let bytes = run_bytes::<F>(blk[j], v);
                        let mut w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes));
                        let mut w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(bytes));
                        if scaled::<F>() {
                            let (s0, s1) = h[j].scales(v);
                            let s0 = _mm256_set1_epi16(s0);
                            let s1 = if F == Q6_K { _mm256_set1_epi16(s1) } else { s0 };
                            w0 = _mm256_mullo_epi16(w0, s0);
                            w1 = _mm256_mullo_epi16(w1, s1);
                        }
                        lanes[j] = _mm256_add_epi32(lanes[j], _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1)));
                    }
                }
                for j in 0..R {
                    acc[j] = scale_group(acc[j], h[j].d, lanes[j]);
                }
            }
            if has_minimums::<F>() {
                let sums = _mm256_loadu_ps(x.sums.as_ptr().add(b * 8));
                for j in 0..R {
                    acc[j] = _mm256_fmadd_ps(minimums(&h[j]), sums, acc[j]);
                }
            }
        }
        for j in 0..R {
            done(j, reduce8(acc[j]) * x.scale);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend::cpu::kernels::matmul::tests::lcg;
    use crate::backend::cpu::kernels::matmul::{decode_group, matmul_ref, weight};
    use crate::backend::cpu::pool::Pool;
    use crate::model::tensor::Buf;

    /// A matrix of random blocks (finite scales) of every format.
    pub(crate) fn random_matrix(f: BlockFormat, n: usize, k: usize, seed: &mut u64) -> Matrix {
        let mut s = *seed;
        let data = crate::model::blocks::tests::random_blocks(f, n * k / f.elements(), &mut s);
        *seed = s;
        Matrix { rows: n, cols: k, data: WeightData::Blocks { format: f, data: Buf::from_vec(data) } }
    }

    /// The fast dequantizer gives the plain one's bits, for every format, whole rows and
    /// ranges that start and end inside blocks.
    #[test]
    fn panels_dequantize_to_the_plain_bits() {
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let mut seed = 21;
            for f in BlockFormat::ALL {
                let k = 512;
                let w = random_matrix(f, 3, k, &mut seed);
                let WeightData::Blocks { data, .. } = &w.data else { unreachable!() };
                let rb = f.bytes_of(k);
                for r in 0..3 {
                    let row = &data.as_slice()[r * rb..(r + 1) * rb];
                    let mut want = vec![0f32; k];
                    blocks::dequantize(f, row, &mut want);
                    for (k0, len) in [(0, k), (256, 256), (32, 64), (40, 300), (0, 1)] {
                        let mut got = vec![f32::NAN; len];
                        dequantize_range(f, row, k0, &mut got);
                        let same = got.iter().zip(&want[k0..k0 + len]).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{isa:?} {f} row {r} values {k0}..{}: not the plain dequantizer's bits", k0 + len);
                    }
                }
            }
        });
    }

    /// Every format's GEMV gives `dot_ref`'s bits on every instruction set, one token and
    /// several (each token the bits it gets alone), sets whose last streams run short; and
    /// `dot_ref` is the f64 product of the dequantized weights up to rounding x to 16 bits.
    #[test]
    fn the_block_gemv_is_its_reference_and_near_the_exact_product() {
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let mut seed = 5;
            let pool = Pool::new(3);
            for f in BlockFormat::ALL {
                for &(t, n, k) in &[(1, 37, 256), (1, 9, 1024), (2, 13, 512), (3, 21, 256), (5, 8, 768)] {
                    let w = random_matrix(f, n, k, &mut seed);
                    let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed)).collect();
                    let xs: Vec<BlockX> = x.chunks(k).map(BlockX::new).collect();
                    let mut got = vec![f32::NAN; t * n];
                    decode_group(&pool, &x, t, &mut [(&w, &mut got)]);
                    let WeightData::Blocks { data, .. } = &w.data else { unreachable!() };
                    let rb = f.bytes_of(k);
                    let mut want = vec![0f32; t * n];
                    matmul_ref(&x, t, &w, &mut want);
                    for m in 0..t {
                        for r in 0..n {
                            let reference = dot_ref(f, &data.as_slice()[r * rb..(r + 1) * rb], &xs[m]);
                            let g = got[m * n + r];
                            assert_eq!(g.to_bits(), reference.to_bits(), "{isa:?} {f} t={t} n={n} k={k} token {m} row {r}: {g} vs dot_ref {reference}");
                            // x rounded to 16 bits moves each product by at most half a step.
                            let x_max = x[m * k..(m + 1) * k].iter().fold(0f32, |a, v| a.max(v.abs()));
                            let w_abs: f32 = (0..k).map(|c| weight(&w, r, c).abs()).sum();
                            let tol = w_abs * x_max / 65534.0 + 1e-5 * w_abs.max(1.0);
                            assert!((g - want[m * n + r]).abs() <= tol, "{isa:?} {f} t={t} token {m} row {r}: {g} vs exact {}", want[m * n + r]);
                        }
                    }
                }
            }
        });
    }
}
