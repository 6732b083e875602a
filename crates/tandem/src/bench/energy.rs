//! Table 7: energy per token from the machine's own power counters: RAPL (Linux powercap) for
//! the CPU packages, NVML for the board of a GPU engine. Where none can be read, the table says
//! which were looked for and why each is missing; nothing is estimated in their place.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Result;
use super::nvml::NvmlDevice;
use tandem_core::backend::cuda::Gpu;
use tandem_core::engine::{Engine, EngineSpec};
use tandem_core::state::DeviceState;
use tandem_core::model::load::LoadedModel;
use tandem_core::pipeline::PipelineConfig;

use super::pipeline::{on_engine, prompt_of};
use super::{progress, Record};

/// One energy counter.
pub(super) enum Counter {
    /// A CPU package's RAPL zone: its energy_uj file, wrapping at `range_uj`.
    Rapl { name: String, file: PathBuf, range_uj: u64 },
    /// A GPU board (NVML's total energy).
    Nvml { name: String, meter: NvmlDevice },
}

impl Counter {
    fn name(&self) -> &str {
        match self {
            Counter::Rapl { name, .. } | Counter::Nvml { name, .. } => name,
        }
    }

    /// The counter's reading, in joules.
    fn read(&self) -> Result<f64> {
        Ok(match self {
            Counter::Rapl { file, .. } => read_u64(file)? as f64 / 1e6,
            Counter::Nvml { meter, .. } => meter.millijoules()? as f64 / 1e3,
        })
    }

    /// Joules between two readings (a RAPL counter wraps around at its range).
    fn used(&self, before: f64, after: f64) -> f64 {
        match self {
            Counter::Rapl { range_uj, .. } if after < before => after + *range_uj as f64 / 1e6 - before,
            _ => after - before,
        }
    }
}

fn read_u64(file: &Path) -> Result<u64> {
    let text = std::fs::read_to_string(file).map_err(|e| anyhow::anyhow!("reading {}: {e}", file.display()))?;
    text.trim().parse().map_err(|_| anyhow::anyhow!("{}: {:?} is not a number", file.display(), text.trim()))
}

/// The CPU packages' RAPL counters, or why there are none.
fn rapl() -> std::result::Result<Vec<Counter>, String> {
    let root = Path::new("/sys/class/powercap");
    let entries = std::fs::read_dir(root).map_err(|e| format!("RAPL: {} cannot be read ({e}): this kernel exposes no power counters{}", root.display(), virtual_machine()))?;
    // Top-level zones ("intel-rapl:0", also on AMD) are packages; "intel-rapl:0:0" are parts of one.
    let mut zones: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("intel-rapl:")).is_some_and(|i| i.parse::<u32>().is_ok()))
        .collect();
    zones.sort();
    if zones.is_empty() {
        return Err(format!("RAPL: {} has no package zones{}", root.display(), virtual_machine()));
    }
    zones
        .iter()
        .map(|z| {
            let file = z.join("energy_uj");
            let name = std::fs::read_to_string(z.join("name")).map(|n| n.trim().to_string()).unwrap_or_else(|_| z.display().to_string());
            let range_uj = read_u64(&z.join("max_energy_range_uj")).map_err(|e| format!("RAPL: {e:#}"))?;
            match std::fs::read_to_string(&file) {
                Ok(_) => Ok(Counter::Rapl { name: format!("CPU {name} (RAPL)"), file, range_uj }),
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(format!(
                    "RAPL: {} is readable by root only (Linux restricts it since 5.10, against power side channels): run the bench as root, or make the file readable",
                    file.display()
                )),
                Err(e) => Err(format!("RAPL: reading {}: {e}", file.display())),
            }
        })
        .collect()
}

/// " (a virtual machine: ...)" where the CPU says it runs under a hypervisor.
fn virtual_machine() -> &'static str {
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    if flags.lines().any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "hypervisor")) {
        " (this is a virtual machine: its hypervisor does not pass the CPU's energy counters through)"
    } else {
        ""
    }
}

/// A GPU board's NVML counter, or why it has none.
pub(super) fn nvml(gpu: &Gpu) -> Result<Counter> {
    let meter = gpu.pci_bus_id().and_then(|id| NvmlDevice::open(&id))?;
    meter.millijoules()?;
    Ok(Counter::Nvml { name: format!("cuda:{} {} (NVML)", gpu.ordinal, gpu.name), meter })
}

/// The counters that see an engine's work: the CPU packages, and its GPU's board.
fn counters(engine: &Engine) -> (Vec<Counter>, Vec<String>) {
    let (mut found, mut missing) = (Vec::new(), Vec::new());
    match rapl() {
        Ok(c) => found.extend(c),
        Err(why) => missing.push(why),
    }
    if let Some(g) = engine.gpu() {
        match nvml(&g.gpu) {
            Ok(c) => found.push(c),
            Err(e) => missing.push(format!("NVML (cuda:{}): {e:#}", g.gpu.ordinal)),
        }
    }
    if !cfg!(target_os = "macos") {
        missing.push("powermetrics: Apple's counter exists on macOS only".into());
    }
    (found, missing)
}

/// One phase measured on one counter.
struct Measured {
    counter: String,
    idle_watts: f64,
    joules: f64,
    seconds: f64,
    tokens: usize,
}

/// Each counter's power while nothing runs, over one second, in watts.
pub(super) fn idle_watts(counters: &[Counter]) -> Result<Vec<f64>> {
    let start: Vec<f64> = counters.iter().map(Counter::read).collect::<Result<_>>()?;
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let seconds = t.elapsed().as_secs_f64();
    counters.iter().zip(start).map(|(c, s)| Ok(c.used(s, c.read()?) / seconds)).collect()
}

/// Repeat `run` for 2 s or more in all, so that the counters' update intervals do not matter:
/// each counter's joules, the seconds taken and the number of runs.
pub(super) fn over_two_seconds(counters: &[Counter], mut run: impl FnMut() -> Result<()>) -> Result<(Vec<f64>, f64, usize)> {
    let start: Vec<f64> = counters.iter().map(Counter::read).collect::<Result<_>>()?;
    let t = Instant::now();
    let mut runs = 0;
    while runs == 0 || t.elapsed() < Duration::from_secs(2) {
        run()?;
        runs += 1;
    }
    let seconds = t.elapsed().as_secs_f64();
    let joules = counters.iter().zip(start).map(|(c, s)| Ok(c.used(s, c.read()?))).collect::<Result<_>>()?;
    Ok((joules, seconds, runs))
}

/// Every counter over repetitions of `run` (each handling `tokens` tokens), with idle power
/// over 1 s before.
fn measure(counters: &[Counter], tokens: usize, run: impl FnMut() -> Result<()>) -> Result<Vec<Measured>> {
    let idle = idle_watts(counters)?;
    let (joules, seconds, runs) = over_two_seconds(counters, run)?;
    Ok(counters
        .iter()
        .zip(idle)
        .zip(joules)
        .map(|((c, idle_watts), joules)| Measured { counter: c.name().to_string(), idle_watts, joules, seconds, tokens: runs * tokens })
        .collect())
}

/// Table 7: joules per prefill token on the prefill engine (`prompt_tokens`-token prompts) and
/// per decode token on the decode engine (one sequence), from every counter that sees them.
pub fn section(rec: &mut Record, model: &LoadedModel, config: &PipelineConfig, prompt_tokens: usize, spec: &str) -> Result<()> {
    let vocab = model.sampleable_vocab();
    let roles: [(&str, &EngineSpec); 2] = [("prefill", &config.prefill), ("decode", &config.decode)];
    let mut rows = Vec::new();
    let mut missing: Vec<String> = Vec::new();
    for (phase, placement) in roles {
        progress(&format!("energy: {phase} on {placement}"));
        let (measured, why) = on_engine(placement, &model.net, |engine| {
            let (found, why) = counters(&engine);
            if found.is_empty() {
                return Ok((Vec::new(), why));
            }
            let measured = if phase == "prefill" {
                let prompt = prompt_of(prompt_tokens, vocab);
                measure(&found, prompt_tokens, || {
                    let mut state = engine.new_state()?;
                    engine.prefill(&prompt, &mut state).map(drop)
                })?
            } else {
                let steps = 8;
                let mut state = engine.new_state()?;
                engine.prefill(&prompt_of(13, vocab), &mut state)?;
                measure(&found, steps, || {
                    if state.position() > 2048 {
                        state = engine.new_state()?;
                        engine.prefill(&prompt_of(13, vocab), &mut state)?;
                    }
                    for i in 0..steps {
                        let mut one: [&mut DeviceState; 1] = [&mut state];
                        engine.decode(&[100 + i as u32], &mut one)?;
                    }
                    Ok(())
                })?
            };
            Ok((measured, why))
        })?;
        if measured.is_empty() {
            rows.push((phase, placement.to_string(), None));
        }
        for m in measured {
            rec.run(
                "energy",
                serde_json::json!({"phase": phase, "engine": placement.to_string(), "counter": m.counter, "tokens": m.tokens, "joules": m.joules,
                    "seconds": m.seconds, "idle_watts": m.idle_watts}),
            );
            rows.push((phase, placement.to_string(), Some(m)));
        }
        for w in why {
            if !missing.contains(&w) {
                missing.push(w);
            }
        }
    }
    writeln!(rec.report, "\n## Energy ({spec}; prefill of {prompt_tokens}-token prompts on the prefill engine, one-sequence decode on the decode engine)\n")?;
    if rows.iter().all(|(_, _, m)| m.is_none()) {
        writeln!(rec.report, "No power counter could be read on this machine, so this table has no figures (none are estimated in their place):\n")?;
        for w in &missing {
            writeln!(rec.report, "- {w}")?;
        }
        return Ok(());
    }
    writeln!(rec.report, "| phase | engine | counter | joules per token | average power | idle power |")?;
    writeln!(rec.report, "|---|---|---|---|---|---|")?;
    for (phase, engine, m) in &rows {
        let Some(m) = m else {
            writeln!(rec.report, "| {phase} | {engine} | none readable (below) | not measured | | |")?;
            continue;
        };
        let per_token = m.joules / m.tokens as f64;
        let per_token = if per_token < 1.0 { format!("{:.1} mJ", per_token * 1e3) } else { format!("{per_token:.2} J") };
        writeln!(rec.report, "| {phase} | {engine} | {} | {per_token} | {:.0} W | {:.0} W |", m.counter, m.joules / m.seconds, m.idle_watts)?;
    }
    writeln!(rec.report, "\nEach counter covers its whole package or board (idle power and whatever else runs included), over 2 s or more of work. Not read: {}.", missing.join("; "))?;
    Ok(())
}
