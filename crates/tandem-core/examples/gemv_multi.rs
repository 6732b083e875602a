//! The decode GEMV for 1 to 8 tokens on one thread: weight read rate and FLOP rate for the
//! shapes of synthetic 0.8B (k = 1024 and k = 3584).
//! `cargo run --release --example gemv_multi -p tandem-core [THREADS]`
use std::time::Instant;
use tandem_core::backend::cpu::kernels::matmul::matmul;
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::model::tensor::{f32_to_bf16, Buf, Matrix, WeightData};
fn main() {
    let pool = Pool::new(std::env::args().nth(1).map_or(1, |a| a.parse().unwrap()));
    for (n, k) in [(32768usize, 1024usize), (1024, 3584 * 8)] {
        let w = Matrix { rows: n, cols: k, data: WeightData::Bf16(Buf::from_vec((0..n * k).map(|i| f32_to_bf16(((i % 13) as f32 - 6.0) * 0.01)).collect())) };
        for t in [1usize, 8, 1, 8] {
            let x: Vec<f32> = (0..t * k).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
            let mut out = vec![0f32; t * n];
            let mut r = vec![];
            for _ in 0..7 {
                let s = Instant::now();
                matmul(&pool, &x, t, &w, &mut out);
                r.push(s.elapsed().as_secs_f64());
            }
            r.sort_by(f64::total_cmp);
            println!("{n}x{k} t={t}: {:.1} GB/s, {:.1} GFLOP/s", w.bytes() as f64 / r[3] / 1e9, (2 * n * k * t) as f64 / r[3] / 1e9);
        }
    }
}
