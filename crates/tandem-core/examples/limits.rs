fn main() {
    use tandem_core::{limits, pool::Pool};
    for t in [1usize, 2] {
        let pool = Pool::new(t);
        let bw = limits::read_bandwidth(&pool, 1 << 30, 5);
        let fma = limits::fma_peak(&pool, 5);
        let bf = limits::bf16_dot_peak(&pool, 5);
        println!("{t} threads: read {:.1} GB/s, fma {:.1} GFLOP/s, bf16 {:?} GFLOP/s", bw / 1e9, fma / 1e9, bf.map(|b| b / 1e9));
    }
}
