//! Why the GEMV reads a matrix as four distant streams: one core's read rate of a bf16 GEMV
//! over a 508 MB matrix (the LM head's shape) when its four rows in flight are adjacent
//! versus a quarter of the matrix apart. `cargo run --release --example gemv_streams -p tandem-core`
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
#[cfg(target_arch = "x86_64")]
use std::time::Instant;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn gemv(w: &[u16], k: usize, x: &[f32], out: &mut [f32], distant: bool) {
    let n = out.len();
    let stride = if distant { n / 4 } else { 1 };
    let groups = n / 4;
    for g in 0..groups {
        let rows = if distant { [g, g + stride, g + 2 * stride, g + 3 * stride] } else { [4 * g, 4 * g + 1, 4 * g + 2, 4 * g + 3] };
        let p = rows.map(|r| w.as_ptr().add(r * k));
        let mut a = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i < k {
            let xv = _mm512_loadu_ps(x.as_ptr().add(i));
            for j in 0..4 {
                if i % 32 == 0 {
                    // 4 KB ahead in each stream (for adjacent rows: the next row group).
                    let ahead = if distant { p[j].wrapping_add(i + 2048) } else { p[j].wrapping_add(4 * k + i) };
                    _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                }
                let wv = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p[j].add(i) as *const __m256i))));
                a[j] = _mm512_fmadd_ps(wv, xv, a[j]);
            }
            i += 16;
        }
        for j in 0..4 {
            out[rows[j]] = _mm512_reduce_add_ps(a[j]);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("this comparison uses AVX-512: x86-64 only");
}

#[cfg(target_arch = "x86_64")]
fn main() {
    assert!(is_x86_feature_detected!("avx512bw"), "needs AVX-512");
    let (n, k) = (248_320usize, 1024usize);
    let w: Vec<u16> = (0..n * k).map(|i| 0x3f80 + (i % 13) as u16).collect();
    let x: Vec<f32> = (0..k).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let mut out = vec![0f32; n];
    for round in 0..3 {
        for distant in [false, true] {
            let mut r: Vec<f64> = (0..3)
                .map(|_| {
                    let s = Instant::now();
                    // SAFETY: feature checked above.
                    unsafe { gemv(&w, k, &x, &mut out, distant) };
                    (n * k * 2) as f64 / s.elapsed().as_secs_f64() / 1e9
                })
                .collect();
            r.sort_by(|a, b| a.total_cmp(b));
            println!("round {round}: {} rows: {:.1} GB/s (median of 3)", if distant { "four distant" } else { "four adjacent" }, r[1]);
        }
    }
}
