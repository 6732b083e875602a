//! Where a batched decode step spends its time: synthetic 0.8B, the step time for 1 and for SEQS
//! sequences, interleaved (median of 6 steps each). For `perf record` and for comparing kernels:
//! `cargo run --release --example decode_batch -p tandem-core [THREADS] [SEQS] [bf16|int8]`.
use std::time::Instant;
use tandem_core::model::load::LoadedModel;
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::state::State;
fn main() {
    let threads: usize = std::env::args().nth(1).map_or(1, |a| a.parse().unwrap());
    let max_seqs: usize = std::env::args().nth(2).map_or(8, |a| a.parse().unwrap());
    let t_start = Instant::now();
    let pool = Pool::new(threads);
    let model = match std::env::args().nth(3).as_deref() {
        Some("int8") => LoadedModel::load_int8("synthetic:qwen3.5-0.8b", &pool).unwrap(),
        _ => LoadedModel::load("synthetic:qwen3.5-0.8b").unwrap(),
    };
    let net = &model.net;
    let base: Vec<State> = (0..max_seqs)
        .map(|i| {
            let mut st = State::new(&net.config);
            let prompt: Vec<u32> = (0..13 + i as u32).map(|t| 1000 + 37 * t).collect();
            net.forward(&pool, &prompt, &mut st, tandem_core::model::Logits::Last).unwrap();
            st
        })
        .collect();
    let t0 = Instant::now();
    eprintln!("setup done after {:.1} s", t_start.elapsed().as_secs_f64());
    let _ = t0;
    let order: Vec<usize> = if std::env::var("ONLY_BATCH").is_ok() { vec![max_seqs; 4] } else { vec![1, max_seqs, 1, max_seqs] };
    for n in order {
        let mut states = base[..n].to_vec();
        let mut refs: Vec<&mut State> = states.iter_mut().collect();
        let tokens: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
        let mut times = Vec::new();
        for _ in 0..6 {
            let t = Instant::now();
            if n == 1 {
                net.forward(&pool, &tokens, refs[0], tandem_core::model::Logits::Last).unwrap();
            } else {
                net.decode_batch(&pool, &tokens, &mut refs).unwrap();
            }
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        println!("{n} sequences: step {:.1} ms median (min {:.1}), {:.1} tok/s", times[3], times[0], n as f64 / times[3] * 1e3);
    }
}
