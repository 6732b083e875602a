//! Where a one-sequence decode step falls short of the read bandwidth: a plain read and the
//! bench's four-stream read of 512 MB, the synthetic model's matrices each through the decode
//! GEMV alone (GB/s against a plain read of as many bytes on the same pool; the small ones are
//! then in cache, unlike in a step), every matrix once as a step reads them (and each call's
//! time by shape, against an empty pool call), then whole decode steps against the bytes they
//! read, and their time by phase.
//! `cargo run --release --example decode_bandwidth -p tandem-core [THREADS] [bf16|int8|q4_k|...][-fast] [MODEL]`
//! (`-fast`: the CPU engine's precision=fast).
use std::cell::RefCell;
use std::time::Instant;
use tandem_core::backend::cpu::kernels::matmul::{decode_group, decode_group_fast};
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::backend::cpu::profile;
use tandem_core::model::load::LoadedModel;
use tandem_core::model::tensor::Matrix;
use tandem_core::state::State;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// GB/s of summing `bytes` bytes of a buffer on the pool (what the GEMV reads, plainly read).
fn plain_read(pool: &Pool, buf: &[f32]) -> f64 {
    let rates: Vec<f64> = (0..7)
        .map(|_| {
            let sink = std::sync::atomic::AtomicU32::new(0);
            let t = Instant::now();
            pool.for_ranges(buf.len(), 1024, &|r| {
                let mut acc = [0f32; 16];
                for c in buf[r].chunks_exact(16) {
                    for j in 0..16 {
                        acc[j] += c[j];
                    }
                }
                sink.fetch_add(acc.iter().sum::<f32>().to_bits() & 1, std::sync::atomic::Ordering::Relaxed);
            });
            (buf.len() * 4) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    median(rates)
}

/// The bench's ceiling: four interleaved streams with software prefetch 4 KB ahead.
#[target_feature(enable = "avx512f")]
unsafe fn sum4(x: &[f32], prefetch: bool) -> f32 {
    use std::arch::x86_64::*;
    const AHEAD: usize = 1024;
    let part = x.len() / 4 / 16 * 16;
    let p = x.as_ptr();
    let mut a = [_mm512_setzero_ps(); 8];
    let mut i = 0;
    while i + 32 <= part {
        for s in 0..4 {
            let q = p.add(s * part + i);
            if prefetch {
                _mm_prefetch::<_MM_HINT_T0>(q.add(AHEAD) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(q.add(AHEAD + 16) as *const i8);
            }
            a[2 * s] = _mm512_add_ps(a[2 * s], _mm512_loadu_ps(q));
            a[2 * s + 1] = _mm512_add_ps(a[2 * s + 1], _mm512_loadu_ps(q.add(16)));
        }
        i += 32;
    }
    let mut t = _mm512_setzero_ps();
    for v in a {
        t = _mm512_add_ps(t, v);
    }
    _mm512_reduce_add_ps(t)
}

fn read4(pool: &Pool, buf: &[f32], prefetch: bool) -> f64 {
    let rates: Vec<f64> = (0..7)
        .map(|_| {
            let sink = std::sync::atomic::AtomicU32::new(0);
            let t = Instant::now();
            pool.for_ranges(buf.len(), 1024, &|r| {
                let s = unsafe { sum4(&buf[r], prefetch) };
                sink.fetch_add(s.to_bits() & 1, std::sync::atomic::Ordering::Relaxed);
            });
            (buf.len() * 4) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    median(rates)
}

fn main() {
    let threads: usize = std::env::args().nth(1).map_or(2, |a| a.parse().unwrap());
    let format = std::env::args().nth(2).unwrap_or("bf16".into());
    let fast = format.ends_with("-fast");
    let quant = Some(format.trim_end_matches("-fast")).filter(|q| *q != "bf16").map(|q| tandem_core::model::quant::Quant::parse(q).unwrap());
    let gemv = |pool: &Pool, x: &[f32], jobs: &mut [(&Matrix, &mut [f32])]| if fast { decode_group_fast(pool, x, 1, jobs) } else { decode_group(pool, x, 1, jobs) };
    let spec = std::env::args().nth(3).unwrap_or("synthetic:qwen3.5-0.8b".into());
    let pool = Pool::new(threads);
    let mut model = match quant {
        Some(q) => LoadedModel::load_quantized(&spec, q, &pool).unwrap(),
        None => LoadedModel::load(&spec).unwrap(),
    };
    if fast {
        model.net.set_cpu_precision(tandem_core::backend::cpu::CpuPrecision::Fast);
    }
    let net = &model.net;
    // One of each shape of matrix, as the forward pass multiplies by them.
    let seen = RefCell::new(Vec::<Matrix>::new());
    net.clone().map_matrices(|m| {
        let mut s = seen.borrow_mut();
        if !s.iter().any(|o| (o.rows, o.cols) == (m.rows, m.cols)) {
            s.push(m.clone());
        }
        m.clone()
    });
    // In 2 MB pages where the kernel gives them, as the weights are.
    let mut big = tandem_core::model::tensor::zeroed_in_huge_pages::<f32>((512usize << 20) / 4);
    for (i, v) in big.iter_mut().enumerate() {
        *v = (i % 7) as f32;
    }
    for _ in 0..2 {
        if std::arch::is_x86_feature_detected!("avx512f") {
            println!("plain read of 512 MB: {:.1} GB/s; four streams with prefetch {:.1}, without {:.1}", plain_read(&pool, &big), read4(&pool, &big, true), read4(&pool, &big, false));
        } else {
            println!("plain read of 512 MB: {:.1} GB/s (no AVX-512 here for the four-stream read)", plain_read(&pool, &big));
        }
    }
    println!("| matrix | MB | GEMV GB/s | plain read of as many bytes, GB/s | µs |");
    for m in seen.borrow().iter() {
        let x: Vec<f32> = (0..m.cols).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
        let mut out = vec![0f32; m.rows];
        let times: Vec<f64> = (0..15)
            .map(|_| {
                let t = Instant::now();
                gemv(&pool, &x, &mut [(m, &mut out)]);
                t.elapsed().as_secs_f64()
            })
            .collect();
        let t = median(times);
        let plain = plain_read(&pool, &big[..m.bytes() / 4]);
        println!("| {}x{} | {:.1} | {:.1} | {:.1} | {:.0} |", m.rows, m.cols, m.bytes() as f64 / 1e6, m.bytes() as f64 / t / 1e9, plain, t * 1e6);
    }
    // Every matrix of the model through the GEMV one after another, as a step reads them
    // (from memory, not from cache): what the products alone cost of a step.
    let all = RefCell::new(Vec::<Matrix>::new());
    net.clone().map_matrices(|m| {
        all.borrow_mut().push(m.clone());
        m.clone()
    });
    let all = all.into_inner();
    let bytes: usize = all.iter().map(|m| m.bytes()).sum();
    let xs: Vec<Vec<f32>> = all.iter().map(|m| vec![0.01; m.cols]).collect();
    let mut outs: Vec<Vec<f32>> = all.iter().map(|m| vec![0f32; m.rows]).collect();
    // Each call's time too: within a stream of every matrix, a small matrix comes from memory as
    // in a step, and its time against its bytes shows what a call costs beyond its reading.
    let mut per_call: Vec<Vec<f64>> = vec![Vec::new(); all.len()];
    let times: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            for (i, m) in all.iter().enumerate() {
                let c = Instant::now();
                gemv(&pool, &xs[i], &mut [(m, &mut outs[i])]);
                per_call[i].push(c.elapsed().as_secs_f64());
            }
            t.elapsed().as_secs_f64()
        })
        .collect();
    let t = median(times);
    println!("every matrix once, one GEMV each: {:.2} ms, {:.0} MB, {:.1} GB/s", t * 1e3, bytes as f64 / 1e6, bytes as f64 / t / 1e9);
    let empty = median((0..7).map(|_| {
        let t = Instant::now();
        for _ in 0..100 {
            pool.run(&|_| {});
        }
        t.elapsed().as_secs_f64() / 100.0
    }).collect());
    println!("an empty pool call: {:.2} µs", empty * 1e6);
    println!("| matrix (in that stream) | MB | calls | µs per call (median) | GB/s |");
    let mut shapes: Vec<(usize, usize)> = Vec::new();
    for m in &all {
        if !shapes.contains(&(m.rows, m.cols)) {
            shapes.push((m.rows, m.cols));
        }
    }
    for shape in shapes {
        let of_shape: Vec<usize> = (0..all.len()).filter(|&i| (all[i].rows, all[i].cols) == shape).collect();
        let call = median(of_shape.iter().flat_map(|&i| per_call[i].iter().copied()).collect());
        let mb = all[of_shape[0]].bytes() as f64;
        println!("| {}x{} | {:.2} | {} | {:.1} | {:.1} |", shape.0, shape.1, mb / 1e6, of_shape.len(), call * 1e6, mb / call / 1e9);
    }
    let mut st = State::new(&net.config);
    net.forward(&pool, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], &mut st, tandem_core::model::Logits::Last).unwrap();
    let times: Vec<f64> = (0..24)
        .map(|i| {
            let t = Instant::now();
            net.decode_batch(&pool, &[100 + i], &mut [&mut st]).unwrap();
            t.elapsed().as_secs_f64()
        })
        .collect();
    let t = median(times);
    let bytes = (net.weight_bytes_per_token() + st.bytes()) as f64;
    println!("decode step: {:.2} ms, {:.0} MB read, {:.1} GB/s; plain read now {:.1} GB/s", t * 1e3, bytes / 1e6, bytes / t / 1e9, plain_read(&pool, &big));
    // The same steps by phase (timing each phase adds a little to the step).
    profile::enable(true);
    profile::take();
    let steps = 24;
    for i in 0..steps {
        net.decode_batch(&pool, &[200 + i], &mut [&mut st]).unwrap();
    }
    profile::enable(false);
    let phases = profile::take();
    let total: f64 = phases.iter().map(|(_, d)| d.as_secs_f64()).sum();
    println!("| phase of a step | ms | share |");
    for (phase, d) in phases {
        let ms = d.as_secs_f64() * 1e3 / steps as f64;
        println!("| {} | {:.3} | {:.1}% |", phase.name(), ms, 100.0 * d.as_secs_f64() / total);
    }
}
