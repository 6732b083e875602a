//! `out = x · Wᵀ` for a weight matrix in its stored dtype: the GEMV of decode (t = 1) and the
//! GEMM of prefill (t > 1). `matmul_ref` is the plain definition; `matmul_rows` is the one the
//! model uses, compiled once per instruction set and picked at run time.

use crate::tensor::{bf16_to_f32, f16_to_f32, Matrix, WeightData};

/// Reference: `out[ti * w.rows + r] = Σ_k x[ti * w.cols + k] · w[r, k]`, summed in f64.
pub fn matmul_ref(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), t * k);
    assert_eq!(out.len(), t * n);
    for ti in 0..t {
        for r in 0..n {
            let mut acc = 0f64;
            for i in 0..k {
                let wv = match &w.data {
                    WeightData::Bf16(b) => bf16_to_f32(b.as_slice()[r * k + i]),
                    WeightData::F16(b) => f16_to_f32(b.as_slice()[r * k + i]),
                    WeightData::F32(b) => b.as_slice()[r * k + i],
                };
                acc += x[ti * k + i] as f64 * wv as f64;
            }
            out[ti * n + r] = acc as f32;
        }
    }
}

/// `out = x · Wᵀ` over all rows of `w`.
pub fn matmul(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) {
    assert_eq!(x.len(), t * w.cols, "matmul input has the wrong length");
    assert_eq!(out.len(), t * w.rows, "matmul output has the wrong length");
    // SAFETY: the row range covers w, and out has t * w.rows elements.
    unsafe { matmul_rows(x, t, w, 0..w.rows, out.as_mut_ptr(), w.rows) }
}

/// Rows `rows` of `out = x · Wᵀ`, writing `out[ti * out_stride + r]`. Disjoint row ranges may be
/// computed by different threads into the same output.
///
/// # Safety
/// `out` must be valid for writes at `ti * out_stride + r` for all `ti < t`, `r` in `rows`.
pub unsafe fn matmul_rows(x: &[f32], t: usize, w: &Matrix, rows: std::ops::Range<usize>, out: *mut f32, out_stride: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return matmul_rows_avx512(x, t, w, rows, out, out_stride);
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return matmul_rows_avx2(x, t, w, rows, out, out_stride);
        }
    }
    matmul_rows_generic(x, t, w, rows, out, out_stride)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn matmul_rows_avx512(x: &[f32], t: usize, w: &Matrix, rows: std::ops::Range<usize>, out: *mut f32, out_stride: usize) {
    matmul_rows_generic(x, t, w, rows, out, out_stride)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn matmul_rows_avx2(x: &[f32], t: usize, w: &Matrix, rows: std::ops::Range<usize>, out: *mut f32, out_stride: usize) {
    matmul_rows_generic(x, t, w, rows, out, out_stride)
}

/// Portable body, written so the compiler vectorises it for whatever target feature set the
/// caller was compiled with: each weight row is widened to f32 once into a buffer that stays
/// in L1, then dotted with every token.
#[inline(always)]
unsafe fn matmul_rows_generic(x: &[f32], t: usize, w: &Matrix, rows: std::ops::Range<usize>, out: *mut f32, out_stride: usize) {
    let k = w.cols;
    let mut row = vec![0f32; k];
    for r in rows {
        let wrow: &[f32] = match &w.data {
            WeightData::Bf16(b) => {
                for (d, &s) in row.iter_mut().zip(&b.as_slice()[r * k..(r + 1) * k]) {
                    *d = bf16_to_f32(s);
                }
                &row
            }
            WeightData::F16(b) => {
                for (d, &s) in row.iter_mut().zip(&b.as_slice()[r * k..(r + 1) * k]) {
                    *d = f16_to_f32(s);
                }
                &row
            }
            WeightData::F32(b) => &b.as_slice()[r * k..(r + 1) * k],
        };
        for ti in 0..t {
            *out.add(ti * out_stride + r) = dot(&x[ti * k..(ti + 1) * k], wrow);
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
mod tests {
    use super::*;
    use crate::tensor::{f32_to_bf16, Buf};

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn matmul_matches_reference_for_every_dtype() {
        let mut seed = 7;
        for &(t, n, k) in &[(1, 5, 3), (1, 33, 100), (3, 17, 257), (7, 64, 1024)] {
            let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed)).collect();
            let wf: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
            let mats = [
                Matrix { rows: n, cols: k, data: WeightData::F32(Buf::from_vec(wf.clone())) },
                Matrix { rows: n, cols: k, data: WeightData::Bf16(Buf::from_vec(wf.iter().map(|&v| f32_to_bf16(v)).collect())) },
                Matrix {
                    rows: n,
                    cols: k,
                    data: WeightData::F16(Buf::from_vec(wf.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect())),
                },
            ];
            for w in &mats {
                let mut want = vec![0f32; t * n];
                let mut got = vec![0f32; t * n];
                matmul_ref(&x, t, w, &mut want);
                matmul(&x, t, w, &mut got);
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() <= 1e-5 * (k as f32).sqrt(), "{:?} t={t} n={n} k={k}: {a} vs {b}", w.dtype());
                }
            }
        }
    }
}
