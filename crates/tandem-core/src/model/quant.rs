//! `--quant`: the weights a forward pass multiplies by, quantized at load time from the stored
//! weights (bf16/f16/f32, or a GGUF file's blocks, dequantized first). Activations stay f32.
//!
//! - `int8`: weight-only int8 with one symmetric scale per output row (`scale = max|w| / 127`):
//!   a per-row scale costs nothing in the GEMV's inner loop (applied once per dot product),
//!   and halves the bytes a decode step streams.
//! - `q8_0`, `q4_k`, `q5_k`, `q6_k`: GGML's block formats (model/blocks), as a GGUF file of the
//!   local runners holds them. `q4_k` and `q5_k` store the LM head in Q6_K, as the runners' own
//!   `Q4_K_M` and `Q5_K_M` files do: the LM head's error reaches every logit directly. A matrix
//!   whose rows are not a whole number of 256-value blocks takes Q8_0 instead (the runners fall
//!   back the same way), and one whose rows are not a whole number of 32 stays as stored.

use anyhow::{bail, Result};

use crate::backend::cpu::pool::Pool;
use crate::model::blocks::quantize::quantize_row;
use crate::model::blocks::BlockFormat;
use crate::model::tensor::{zeroed_in_huge_pages, Buf, Matrix, WeightData};

/// What `--quant` makes of the matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quant {
    Int8,
    /// A block format for the layers' matrices and one for the LM head.
    Blocks { layers: BlockFormat, lm_head: BlockFormat },
}

/// Which matrix of the model one is (the LM head may take another format).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Layer,
    LmHead,
}

impl Quant {
    /// The choices `--quant` takes besides `bf16` (as stored).
    pub const NAMES: [&'static str; 5] = ["int8", "q8_0", "q4_k", "q5_k", "q6_k"];

    /// `--quant NAME`, or an error listing the choices.
    pub fn parse(name: &str) -> Result<Quant> {
        let blocks = |layers, lm_head| Quant::Blocks { layers, lm_head };
        Ok(match name.to_ascii_lowercase().as_str() {
            "int8" => Quant::Int8,
            "q8_0" => blocks(BlockFormat::Q8_0, BlockFormat::Q8_0),
            "q4_k" => blocks(BlockFormat::Q4_K, BlockFormat::Q6_K),
            "q5_k" => blocks(BlockFormat::Q5_K, BlockFormat::Q6_K),
            "q6_k" => blocks(BlockFormat::Q6_K, BlockFormat::Q6_K),
            _ => bail!("--quant {name:?}: choose bf16 (as stored), {}", Quant::NAMES.join(", ")),
        })
    }

    /// The name `parse` takes.
    pub fn name(self) -> String {
        match self {
            Quant::Int8 => "int8".into(),
            Quant::Blocks { layers, .. } => layers.name().to_ascii_lowercase(),
        }
    }

    /// `m` quantized for its role.
    pub fn apply(self, pool: &Pool, m: &Matrix, role: Role) -> Matrix {
        match self {
            Quant::Int8 => quantize_int8_on(pool, m),
            Quant::Blocks { layers, lm_head } => {
                let wanted = if role == Role::LmHead { lm_head } else { layers };
                match [wanted, BlockFormat::Q8_0].into_iter().find(|f| m.cols.is_multiple_of(f.elements())) {
                    Some(f) => quantize_blocks_on(pool, m, f),
                    None => m.clone(),
                }
            }
        }
    }
}

/// `m` in block format `f` (one that `blocks::quantize::writes`, rows a whole number of its
/// blocks), quantized row by row on the pool's threads from its values as f32.
pub fn quantize_blocks_on(pool: &Pool, m: &Matrix, f: BlockFormat) -> Matrix {
    let (n, k) = (m.rows, m.cols);
    assert!(k.is_multiple_of(f.elements()), "rows of {k} are not whole {f} blocks");
    let rb = f.bytes_of(k);
    let mut data = zeroed_in_huge_pages::<u8>(n * rb);
    #[derive(Clone, Copy)]
    struct Ptr(*mut u8);
    unsafe impl Send for Ptr {}
    unsafe impl Sync for Ptr {}
    let p = Ptr(data.as_mut_ptr());
    pool.for_ranges(n, 16, &|rows| {
        let p = p;
        let mut row = vec![0f32; k];
        for r in rows {
            m.row_to_f32(r, &mut row);
            // SAFETY: rows are disjoint between workers and inside the buffer.
            let out = unsafe { std::slice::from_raw_parts_mut(p.0.add(r * rb), rb) };
            quantize_row(f, &row, out);
        }
    });
    Matrix { rows: n, cols: k, data: WeightData::Blocks { format: f, data: Buf::from_vec(data) } }
}

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
            w.row_to_f32(r, &mut row);
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
    use crate::backend::cpu::kernels::matmul::weight;

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
