//! The pipeline between the engines. Requests queue for the prefill engine (`prefill.rs`),
//! which takes those that wait together (a GPU engine prefills them in one packed forward);
//! each prefilled state crosses the bridge (`bridge::handoff`) to the decode engine
//! (`decode.rs`), which decodes every active sequence in one batched step per token. With two
//! engines (hybrid) the two run at once on their own threads (and cores): while the decode
//! engine decodes request k, the prefill engine prefills k+1. With one engine (the study's
//! pure modes) a single thread does both, prefilling new requests between decode steps.
//!
//! The handoff position is exact: a prefilled state covers the prompt `[0, N)` and carries the
//! logits of token N-1; the decode side samples its first token from those logits and applies
//! only tokens it sampled.

mod decode;
mod prefill;
pub mod request;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub use request::{Event, Finish, Generated, Request, RequestParams, Timings};

use crate::bridge::{handoff, Transfer};
use crate::engine::{Engine, EngineSpec};
use crate::model::Qwen35;
use crate::sampling::SamplingParams;
use crate::state::State;

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
    /// wait into one (a CUDA engine); a longer prompt goes alone.
    pub max_prefill_tokens: usize,
}

impl PipelineConfig {
    /// The default budget of one packed prefill: 16 prompts of 512 tokens.
    pub const MAX_PREFILL_TOKENS: usize = 8192;
}

/// Time the engines spent computing, in nanoseconds, since the pipeline started: prefill work
/// (the prefill engine's, or the single engine's prefills) and decode steps.
#[derive(Default)]
struct EngineTime {
    prefill_ns: AtomicU64,
    decode_ns: AtomicU64,
}

impl EngineTime {
    fn add(counter: &AtomicU64, since: Instant) {
        counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// The caller's side of a running pipeline. Clones submit to the same engines; the pipeline
/// stops once every clone is dropped (after `run`'s body returns).
#[derive(Clone)]
pub struct Pipeline {
    requests: Sender<(Request, Instant)>,
    engine_time: Arc<EngineTime>,
}

impl Pipeline {
    /// Engine time spent on (prefill, decode) work since the pipeline started.
    pub fn busy(&self) -> (Duration, Duration) {
        let get = |c: &AtomicU64| Duration::from_nanos(c.load(Ordering::Relaxed));
        (get(&self.engine_time.prefill_ns), get(&self.engine_time.decode_ns))
    }

    /// Queue a request; its events arrive on `request.events`.
    pub fn submit(&self, request: Request) -> Result<()> {
        self.requests.send((request, Instant::now())).map_err(|_| anyhow::anyhow!("the pipeline has stopped"))
    }

    /// Run one request to the end and return its outcome (with the final state), passing each
    /// token to `on_token` as it is sampled.
    pub fn generate(&self, start: Option<State>, tokens: Vec<u32>, params: &RequestParams, mut on_token: impl FnMut(u32) -> Result<()>) -> Result<Generated> {
        let (events, rx) = channel();
        self.submit(Request {
            id: 0,
            start,
            tokens,
            max_tokens: params.max_tokens,
            sampling: params.sampling.clone(),
            vocab: params.vocab,
            stop_ids: params.stop_ids.clone(),
            return_state: true,
            cancel: Arc::new(AtomicBool::new(false)),
            events,
        })?;
        let mut out = Vec::new();
        for event in rx {
            match event {
                Event::Token { token, .. } => {
                    out.push(token);
                    on_token(token)?;
                }
                Event::Done { finish, timings, state, .. } => return Ok(Generated { tokens: out, finish, timings, state }),
                Event::Failed { error, .. } => bail!("{error}"),
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
/// whether that worked; None after a failure was reported.
fn start_engine<'m>(spec: &EngineSpec, net: &'m Qwen35, ready: &Sender<Result<()>>, what: &str) -> Option<Engine<'m>> {
    match Engine::new(spec, net) {
        Ok(e) => {
            let _ = ready.send(Ok(()));
            Some(e)
        }
        Err(e) => {
            let _ = ready.send(Err(e.context(format!("starting the {what}"))));
            None
        }
    }
}

/// Run a pipeline for the duration of `body`: the engines start on their own threads (made
/// there, so that pinned pools pin those threads), `body` submits requests, and when it
/// returns the pipeline drains and stops. Engine start-up errors are returned.
pub fn run<T>(net: &Qwen35, config: &PipelineConfig, body: impl FnOnce(&Pipeline) -> Result<T>) -> Result<T> {
    if config.max_batch == 0 {
        bail!("max batch must be at least 1");
    }
    if config.max_prefill_tokens == 0 {
        bail!("the prefill token budget must be at least 1");
    }
    let (req_tx, req_rx) = channel::<(Request, Instant)>();
    let engine_time = Arc::new(EngineTime::default());
    let pipeline = Pipeline { requests: req_tx, engine_time: Arc::clone(&engine_time) };
    std::thread::scope(|s| {
        let (ready_tx, ready_rx) = channel::<Result<()>>();
        let mut threads = Vec::new();
        let time = &engine_time;
        let (max_batch, max_prefill_tokens) = (config.max_batch, config.max_prefill_tokens);
        match config.mode {
            Mode::AllOnPrefillEngine | Mode::AllOnDecodeEngine => {
                let spec = if config.mode == Mode::AllOnPrefillEngine { &config.prefill } else { &config.decode };
                let ready = ready_tx.clone();
                threads.push(s.spawn(move || {
                    if let Some(engine) = start_engine(spec, net, &ready, "engine") {
                        decode::single_engine_loop(&engine, prefill::Queue::new(req_rx), max_batch, max_prefill_tokens, time);
                    }
                }));
            }
            Mode::Hybrid => {
                let (to_decode, from_prefill) = handoff::channel(&config.transfer, net.fingerprint(), &net.config)?;
                let (ready_p, ready_d) = (ready_tx.clone(), ready_tx.clone());
                threads.push(s.spawn(move || {
                    if let Some(engine) = start_engine(&config.prefill, net, &ready_p, "prefill engine") {
                        prefill::prefill_loop(&engine, prefill::Queue::new(req_rx), to_decode, max_prefill_tokens, time);
                    }
                }));
                threads.push(s.spawn(move || {
                    if let Some(engine) = start_engine(&config.decode, net, &ready_d, "decode engine") {
                        decode::decode_loop(&engine, from_prefill, max_batch, time);
                    }
                }));
            }
        }
        drop(ready_tx);
        for _ in 0..threads.len() {
            if let Ok(Err(e)) = ready_rx.recv() {
                drop(pipeline);
                return Err(e);
            }
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
