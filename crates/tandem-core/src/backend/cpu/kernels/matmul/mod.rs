//! `out = x · Wᵀ` for a weight matrix in its stored dtype: the GEMV of decode (one token, or
//! one per sequence of a batch: bound by how fast the weights stream from memory, and past a
//! few tokens by FMA throughput) and the GEMM of prefill (bound by FMA throughput; for a few
//! tokens the narrow kernel, which sums as the GEMM does). `matmul_ref` is the plain
//! definition the fast paths are tested against.
//!
//! The two orders are each kept whatever the number of tokens: a decode step's sequence gets
//! the bits it would get alone (GEMV order), and a prompt's token gets the same bits whether
//! it is prefilled in one call or in pieces (GEMM order), which is what lets a cached state
//! continue a prompt exactly as a cold prefill would.
//!
//! Work is cut into units (a few rows of a GEMV, a few output columns of a GEMM) that the
//! pool's workers take in turn from a queue, and the products that read the same input (q, k
//! and v; gate and up) are run as one group: one fork/join for the group, and no worker waits
//! for a slower one at the end of each matrix.
//!
//! Activations stay f32 and every floating-point product is an f32 FMA (weights are widened
//! on the fly), so the fast paths differ from the reference only in summation order. The one
//! exception is the int8 GEMV, which multiplies int8 weights by `x` rounded to int16 in exact
//! integer arithmetic (relative rounding of x below 2e-5).

use crate::backend::cpu::pool::{Pool, WorkQueue};
use crate::model::tensor::{bf16_to_f32, f16_to_f32, Matrix, WeightData};

/// Reference: `out[ti * w.rows + r] = Σ_k x[ti * w.cols + k] · w[r, k]`, summed in f64.
pub fn matmul_ref(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), t * k);
    assert_eq!(out.len(), t * n);
    for ti in 0..t {
        for r in 0..n {
            let mut acc = 0f64;
            for i in 0..k {
                acc += x[ti * k + i] as f64 * weight(w, r, i) as f64;
            }
            out[ti * n + r] = acc as f32;
        }
    }
}

/// One weight as f32 (int8: dequantized with its row scale).
pub fn weight(w: &Matrix, r: usize, i: usize) -> f32 {
    let k = w.cols;
    match &w.data {
        WeightData::Bf16(b) => bf16_to_f32(b.as_slice()[r * k + i]),
        WeightData::F16(b) => f16_to_f32(b.as_slice()[r * k + i]),
        WeightData::F32(b) => b.as_slice()[r * k + i],
        WeightData::Int8 { q, scales, .. } => q.as_slice()[r * k + i] as f32 * scales.as_slice()[r],
        WeightData::Blocks { format, data } => {
            // The whole block, then the one value (for references and tests).
            let e = format.elements();
            let at = r * format.bytes_of(k) + i / e * format.bytes();
            let mut y = vec![0f32; e];
            crate::model::blocks::dequantize_block(*format, &data.as_slice()[at..at + format.bytes()], &mut y);
            y[i % e]
        }
    }
}

/// A raw output pointer that worker threads may write disjoint parts of.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out = x · Wᵀ` for a prompt's `t` tokens: the GEMM's sums whatever `t` (see `matmul_group`).
pub fn matmul(pool: &Pool, x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
    matmul_group(pool, x, t, &mut [(w, out)]);
}

/// `out_i = x · W_iᵀ` for every `(W_i, out_i)` of the group, all in one pool call: a prompt's
/// products, each token's outputs the same bits whatever `t` (the narrow kernel up to
/// `NARROW_MAX_TOKENS` tokens, the packed GEMM past, both summing in one order), so that a
/// prompt applied in pieces of any size computes what it computes in one call.
pub fn matmul_group(pool: &Pool, x: &[f32], t: usize, products: &mut [(&Matrix, &mut [f32])]) {
    let jobs = checked_jobs(x, t, products);
    prompt_group(pool, x, t, &jobs);
}

/// The fast precision's prompt products (`precision=fast`): for bf16 weights the inputs rounded
/// to bf16 and the products summed in f32 by AMX tiles where the CPU has them (amx_gemm.rs),
/// else two at a time by `vdpbf16ps` where it has AVX512-BF16 (bf16_dot.rs), elsewhere by the
/// exact kernels on the rounded inputs (the same arithmetic up to summation order); for int8
/// weights each token's inputs quantized to int8 in blocks of 64 and multiplied by AMX tiles or
/// `vpdpbusd` (AVX512-VNNI, int8_dot.rs), the same bits (W8A8), elsewhere the exact kernels;
/// other weights as `matmul_group`. Each token's outputs are the same bits whatever `t`, as
/// there.
pub fn matmul_group_fast(pool: &Pool, x: &[f32], t: usize, products: &mut [(&Matrix, &mut [f32])]) {
    fast_group(pool, x, t, products, FastKernels::DotProducts);
}

/// `matmul_group_fast`'s arithmetic by plain kernels: for bf16 weights the exact kernels on
/// the inputs rounded to bf16 (`precision=fast` up to the order of f32 sums); for the int8
/// weights that the W8A8 kernel takes its scalar reference `int8_dot::w8a8_ref` (the kernel's
/// bits); other weights as `matmul_group`.
pub fn matmul_group_fast_reference(pool: &Pool, x: &[f32], t: usize, products: &mut [(&Matrix, &mut [f32])]) {
    fast_group(pool, x, t, products, FastKernels::Plain);
}

/// Which kernels `fast_group` runs the fast precision's arithmetic on.
#[derive(Clone, Copy, PartialEq)]
enum FastKernels {
    /// `vdpbf16ps` and `vpdpbusd` where the CPU has them (`matmul_group_fast`).
    DotProducts,
    /// The plain references (`matmul_group_fast_reference`).
    Plain,
}

/// The fast precision's products, split by weights: int8 that W8A8 takes, bf16, and the rest.
fn fast_group(pool: &Pool, x: &[f32], t: usize, products: &mut [(&Matrix, &mut [f32])], kernels: FastKernels) {
    let jobs = checked_jobs(x, t, products);
    // AMX tiles where the CPU has them (the W8A8 products' bits; bf16 in another order of f32
    // sums), else the dot-product instructions.
    let (tiles, jobs): (Vec<_>, Vec<_>) = jobs.into_iter().partition(|(w, _)| kernels == FastKernels::DotProducts && amx_gemm::applies(w));
    let (tiles_int8, tiles_bf16): (Vec<_>, Vec<_>) = tiles.into_iter().partition(|(w, _)| matches!(w.data, WeightData::Int8 { .. }));
    if !tiles_int8.is_empty() {
        amx_gemm::int8_group(pool, x, t, &tiles_int8);
    }
    if !tiles_bf16.is_empty() {
        amx_gemm::bf16_group(pool, x, t, &tiles_bf16);
    }
    let (w8a8, jobs): (Vec<_>, Vec<_>) = jobs.into_iter().partition(|(w, _)| int8_dot::applies(w));
    match kernels {
        _ if w8a8.is_empty() => {}
        FastKernels::DotProducts => int8_dot::gemm_group(pool, x, t, &w8a8),
        FastKernels::Plain => {
            for (w, out) in w8a8 {
                let (k, n) = (w.cols, w.rows);
                pool.for_ranges(t, 1, &|r| {
                    let out: OutPtr = out;
                    // SAFETY: the ranges of tokens are disjoint, so are their rows of `out`.
                    let out = unsafe { std::slice::from_raw_parts_mut(out.0.add(r.start * n), r.len() * n) };
                    int8_dot::w8a8_ref(&x[r.start * k..r.end * k], r.len(), w, out);
                });
            }
        }
    }
    let (bf16, other): (Vec<_>, Vec<_>) = jobs.into_iter().partition(|(w, _)| matches!(w.data, WeightData::Bf16(_)));
    let (dot, rounded): (Vec<_>, Vec<_>) = bf16.into_iter().partition(|(w, _)| kernels == FastKernels::DotProducts && bf16_dot::applies(w));
    if !dot.is_empty() {
        bf16_dot::gemm_group(pool, x, t, &dot);
    }
    if !rounded.is_empty() {
        let x: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        prompt_group(pool, &x, t, &rounded);
    }
    if !other.is_empty() {
        prompt_group(pool, x, t, &other);
    }
}

/// The fast precision's decode products: for bf16 weights the GEMV of the bf16-rounded inputs
/// (each token's outputs the one-token product's bits, as `decode_group`); for k-quant blocks
/// on AVX2 and AVX-512 each token's inputs quantized to int8 in blocks of 256 (W4A8 / W6A8,
/// blocks_a8.rs); other weights as `decode_group`.
pub fn decode_group_fast(pool: &Pool, x: &[f32], t: usize, products: &mut [(&Matrix, &mut [f32])]) {
    decode_fast(pool, x, t, products, FastKernels::DotProducts);
}

/// `decode_group_fast`'s arithmetic by plain kernels: the W4A8 products by their scalar
/// reference `blocks_a8::dot_ref` (the kernel's bits), the others as there.
pub fn decode_group_fast_reference(pool: &Pool, x: &[f32], t: usize, products: &mut [(&Matrix, &mut [f32])]) {
    decode_fast(pool, x, t, products, FastKernels::Plain);
}

fn decode_fast(pool: &Pool, x: &[f32], t: usize, products: &mut [(&Matrix, &mut [f32])], kernels: FastKernels) {
    let jobs = checked_jobs(x, t, products);
    let (bf16, other): (Vec<_>, Vec<_>) = jobs.into_iter().partition(|(w, _)| matches!(w.data, WeightData::Bf16(_)));
    if !bf16.is_empty() {
        let x: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        gemv_group(pool, &x, t, &bf16, false);
    }
    let (w4a8, other): (Vec<_>, Vec<_>) = other.into_iter().partition(|(w, _)| kernels == FastKernels::Plain && blocks_a8::applies(w));
    // The group's products share x (and its length): quantized once.
    let xs: Vec<blocks_a8::BlockX8> = match w4a8.first() {
        Some((w, _)) => x.chunks_exact(w.cols).map(blocks_a8::BlockX8::new).collect(),
        None => Vec::new(),
    };
    for (w, out) in w4a8 {
        pool.for_ranges(w.rows, 1, &|rows| {
            let out: OutPtr = out;
            // SAFETY: the ranges of rows are disjoint, so are the outputs written.
            unsafe { blocks_a8::gemv_rows_ref(&xs, w, rows, out.0) };
        });
    }
    if !other.is_empty() {
        gemv_group(pool, x, t, &other, kernels == FastKernels::DotProducts);
    }
}

/// The exact prompt kernels for checked jobs: narrow up to `NARROW_MAX_TOKENS`, else the GEMM.
fn prompt_group(pool: &Pool, x: &[f32], t: usize, jobs: &[(&Matrix, OutPtr)]) {
    if t <= NARROW_MAX_TOKENS {
        narrow::narrow_group(pool, x, t, jobs);
    } else {
        gemm::gemm_group(pool, x, t, jobs);
    }
}

/// `out_i = x · W_iᵀ` for every product of a decode step of `t` sequences: each token's
/// outputs are the one-token GEMV's, bit for bit, whatever `t` (each weight row read from memory
/// once for all tokens).
pub fn decode_group(pool: &Pool, x: &[f32], t: usize, products: &mut [(&Matrix, &mut [f32])]) {
    let jobs = checked_jobs(x, t, products);
    gemv_group(pool, x, t, &jobs, false);
}

/// `out_i = x · W_iᵀ` by the packed GEMM whatever `t` (for tests and measurements: the
/// narrow kernel must give its bits).
pub fn gemm_group(pool: &Pool, x: &[f32], t: usize, products: &mut [(&Matrix, &mut [f32])]) {
    let jobs = checked_jobs(x, t, products);
    gemm::gemm_group(pool, x, t, &jobs);
}

fn checked_jobs<'m>(x: &[f32], t: usize, products: &mut [(&'m Matrix, &mut [f32])]) -> Vec<(&'m Matrix, OutPtr)> {
    products
        .iter_mut()
        .map(|(w, out)| {
            assert_eq!(x.len(), t * w.cols, "matmul input has the wrong length");
            assert_eq!(out.len(), t * w.rows, "matmul output has the wrong length");
            (*w, OutPtr(out.as_mut_ptr()))
        })
        .collect()
}

/// Unit `u` of a group whose job `j` is cut into `units[j]` units: (job, unit within the job).
fn locate(units: &[usize], mut u: usize) -> (usize, usize) {
    for (j, &n) in units.iter().enumerate() {
        if u < n {
            return (j, u);
        }
        u -= n;
    }
    unreachable!("unit index past the group's work")
}

mod amx_gemm;
mod bf16_dot;
pub mod blocks;
pub mod blocks_a8;
mod gemv;
pub mod int8_dot;
pub mod gemm;
pub mod narrow;

use gemv::gemv_group;
pub use narrow::NARROW_MAX_TOKENS;

/// Columns `k0..k0 + kc` of row `r` as f32 into `buf`; returns the factor to apply to a dot
/// with them (the int8 row scale, else 1).
#[inline(always)]
fn widen_row_range(w: &Matrix, r: usize, k0: usize, kc: usize, buf: &mut [f32]) -> f32 {
    let base = r * w.cols + k0;
    match &w.data {
        WeightData::Bf16(b) => {
            for (d, &s) in buf.iter_mut().zip(&b.as_slice()[base..base + kc]) {
                *d = bf16_to_f32(s);
            }
            1.0
        }
        WeightData::F16(b) => {
            for (d, &s) in buf.iter_mut().zip(&b.as_slice()[base..base + kc]) {
                *d = f16_to_f32(s);
            }
            1.0
        }
        WeightData::F32(b) => {
            buf[..kc].copy_from_slice(&b.as_slice()[base..base + kc]);
            1.0
        }
        WeightData::Int8 { q, scales, .. } => {
            for (d, &s) in buf.iter_mut().zip(&q.as_slice()[base..base + kc]) {
                *d = s as f32;
            }
            scales.as_slice()[r]
        }
        WeightData::Blocks { format, data } => {
            let rb = format.bytes_of(w.cols);
            blocks::dequantize_range(*format, &data.as_slice()[r * rb..(r + 1) * rb], k0, &mut buf[..kc]);
            1.0
        }
    }
}

/// f32 dot product with 16 independent accumulators (vectorises to 1-2 FMA chains per lane).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 16];
    let chunks = n / 16;
    for c in 0..chunks {
        let (pa, pb) = (&a[c * 16..c * 16 + 16], &b[c * 16..c * 16 + 16]);
        for j in 0..16 {
            acc[j] = pa[j].mul_add(pb[j], acc[j]);
        }
    }
    let mut s = 0f32;
    for i in chunks * 16..n {
        s = a[i].mul_add(b[i], s);
    }
    // Pairwise reduction keeps the rounding error of long rows small.
    for width in [8, 4, 2, 1] {
        for j in 0..width {
            acc[j] += acc[j + width];
        }
    }
    acc[0] + s
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::model::tensor::{f32_to_bf16, Buf};

    pub fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The same random matrix in every dtype: f32, bf16, f16, int8, and the block formats
    /// whose blocks its rows hold whole (Q8_0 for multiples of 32; Q4_K and Q6_K of 256).
    pub fn test_matrices(n: usize, k: usize, seed: &mut u64) -> Vec<Matrix> {
        let wf: Vec<f32> = (0..n * k).map(|_| lcg(seed)).collect();
        let f32m = Matrix { rows: n, cols: k, data: WeightData::F32(Buf::from_vec(wf.clone())) };
        let mut all = vec![
            f32m.clone(),
            Matrix { rows: n, cols: k, data: WeightData::Bf16(Buf::from_vec(wf.iter().map(|&v| f32_to_bf16(v)).collect())) },
            Matrix { rows: n, cols: k, data: WeightData::F16(Buf::from_vec(wf.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect())) },
            crate::model::quant::quantize_int8(&f32m),
        ];
        use crate::model::blocks::BlockFormat;
        for f in [BlockFormat::Q8_0, BlockFormat::Q4_K, BlockFormat::Q6_K] {
            if k.is_multiple_of(f.elements()) {
                all.push(crate::model::quant::quantize_blocks_on(&Pool::new(1), &f32m, f));
            }
        }
        all
    }

    /// The packed layout of x, AVX-512 transposes and plain copies alike, against its definition.
    #[test]
    fn pack_x_matches_its_definition() {
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let pool = Pool::new(2);
            for &(t, k) in &[(1, 16), (13, 40), (32, 48), (45, 300), (70, 33)] {
                let x: Vec<f32> = (0..t * k).map(|i| i as f32).collect();
                let xp = gemm::pack_x(&pool, &x, t, k);
                assert_eq!(xp.len(), t.div_ceil(gemm::TB) * k * gemm::TB);
                for b in 0..t.div_ceil(gemm::TB) {
                    for kk in 0..k {
                        for m in 0..gemm::TB {
                            let ti = b * gemm::TB + m;
                            let want = if ti < t { x[ti * k + kk] } else { 0.0 };
                            assert_eq!(xp[(b * k + kk) * gemm::TB + m], want, "{isa:?} t={t} k={k} token {ti} input {kk}");
                        }
                    }
                }
            }
        });
    }

    /// Every path (GEMV, narrow kernel, GEMM with full and partial tiles) on every instruction
    /// set this CPU has, against the f64 reference, for every weight dtype, on one and on three
    /// threads; and each order kept whatever the number of tokens.
    #[test]
    fn matmul_matches_reference_for_every_isa_dtype_and_shape() {
        crate::backend::cpu::kernels::for_each_isa(|_| matmul_cases());
    }

    /// The fast precision's prompt products on every instruction set: for bf16 weights the
    /// reference of the bf16-rounded inputs (the dot-product kernel on AVX512-BF16, the exact
    /// kernels on rounded inputs elsewhere), the same bits for a prompt in two calls as in one;
    /// int8 weights W8A8's bits with VNNI; other weights exactly the exact kernels' results.
    #[test]
    fn matmul_fast_matches_the_reference_of_rounded_inputs_on_every_isa() {
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let mut seed = 11;
            let pool = Pool::new(2);
            for &(t, n, k) in &[(1, 9, 64), (5, 30, 300), (20, 17, 96), (40, 50, 520), (33, 20, 640)] {
                let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed)).collect();
                let rounded: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
                for w in &test_matrices(n, k, &mut seed) {
                    let mut got = vec![0f32; t * n];
                    matmul_group_fast(&pool, &x, t, &mut [(w, &mut got)]);
                    if int8_dot::applies(w) {
                        let mut w8a8 = vec![0f32; t * n];
                        int8_dot::w8a8_ref(&x, t, w, &mut w8a8);
                        assert!(got == w8a8, "{isa:?} t={t}: fast int8 is not W8A8's bits");
                        continue;
                    }
                    if !matches!(w.data, WeightData::Bf16(_)) {
                        let mut exact = vec![0f32; t * n];
                        matmul(&pool, &x, t, w, &mut exact);
                        assert!(got == exact, "{isa:?} {}: fast differs from exact", w.dtype());
                        continue;
                    }
                    let mut want = vec![0f32; t * n];
                    matmul_ref(&rounded, t, w, &mut want);
                    let tol = 2e-6 * (k as f32).sqrt() * 4.0;
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!((a - b).abs() <= tol, "{isa:?} t={t} n={n} k={k} [{i}]: {a} vs {b}");
                    }
                    let cut = t / 2;
                    if cut > 0 {
                        let mut pieces = vec![0f32; t * n];
                        let (head, tail) = pieces.split_at_mut(cut * n);
                        matmul_group_fast(&pool, &x[..cut * k], cut, &mut [(w, head)]);
                        matmul_group_fast(&pool, &x[cut * k..], t - cut, &mut [(w, tail)]);
                        assert!(pieces == got, "{isa:?} t={t}: a prompt in two calls differs from one");
                    }
                }
            }
        });
    }

    /// A decode step's group of matrices (cut into units of every size, the jobs' units mixed
    /// in one queue) gives each matrix the bits of its GEMV alone, on every instruction set.
    #[test]
    fn a_decode_group_equals_its_matrices_alone() {
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let mut seed = 5;
            let pool = Pool::new(3);
            for t in [1, 3] {
                let k = 128;
                let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed)).collect();
                for (a, b, c) in [(0, 1, 3), (1, 3, 2), (3, 0, 1)] {
                    let ws = [&test_matrices(700, k, &mut seed)[a], &test_matrices(45, k, &mut seed)[b], &test_matrices(3, k, &mut seed)[c]];
                    let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; t * w.rows]).collect();
                    let mut jobs: Vec<(&Matrix, &mut [f32])> = ws.iter().copied().zip(outs.iter_mut().map(|o| o.as_mut_slice())).collect();
                    decode_group(&pool, &x, t, &mut jobs);
                    for (w, got) in ws.iter().zip(&outs) {
                        let mut alone = vec![0f32; t * w.rows];
                        decode_group(&Pool::new(1), &x, t, &mut [(w, &mut alone)]);
                        assert!(&alone == got, "{isa:?} t={t}: a {}x{k} {} matrix in a group differs from its GEMV alone", w.rows, w.dtype());
                    }
                }
            }
        });
    }

    fn matmul_cases() {
        let mut seed = 7;
        for threads in [1, 3] {
            let pool = Pool::new(threads);
            for &(t, n, k) in &[(1, 5, 16), (1, 33, 96), (1, 70, 1024), (1, 7, 800), (2, 17, 48), (3, 9, 64), (8, 70, 1024), (5, 7, 800), (13, 64, 256), (25, 100, 300), (12, 32, 600), (33, 70, 1024), (9, 23, 48), (6, 9, 128), (17, 13, 192), (7, 40, 300), (40, 390, 64)] {
                let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed)).collect();
                for w in &test_matrices(n, k, &mut seed) {
                    let mut want = vec![0f32; t * n];
                    let mut got = vec![0f32; t * n];
                    matmul_ref(&x, t, w, &mut want);
                    matmul(&pool, &x, t, w, &mut got);
                    let f32_tol = 2e-6 * (k as f32).sqrt() * 4.0;
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!((a - b).abs() <= f32_tol, "{} t={t} n={n} k={k} [{i}]: {a} vs {b}", w.dtype());
                    }
                    // A prompt's product: the packed GEMM's bits at any t (the narrow kernel
                    // below NARROW_MAX_TOKENS), and the same bits for the tokens in two calls.
                    let mut gemm_out = vec![0f32; t * n];
                    gemm_group(&pool, &x, t, &mut [(w, &mut gemm_out)]);
                    assert!(gemm_out == got, "{} t={t} n={n} k={k}: the prompt's product differs from the packed GEMM", w.dtype());
                    for cut in [1, t / 2, t - 1].into_iter().filter(|&c| c > 0 && c < t) {
                        let mut pieces = vec![0f32; t * n];
                        let (head, tail) = pieces.split_at_mut(cut * n);
                        matmul(&pool, &x[..cut * k], cut, w, head);
                        matmul(&pool, &x[cut * k..], t - cut, w, tail);
                        assert!(pieces == got, "{} t={t} n={n} k={k}: cut at {cut}, the pieces differ from one call", w.dtype());
                    }
                    // A decode step's product, at any number of tokens: each token gets the
                    // one-token GEMV's bits (every dtype), and the reference within tolerance.
                    // The int8 GEMV (VNNI) rounds each token's x to int16: at most half a
                    // step (max|x| / 65534) per input.
                    let x_max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    // Block formats round x to 16 bits the same way (blocks.rs).
                    let int8 = matches!(w.dtype(), crate::model::tensor::DType::I8 | crate::model::tensor::DType::Blocks(_));
                    let tol = |r: usize| f32_tol + if int8 { (0..k).map(|c| weight(w, r, c).abs()).sum::<f32>() * x_max / 65534.0 } else { 0.0 };
                    let mut step = vec![0f32; t * n];
                    decode_group(&pool, &x, t, &mut [(w, &mut step)]);
                    for (i, (a, b)) in step.iter().zip(&want).enumerate() {
                        assert!((a - b).abs() <= tol(i % n), "decode step {} t={t} n={n} k={k} [{i}]: {a} vs {b}", w.dtype());
                    }
                    if t > 1 {
                        for m in 0..t {
                            let mut alone = vec![0f32; n];
                            decode_group(&pool, &x[m * k..(m + 1) * k], 1, &mut [(w, &mut alone)]);
                            assert!(alone == step[m * n..(m + 1) * n], "{} t={t}: token {m} of a decode step differs from its one-token product", w.dtype());
                        }
                    }
                }
            }
        }
    }
}
