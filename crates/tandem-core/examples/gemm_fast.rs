//! The fast precision's prompt GEMMs on the 0.8B's product shapes, in GOP/s (two operations
//! per multiply-add), median of 7: on AMX tiles where the CPU has them, then capped to the
//! dot-product instructions (bf16 `vdpbf16ps`, int8 W8A8 `vpdpbusd`); with the tiles' own
//! peak on the same threads where there are tiles.
//! `cargo run --release --example gemm_fast -p tandem-core [threads]`
use std::time::Instant;
use tandem_core::backend::cpu::kernels::matmul::matmul_group_fast;
use tandem_core::backend::cpu::kernels::{amx, available_isas, set_max_isa, Isa};
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::model::quant::quantize_int8_on;
use tandem_core::model::tensor::{f32_to_bf16, Buf, Matrix, WeightData};

fn main() {
    let threads = std::env::args().nth(1).map_or(2, |s| s.parse().expect("threads: a number"));
    let pool = Pool::new(threads);
    for (name, int8) in [("int8", true), ("bf16", false)] {
        let ops = std::sync::Mutex::new(0f64);
        let s = Instant::now();
        pool.run(&|_| *ops.lock().unwrap() += amx::peak_ops(2_000_000, int8).unwrap_or(0.0));
        let rate = *ops.lock().unwrap() / s.elapsed().as_secs_f64() / 1e9;
        if rate > 0.0 {
            println!("AMX {name} tile peak, {threads} threads: {rate:.1} GOP/s");
        }
    }
    for isa in [Isa::Amx, Isa::Avx512Dot].into_iter().filter(|i| available_isas().contains(i)) {
        set_max_isa(isa);
        println!("{isa:?}:");
        for &(t, n, k) in &[(410usize, 3584usize, 1024usize), (410, 1024, 3584), (410, 6144, 1024), (13, 3584, 1024)] {
            let bf16 = Matrix { rows: n, cols: k, data: WeightData::Bf16(Buf::from_vec((0..n * k).map(|i| f32_to_bf16(((i * 7919 % 13) as f32 - 6.0) * 0.01)).collect())) };
            let int8 = quantize_int8_on(&pool, &bf16);
            let x: Vec<f32> = (0..t * k).map(|i| ((i * 31 % 7) as f32 - 3.0) * 0.1).collect();
            let mut out = vec![0f32; t * n];
            for (name, w) in [("bf16-fast", &bf16), ("int8-fast", &int8)] {
                matmul_group_fast(&pool, &x, t, &mut [(w, &mut out)]);
                let mut rates = vec![];
                for _ in 0..7 {
                    let s = Instant::now();
                    matmul_group_fast(&pool, &x, t, &mut [(w, &mut out)]);
                    rates.push(2.0 * (t * n * k) as f64 / s.elapsed().as_secs_f64() / 1e9);
                }
                rates.sort_by(|a, b| a.total_cmp(b));
                println!("  {name} t={t} n={n} k={k}: {:.1} GOP/s (min {:.1}, max {:.1})", rates[3], rates[0], rates[6]);
            }
        }
    }
}
