//! An engine is a backend, its resources and a prefill dispatch contract, written as a
//! placement (`EngineSpec`), e.g. `cpu:cores=0,dispatch=batched:32`: the CPU kernels on a pool
//! pinned to core 0, prefilling in fixed 32-token dispatches as a static-shape accelerator
//! would (the study's Neural Engine). `cuda:0` is the CUDA engine on GPU 0 (backend::cuda). A
//! pipeline has a prefill engine and a decode engine; both may be the same. An engine keeps the
//! states it works on where it computes (`DeviceState`); a state that reaches an engine of
//! another device is copied there first (`bridge::device`: host to GPU, GPU to host, or GPU to
//! GPU).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use std::sync::Arc;

use crate::backend::cuda::qwen35::kv_cache::KvPool;
use crate::backend::cuda::qwen35::state_slots::{SlotPool, StateDtype};
use crate::backend::cuda::qwen35::device_pool::PoolFull;
use crate::backend::cuda::qwen35::{GpuPools, GpuQwen35, GpuState, Precision};
use crate::model::{Logits, Qwen35};
use crate::backend::cpu::pool::Pool;
use crate::backend::cpu::CpuPrecision;
use std::borrow::Cow;
use crate::sampling::{GpuDraw, Sampler};
use crate::state::{DeviceState, Snapshot, State};
use crate::bridge::device;

/// How an engine applies a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dispatch {
    /// One token per dispatch (the study's first engine).
    Sequential,
    /// Fixed dispatches of N rows; the last one right-padded and masked.
    Batched(usize),
    /// One static shape per bucket (ascending): each dispatch takes the smallest bucket that
    /// holds the rest of the prompt, or the largest one, padded and masked.
    Buckets(Vec<usize>),
    /// Whatever the prompt needs, in one call.
    Dynamic,
}

impl Dispatch {
    pub fn parse(s: &str) -> Result<Dispatch> {
        let positive = |v: &str| -> Result<usize> {
            match v.trim().parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => bail!("dispatch {s:?}: {v:?} is not a positive number of tokens"),
            }
        };
        Ok(match s.split_once(':') {
            None if s == "sequential" => Dispatch::Sequential,
            None if s == "dynamic" => Dispatch::Dynamic,
            Some(("batched", n)) => Dispatch::Batched(positive(n)?),
            Some(("buckets", list)) => {
                let mut b = list.split(',').map(positive).collect::<Result<Vec<_>>>()?;
                b.sort_unstable();
                b.dedup();
                Dispatch::Buckets(b)
            }
            _ => bail!("unknown dispatch {s:?}: choose sequential, batched:N, buckets:64,256,512 or dynamic"),
        })
    }

    /// The dispatches of an `n`-token prompt: (real tokens, rows) each.
    pub fn plan(&self, n: usize) -> Vec<(usize, usize)> {
        match self {
            Dispatch::Sequential => vec![(1, 1); n],
            Dispatch::Dynamic => vec![(n, n)],
            Dispatch::Batched(size) => (0..n).step_by(*size).map(|i| ((n - i).min(*size), *size)).collect(),
            Dispatch::Buckets(buckets) => {
                let mut plan = Vec::new();
                let mut left = n;
                while left > 0 {
                    let b = buckets.iter().copied().find(|&b| b >= left).unwrap_or(*buckets.last().expect("buckets are never empty"));
                    plan.push((left.min(b), b));
                    left -= left.min(b);
                }
                plan
            }
        }
    }
}

impl std::fmt::Display for Dispatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dispatch::Sequential => write!(f, "sequential"),
            Dispatch::Dynamic => write!(f, "dynamic"),
            Dispatch::Batched(n) => write!(f, "batched:{n}"),
            Dispatch::Buckets(b) => write!(f, "buckets:{}", b.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",")),
        }
    }
}

/// An engine to start, parsed from its placement: where it runs and how it dispatches,
/// `cpu[:cores=0-3|threads=N][,precision=exact|fast][,dispatch=MODE]`
/// or `cuda[:N][,precision=exact|tensor-cores|fast][,state=f32|bf16][,dispatch=MODE]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineSpec {
    pub device: Device,
    /// Pin one worker to each of these cores (the engine's thread takes the first).
    pub cores: Option<Vec<usize>>,
    /// Or this many unpinned workers (default: every core).
    pub threads: Option<usize>,
    pub dispatch: Dispatch,
    /// How a CUDA engine computes prefill products (tensor cores unless asked otherwise).
    pub precision: Precision,
    /// How a CPU engine multiplies (`precision=exact|fast`; exact unless asked otherwise).
    pub cpu_precision: CpuPrecision,
    /// Whether a CUDA engine replays decode steps from CUDA graphs (on unless asked otherwise).
    pub graphs: bool,
    /// Whether a CUDA engine's stream runs at the GPU's highest priority (`priority=high`;
    /// None: as `normal`). For a decode engine sharing its GPU with a prefill engine it
    /// measured no better by default: on an H200 the 0.8B served 1-9% fewer tokens, and the
    /// 9B's decode steps starved its prefills (TTFT p50 3.3 s against 0.65 s at 32 requests)
    /// while its inter-token p99 fell from 80 to 40 ms (docs/results, packed prefill).
    pub high_priority: Option<bool>,
    /// The dtype a CUDA engine keeps its states' recurrent states in (`state=bf16`; f32 unless
    /// asked otherwise).
    pub state_dtype: StateDtype,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl EngineSpec {
    /// Parse a placement. Values may contain commas (`cores=0,1`, `buckets:64,256`): a part
    /// without `=` continues the previous value.
    pub fn parse(spec: &str) -> Result<EngineSpec> {
        let (backend, mut opts) = spec.split_once(':').unwrap_or((spec, ""));
        let device = match backend {
            "cpu" => Device::Cpu,
            "cuda" => {
                // `cuda:N` names the GPU; `cuda` alone is GPU 0.
                let (first, rest) = opts.split_once(',').unwrap_or((opts, ""));
                if first.contains('=') || first.is_empty() {
                    Device::Cuda(0)
                } else {
                    opts = rest;
                    Device::Cuda(first.trim().parse().map_err(|_| anyhow::anyhow!("placement {spec:?}: {first:?} is not a GPU number (cuda:0, cuda:1, ...)"))?)
                }
            }
            other => bail!("placement {spec:?}: unknown backend {other:?} (choose cpu or cuda:N)"),
        };
        let mut pairs: Vec<(String, String)> = Vec::new();
        for part in opts.split(',').filter(|p| !p.is_empty()) {
            match part.split_once('=') {
                Some((k, v)) => pairs.push((k.trim().to_string(), v.trim().to_string())),
                None => match pairs.last_mut() {
                    Some((_, v)) => {
                        v.push(',');
                        v.push_str(part.trim());
                    }
                    None => bail!("placement {spec:?}: {part:?} is not key=value"),
                },
            }
        }
        let mut p = EngineSpec { device, cores: None, threads: None, dispatch: Dispatch::Dynamic, precision: Precision::TensorCores, cpu_precision: CpuPrecision::Exact, graphs: true, high_priority: None, state_dtype: StateDtype::F32 };
        for (k, v) in pairs {
            match (k.as_str(), device) {
                ("cores", Device::Cpu) => p.cores = Some(parse_cores(&v).with_context(|| format!("placement {spec:?}"))?),
                ("threads", Device::Cpu) => match v.parse::<usize>() {
                    Ok(n) if n > 0 => p.threads = Some(n),
                    _ => bail!("placement {spec:?}: threads={v:?} is not a positive number"),
                },
                ("precision", Device::Cpu) => {
                    p.cpu_precision = match v.as_str() {
                        "exact" => CpuPrecision::Exact,
                        "fast" => CpuPrecision::Fast,
                        _ => bail!("placement {spec:?}: precision={v:?}: choose exact or fast"),
                    }
                }
                ("precision", Device::Cuda(_)) => {
                    p.precision = match v.as_str() {
                        "exact" => Precision::Exact,
                        "tensor-cores" => Precision::TensorCores,
                        "fast" => Precision::Fast,
                        _ => bail!("placement {spec:?}: precision={v:?}: choose exact, tensor-cores or fast"),
                    }
                }
                ("graphs", Device::Cuda(_)) => {
                    p.graphs = match v.as_str() {
                        "on" => true,
                        "off" => false,
                        _ => bail!("placement {spec:?}: graphs={v:?}: choose on or off"),
                    }
                }
                ("priority", Device::Cuda(_)) => {
                    p.high_priority = Some(match v.as_str() {
                        "high" => true,
                        "normal" => false,
                        _ => bail!("placement {spec:?}: priority={v:?}: choose high or normal"),
                    })
                }
                ("state", Device::Cuda(_)) => p.state_dtype = StateDtype::parse(&v).with_context(|| format!("placement {spec:?}: state={v:?}"))?,
                ("dispatch", _) => p.dispatch = Dispatch::parse(&v).with_context(|| format!("placement {spec:?}"))?,
                (other, Device::Cpu) => bail!("placement {spec:?}: unknown key {other:?} (keys: cores, threads, precision, dispatch)"),
                (other, Device::Cuda(_)) => bail!("placement {spec:?}: unknown key {other:?} (keys: precision, state, graphs, priority, dispatch)"),
            }
        }
        if p.cores.is_some() && p.threads.is_some() {
            bail!("placement {spec:?}: give cores or threads, not both");
        }
        Ok(p)
    }

    /// The worker pool this placement asks for, pinning the calling thread when it names cores.
    pub fn pool(&self) -> Result<Pool> {
        match (&self.cores, self.threads) {
            (Some(cores), _) => Pool::pinned(cores),
            (None, Some(n)) => Ok(Pool::new(n)),
            (None, None) => Ok(Pool::new(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))),
        }
    }
}

impl std::fmt::Display for EngineSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Device::Cuda(n) = self.device {
            let precision = match self.precision {
                Precision::Exact => "exact",
                Precision::TensorCores => "tensor-cores",
                Precision::Fast => "fast",
            };
            let graphs = if self.graphs { "" } else { ",graphs=off" };
            let priority = match self.high_priority {
                Some(true) => ",priority=high",
                Some(false) => ",priority=normal",
                None => "",
            };
            let state = match self.state_dtype {
                StateDtype::F32 => String::new(),
                other => format!(",state={other}"),
            };
            return write!(f, "cuda:{n},precision={precision}{state}{graphs}{priority},dispatch={}", self.dispatch);
        }
        write!(f, "cpu:")?;
        match (&self.cores, self.threads) {
            (Some(c), _) => write!(f, "cores={},", c.iter().map(|c| c.to_string()).collect::<Vec<_>>().join("+"))?,
            (None, Some(n)) => write!(f, "threads={n},")?,
            (None, None) => {}
        }
        if self.cpu_precision == CpuPrecision::Fast {
            write!(f, "precision=fast,")?;
        }
        write!(f, "dispatch={}", self.dispatch)
    }
}

/// `0`, `0,1`, `0-3`, `0+2` (also mixed: `0-1,4`).
fn parse_cores(s: &str) -> Result<Vec<usize>> {
    let num = |x: &str| x.trim().parse::<usize>().map_err(|_| anyhow::anyhow!("cores: {x:?} is not a core number"));
    let mut cores = Vec::new();
    for part in s.split([',', '+']) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    bail!("cores: range {part:?} runs backwards");
                }
                cores.extend(a..=b);
            }
            None => cores.push(num(part)?),
        }
    }
    if cores.is_empty() {
        bail!("cores: no core given");
    }
    Ok(cores)
}

/// What one prefill did.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefillStats {
    pub tokens: usize,
    pub dispatches: usize,
    /// Rows computed beyond the real tokens (the padding of static-shape dispatches).
    pub padded_rows: usize,
    pub time: Duration,
}

/// What an engine computes with.
enum Backend {
    Cpu(Pool),
    Cuda(Box<GpuQwen35>),
}

/// An engine: the model's kernels on a CPU worker pool or on a GPU, with a dispatch mode. It
/// must be made on the thread that will run it (a pinned pool pins that thread).
pub struct Engine<'m> {
    pub spec: EngineSpec,
    /// The model; a CPU engine whose precision differs from the model's holds its own view of
    /// it (the weights shared).
    pub net: Cow<'m, Qwen35>,
    backend: Backend,
}

impl<'m> Engine<'m> {
    /// Start an engine: a worker pool, or a GPU with the model's weights copied to it (each
    /// CUDA engine holds its own copy, also two engines on one GPU).
    pub fn new(spec: &EngineSpec, net: &'m Qwen35) -> Result<Engine<'m>> {
        let backend = match spec.device {
            Device::Cpu => Backend::Cpu(spec.pool()?),
            Device::Cuda(n) => {
                let gpu = crate::backend::cuda::Gpu::open_with_priority(n, spec.high_priority == Some(true))?;
                let mut g = GpuQwen35::upload(gpu, net, spec.precision).with_context(|| format!("loading the model onto cuda:{n}"))?;
                g.graphs = spec.graphs;
                g.set_state_dtype(spec.state_dtype)?;
                Backend::Cuda(Box::new(g))
            }
        };
        let net = match spec.device {
            Device::Cpu if net.cpu_precision() != spec.cpu_precision => {
                let mut own = net.clone();
                own.set_cpu_precision(spec.cpu_precision);
                Cow::Owned(own)
            }
            _ => Cow::Borrowed(net),
        };
        Ok(Engine { spec: spec.clone(), net, backend })
    }

    /// The CPU worker pool (None for a GPU engine).
    pub fn pool(&self) -> Option<&Pool> {
        match &self.backend {
            Backend::Cpu(p) => Some(p),
            Backend::Cuda(_) => None,
        }
    }

    /// The GPU model (None for a CPU engine).
    pub fn gpu(&self) -> Option<&GpuQwen35> {
        match &self.backend {
            Backend::Cpu(_) => None,
            Backend::Cuda(g) => Some(g),
        }
    }

    /// The GPU engine's K/V block pool (None for a CPU engine).
    pub fn kv_pool(&self) -> Option<&Arc<KvPool>> {
        self.gpu().map(|g| g.kv_pool())
    }

    /// The GPU engine's pools: K/V blocks and state slots (None for a CPU engine).
    pub fn pools(&self) -> Option<GpuPools> {
        self.gpu().map(GpuQwen35::pools)
    }

    /// The GPU engine's pool of state slots (None for a CPU engine).
    pub fn slot_pool(&self) -> Option<&Arc<SlotPool>> {
        self.gpu().map(|g| g.slot_pool())
    }

    /// Take the K/V blocks and slots of this GPU engine's states from `pools` (another
    /// engine's on the same GPU), so that one budget covers both and states move between them
    /// as they are.
    pub fn share_pools(&mut self, pools: GpuPools) -> Result<()> {
        match &mut self.backend {
            Backend::Cuda(g) => g.share_pools(pools),
            Backend::Cpu(_) => bail!("a CPU engine keeps no K/V block or state slot pool"),
        }
    }

    /// Keep the snapshots this GPU engine takes (`snapshot`) on its GPU; a CPU engine's stay in
    /// host memory, where its states are.
    pub fn keep_snapshots_on_device(&mut self) -> Result<()> {
        match &mut self.backend {
            Backend::Cuda(g) => g.keep_snapshots_on_device(),
            Backend::Cpu(_) => Ok(()),
        }
    }

    /// A copy of `state` for a prefix cache: on the GPU where this engine keeps snapshots there
    /// and has room (a snapshot on the GPU takes a slot of its own, shares the state's full
    /// K/V blocks and copies the last), else in host memory.
    pub fn snapshot(&self, state: &DeviceState) -> Result<Snapshot> {
        if let (Backend::Cuda(g), DeviceState::Gpu(s)) = (&self.backend, state) {
            match g.snapshot_state(s) {
                Ok(Some(kept)) => return Ok(Snapshot::Gpu(kept)),
                Ok(None) => {}
                Err(e) if PoolFull::is(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(state.snapshot()?.into())
    }

    /// A state that goes on from `snapshot`, where this engine keeps its states: a snapshot on
    /// this GPU copied there (its full K/V blocks shared), one in host memory uploaded (a GPU
    /// engine) or copied. `logits`: whether the state must come with its last logits (nothing
    /// is left to prefill; a snapshot on the GPU may leave them out otherwise). A `PoolFull`
    /// error where a GPU engine has no slot or block free.
    pub fn restore(&self, snapshot: &Snapshot, logits: bool) -> Result<DeviceState> {
        Ok(match (&self.backend, snapshot) {
            (Backend::Cuda(g), Snapshot::Gpu(s)) => DeviceState::Gpu(Box::new(g.restore_state(s, logits)?)),
            (Backend::Cuda(g), Snapshot::Host(s)) => DeviceState::Gpu(Box::new(g.place_snapshot(s)?)),
            (Backend::Cpu(_), s) => DeviceState::Host(s.to_host()?),
        })
    }

    /// A copy of `state` that goes on apart from it (another choice of the same prompt): on
    /// this engine's GPU where its pools have room, else in host memory.
    pub fn fork(&self, state: &DeviceState) -> Result<DeviceState> {
        if let (Backend::Cuda(g), DeviceState::Gpu(s)) = (&self.backend, state) {
            match g.copy_state(s) {
                Ok(copy) => return Ok(DeviceState::Gpu(Box::new(copy))),
                Err(e) if PoolFull::is(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(DeviceState::Host(state.snapshot()?.into_owned()))
    }

    /// Blocks of `KV_BLOCK` positions this engine's K/V cache could still give out under its
    /// limit: None where nothing limits it (a CPU engine, or a pool without a limit).
    pub fn kv_room(&self) -> Option<usize> {
        self.kv_pool().and_then(|p| p.available())
    }

    /// Bring `state` to this engine and let it hold `end` positions: a GPU state takes the K/V
    /// blocks it lacks now (all or none: a `PoolFull` error where the pool's limit is
    /// reached). A CPU engine's states grow as they go.
    pub fn reserve_kv(&self, state: &mut DeviceState, end: usize) -> Result<()> {
        device::move_in_place(self.gpu(), state)?;
        match (&self.backend, state) {
            (Backend::Cuda(g), DeviceState::Gpu(s)) => g.reserve_kv(s, end),
            _ => Ok(()),
        }
    }

    /// Take what a GPU engine's batched decode steps need from its pools before any request
    /// does (the state its padding rows decode into); nothing on a CPU engine.
    pub fn reserve_batch_padding(&self) -> Result<()> {
        match &self.backend {
            Backend::Cuda(g) => g.reserve_batch_padding(),
            Backend::Cpu(_) => Ok(()),
        }
    }

    /// A fresh state, where this engine keeps it.
    pub fn new_state(&self) -> Result<DeviceState> {
        Ok(match &self.backend {
            Backend::Cpu(_) => DeviceState::Host(State::new(&self.net.config)),
            Backend::Cuda(g) => DeviceState::Gpu(Box::new(g.new_state()?)),
        })
    }

    /// Apply `tokens` to `state` in this engine's dispatches; the state's last logits end up
    /// those of the last token. A CUDA engine runs each dispatch at its real size (a GPU has
    /// no static shapes to pad to).
    pub fn prefill(&self, tokens: &[u32], state: &mut DeviceState) -> Result<PrefillStats> {
        let start = Instant::now();
        device::move_in_place(self.gpu(), state)?;
        let plan = self.spec.dispatch.plan(tokens.len());
        let mut at = 0;
        let mut padded_rows = 0;
        for (i, &(real, rows)) in plan.iter().enumerate() {
            let part = &tokens[at..at + real];
            // Logits from the last dispatch alone (nothing samples in between).
            let which = if i + 1 == plan.len() { Logits::Last } else { Logits::Skip };
            match (&self.backend, &mut *state) {
                (Backend::Cuda(g), DeviceState::Gpu(s)) => {
                    g.apply(part, s)?;
                }
                (Backend::Cpu(pool), DeviceState::Host(s)) => match self.spec.dispatch {
                    Dispatch::Sequential | Dispatch::Dynamic => {
                        self.net.forward(pool, part, s, which)?;
                    }
                    Dispatch::Batched(_) | Dispatch::Buckets(_) => {
                        let mut shaped = part.to_vec();
                        // Pad id 0: any id works, pads are masked out.
                        shaped.resize(rows, 0);
                        self.net.forward_padded(pool, &shaped, real, s, which)?;
                        padded_rows += rows - real;
                    }
                },
                _ => unreachable!("move_in_place brought the state here"),
            }
            at += real;
        }
        Ok(PrefillStats { tokens: tokens.len(), dispatches: plan.len(), padded_rows, time: start.elapsed() })
    }

    /// Whether `prefill_batch` packs several prompts into one forward: a CUDA engine that
    /// dispatches dynamically (a CPU engine's prefill already keeps its cores busy with one
    /// prompt; a static-shape dispatch prefills one prompt at a time, as its device would).
    pub fn packs_prompts(&self) -> bool {
        matches!(self.backend, Backend::Cuda(_)) && self.spec.dispatch == Dispatch::Dynamic
    }

    /// Refuse a prompt that this engine cannot apply at `position` (too long for its context),
    /// before anything is applied.
    pub fn check_prompt(&self, tokens: &[u32], position: usize) -> Result<()> {
        match &self.backend {
            Backend::Cuda(g) => g.check_prompt(tokens, position),
            Backend::Cpu(_) => self.net.config.check_input(tokens, position, tokens.len(), self.net.config.max_position_embeddings, "the model's"),
        }
    }

    /// Apply `prompts[i]` to `states[i]`, all in one forward (`GpuQwen35::prefill_batch`:
    /// every prompt checked first, so an error changes no state); each state's last logits are
    /// those of its prompt's last token. Each prompt's stats carry the time of the whole call.
    /// Only for engines that `packs_prompts`.
    pub fn prefill_batch(&self, prompts: &[&[u32]], states: &mut [&mut DeviceState]) -> Result<Vec<PrefillStats>> {
        let start = Instant::now();
        let Backend::Cuda(g) = &self.backend else { bail!("prefill_batch: a CPU engine prefills one prompt at a time") };
        if !self.packs_prompts() {
            bail!("prefill_batch: this engine dispatches {}; packing prompts takes dynamic dispatch", self.spec.dispatch);
        }
        for s in states.iter_mut() {
            device::move_in_place(self.gpu(), s)?;
        }
        let mut on_gpu: Vec<&mut GpuState> = states
            .iter_mut()
            .map(|s| match &mut **s {
                DeviceState::Gpu(s) => &mut **s,
                DeviceState::Host(_) => unreachable!("moved here"),
            })
            .collect();
        g.prefill_batch(prompts, &mut on_gpu)?;
        let time = start.elapsed();
        Ok(prompts.iter().map(|p| PrefillStats { tokens: p.len(), dispatches: 1, padded_rows: 0, time }).collect())
    }

    /// The next token of each sequence (its state and sampler), from its state's last logits:
    /// a GPU engine picks on the GPU where its step left the logits (only ids cross): a greedy
    /// pick is the step's argmax; draws at a temperature are made all in one launch; a sampler
    /// whose grammar alone changes the logits has its row masked there (the masks computed on
    /// the host, ahead where `Sampler::prepare` was called). Else the host samples the row.
    pub fn sample(&self, seqs: &mut [(&mut DeviceState, &mut Sampler)]) -> Vec<Result<u32>> {
        let mut picks: Vec<Option<Result<u32>>> = (0..seqs.len()).map(|_| None).collect();
        // Per sequence, what the GPU was asked for (a draw, or a masked pick with its draw or
        // None for greedy) and its answer: the id, None where the host picks, or the launch's
        // error (as text, for each of its rows).
        let mut asked: Vec<Option<(GpuAsk, GpuAnswer)>> = vec![None; seqs.len()];
        if let Backend::Cuda(g) = &self.backend {
            let (mut draws, mut masked) = (Vec::new(), Vec::new());
            for (i, (state, sampler)) in seqs.iter_mut().enumerate() {
                let DeviceState::Gpu(s) = &**state else { continue };
                if let Some(d) = sampler.gpu_draw() {
                    draws.push((i, &**s, d));
                } else if let Some(p) = sampler.gpu_masked_pick() {
                    match p {
                        Ok(p) => masked.push((i, &**s, p)),
                        Err(e) => picks[i] = Some(Err(e)),
                    }
                }
            }
            if !draws.is_empty() {
                let rows: Vec<_> = draws.iter().map(|&(_, s, d)| (s, d)).collect();
                let ids = g.sample_rows(&rows).map_err(|e| format!("{e:#}"));
                for (k, &(i, _, d)) in draws.iter().enumerate() {
                    asked[i] = Some((GpuAsk::Draw(d), ids.as_ref().map(|ids| ids[k]).map_err(Clone::clone)));
                }
            }
            if !masked.is_empty() {
                let rows: Vec<_> = masked.iter().map(|&(_, s, p)| (s, p)).collect();
                let ids = g.sample_masked(&rows).map_err(|e| format!("{e:#}"));
                for (k, &(i, _, p)) in masked.iter().enumerate() {
                    asked[i] = Some((GpuAsk::Masked(p.draw), ids.as_ref().map(|ids| ids[k]).map_err(Clone::clone)));
                }
            }
        }
        // The rows the host samples are brought over first (a copy each), then sampled side by
        // side on a GPU engine's machine where there are several: a grammar's mask costs a few
        // hundred microseconds a row, which the decode thread would otherwise pay for each in
        // turn. (A CPU engine's cores are its own engines'.)
        let (mut at, mut rows): (Vec<usize>, Vec<(&[f32], &mut Sampler)>) = (Vec::new(), Vec::new());
        for (i, ((state, sampler), asked)) in seqs.iter_mut().zip(asked).enumerate() {
            if picks[i].is_some() {
                continue;
            }
            // A greedy pick the GPU's argmax already made (no logits cross to the host).
            let greedy = match &**state {
                DeviceState::Gpu(s) => s.last_argmax().and_then(|a| sampler.greedy_pick(a)),
                DeviceState::Host(_) => None,
            };
            picks[i] = match asked {
                Some((GpuAsk::Draw(_), Ok(Some(id)))) => Some(Ok(id)),
                Some((GpuAsk::Masked(_), Ok(Some(id)))) => {
                    sampler.took(id);
                    Some(Ok(id))
                }
                Some((_, Err(e))) => Some(Err(anyhow::anyhow!("picking on the GPU: {e}"))),
                Some((GpuAsk::Draw(d) | GpuAsk::Masked(Some(d)), Ok(None))) => Some(state.last_logits().and_then(|l| sampler.sample_drawn(l, d.u))),
                _ if greedy.is_some() => greedy.map(Ok),
                _ => match state.last_logits() {
                    Ok(row) => {
                        at.push(i);
                        rows.push((row, &mut **sampler));
                        None
                    }
                    Err(e) => Some(Err(e)),
                },
            };
        }
        let threads = self.sampling_threads(rows.len());
        for (i, pick) in at.into_iter().zip(crate::sampling::sample_side_by_side(&mut rows, threads)) {
            picks[i] = Some(pick);
        }
        picks.into_iter().map(|p| p.expect("every sequence picked")).collect()
    }

    /// How many threads the host's sampling of `rows` rows takes (or the grammars' masks
    /// computed ahead for them): on a GPU engine's machine all its cores but two (the decode
    /// and prefill threads'), at most 16, and at least two rows each; one on a CPU engine,
    /// whose cores are its engines'.
    pub fn sampling_threads(&self, rows: usize) -> usize {
        match self.backend {
            Backend::Cuda(_) => std::thread::available_parallelism().map_or(1, |n| n.get()).saturating_sub(2).clamp(1, 16).min(rows / 2).max(1),
            Backend::Cpu(_) => 1,
        }
    }

    /// One decode step: `tokens[i]` applied to `states[i]`, all in one pass over the weights.
    pub fn decode(&self, tokens: &[u32], states: &mut [&mut DeviceState]) -> Result<()> {
        for s in states.iter_mut() {
            device::move_in_place(self.gpu(), s)?;
        }
        match &self.backend {
            Backend::Cpu(pool) => {
                let mut host: Vec<&mut State> = states.iter_mut().map(|s| match &mut **s {
                    DeviceState::Host(s) => s,
                    DeviceState::Gpu(_) => unreachable!("moved here"),
                }).collect();
                self.net.decode_batch(pool, tokens, &mut host)
            }
            Backend::Cuda(g) => {
                let mut on_gpu: Vec<&mut GpuState> = states.iter_mut().map(|s| match &mut **s {
                    DeviceState::Gpu(s) => &mut **s,
                    DeviceState::Host(_) => unreachable!("moved here"),
                }).collect();
                if let [state] = &mut on_gpu[..] {
                    g.apply(tokens, state)?;
                    return Ok(());
                }
                g.decode_batch(tokens, &mut on_gpu)
            }
        }
    }
}

/// A GPU's answer to a pick (`Engine::sample`): the id, None where the host picks, or the
/// launch's error as text (one for each of its rows).
type GpuAnswer = Result<Option<u32>, String>;

/// What a GPU engine was asked to pick for a sequence (`Engine::sample`).
#[derive(Clone, Copy)]
enum GpuAsk {
    /// A draw from the row as it is.
    Draw(GpuDraw),
    /// A pick from the row masked by a grammar: a draw, or greedy.
    Masked(Option<GpuDraw>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_commas_inside_values() {
        let p = EngineSpec::parse("cpu:cores=0,dispatch=batched:32").unwrap();
        assert_eq!(p.cores, Some(vec![0]));
        assert_eq!(p.dispatch, Dispatch::Batched(32));
        let p = EngineSpec::parse("cpu:cores=0,1,dispatch=buckets:256,64,512").unwrap();
        assert_eq!(p.cores, Some(vec![0, 1]));
        assert_eq!(p.dispatch, Dispatch::Buckets(vec![64, 256, 512]));
        assert_eq!(EngineSpec::parse("cpu:cores=0-2").unwrap().cores, Some(vec![0, 1, 2]));
        assert_eq!(EngineSpec::parse("cpu").unwrap(), EngineSpec { device: Device::Cpu, cores: None, threads: None, dispatch: Dispatch::Dynamic, precision: Precision::TensorCores, cpu_precision: CpuPrecision::Exact, graphs: true, high_priority: None, state_dtype: StateDtype::F32 });
        let p = EngineSpec::parse("cpu:threads=2,precision=fast").unwrap();
        assert_eq!((p.cpu_precision, p.to_string().as_str()), (CpuPrecision::Fast, "cpu:threads=2,precision=fast,dispatch=dynamic"));
        assert!(EngineSpec::parse("cpu:precision=tensor-cores").is_err());
        let p = EngineSpec::parse("cuda:1,precision=exact,dispatch=batched:32").unwrap();
        assert_eq!((p.device, p.precision, p.dispatch.clone()), (Device::Cuda(1), Precision::Exact, Dispatch::Batched(32)));
        let fast = EngineSpec::parse("cuda:0,precision=fast").unwrap();
        assert_eq!(fast.precision, Precision::Fast);
        assert_eq!(EngineSpec::parse(&fast.to_string()).unwrap(), fast);
        assert_eq!(p.to_string(), "cuda:1,precision=exact,dispatch=batched:32");
        assert_eq!(EngineSpec::parse("cuda").unwrap().device, Device::Cuda(0));
        let p = EngineSpec::parse("cuda:0,priority=high").unwrap();
        assert_eq!((p.high_priority, p.to_string().as_str()), (Some(true), "cuda:0,precision=tensor-cores,priority=high,dispatch=dynamic"));
        let p = EngineSpec::parse("cuda:0,state=bf16").unwrap();
        assert_eq!((p.state_dtype, p.to_string().as_str()), (StateDtype::Bf16, "cuda:0,precision=tensor-cores,state=bf16,dispatch=dynamic"));
        assert_eq!(EngineSpec::parse(&p.to_string()).unwrap(), p);
        assert_eq!(EngineSpec::parse("cuda:dispatch=sequential").unwrap().device, Device::Cuda(0));
        assert_eq!(EngineSpec::parse("cpu:threads=2,dispatch=sequential").unwrap().to_string(), "cpu:threads=2,dispatch=sequential");
        for (bad, says) in [
            ("gpu", "unknown backend"),
            ("cpu:cores=x", "not a core number"),
            ("cpu:dispatch=batched:0", "positive"),
            ("cpu:dispatch=chunky", "unknown dispatch"),
            ("cpu:speed=fast", "unknown key"),
            ("cpu:cores=1,threads=2", "not both"),
            ("cpu:0", "not key=value"),
            ("cuda:x", "not a GPU number"),
            ("cuda:0,cores=1", "keys: precision, state, graphs, priority, dispatch"),
            ("cuda:0,state=fp8", "state=\"fp8\": state dtype \"fp8\": choose f32 or bf16"),
            ("cpu:state=bf16", "keys: cores, threads, precision, dispatch"),
            ("cuda:0,priority=urgent", "choose high or normal"),
            ("cuda:0,graphs=maybe", "choose on or off"),
            ("cuda:0,precision=fp8", "choose exact, tensor-cores or fast"),
            ("cpu:precision=tensor-cores", "precision=\"tensor-cores\": choose exact or fast"),
        ] {
            let e = format!("{:#}", EngineSpec::parse(bad).unwrap_err());
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn dispatch_plans_cover_the_prompt_with_the_right_shapes() {
        assert_eq!(Dispatch::Batched(32).plan(74), vec![(32, 32), (32, 32), (10, 32)]);
        assert_eq!(Dispatch::Buckets(vec![64, 256, 512]).plan(74), vec![(74, 256)]);
        assert_eq!(Dispatch::Buckets(vec![64, 256]).plan(600), vec![(256, 256), (256, 256), (88, 256)]);
        assert_eq!(Dispatch::Buckets(vec![64, 256]).plan(40), vec![(40, 64)]);
        assert_eq!(Dispatch::Sequential.plan(3), vec![(1, 1); 3]);
        assert_eq!(Dispatch::Dynamic.plan(74), vec![(74, 74)]);
        for d in [Dispatch::Batched(7), Dispatch::Buckets(vec![3, 10]), Dispatch::Sequential, Dispatch::Dynamic] {
            for n in 1..50 {
                let plan = d.plan(n);
                assert_eq!(plan.iter().map(|p| p.0).sum::<usize>(), n, "{d} n={n}");
                assert!(plan.iter().all(|&(real, rows)| real >= 1 && real <= rows));
            }
        }
    }
}
