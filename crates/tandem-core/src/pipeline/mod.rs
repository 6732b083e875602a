//! The pipeline between the engines. Requests queue for the prefill engine (`prefill.rs`),
//! which takes those that wait together (a GPU engine prefills them in one packed forward);
//! each prefilled state crosses the bridge (`bridge::handoff`) to the decode engine
//! (`decode.rs`), which decodes every active sequence in one batched step per token. With two
//! engines (hybrid) the two run at once on their own threads (and cores): while the decode
//! engine decodes request k, the prefill engine prefills k+1. With one engine (the study's
//! pure modes) a single thread does both: each step applies a budget of prompt tokens (a long
//! prompt in chunks over several steps: chunked prefill), then decodes every running sequence.
//!
//! The handoff position is exact: a prefilled state covers the prompt `[0, N)` and carries the
//! logits of token N-1; the decode side samples its first token from those logits and applies
//! only tokens it sampled.

mod decode;
pub mod host_budget;
mod prefill;
pub mod request;
mod swap_file;
pub mod trace;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub use request::{Event, Finish, Fork, Generated, Request, RequestParams, Start, Timings};

use crate::backend::cuda::qwen35::{device_pool::PoolLevel, kv_cache::{KvPool, KV_BLOCK}, state_slots::{SlotPool, StateDtype}, GpuPools};
use crate::prefix_cache::DeviceTier;
use crate::bridge::{handoff, Transfer};
use crate::engine::{Device, Engine, EngineSpec};
use crate::model::config::Qwen35Config;
use crate::model::Qwen35;
use crate::sampling::SamplingParams;
use crate::state::State;
use host_budget::HostBudget;
use trace::{Trace, Work};

/// The study's three modes: which engines a request's prefill and decode run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The prefill engine does both (CLI `prefill-engine`).
    AllOnPrefillEngine,
    /// The decode engine does both (CLI `decode-engine`).
    AllOnDecodeEngine,
    /// Prefill on the prefill engine, bridge, decode on the decode engine.
    Hybrid,
}

impl Mode {
    pub fn parse(s: &str) -> Result<Mode> {
        Ok(match s {
            "prefill-engine" => Mode::AllOnPrefillEngine,
            "decode-engine" => Mode::AllOnDecodeEngine,
            "hybrid" => Mode::Hybrid,
            _ => bail!("unknown mode {s:?}: choose hybrid, prefill-engine or decode-engine"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::AllOnPrefillEngine => "prefill-engine",
            Mode::AllOnDecodeEngine => "decode-engine",
            Mode::Hybrid => "hybrid",
        }
    }
}

#[derive(Clone, Debug)]
pub struct PipelineConfig {
    pub mode: Mode,
    pub prefill: EngineSpec,
    pub decode: EngineSpec,
    pub transfer: Transfer,
    /// Most sequences decoded in one step.
    pub max_batch: usize,
    /// Most prompt tokens prefilled in one forward, where the engine packs the prompts that
    /// wait into one (a CUDA engine); a longer prompt goes alone. With one engine doing both,
    /// the prompt tokens it applies per step between decode steps, a longer prompt in chunks
    /// over several steps (chunked prefill).
    pub max_prefill_tokens: usize,
    /// The memory the decode engine's K/V cache may take.
    pub kv_cache: KvBudget,
    /// Where to write a timeline of the engines' work (`trace.rs`), if anywhere.
    pub trace: Option<PathBuf>,
    /// GPU memory for a prefix cache's snapshots (`Pipeline::device_tier`), taken from what the
    /// K/V cache would get; 0: none (snapshots go to host memory); `DEVICE_TIER_DEFAULT`: the
    /// default share of it.
    pub prefix_cache_device: usize,
    /// The prefill engine keeps the snapshots it takes on its GPU even without a device tier (a
    /// prefill worker sends them from there, GPU memory to GPU memory).
    pub device_snapshots: bool,
}

/// How much memory a decode engine's K/V cache may take: a GPU engine's pool of blocks that
/// engines on one GPU share (kv_cache.rs), its limit set once the engines are loaded; a CPU
/// engine's budget of host memory (host_budget.rs). Admission, and swapping sequences out when
/// it runs short, keep the work within it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvBudget {
    /// As much as the GPU gives, taken as it is needed.
    Unlimited,
    /// What is left of this fraction of the GPU's memory once the engines are loaded, less an
    /// estimate of what the running sequences' states and the workspaces take
    /// (`--gpu-memory-utilization`).
    GpuFraction(f64),
    /// This many bytes (`--kv-cache-memory`; the one budget a CPU decode engine takes).
    Bytes(usize),
}

/// What a memory budget came to at start-up (`Pipeline::kv_capacity`).
#[derive(Clone, Copy, Debug)]
pub struct KvCapacity {
    pub device: Device,
    pub blocks: usize,
    pub block_bytes: usize,
    /// State slots: `max_batch` running sequences, as many prefilled ahead, and one for the
    /// padding rows of batched steps.
    pub slots: usize,
    /// Bytes of one slot (a sequence's fixed-size state: conv windows and recurrent states).
    pub state_bytes: usize,
    pub state_dtype: StateDtype,
    /// Bytes kept back for the slots (and a GPU engine's workspaces).
    pub reserved_bytes: usize,
}

impl KvCapacity {
    /// Positions the cache holds.
    pub fn positions(&self) -> usize {
        self.blocks * KV_BLOCK
    }

    /// A line for the start-up log.
    pub fn describe(&self, max_batch: usize) -> String {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let device = match self.device {
            Device::Cpu => "cpu".to_string(),
            Device::Cuda(n) => format!("cuda:{n}"),
        };
        let kept = if self.device == Device::Cpu { "for them" } else { "for them and the workspaces" };
        format!(
            "{device}: up to {max_batch} sequences decoding; K/V cache {:.2} GiB: {} blocks of {KV_BLOCK} positions ({} positions in all, {} per sequence at {max_batch} sequences); {} state slots of {:.1} MiB ({} recurrent states), {:.2} GiB kept {kept}",
            gib(self.blocks * self.block_bytes),
            self.blocks,
            self.positions(),
            self.positions() / max_batch.max(1),
            self.slots,
            self.state_bytes as f64 / (1 << 20) as f64,
            self.state_dtype,
            gib(self.reserved_bytes),
        )
    }
}

impl PipelineConfig {
    /// The default budget of one packed prefill: 16 prompts of 512 tokens.
    pub const MAX_PREFILL_TOKENS: usize = 8192;

    /// `prefix_cache_device` for the default device tier: a quarter of the memory the K/V
    /// cache would otherwise get, at most `DEVICE_TIER_MOST` (a GPU with room for little more
    /// than the weights keeps most of it for running requests).
    pub const DEVICE_TIER_DEFAULT: usize = usize::MAX;
    pub const DEVICE_TIER_MOST: usize = 8 << 30;

    /// The device tier's bytes where the K/V cache would get `kv_bytes` without it (None: no
    /// budget to take it from).
    fn device_tier_bytes(&self, kv_bytes: Option<usize>) -> usize {
        match self.prefix_cache_device {
            Self::DEVICE_TIER_DEFAULT => kv_bytes.map_or(Self::DEVICE_TIER_MOST, |b| (b / 4).min(Self::DEVICE_TIER_MOST)),
            bytes => bytes,
        }
    }
}

/// Time the engines spent computing, in nanoseconds, since the pipeline started: prefill work
/// (the prefill engine's, or the single engine's prefills) and decode steps.
#[derive(Default)]
struct EngineTime {
    prefill_ns: AtomicU64,
    decode_ns: AtomicU64,
    /// Sequences swapped out of the K/V cache to host memory, and back (decode.rs).
    swapped_out: AtomicU64,
    swapped_in: AtomicU64,
    /// Every span of work, with `--trace`.
    trace: Option<Trace>,
}

impl EngineTime {
    fn add(counter: &AtomicU64, since: Instant) {
        counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Trace `work` from `started` to now (with `--trace`); `work` is only made then.
    fn span(&self, started: Instant, work: impl FnOnce() -> Work) {
        if let Some(t) = &self.trace {
            t.span(started, work());
        }
    }
}

/// The caller's side of a running pipeline. Clones submit to the same engines; the pipeline
/// stops once every clone is dropped (after `run`'s body returns).
#[derive(Clone)]
pub struct Pipeline {
    requests: Sender<(Request, Instant)>,
    engine_time: Arc<EngineTime>,
    /// The decode engine's pools (a GPU engine's) and what its budget came to.
    kv: Option<(GpuPools, Option<KvCapacity>)>,
    /// Where the prefill engine keeps snapshots on its GPU (`PipelineConfig::prefix_cache_device`).
    device_tier: Option<Arc<DeviceTier>>,
    /// The pools of the engine that prefills (a GPU engine's): its snapshots are there.
    prefill_pools: Option<GpuPools>,
    /// A CPU decode engine's memory budget, and what it came to.
    host: Option<(Arc<HostBudget>, KvCapacity)>,
}

impl Pipeline {
    /// Engine time spent on (prefill, decode) work since the pipeline started.
    pub fn busy(&self) -> (Duration, Duration) {
        let get = |c: &AtomicU64| Duration::from_nanos(c.load(Ordering::Relaxed));
        (get(&self.engine_time.prefill_ns), get(&self.engine_time.decode_ns))
    }

    /// How full the decode engine's K/V cache is (a GPU engine's pool; a CPU engine's budget).
    pub fn kv_level(&self) -> Option<PoolLevel> {
        match &self.host {
            Some((h, _)) => Some(h.kv_level()),
            None => self.kv.as_ref().map(|(p, _)| p.kv.level()),
        }
    }

    /// What the K/V budget came to at start-up (None without one).
    pub fn kv_capacity(&self) -> Option<KvCapacity> {
        match &self.host {
            Some((_, c)) => Some(*c),
            None => self.kv.as_ref().and_then(|(_, c)| *c),
        }
    }

    /// How full the decode engine's state slots are (a GPU engine's pool; a CPU engine's
    /// budget).
    pub fn slot_level(&self) -> Option<PoolLevel> {
        match &self.host {
            Some((h, _)) => Some(h.slot_level()),
            None => self.kv.as_ref().map(|(p, _)| p.slots.level()),
        }
    }

    /// Sequences swapped out of the decode engine's K/V cache to make room, and back, so far.
    pub fn swaps(&self) -> (u64, u64) {
        (self.engine_time.swapped_out.load(Ordering::Relaxed), self.engine_time.swapped_in.load(Ordering::Relaxed))
    }

    /// The GPU memory the prefill engine keeps a prefix cache's snapshots in (None: they go to
    /// host memory: no budget was given, or the prefill engine runs on the CPU).
    pub fn device_tier(&self) -> Option<&Arc<DeviceTier>> {
        self.device_tier.as_ref()
    }

    /// The decode engine's pools, where it is a GPU engine (states it runs live there).
    pub fn decode_pools(&self) -> Option<&GpuPools> {
        self.kv.as_ref().map(|(p, _)| p)
    }

    /// The pools of the engine that prefills, where it is a GPU engine (its snapshots live
    /// there).
    pub fn prefill_pools(&self) -> Option<&GpuPools> {
        self.prefill_pools.as_ref()
    }

    /// Trace `work` from `started` to now on the calling thread's track (with `--trace`): work
    /// of the pipeline's caller that bears on its engines' (a prefix cache's).
    pub fn trace(&self, started: Instant, work: Work) {
        self.engine_time.span(started, || work);
    }

    /// Queue a request; its events arrive on `request.events`.
    pub fn submit(&self, request: Request) -> Result<()> {
        self.requests.send((request, Instant::now())).map_err(|_| anyhow::anyhow!("the pipeline has stopped"))
    }

    /// Run one request to the end and return its outcome (with the final state), passing each
    /// token to `on_token` as it is sampled.
    pub fn generate(&self, start: Option<State>, tokens: Vec<u32>, params: &RequestParams, mut on_token: impl FnMut(u32) -> Result<()>) -> Result<Generated> {
        let (events, rx) = channel();
        let request = Request::new(0, tokens, params.max_tokens, params.vocab, events);
        self.submit(Request { start: start.map(Start::State), sampling: params.sampling.clone(), stop_ids: params.stop_ids.clone(), return_state: true, ..request })?;
        let mut out = Vec::new();
        for event in rx {
            match event {
                Event::Token { token, .. } => {
                    out.push(token);
                    on_token(token)?;
                }
                Event::Done { finish, timings, state, .. } => return Ok(Generated { tokens: out, finish, timings, state }),
                Event::Failed { error, .. } => bail!("{error}"),
                Event::Snapshot { .. } => {}
            }
        }
        bail!("the pipeline stopped before the request finished")
    }

    /// Prefill `tokens` into `start` on the prefill engine and wait for the state (what a
    /// session's early prefill and prefill-while-typing run).
    pub fn prefill(&self, start: State, tokens: &[u32]) -> Result<(State, Timings)> {
        let params = RequestParams { max_tokens: 0, sampling: SamplingParams::default(), vocab: usize::MAX, stop_ids: Vec::new() };
        let g = self.generate(Some(start), tokens.to_vec(), &params, |_| Ok(()))?;
        Ok((g.state.context("a prefill-only request returns its state")?, g.timings))
    }
}

/// Make an engine on the calling thread (the thread it will run on) and report to `ready`
/// whether that worked, with its K/V pool where it has one; then wait for `go` (the K/V
/// budget set). None after a failure was reported, or when no go comes.
fn start_engine<'m>(spec: &EngineSpec, net: &'m Qwen35, config: &PipelineConfig, ready: &Sender<Result<Started>>, go: Receiver<()>, what: &'static str) -> Option<Engine<'m>> {
    let made = Engine::new(spec, net).and_then(|mut e| {
        if config.prefix_cache_device > 0 || config.device_snapshots {
            e.keep_snapshots_on_device()?;
        }
        Ok(e)
    });
    match made {
        Ok(e) => {
            let _ = ready.send(Ok(Started { what, pools: e.pools() }));
            go.recv().ok()?;
            Some(e)
        }
        Err(e) => {
            let _ = ready.send(Err(e.context(format!("starting the {what}"))));
            None
        }
    }
}

/// An engine that started, and its pools (a GPU engine's).
struct Started {
    what: &'static str,
    pools: Option<GpuPools>,
}

/// Run a pipeline for the duration of `body`: the engines start on their own threads (made
/// there, so that pinned pools pin those threads), `body` submits requests, and when it
/// returns the pipeline drains and stops. Engine start-up errors are returned. Two GPU engines
/// on one GPU share one K/V pool; the decode engine's pool gets its limit from
/// `config.kv_cache` once every engine is loaded.
pub fn run<T>(net: &Qwen35, config: &PipelineConfig, body: impl FnOnce(&Pipeline) -> Result<T>) -> Result<T> {
    if config.max_batch == 0 {
        bail!("max batch must be at least 1");
    }
    if config.max_prefill_tokens == 0 {
        bail!("the prefill token budget must be at least 1");
    }
    let (req_tx, req_rx) = channel::<(Request, Instant)>();
    let trace = config.trace.as_deref().map(Trace::create).transpose()?;
    let engine_time = Arc::new(EngineTime { trace, ..EngineTime::default() });
    let host = host_budget_for(net, config)?;
    let mut pipeline = Pipeline { requests: req_tx, engine_time: Arc::clone(&engine_time), kv: None, device_tier: None, prefill_pools: None, host: host.clone() };
    let host = host.map(|(h, _)| h);
    std::thread::scope(|s| {
        let (ready_tx, ready_rx) = channel::<Result<Started>>();
        // Each engine starts work once the K/V budget is set (dropped senders: it stops).
        let mut go = Vec::new();
        let mut go_for = || {
            let (tx, rx) = channel::<()>();
            go.push(tx);
            rx
        };
        let mut threads = Vec::new();
        let time = &engine_time;
        let (max_batch, max_prefill_tokens) = (config.max_batch, config.max_prefill_tokens);
        let host = host.as_ref();
        let decode_engine = match config.mode {
            Mode::AllOnPrefillEngine | Mode::AllOnDecodeEngine => {
                let spec = if config.mode == Mode::AllOnPrefillEngine { &config.prefill } else { &config.decode };
                let (ready, go) = (ready_tx.clone(), go_for());
                threads.push(std::thread::Builder::new().name("engine".into()).spawn_scoped(s, move || {
                    if let Some(engine) = start_engine(spec, net, config, &ready, go, "engine") {
                        decode::single_engine_loop(&engine, prefill::Queue::new(req_rx), max_batch, max_prefill_tokens, host, time);
                    }
                }).context("starting the engine thread")?);
                "engine"
            }
            Mode::Hybrid => {
                let (to_decode, from_prefill) = handoff::channel(&config.transfer, net.fingerprint(), &net.config)?;
                let (ready_p, ready_d) = (ready_tx.clone(), ready_tx.clone());
                // Engines on one GPU: the prefill engine takes the decode engine's pool.
                let one_gpu = matches!((config.prefill.device, config.decode.device), (Device::Cuda(a), Device::Cuda(b)) if a == b);
                let (pool_tx, pool_rx) = channel::<GpuPools>();
                let (go_p, go_d) = (go_for(), go_for());
                threads.push(std::thread::Builder::new().name("prefill engine".into()).spawn_scoped(s, move || {
                    if let Some(mut engine) = start_engine(&config.prefill, net, config, &ready_p, go_p, "prefill engine") {
                        if one_gpu {
                            // (No pool comes if the decode engine failed to start; then nothing runs.)
                            if let Ok(pools) = pool_rx.recv() {
                                if let Err(e) = engine.share_pools(pools) {
                                    eprintln!("the prefill engine keeps pools of its own (its states are copied to the decode engine's): {e:#}");
                                }
                            }
                        }
                        prefill::prefill_loop(&engine, prefill::Queue::new(req_rx), to_decode, max_prefill_tokens, host, time);
                    }
                }).context("starting the prefill engine thread")?);
                threads.push(std::thread::Builder::new().name("decode engine".into()).spawn_scoped(s, move || {
                    if let Some(engine) = start_engine(&config.decode, net, config, &ready_d, go_d, "decode engine") {
                        if let (true, Some(pools)) = (one_gpu, engine.pools()) {
                            let _ = pool_tx.send(pools);
                        }
                        drop(pool_tx);
                        decode::decode_loop(&engine, from_prefill, max_batch, host, time);
                    }
                }).context("starting the decode engine thread")?);
                "decode engine"
            }
        };
        drop(ready_tx);
        let mut failed = None;
        // The pools of the engine that prefills (its snapshots go there).
        let mut prefill_pools = None;
        for _ in 0..threads.len() {
            match ready_rx.recv() {
                Ok(Ok(started)) => {
                    if started.what == decode_engine {
                        pipeline.kv = started.pools.clone().map(|p| (p, None));
                    }
                    if started.what != "decode engine" {
                        prefill_pools = started.pools;
                    }
                }
                Ok(Err(e)) => failed = Some(e),
                _ => {}
            }
        }
        // Two engines on one GPU: the prefill engine takes the decode engine's pools.
        if matches!((config.prefill.device, config.decode.device), (Device::Cuda(a), Device::Cuda(b)) if a == b) && config.mode == Mode::Hybrid {
            prefill_pools = pipeline.kv.as_ref().map(|(p, _)| p.clone());
        }
        // The device tier's bytes, where they come out of the K/V cache's budget.
        let mut tier_bytes = None;
        if failed.is_none() {
            if let Some((pools, capacity)) = &mut pipeline.kv {
                // The tier's budget comes out of the K/V cache's where the two share a pool.
                let tier_here = prefill_pools.as_ref().is_some_and(|p| Arc::ptr_eq(&p.kv, &pools.kv));
                match budget_kv_cache(&pools.kv, &pools.slots, config, tier_here) {
                    Ok((c, tier)) => {
                        *capacity = c;
                        tier_bytes = tier_here.then_some(tier);
                    }
                    Err(e) => failed = Some(e),
                }
            }
        }
        if failed.is_none() && config.prefix_cache_device > 0 {
            if let Some(pools) = prefill_pools.clone().filter(|p| p.snapshots.is_some()) {
                let base = pipeline.kv.as_ref().filter(|(p, _)| Arc::ptr_eq(&p.kv, &pools.kv)).and_then(|(_, c)| c.map(|c| c.blocks));
                let budget = tier_bytes.unwrap_or_else(|| config.device_tier_bytes(None));
                pipeline.device_tier = Some(Arc::new(DeviceTier::new(&pools, budget, base)));
            }
        }
        pipeline.prefill_pools = prefill_pools;
        if let Some(e) = failed {
            drop(pipeline);
            drop(go);
            return Err(e);
        }
        for g in go {
            let _ = g.send(());
        }
        let out = body(&pipeline);
        // Dropping the request sender lets the threads drain their work and stop.
        drop(pipeline);
        for t in threads {
            if t.join().is_err() {
                bail!("an engine thread panicked");
            }
        }
        out
    })
}

/// The memory budget of a CPU decode engine (None for a GPU one, or without a budget): the
/// K/V cache `--kv-cache-memory` gives, and `2 max_batch` state slots (the running sequences
/// and as many prefilled ahead of them). A fraction of a GPU's memory is refused: the CPU's
/// memory is not the GPU's.
fn host_budget_for(net: &Qwen35, config: &PipelineConfig) -> Result<Option<(Arc<HostBudget>, KvCapacity)>> {
    let decode = if config.mode == Mode::AllOnPrefillEngine { &config.prefill } else { &config.decode };
    if decode.device != Device::Cpu {
        return Ok(None);
    }
    let kv_bytes = match config.kv_cache {
        KvBudget::Unlimited => return Ok(None),
        KvBudget::GpuFraction(_) => bail!("--gpu-memory-utilization sizes a GPU decode engine's K/V cache; this decode engine runs on the CPU: give its budget in bytes with --kv-cache-memory"),
        KvBudget::Bytes(b) => b,
    };
    let slots = 2 * config.max_batch;
    let budget = HostBudget::new(&net.config, kv_bytes, slots);
    if budget.block_limit() == 0 {
        bail!("--kv-cache-memory {kv_bytes}: less than one K/V block ({} bytes, {KV_BLOCK} positions)", budget.block_bytes());
    }
    let capacity = KvCapacity {
        device: Device::Cpu,
        blocks: budget.block_limit(),
        block_bytes: budget.block_bytes(),
        slots,
        state_bytes: budget.slot_bytes(),
        state_dtype: StateDtype::F32,
        reserved_bytes: slots * budget.slot_bytes(),
    };
    Ok(Some((Arc::new(budget), capacity)))
}

/// Set the limits of the decode engine's pools from `config.kv_cache` (None: no limits), with
/// the engines loaded: `2 max_batch + 1` state slots (the running sequences, as many prefilled
/// ahead of them, and the padding rows' state of batched steps), and K/V blocks in the memory
/// left. A fraction of the GPU's memory leaves, of
/// what is left of it, room for the slots, `max_batch` sequences' logits and the workspaces of
/// a prefill of `max_prefill_tokens` rows and a decode step of `max_batch` (an estimate from
/// the model's shapes, plus 1 GiB for cuBLAS, graphs and the kernels).
fn budget_kv_cache(pool: &KvPool, slot_pool: &SlotPool, config: &PipelineConfig, with_tier: bool) -> Result<(Option<KvCapacity>, usize)> {
    let c = pool.config();
    let block_bytes = pool.level().piece_bytes;
    let (slots, state_bytes) = (2 * config.max_batch + 1, slot_pool.level().piece_bytes);
    let mut reserved = slots * state_bytes + config.max_batch * 4 * c.vocab_size + (config.max_prefill_tokens + config.max_batch) * workspace_bytes_per_row(c) + (1 << 30);
    let tier = |kv_bytes: Option<usize>| if with_tier { config.device_tier_bytes(kv_bytes) } else { 0 };
    let prefix_cache;
    let kv_bytes = match config.kv_cache {
        KvBudget::Unlimited => return Ok((None, tier(None))),
        KvBudget::Bytes(b) => {
            prefix_cache = tier(Some(b));
            reserved += prefix_cache;
            match b.checked_sub(prefix_cache) {
                Some(left) if left >= block_bytes => left,
                _ => bail!("--kv-cache-memory {b}: the prefix cache's {prefix_cache} bytes on the GPU (--prefix-cache-device-memory) leave less than one K/V block: raise the first or lower the second"),
            }
        }
        KvBudget::GpuFraction(f) => {
            if !(f > 0.0 && f <= 1.0) {
                bail!("--gpu-memory-utilization {f}: give a fraction of the GPU's memory above 0 and at most 1");
            }
            let (free, total) = pool.memory()?;
            let in_use = total - free;
            let allowed = (f * total as f64) as usize;
            prefix_cache = tier(Some(allowed.saturating_sub(in_use + reserved)));
            reserved += prefix_cache;
            match allowed.checked_sub(in_use + reserved) {
                Some(b) if b >= block_bytes => b,
                _ => bail!(
                    "cuda:{}: --gpu-memory-utilization {f} allows {:.1} GiB of the GPU's {:.1}; {:.1} GiB are in use (the weights among them) and {:.1} GiB are kept for {slots} state slots ({} sequences decoding and as many prefilled ahead), the workspaces and the prefix cache on the GPU, which leaves nothing for the K/V cache: raise the fraction or lower --max-batch, --max-prefill-tokens or --prefix-cache-device-memory",
                    pool.ordinal(),
                    allowed as f64 / (1u64 << 30) as f64,
                    total as f64 / (1u64 << 30) as f64,
                    in_use as f64 / (1u64 << 30) as f64,
                    reserved as f64 / (1u64 << 30) as f64,
                    config.max_batch
                ),
            }
        }
    };
    let blocks = kv_bytes / block_bytes;
    if blocks == 0 {
        bail!("--kv-cache-memory {kv_bytes}: less than one K/V block ({block_bytes} bytes, {KV_BLOCK} positions)");
    }
    pool.set_limit(Some(blocks));
    slot_pool.set_limit(Some(slots));
    Ok((Some(KvCapacity { device: Device::Cuda(pool.ordinal()), blocks, block_bytes, slots, state_bytes, state_dtype: slot_pool.layout().dtype, reserved_bytes: reserved }), prefix_cache))
}

/// Bytes of activations a forward call's workspace takes per token row (backend/cuda/qwen35/
/// workspace.rs: the rows' buffers), rounded up.
fn workspace_bytes_per_row(c: &Qwen35Config) -> usize {
    let (h, cd, vd, hv, f) = (c.hidden_size, c.linear_conv_dim(), c.linear_value_dim(), c.linear_num_value_heads, c.intermediate_size);
    let (qd, kvd, dk, dv) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.linear_key_head_dim, c.linear_value_head_dim);
    let floats = h + 2 * cd + 2 * vd + 2 * hv + hv * (1 + dk + dv + 64) + 2 * qd + 2 * kvd + 3 * qd + 2 * f;
    4 * floats + 2 * h.max(vd).max(qd).max(f)
}


#[cfg(test)]
mod tests {
    use super::*;

    /// The default device tier takes a quarter of what the K/V cache would get, at most 8 GiB
    /// (a GPU with little room past the weights keeps most of it for running requests); a
    /// size given is taken as it is.
    #[test]
    fn the_default_device_tier_is_a_quarter_of_the_k_v_cache_at_most_8_gib() {
        let mut config = PipelineConfig {
            mode: Mode::Hybrid,
            prefill: EngineSpec::parse("cuda:0").unwrap(),
            decode: EngineSpec::parse("cuda:0").unwrap(),
            transfer: Transfer::Move,
            max_batch: 4,
            max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS,
            kv_cache: KvBudget::Unlimited,
            trace: None,
            prefix_cache_device: PipelineConfig::DEVICE_TIER_DEFAULT,
            device_snapshots: false,
        };
        assert_eq!(config.device_tier_bytes(Some(4 << 30)), 1 << 30);
        assert_eq!(config.device_tier_bytes(Some(100 << 30)), 8 << 30);
        assert_eq!(config.device_tier_bytes(None), 8 << 30);
        config.prefix_cache_device = 3 << 30;
        assert_eq!(config.device_tier_bytes(Some(4 << 30)), 3 << 30);
    }
}
