//! What one pool call costs with nothing to do: `Pool::run` of an empty job on THREADS workers
//! (the fork and the join that every kernel call of a decode step pays), median ns per call
//! over 7 runs of 20,000 calls, with min and max.
//! `cargo run --release --example fork_join -p tandem-core [THREADS]`.
use std::time::Instant;
use tandem_core::backend::cpu::pool::Pool;

fn main() {
    let threads: usize = std::env::args().nth(1).map_or(2, |a| a.parse().expect("THREADS is a number"));
    let pool = Pool::new(threads);
    const CALLS: u32 = 20_000;
    let mut ns: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..CALLS {
                pool.run(&|w| {
                    std::hint::black_box(w);
                });
            }
            t.elapsed().as_nanos() as f64 / CALLS as f64
        })
        .collect();
    ns.sort_by(f64::total_cmp);
    println!("{threads} threads: an empty pool call takes {:.0} ns (median; {:.0} - {:.0})", ns[3], ns[0], ns[6]);
}
