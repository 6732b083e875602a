//! The machine's own limits, measured in the same run as the engine: streaming read
//! bandwidth (the decode ceiling) and peak arithmetic (the prefill ceiling), on the pool's
//! threads.

use std::time::Instant;

use tandem_core::backend::cpu::pool::Pool;

/// Instruction set the kernels dispatch to on this machine.
pub fn isa() -> &'static str {
    match tandem_core::backend::cpu::kernels::isa() {
        tandem_core::backend::cpu::kernels::Isa::Amx => "amx",
        tandem_core::backend::cpu::kernels::Isa::Avx512Dot => "avx512-dot",
        tandem_core::backend::cpu::kernels::Isa::Avx512 => "avx512",
        tandem_core::backend::cpu::kernels::Isa::Avx2 => "avx2",
        tandem_core::backend::cpu::kernels::Isa::Portable => "portable",
    }
}

pub fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Read bandwidth in bytes/s: every worker sums its share of a `bytes` buffer, `reps` times
/// after one warm-up pass, each `ReadWay`; the faster way's median. The buffer should be far
/// larger than the last-level cache.
pub fn read_bandwidth(pool: &Pool, bytes: usize, reps: usize) -> f64 {
    ReadBuffer::new(bytes).bandwidth(pool, bytes, reps).best()
}

/// The median rates (bytes/s) of the two ways of reading a buffer.
#[derive(Clone, Copy, Debug)]
pub struct ReadRates {
    pub four_streams: f64,
    pub sequential: f64,
}

impl ReadRates {
    /// The ceiling: the faster way.
    pub fn best(&self) -> f64 {
        self.four_streams.max(self.sequential)
    }
}

/// A buffer to measure read bandwidth over its first `bytes`, allocated once for many
/// measurements, in 2 MB pages where the kernel gives them, as the engine's weights are.
pub struct ReadBuffer(Vec<f32>);

impl ReadBuffer {
    pub fn new(bytes: usize) -> ReadBuffer {
        let mut buf = tandem_core::model::tensor::zeroed_in_huge_pages::<f32>(bytes / 4);
        for (i, v) in buf.iter_mut().enumerate() {
            *v = (i % 7) as f32;
        }
        ReadBuffer(buf)
    }

    /// Bytes/s of reading the first `bytes` on the pool: each way of reading (`ReadWay`) `reps`
    /// times after a warm-up, the ways interleaved; each way's median.
    pub fn bandwidth(&self, pool: &Pool, bytes: usize, reps: usize) -> ReadRates {
        let buf = &self.0[..(bytes / 4).min(self.0.len())];
        let bytes = buf.len() * 4;
        let mut rates = [Vec::new(), Vec::new()];
        for rep in 0..=reps {
            for (way, rates) in [ReadWay::FourStreams, ReadWay::Sequential].into_iter().zip(rates.iter_mut()) {
                let sink = std::sync::atomic::AtomicU32::new(0);
                let t = Instant::now();
                pool.for_ranges(buf.len(), 1024, &|r| {
                    let s = sum(&buf[r], way);
                    sink.fetch_add(s.to_bits() & 1, std::sync::atomic::Ordering::Relaxed);
                });
                let dt = t.elapsed().as_secs_f64();
                std::hint::black_box(sink.load(std::sync::atomic::Ordering::Relaxed));
                if rep > 0 {
                    rates.push(bytes as f64 / dt);
                }
            }
        }
        let [mut four, mut sequential] = rates;
        ReadRates { four_streams: median(&mut four), sequential: median(&mut sequential) }
    }
}

/// How a ceiling measurement reads each worker's share. The faster of the two is the ceiling,
/// since which one is faster depends on the machine and the prefetch: on the 16-core Xeon of
/// an H200 host a trial program read one plain stream 11-24% faster than four streams
/// prefetched into L1 (at 2, 8 and 16 threads), which alone had been the ceiling; with the
/// prefetch into L2 the two ways were level there (docs/results/2026-11-29-cpu-decode-
/// prefetch-and-ceiling.md).
#[derive(Clone, Copy)]
enum ReadWay {
    /// Four distant streams (the decode GEMV's pattern), each prefetched 4 KB ahead into L2.
    FourStreams,
    /// One sequential stream, the hardware prefetchers alone.
    Sequential,
}

fn sum(x: &[f32], way: ReadWay) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: feature checked.
            return unsafe {
                match way {
                    ReadWay::FourStreams => sum_four_streams_avx512(x),
                    ReadWay::Sequential => sum_sequential_avx512(x),
                }
            };
        }
    }
    let _ = way;
    let mut acc = [0f32; 16];
    for c in x.chunks_exact(16) {
        for j in 0..16 {
            acc[j] += c[j];
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_four_streams_avx512(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    const AHEAD: usize = 1024; // floats = 4 KB
    let part = x.len() / 4 / 16 * 16;
    let p = x.as_ptr();
    let mut a = [_mm512_setzero_ps(); 8];
    let mut i = 0;
    while i + 32 <= part {
        for s in 0..4 {
            let q = p.add(s * part + i);
            _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(AHEAD) as *const i8);
            _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(AHEAD + 16) as *const i8);
            a[2 * s] = _mm512_add_ps(a[2 * s], _mm512_loadu_ps(q));
            a[2 * s + 1] = _mm512_add_ps(a[2 * s + 1], _mm512_loadu_ps(q.add(16)));
        }
        i += 32;
    }
    let mut t = _mm512_setzero_ps();
    for v in a {
        t = _mm512_add_ps(t, v);
    }
    _mm512_reduce_add_ps(t) + x[4 * part..].iter().sum::<f32>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_sequential_avx512(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let whole = x.len() / 64 * 64;
    let p = x.as_ptr();
    let mut a = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i < whole {
        for (j, acc) in a.iter_mut().enumerate() {
            *acc = _mm512_add_ps(*acc, _mm512_loadu_ps(p.add(i + 16 * j)));
        }
        i += 64;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]))) + x[whole..].iter().sum::<f32>()
}

/// Peak f32 FLOP/s of fused multiply-adds on every worker (the arithmetic the prefill GEMM
/// uses), median of `reps`.
pub fn fma_peak(pool: &Pool, reps: usize) -> f64 {
    peak(pool, reps, fma_flops)
}

/// Peak FLOP/s of bf16 dot products (`vdpbf16ps`, 2 multiply-adds per f32 lane), if the CPU has
/// them: the upper bound for a prefill that rounds activations to bf16 (tandem does not).
pub fn bf16_dot_peak(pool: &Pool, reps: usize) -> Option<f64> {
    if !has_avx512_bf16() {
        return None;
    }
    Some(peak(pool, reps, bf16_flops))
}

/// Peak int8 operations per second of `vpdpbusd` (4 multiply-adds per i32 lane, counted as 8
/// operations), if the CPU has AVX512-VNNI: the ceiling of a CPU engine's fast int8 prefill.
pub fn int8_dot_peak(pool: &Pool, reps: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512vnni") {
        // SAFETY: the feature was detected.
        return Some(peak(pool, reps, |iters| unsafe { int8_avx512(iters) }));
    }
    let _ = (pool, reps);
    None
}

/// Peak int8 operations per second of AMX tiles (`tdpbssd`), where the CPU has them and the
/// kernels may use them: the fast int8 prefill's ceiling there.
pub fn amx_int8_peak(pool: &Pool, reps: usize) -> Option<f64> {
    amx_peak(pool, reps, true)
}

/// Peak FLOP/s of AMX bf16 tiles (`tdpbf16ps`), as `amx_int8_peak`.
pub fn amx_bf16_peak(pool: &Pool, reps: usize) -> Option<f64> {
    amx_peak(pool, reps, false)
}

fn amx_peak(pool: &Pool, reps: usize, int8: bool) -> Option<f64> {
    use tandem_core::backend::cpu::kernels::{amx, Isa};
    if tandem_core::backend::cpu::kernels::isa() != Isa::Amx {
        return None;
    }
    // Four tile products take about 64 cycles: a tenth of the vector loops' rounds lasts
    // about as long as those do.
    Some(peak(pool, reps, move |iters| amx::peak_ops(iters / 10, int8).unwrap_or(0.0)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn int8_avx512(iters: u64) -> f64 {
    use std::arch::x86_64::*;
    let x = _mm512_set1_epi8(3);
    let mut a = [_mm512_setzero_si512(); 12];
    for _ in 0..iters {
        for acc in a.iter_mut() {
            *acc = _mm512_dpbusd_epi32(*acc, x, x);
        }
    }
    std::hint::black_box(a);
    iters as f64 * 12.0 * 64.0 * 2.0
}

fn peak(pool: &Pool, reps: usize, kernel: impl Fn(u64) -> f64 + Sync) -> f64 {
    const ITERS: u64 = 20_000_000;
    let mut rates = Vec::new();
    for rep in 0..=reps {
        let flops = std::sync::Mutex::new(0f64);
        let t = Instant::now();
        pool.run(&|_| {
            let f = kernel(ITERS);
            *flops.lock().unwrap() += f;
        });
        let dt = t.elapsed().as_secs_f64();
        if rep > 0 {
            rates.push(*flops.lock().unwrap() / dt);
        }
    }
    median(&mut rates)
}

/// Runs `iters` rounds of 12 independent FMA chains; returns the FLOPs done.
/// On the instruction set the kernels use (see `kernels::isa`).
fn fma_flops(iters: u64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    match tandem_core::backend::cpu::kernels::isa() {
        // SAFETY: isa() only reports features the CPU has.
        tandem_core::backend::cpu::kernels::Isa::Avx512 | tandem_core::backend::cpu::kernels::Isa::Avx512Dot | tandem_core::backend::cpu::kernels::Isa::Amx => return unsafe { fma_avx512(iters) },
        tandem_core::backend::cpu::kernels::Isa::Avx2 => return unsafe { fma_avx2(iters) },
        tandem_core::backend::cpu::kernels::Isa::Portable => {}
    }
    let mut a = [1.0f32; 8];
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = x.mul_add(0.999_999, 1e-7);
        }
    }
    std::hint::black_box(a);
    iters as f64 * 8.0 * 2.0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_avx512(iters: u64) -> f64 {
    use std::arch::x86_64::*;
    let m = _mm512_set1_ps(0.999_999);
    let c = _mm512_set1_ps(1e-7);
    let mut a = [_mm512_set1_ps(1.0); 12];
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm512_fmadd_ps(*x, m, c);
        }
    }
    std::hint::black_box(a);
    iters as f64 * 12.0 * 16.0 * 2.0
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: u64) -> f64 {
    use std::arch::x86_64::*;
    let m = _mm256_set1_ps(0.999_999);
    let c = _mm256_set1_ps(1e-7);
    let mut a = [_mm256_set1_ps(1.0); 12];
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm256_fmadd_ps(*x, m, c);
        }
    }
    std::hint::black_box(a);
    iters as f64 * 12.0 * 8.0 * 2.0
}

fn bf16_flops(iters: u64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: only called when avx512bf16 was detected.
        unsafe { bf16_avx512(iters) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = iters;
        0.0
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bf16_avx512(iters: u64) -> f64 {
    use std::arch::x86_64::*;
    let x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5), _mm512_set1_ps(0.25));
    let mut a = [_mm512_setzero_ps(); 12];
    for _ in 0..iters {
        for acc in a.iter_mut() {
            *acc = _mm512_dpbf16_ps(*acc, x, x);
        }
    }
    std::hint::black_box(a);
    iters as f64 * 12.0 * 32.0 * 2.0
}

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        // An even count: the mean of the two middle values.
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
