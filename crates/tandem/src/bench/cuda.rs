//! `tandem bench --sections cuda`: the CUDA engine against the GPU's own limits, measured in the
//! same run: the bf16 tensor-core peak (a large cuBLAS GEMM) for prefill, the device memory
//! bandwidth (a device-to-device copy) for decode. Then where a decode step goes, batched decode,
//! the bridge between devices, and energy per token from the GPU's counter.

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::Result;
use tandem_core::backend::cuda::qwen35::{GpuQwen35, GpuState, Precision};
use tandem_core::backend::cuda::Gpu;
use tandem_core::model::Logits;
use tandem_core::sampling::argmax;

use super::energy::{self, Counter};
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

/// The side of the square GEMM that measures the tensor cores' rate.
pub(super) const PEAK_GEMM: usize = 8192;

/// FLOP/s of a bf16 GEMM of `PEAK_GEMM` cubed on tensor cores (cuBLAS, f32 out), median of `reps`.
pub(super) fn tensor_core_peak(gpu: &Gpu, reps: usize) -> Result<f64> {
    let n = PEAK_GEMM;
    let a = gpu.zeros::<u16>(n * n)?;
    let b = gpu.zeros::<u16>(n * n)?;
    let c = gpu.zeros::<f32>(n * n)?;
    let (gemm_s, _, _) = time(reps, || {
        gpu.gemm_bf16(gpu.ptr(&a), n, gpu.ptr(&b), n, n, tandem_core::backend::cuda::GemmOut::F32(gpu.ptr(&c)))?;
        gpu.synchronize()
    })?;
    Ok(2.0 * (n * n * n) as f64 / gemm_s)
}

/// The GPU's device memory bandwidth in bytes/s: the median of `reps` 1 GiB device-to-device
/// copies, each reading and writing every byte.
pub(super) fn memory_bandwidth(gpu: &Gpu, reps: usize) -> Result<f64> {
    let bytes = 1usize << 30;
    let src = gpu.zeros::<u8>(bytes)?;
    let mut dst = gpu.zeros::<u8>(bytes)?;
    let (copy_s, _, _) = time(reps, || {
        gpu.stream.memcpy_dtod(&src, &mut dst).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        gpu.synchronize()
    })?;
    Ok(2.0 * bytes as f64 / copy_s)
}

/// Each model of `specs` in each weight format of `quants` (bf16: as stored; else `--quant`'s
/// formats, quantized at load).
#[allow(clippy::too_many_arguments)]
pub fn run(report: &mut String, ordinal: usize, specs: &[String], quants: &[String], prompt: usize, decode_steps: usize, reps: usize) -> Result<()> {
    progress(&format!("opening cuda:{ordinal}"));
    let gpu = Gpu::open(ordinal)?;
    writeln!(report, "## CUDA engine (cuda:{ordinal}: {})\n", gpu.name)?;

    // The GPU's limits, measured now.
    progress("measuring the GPU's limits");
    let tc_peak = tensor_core_peak(&gpu, reps.max(3))?;
    let n = PEAK_GEMM;
    let bandwidth = memory_bandwidth(&gpu, reps.max(3))?;
    writeln!(report, "| limit (measured in this run) | |\n|---|---|")?;
    writeln!(report, "| bf16 tensor-core GEMM {n}x{n}x{n} (cuBLAS) | {:.0} TFLOP/s |", tc_peak / 1e12)?;
    writeln!(report, "| device memory bandwidth (1 GiB device-to-device copy, read + write) | {:.0} GB/s |", bandwidth / 1e9)?;

    // A second GPU, for the peer copy of the bridge.
    let mut peer = match tandem_core::backend::cuda::gpu_count()? {
        n if n > ordinal + 1 => Some(Gpu::open(ordinal + 1)?),
        _ => None,
    };
    let meter = energy::nvml(&gpu);
    let idle_watts = match &meter {
        Ok(m) => Some(energy::idle_watts(std::slice::from_ref(m))?[0]),
        Err(_) => None,
    };

    writeln!(report, "\nPrefill of {prompt} tokens from an empty state; decode after a 13-token prompt, one sequence, {decode_steps} steps per run, with the step replayed from a CUDA graph and launched kernel by kernel, interleaved; median of {reps} after a warm-up (min - max).\n")?;
    writeln!(report, "| model | weights | prefill tensor cores tok/s | TFLOP/s | of bf16 peak | prefill exact f32 tok/s | decode tok/s (graph) | weight GB/s | of bandwidth | decode tok/s (launches) | TC vs exact: top-1, max logit diff |")?;
    writeln!(report, "|---|---|---|---|---|---|---|---|---|---|---|")?;
    let mut profiles = String::new();
    let mut gemvs = String::new();
    let mut steps_alone = String::new();
    let mut batches = String::new();
    let mut batch_profile = String::new();
    let (mut serving_steps, mut serving_profile) = (String::new(), String::new());
    let mut packs = String::new();
    let mut pack_profile = String::new();
    let (mut state_errors, mut state_speed) = (String::new(), String::new());
    let mut step_heads = String::new();
    let mut bridges = String::new();
    let mut energy = String::new();
    let mut model = Some(gpu);
    // (A format with -fast runs precision=fast: int8 inputs to the k-quant decode GEMVs.)
    let runs: Vec<(String, Option<tandem_core::model::quant::Quant>, &String, Precision)> = specs
        .iter()
        .flat_map(|spec| quants.iter().map(move |q| (spec, q)))
        .map(|(spec, q)| -> Result<_> {
            let (weights, precision) = match q.strip_suffix("-fast") {
                Some(w) => (w, Precision::Fast),
                None => (q.as_str(), Precision::TensorCores),
            };
            Ok(match weights {
                "bf16" => (if q == "bf16" { spec.clone() } else { format!("{spec} ({q})") }, None, spec, precision),
                w => (format!("{spec} ({q})"), Some(tandem_core::model::quant::Quant::parse(w)?), spec, precision),
            })
        })
        .collect::<Result<_>>()?;
    for (spec, quant, model_spec, precision) in &runs {
        let precision = *precision;
        let spec = spec.as_str();
        progress(&format!("loading {spec}"));
        let loaded = match quant {
            None => tandem_core::model::load::LoadedModel::load(model_spec)?,
            Some(q) => tandem_core::model::load::LoadedModel::load_quantized(model_spec, *q, &tandem_core::backend::cpu::pool::Pool::new(std::thread::available_parallelism().map_or(1, |n| n.get())))?,
        };
        let net = &loaded.net;
        progress(&format!("uploading {spec} to the GPU"));
        let mut g = GpuQwen35::upload(model.take().expect("one GPU"), net, precision)?;
        let vocab = net.config.vocab_size.min(248044);
        let tokens: Vec<u32> = (0..prompt.max(2048) as u32).map(|i| (i * 7919 + 13) % vocab as u32).collect();
        let prompt_tokens = &tokens[..prompt];
        progress(&format!("{spec}: prefill"));
        let mut tc_logits = Vec::new();
        let (tc, tc_lo, tc_hi) = time(reps, || {
            let mut st = g.new_state()?;
            tc_logits = g.forward(prompt_tokens, &mut st, Logits::Last)?;
            Ok(())
        })?;
        g.precision = Precision::Exact;
        let mut exact_logits = Vec::new();
        let (ex, _, _) = time(reps.min(2), || {
            let mut st = g.new_state()?;
            exact_logits = g.forward(prompt_tokens, &mut st, Logits::Last)?;
            Ok(())
        })?;
        g.precision = precision;
        let diff = tc_logits.iter().zip(&exact_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let same_top = argmax(&tc_logits) == argmax(&exact_logits);

        progress(&format!("{spec}: decode"));
        // Per-step seconds of `decode_steps` greedy steps from a fresh 13-token state, each
        // token picked as the engines pick it: the GPU's argmax after a replayed step, the
        // host's from the logits after launches.
        let decode_run = |g: &GpuQwen35| -> Result<f64> {
            let mut st = g.new_state()?;
            g.forward(&tokens[..13], &mut st, Logits::Last)?;
            let greedy = |st: &mut GpuState| -> Result<u32> {
                Ok(match st.last_argmax() {
                    Some(a) => a,
                    None => argmax(st.last_logits()?),
                })
            };
            let mut next = greedy(&mut st)?;
            let t = Instant::now();
            for _ in 0..decode_steps {
                g.apply(&[next], &mut st)?;
                next = greedy(&mut st)?;
            }
            Ok(t.elapsed().as_secs_f64() / decode_steps as f64)
        };
        let (mut with_graph, mut launched, mut gpu_alone) = (Vec::new(), Vec::new(), Vec::new());
        decode_run(&g)?;
        let mut replayed = g.new_state()?;
        g.forward(&tokens[..13], &mut replayed, Logits::Last)?;
        for _ in 0..reps {
            for graphs in [true, false] {
                g.graphs = graphs;
                let s = decode_run(&g)?;
                if graphs { with_graph.push(s) } else { launched.push(s) }
            }
            g.graphs = true;
            gpu_alone.push(g.time_step_replays(&mut replayed, decode_steps)?);
        }
        let (step, _, _) = stats(&mut with_graph);
        let (gpu_step, _, _) = stats(&mut gpu_alone);
        writeln!(steps_alone, "| {spec} | {:.0} | {:.0} | {:.0} |", 1e6 * gpu_step, 1e6 * step, 1.0 / gpu_step)?;
        let (step_launched, _, _) = stats(&mut launched);
        let flops = net.prefill_flops(prompt);
        let weight_rate = g.weight_bytes() as f64 / step;
        writeln!(
            report,
            "| {spec} | {:.1} GB | {:.0} ({:.0} - {:.0}) | {:.0} | {:.0}% | {:.0} | {:.0} | {:.0} | {:.0}% | {:.0} | {}, {diff:.2e} |",
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
            1.0 / step_launched,
            if same_top { "same" } else { "differs" },
        )?;

        // The decode GEMVs alone, by shape, against the bandwidth.
        progress(&format!("{spec}: decode GEMVs"));
        for t in g.time_decode_gemvs(40, 5)? {
            let rate = t.bytes as f64 / (t.micros * 1e-6);
            writeln!(gemvs, "| {spec} | {} | {} x {} | {:.1} | {:.2} | {:.0} | {:.0}% |", t.what, t.rows, t.cols, t.bytes as f64 / 1e6, t.micros, rate / 1e9, 100.0 * rate / bandwidth)?;
        }

        // Where a decode step goes: each kernel timed with events (launched one by one).
        progress(&format!("{spec}: decode profile"));
        g.graphs = false;
        let mut st = g.new_state()?;
        g.forward(&tokens[..13], &mut st, Logits::Last)?;
        let profiled = 8;
        g.gpu.start_profile();
        for i in 0..profiled {
            g.forward(&[tokens[20 + i]], &mut st, Logits::Last)?;
        }
        let profile = g.gpu.finish_profile()?;
        g.graphs = true;
        let total: f64 = profile.iter().map(|p| p.1).sum();
        writeln!(profiles, "\n{spec}: {:.0} µs of kernels per step ({:.0} launches), against {:.0} µs per step with the graph:\n", 1e3 * total / profiled as f64, profile.iter().map(|p| p.2).sum::<usize>() as f64 / profiled as f64, 1e6 * step)?;
        writeln!(profiles, "| kernel | µs per step | launches per step | share |\n|---|---|---|---|")?;
        for (name, ms, count) in &profile {
            writeln!(profiles, "| {name} | {:.1} | {} | {:.0}% |", 1e3 * ms / profiled as f64, count / profiled, 100.0 * ms / total)?;
        }
        // Where a prefill goes (tensor cores), kernel by kernel and the cuBLAS GEMMs.
        progress(&format!("{spec}: prefill profile"));
        let mut st = g.new_state()?;
        g.gpu.start_profile();
        g.forward(prompt_tokens, &mut st, Logits::Last)?;
        let profile = g.gpu.finish_profile()?;
        let total: f64 = profile.iter().map(|p| p.1).sum();
        writeln!(profiles, "\n{spec}, prefill of {prompt} tokens (tensor cores): {total:.1} ms of kernels ({} launches), against {:.1} ms per prefill unprofiled:\n", profile.iter().map(|p| p.2).sum::<usize>(), 1e3 * tc)?;
        writeln!(profiles, "| kernel | ms | launches | share |\n|---|---|---|---|")?;
        for (name, ms, count) in &profile {
            writeln!(profiles, "| {name} | {ms:.2} | {count} | {:.0}% |", 100.0 * ms / total)?;
        }

        // Several sequences per step: every weight read once for all of them. Up to 8
        // sequences, the products by the GEMV and by the tensor-core GEMM, interleaved (the
        // engine's default takes the GEMM from `decode_gemm_from` sequences).
        progress(&format!("{spec}: batched decode"));
        let default_from = g.decode_gemm_from();
        let mut one = 0.0;
        for n in [1usize, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256] {
            let mut states = (0..n)
                .map(|i| {
                    let mut st = g.new_state()?;
                    g.forward(&tokens[i..13 + i], &mut st, Logits::Last)?;
                    Ok(st)
                })
                .collect::<Result<Vec<_>>>()?;
            let ids: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
            // (GEMM from, label): both paths where the GEMV can take the batch (its graph's
            // bucket, the batch padded to a power of two, has at most 8 rows).
            let paths: Vec<(usize, &str)> = if (2..=8).contains(&n) { vec![(9, "GEMV"), (2, "GEMM")] } else { vec![(default_from, "")] };
            let mut rates = vec![Vec::new(); paths.len()];
            for rep in 0..=reps {
                for (p, &(from, _)) in paths.iter().enumerate() {
                    g.set_decode_gemm_from(from);
                    let step_once = |states: &mut Vec<GpuState>| -> Result<()> {
                        if n == 1 {
                            g.forward(&ids, &mut states[0], Logits::Last)?;
                        } else {
                            let mut refs: Vec<_> = states.iter_mut().collect();
                            g.decode_batch(&ids, &mut refs)?;
                        }
                        Ok(())
                    };
                    // One untimed step captures the path's graph (and, first, warms up).
                    step_once(&mut states)?;
                    if rep == 0 {
                        continue;
                    }
                    let t = Instant::now();
                    for _ in 0..decode_steps {
                        step_once(&mut states)?;
                    }
                    rates[p].push((n * decode_steps) as f64 / t.elapsed().as_secs_f64());
                }
            }
            g.set_decode_gemm_from(default_from);
            for (p, &(from, label)) in paths.iter().enumerate() {
                let (rate, lo, hi) = stats(&mut rates[p]);
                if n == 1 {
                    one = rate;
                }
                let chosen = if paths.len() == 1 || (n.next_power_of_two() >= default_from) == (from == 2) { " (default)" } else { "" };
                writeln!(batches, "| {spec} | {n} | {label}{chosen} | {rate:.0} ({lo:.0} - {hi:.0}) | {:.2}x |", rate / one)?;
            }
            if n == 256 {
                // Where the largest batched step goes, kernel by kernel.
                let mut refs: Vec<_> = states.iter_mut().collect();
                batch_profile += &batched_step_profile(&mut g, &ids, &mut refs, &format!("{spec}, a step of {n} sequences"))?;
            }
        }

        let (rates, profile) = super::serving_step::measure(&mut g, spec, vocab, prompt, decode_steps, reps)?;
        serving_steps += &rates;
        serving_profile += &profile;
        super::step_heads::compare(&mut g, spec, &tokens, decode_steps, reps, &mut step_heads)?;
        super::state_dtype::compare(&mut g, spec, &tokens, decode_steps, reps, &mut state_errors, &mut state_speed)?;

        // Several prompts prefilled in one forward (their rows packed) against one after
        // another, interleaved; the last packing profiled kernel by kernel.
        progress(&format!("{spec}: packed prefill"));
        for n in [1usize, 2, 4, 8, 16, 32] {
            let prompts: Vec<&[u32]> = (0..n).map(|i| &tokens[i % 7..i % 7 + prompt]).collect();
            let packed = |g: &GpuQwen35| -> Result<()> {
                let mut states = (0..n).map(|_| g.new_state()).collect::<Result<Vec<_>>>()?;
                let mut refs: Vec<_> = states.iter_mut().collect();
                g.prefill_batch(&prompts, &mut refs)
            };
            let one_by_one = |g: &GpuQwen35| -> Result<()> {
                for p in &prompts {
                    let mut st = g.new_state()?;
                    g.apply(p, &mut st)?;
                    st.last_logits()?;
                }
                Ok(())
            };
            packed(&g)?;
            let (mut rates, mut alone) = (Vec::new(), Vec::new());
            for _ in 0..reps {
                let t = Instant::now();
                packed(&g)?;
                rates.push((n * prompt) as f64 / t.elapsed().as_secs_f64());
                if n == 1 || n == 16 {
                    let t = Instant::now();
                    one_by_one(&g)?;
                    alone.push((n * prompt) as f64 / t.elapsed().as_secs_f64());
                }
            }
            let (rate, lo, hi) = stats(&mut rates);
            let alone = if alone.is_empty() { "-".to_string() } else { format!("{:.0}", stats(&mut alone).0) };
            let flops = n as f64 * net.prefill_flops(prompt);
            let secs = (n * prompt) as f64 / rate;
            writeln!(packs, "| {spec} | {n} | {} | {rate:.0} ({lo:.0} - {hi:.0}) | {:.0} | {:.0}% | {alone} |", n * prompt, flops / secs / 1e12, 100.0 * flops / secs / tc_peak)?;
            if n == 16 {
                g.gpu.start_profile();
                packed(&g)?;
                let profile = g.gpu.finish_profile()?;
                let total: f64 = profile.iter().map(|p| p.1).sum();
                writeln!(pack_profile, "
{spec}, {n} prompts of {prompt} tokens packed: {total:.1} ms of kernels ({} launches):
", profile.iter().map(|p| p.2).sum::<usize>())?;
                writeln!(pack_profile, "| kernel | ms | launches | share |\n|---|---|---|---|")?;
                for (name, ms, count) in profile.iter().take(20) {
                    writeln!(pack_profile, "| {name} | {ms:.2} | {count} | {:.0}% |", 100.0 * ms / total)?;
                }
            }
        }

        // The bridge between devices: a prefilled state copied GPU -> host, host -> GPU, GPU ->
        // GPU (the same one, and the peer where there are two).
        progress(&format!("{spec}: bridge"));
        let mut peer_model = match peer.take() {
            Some(p) => Some(GpuQwen35::upload(p, net, Precision::TensorCores)?),
            None => None,
        };
        for len in [410usize, 2048] {
            let mut st = g.new_state()?;
            g.forward(&tokens[..len], &mut st, Logits::Last)?;
            let host = st.download()?;
            let mb = st.bytes() as f64 / 1e6;
            let mut row = |what: &str, (s, lo, hi): (f64, f64, f64)| writeln!(bridges, "| {spec} | {len} | {what} | {mb:.1} | {:.2} ({:.2} - {:.2}) | {:.1} |", s * 1e3, lo * 1e3, hi * 1e3, mb / 1e3 / s);
            row("GPU -> host (device to host)", time(reps, || st.download().map(drop))?)?;
            row("host -> GPU (host to device)", time(reps, || g.upload_state(&host).map(drop))?)?;
            row("GPU -> same GPU (device to device)", time(reps, || g.copy_state(&st).map(drop))?)?;
            if let Some(p) = &peer_model {
                row(&format!("cuda:{ordinal} -> cuda:{} (peer)", ordinal + 1), time(reps, || p.copy_state(&st).map(drop))?)?;
            }
        }
        peer = peer_model.take().map(GpuQwen35::into_gpu);

        // Energy per token from the GPU's own counter.
        progress(&format!("{spec}: energy"));
        match &meter {
            Ok(m) => {
                let (j_prefill, w_prefill) = joules_per_token(m, prompt, || {
                    let mut st = g.new_state()?;
                    g.forward(prompt_tokens, &mut st, Logits::Last).map(drop)
                })?;
                let mut st = g.new_state()?;
                g.forward(&tokens[..13], &mut st, Logits::Last)?;
                let (j_decode, w_decode) = joules_per_token(m, decode_steps, || {
                    for i in 0..decode_steps {
                        g.forward(&[tokens[i]], &mut st, Logits::Last)?;
                    }
                    if st.position > 4096 {
                        st = g.new_state()?;
                        g.forward(&tokens[..13], &mut st, Logits::Last)?;
                    }
                    Ok(())
                })?;
                writeln!(energy, "| {spec} | {:.2} mJ | {w_prefill:.0} W | {:.1} mJ | {w_decode:.0} W |", j_prefill * 1e3, j_decode * 1e3)?;
            }
            Err(e) => writeln!(energy, "| {spec} | no energy counter: {e:#} | | | |")?,
        }
        model = Some(g.into_gpu());
    }
    writeln!(report, "\n### Where a decode step and a prefill go (kernel by kernel, CUDA events)\n{profiles}")?;
    writeln!(
        report,
        "\n### A decode step on the GPU alone (its graph replayed {decode_steps} times back to back, one wait at the end; median of {reps}) against a step as `apply` runs it with its greedy pick (a wait, and the argmax, found on the GPU, copied to the host each token)\n\n| model | µs per step, GPU alone | µs per step, apply + pick | tok/s, GPU alone |\n|---|---|---|---|\n{steps_alone}"
    )?;
    writeln!(report, "\n### The decode GEMVs alone (one token; each kind through every layer's matrices, a CUDA graph of 40 launches or more, median of 5 replays)\n\n| model | GEMV | weights | MB | µs per launch | GB/s | of bandwidth |\n|---|---|---|---|---|---|---|\n{gemvs}")?;
    writeln!(report, "\n### Batched decode (one step for every sequence, replayed from its batch-size bucket's graph; one sequence: its own graph). From 2 to 8 sequences the products by the GEMV and by the tensor-core GEMM, interleaved; (default): the path the engine takes\n\n| model | sequences | products | aggregate tok/s | vs one |\n|---|---|---|---|---|\n{batches}{batch_profile}")?;
    writeln!(
        report,
        "\n### A batched step at a prompt's context (the serving batch: {} sequences of a model under 4 GB of weights, {} of a larger one; each prefilled with {prompt} tokens, then {decode_steps} steps a run, median of {reps}, min - max; the kernels one by one after them)\n\n| model | sequences | positions | ms per step | tok/s |\n|---|---|---|---|---|\n{serving_steps}{serving_profile}",
        super::serving_step::sequences(0),
        super::serving_step::sequences(usize::MAX)
    )?;
    writeln!(
        report,
        "\n### The batched step's DeltaNet mixer: a block per 32 columns of a value head against a block per value head (the same bits; the whole step's rate with each, interleaved, {decode_steps} steps a run, median of {reps}, min - max; the mixer kernels' time per step by CUDA events, kernel by kernel)\n\n| model | sequences | mixer ms per step (per 32 columns / per head) | tok/s per 32 columns | tok/s per head | per head / per 32 columns | default |\n|---|---|---|---|---|---|---|\n{step_heads}"
    )?;
    writeln!(
        report,
        "\n### Recurrent states in f32 and in bf16 (`state=bf16`)\n\nA {}-token prompt prefilled from an empty state in each, then {} greedy steps fed the f32 run's tokens: the largest logit difference, the steps whose top-1 agree, the first step where the bf16 run's own greedy pick would differ, and the recurrent states' relative error (the worst layer's ||bf16 - f32|| / ||f32||) after them.\n\n| model | max logit diff after the prompt | max logit diff over the steps | top-1 agree | first greedy divergence | state relative error |\n|---|---|---|---|---|---|\n{state_errors}\nBatched decode steps in each, interleaved ({decode_steps} steps a run, median of {reps}, min - max):\n\n| model | sequences | slot MiB (f32 / bf16) | f32 tok/s | bf16 tok/s | bf16 / f32 |\n|---|---|---|---|---|---|\n{state_speed}",
        super::state_dtype::PROMPT,
        super::state_dtype::STEPS
    )?;
    writeln!(report, "\n### Packed prefill (prompts of {prompt} tokens prefilled in one forward, their rows packed; against the same prompts one after another, measured at 1 and 16; median of {reps})\n\n| model | prompts | tokens | tok/s | TFLOP/s | of bf16 peak | one after another tok/s |\n|---|---|---|---|---|---|---|\n{packs}{pack_profile}")?;
    writeln!(
        report,
        "\n### The bridge between devices (a prefilled state, median of {reps}; {})\n\n| model | tokens | copy | MB | ms | GB/s |\n|---|---|---|---|---|---|\n{bridges}",
        if peer.is_some() { "peer copy between two GPUs of one host" } else { "one GPU here: no peer copy" }
    )?;
    writeln!(report, "\n### Energy (the GPU's NVML energy counter over runs of 2 s or more; the whole board, idle power included)\n")?;
    if let Some(w) = idle_watts {
        writeln!(report, "Idle power before the runs: {w:.0} W.\n")?;
    }
    writeln!(report, "| model | per prefill token ({prompt}-token prompts) | average power | per decode token | average power |\n|---|---|---|---|---|\n{energy}")?;
    Ok(())
}

/// Joules per token and average watts of `run` (which handles `tokens` tokens), after one
/// warm-up run, repeated for at least 2 s so that the counter's coarse updates do not matter.
/// `steps` batched decode steps of `states` launched kernel by kernel (after one more, unprofiled)
/// and profiled with CUDA events: each kernel's milliseconds and launches over the steps. The
/// engine replays its graphs again afterwards.
pub(super) fn profile_batched_steps(g: &mut GpuQwen35, ids: &[u32], states: &mut [&mut GpuState], steps: usize) -> Result<Vec<(std::borrow::Cow<'static, str>, f64, usize)>> {
    g.graphs = false;
    g.decode_batch(ids, states)?;
    g.gpu.start_profile();
    for _ in 0..steps {
        g.decode_batch(ids, states)?;
    }
    let profile = g.gpu.finish_profile();
    g.graphs = true;
    profile
}

/// Four batched decode steps of `states` profiled kernel by kernel (`profile_batched_steps`), as
/// a Markdown table under `title`: each kernel's milliseconds and launches per step, the 20
/// that take longest.
pub(super) fn batched_step_profile(g: &mut GpuQwen35, ids: &[u32], states: &mut [&mut GpuState], title: &str) -> Result<String> {
    let profiled = 4;
    let profile = profile_batched_steps(g, ids, states, profiled)?;
    let total: f64 = profile.iter().map(|p| p.1).sum();
    let mut out = format!("\n{title}: {:.2} ms of kernels ({} launches):\n\n", total / profiled as f64, profile.iter().map(|p| p.2).sum::<usize>() / profiled);
    out += "| kernel | ms per step | launches per step | share |\n|---|---|---|---|\n";
    for (name, ms, count) in profile.iter().take(20) {
        writeln!(out, "| {name} | {:.3} | {} | {:.0}% |", ms / profiled as f64, count / profiled, 100.0 * ms / total)?;
    }
    Ok(out)
}

/// Tokens per second of `steps` batched decode steps of `states`, back to back.
pub(super) fn batched_rate(g: &GpuQwen35, ids: &[u32], states: &mut [&mut GpuState], steps: usize) -> Result<f64> {
    let t = Instant::now();
    for _ in 0..steps {
        g.decode_batch(ids, states)?;
    }
    Ok((ids.len() * steps) as f64 / t.elapsed().as_secs_f64())
}

fn joules_per_token(m: &Counter, tokens: usize, mut run: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    run()?;
    let (joules, seconds, runs) = energy::over_two_seconds(std::slice::from_ref(m), run)?;
    Ok((joules[0] / (runs * tokens) as f64, joules[0] / seconds))
}
