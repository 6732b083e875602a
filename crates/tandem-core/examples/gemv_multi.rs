//! A product of t tokens by bf16 weights: weight read rate and FLOP rate, for the shapes of
//! synthetic 0.8B (k = 1024, and k = 3584 stretched to a 56 MB matrix) and a small matrix that
//! stays in cache (the kernel's arithmetic alone). Each kernel that the engine might choose,
//! interleaved per token count, median of 7 calls (501 for the small matrix):
//! `gemv` (the decode step's GEMV, any t) and `matmul` (a prompt's: the GEMV up to 8 tokens,
//! the packed GEMM past), so that the crossover between them can be read off.
//! `cargo run --release --example gemv_multi -p tandem-core [THREADS] [T,T,...]`
use std::time::Instant;
use tandem_core::backend::cpu::kernels::matmul::{decode_group, matmul};
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::model::tensor::{f32_to_bf16, Buf, Matrix, WeightData};
fn main() {
    let pool = Pool::new(std::env::args().nth(1).map_or(1, |a| a.parse().unwrap()));
    let tokens: Vec<usize> = std::env::args().nth(2).map_or(vec![1, 2, 4, 8, 16, 32, 64, 128], |a| a.split(',').map(|v| v.parse().unwrap()).collect());
    for (n, k) in [(32768usize, 1024usize), (1024, 3584 * 8), (256, 1024)] {
        let w = Matrix { rows: n, cols: k, data: WeightData::Bf16(Buf::from_vec((0..n * k).map(|i| f32_to_bf16(((i % 13) as f32 - 6.0) * 0.01)).collect())) };
        for &t in &tokens {
            let x: Vec<f32> = (0..t * k).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
            let mut out = vec![0f32; t * n];
            let mut line = format!("{n}x{k} t={t}:");
            for (name, gemv) in [("gemv", true), ("matmul", false)] {
                let mut r = vec![];
                for _ in 0..(if n * k < 1 << 20 { 501 } else { 7 }) {
                    let s = Instant::now();
                    if gemv {
                        decode_group(&pool, &x, t, &mut [(&w, &mut out)]);
                    } else {
                        matmul(&pool, &x, t, &w, &mut out);
                    }
                    r.push(s.elapsed().as_secs_f64());
                }
                r.sort_by(f64::total_cmp);
                let median = r[r.len() / 2];
                line += &format!("  {name} {:.1} GB/s {:.1} GFLOP/s", w.bytes() as f64 / median / 1e9, (2 * n * k * t) as f64 / median / 1e9);
            }
            println!("{line}");
        }
    }
}
