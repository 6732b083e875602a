use std::time::Instant;
use tandem_core::kernels::matmul::matmul;
use tandem_core::pool::Pool;
use tandem_core::quant::quantize_int8;
use tandem_core::tensor::{f32_to_bf16, Buf, Matrix, WeightData};
fn main() {
    let threads = std::env::args().nth(1).map(|a| a.parse().unwrap()).unwrap_or(2);
    let pool = Pool::new(threads);
    let (n, k) = (248320usize, 1024usize);
    let w = Matrix { rows: n, cols: k, data: WeightData::Bf16(Buf::from_vec((0..n * k).map(|i| f32_to_bf16(((i % 13) as f32 - 6.0) * 0.01)).collect())) };
    let q = quantize_int8(&w);
    let x: Vec<f32> = (0..k).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let mut out = vec![0f32; n];
    for _ in 0..4 {
        let bw = tandem_core::limits::read_bandwidth(&pool, 1 << 30, 3);
        let mut line = format!("probe {:.1} GB/s", bw / 1e9);
        for (name, m) in [("bf16", &w), ("int8", &q)] {
            let mut r = vec![];
            for _ in 0..5 { let s = Instant::now(); matmul(&pool, &x, 1, m, &mut out); r.push(m.bytes() as f64 / s.elapsed().as_secs_f64() / 1e9); }
            r.sort_by(|a, b| a.total_cmp(b));
            line += &format!(" | {name} {:.1} GB/s ({:.0}%)", r[2], 100.0 * r[2] * 1e9 / bw);
        }
        println!("{line}");
    }
}
