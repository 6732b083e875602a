//! `tandem bench`: the CPU engine against the machine's own limits, measured in the same run.
//!
//! Ceilings: decode streams every weight once per token, so its ceiling is the bandwidth of a
//! plain read of as many bytes as a step reads / bytes per token; prefill is arithmetic, so its
//! ceiling is the measured f32 FMA peak / FLOPs per token (or the dot products' peak for the
//! fast precision).
//! Method: one warm-up, then `--reps` repetitions with the compared configurations interleaved
//! (bf16, int8, bf16, int8, ...), reporting the median with min and max. On a shared machine
//! the limits themselves move from minute to minute (the hypervisor's steal time reaches 50%
//! here), so the ceilings are measured again around every run, and the fractions are the
//! median rate over the median of all those measurements (the ceilings of the whole run, not
//! of one moment).

use std::fmt::Write as _;
use std::io::IsTerminal as _;
use std::path::Path;
use std::process::{Command, ExitCode};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use tandem_core::model::{Logits, Qwen35};
use tandem_core::sampling::argmax;
use tandem_core::state::State;

use crate::args::Args;

pub mod cuda;
mod disagg;
mod energy;
pub mod limits;
mod load;
mod nixl_peer;
mod nvml;
pub mod pipeline;
mod placement;
mod prefix_cache;
mod serve;
mod serving_step;
mod state_dtype;
mod grammar;
mod step_heads;
mod study;
mod svg;

/// The weight formats the kernels section compares: as stored, each `--quant`, and the CPU
/// engine's fast precision on bf16 and int8 weights.
const BENCH_FORMATS: [&str; 11] = ["bf16", "int8", "bf16-fast", "int8-fast", "q8_0", "q4_k", "q5_k", "q6_k", "q4_k-fast", "q5_k-fast", "q6_k-fast"];
const DEFAULT_FORMATS: &str = "bf16,int8,bf16-fast,int8-fast,q4_k,q4_k-fast";

/// A benchmark format's `--quant` (None: as stored) and whether it runs precision=fast.
fn format_quant(q: &str) -> Result<(Option<tandem_core::model::quant::Quant>, bool)> {
    let (base, fast) = match q.strip_suffix("-fast") {
        Some(base) => (base, true),
        None => (q, false),
    };
    Ok((if base == "bf16" { None } else { Some(tandem_core::model::quant::Quant::parse(base)?) }, fast))
}

/// The report's sections, in order (the study's tables 1-7 after the engine kernels).
const SECTIONS: [&str; 9] = ["kernels", "placement", "modes", "dispatch", "transfer", "multiturn", "concurrency", "crossover", "energy"];
/// Sections run only when named, each on its own.
const OWN_SECTIONS: [&str; 5] = ["cuda", "serve", "prefix-cache", "disagg", "grammar"];

pub const USAGE: &str = "\
tandem bench [--model M] [--prefill PLACEMENT] [--decode PLACEMENT]
             [--quant bf16,int8,bf16-fast,int8-fast,q4_k,q4_k-fast] [--sections kernels,modes,...] [--quick]
             [--out DIR] [--reps 3] [--threads N | --cores 0,1] [--prompts 13,74,410]
             [--decode-tokens 32] [--drift-tokens 2000] [--isa amx|avx512-dot|avx512|avx2|portable]

Measures the machine (read bandwidth, f32 FMA peak, bf16 dot peak), then each section:
  kernels      prefill and decode tok/s of each weight format (--quant: bf16 as stored,
               int8, q8_0, q4_k, q5_k, q6_k; bf16-fast, int8-fast, q4_k-fast, q5_k-fast
               and q6_k-fast a CPU engine's precision=fast) on all cores (--threads/
               --cores), against the measured ceilings (the fast ones against the dot
               products' peaks); where a
               prefill's and a decode step's time goes, phase by phase; the quality table
               (each quantized format against bf16, on the model and on the golden fixture);
               each fast format against exact, with the states' drift over --drift-tokens
               tokens (2000; --quick 500); peak memory (the other sections run the first
               format of --quant)
  placement    the two engines (--prefill, --decode) each alone and both at once: decode
               tok/s and GB/s against its cores' read ceiling, prefill tok/s on the longest
               prompt; one sequence's decode on 1, 2, 4, ... cores against the machine's
               bandwidth, and the fewest cores that reach 90% of it
  modes        the study's tables 1-2: prefill engine alone, decode engine alone, hybrid, on
               prompts of 13, 28, 74 and 6, 133, 410 tokens
  dispatch     table 2: sequential, batched:32 and dynamic dispatch of a 74-token prompt
  transfer     table 3: state transfer split into serialize / read / rebuild
  multiturn    table 4: three turns with and without sessions, measured
  concurrency  table 5: 1, 2, 4, 8 concurrent requests
  crossover    table 6: prefill tok/s of each engine from 8 to 2048 tokens
  energy       table 7: joules per prefill and decode token from RAPL or NVML, where present
The engines: --prefill and --decode placements (default cpu:cores=0 and cpu:cores=1).
Repetitions (--reps, default 2; the multi-turn conversations once unless --reps is given):
interleaved, after a warm-up, reported as median with min and max.
Default model: synthetic:qwen3.5-0.8b. --quick: a run of a minute or two (fewer prompts,
repetitions and tokens). The Markdown report goes to stdout and, with a JSON file of every raw
run and SVG plots, to --out (default ./tandem-bench).

--sections cuda [--device cuda:N] [--model M1,M2] [--quant bf16,q4_k,q4_k-fast] [--prompts 2048] [--decode-tokens 64]:
the CUDA engine on GPU N against the GPU's measured tensor-core peak and memory bandwidth
(default models synthetic:qwen3.5-0.8b and synthetic:qwen3.5-9b, weights bf16; -fast: GPU
precision=fast, the k-quant decode products against int8 inputs).

--sections serve [--model M] [engine options as for tandem serve] [--max-concurrent N]
                 [--input-len 512] [--output-len 128] [--concurrency 1,8,32,64,128,256]
                 [--rates 4,16,64|none] [--requests N] [--temperature 0] [--top-k 0] [--top-p 1]
                 [--slo-ttft-ms 1000] [--slo-tpot-ms 50]:
starts tandem serve on a loopback port and drives it with streamed random-token requests
(ignore_eos) at each concurrency, then at each Poisson request rate: output and total tok/s,
TTFT and ITL p50/p99, goodput within the SLO, GPU memory, and each point's physical limit from
the decode engine's memory bandwidth, measured first. Requests per point: two per client, or
15 s of arrivals (--requests N for all). --quick: concurrency 1 and 4, 64 in / 16 out.
--trace FILE: the server's timeline of its engines' work over every point (tandem serve --trace).
--url http://IP:PORT: the same loads against a server already running there (a tandem serve,
or a router in front of prefill and decode workers; --model names the served model), without
the limits and the engines' gauges.

--sections disagg [--model M] [--prefill P] [--decode P] [--prompts 410,2048,8192] [--reps 5]
                 [--short-len 64] [--long-len 2048] [--output-len 64] [--requests 24]
                 [--concurrency 4] [--slo-ttft-ms 5000] [--slo-tpot-ms 200] [--rounds 1]:
disaggregated serving: the state's transfer at each prompt length (move, a memcpy of its
image, a state file, the socket bridge and NIXL to another process; on a GPU also NIXL GPU
memory to GPU memory against a copy on the GPU; time, GB/s and the ratio to the copy), then one
tandem serve (prefill engine P, decode engine P) against a router with a prefill worker on the
prefill engine and a decode worker on the decode engine, with each prefill placement, under a
mixed load of short and long prompts: TTFT, ITL, output tok/s and goodput (--rounds N: the
setups in turn N times, medians). On two GPUs (--prefill cuda:0 --decode cuda:1): the state
between the two, and end to end the single server, two replicas behind the router (one per
GPU), and a prefill worker on one GPU with a decode worker on the other (remote, conditional).
NIXL needs a tandem built with --features nixl (else its rows say so and the workers move
states by stream). --quick: 410 and 2048 tokens, 3
repetitions, a smaller load.

--sections prefix-cache [--model M] [engine options as for tandem serve] [--reps 2]
                 [--system-len 2000] [--questions 200] [--conversations 16] [--turns 10]
                 [--shared-len 1500] [--few-shot 100] [--output-len 32]
                 [--no-reuse-requests 64] [--no-reuse-len 512]
                 [--prefix-cache-memory SIZE] [--prefix-cache-device-memory SIZE]
                 [--prefix-snapshot-every N] [--workloads questions,agent,few-shot,no-reuse]
                 [--trace PREFIX]:
tandem serve's prefix cache on four workloads, each with the cache on and off (a fresh server
of each per repetition, in alternating order): a shared system prompt with short questions
after it (and the questions alone), agent conversations adding tool results turn by turn,
few-shot prompts sharing a long run of examples, random prompts that share nothing. Hit rate
against the ideal (the prompt tokens finished requests applied), TTFT p50/p99, output tok/s,
the cache's memory. --quick: the tiny sizes of a test. --trace PREFIX: each server's timeline
of its engines' work in PREFIX-cache-on-1.json and so on (tandem serve --trace).

--sections grammar [--model M] [--prefill P] [--decode P] [--concurrency 1,32]
                   [--decode-tokens 48] [--reps 3]:
constrained decoding (response_format, required tool calls): the grammar engine's setup and
compile times, the sampler's time per token with a JSON schema, any JSON object and a tool
call against none, for one sequence and a serving batch, and the decode rate through the
pipeline with the schema against none, interleaved. --quick: 1 and 8 sequences, 16 tokens.
";

/// What a run produces: the Markdown report, every raw measurement (the JSON file) and the
/// plots.
#[derive(Default)]
pub struct Record {
    pub report: String,
    runs: Vec<serde_json::Value>,
    plots: Vec<(String, String)>,
}

impl Record {
    /// One raw measurement of `section` (an object of its parameters and results).
    pub fn run(&mut self, section: &str, mut run: serde_json::Value) {
        run["section"] = section.into();
        self.runs.push(run);
    }

    pub fn plot(&mut self, file: &str, chart: svg::Chart) {
        self.plots.push((file.to_string(), chart.render()));
    }

    /// report.md, runs.json (with `header`) and the plots, into `dir`.
    fn write(self, dir: &Path, mut header: serde_json::Value) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating the output folder {}", dir.display()))?;
        let put = |name: &str, text: &str| std::fs::write(dir.join(name), text).with_context(|| format!("writing {}", dir.join(name).display()));
        put("report.md", &self.report)?;
        header["runs"] = self.runs.into();
        put("runs.json", &serde_json::to_string_pretty(&header)?)?;
        for (name, svg) in &self.plots {
            put(name, svg)?;
        }
        Ok(())
    }
}

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
    let args = Args::parse(
        argv,
        &[
            "model", "threads", "cores", "quant", "prompts", "decode-tokens", "drift-tokens", "reps", "out", "isa", "sections", "prefill", "decode", "device", "mode", "transfer",
            // The serve section's.
            "input-len", "output-len", "concurrency", "rates", "requests", "max-concurrent", "max-prefill-tokens", "temperature", "top-k", "top-p", "slo-ttft-ms", "slo-tpot-ms", "gpu-memory-utilization",
            "kv-cache-memory", "trace",
            // The prefix-cache section's.
            "system-len", "questions", "conversations", "turns", "shared-len", "few-shot", "prefix-cache-memory", "prefix-cache-device-memory", "prefix-snapshot-every", "no-reuse-requests", "no-reuse-len", "workloads",
            // The disagg section's.
            "short-len", "long-len", "rounds", "url",
        ],
        &["quick"],
    )?;
    let quick = args.flag("quick");
    let sections: Vec<&str> = args.str("sections").map(|s| s.split(',').map(str::trim).collect()).unwrap_or(SECTIONS.to_vec());
    if let Some(bad) = sections.iter().find(|s| !SECTIONS.contains(s) && !OWN_SECTIONS.contains(s)) {
        bail!("--sections: unknown section {bad:?} (sections: {}; on their own: {})", SECTIONS.join(", "), OWN_SECTIONS.join(", "));
    }
    // The sections that run on their own, each with its own report.
    type Own = fn(&mut String, &Args, bool) -> Result<()>;
    let own: [(&str, &str, Own); 4] = [
        ("serve", "serving", serve::run),
        ("prefix-cache", "prefix cache", prefix_cache::run),
        ("disagg", "disaggregated serving", disagg::run),
        ("grammar", "constrained decoding", grammar::run),
    ];
    if let Some((_, title, run)) = own.iter().find(|(name, ..)| sections == [*name]) {
        started();
        let mut report = format!("# tandem bench ({title})\n\n");
        let result = run(&mut report, &args, quick);
        print!("{report}");
        return result.map(|()| ExitCode::SUCCESS);
    }
    if sections == ["cuda"] {
        let ordinal = crate::parse_cuda_device(args.str("device").unwrap_or("cuda:0"))?;
        let specs: Vec<String> = args.str("model").unwrap_or("synthetic:qwen3.5-0.8b,synthetic:qwen3.5-9b").split(',').map(|s| s.trim().to_string()).collect();
        let prompt: usize = args.get("prompts", if quick { 512 } else { 2048 })?;
        let steps: usize = args.get("decode-tokens", if quick { 16 } else { 64 })?;
        let reps: usize = args.get("reps", if quick { 2 } else { 5 })?;
        let mut report = String::from("# tandem bench (CUDA)\n\n");
        let quants: Vec<String> = args.str("quant").unwrap_or("bf16").split(',').map(|s| s.trim().to_string()).collect();
        let result = cuda::run(&mut report, ordinal, &specs, &quants, prompt, steps, reps.max(1));
        print!("{report}");
        return result.map(|()| ExitCode::SUCCESS);
    }
    if sections.iter().any(|s| OWN_SECTIONS.contains(s)) {
        bail!("--sections: run {} on their own", OWN_SECTIONS.join(" and "));
    }
    let spec = args.str("model").unwrap_or("synthetic:qwen3.5-0.8b").to_string();
    let quants: Vec<String> = args.str("quant").unwrap_or(DEFAULT_FORMATS).split(',').map(|s| s.trim().to_string()).collect();
    for q in &quants {
        if !BENCH_FORMATS.contains(&q.as_str()) {
            bail!("--quant {q:?}: benchmark formats are {} (bf16 as stored; -fast: with the CPU engine's precision=fast)", BENCH_FORMATS.join(", "));
        }
    }
    let prompts: Vec<usize> = parse_list(args.str("prompts").unwrap_or(if quick { "13,74" } else { "13,74,410" }), "--prompts")?;
    let decode_tokens: usize = args.get("decode-tokens", if quick { 8 } else { 32 })?;
    let reps: usize = args.get("reps", if quick { 1 } else { 2 })?;
    let drift_tokens: usize = args.get("drift-tokens", if quick { 500 } else { 2000 })?;
    // A conversation of three 100-token replies per variant takes minutes on a small CPU.
    let conversations = if args.str("reps").is_some() { reps } else { 1 };
    if reps == 0 || decode_tokens == 0 || drift_tokens == 0 || prompts.is_empty() {
        bail!("--reps, --decode-tokens, --drift-tokens and --prompts must be positive");
    }
    let out_dir = std::path::PathBuf::from(args.str("out").unwrap_or("tandem-bench"));
    // Before any pinning: the cores this process may use.
    let allowed = tandem_core::backend::cpu::pool::allowed_cores();
    let pool = crate::make_pool(&args)?;
    let threads = pool.threads();
    let config = pipeline_config(&args, &allowed)?;
    started();

    let mut rec = Record::default();
    let steal_start = cpu_steal();
    progress("measuring the machine's limits");
    let bw_bytes = if quick { 256 << 20 } else { 1 << 30 };
    let bandwidth = limits::read_bandwidth(&pool, bw_bytes, if quick { 3 } else { 7 });
    let fma_peak = limits::fma_peak(&pool, if quick { 3 } else { 7 });
    let bf16_peak = limits::bf16_dot_peak(&pool, if quick { 3 } else { 7 });
    writeln!(rec.report, "# tandem bench\n")?;
    writeln!(rec.report, "## Machine\n")?;
    writeln!(rec.report, "| | |\n|---|---|")?;
    writeln!(rec.report, "| CPU | {} ({} logical cores) |", cpu_model(), allowed.len())?;
    writeln!(rec.report, "| memory | {} |", total_memory().map(|b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)).unwrap_or_else(|| "unknown".into()))?;
    writeln!(
        rec.report,
        "| engine threads (kernels section) | {threads}{} |",
        if pool.cores().is_empty() { String::new() } else { format!(" pinned to cores {:?}", pool.cores()) }
    )?;
    writeln!(rec.report, "| two-engine sections | prefill engine {}, decode engine {}, {} weights |", config.prefill, config.decode, quants[0])?;
    writeln!(rec.report, "| kernels | {} |", limits::isa())?;
    writeln!(rec.report, "| read bandwidth ({threads} threads, at the start) | {:.1} GB/s |", bandwidth / 1e9)?;
    writeln!(rec.report, "| f32 FMA peak ({threads} threads, at the start) | {:.1} GFLOP/s |", fma_peak / 1e9)?;
    match bf16_peak {
        Some(p) => writeln!(rec.report, "| bf16 dot peak ({threads} threads) | {:.1} GFLOP/s (the ceiling of a CPU engine's precision=fast) |", p / 1e9)?,
        None => writeln!(rec.report, "| bf16 dot peak | no AVX-512 BF16 on this CPU |")?,
    }
    writeln!(rec.report, "| GPUs | {} |", gpus())?;

    progress(&format!("loading {spec}"));
    let mut model = tandem_core::model::load::LoadedModel::load(&spec)?;
    // The kernels and placement sections run CPU engines, the others the configured ones.
    if sections.iter().any(|s| matches!(*s, "kernels" | "placement")) {
        model.net.copy_file_weights_into_huge_pages();
    } else {
        crate::place_weights_for(&mut model, &[&config.prefill, &config.decode]);
    }
    let mut samples = Vec::new();
    let chosen: Vec<&str> = SECTIONS.iter().copied().filter(|s| sections.contains(s)).collect();
    let mut result = Ok(());
    let mut quantized = false;
    for (i, &section) in chosen.iter().enumerate() {
        progress(&format!("section {}/{}: {section}", i + 1, chosen.len()));
        // The two-engine sections run the first format of --quant (the kernels section, which
        // compares them all, makes its own copies from the stored weights first).
        if let (false, false, (Some(quant), _)) = (section == "kernels", quantized, format_quant(&quants[0])?) {
            progress(&format!("quantizing to {} for the two-engine sections", quant.name()));
            model.net.quantize(quant, &pool);
            quantized = true;
        }
        result = match section {
            "kernels" => kernels(&mut rec, &mut samples, &model, &pool, &spec, &quants, &prompts, decode_tokens, reps, drift_tokens),
            "placement" => placement::section(&mut rec, &model, &config, &allowed, *prompts.iter().max().expect("prompts checked non-empty"), decode_tokens, reps, &spec),
            _ => pipeline_section(&mut rec, section, &model, &config, quick, reps, conversations, &spec),
        };
        if result.is_err() {
            break;
        }
    }
    if let (Some(a), Some(b)) = (steal_start, cpu_steal()) {
        let (steal, total) = (b.0 - a.0, b.1 - a.1);
        writeln!(rec.report, "\nCPU time taken by the hypervisor (steal) during this run: {:.0}%. Wall time of the run: {}.", 100.0 * steal as f64 / total.max(1) as f64, clock())?;
    }
    print!("{}", rec.report);
    let header = serde_json::json!({
        "tandem": env!("CARGO_PKG_VERSION"), "unix_time": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "model": spec, "quick": quick, "sections": chosen, "reps": reps,
        "cpu": cpu_model(), "logical_cores": allowed.len(), "memory_bytes": total_memory(),
        "kernels": limits::isa(), "kernel_threads": threads, "prefill_engine": config.prefill.to_string(), "decode_engine": config.decode.to_string(), "weights": quants,
        "read_bandwidth_bytes_per_s": bandwidth, "fma_peak_flops": fma_peak, "bf16_dot_peak_flops": bf16_peak,
        "complete": result.is_ok(),
    });
    rec.write(&out_dir, header)?;
    eprintln!("[bench] report, raw runs (runs.json) and plots written to {}/", out_dir.display());
    result.map(|()| ExitCode::SUCCESS)
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

/// Installed memory in bytes (MemTotal of /proc/meminfo).
fn total_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = info.lines().find(|l| l.starts_with("MemTotal:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The GPUs the CUDA driver reports, or why there are none.
fn gpus() -> String {
    match tandem_core::backend::cuda::gpu_names() {
        Ok(names) if names.is_empty() => "none".into(),
        Ok(names) => names.iter().enumerate().map(|(i, n)| format!("cuda:{i} {n}")).collect::<Vec<_>>().join(", "),
        Err(e) => format!("none ({e:#})"),
    }
}

static START: OnceLock<Instant> = OnceLock::new();

fn started() {
    START.get_or_init(Instant::now);
}

/// Time since the run started, as m:ss.
fn clock() -> String {
    let s = START.get_or_init(Instant::now).elapsed().as_secs();
    format!("{}:{:02}", s / 60, s % 60)
}

fn progress(msg: &str) {
    eprintln!("[bench {}] {msg}", clock());
}

/// A progress bar on stderr for the runs of one section: redrawn in place on a terminal, one
/// line when the section's runs are done otherwise (a log stays readable).
pub struct Bar {
    label: String,
    done: usize,
    total: usize,
    terminal: bool,
}

impl Bar {
    pub fn new(label: &str, total: usize) -> Bar {
        let bar = Bar { label: label.to_string(), done: 0, total, terminal: std::io::stderr().is_terminal() };
        if bar.terminal {
            bar.draw();
        }
        bar
    }

    pub fn tick(&mut self) {
        self.done += 1;
        if self.terminal || self.done == self.total {
            self.draw();
        }
    }

    fn draw(&self) {
        let width = 30;
        let filled = width * self.done.min(self.total) / self.total.max(1);
        let end = if self.done >= self.total { "\n" } else { "" };
        eprint!("\r[bench {}] {} [{}{}] {}/{} runs{end}", clock(), self.label, "#".repeat(filled), ".".repeat(width - filled), self.done, self.total);
    }
}

/// Prefill and decode rates of each weight format against the measured ceilings, int8 quality,
/// and peak memory.
#[allow(clippy::too_many_arguments)]
fn kernels(
    rec: &mut Record,
    samples: &mut Vec<Sample>,
    model: &tandem_core::model::load::LoadedModel,
    pool: &tandem_core::backend::cpu::pool::Pool,
    spec: &str,
    quants: &[String],
    prompts: &[usize],
    decode_tokens: usize,
    reps: usize,
    drift_tokens: usize,
) -> Result<()> {
    let threads = pool.threads();
    let mut nets: Vec<(String, Qwen35)> = Vec::new();
    for q in quants {
        let (quant, fast) = format_quant(q)?;
        // A fast format shares the weights of its exact one where that came first.
        let mut net = match nets.iter().find(|(n, _)| n.as_str() == q.trim_end_matches("-fast")) {
            Some((_, exact)) => exact.clone(),
            None => {
                let mut net = model.net.clone();
                if let Some(quant) = quant {
                    progress(&format!("quantizing to {}", quant.name()));
                    net.quantize(quant, pool);
                }
                net
            }
        };
        if fast {
            net.set_cpu_precision(tandem_core::backend::cpu::CpuPrecision::Fast);
        }
        nets.push((q.clone(), net));
    }
    // The fast precision's prefill ceilings: the dot products' peaks, where the CPU has them
    // (measured once, at the section's start).
    let bf16_dot = if quants.iter().any(|q| q == "bf16-fast") { limits::bf16_dot_peak(pool, 3) } else { None };
    let int8_dot = if quants.iter().any(|q| q == "int8-fast") { limits::int8_dot_peak(pool, 3) } else { None };
    // Where the kernels use AMX tiles, their peaks too: the ceiling of what runs there.
    let amx_bf16 = if quants.iter().any(|q| q == "bf16-fast") { limits::amx_bf16_peak(pool, 3) } else { None };
    let amx_int8 = if quants.iter().any(|q| q == "int8-fast") { limits::amx_int8_peak(pool, 3) } else { None };
    let vocab = model.sampleable_vocab();
    let prompt_of = |n: usize| -> Vec<u32> { (0..n).map(|i| ((i * 7919 + 17) % vocab) as u32).collect() };

    // Warm-up: page in the weights and the caches of each format.
    for (_, net) in &nets {
        let mut st = State::new(&net.config);
        net.forward(&pool, &prompt_of(8), &mut st, Logits::Last)?;
        net.decode_batch(&pool, &[1], &mut [&mut st])?;
    }
    let mut bar = Bar::new("kernels", reps * nets.len() * (prompts.len() + 1));
    // A format's decode ceiling: a plain read of as many bytes as its decode step reads, in one
    // pass after another as the steps read them. Against a fixed buffer the ceiling depends on
    // how much of it the last-level cache holds: on a Xeon with 300 MB of L3 a 256 MB read
    // measured 93-120 GB/s from run to run and a 1.5 GB decode step read faster than it.
    let decode_bytes: Vec<f64> = nets.iter().map(|(_, net)| decode_bytes_per_token(net, pool, decode_tokens)).collect::<Result<_>>()?;
    // One buffer for every read ceiling of the section: the prefills' 256 MB and each format's
    // decode bytes.
    const PREFILL_READ_BYTES: usize = 256 << 20;
    let read_buffer = limits::ReadBuffer::new(decode_bytes.iter().fold(PREFILL_READ_BYTES as f64, |m, &b| m.max(b)) as usize);
    // The ceilings again, just before each prefill run (about a quarter of a second).
    let ceilings = || (read_buffer.bandwidth(&pool, PREFILL_READ_BYTES, 2).best(), limits::fma_peak(&pool, 2));
    let (mut four_streams, mut sequential) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        for (f, (q, net)) in nets.iter().enumerate() {
            for &n in prompts {
                let (bandwidth, fma_peak) = ceilings();
                let prompt = prompt_of(n);
                let mut st = State::new(&net.config);
                let t = Instant::now();
                net.forward(&pool, &prompt, &mut st, Logits::Last)?;
                samples.push(Sample { quant: q.clone(), kind: "prefill", tokens: n, seconds: t.elapsed().as_secs_f64(), bandwidth, fma_peak });
                bar.tick();
            }
            // Decode: greedy tokens after a 13-token prompt (whose prefill is not timed).
            let mut st = State::new(&net.config);
            net.forward(&pool, &prompt_of(13), &mut st, Logits::Last)?;
            let fma_peak = limits::fma_peak(&pool, 2);
            let ceiling = || read_buffer.bandwidth(&pool, decode_bytes[f] as usize, 2);
            let before = ceiling();
            let t = Instant::now();
            greedy_steps(net, pool, &mut st, decode_tokens, vocab)?;
            let seconds = t.elapsed().as_secs_f64();
            // Before and after: the machine's bandwidth drifts under other tenants' load.
            let after = ceiling();
            let bandwidth = (before.best() + after.best()) / 2.0;
            four_streams.extend([before.four_streams, after.four_streams]);
            sequential.extend([before.sequential, after.sequential]);
            rec.run(
                "kernels",
                serde_json::json!({"weights": q, "phase": "decode ceiling", "bytes": decode_bytes[f],
                    "four_streams_bytes_per_s": [before.four_streams, after.four_streams], "sequential_bytes_per_s": [before.sequential, after.sequential]}),
            );
            samples.push(Sample { quant: q.clone(), kind: "decode", tokens: decode_tokens, seconds, bandwidth, fma_peak });
            bar.tick();
        }
    }
    for s in samples.iter() {
        rec.run(
            "kernels",
            serde_json::json!({"weights": s.quant, "phase": s.kind, "tokens": s.tokens, "seconds": s.seconds, "threads": threads,
                "read_bandwidth_bytes_per_s": s.bandwidth, "fma_peak_flops": s.fma_peak}),
        );
    }

    let fma_ceiling = limits::median(&mut samples.iter().map(|s| s.fma_peak).collect::<Vec<_>>());
    let bandwidth_ceiling = limits::median(&mut samples.iter().filter(|s| s.kind == "prefill").map(|s| s.bandwidth).collect::<Vec<_>>());
    writeln!(
        rec.report,
        "\nCeilings during the runs (median of the measurements before each run): read bandwidth {:.1} GB/s (256 MB), f32 FMA peak {:.1} GFLOP/s.",
        bandwidth_ceiling / 1e9,
        fma_ceiling / 1e9
    )?;
    writeln!(rec.report, "\n## Prefill ({spec}, {threads} threads, median of {reps} after a warm-up)\n")?;
    writeln!(rec.report, "| weights | prompt tokens | tok/s (median) | min - max | GFLOP/token | GFLOP/s | of FMA peak | ceiling tok/s |")?;
    writeln!(rec.report, "|---|---|---|---|---|---|---|---|")?;
    for (q, net) in &nets {
        for &n in prompts {
            let runs: Vec<&Sample> = samples.iter().filter(|s| &s.quant == q && s.kind == "prefill" && s.tokens == n).collect();
            let flops_per_token = net.prefill_flops(n) / n as f64;
            let (med, lo, hi) = stats(&mut runs.iter().map(|s| n as f64 / s.seconds).collect::<Vec<_>>());
            // A fast row against the dot products' peak (measured once, at the section's start).
            let (peak, of) = match (q.as_str(), bf16_dot, int8_dot) {
                ("bf16-fast", Some(p), _) => (p, " of bf16 dot peak"),
                ("int8-fast", _, Some(p)) => (p, " of int8 dot peak"),
                _ => (fma_ceiling, ""),
            };
            let fraction = med * flops_per_token / peak;
            let ceiling = peak / flops_per_token;
            let tiles = match (q.as_str(), amx_bf16, amx_int8) {
                ("bf16-fast", Some(p), _) | ("int8-fast", _, Some(p)) => format!(" ({:.0}% of AMX peak)", 100.0 * med * flops_per_token / p),
                _ => String::new(),
            };
            writeln!(
                rec.report,
                "| {q} | {n} | {med:.1} | {lo:.1} - {hi:.1} | {:.2} | {:.1} | {:.0}%{of}{tiles} | {ceiling:.1} |",
                flops_per_token / 1e9,
                med * flops_per_token / 1e9,
                100.0 * fraction,
            )?;
        }
    }
    writeln!(rec.report, "\n## Decode ({spec}, one sequence, {decode_tokens} tokens after a 13-token prompt)\n")?;
    writeln!(rec.report, "| weights | tok/s (median) | min - max | MB read/token | GB/s | read ceiling GB/s | of ceiling | ceiling tok/s |")?;
    writeln!(rec.report, "|---|---|---|---|---|---|---|---|")?;
    for (f, (q, _)) in nets.iter().enumerate() {
        let runs: Vec<&Sample> = samples.iter().filter(|s| &s.quant == q && s.kind == "decode").collect();
        let bytes = decode_bytes[f];
        let (med, lo, hi) = stats(&mut runs.iter().map(|s| s.tokens as f64 / s.seconds).collect::<Vec<_>>());
        let ceiling = limits::median(&mut runs.iter().map(|s| s.bandwidth).collect::<Vec<_>>());
        writeln!(
            rec.report,
            "| {q} | {med:.2} | {lo:.2} - {hi:.2} | {:.0} | {:.1} | {:.1} | {:.0}% | {:.1} |",
            bytes / 1e6,
            med * bytes / 1e9,
            ceiling / 1e9,
            100.0 * med * bytes / ceiling,
            ceiling / bytes,
        )?;
    }
    let ways = (limits::median(&mut four_streams), limits::median(&mut sequential));
    writeln!(
        rec.report,
        "\nA format's read ceiling: a plain read of as many bytes as its decode step reads (weights and state), pass after pass as the steps read them, from a buffer in 2 MB pages where the kernel gives them (as the weights tandem lays out are), measured before and after each of its decode runs (median of the runs' means), the faster of two ways of reading: four distant streams prefetched into L2 ({:.1} GB/s, median) and one sequential stream ({:.1} GB/s).",
        ways.0 / 1e9,
        ways.1 / 1e9
    )?;

    // Where one prefill of the longest prompt spends its time, phase by phase, per format.
    let longest = prompts.iter().copied().max().unwrap_or(410);
    progress("a prefill's phases");
    let mut prefills = Vec::new();
    for (q, net) in &nets {
        let mut st = State::new(&net.config);
        let phases = timed_phases(|| net.forward(pool, &prompt_of(longest), &mut st, Logits::Last).map(drop))?;
        for (p, d) in &phases.taken {
            rec.run("prefill_phases", serde_json::json!({"weights": q, "tokens": longest, "threads": threads, "phase": p.name(), "seconds": d.as_secs_f64()}));
        }
        prefills.push(phases);
    }
    writeln!(rec.report, "\n## Where a {longest}-token prefill's time goes ({spec}, {threads} threads, one run each)\n")?;
    phase_table(rec, &nets, &prefills, "whole prefill", 1)?;

    // Where a decode step's time goes: the products' and the LM head's own read rates, against
    // the formats' read ceilings above, say how much of a step is reading weights.
    progress("a decode step's phases");
    let mut steps = Vec::new();
    for (q, net) in &nets {
        let mut st = State::new(&net.config);
        net.forward(pool, &prompt_of(13), &mut st, Logits::Last)?;
        let phases = timed_phases(|| greedy_steps(net, pool, &mut st, decode_tokens, vocab))?;
        for (p, d) in &phases.taken {
            rec.run("decode_phases", serde_json::json!({"weights": q, "steps": decode_tokens, "threads": threads, "phase": p.name(), "seconds": d.as_secs_f64()}));
        }
        steps.push(phases);
    }
    writeln!(rec.report, "\n## Where a decode step's time goes ({spec}, {threads} threads, the mean of {decode_tokens} steps after a 13-token prompt)\n")?;
    phase_table(rec, &nets, &steps, "whole step", decode_tokens)?;
    {
        use tandem_core::backend::cpu::profile::Phase;
        // A phase's bytes over its time in every step (`taken` is in the phases' order).
        let row = |name: &str, bytes: &dyn Fn(&Qwen35) -> usize, phase: Phase| {
            let rates = nets.iter().zip(&steps).map(|((_, net), p)| format!("{:.1} GB/s", (bytes(net) * decode_tokens) as f64 / p.taken[phase as usize].1.as_secs_f64() / 1e9));
            format!("| {name} | {} |", rates.collect::<Vec<_>>().join(" | "))
        };
        writeln!(rec.report, "{}", row("layer products read at", &|n| n.weight_bytes_per_token() - n.lm_head_bytes(), Phase::Products))?;
        writeln!(rec.report, "{}", row("LM head read at", &|n| n.lm_head_bytes(), Phase::LmHead))?;
    }
    writeln!(
        rec.report,
        "\nA decode step's DeltaNet conv and norms run inside the recurrence's tasks (one per key head) and are timed with it. The read rates: the bytes of the layers' matrices and of the LM head over their phases' times, to set beside the read ceilings above."
    )?;

    if let Some(p) = bf16_dot {
        writeln!(rec.report, "\nbf16 dot peak ({threads} threads, at the section's start): {:.1} GFLOP/s, the ceiling of the bf16-fast rows.", p / 1e9)?;
    }
    if let Some(p) = int8_dot {
        writeln!(rec.report, "\nint8 dot peak ({threads} threads, at the section's start): {:.1} GOP/s, the ceiling of the int8-fast rows.", p / 1e9)?;
    }
    for (name, unit, peak) in [("AMX bf16", "GFLOP/s", amx_bf16), ("AMX int8", "GOP/s", amx_int8)] {
        if let Some(p) = peak {
            writeln!(rec.report, "\n{name} tile peak ({threads} threads, at the section's start): {:.1} {unit}; the fast rows run their products on the tiles here, so their fraction of it is shown beside the dot peak's.", p / 1e9)?;
        }
    }
    quality_tables(rec, pool, &nets, spec, &prompt_of(133), vocab)?;

    // Each fast format against the exact arithmetic on the same weights: on a short and the
    // longest prompt, and the states' drift over `drift_tokens` tokens.
    for (fast_q, fast) in nets.iter().filter(|(q, _)| q.ends_with("-fast")) {
        let exact_q = fast_q.trim_end_matches("-fast");
        let Some((_, exact)) = nets.iter().find(|(q, _)| q == exact_q) else { continue };
        progress(&format!("{fast_q} quality against the exact arithmetic"));
        writeln!(rec.report, "\n## {fast_q} against {exact_q}'s exact arithmetic ({spec}, 16 greedy tokens after each prompt)\n")?;
        writeln!(rec.report, "| prompt | positions | top-1 agreement | largest logit difference | greedy ids identical |")?;
        writeln!(rec.report, "|---|---|---|---|---|")?;
        let mut lengths = vec![133.min(longest), longest];
        lengths.dedup();
        for n in lengths {
            let row = crate::quality::compare(pool, exact, fast, "random ids", &prompt_of(n), 16, vocab)?;
            writeln!(rec.report, "{row}")?;
            rec.run("fast_quality", serde_json::json!({"weights": fast_q, "tokens": n, "top1_agree": row.top1_agree, "max_logit_diff": row.max_logit_diff, "greedy_identical": row.greedy_identical, "greedy_total": row.greedy_total}));
        }
        let every = (drift_tokens / 8).max(1);
        writeln!(rec.report, "\nThe states apart as the tokens accumulate ({drift_tokens} random ids fed to both in pieces of {every}):\n")?;
        writeln!(rec.report, "| tokens | recurrent state: largest error / largest value | keys and values: the same | last logits: largest difference | same top-1 |")?;
        writeln!(rec.report, "|---|---|---|---|---|")?;
        for row in crate::quality::drift(pool, exact, fast, &prompt_of(drift_tokens), every, vocab)? {
            writeln!(rec.report, "{row}")?;
            rec.run("fast_drift", serde_json::json!({"weights": fast_q, "tokens": row.tokens, "recurrent_rel": row.recurrent, "kv_rel": row.kv, "max_logit_diff": row.logits, "top1_same": row.top1_same}));
        }
    }

    progress("peak memory (a generate run per format in a child process)");
    // The longest prompt of the run (410 in a full run).
    let memory_prompt = longest;
    writeln!(rec.report, "\n## Memory (`tandem generate` of a {memory_prompt}-token prompt + 8 tokens, each format in its own process)\n")?;
    writeln!(rec.report, "| weights | weights held | state | peak RSS | peak / (weights + state) |")?;
    writeln!(rec.report, "|---|---|---|---|---|")?;
    // A fast format holds what its exact one holds.
    for (q, net) in nets.iter().filter(|(q, _)| !q.ends_with("-fast")) {
        let ids: Vec<String> = prompt_of(memory_prompt).iter().map(|i| i.to_string()).collect();
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["generate", "--model", &spec, "--token-ids", &ids.join(","), "--max-tokens", "8", "--ids-out", "--threads", &threads.to_string()]);
        if let (Some(quant), _) = format_quant(q)? {
            cmd.args(["--quant", &quant.name()]);
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
        net.forward(&pool, &prompt_of(memory_prompt + 8), &mut st, Logits::Last)?;
        let (w, s) = (net.weight_bytes() as f64 / 1e9, st.bytes() as f64 / 1e9);
        writeln!(rec.report, "| {q} | {w:.2} GB | {:.0} MB | {peak_gb:.2} GB | {:.2} |", s * 1e3, peak_gb / (w + s))?;
        rec.run("memory", serde_json::json!({"weights": q, "prompt_tokens": memory_prompt, "generated": 8, "weight_gb": w, "state_gb": s, "peak_rss_gb": peak_gb}));
    }
    Ok(())
}

/// The quality table: each quantized format of `nets` against the stored weights (the
/// bf16 row), on a 133-token prompt of the model; then every `--quant` format on the golden
/// fixture's prompts (the checkpoint of tests/fixtures, where this tree has it), against its
/// stored weights.
fn quality_tables(rec: &mut Record, pool: &tandem_core::backend::cpu::pool::Pool, nets: &[(String, Qwen35)], spec: &str, prompt: &[u32], vocab: usize) -> Result<()> {
    use tandem_core::model::quant::Quant;
    let header = |rec: &mut Record| -> Result<()> {
        writeln!(rec.report, "| weights | matrices | prompt | positions | top-1 agreement | largest logit difference | greedy ids identical |")?;
        writeln!(rec.report, "|---|---|---|---|---|---|---|")?;
        Ok(())
    };
    // The k-quants' fast rows too: their decode takes int8 inputs (W4A8), a quantization of its own.
    let quantized: Vec<&(String, Qwen35)> = nets.iter().filter(|(q, _)| q != "bf16" && (!q.ends_with("-fast") || q.starts_with('q'))).collect();
    if let (Some((_, stored)), false) = (nets.iter().find(|(q, _)| q == "bf16"), quantized.is_empty()) {
        progress("quality of each format against the stored weights");
        writeln!(rec.report, "\n## Each format against the stored weights ({spec}, a {}-token prompt, 16 greedy tokens)\n", prompt.len())?;
        header(rec)?;
        for (q, net) in quantized {
            let row = crate::quality::compare(pool, stored, net, "random ids", prompt, 16, vocab)?;
            writeln!(rec.report, "| {q} | {} | {}", net.matrix_formats(), row.to_string().trim_start_matches('|').trim_start())?;
            rec.run("quality", serde_json::json!({"model": spec, "weights": q, "tokens": row.positions, "top1_agree": row.top1_agree, "max_logit_diff": row.max_logit_diff, "greedy_identical": row.greedy_identical, "greedy_total": row.greedy_total}));
        }
    }
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
    if !fixture.join("reference.safetensors").exists() {
        return Ok(());
    }
    progress("quality of each format on the golden fixture");
    writeln!(rec.report, "\n## Each format against the stored weights on the golden fixture (tests/fixtures/qwen35-tiny, its reference's prompts)\n")?;
    writeln!(
        rec.report,
        "The fixture's rows are 128 and 256 values long: the k-quants take the matrices whose rows are whole 256-value blocks, Q8_0 the others (the matrices column says which).\n"
    )?;
    header(rec)?;
    let dir = fixture.to_string_lossy().to_string();
    for name in Quant::NAMES {
        let quant = Quant::parse(name)?;
        let mut net = tandem_core::model::load::LoadedModel::load(&dir)?.net;
        net.quantize(quant, pool);
        for row in crate::quality::quantized_vs_stored(pool, &dir, quant, &fixture.join("reference.safetensors"))? {
            writeln!(rec.report, "| {name} | {} | {}", net.matrix_formats(), row.to_string().trim_start_matches('|').trim_start())?;
            rec.run("quality", serde_json::json!({"model": "tests/fixtures/qwen35-tiny", "weights": name, "prompt": row.prompt, "tokens": row.positions, "top1_agree": row.top1_agree, "max_logit_diff": row.max_logit_diff, "greedy_identical": row.greedy_identical, "greedy_total": row.greedy_total}));
        }
    }
    Ok(())
}

/// `steps` greedy decode steps of one sequence from `st` (the argmax over the sampleable
/// `vocab`).
fn greedy_steps(net: &Qwen35, pool: &tandem_core::backend::cpu::pool::Pool, st: &mut State, steps: usize, vocab: usize) -> Result<()> {
    for _ in 0..steps {
        let id = argmax(&st.last_logits[..vocab.min(st.last_logits.len())]);
        net.decode_batch(pool, &[id], &mut [st])?;
    }
    Ok(())
}

/// The phases of some forward work (`profile`): each phase's time, the whole, and what no
/// phase timed.
struct PhaseTimes {
    taken: Vec<(tandem_core::backend::cpu::profile::Phase, Duration)>,
    total: Duration,
    rest: Duration,
}

/// Run `work` with the phase timers on.
fn timed_phases(work: impl FnOnce() -> Result<()>) -> Result<PhaseTimes> {
    use tandem_core::backend::cpu::profile;
    profile::enable(true);
    profile::take();
    let t = Instant::now();
    let done = work();
    let total = t.elapsed();
    let taken = profile::take();
    profile::enable(false);
    done?;
    let rest = total.saturating_sub(taken.iter().map(|(_, d)| *d).sum());
    Ok(PhaseTimes { taken, total, rest })
}

/// A table of each format's phases (a column per format), the times divided by `per`.
fn phase_table(rec: &mut Record, nets: &[(String, Qwen35)], runs: &[PhaseTimes], whole: &str, per: usize) -> Result<()> {
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / per as f64;
    let cell = |d: Duration, total: Duration| format!("{:.2} ms ({:.0}%)", ms(d), 100.0 * d.as_secs_f64() / total.as_secs_f64());
    writeln!(rec.report, "| phase | {} |", nets.iter().map(|(q, _)| q.as_str()).collect::<Vec<_>>().join(" | "))?;
    writeln!(rec.report, "|---|{}", "---|".repeat(nets.len()))?;
    for (i, p) in tandem_core::backend::cpu::profile::PHASES.iter().enumerate() {
        writeln!(rec.report, "| {} | {} |", p.name(), runs.iter().map(|r| cell(r.taken[i].1, r.total)).collect::<Vec<_>>().join(" | "))?;
    }
    writeln!(rec.report, "| the rest (buffers, between phases) | {} |", runs.iter().map(|r| cell(r.rest, r.total)).collect::<Vec<_>>().join(" | "))?;
    writeln!(rec.report, "| {whole} | {} |", runs.iter().map(|r| format!("{:.2} ms", ms(r.total))).collect::<Vec<_>>().join(" | "))?;
    Ok(())
}

/// What a one-sequence decode step after a 13-token prompt reads per token over
/// `decode_tokens` tokens: the weights it streams and the state at the middle of the span.
fn decode_bytes_per_token(net: &Qwen35, pool: &tandem_core::backend::cpu::pool::Pool, decode_tokens: usize) -> Result<f64> {
    let mut st = State::new(&net.config);
    net.forward(pool, &pipeline::prompt_of(13 + decode_tokens / 2, net.config.vocab_size), &mut st, Logits::Last)?;
    Ok((net.weight_bytes_per_token() + st.bytes()) as f64)
}

/// The engines of the two-engine sections: `--prefill`/`--decode` (default: prefill on the
/// first core this process may use, decode on the second, or both on one thread where it may
/// use one), hybrid, moving the state.
fn pipeline_config(args: &Args, allowed: &[usize]) -> Result<tandem_core::pipeline::PipelineConfig> {
    use tandem_core::engine::EngineSpec;
    use tandem_core::bridge::Transfer;
    use tandem_core::pipeline::{KvBudget, Mode, PipelineConfig};
    // By default the first two cores this process may use, one engine on each.
    let (p, d) = match allowed {
        [a, b, ..] => (format!("cpu:cores={a}"), format!("cpu:cores={b}")),
        _ => ("cpu:threads=1".to_string(), "cpu:threads=1".to_string()),
    };
    Ok(PipelineConfig {
        mode: Mode::Hybrid,
        prefill: EngineSpec::parse(args.str("prefill").unwrap_or(&p)).context("--prefill")?,
        decode: EngineSpec::parse(args.str("decode").unwrap_or(&d)).context("--decode")?,
        transfer: Transfer::Move,
        max_batch: 8,
        max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS,
        kv_cache: KvBudget::Unlimited,
        trace: None,
        prefix_cache_device: 0,
        device_snapshots: false,
    })
}

/// One of the two-engine sections (the study's tables), full or `--quick`.
#[allow(clippy::too_many_arguments)]
fn pipeline_section(rec: &mut Record, section: &str, model: &tandem_core::model::load::LoadedModel, config: &tandem_core::pipeline::PipelineConfig, quick: bool, reps: usize, conversations: usize, spec: &str) -> Result<()> {
    match section {
        "modes" => {
            let prompts: &[usize] = if quick { &[13, 74] } else { &[13, 28, 74, 6, 133, 410] };
            study::modes(rec, model, config, prompts, 8, reps, spec)
        }
        "dispatch" => study::dispatch(rec, model, &config.prefill, 74, if quick { 1 } else { reps }, spec),
        "transfer" => pipeline::transfer(rec, model, &config.decode, &[74, 410], if quick { 3 } else { 5 }, spec),
        // --quick: two turns, replies of 16 tokens, and the typing fed 12 words at a time (else
        // 6: each update costs prefill passes over the weights on one core, ~0.5 s here).
        "multiturn" => {
            let (turns, reply, words_per_update) = if quick { (2, 16, 12) } else { (3, 100, 6) };
            pipeline::multiturn(rec, model, config, turns, 74, reply, words_per_update, conversations, spec)
        }
        "concurrency" => pipeline::concurrency(rec, model, config, &[1, 2, 4, 8], 13, 8, reps, spec),
        "crossover" => {
            let lengths: &[usize] = if quick { &[8, 64, 256] } else { &[8, 32, 128, 512, 2048] };
            study::crossover(rec, model, config, lengths, reps, spec)
        }
        "energy" => energy::section(rec, model, config, if quick { 74 } else { 410 }, spec),
        _ => unreachable!("sections are checked against SECTIONS"),
    }
}
