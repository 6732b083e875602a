//! The pipeline between the engines. Requests queue for the prefill engine; each prefilled
//! state crosses the bridge to the decode engine, which decodes every active sequence in one
//! batched step per token. With two engines (hybrid) the two run at once on their own threads
//! (and cores): while the decode engine decodes request k, the prefill engine prefills k+1.
//! With one engine (the study's pure modes) a single thread does both, prefilling new requests
//! between decode steps.
//!
//! The handoff position is exact: a prefilled state covers the prompt `[0, N)` and carries the
//! logits of token N-1; the decode side samples its first token from those logits and applies
//! only tokens it sampled.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::engine::{Engine, Placement, PrefillStats, Resident};
use crate::model::Qwen35;
use crate::sampling::{Sampler, SamplingParams};
use crate::state::bridge::{self, StateFile, TransferTimes};
use crate::state::State;

/// The study's three modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Prefill and decode on the prefill engine.
    PrefillEngine,
    /// Prefill and decode on the decode engine.
    DecodeEngine,
    /// Prefill on the prefill engine, bridge, decode on the decode engine.
    Hybrid,
}

impl Mode {
    pub fn parse(s: &str) -> Result<Mode> {
        Ok(match s {
            "prefill-engine" => Mode::PrefillEngine,
            "decode-engine" => Mode::DecodeEngine,
            "hybrid" => Mode::Hybrid,
            _ => bail!("unknown mode {s:?}: choose hybrid, prefill-engine or decode-engine"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::PrefillEngine => "prefill-engine",
            Mode::DecodeEngine => "decode-engine",
            Mode::Hybrid => "hybrid",
        }
    }
}

/// How a hybrid pipeline moves a state from the prefill to the decode engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transfer {
    /// The `State` itself moves to the other thread (no copy).
    Move,
    /// Written to a state file in this directory (default /dev/shm where there is one),
    /// memory-mapped by the reader.
    File(PathBuf),
    /// Streamed over a Unix socket.
    Socket,
}

impl Transfer {
    pub fn parse(s: &str) -> Result<Transfer> {
        Ok(match s.split_once(':') {
            None if s == "move" => Transfer::Move,
            None if s == "socket" => Transfer::Socket,
            None if s == "file" => Transfer::File(bridge::default_dir()),
            Some(("file", dir)) => Transfer::File(PathBuf::from(dir)),
            _ => bail!("unknown transfer {s:?}: choose move, file[:DIR] or socket"),
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Transfer::Move => "move",
            Transfer::File(_) => "file",
            Transfer::Socket => "socket",
        }
    }
}

#[derive(Clone, Debug)]
pub struct PipelineConfig {
    pub mode: Mode,
    pub prefill: Placement,
    pub decode: Placement,
    pub transfer: Transfer,
    /// Most sequences decoded in one step.
    pub max_batch: usize,
}

/// One request: tokens to apply to a state (fresh, or a checkpoint of a conversation), then
/// up to `max_tokens` sampled tokens. With `max_tokens == 0` it is a prefill only, and its
/// `Done` carries the state.
pub struct Request {
    pub id: u64,
    pub start: Option<State>,
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Ids that may be sampled (the tokenizer's vocabulary).
    pub vocab: usize,
    pub stop_ids: Vec<u32>,
    /// Send the final state back in `Done` (to checkpoint a conversation).
    pub return_state: bool,
    /// Set to stop the request; its state is dropped.
    pub cancel: Arc<AtomicBool>,
    /// Where this request's events go.
    pub events: Sender<Event>,
}

/// How to sample one request (for `Pipeline::generate`).
#[derive(Clone, Debug)]
pub struct Generation {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub vocab: usize,
    pub stop_ids: Vec<u32>,
}

/// What `Pipeline::generate` returns.
pub struct Generated {
    pub tokens: Vec<u32>,
    pub finish: Finish,
    pub timings: Timings,
    pub state: Option<State>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token was sampled (not emitted).
    Stop,
    /// `max_tokens` reached, or the model's context is full.
    Length,
    Cancelled,
    /// A prefill-only request is done.
    Prefilled,
}

/// Per-request timings, measured where they happen.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timings {
    /// Submitted to prefill start.
    pub queued: Duration,
    pub prefill: PrefillStats,
    /// The bridge (hybrid only).
    pub transfer: TransferTimes,
    /// Prefill done to decode admitted: the bridge plus the wait for the current decode step.
    pub handoff: Duration,
    /// Submitted to the first token sampled.
    pub ttft: Duration,
    /// First token to last token.
    pub decode: Duration,
    pub generated: usize,
}

impl Timings {
    pub fn decode_tok_s(&self) -> f64 {
        if self.generated < 2 {
            return 0.0;
        }
        (self.generated - 1) as f64 / self.decode.as_secs_f64()
    }
}

pub enum Event {
    Token { id: u64, token: u32 },
    Done { id: u64, finish: Finish, timings: Timings, state: Option<State> },
    Failed { id: u64, error: String },
}

impl Event {
    /// The request the event belongs to.
    pub fn id(&self) -> u64 {
        match self {
            Event::Token { id, .. } | Event::Done { id, .. } | Event::Failed { id, .. } => *id,
        }
    }
}

/// Time the engines spent computing, in nanoseconds, since the pipeline started: prefill work
/// (the prefill engine's, or the single engine's prefills) and decode steps.
#[derive(Default)]
struct Busy {
    prefill_ns: AtomicU64,
    decode_ns: AtomicU64,
}

impl Busy {
    fn add(counter: &AtomicU64, since: Instant) {
        counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// The caller's side of a running pipeline. Clones submit to the same engines; the pipeline
/// stops once every clone is dropped (after `run`'s body returns).
#[derive(Clone)]
pub struct Pipeline {
    requests: Sender<(Request, Instant)>,
    busy: Arc<Busy>,
}

impl Pipeline {
    /// Engine time spent on (prefill, decode) work since the pipeline started.
    pub fn busy(&self) -> (Duration, Duration) {
        let get = |c: &AtomicU64| Duration::from_nanos(c.load(Ordering::Relaxed));
        (get(&self.busy.prefill_ns), get(&self.busy.decode_ns))
    }

    /// Queue a request; its events arrive on `request.events`.
    pub fn submit(&self, request: Request) -> Result<()> {
        self.requests.send((request, Instant::now())).map_err(|_| anyhow::anyhow!("the pipeline has stopped"))
    }

    /// Run one request to the end and return its outcome (with the final state), passing each
    /// token to `on_token` as it is sampled.
    pub fn generate(&self, start: Option<State>, tokens: Vec<u32>, params: &Generation, mut on_token: impl FnMut(u32) -> Result<()>) -> Result<Generated> {
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
        let params = Generation { max_tokens: 0, sampling: SamplingParams::default(), vocab: usize::MAX, stop_ids: Vec::new() };
        let g = self.generate(Some(start), tokens.to_vec(), &params, |_| Ok(()))?;
        Ok((g.state.context("a prefill-only request returns its state")?, g.timings))
    }
}

/// Make an engine on the calling thread (the thread it will run on) and report to `ready`
/// whether that worked; None after a failure was reported.
fn start_engine<'m>(placement: &Placement, net: &'m Qwen35, ready: &Sender<Result<()>>, what: &str) -> Option<Engine<'m>> {
    match Engine::new(placement, net) {
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
    let (req_tx, req_rx) = channel::<(Request, Instant)>();
    let busy = Arc::new(Busy::default());
    let pipeline = Pipeline { requests: req_tx, busy: Arc::clone(&busy) };
    std::thread::scope(|s| {
        let (ready_tx, ready_rx) = channel::<Result<()>>();
        let mut threads = Vec::new();
        match config.mode {
            Mode::PrefillEngine | Mode::DecodeEngine => {
                let placement = if config.mode == Mode::PrefillEngine { &config.prefill } else { &config.decode };
                let ready = ready_tx.clone();
                let max_batch = config.max_batch;
                let busy = &busy;
                threads.push(s.spawn(move || {
                    if let Some(engine) = start_engine(placement, net, &ready, "engine") {
                        single_engine_loop(&engine, req_rx, max_batch, busy);
                    }
                }));
            }
            Mode::Hybrid => {
                let (hand_tx, hand_rx) = channel::<Handoff>();
                let (socket_tx, socket_rx) = match config.transfer {
                    Transfer::Socket => {
                        let (a, b) = std::os::unix::net::UnixStream::pair().context("creating the bridge socket pair")?;
                        let (sent_tx, sent_rx) = channel::<Duration>();
                        (Some(SocketEnd { stream: a, sent: Err(sent_tx) }), Some(SocketEnd { stream: b, sent: Ok(sent_rx) }))
                    }
                    _ => (None, None),
                };
                let (ready_p, ready_d) = (ready_tx.clone(), ready_tx.clone());
                let transfer = config.transfer.clone();
                let busy = &busy;
                threads.push(s.spawn(move || {
                    if let Some(engine) = start_engine(&config.prefill, net, &ready_p, "prefill engine") {
                        prefill_loop(&engine, req_rx, hand_tx, &transfer, socket_tx, busy);
                    }
                }));
                let max_batch = config.max_batch;
                threads.push(s.spawn(move || {
                    if let Some(engine) = start_engine(&config.decode, net, &ready_d, "decode engine") {
                        decode_loop(&engine, hand_rx, socket_rx, max_batch, busy);
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

/// A sequence being decoded.
struct Active {
    request: Request,
    state: Resident,
    sampler: Sampler,
    timings: Timings,
    submitted: Instant,
    first_token: Option<Instant>,
}

/// A prefilled request on its way to the decode engine.
struct Handoff {
    request: Request,
    submitted: Instant,
    timings: Timings,
    payload: Payload,
    prefilled: Instant,
}

enum Payload {
    /// The state itself, wherever the prefill engine keeps it (copied to the decode engine's
    /// device on arrival when that is another one).
    Moved(Resident),
    /// A state file the prefill engine wrote, read in place by the decode engine.
    File(Arc<StateFile>),
    /// Arriving on the bridge socket right now.
    Socket,
}

/// Prefill `request` on `engine`; None means the request failed or was cancelled while it
/// queued, and was answered.
fn prefill_request(engine: &Engine, request: &mut Request, submitted: Instant, busy: &Busy) -> Option<(Resident, Timings)> {
    let mut timings = Timings { queued: submitted.elapsed(), ..Default::default() };
    if request.cancel.load(Ordering::Relaxed) {
        let _ = request.events.send(Event::Done { id: request.id, finish: Finish::Cancelled, timings, state: None });
        return None;
    }
    let started = Instant::now();
    let result = match request.start.take() {
        Some(state) => Ok(Resident::Host(state)),
        None => engine.new_state(),
    }
    .and_then(|mut state| {
        if request.tokens.is_empty() {
            // Nothing new (a checkpoint continued as is): its logits must already be there.
            if !state.has_logits() {
                bail!("nothing to prefill and no logits in the state to sample from");
            }
            return Ok((state, PrefillStats::default()));
        }
        let stats = engine.prefill(&request.tokens, &mut state)?;
        Ok((state, stats))
    });
    Busy::add(&busy.prefill_ns, started);
    match result {
        Ok((state, stats)) => {
            timings.prefill = stats;
            Some((state, timings))
        }
        Err(e) => {
            let _ = request.events.send(Event::Failed { id: request.id, error: format!("{e:#}") });
            None
        }
    }
}

/// Answer a prefill-only request.
fn finish_prefill_only(request: Request, state: Resident, timings: Timings) {
    let event = match state.into_host() {
        Ok(state) => Event::Done { id: request.id, finish: Finish::Prefilled, timings, state: Some(state) },
        Err(e) => Event::Failed { id: request.id, error: format!("bringing the state back from the GPU: {e:#}") },
    };
    let _ = request.events.send(event);
}

fn single_engine_loop(engine: &Engine, requests: Receiver<(Request, Instant)>, max_batch: usize, busy: &Busy) {
    let mut active: Vec<Active> = Vec::new();
    let mut open = true;
    while open || !active.is_empty() {
        // Admit new requests: block when idle, else take what is waiting (up to the batch).
        while active.len() < max_batch && open {
            let next = if active.is_empty() { requests.recv().ok() } else { requests.try_recv().ok() };
            let Some((mut request, submitted)) = next else {
                if active.is_empty() {
                    open = false;
                }
                break;
            };
            if let Some((state, timings)) = prefill_request(engine, &mut request, submitted, busy) {
                if request.max_tokens == 0 {
                    finish_prefill_only(request, state, timings);
                } else {
                    active.push(activate(request, state, timings, submitted));
                }
            }
        }
        step(engine, &mut active, None, busy);
    }
}

/// One end of the bridge socket, with the channel on which the sender reports how long each
/// send took (the receiver reports all three parts of the transfer).
struct SocketEnd {
    stream: std::os::unix::net::UnixStream,
    /// Ok: the receiver's end; Err: the sender's.
    sent: Result<Receiver<Duration>, Sender<Duration>>,
}

fn prefill_loop(engine: &Engine, requests: Receiver<(Request, Instant)>, handoffs: Sender<Handoff>, transfer: &Transfer, mut socket: Option<SocketEnd>, busy: &Busy) {
    let fingerprint = engine.net.fingerprint();
    // The file transfer's state files: one is free to write when no state holds it.
    let mut files: Vec<Arc<StateFile>> = Vec::new();
    while let Ok((mut request, submitted)) = requests.recv() {
        // With the file transfer, a fresh request is prefilled straight into a state file (its
        // recurrent states live there from the start), so that handing it over copies only K/V
        // and the logits. A request that continues a checkpoint starts from that state.
        let mut in_file = None;
        if let (Transfer::File(dir), None, false, None) = (transfer, &request.start, request.tokens.is_empty() || request.max_tokens == 0, engine.gpu()) {
            match free_state_file(&mut files, dir).and_then(|i| Ok((i, bridge::state_in_file(&mut files[i], &engine.net.config, request.tokens.len(), fingerprint)?))) {
                Ok((i, state)) => {
                    request.start = Some(state);
                    in_file = Some(i);
                }
                Err(e) => {
                    let _ = request.events.send(Event::Failed { id: request.id, error: format!("{e:#}") });
                    continue;
                }
            }
        }
        let Some((state, mut timings)) = prefill_request(engine, &mut request, submitted, busy) else { continue };
        if request.max_tokens == 0 {
            finish_prefill_only(request, state, timings);
            continue;
        }
        let prefilled = Instant::now();
        let payload = match transfer {
            Transfer::Move => Payload::Moved(state),
            Transfer::File(dir) => {
                let t = Instant::now();
                let written = match in_file {
                    Some(i) => {
                        // SAFETY: the file was free when `state_in_file` took it; since then
                        // only `state` has used it, and it is dropped before the handoff.
                        let r = match &state {
                            Resident::Host(s) => unsafe { files[i].write_shared(s, fingerprint) },
                            Resident::Gpu(_) => unreachable!("only a CPU engine prefills into a file"),
                        };
                        drop(state);
                        r.map(|()| Arc::clone(&files[i]))
                    }
                    // A GPU engine's state is copied to the host first (part of the write).
                    None => state.into_host().and_then(|state| write_state_file(&mut files, dir, &state, fingerprint)),
                };
                match written {
                    Ok(file) => {
                        timings.transfer.serialize = t.elapsed();
                        Payload::File(file)
                    }
                    Err(e) => {
                        let _ = request.events.send(Event::Failed { id: request.id, error: format!("{e:#}") });
                        continue;
                    }
                }
            }
            Transfer::Socket => {
                // Announce first: the decode side must be reading while this side writes.
                let id = request.id;
                let events = request.events.clone();
                if handoffs.send(Handoff { request, submitted, timings, payload: Payload::Socket, prefilled: Instant::now() }).is_err() {
                    break;
                }
                let t = Instant::now();
                let end = socket.as_mut().expect("a socket pipeline has a socket");
                if let Err(e) = state.into_host().and_then(|state| bridge::send(&mut end.stream, &state, fingerprint)) {
                    let _ = events.send(Event::Failed { id, error: format!("sending the state: {e:#}") });
                    break;
                }
                if let Err(sent) = &end.sent {
                    let _ = sent.send(t.elapsed());
                }
                continue;
            }
        };
        if handoffs.send(Handoff { request, submitted, timings, payload, prefilled }).is_err() {
            break;
        }
    }
    // States still holding a file keep its pages until they are dropped.
    for f in &files {
        let _ = std::fs::remove_file(f.path());
    }
}

/// Write `state` into a free file of `files` (one that no state holds), or into a new one in
/// `dir`; the file goes to the decode engine, whose state keeps it until the request ends.
fn write_state_file(files: &mut Vec<Arc<StateFile>>, dir: &std::path::Path, state: &State, fingerprint: bridge::Fingerprint) -> anyhow::Result<Arc<StateFile>> {
    let i = free_state_file(files, dir)?;
    Arc::get_mut(&mut files[i]).expect("a free file").write(state, fingerprint)?;
    Ok(Arc::clone(&files[i]))
}

/// The index of a file of `files` that no state holds, made in `dir` if there is none.
fn free_state_file(files: &mut Vec<Arc<StateFile>>, dir: &std::path::Path) -> anyhow::Result<usize> {
    if let Some(i) = files.iter_mut().position(|f| Arc::get_mut(f).is_some()) {
        return Ok(i);
    }
    let path = dir.join(format!("tandem-{}-{}.state", std::process::id(), files.len()));
    files.push(Arc::new(StateFile::create(&path)?));
    Ok(files.len() - 1)
}

fn decode_loop(engine: &Engine, handoffs: Receiver<Handoff>, mut socket: Option<SocketEnd>, max_batch: usize, busy: &Busy) {
    let fingerprint = engine.net.fingerprint();
    let cfg = &engine.net.config;
    let mut active: Vec<Active> = Vec::new();
    // States of finished requests, whose buffers the next received states are rebuilt into.
    let mut spare: Vec<State> = Vec::new();
    let mut open = true;
    while open || !active.is_empty() {
        while active.len() < max_batch && open {
            let next = if active.is_empty() { handoffs.recv().ok() } else { handoffs.try_recv().ok() };
            let Some(h) = next else {
                if active.is_empty() {
                    open = false;
                }
                break;
            };
            let Handoff { request, submitted, mut timings, payload, prefilled } = h;
            let received = match payload {
                // Between devices the copy is the whole transfer: it counts as the read.
                Payload::Moved(state) => {
                    let t = Instant::now();
                    let adopted = engine.adopt(state);
                    timings.transfer.read = t.elapsed();
                    adopted
                }
                Payload::File(file) => bridge::read_file(&file, fingerprint, cfg, spare.pop(), true).map(|(state, read, rebuild)| {
                    timings.transfer.read = read;
                    timings.transfer.rebuild = rebuild;
                    Resident::Host(state)
                }),
                Payload::Socket => {
                    let end = socket.as_mut().expect("a socket pipeline has a socket");
                    bridge::receive(&mut end.stream, fingerprint, cfg, spare.pop()).map(|(state, read, rebuild)| {
                        if let Ok(sent) = &end.sent {
                            timings.transfer.serialize = sent.recv().unwrap_or_default();
                        }
                        timings.transfer.read = read;
                        timings.transfer.rebuild = rebuild;
                        Resident::Host(state)
                    })
                }
            };
            // A GPU decode engine rebuilds a host state on its GPU: part of the rebuild.
            let received = received.and_then(|state| {
                if matches!(state, Resident::Host(_)) && engine.gpu().is_some() {
                    let t = Instant::now();
                    let adopted = engine.adopt(state);
                    timings.transfer.rebuild += t.elapsed();
                    return adopted;
                }
                Ok(state)
            });
            timings.handoff = prefilled.elapsed();
            match received {
                Ok(state) => active.push(activate(request, state, timings, submitted)),
                Err(e) => {
                    let _ = request.events.send(Event::Failed { id: request.id, error: format!("receiving the state: {e:#}") });
                }
            }
        }
        step(engine, &mut active, Some(&mut spare), busy);
    }
}

fn activate(request: Request, state: Resident, timings: Timings, submitted: Instant) -> Active {
    let sampler = Sampler::new(request.sampling.clone(), request.vocab);
    Active { request, state, sampler, timings, submitted, first_token: None }
}

/// Sample one token for every active sequence (from the logits its state carries), answer the
/// finished ones (keeping up to two of their states in `spare` when given), and decode the rest
/// in one batched step.
fn step(engine: &Engine, active: &mut Vec<Active>, mut spare: Option<&mut Vec<State>>, busy: &Busy) {
    let ctx = engine.net.config.max_position_embeddings;
    let mut tokens = Vec::with_capacity(active.len());
    let mut i = 0;
    while i < active.len() {
        let a = &mut active[i];
        let finish = if a.request.cancel.load(Ordering::Relaxed) {
            Some(Finish::Cancelled)
        } else {
            let token = match a.state.sample(&mut a.sampler) {
                Ok(token) => token,
                Err(e) => {
                    let a = active.remove(i);
                    let _ = a.request.events.send(Event::Failed { id: a.request.id, error: format!("sampling: {e:#}") });
                    continue;
                }
            };
            let now = Instant::now();
            let first = *a.first_token.get_or_insert(now);
            if a.timings.generated == 0 {
                a.timings.ttft = now - a.submitted;
            }
            a.timings.decode = now - first;
            if a.request.stop_ids.contains(&token) {
                Some(Finish::Stop)
            } else {
                a.timings.generated += 1;
                let _ = a.request.events.send(Event::Token { id: a.request.id, token });
                if a.timings.generated >= a.request.max_tokens || a.state.position() >= ctx {
                    Some(Finish::Length)
                } else {
                    tokens.push(token);
                    None
                }
            }
        };
        match finish {
            Some(finish) => {
                let a = active.remove(i);
                let event = if a.request.return_state && finish != Finish::Cancelled {
                    // A state that outlives its request leaves its state file (or GPU) free.
                    match a.state.into_host() {
                        Ok(state) => Event::Done { id: a.request.id, finish, timings: a.timings, state: Some(state) },
                        Err(e) => Event::Failed { id: a.request.id, error: format!("bringing the state back from the GPU: {e:#}") },
                    }
                } else {
                    match (spare.as_deref_mut(), a.state) {
                        (Some(spare), Resident::Host(state)) if spare.len() < 2 && !state.in_file() => spare.push(state),
                        _ => {}
                    }
                    Event::Done { id: a.request.id, finish, timings: a.timings, state: None }
                };
                let _ = a.request.events.send(event);
            }
            None => i += 1,
        }
    }
    if active.is_empty() {
        return;
    }
    let mut states: Vec<&mut Resident> = active.iter_mut().map(|a| &mut a.state).collect();
    let started = Instant::now();
    let decoded = engine.decode(&tokens, &mut states);
    Busy::add(&busy.decode_ns, started);
    if let Err(e) = decoded {
        // A step that fails fails every sequence in it (inputs are checked before anything is
        // applied, so no state was changed).
        for a in active.drain(..) {
            let _ = a.request.events.send(Event::Failed { id: a.request.id, error: format!("decode step: {e:#}") });
        }
    }
}
