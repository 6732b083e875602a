//! `tandem bench --sections disagg`: disaggregated serving, measured.
//!
//! 1. The state's transfer at several prompt lengths (410, 2048 and 8192 tokens by default):
//!    in process (move), a memcpy of its image (the floor of any copy), a new state file
//!    written and read back, the socket bridge to another process, and NIXL (UCX over TCP)
//!    into a slot another process reserved, each as time and GB/s of the image.
//! 2. End to end on the same engines: a single `tandem serve` (prefill engine `--prefill`,
//!    decode engine `--decode`) against a router with a prefill worker (one engine on
//!    `--prefill`) and a decode worker (on a GPU both engines, as the single server; on CPU
//!    cores one engine on `--decode`, prefilling what the router leaves it), with each prefill
//!    placement (local, remote, conditional), under a mixed load
//!    of short and long prompts: TTFT and ITL percentiles, output tok/s and goodput, and the
//!    states' transfers (mean time, size and bandwidth, from the router's counters). With the
//!    engines on two GPUs, two replicas behind the router (one per GPU) replace the local
//!    placement.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tandem_core::bridge;
use tandem_core::engine::{Device, EngineSpec};
use tandem_core::model::load::LoadedModel;
use tandem_core::state::State;

use super::load::{self, percentile, Arrivals, Outcome, Workload};
use super::nixl_peer::NixlPeer;
use super::pipeline::{on_engine, prompt_of, SocketPeer};
use super::serve::Server;
use super::{progress, stats};
use crate::args::Args;
use crate::ms;

pub fn run(report: &mut String, args: &Args, quick: bool) -> Result<()> {
    let spec = args.str("model").unwrap_or("synthetic:qwen3.5-0.8b").to_string();
    let lengths: Vec<usize> = super::parse_list(args.str("prompts").unwrap_or(if quick { "410,2048" } else { "410,2048,8192" }), "--prompts")?;
    let reps: usize = args.get("reps", if quick { 3 } else { 5 })?;
    let prefill = EngineSpec::parse(args.str("prefill").unwrap_or("cpu:cores=0"))?;
    let decode = EngineSpec::parse(args.str("decode").unwrap_or("cpu:cores=1"))?;
    if reps == 0 || lengths.is_empty() {
        bail!("--reps and --prompts must be positive");
    }
    writeln!(report, "| | |\n|---|---|\n| model | {spec} |\n| prefill engine | {prefill} |\n| decode engine | {decode} |")?;
    transfer(report, &spec, &prefill, &decode, &lengths, reps)?;
    end_to_end(report, args, &spec, &prefill, &decode, quick)
}

/// Part 1: each way a state crosses, at each length.
fn transfer(report: &mut String, spec: &str, engine: &EngineSpec, decode: &EngineSpec, lengths: &[usize], reps: usize) -> Result<()> {
    let model = LoadedModel::load(spec)?;
    let (fp, cfg) = (model.net.fingerprint(), model.net.config.clone());
    progress(&format!("prefilling states of {lengths:?} tokens"));
    let states: Vec<State> = lengths
        .iter()
        .map(|&n| {
            on_engine(engine, &model.net, |engine| {
                let mut state = engine.new_state()?;
                engine.prefill(&prompt_of(n, model.sampleable_vocab()), &mut state)?;
                state.into_host()
            })
        })
        .collect::<Result<_>>()?;
    let mut socket = SocketPeer::start(spec, fp)?;
    let mut nixl = NixlPeer::start(spec, fp);
    writeln!(report, "\n## State transfer between processes ({spec}; median of {reps}, min - max in brackets)\n")?;
    writeln!(report, "| prompt tokens | state image | transfer | time (ms) | GB/s | x memcpy |")?;
    writeln!(report, "|---|---|---|---|---|---|")?;
    let dir = bridge::file::default_dir();
    for state in &states {
        let n = state.position;
        let bytes = bridge::format::image_bytes(state);
        let mut rows: Vec<(&str, Vec<Duration>)> = vec![("memcpy of the image (one core, warm buffers)", vec![]), ("move (in process, another thread)", vec![]), ("file (new file in /dev/shm, read back)", vec![]), ("socket bridge (another process)", vec![])];
        if nixl.is_ok() {
            rows.push(("NIXL, UCX over TCP (another process)", vec![]));
        }
        let mut image = Vec::with_capacity(bytes);
        bridge::format::write_state(&mut image, state, fp)?;
        let mut copy = vec![0u8; bytes];
        copy.copy_from_slice(&image);
        let path = dir.join(format!("tandem-bench-disagg-{}.state", std::process::id()));
        // NIXL's one-sided write alone (of its row's total).
        let mut wire = Vec::new();
        // Interleaved: each round runs every transfer once.
        for _ in 0..reps {
            let t = Instant::now();
            copy.copy_from_slice(std::hint::black_box(&image));
            rows[0].1.push(t.elapsed());
            std::hint::black_box(&copy);

            let (tx, rx) = std::sync::mpsc::channel::<(State, Instant)>();
            let moved = std::thread::spawn(move || rx.recv().map(|(s, t)| (s, t.elapsed())));
            tx.send((state.clone(), Instant::now())).expect("the receiving thread waits");
            let (_, took) = moved.join().expect("the receiving thread")?;
            rows[1].1.push(took);

            let t = Instant::now();
            bridge::file::save(&path, state, fp)?;
            let (back, _, _) = bridge::file::load(&path, fp, &cfg, None)?;
            rows[2].1.push(t.elapsed());
            std::fs::remove_file(&path)?;
            if back != *state {
                bail!("the file bridge changed a {n}-token state");
            }

            let (s, r, b) = socket.send(state, fp)?;
            rows[3].1.push(s + r + b);
            if let Ok(peer) = &mut nixl {
                let t = peer.send(state, fp)?;
                rows[4].1.push(t.total());
                wire.push(t.wire);
            }
        }
        let floor = stats(&mut rows[0].1.iter().map(|d| ms(*d)).collect::<Vec<_>>()).0;
        for (name, times) in &rows {
            let (m, lo, hi) = stats(&mut times.iter().map(|d| ms(*d)).collect::<Vec<_>>());
            let gbs = if m > 0.0 { format!("{:.1}", bytes as f64 / (m / 1e3) / 1e9) } else { "-".into() };
            writeln!(report, "| {n} | {:.1} MB | {name} | {m:.2} ({lo:.2} - {hi:.2}) | {gbs} | {:.2} |", bytes as f64 / 1e6, m / floor)?;
        }
        if !wire.is_empty() {
            let (m, lo, hi) = stats(&mut wire.iter().map(|d| ms(*d)).collect::<Vec<_>>());
            writeln!(report, "| {n} | {:.1} MB | of which NIXL's write alone (until complete) | {m:.2} ({lo:.2} - {hi:.2}) | {:.1} | {:.2} |", bytes as f64 / 1e6, bytes as f64 / (m / 1e3) / 1e9, m / floor)?;
        }
    }
    if let Err(e) = &nixl {
        writeln!(report, "\nNIXL: not measured: {e:#}")?;
    }
    if let Device::Cuda(from) = engine.device {
        // To the decode engine's GPU where it has one, else within the prefill engine's.
        let to = if let Device::Cuda(to) = decode.device { to } else { from };
        match super::nixl_peer::gpu_rows(spec, &model.net, from, to, lengths, reps) {
            Ok(rows) => {
                let gpus = if to == from { format!("cuda:{from}") } else { format!("cuda:{from} to cuda:{to}") };
                writeln!(report, "\n### GPU memory to GPU memory ({gpus}; median of {reps}, min - max in brackets)\n")?;
                writeln!(report, "| prompt tokens | state on the GPU | transfer | time (ms) | GB/s | x the copy in one process |")?;
                writeln!(report, "|---|---|---|---|---|---|")?;
                for row in rows {
                    let floor = stats(&mut row.times[0].1.iter().map(|d| ms(*d)).collect::<Vec<_>>()).0;
                    for (name, times) in &row.times {
                        let (m, lo, hi) = stats(&mut times.iter().map(|d| ms(*d)).collect::<Vec<_>>());
                        writeln!(report, "| {} | {:.1} MB | {name} | {m:.3} ({lo:.3} - {hi:.3}) | {:.1} | {:.2} |", row.tokens, row.bytes as f64 / 1e6, row.bytes as f64 / (m / 1e3) / 1e9, m / floor)?;
                    }
                }
                writeln!(report, "\nThe state's own pieces (slot, K/V blocks, logits) move, each into the one the receiving process reserved; the NIXL time runs from the reservation to the receiver's checked header (its pieces then restore on the GPU as any snapshot does). UCX picks the transport (CUDA IPC between processes on one host, over NVLink or PCIe between two GPUs).")?;
            }
            Err(e) => writeln!(report, "\nNIXL GPU to GPU: not measured: {e:#}")?,
        }
    }
    writeln!(report, "\nEach time runs from the state in the sender's memory to a checked state in the receiver's (header, layout, fingerprint and checksum verified; for NIXL: the image written into registered memory, the one-sided write and its notification, the check and copy out). Move hands the state itself to another thread (no copy). The rows of each length ran interleaved, {reps} rounds.")?;
    Ok(())
}

/// The processes of one end-to-end setup, stopped when dropped.
struct Setup {
    /// Where the load goes: the single server or the router.
    front: Server,
    _workers: Vec<Server>,
}

fn gpu_share(spec: &EngineSpec, share: &str) -> Vec<String> {
    match spec.device {
        Device::Cuda(_) => vec!["--gpu-memory-utilization".into(), share.into()],
        Device::Cpu => Vec::new(),
    }
}

/// One end-to-end setup.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    /// One `tandem serve` running the prefill and the decode engine.
    Single,
    /// A router with this prefill placement, a prefill worker (one engine on the prefill
    /// engine's device) and a decode worker.
    Split(&'static str),
    /// Two GPUs: a router keeping every prefill local, and a decode worker on each GPU running
    /// both engines there (two replicas).
    Replicas,
}

/// Whether the engines are on two GPUs.
fn two_gpus(prefill: &EngineSpec, decode: &EngineSpec) -> bool {
    matches!((prefill.device, decode.device), (Device::Cuda(a), Device::Cuda(b)) if a != b)
}

fn start_setup(spec: &str, prefill: &EngineSpec, decode: &EngineSpec, layout: Layout, max_concurrent: usize) -> Result<Setup> {
    let common: Vec<String> = ["--model", spec, "--host", "127.0.0.1", "--port", "0", "--max-queue", "100000", "--prefix-cache-memory", "0", "--prefix-cache-device-memory", "0", "--max-concurrent", &max_concurrent.to_string()].map(String::from).to_vec();
    let both_engines = |on: &EngineSpec| -> Vec<String> { ["--prefill".into(), on.to_string(), "--decode".into(), on.to_string()].to_vec() };
    let placement = match layout {
        Layout::Single => {
            let mut a = common.clone();
            a.extend(["--prefill".into(), prefill.to_string(), "--decode".into(), decode.to_string()]);
            // Two engines on one GPU share it as one server does.
            return Ok(Setup { front: Server::start(&a)?, _workers: Vec::new() });
        }
        Layout::Split(placement) => placement,
        Layout::Replicas => "local",
    };
    let router = Server::start(&["--role", "router", "--host", "127.0.0.1", "--port", "0", "--prefill-placement", placement].map(String::from))?;
    let url = format!("http://{}", router.addr);
    let worker = |role: &str| -> Vec<String> {
        let mut w = common.clone();
        w.extend(["--role".into(), role.into(), "--router".into(), url.clone()]);
        w
    };
    let workers = if layout == Layout::Replicas {
        let (mut a, mut b) = (worker("decode"), worker("decode"));
        a.extend(both_engines(prefill));
        a.extend(gpu_share(prefill, "0.85"));
        b.extend(both_engines(decode));
        b.extend(gpu_share(decode, "0.85"));
        vec![Server::start(&a)?, Server::start(&b)?]
    } else {
        let two = two_gpus(prefill, decode);
        let mut p = worker("prefill");
        p.extend(["--mode".into(), "prefill-engine".into(), "--prefill".into(), prefill.to_string()]);
        p.extend(gpu_share(prefill, if two { "0.85" } else { "0.35" }));
        let mut d = worker("decode");
        // On one GPU the decode worker runs both engines as the single server does (they share
        // the GPU); on two GPUs or on CPU cores, one engine on the decode engine's, so that the
        // devices add up to the single server's.
        match decode.device {
            Device::Cuda(_) if !two => d.extend(both_engines(decode)),
            _ => d.extend(["--mode".into(), "decode-engine".into(), "--decode".into(), decode.to_string()]),
        }
        // A GPU budget is a fraction of the whole GPU less everything in use when the server
        // starts, the prefill worker's share among it on one GPU: the decode worker, started
        // second, names the total of both.
        d.extend(gpu_share(decode, "0.85"));
        vec![Server::start(&p)?, Server::start(&d)?]
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let started = Instant::now();
    loop {
        let (_, health) = rt.block_on(load::get(router.addr, "/health"))?;
        if health.matches("\"live\":true").count() == 2 {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("the workers did not register with the router within 60 s: {health}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(Setup { front: router, _workers: workers })
}

/// Part 2: the same mixed load on a single server and on router + workers.
fn end_to_end(report: &mut String, args: &Args, spec: &str, prefill: &EngineSpec, decode: &EngineSpec, quick: bool) -> Result<()> {
    let short: usize = args.get("short-len", 64)?;
    let long: usize = args.get("long-len", if quick { 512 } else { 2048 })?;
    let output: usize = args.get("output-len", if quick { 16 } else { 64 })?;
    let requests: usize = args.get("requests", if quick { 8 } else { 24 })?;
    let concurrency: usize = args.get("concurrency", 4)?;
    let slo_ttft: f64 = args.get("slo-ttft-ms", 5000.0)? / 1e3;
    let slo_tpot: f64 = args.get("slo-tpot-ms", 200.0)? / 1e3;
    let vocab = LoadedModel::load(spec).map(|m| m.sampleable_vocab()).context("the model's vocabulary")?;
    // Every other prompt long, in a fixed order; random tokens (no prefix shared).
    let mixed = |n: usize, seed: u64| -> Vec<Vec<u32>> { (0..n).map(|i| Workload::random_prompts(1, if i % 2 == 1 { long } else { short }, vocab, seed + i as u64).remove(0)).collect() };
    let (prompts, warm_up) = (mixed(requests, 1000), mixed(6, 500));
    writeln!(report, "\n## End to end: one server against a router with a prefill and a decode worker\n")?;
    writeln!(report, "{requests} requests, {concurrency} at a time, prompts of {short} and {long} tokens alternating (random tokens), {output} output tokens each (ignore_eos, greedy), after 6 such requests 2 at a time to warm each setup up. SLO for goodput: TTFT <= {:.0} ms and time per output token <= {:.0} ms. The single server runs the prefill engine {prefill} and the decode engine {decode}; the prefill worker one engine on {prefill}; the decode worker {}.\n", slo_ttft * 1e3, slo_tpot * 1e3, match decode.device {
        Device::Cuda(_) if two_gpus(prefill, decode) => format!("one engine on {decode}, which prefills what stays local between its decode steps; the two replicas each run both engines on their GPU"),
        Device::Cuda(_) => "both engines, as the single server".to_string(),
        Device::Cpu => format!("one engine on {decode}, which prefills what stays local between its decode steps"),
    })?;
    writeln!(report, "| setup | failed | s | output tok/s | goodput tok/s (in SLO) | TTFT p50 / p99 (ms) | TTFT short / long p50 (ms) | ITL p50 / p99 (ms) | prefills remote | a state's transfer: mean ms, MB, GB/s |")?;
    writeln!(report, "|---|---|---|---|---|---|---|---|---|---|")?;
    let rounds: usize = args.get("rounds", 1)?;
    if rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let setups: Vec<(&str, Layout)> = if two_gpus(prefill, decode) {
        vec![("single server", Layout::Single), ("two replicas behind the router", Layout::Replicas), ("router, prefill remote", Layout::Split("remote")), ("router, conditional", Layout::Split("conditional"))]
    } else {
        vec![("single server", Layout::Single), ("router, prefill local", Layout::Split("local")), ("router, prefill remote", Layout::Split("remote")), ("router, conditional", Layout::Split("conditional"))]
    };
    // Per setup, per round: (output tok/s, goodput tok/s). Rounds run every setup in turn.
    let mut rates: Vec<Vec<(f64, f64)>> = vec![Vec::new(); setups.len()];
    for round in 1..=rounds {
        for (i, (label, layout)) in setups.iter().enumerate() {
            progress(&format!("end to end, round {round}/{rounds}: {label}"));
            let setup = start_setup(spec, prefill, decode, *layout, concurrency)?;
            let workload = |prompts: Vec<Vec<u32>>| Arc::new(Workload { addr: setup.front.addr, model: spec.to_string(), prompts, output_len: output, temperature: 0.0, top_k: 0, top_p: 1.0 });
            // Warm-up, not reported: the first requests of a process make its buffers, the
            // first states to a decode worker map its memory.
            let (warm, _) = rt.block_on(load::drive(workload(warm_up.clone()), Arrivals::Concurrency(2)));
            if let Some(e) = warm.iter().find_map(|o| o.error.clone()) {
                bail!("{label}: a warm-up request failed: {e}");
            }
            let workload = workload(prompts.clone());
            let router_before = if *layout != Layout::Single { Some(RouterCounts::read(&rt.block_on(load::get(setup.front.addr, "/metrics"))?.1)) } else { None };
            let (outcomes, seconds) = rt.block_on(load::drive(workload, Arrivals::Concurrency(concurrency)));
            let (remote, moved) = match router_before {
                Some(before) => {
                    let run = RouterCounts::read(&rt.block_on(load::get(setup.front.addr, "/metrics"))?.1).since(&before);
                    (format!("{:.0}", run.remote), run.state_moves())
                }
                None => ("-".into(), "-".into()),
            };
            let label = if rounds > 1 { format!("{label} (round {round})") } else { label.to_string() };
            let (line, out, good) = row(&label, &outcomes, seconds, short, slo_ttft, slo_tpot, &remote, &moved);
            writeln!(report, "{line}")?;
            rates[i].push((out, good));
            drop(setup);
        }
    }
    if rounds > 1 {
        let median = |v: &mut Vec<f64>| stats(v);
        let local = median(&mut rates[1].iter().map(|r| r.0).collect()).0;
        writeln!(report, "\n{rounds} rounds, the setups in turn in each: median (min - max).\n")?;
        writeln!(report, "| setup | output tok/s | goodput tok/s | x {} (medians) |", setups[1].0)?;
        writeln!(report, "|---|---|---|---|")?;
        for ((label, _), r) in setups.iter().zip(&rates) {
            let (o, olo, ohi) = median(&mut r.iter().map(|r| r.0).collect());
            let (g, glo, ghi) = median(&mut r.iter().map(|r| r.1).collect());
            writeln!(report, "| {label} | {o:.1} ({olo:.1} - {ohi:.1}) | {g:.1} ({glo:.1} - {ghi:.1}) | {:.2} |", o / local)?;
        }
    }
    Ok(())
}

/// The router's counters of remote prefills and the states they wrote into decode workers'
/// slots.
#[derive(Clone, Copy)]
struct RouterCounts {
    remote: f64,
    transfer_seconds: f64,
    state_bytes: f64,
}

impl RouterCounts {
    fn read(metrics: &str) -> RouterCounts {
        let get = |name: &str| super::serve::gauge(metrics, name).unwrap_or(0.0);
        RouterCounts { remote: get("tandem_router_requests_total{prefill=\"remote\"}"), transfer_seconds: get("tandem_router_state_transfer_seconds_total"), state_bytes: get("tandem_router_state_bytes_total") }
    }

    fn since(&self, before: &RouterCounts) -> RouterCounts {
        RouterCounts { remote: self.remote - before.remote, transfer_seconds: self.transfer_seconds - before.transfer_seconds, state_bytes: self.state_bytes - before.state_bytes }
    }

    /// The mean time of one state's transfer (from the prefill worker's snapshot to the
    /// write's completion, the image included where one is built), its mean size, and the
    /// bandwidth of the two.
    fn state_moves(&self) -> String {
        if self.remote < 1.0 || self.transfer_seconds <= 0.0 {
            return "-".into();
        }
        format!("{:.2}, {:.1}, {:.1}", self.transfer_seconds / self.remote * 1e3, self.state_bytes / self.remote / 1e6, self.state_bytes / self.transfer_seconds / 1e9)
    }
}

/// A setup's row, with its output and goodput tok/s.
#[allow(clippy::too_many_arguments)]
fn row(label: &str, outcomes: &[Outcome], seconds: f64, short: usize, slo_ttft: f64, slo_tpot: f64, remote: &str, moved: &str) -> (String, f64, f64) {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
    let ms = |v: &[f64], p: f64| if v.is_empty() { f64::NAN } else { 1e3 * percentile(v, p) };
    let ttft: Vec<f64> = ok.iter().map(|o| o.ttft).collect();
    let ttft_of = |is_short: bool| -> Vec<f64> { ok.iter().filter(|o| (o.prompt_tokens <= short) == is_short).map(|o| o.ttft).collect() };
    let itl: Vec<f64> = ok.iter().flat_map(|o| o.itl.iter().copied()).collect();
    let out: usize = ok.iter().map(|o| o.output_tokens).sum();
    let good: usize = ok.iter().filter(|o| o.ttft <= slo_ttft && o.tpot() <= slo_tpot).map(|o| o.output_tokens).sum();
    let line = format!(
        "| {label} | {} | {seconds:.1} | {:.1} | {:.1} | {:.0} / {:.0} | {:.0} / {:.0} | {:.1} / {:.1} | {remote} | {moved} |",
        outcomes.len() - ok.len(),
        out as f64 / seconds,
        good as f64 / seconds,
        ms(&ttft, 50.0),
        ms(&ttft, 99.0),
        ms(&ttft_of(true), 50.0),
        ms(&ttft_of(false), 50.0),
        ms(&itl, 50.0),
        ms(&itl, 99.0),
    );
    (line, out as f64 / seconds, good as f64 / seconds)
}
