//! `tandem bench`: the CPU engine against the machine's own limits, measured in the same run.
//!
//! Ceilings: decode streams every weight once per token, so its ceiling is the measured read
//! bandwidth / bytes per token; prefill is arithmetic, so its ceiling is the measured f32 FMA
//! peak / FLOPs per token (the engine computes in f32 FMAs on every instruction set).
//! Method: one warm-up, then `--reps` repetitions with the compared configurations interleaved
//! (bf16, int8, bf16, int8, ...), reporting the median with min and max. On a shared machine
//! the limits themselves move from minute to minute (the hypervisor's steal time reaches 50%
//! here), so the ceilings are measured again just before every run, and the fractions are the
//! median rate over the median of all those measurements (the ceilings of the whole run, not
//! of one moment).

use std::fmt::Write as _;
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tandem_core::limits;
use tandem_core::model::{Logits, Qwen35};
use tandem_core::sampling::argmax;
use tandem_core::state::State;

use crate::args::Args;

pub mod cuda;
pub mod pipeline;

/// The report's sections, in order.
const SECTIONS: [&str; 4] = ["kernels", "transfer", "multiturn", "concurrency"];
/// Sections run only when named.
const GPU_SECTIONS: [&str; 1] = ["cuda"];

pub const USAGE: &str = "\
tandem bench [--model M] [--threads N | --cores 0,1] [--quant bf16,int8] [--prompts 13,74,133,410]
             [--decode-tokens 32] [--reps 3] [--quick] [--json FILE] [--isa avx512|avx2|portable]

Measures the machine (read bandwidth, f32 FMA peak, bf16 dot peak), then prefill tok/s per
prompt length and decode tok/s for each weight format, as absolute figures and as fractions of
the measured ceilings, and the peak resident memory of a generate run of each format.
Default model: synthetic:qwen3.5-0.8b. --quick: one repetition, prompts 13 and 74, 8 decode tokens.

--sections cuda [--device cuda:N] [--model M1,M2] [--prompts 2048] [--decode-tokens 64]:
the CUDA engine on GPU N against the GPU's measured tensor-core peak and memory bandwidth
(default models synthetic:qwen3.5-0.8b and synthetic:qwen3.5-9b).
";

struct Sample {
    quant: String,
    kind: &'static str,
    tokens: usize,
    seconds: f64,
    /// The ceilings measured just before this run's repetition (bytes/s, FLOP/s).
    bandwidth: f64,
    fma_peak: f64,
}

pub fn run(argv: &[String]) -> Result<ExitCode> {
    if argv.iter().any(|a| a == "--help" || a == "-h") {
        print!("{USAGE}");
        return Ok(ExitCode::SUCCESS);
    }
    let args = Args::parse(argv, &["model", "threads", "cores", "quant", "prompts", "decode-tokens", "reps", "json", "isa", "sections", "prefill", "decode", "device"], &["quick"])?;
    let quick = args.flag("quick");
    let sections: Vec<&str> = args.str("sections").map(|s| s.split(',').map(str::trim).collect()).unwrap_or(SECTIONS.to_vec());
    if let Some(bad) = sections.iter().find(|s| !SECTIONS.contains(s) && !GPU_SECTIONS.contains(s)) {
        bail!("--sections: unknown section {bad:?} (sections: {}; on a GPU: {})", SECTIONS.join(", "), GPU_SECTIONS.join(", "));
    }
    if sections == ["cuda"] {
        let ordinal = crate::parse_cuda_device(args.str("device").unwrap_or("cuda:0"))?;
        let specs: Vec<String> = args.str("model").unwrap_or("synthetic:qwen3.5-0.8b,synthetic:qwen3.5-9b").split(',').map(|s| s.trim().to_string()).collect();
        let prompt: usize = args.get("prompts", if quick { 512 } else { 2048 })?;
        let steps: usize = args.get("decode-tokens", if quick { 16 } else { 64 })?;
        let reps: usize = args.get("reps", if quick { 2 } else { 5 })?;
        let mut report = String::from("# tandem bench (CUDA)\n\n");
        let result = cuda::run(&mut report, ordinal, &specs, prompt, steps, reps.max(1));
        print!("{report}");
        return result.map(|()| ExitCode::SUCCESS);
    }
    if sections.iter().any(|s| GPU_SECTIONS.contains(s)) {
        bail!("--sections: run the GPU sections ({}) on their own", GPU_SECTIONS.join(", "));
    }
    let spec = args.str("model").unwrap_or("synthetic:qwen3.5-0.8b").to_string();
    let quants: Vec<String> = args.str("quant").unwrap_or("bf16,int8").split(',').map(|s| s.trim().to_string()).collect();
    for q in &quants {
        if q != "bf16" && q != "int8" {
            bail!("--quant {q:?}: benchmark formats are bf16 (as stored) and int8");
        }
    }
    let prompts: Vec<usize> = parse_list(args.str("prompts").unwrap_or(if quick { "13,74" } else { "13,74,133,410" }), "--prompts")?;
    let decode_tokens: usize = args.get("decode-tokens", if quick { 8 } else { 32 })?;
    let reps: usize = args.get("reps", if quick { 1 } else { 3 })?;
    if reps == 0 || decode_tokens == 0 || prompts.is_empty() {
        bail!("--reps, --decode-tokens and --prompts must be positive");
    }
    let pool = crate::make_pool(&args)?;
    let threads = pool.threads();

    let mut report = String::new();
    let steal_start = cpu_steal();
    progress("measuring the machine's limits");
    let bw_bytes = if quick { 256 << 20 } else { 1 << 30 };
    let bandwidth = limits::read_bandwidth(&pool, bw_bytes, if quick { 3 } else { 7 });
    let fma_peak = limits::fma_peak(&pool, if quick { 3 } else { 7 });
    let bf16_peak = limits::bf16_dot_peak(&pool, if quick { 3 } else { 7 });
    writeln!(report, "# tandem bench\n")?;
    writeln!(report, "## Machine\n")?;
    writeln!(report, "| | |\n|---|---|")?;
    writeln!(report, "| CPU | {} ({} logical cores) |", cpu_model(), std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))?;
    writeln!(
        report,
        "| engine threads | {threads}{} |",
        if pool.cores().is_empty() { String::new() } else { format!(" pinned to cores {:?}", pool.cores()) }
    )?;
    writeln!(report, "| kernels | {} |", limits::isa())?;
    writeln!(report, "| read bandwidth ({threads} threads, at the start) | {:.1} GB/s |", bandwidth / 1e9)?;
    writeln!(report, "| f32 FMA peak ({threads} threads, at the start) | {:.1} GFLOP/s |", fma_peak / 1e9)?;
    match bf16_peak {
        Some(p) => writeln!(report, "| bf16 dot peak ({threads} threads) | {:.1} GFLOP/s (not used: tandem keeps activations f32) |", p / 1e9)?,
        None => writeln!(report, "| bf16 dot peak | no AVX-512 BF16 on this CPU |")?,
    }

    progress(&format!("loading {spec}"));
    let model = tandem_core::load::LoadedModel::load(&spec)?;
    let mut samples = Vec::new();
    if sections.contains(&"kernels") {
        kernels(&mut report, &mut samples, &model, &pool, &spec, &quants, &prompts, decode_tokens, reps)?;
    }
    if let Err(e) = pipeline_sections(&mut report, &model, &args, &sections, quick, reps, &spec) {
        print!("{report}");
        return Err(e);
    }
    if let (Some(a), Some(b)) = (steal_start, cpu_steal()) {
        let (steal, total) = (b.0 - a.0, b.1 - a.1);
        writeln!(report, "\nCPU time taken by the hypervisor (steal) during this run: {:.0}%.", 100.0 * steal as f64 / total.max(1) as f64)?;
    }
    print!("{report}");

    if let Some(path) = args.str("json") {
        let runs: Vec<serde_json::Value> = samples
            .iter()
            .map(|s| {
                serde_json::json!({"weights": s.quant, "phase": s.kind, "tokens": s.tokens, "seconds": s.seconds,
                    "read_bandwidth_bytes_per_s": s.bandwidth, "fma_peak_flops": s.fma_peak})
            })
            .collect();
        let doc = serde_json::json!({
            "model": spec, "threads": threads, "cpu": cpu_model(), "kernels": limits::isa(),
            "read_bandwidth_bytes_per_s": bandwidth, "fma_peak_flops": fma_peak, "bf16_dot_peak_flops": bf16_peak,
            "runs": runs,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?).with_context(|| format!("writing {path}"))?;
        eprintln!("raw runs written to {path}");
    }
    Ok(ExitCode::SUCCESS)
}

fn parse_list(s: &str, flag: &str) -> Result<Vec<usize>> {
    s.split(',').map(|p| p.trim().parse::<usize>().map_err(|_| anyhow::anyhow!("{flag}: {p:?} is not a number"))).collect()
}

/// (median, min, max).
fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    let med = limits::median(v);
    (med, v.first().copied().unwrap_or(f64::NAN), v.last().copied().unwrap_or(f64::NAN))
}

/// (steal, total) jiffies of all CPUs since boot, from /proc/stat; None where it is absent.
fn cpu_steal() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat.lines().next()?.split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    Some((*fields.get(7)?, fields.iter().sum()))
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| c.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string()))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn progress(msg: &str) {
    eprintln!("[bench] {msg}");
}

fn progress_bar(done: usize, total: usize) {
    let width = 30;
    let filled = width * done / total.max(1);
    eprint!("\r[bench] [{}{}] {done}/{total} runs", "#".repeat(filled), ".".repeat(width - filled));
}

/// Prefill and decode rates of each weight format against the measured ceilings, int8 quality,
/// and peak memory.
#[allow(clippy::too_many_arguments)]
fn kernels(
    report: &mut String,
    samples: &mut Vec<Sample>,
    model: &tandem_core::load::LoadedModel,
    pool: &tandem_core::pool::Pool,
    spec: &str,
    quants: &[String],
    prompts: &[usize],
    decode_tokens: usize,
    reps: usize,
) -> Result<()> {
    let threads = pool.threads();
    let mut nets: Vec<(String, Qwen35)> = Vec::new();
    for q in quants {
        let mut net = model.net.clone();
        if q == "int8" {
            progress("quantizing to int8");
            net.quantize_int8(&pool);
        }
        nets.push((q.clone(), net));
    }
    let vocab = model.sampleable_vocab();
    let prompt_of = |n: usize| -> Vec<u32> { (0..n).map(|i| ((i * 7919 + 17) % vocab) as u32).collect() };

    // Warm-up: page in the weights and the caches of each format.
    for (_, net) in &nets {
        let mut st = State::new(&net.config);
        net.forward(&pool, &prompt_of(8), &mut st, Logits::Last)?;
        net.forward(&pool, &[1], &mut st, Logits::Last)?;
    }
    let total = reps * nets.len() * (prompts.len() + 1);
    let mut done = 0;
    // The ceilings again, just before each run (about a quarter of a second).
    let ceilings = || (limits::read_bandwidth(&pool, 256 << 20, 2), limits::fma_peak(&pool, 2));
    for _ in 0..reps {
        for (q, net) in &nets {
            for &n in prompts {
                let (bandwidth, fma_peak) = ceilings();
                let prompt = prompt_of(n);
                let mut st = State::new(&net.config);
                let t = Instant::now();
                net.forward(&pool, &prompt, &mut st, Logits::Last)?;
                samples.push(Sample { quant: q.clone(), kind: "prefill", tokens: n, seconds: t.elapsed().as_secs_f64(), bandwidth, fma_peak });
                done += 1;
                progress_bar(done, total);
            }
            // Decode: greedy tokens after a 13-token prompt (whose prefill is not timed).
            let mut st = State::new(&net.config);
            let mut logits = net.forward(&pool, &prompt_of(13), &mut st, Logits::Last)?;
            let (bandwidth, fma_peak) = ceilings();
            let t = Instant::now();
            for _ in 0..decode_tokens {
                let id = argmax(&logits[..vocab.min(logits.len())]);
                logits = net.forward(&pool, &[id], &mut st, Logits::Last)?;
            }
            samples.push(Sample { quant: q.clone(), kind: "decode", tokens: decode_tokens, seconds: t.elapsed().as_secs_f64(), bandwidth, fma_peak });
            done += 1;
            progress_bar(done, total);
        }
    }
    eprintln!();

    let fma_ceiling = limits::median(&mut samples.iter().map(|s| s.fma_peak).collect::<Vec<_>>());
    let bandwidth_ceiling = limits::median(&mut samples.iter().map(|s| s.bandwidth).collect::<Vec<_>>());
    writeln!(
        report,
        "\nCeilings during the runs (median of {} measurements, one before each run): read bandwidth {:.1} GB/s, f32 FMA peak {:.1} GFLOP/s.",
        samples.len(),
        bandwidth_ceiling / 1e9,
        fma_ceiling / 1e9
    )?;
    writeln!(report, "\n## Prefill ({spec}, {threads} threads, median of {reps} after a warm-up)\n")?;
    writeln!(report, "| weights | prompt tokens | tok/s (median) | min - max | GFLOP/token | GFLOP/s | of FMA peak | ceiling tok/s |")?;
    writeln!(report, "|---|---|---|---|---|---|---|---|")?;
    for (q, net) in &nets {
        for &n in prompts {
            let runs: Vec<&Sample> = samples.iter().filter(|s| &s.quant == q && s.kind == "prefill" && s.tokens == n).collect();
            let flops_per_token = net.prefill_flops(n) / n as f64;
            let (med, lo, hi) = stats(&mut runs.iter().map(|s| n as f64 / s.seconds).collect::<Vec<_>>());
            let fraction = med * flops_per_token / fma_ceiling;
            let ceiling = fma_ceiling / flops_per_token;
            writeln!(
                report,
                "| {q} | {n} | {med:.1} | {lo:.1} - {hi:.1} | {:.2} | {:.1} | {:.0}% | {ceiling:.1} |",
                flops_per_token / 1e9,
                med * flops_per_token / 1e9,
                100.0 * fraction,
            )?;
        }
    }
    writeln!(report, "\n## Decode ({spec}, one sequence, {decode_tokens} tokens after a 13-token prompt)\n")?;
    writeln!(report, "| weights | tok/s (median) | min - max | MB read/token | GB/s | of bandwidth | ceiling tok/s |")?;
    writeln!(report, "|---|---|---|---|---|---|---|")?;
    for (q, net) in &nets {
        let runs: Vec<&Sample> = samples.iter().filter(|s| &s.quant == q && s.kind == "decode").collect();
        // Weights streamed + the state read (at the middle of the decoded span).
        let mut st = State::new(&net.config);
        net.forward(&pool, &prompt_of(13 + decode_tokens / 2), &mut st, Logits::Last)?;
        let bytes = (net.weight_bytes_per_token() + st.bytes()) as f64;
        let (med, lo, hi) = stats(&mut runs.iter().map(|s| s.tokens as f64 / s.seconds).collect::<Vec<_>>());
        let fraction = med * bytes / bandwidth_ceiling;
        let ceiling = bandwidth_ceiling / bytes;
        writeln!(
            report,
            "| {q} | {med:.2} | {lo:.2} - {hi:.2} | {:.0} | {:.1} | {:.0}% | {ceiling:.1} |",
            bytes / 1e6,
            med * bytes / 1e9,
            100.0 * fraction,
        )?;
    }

    if nets.len() > 1 {
        progress("int8 quality against the stored weights");
        writeln!(report, "\n## int8 against the stored weights ({spec}, a 133-token prompt, 16 greedy tokens)\n")?;
        writeln!(report, "| prompt | positions | top-1 agreement | largest logit difference | greedy ids identical |")?;
        writeln!(report, "|---|---|---|---|---|")?;
        let row = tandem_core::quality::compare(&pool, &nets[0].1, &nets[1].1, "random ids", &prompt_of(133), 16, vocab)?;
        writeln!(report, "{row}")?;
    }

    progress("peak memory (a generate run per format in a child process)");
    writeln!(report, "\n## Memory (`tandem generate` of a 410-token prompt + 8 tokens, each format in its own process)\n")?;
    writeln!(report, "| weights | weights held | state | peak RSS | peak / (weights + state) |")?;
    writeln!(report, "|---|---|---|---|---|")?;
    for (q, net) in &nets {
        let ids: Vec<String> = prompt_of(410).iter().map(|i| i.to_string()).collect();
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["generate", "--model", &spec, "--token-ids", &ids.join(","), "--max-tokens", "8", "--ids-out", "--threads", &threads.to_string()]);
        if q == "int8" {
            cmd.args(["--quant", "int8"]);
        }
        let out = cmd.output().context("running tandem generate for the memory measurement")?;
        let err = String::from_utf8_lossy(&out.stderr);
        let peak_gb: f64 = err
            .split("peak RSS ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("no peak RSS in the generate summary: {err}"))?;
        let mut st = State::new(&net.config);
        net.forward(&pool, &prompt_of(418), &mut st, Logits::Last)?;
        let (w, s) = (net.weight_bytes() as f64 / 1e9, st.bytes() as f64 / 1e9);
        writeln!(report, "| {q} | {w:.2} GB | {:.0} MB | {peak_gb:.2} GB | {:.2} |", s * 1e3, peak_gb / (w + s))?;
    }
    Ok(())
}

/// The two-engine sections: the engines of `--prefill`/`--decode` (default: prefill on core 0,
/// decode on core 1, or both on one thread on a one-core machine).
fn pipeline_sections(report: &mut String, model: &tandem_core::load::LoadedModel, args: &Args, sections: &[&str], quick: bool, reps: usize, spec: &str) -> Result<()> {
    use tandem_core::engine::Placement;
    use tandem_core::scheduler::{Mode, PipelineConfig, Transfer};
    let two = std::thread::available_parallelism().map(|n| n.get() >= 2).unwrap_or(false);
    let (p, d) = if two { ("cpu:cores=0", "cpu:cores=1") } else { ("cpu:threads=1", "cpu:threads=1") };
    let config = PipelineConfig {
        mode: Mode::Hybrid,
        prefill: Placement::parse(args.str("prefill").unwrap_or(p)).context("--prefill")?,
        decode: Placement::parse(args.str("decode").unwrap_or(d)).context("--decode")?,
        transfer: Transfer::Move,
        max_batch: 8,
    };
    if sections.contains(&"transfer") {
        pipeline::transfer(report, model, &config.decode, &[74, 410], if quick { 3 } else { 7 }, spec)?;
    }
    if sections.contains(&"multiturn") {
        // --quick: replies of 16 tokens, and the typing fed 12 words at a time (else 3: each
        // update costs a prefill pass over the weights on one core, ~0.15 s here).
        let (reply, words_per_update) = if quick { (16, 12) } else { (100, 3) };
        pipeline::multiturn(report, model, &config, 3, 74, reply, words_per_update, if quick { 1 } else { reps.min(2) }, spec)?;
    }
    if sections.contains(&"concurrency") {
        pipeline::concurrency(report, model, &config, &[1, 2, 4, 8], 13, if quick { 8 } else { 32 }, if quick { 1 } else { reps }, spec)?;
    }
    Ok(())
}
