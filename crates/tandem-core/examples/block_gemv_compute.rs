//! The block GEMV's compute alone: a matrix small enough to stay in a core's L2, multiplied
//! again and again on one thread, in ns per 256-value block per row, exact and fast precision.
//! `cargo run --release --example block_gemv_compute -p tandem-core [ROWS] [COLS] [FORMAT|all] [avx2]`
//! (FORMAT: only that k-quant, e.g. q4_k; avx2: the kernels capped at AVX2).

use std::time::Instant;

use tandem_core::backend::cpu::kernels::matmul::{decode_group, decode_group_fast};
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::model::blocks::BlockFormat;
use tandem_core::model::quant::{quantize_blocks_on, quantize_int8_on};
use tandem_core::model::tensor::{Buf, Matrix, WeightData};

fn main() {
    let rows: usize = std::env::args().nth(1).map_or(256, |a| a.parse().unwrap());
    let cols: usize = std::env::args().nth(2).map_or(1024, |a| a.parse().unwrap());
    let pool = Pool::new(1);
    let values: Vec<f32> = (0..rows * cols).map(|i| (((i * 7919) % 1000) as f32 / 1000.0 - 0.5) * 0.1).collect();
    let f32m = Matrix { rows, cols, data: WeightData::F32(Buf::from_vec(values)) };
    let x: Vec<f32> = (0..cols).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
    let mut out = vec![0f32; rows];
    let mut report = |name: &str, m: &Matrix, fast: bool| {
        let mut times = Vec::new();
        for _ in 0..9 {
            let t = Instant::now();
            for _ in 0..200 {
                if fast { decode_group_fast(&pool, &x, 1, &mut [(m, &mut out)]) } else { decode_group(&pool, &x, 1, &mut [(m, &mut out)]) }
            }
            times.push(t.elapsed().as_secs_f64() / 200.0);
        }
        times.sort_by(f64::total_cmp);
        let blocks = (rows * cols / 256) as f64;
        println!("{name}: {:.2} ns per 256 values (min {:.2}), {:.1} GB/s", times[4] / blocks * 1e9, times[0] / blocks * 1e9, m.bytes() as f64 / times[4] / 1e9);
    };
    let only = std::env::args().nth(3).map(|f| f.to_uppercase()).filter(|f| f != "ALL");
    if std::env::args().nth(4).as_deref() == Some("avx2") {
        tandem_core::backend::cpu::kernels::set_max_isa(tandem_core::backend::cpu::kernels::Isa::Avx2);
    }
    if only.is_none() {
        report("int8", &quantize_int8_on(&pool, &f32m), false);
    }
    for f in [BlockFormat::Q4_K, BlockFormat::Q5_K, BlockFormat::Q6_K].into_iter().filter(|f| only.as_ref().is_none_or(|o| *o == f.name())) {
        let m = quantize_blocks_on(&pool, &f32m, f);
        report(&format!("{f} exact"), &m, false);
        report(&format!("{f} fast"), &m, true);
    }
}
