//! `--quant int8`: weight-only int8, quantized at load time from the stored bf16/f16/f32
//! weights. One symmetric scale per output row (`scale = max|w| / 127`): a per-row scale costs
//! nothing in the GEMV's inner loop (applied once per dot product), and halves the bytes a
//! decode step streams. Activations stay f32.

use crate::backend::cpu::kernels::matmul::weight;
use crate::backend::cpu::pool::Pool;
use crate::model::tensor::{zeroed_in_huge_pages, Buf, Matrix, WeightData};

pub fn quantize_int8(w: &Matrix) -> Matrix {
    quantize_int8_on(&Pool::new(1), w)
}

/// Quantize on the pool's threads (the 9B model has 8.5 G weights).
pub fn quantize_int8_on(pool: &Pool, w: &Matrix) -> Matrix {
    let (n, k) = (w.rows, w.cols);
    let mut q = zeroed_in_huge_pages::<i8>(n * k);
    let mut scales = vec![0f32; n];
    let mut sums = vec![0i32; n];
    #[derive(Clone, Copy)]
    struct Ptrs(*mut i8, *mut f32, *mut i32);
    unsafe impl Send for Ptrs {}
    unsafe impl Sync for Ptrs {}
    let p = Ptrs(q.as_mut_ptr(), scales.as_mut_ptr(), sums.as_mut_ptr());
    pool.for_ranges(n, 64, &|rows| {
        let p = p;
        let mut row = vec![0f32; k];
        for r in rows {
            for (i, v) in row.iter_mut().enumerate() {
                *v = weight(w, r, i);
            }
            let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = if max > 0.0 { max / 127.0 } else { 1.0 };
            // SAFETY: rows are disjoint between workers and inside the buffers.
            unsafe {
                *p.1.add(r) = scale;
                let mut sum = 0i32;
                for (i, v) in row.iter().enumerate() {
                    let qv = (v / scale).round().clamp(-127.0, 127.0) as i8;
                    *p.0.add(r * k + i) = qv;
                    sum += qv as i32;
                }
                *p.2.add(r) = sum;
            }
        }
    });
    Matrix { rows: n, cols: k, data: WeightData::Int8 { q: Buf::from_vec(q), scales: Buf::from_vec(scales), sums: Buf::from_vec(sums) } }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantization_error_is_within_half_a_step() {
        let vals: Vec<f32> = (0..256).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let m = Matrix { rows: 4, cols: 64, data: WeightData::F32(Buf::from_vec(vals.clone())) };
        let q = quantize_int8(&m);
        for r in 0..4 {
            let max = vals[r * 64..(r + 1) * 64].iter().fold(0f32, |a, v| a.max(v.abs()));
            for i in 0..64 {
                let err = (weight(&q, r, i) - vals[r * 64 + i]).abs();
                assert!(err <= max / 127.0 * 0.5 + 1e-6, "row {r} col {i}: error {err}");
            }
        }
        assert_eq!(q.bytes(), 256 + 4 * 8);
        let WeightData::Int8 { q: qv, sums, .. } = &q.data else { unreachable!() };
        for r in 0..4 {
            assert_eq!(sums.as_slice()[r], qv.as_slice()[r * 64..(r + 1) * 64].iter().map(|&v| v as i32).sum::<i32>());
        }
    }
}
