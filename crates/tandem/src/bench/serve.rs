//! `tandem bench --sections serve`: `tandem serve` under load, measured as serving engines are
//! measured (in the manner of `vllm bench serve`). The section starts the real server as a
//! child process on a loopback port, drives it with the load generator (`load.rs`): random-token
//! prompts of a fixed length with `ignore_eos`, a sweep of concurrencies and one of Poisson
//! request rates. Each point reports output and total tok/s, TTFT and ITL percentiles, goodput
//! under the stated SLO, the GPU's memory in use, and its physical limit: the tokens per second
//! that the decode engine's memory bandwidth allows when every step reads the weights plus each
//! running sequence's state and KV, with the prefills' arithmetic at the prefill engine's rate
//! (both measured in the same run, before the server starts).
//! After each point the server's sequence slots must all be free again.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tandem_core::backend::cuda::Gpu;
use tandem_core::engine::Device;
use tandem_core::pipeline::Mode;

use super::load::{self, percentile, Arrivals, Outcome, Workload};
use super::nvml::NvmlDevice;
use super::pipeline::on_own_thread;
use super::{limits, progress};
use crate::args::{pipeline_config, Args, ENGINE_OPTIONS};

/// How long a server may take to start listening (loading a 9B checkpoint and compiling kernels).
const START_TIMEOUT: Duration = Duration::from_secs(900);

/// What the section runs.
pub struct Options {
    pub model: String,
    pub input_len: usize,
    pub output_len: usize,
    pub concurrency: Vec<usize>,
    /// Poisson request rates per second.
    pub rates: Vec<f64>,
    /// Requests per point (None: two per client at a concurrency, 15 s of arrivals at a rate).
    pub requests: Option<usize>,
    pub max_concurrent: usize,
    pub temperature: f64,
    pub top_k: usize,
    pub top_p: f64,
    /// The SLO a request must meet to count toward goodput: its TTFT and its mean time per
    /// output token, in seconds.
    pub slo_ttft: f64,
    pub slo_tpot: f64,
}

impl Options {
    pub fn parse(args: &Args, quick: bool) -> Result<Options> {
        let list = |name: &str, default: &str| -> Result<Vec<f64>> {
            args.str(name).unwrap_or(default).split(',').map(str::trim).filter(|s| !s.is_empty()).map(|s| s.parse::<f64>().ok().filter(|v| *v > 0.0 && v.is_finite()).with_context(|| format!("--{name}: {s:?} is not a positive number"))).collect()
        };
        let concurrency: Vec<usize> = list("concurrency", if quick { "1,4" } else { "1,8,32,64,128,256" })?.into_iter().map(|c| c as usize).collect();
        let rates = if args.str("rates") == Some("none") { Vec::new() } else { list("rates", if quick { "" } else { "4,16,64" })? };
        let o = Options {
            model: args.str("model").unwrap_or("synthetic:qwen3.5-0.8b").to_string(),
            input_len: args.get("input-len", if quick { 64 } else { 512 })?,
            output_len: args.get("output-len", if quick { 16 } else { 128 })?,
            max_concurrent: args.get("max-concurrent", concurrency.iter().copied().max().unwrap_or(1))?,
            requests: args.str("requests").map(|_| args.get("requests", 0)).transpose()?,
            concurrency,
            rates,
            temperature: args.get("temperature", 0.0)?,
            top_k: args.get("top-k", 0)?,
            top_p: args.get("top-p", 1.0)?,
            slo_ttft: args.get("slo-ttft-ms", 1000.0)? / 1e3,
            slo_tpot: args.get("slo-tpot-ms", 50.0)? / 1e3,
        };
        if !(o.top_p > 0.0 && o.top_p <= 1.0) {
            bail!("--top-p {}: give a fraction above 0 and at most 1", o.top_p);
        }
        if o.input_len == 0 || o.output_len == 0 || o.max_concurrent == 0 || o.requests == Some(0) {
            bail!("--input-len, --output-len, --max-concurrent and --requests must be at least 1");
        }
        if o.concurrency.contains(&0) || (o.concurrency.is_empty() && o.rates.is_empty()) {
            bail!("--concurrency: give whole numbers of 1 or more (and --rates, or none)");
        }
        Ok(o)
    }
}

/// The server under test: a `tandem serve` child process.
pub(super) struct Server {
    child: Child,
    pub(super) addr: SocketAddr,
    /// What the server wrote to stderr, for the report of a failure.
    log: Arc<Mutex<Vec<String>>>,
    started_in: Duration,
}

impl Server {
    pub(super) fn start(args: &[String]) -> Result<Server> {
        let exe = std::env::current_exe().context("finding the tandem executable")?;
        let started = Instant::now();
        let mut child = Command::new(&exe).arg("serve").args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().with_context(|| format!("starting {} serve", exe.display()))?;
        let stderr = child.stderr.take().expect("piped");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let lines = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("listening on http://") {
                    let _ = tx.send(addr.trim().to_string());
                }
                lines.lock().expect("log lock").push(line);
            }
        });
        let mut server = Server { child, addr: SocketAddr::from(([127, 0, 0, 1], 0)), log, started_in: Duration::ZERO };
        let addr = loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(a) => break a,
                Err(mpsc::RecvTimeoutError::Timeout) if started.elapsed() < START_TIMEOUT => {
                    if let Some(status) = server.child.try_wait()? {
                        bail!("the server exited ({status}) before listening:\n{}", server.log_tail());
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = server.child.wait()?;
                    bail!("the server exited ({status}) before listening:\n{}", server.log_tail())
                }
                Err(_) => bail!("the server did not start listening within {} s:\n{}", START_TIMEOUT.as_secs(), server.log_tail()),
            }
        };
        server.addr = addr.parse().with_context(|| format!("the server's address {addr:?}"))?;
        server.started_in = started.elapsed();
        Ok(server)
    }

    pub(super) fn log_tail(&self) -> String {
        let log = self.log.lock().expect("log lock");
        log[log.len().saturating_sub(20)..].join("\n")
    }

    /// The server's start-up line (engines, slots, capacity).
    pub(super) fn banner(&self) -> String {
        self.log.lock().expect("log lock").iter().find(|l| l.starts_with("tandem serve:")).cloned().unwrap_or_default()
    }

    /// Stop with SIGTERM (the server finishes what is in flight), killing it if it lingers.
    pub(super) fn stop(mut self) -> Result<()> {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return if status.success() { Ok(()) } else { bail!("the server exited with {status}:\n{}", self.log_tail()) };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        bail!("the server did not stop within 30 s of SIGTERM and was killed")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A gauge's value from a Prometheus text page.
pub(super) fn gauge(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

/// The facts of the served model that a point's physical limit needs (from `/metrics`).
struct Served {
    weight_bytes: f64,
    state_bytes: f64,
    kv_bytes_per_token: f64,
    prefill_flops_per_token: f64,
    vocab: usize,
    slots: usize,
}

/// The limits of the engines that serve, measured before the server starts.
struct Limits {
    decoder: String,
    /// The decode engine's memory bandwidth, bytes/s.
    bandwidth: f64,
    prefiller: String,
    /// The prefill engine's rate for its projections, FLOP/s: a CUDA engine's bf16 GEMM on
    /// tensor cores (cuBLAS), a CPU engine's f32 FMAs on its workers.
    prefill_peak: f64,
    /// What `prefill_peak` measured.
    prefill_rate: String,
    /// Whether one device both prefills and decodes (their times add up) or two work side by
    /// side (the slower one bounds).
    shared: bool,
    nvml: Option<Arc<NvmlDevice>>,
}

impl Limits {
    fn measure(args: &Args) -> Result<Limits> {
        let config = pipeline_config(args)?;
        let (prefill, decode) = match config.mode {
            Mode::AllOnPrefillEngine => (&config.prefill, &config.prefill),
            Mode::AllOnDecodeEngine => (&config.decode, &config.decode),
            Mode::Hybrid => (&config.prefill, &config.decode),
        };
        // CPU engines share their cores unless both were given disjoint ones.
        let shared = match (prefill.device, decode.device, &prefill.cores, &decode.cores) {
            (Device::Cpu, Device::Cpu, Some(a), Some(b)) => a.iter().any(|c| b.contains(c)),
            (a, b, _, _) => a == b,
        };
        let (decoder, bandwidth, nvml) = match decode.device {
            Device::Cuda(n) => {
                let gpu = Gpu::open(n)?;
                let bandwidth = super::cuda::memory_bandwidth(&gpu, 5)?;
                let nvml = gpu.pci_bus_id().and_then(|id| NvmlDevice::open(&id)).ok().map(Arc::new);
                (format!("{decode} ({})", gpu.name), bandwidth, nvml)
            }
            Device::Cpu => (decode.to_string(), on_own_thread(decode, |pool| limits::read_bandwidth(pool, 1 << 30, 5))?, None),
        };
        let (prefiller, prefill_peak, prefill_rate) = match prefill.device {
            Device::Cuda(n) => {
                let gpu = Gpu::open(n)?;
                (format!("{prefill} ({})", gpu.name), super::cuda::tensor_core_peak(&gpu, 3)?, format!("a bf16 GEMM of {} cubed on tensor cores (cuBLAS)", super::cuda::PEAK_GEMM))
            }
            Device::Cpu => (prefill.to_string(), on_own_thread(prefill, |pool| limits::fma_peak(pool, 5))?, "f32 FMAs on its workers".to_string()),
        };
        Ok(Limits { decoder, bandwidth, prefiller, prefill_peak, prefill_rate, shared, nvml })
    }
}

/// One load point's results.
struct Point {
    label: String,
    outcomes: Vec<Outcome>,
    seconds: f64,
    peak_gpu_memory: Option<u64>,
    /// Sequence slots free once the point's requests were answered, of all.
    slots_free_after: (usize, usize),
    /// The decode engine's K/V cache blocks in use before the point and once its requests were
    /// answered (a GPU engine's), and the sequences swapped out to host memory meanwhile.
    kv_blocks: (Option<usize>, Option<usize>),
    /// Its state slots in use, the same two times.
    state_slots: (Option<usize>, Option<usize>),
    swaps: u64,
    /// Seconds the server's engines spent in their prefill and decode calls during the point
    /// (`tandem_engine_busy_seconds_total`; two engines on one GPU may both be busy at once).
    busy: (f64, f64),
}

/// The server's `/metrics` page.
pub(super) fn metrics(rt: &tokio::runtime::Runtime, addr: SocketAddr) -> Result<String> {
    let (status, text) = rt.block_on(load::get(addr, "/metrics"))?;
    if status != 200 {
        bail!("GET /metrics answered {status}");
    }
    Ok(text)
}

impl Served {
    fn read(metrics: &str) -> Result<Served> {
        let fact = |name: &str| gauge(metrics, name).with_context(|| format!("the server's /metrics has no {name}"));
        Ok(Served {
            weight_bytes: fact("tandem_model_decode_weight_bytes")?,
            state_bytes: fact("tandem_model_state_bytes")?,
            kv_bytes_per_token: fact("tandem_model_kv_bytes_per_token")?,
            prefill_flops_per_token: fact("tandem_model_prefill_flops_per_token")?,
            vocab: fact("tandem_model_vocab_size")? as usize,
            slots: fact("tandem_sequence_slots")? as usize,
        })
    }
}

/// The arguments of the server under test: the model, a free loopback port, the slots, a
/// queue that refuses nothing, no conversation cache (random prompts share no prefix), and
/// the engine options as given.
fn server_args(o: &Options, args: &Args) -> Vec<String> {
    let mut v: Vec<String> = ["--model", &o.model, "--host", "127.0.0.1", "--port", "0", "--max-queue", "100000", "--session-memory", "0", "--prefix-cache-device-memory", "0"].map(String::from).to_vec();
    v.extend(["--max-concurrent".to_string(), o.max_concurrent.to_string()]);
    for name in ENGINE_OPTIONS.iter().filter(|n| **n != "max-batch") {
        if let Some(value) = args.str(name) {
            v.extend([format!("--{name}"), value.to_string()]);
        }
    }
    v
}

pub fn run(report: &mut String, args: &Args, quick: bool) -> Result<()> {
    let o = Options::parse(args, quick)?;
    if let Some(url) = args.str("url") {
        return run_against(report, &o, url);
    }
    progress("measuring the engines' limits");
    let limits = Limits::measure(args)?;
    let server_args = server_args(&o, args);
    progress(&format!("starting tandem serve {}", server_args.join(" ")));
    let server = Server::start(&server_args)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("starting the load generator's runtime")?;
    let first_metrics = metrics(&rt, server.addr)?;
    let served = Served::read(&first_metrics)?;
    writeln!(report, "## Serving under load ({})\n", o.model)?;
    writeln!(report, "| | |\n|---|---|")?;
    writeln!(report, "| server | `tandem serve {}` |", server_args.join(" "))?;
    writeln!(report, "| started | {} |", server.banner())?;
    writeln!(report, "| process start to listening | {:.1} s |", server.started_in.as_secs_f64())?;
    if let (Some(limit), Some(bytes)) = (gauge(&first_metrics, "tandem_kv_cache_blocks_limit"), gauge(&first_metrics, "tandem_kv_cache_block_bytes")) {
        let positions = limit as usize * tandem_core::backend::cuda::qwen35::kv_cache::KV_BLOCK;
        writeln!(report, "| decode engine's K/V cache (its limit at start-up) | {:.2} GiB: {limit:.0} blocks, {positions} positions |", limit * bytes / (1u64 << 30) as f64)?;
    }
    if let (Some(limit), Some(bytes)) = (gauge(&first_metrics, "tandem_state_slots_limit"), gauge(&first_metrics, "tandem_state_slot_bytes")) {
        writeln!(report, "| decode engine's state slots (their limit at start-up) | {limit:.0} of {:.1} MiB, {:.2} GiB |", bytes / (1 << 20) as f64, limit * bytes / (1u64 << 30) as f64)?;
    }
    writeln!(report, "| decode engine, memory bandwidth (measured before the server started) | {}, {:.0} GB/s |", limits.decoder, limits.bandwidth / 1e9)?;
    writeln!(report, "| prefill engine, its rate for the projections (measured before the server started) | {}: {:.2} TFLOP/s, {}{} |", limits.prefiller, limits.prefill_peak / 1e12, limits.prefill_rate, if limits.shared { "; the same device as the decode engine" } else { "" })?;
    writeln!(
        report,
        "| workload | {} random prompt tokens, {} output tokens (`ignore_eos`), temperature {}{}, streamed `/v1/completions` over loopback HTTP/1.1 |",
        o.input_len,
        o.output_len,
        o.temperature,
        match (o.top_k, o.top_p) {
            (0, p) if p >= 1.0 => String::new(),
            (k, p) => format!(" top-k {k} top-p {p}"),
        }
    )?;
    writeln!(report, "| SLO for goodput | TTFT <= {:.0} ms and mean time per output token <= {:.0} ms |", o.slo_ttft * 1e3, o.slo_tpot * 1e3)?;
    writeln!(
        report,
        "| bytes a decode step reads | {:.2} GB of weights + per running sequence {:.1} MB of state + {:.1} KB of K/V per token of context |",
        served.weight_bytes / 1e9,
        served.state_bytes / 1e6,
        served.kv_bytes_per_token / 1e3
    )?;
    let workload = |n: usize, seed: u64| Arc::new(Workload { addr: server.addr, model: o.model.clone(), prompts: Workload::random_prompts(n, o.input_len, served.vocab, seed), output_len: o.output_len, temperature: o.temperature, top_k: o.top_k, top_p: o.top_p });

    // Warm-up, not reported: the first requests of a process pay for lazily made buffers.
    let warm = o.max_concurrent.min(8);
    progress(&format!("warm-up: {} requests at concurrency {warm}", 2 * warm));
    let (outcomes, _) = rt.block_on(load::drive(workload(2 * warm, 1), Arrivals::Concurrency(warm)));
    if let Some(e) = outcomes.iter().find_map(|o| o.error.clone()) {
        bail!("a warm-up request failed: {e}\nserver log:\n{}", server.log_tail());
    }

    let mut loads: Vec<(String, Arrivals, usize)> = o.concurrency.iter().map(|&c| (format!("concurrency {c}"), Arrivals::Concurrency(c), o.requests.unwrap_or((2 * c).max(16)))).collect();
    for (i, &rate) in o.rates.iter().enumerate() {
        let n = o.requests.unwrap_or(((rate * 15.0).round() as usize).clamp(16, 4096));
        loads.push((format!("{rate} req/s (Poisson)"), Arrivals::Poisson { rate, seed: 1000 + i as u64 }, n));
    }
    let mut points = Vec::new();
    let count = loads.len();
    for (i, (label, arrivals, n)) in loads.into_iter().enumerate() {
        progress(&format!("load {}/{count}: {label}, {n} requests", i + 1));
        let point = run_point(&rt, &server, &served, limits.nvml.as_ref(), label, workload(n, 100 + i as u64), arrivals)?;
        points.push(point);
    }
    drop(rt);
    let stopped = server.stop();

    writeln!(report, "\nOne run per point, in the order listed. Percentiles over the requests of the point (ITL over every gap between text chunks). The decode limit assumes the decode engine only decodes: in flight x bandwidth / (weights + in flight x (state + K/V at {} tokens of context)), with in flight the mean number of requests being served (Little's law, at most the {} slots). The limit adds the prefills: a request's prompt takes its projections' operations at the prefill engine's measured rate ({:.3} GFLOP a token; attention, the delta rule and the LM head left out, so that the limit stays an upper bound) and its output its share of those steps; {}.\n", o.input_len + o.output_len / 2, served.slots, served.prefill_flops_per_token / 1e9, if limits.shared { "one device does both, so the two times add up" } else { "the two engines work side by side, so the slower one bounds" })?;
    writeln!(report, "Engines busy: the time the server's engines spent in their prefill calls and in their decode steps (waiting for the device included; sampling and bookkeeping between steps not), as a share of the point's time; two engines on one device can both be busy at once.\n")?;
    writeln!(report, "| load | requests | failed | s | output tok/s | total tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms | goodput tok/s (requests in SLO) | in flight | decode limit output tok/s | limit output tok/s | of limit | GPU memory GiB | slots free after | K/V blocks in use before / after | state slots in use before / after | swapped out | engines busy: prefill / decode |")?;
    writeln!(report, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")?;
    for p in &points {
        writeln!(report, "{}", p.row(&o, &served, &limits))?;
    }
    for p in &points {
        let failed = p.outcomes.iter().filter(|o| o.error.is_some()).count();
        if let Some(e) = p.outcomes.iter().find_map(|o| o.error.as_deref()) {
            writeln!(report, "\n{}: {failed} requests failed; the first said: {e}", p.label)?;
        }
    }
    stopped
}

/// Drive one load point, sampling the GPU's memory in use meanwhile, then wait (up to 30 s)
/// for the server's slots to come back and read them.
#[allow(clippy::too_many_arguments)]
fn run_point(rt: &tokio::runtime::Runtime, server: &Server, served: &Served, nvml: Option<&Arc<NvmlDevice>>, label: String, workload: Arc<Workload>, arrivals: Arrivals) -> Result<Point> {
    let peak = Arc::new(Mutex::new(None::<u64>));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = nvml.map(|nvml| {
        let (nvml, peak, sampling) = (Arc::clone(nvml), Arc::clone(&peak), Arc::clone(&sampling));
        std::thread::spawn(move || {
            while sampling.load(Ordering::Relaxed) {
                if let Ok(used) = nvml.memory_used() {
                    let mut p = peak.lock().expect("peak lock");
                    *p = Some(p.unwrap_or(0).max(used));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    });
    let kv_used = |m: &str| gauge(m, "tandem_kv_cache_blocks_used").map(|v| v as usize);
    let slots_used = |m: &str| gauge(m, "tandem_state_slots_used").map(|v| v as usize);
    let swapped_out = |m: &str| gauge(m, "tandem_kv_cache_swaps_total{direction=\"out\"}").unwrap_or(0.0) as u64;
    let busy = |m: &str| ["prefill", "decode"].map(|w| gauge(m, &format!("tandem_engine_busy_seconds_total{{work=\"{w}\"}}")).unwrap_or(0.0));
    let before = metrics(rt, server.addr)?;
    let busy_before = busy(&before);
    let (kv_before, slots_before, swaps_before) = (kv_used(&before), slots_used(&before), swapped_out(&before));
    let (outcomes, seconds) = rt.block_on(load::drive(workload, arrivals));
    sampling.store(false, Ordering::Relaxed);
    if let Some(s) = sampler {
        let _ = s.join();
    }
    let settle = Instant::now();
    let (mut free, mut queued, mut kv_after, mut slots_after, mut swaps, mut busy_after) = (0, 0, None, None, 0, busy_before);
    while settle.elapsed() < Duration::from_secs(30) {
        let m = metrics(rt, server.addr)?;
        free = served.slots.saturating_sub(gauge(&m, "tandem_active_sequences").unwrap_or(f64::NAN) as usize);
        queued = gauge(&m, "tandem_queue_depth").unwrap_or(0.0) as usize;
        kv_after = kv_used(&m);
        slots_after = slots_used(&m);
        swaps = swapped_out(&m) - swaps_before;
        busy_after = busy(&m);
        if free == served.slots && queued == 0 && kv_after <= kv_before && slots_after <= slots_before {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let failed = outcomes.iter().filter(|o| o.error.is_some()).count();
    progress(&format!("{label}: {:.0} output tok/s, {failed} failed, {free}/{} slots free, {queued} queued", outcomes.iter().map(|o| o.output_tokens).sum::<usize>() as f64 / seconds, served.slots));
    let peak_gpu_memory = *peak.lock().expect("peak lock");
    Ok(Point { label, outcomes, seconds, peak_gpu_memory, slots_free_after: (free, served.slots), kv_blocks: (kv_before, kv_after), state_slots: (slots_before, slots_after), swaps, busy: (busy_after[0] - busy_before[0], busy_after[1] - busy_before[1]) })
}

impl Point {
    /// The point's row of the report's table.
    fn row(&self, o: &Options, served: &Served, limits: &Limits) -> String {
        let ok: Vec<&Outcome> = self.outcomes.iter().filter(|r| r.error.is_none()).collect();
        let failed = self.outcomes.len() - ok.len();
        let out_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
        let in_tokens: usize = ok.iter().map(|r| r.prompt_tokens).sum();
        let ttft: Vec<f64> = ok.iter().map(|r| r.ttft).collect();
        let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl.iter().copied()).collect();
        let tpot: Vec<f64> = ok.iter().map(|r| r.tpot()).collect();
        let in_slo: Vec<&&Outcome> = ok.iter().filter(|r| r.ttft <= o.slo_ttft && r.tpot() <= o.slo_tpot).collect();
        let good_tokens: usize = in_slo.iter().map(|r| r.output_tokens).sum();
        let in_flight = (self.outcomes.iter().map(|r| r.latency).sum::<f64>() / self.seconds).min(served.slots as f64);
        let context = (o.input_len + o.output_len / 2) as f64;
        let step_bytes = served.weight_bytes + in_flight * (served.state_bytes + served.kv_bytes_per_token * context);
        let decode_limit = in_flight * limits.bandwidth / step_bytes;
        // Seconds of each engine's work per request: its prompt's products, its share of steps.
        let prefill = o.input_len as f64 * served.prefill_flops_per_token / limits.prefill_peak;
        let decode = o.output_len as f64 / decode_limit;
        let limit = o.output_len as f64 / if limits.shared { prefill + decode } else { prefill.max(decode) };
        let out_rate = out_tokens as f64 / self.seconds;
        let ms = |v: &[f64], p: f64| 1e3 * percentile(v, p);
        // A workload of one output token has no gaps between tokens.
        let itl_cell = if itl.is_empty() { "- / -".to_string() } else { format!("{:.1} / {:.1}", ms(&itl, 50.0), ms(&itl, 99.0)) };
        let blocks = |b: Option<usize>| b.map_or("-".to_string(), |b| b.to_string());
        format!(
            "| {} | {} | {failed} | {:.1} | {out_rate:.0} | {:.0} | {:.0} / {:.0} | {itl_cell} | {:.1} | {:.0} ({}/{}) | {in_flight:.1} | {decode_limit:.0} | {limit:.0} | {:.0}% | {} | {}/{} | {} / {} | {} / {} | {} | {:.0}% / {:.0}% |",
            self.label,
            self.outcomes.len(),
            self.seconds,
            (in_tokens + out_tokens) as f64 / self.seconds,
            ms(&ttft, 50.0),
            ms(&ttft, 99.0),
            ms(&tpot, 50.0),
            good_tokens as f64 / self.seconds,
            in_slo.len(),
            ok.len(),
            100.0 * out_rate / limit,
            self.peak_gpu_memory.map_or("-".to_string(), |b| format!("{:.1}", b as f64 / (1u64 << 30) as f64)),
            self.slots_free_after.0,
            self.slots_free_after.1,
            blocks(self.kv_blocks.0),
            blocks(self.kv_blocks.1),
            blocks(self.state_slots.0),
            blocks(self.state_slots.1),
            self.swaps,
            100.0 * self.busy.0 / self.seconds,
            100.0 * self.busy.1 / self.seconds,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::gauge;

    #[test]
    fn gauges_are_read_by_their_whole_name() {
        let page = "# HELP tandem_sequence_slots x\n# TYPE tandem_sequence_slots gauge\ntandem_sequence_slots 8\ntandem_sequence_slots_extra 3\ntandem_model_state_bytes 2.5e7\n";
        assert_eq!(gauge(page, "tandem_sequence_slots"), Some(8.0));
        assert_eq!(gauge(page, "tandem_model_state_bytes"), Some(2.5e7));
        assert_eq!(gauge(page, "tandem_sequence"), None);
    }
}

/// `--url http://IP:PORT`: the same loads against a server already running there (a `tandem
/// serve`, or a router in front of prefill and decode workers), measured from outside: no
/// limits (its engines are not this process's to measure) and none of its engines' gauges.
fn run_against(report: &mut String, o: &Options, url: &str) -> Result<()> {
    let addr: SocketAddr = url.strip_prefix("http://").and_then(|a| a.trim_end_matches('/').parse().ok()).with_context(|| format!("--url {url:?}: give http://IP:PORT"))?;
    let vocab = tandem_core::model::load::LoadedModel::load(&o.model).with_context(|| format!("--model {}: the served model, for its vocabulary", o.model))?.sampleable_vocab();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("starting the load generator's runtime")?;
    writeln!(report, "## Serving under load ({}, at {url})\n", o.model)?;
    writeln!(report, "| | |\n|---|---|\n| server | {url}, started elsewhere |\n| workload | {} random prompt tokens, {} output tokens (`ignore_eos`), temperature {}, streamed `/v1/completions` |\n| SLO for goodput | TTFT <= {:.0} ms and mean time per output token <= {:.0} ms |", o.input_len, o.output_len, o.temperature, o.slo_ttft * 1e3, o.slo_tpot * 1e3)?;
    let workload = |n: usize, seed: u64| Arc::new(Workload { addr, model: o.model.clone(), prompts: Workload::random_prompts(n, o.input_len, vocab, seed), output_len: o.output_len, temperature: o.temperature, top_k: o.top_k, top_p: o.top_p });
    let warm = o.max_concurrent.min(8);
    progress(&format!("warm-up: {} requests at concurrency {warm}", 2 * warm));
    let (outcomes, _) = rt.block_on(load::drive(workload(2 * warm, 1), Arrivals::Concurrency(warm)));
    if let Some(e) = outcomes.iter().find_map(|o| o.error.clone()) {
        bail!("a warm-up request to {url} failed: {e}");
    }
    writeln!(report, "\n| load | requests | failed | s | output tok/s | total tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms | goodput tok/s (requests in SLO) |")?;
    writeln!(report, "|---|---|---|---|---|---|---|---|---|---|")?;
    let mut loads: Vec<(String, Arrivals, usize)> = o.concurrency.iter().map(|&c| (format!("concurrency {c}"), Arrivals::Concurrency(c), o.requests.unwrap_or((2 * c).max(16)))).collect();
    for (i, &rate) in o.rates.iter().enumerate() {
        loads.push((format!("{rate} req/s (Poisson)"), Arrivals::Poisson { rate, seed: 1000 + i as u64 }, o.requests.unwrap_or(((rate * 15.0).round() as usize).clamp(16, 4096))));
    }
    let count = loads.len();
    for (i, (label, arrivals, n)) in loads.into_iter().enumerate() {
        progress(&format!("load {}/{count}: {label}, {n} requests", i + 1));
        let (outcomes, seconds) = rt.block_on(load::drive(workload(n, 100 + i as u64), arrivals));
        let ok: Vec<&Outcome> = outcomes.iter().filter(|r| r.error.is_none()).collect();
        let ms = |v: &[f64], p: f64| if v.is_empty() { f64::NAN } else { 1e3 * percentile(v, p) };
        let ttft: Vec<f64> = ok.iter().map(|r| r.ttft).collect();
        let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl.iter().copied()).collect();
        let tpot: Vec<f64> = ok.iter().map(|r| r.tpot()).collect();
        let out: usize = ok.iter().map(|r| r.output_tokens).sum();
        let total: usize = out + ok.iter().map(|r| r.prompt_tokens).sum::<usize>();
        let in_slo: Vec<&&Outcome> = ok.iter().filter(|r| r.ttft <= o.slo_ttft && r.tpot() <= o.slo_tpot).collect();
        let good: usize = in_slo.iter().map(|r| r.output_tokens).sum();
        writeln!(
            report,
            "| {label} | {} | {} | {seconds:.1} | {:.0} | {:.0} | {:.0} / {:.0} | {:.1} / {:.1} | {:.1} | {:.0} ({}/{}) |",
            outcomes.len(),
            outcomes.len() - ok.len(),
            out as f64 / seconds,
            total as f64 / seconds,
            ms(&ttft, 50.0),
            ms(&ttft, 99.0),
            ms(&itl, 50.0),
            ms(&itl, 99.0),
            ms(&tpot, 50.0),
            good as f64 / seconds,
            in_slo.len(),
            ok.len()
        )?;
        if let Some(e) = outcomes.iter().find_map(|o| o.error.as_deref()) {
            writeln!(report, "\n{label}: the first failed request said: {e}\n")?;
        }
    }
    Ok(())
}
