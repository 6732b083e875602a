//! int8 granularity experiment: per-row scales (what --quant int8 does) against per-group scales
//! of 32 inputs, simulated by dequantizing back to f32.
use tandem_core::kernels::matmul::weight;
use tandem_core::tensor::{Buf, Matrix, WeightData};
fn fake_group(w: &Matrix, g: usize) -> Matrix {
    let mut out = vec![0f32; w.rows * w.cols];
    for r in 0..w.rows {
        for c0 in (0..w.cols).step_by(g) {
            let vals: Vec<f32> = (c0..(c0 + g).min(w.cols)).map(|c| weight(w, r, c)).collect();
            let s = vals.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (i, v) in vals.iter().enumerate() { out[r * w.cols + c0 + i] = if s > 0.0 { (v / s).round() * s } else { 0.0 }; }
        }
    }
    Matrix { rows: w.rows, cols: w.cols, data: WeightData::F32(Buf::from_vec(out)) }
}
fn main() {
    let dir = std::env::args().nth(1).unwrap();
    let pool = tandem_core::pool::Pool::new(2);
    let reference = std::path::Path::new(&dir).join("reference.safetensors");
    println!("per-row (--quant int8):");
    for l in tandem_core::quality::int8_vs_stored(&pool, &dir, &reference).unwrap() { println!("{l}"); }
    println!("per-group of 32 (simulated):");
    for l in tandem_core::quality::requantized_vs_stored(&pool, &dir, &reference, |n| n.map_matrices(|m| fake_group(m, 32))).unwrap() { println!("{l}"); }
}
