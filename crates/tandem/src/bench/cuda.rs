//! `tandem bench --sections cuda`: the CUDA engine against the GPU's own limits, measured in the
//! same run: the bf16 tensor-core peak (a large cuBLAS GEMM) for prefill, the device memory
//! bandwidth (a device-to-device copy) for decode.

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::Result;
use tandem_core::cuda::qwen35::{GpuQwen35, Precision};
use tandem_core::cuda::Gpu;
use tandem_core::model::Logits;
use tandem_core::sampling::argmax;

use super::{progress, stats};

/// Median seconds of `reps` runs of `f` after one warm-up; `f` ends synchronized.
fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64, f64)> {
    f()?;
    let mut s = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        s.push(t.elapsed().as_secs_f64());
    }
    Ok(stats(&mut s))
}

pub fn run(report: &mut String, ordinal: usize, specs: &[String], prompt: usize, decode_steps: usize, reps: usize) -> Result<()> {
    progress(&format!("opening cuda:{ordinal}"));
    let gpu = Gpu::open(ordinal)?;
    writeln!(report, "## CUDA engine (cuda:{ordinal}: {})\n", gpu.name)?;

    // The GPU's limits, measured now.
    progress("measuring the GPU's limits");
    let n = 8192usize;
    let a = gpu.zeros::<u16>(n * n)?;
    let b = gpu.zeros::<u16>(n * n)?;
    let c = gpu.zeros::<f32>(n * n)?;
    let (gemm_s, _, _) = time(reps.max(3), || {
        gpu.gemm_bf16(gpu.ptr(&a), n, gpu.ptr(&b), n, n, gpu.ptr(&c))?;
        gpu.synchronize()
    })?;
    let tc_peak = 2.0 * (n * n * n) as f64 / gemm_s;
    drop((a, b, c));
    let bytes = 1usize << 30;
    let src = gpu.zeros::<u8>(bytes)?;
    let mut dst = gpu.zeros::<u8>(bytes)?;
    let (copy_s, _, _) = time(reps.max(3), || {
        gpu.stream.memcpy_dtod(&src, &mut dst).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        gpu.synchronize()
    })?;
    // A copy reads and writes every byte.
    let bandwidth = 2.0 * bytes as f64 / copy_s;
    drop((src, dst));
    writeln!(report, "| limit (measured in this run) | |\n|---|---|")?;
    writeln!(report, "| bf16 tensor-core GEMM {n}x{n}x{n} (cuBLAS) | {:.0} TFLOP/s |", tc_peak / 1e12)?;
    writeln!(report, "| device memory bandwidth (1 GiB device-to-device copy, read + write) | {:.0} GB/s |", bandwidth / 1e9)?;

    writeln!(report, "\nPrefill of {prompt} tokens from an empty state, decode of {decode_steps} steps after a 13-token prompt, one sequence; median of {reps} after a warm-up (min - max).\n")?;
    writeln!(report, "| model | weights | prefill tensor cores tok/s | TFLOP/s | of bf16 peak | prefill exact f32 tok/s | decode tok/s | weight GB/s | of bandwidth | TC vs exact: top-1, max logit diff |")?;
    writeln!(report, "|---|---|---|---|---|---|---|---|---|---|")?;
    let mut model = Some(gpu);
    for spec in specs {
        progress(&format!("loading {spec}"));
        let loaded = tandem_core::load::LoadedModel::load(spec)?;
        let net = &loaded.net;
        progress(&format!("uploading {spec} to the GPU"));
        let mut g = GpuQwen35::upload(model.take().expect("one GPU"), net, Precision::TensorCores)?;
        let vocab = net.config.vocab_size.min(248044);
        let tokens: Vec<u32> = (0..prompt as u32).map(|i| (i * 7919 + 13) % vocab as u32).collect();
        progress(&format!("{spec}: prefill"));
        let mut tc_logits = Vec::new();
        let (tc, tc_lo, tc_hi) = time(reps, || {
            let mut st = g.new_state()?;
            tc_logits = g.forward(&tokens, &mut st, Logits::Last)?;
            Ok(())
        })?;
        g.precision = Precision::Exact;
        let mut exact_logits = Vec::new();
        let (ex, _, _) = time(reps.min(2), || {
            let mut st = g.new_state()?;
            exact_logits = g.forward(&tokens, &mut st, Logits::Last)?;
            Ok(())
        })?;
        g.precision = Precision::TensorCores;
        let diff = tc_logits.iter().zip(&exact_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let same_top = argmax(&tc_logits) == argmax(&exact_logits);
        progress(&format!("{spec}: decode"));
        let mut st = g.new_state()?;
        g.forward(&tokens[..13], &mut st, Logits::Last)?;
        let mut steps = Vec::with_capacity(decode_steps);
        let mut next = argmax(&st.last_logits) as u32;
        for _ in 0..decode_steps {
            let t = Instant::now();
            let l = g.forward(&[next], &mut st, Logits::Last)?;
            steps.push(t.elapsed().as_secs_f64());
            next = argmax(&l) as u32;
        }
        let (step, _, _) = stats(&mut steps);
        let flops = net.prefill_flops(prompt);
        let weight_rate = g.weight_bytes() as f64 / step;
        writeln!(
            report,
            "| {spec} | {:.1} GB | {:.0} ({:.0} - {:.0}) | {:.0} | {:.0}% | {:.0} | {:.0} | {:.0} | {:.0}% | {}, {diff:.2e} |",
            g.weight_bytes() as f64 / 1e9,
            prompt as f64 / tc,
            prompt as f64 / tc_hi,
            prompt as f64 / tc_lo,
            flops / tc / 1e12,
            100.0 * flops / tc / tc_peak,
            prompt as f64 / ex,
            1.0 / step,
            weight_rate / 1e9,
            100.0 * weight_rate / bandwidth,
            if same_top { "same" } else { "differs" },
        )?;
        model = Some(g.into_gpu());
    }
    Ok(())
}
