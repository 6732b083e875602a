use std::time::Instant;
use tandem_core::backend::cpu::kernels::matmul::matmul;
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::model::quant::quantize_int8;
use tandem_core::model::tensor::{f32_to_bf16, Buf, Matrix, WeightData};
fn main() {
    let pool = Pool::new(std::env::args().nth(1).map(|a| a.parse().unwrap()).unwrap_or(2));
    let (n, k) = (248320usize, 1024usize);
    let w = Matrix { rows: n, cols: k, data: WeightData::Bf16(Buf::from_vec((0..n * k).map(|i| f32_to_bf16(((i % 13) as f32 - 6.0) * 0.01)).collect())) };
    let q = quantize_int8(&w);
    let x: Vec<f32> = (0..k).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let mut out = vec![0f32; n];
    for (name, m) in [("bf16", &w), ("int8", &q), ("bf16", &w), ("int8", &q)] {
        let mut r = vec![];
        for _ in 0..7 { let s = Instant::now(); matmul(&pool, &x, 1, m, &mut out); r.push(m.bytes() as f64 / s.elapsed().as_secs_f64() / 1e9); }
        r.sort_by(|a, b| a.total_cmp(b));
        println!("{name}: {:.1} GB/s (median), max {:.1}", r[3], r[6]);
    }
}
