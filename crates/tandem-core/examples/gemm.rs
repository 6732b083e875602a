use std::time::Instant;
use tandem_core::backend::cpu::kernels::matmul::matmul;
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::model::tensor::{f32_to_bf16, Buf, Matrix, WeightData};
fn main() {
    let pool = Pool::new(2);
    for &(t, n, k) in &[(410usize, 3584usize, 1024usize), (410, 1024, 3584), (74, 6144, 1024), (13, 3584, 1024)] {
        let w = Matrix { rows: n, cols: k, data: WeightData::Bf16(Buf::from_vec((0..n * k).map(|i| f32_to_bf16(((i % 13) as f32 - 6.0) * 0.01)).collect())) };
        let x: Vec<f32> = (0..t * k).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
        let mut out = vec![0f32; t * n];
        matmul(&pool, &x, t, &w, &mut out);
        let mut rates = vec![];
        for _ in 0..5 { let s = Instant::now(); matmul(&pool, &x, t, &w, &mut out); rates.push(2.0 * (t * n * k) as f64 / s.elapsed().as_secs_f64() / 1e9); }
        rates.sort_by(|a, b| a.total_cmp(b));
        println!("t={t} n={n} k={k}: {:.1} GFLOP/s", rates[2]);
    }
}
