//! A prompt's product of 1-16 tokens, three ways: the decode GEMV (another summation order),
//! the narrow kernel (the GEMM's order, what a prompt takes up to 8 tokens) and the packed
//! GEMM, on twelve 3584 x 1024 bf16 matrices (a 0.8B MLP's shape; 88 MB, past the caches).
//! `cargo run --release -p tandem-core --example gemm_small`; median of 7 with min - max.
use std::time::Instant;
use tandem_core::backend::cpu::kernels::matmul::{decode_group, gemm_group, matmul_group};
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::model::tensor::{f32_to_bf16, Buf, Matrix, WeightData};

fn main() {
    let pool = Pool::new(2);
    let (n, k) = (3584usize, 1024usize);
    let ws: Vec<Matrix> = (0..12).map(|j| Matrix { rows: n, cols: k, data: WeightData::Bf16(Buf::from_vec((0..n * k).map(|i| f32_to_bf16((((i + j) % 13) as f32 - 6.0) * 0.01)).collect())) }).collect();
    for t in [1usize, 2, 4, 8, 16] {
        let x: Vec<f32> = (0..t * k).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
        let mut out = vec![0f32; t * n];
        for (name, kind) in [("gemv", 0), ("narrow", 1), ("gemm", 2)] {
            if kind == 1 && t > 8 {
                continue;
            }
            let mut ms = vec![];
            for _ in 0..7 {
                let s = Instant::now();
                for w in &ws {
                    match kind {
                        0 => decode_group(&pool, &x, t, &mut [(w, &mut out)]),
                        1 => matmul_group(&pool, &x, t, &mut [(w, &mut out)]),
                        _ => gemm_group(&pool, &x, t, &mut [(w, &mut out)]),
                    }
                }
                ms.push(s.elapsed().as_secs_f64() * 1e3);
            }
            ms.sort_by(|a, b| a.total_cmp(b));
            let gb = (12 * n * k * 2) as f64 / 1e9;
            println!("t={t:2} {name:6}: {:.2} ms ({:.1} - {:.1}), {:.1} GB/s of weights", ms[3], ms[0], ms[6], gb / ms[3] * 1e3);
        }
    }
}
