//! The decode engine's loop: admit handed-over states (up to the batch), then step every
//! active sequence: sample its next token from the logits its state carries, answer the
//! finished ones, and apply the sampled tokens in one batched decode step. `single_engine_loop`
//! is the same step for one engine that also prefills (the study's pure modes), a budget of
//! prompt tokens per step (chunked prefill).
//!
//! Where the engine's K/V cache has a limit, a step that would need more blocks than are free
//! first swaps the sequences admitted last out (`fit_kv_cache`: a GPU engine's to host memory,
//! a CPU engine's under a memory budget to a file on disk), and they come back, oldest first,
//! before anything new is admitted: a swapped state comes back bit for bit, so a request's
//! tokens are those it would have had without the swap.

use std::sync::atomic::Ordering;
use std::sync::mpsc::TryRecvError;
use std::sync::Arc;
use std::time::Instant;

use super::prefill::{apply_chunks, blocks_short, finish_prefill_only, kv_blocks, Chunk, KvRoom, Prefill, Queue};
use crate::backend::cuda::qwen35::{device_pool::PoolFull, kv_cache::KV_BLOCK};
use super::host_budget::{HostBudget, Lease};
use super::request::{Event, Finish, Request, Timings};
use super::swap_file::SwapFile;
use super::trace::Work;
use super::EngineTime;
use crate::bridge::handoff;
use crate::engine::Engine;
use crate::sampling::Sampler;
use crate::state::{DeviceState, State};

/// A prefilled request on its way to the decode engine (what travels beside its state).
pub(super) struct Handoff {
    pub request: Request,
    pub submitted: Instant,
    pub timings: Timings,
    pub prefilled: Instant,
    /// Its share of a CPU decode engine's memory budget, taken before its prefill.
    pub lease: Option<Lease>,
}

/// A sequence being decoded.
struct Active {
    request: Request,
    state: DeviceState,
    sampler: Sampler,
    timings: Timings,
    submitted: Instant,
    first_token: Option<Instant>,
    /// Swapped out of the K/V cache (rather than waiting for room since it arrived).
    swapped_out: bool,
    /// Its share of a CPU engine's memory budget (None without one, or while swapped out).
    lease: Option<Lease>,
    /// Where a CPU engine's state swapped out waits (`state` then holds only its position).
    on_disk: Option<SwapFile>,
}

impl Active {
    fn new(request: Request, state: DeviceState, timings: Timings, submitted: Instant, lease: Option<Lease>) -> Active {
        let sampler = Sampler::new(request.sampling.clone(), request.vocab);
        Active { request, state, sampler, timings, submitted, first_token: None, swapped_out: false, lease, on_disk: None }
    }

    /// K/V blocks the sequence must take to hold `end` positions.
    fn blocks_short(&self, end: usize) -> usize {
        blocks_short(self.lease.as_ref(), &self.state, end)
    }

    /// Whether the sequence holds its place in the engine's memory (and may run): a GPU
    /// engine's state on its GPU, a CPU engine's under a budget with its lease.
    fn holds_room(&self, engine: &Engine, host: Option<&Arc<HostBudget>>) -> bool {
        match engine.gpu() {
            Some(g) => self.state.is_on(g),
            None => host.is_none() || self.lease.is_some(),
        }
    }

    /// Let the sequence hold `end` positions: take the K/V blocks it lacks (a GPU engine's
    /// state from its pool, a CPU engine's lease from the budget, with a slot first where it
    /// has none, and its state back from disk), all or none: a `PoolFull` error where there is
    /// no room now.
    fn reserve(&mut self, engine: &Engine, host: Option<&Arc<HostBudget>>, end: usize) -> anyhow::Result<()> {
        let Some(host) = host.filter(|_| engine.gpu().is_none()) else { return engine.reserve_kv(&mut self.state, end) };
        match &mut self.lease {
            Some(lease) => lease.grow(end),
            None => {
                let lease = host.lease(end)?;
                if let Some(file) = self.on_disk.take() {
                    self.state = DeviceState::Host(file.read(engine.net.fingerprint(), &engine.net.config)?);
                }
                self.lease = Some(lease);
                Ok(())
            }
        }
    }

    /// Give the sequence's room back: a GPU engine's state to host memory, a CPU engine's
    /// under a budget to a file on disk (its lease dropped).
    fn swap_out(&mut self, engine: &Engine) -> anyhow::Result<()> {
        if engine.gpu().is_some() {
            return crate::bridge::device::move_in_place(None, &mut self.state);
        }
        let position = self.state.position();
        let state = std::mem::replace(&mut self.state, DeviceState::Host(State { position, layers: Vec::new(), last_logits: Vec::new() }));
        self.on_disk = Some(SwapFile::write(state.into_host()?, engine.net.fingerprint())?);
        self.lease = None;
        Ok(())
    }
}

/// The sequences that `a`'s forks decode as (OpenAI's `n`), each from a copy of its prompt
/// state: on the engine's GPU where its pools have room, else in host memory (then it waits
/// for room as a swapped-out sequence does). A fork whose copy fails is answered so.
fn forks(engine: &Engine, a: &Active) -> Vec<Active> {
    let mut forks = Vec::with_capacity(a.request.forks.len());
    for fork in &a.request.forks {
        let request = a.request.forked(fork);
        match engine.fork(&a.state) {
            Ok(state) => forks.push(Active::new(request, state, a.timings, a.submitted, None)),
            Err(e) => {
                let _ = request.events.send(Event::Failed { id: request.id, error: format!("copying the prompt's state for another choice: {e:#}") });
            }
        }
    }
    forks
}

/// The sequences of a decode engine: those in the batch, in the order they were admitted, and
/// those swapped out to host memory to make room in the K/V cache, in the same order.
#[derive(Default)]
struct Batch {
    active: Vec<Active>,
    swapped: Vec<Active>,
}

impl Batch {
    /// Whether new sequences may join: room in the batch, and none waiting to come back (or
    /// nothing running that could free blocks for them).
    fn admits(&self, max_batch: usize) -> bool {
        self.active.len() < max_batch && (self.swapped.is_empty() || self.active.is_empty())
    }

    fn is_empty(&self) -> bool {
        self.active.is_empty() && self.swapped.is_empty()
    }
}

/// `host`: a CPU decode engine's memory budget (its requests' leases come with them).
pub(super) fn decode_loop(engine: &Engine, mut bridge: handoff::Receiver<Handoff>, max_batch: usize, host: Option<&Arc<HostBudget>>, time: &EngineTime) {
    reserve_batch_padding(engine, max_batch);
    let mut batch = Batch::default();
    let mut open = true;
    // How long the last decode step took: what taking in states may cost between two steps.
    let mut last_step = std::time::Duration::ZERO;
    while open || !batch.is_empty() {
        // Admit handed-over states: block when idle, else take what is waiting (up to the batch).
        // While sequences run, their copies onto this engine's device (from another GPU, or
        // from the host) take about one step's time at most before the next step, so that a
        // burst of prefilled states does not stall the running sequences.
        let mut copying = std::time::Duration::ZERO;
        while batch.admits(max_batch) && open && (batch.active.is_empty() || copying <= last_step.max(std::time::Duration::from_millis(1))) {
            let (h, received) = match bridge.receive(batch.is_empty(), engine.gpu()) {
                Ok(next) => next,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            };
            let Handoff { request, submitted, mut timings, prefilled, lease } = h;
            timings.handoff = prefilled.elapsed();
            match received {
                Ok((state, transfer)) => {
                    // Its reading and copying were the last of the call (the wait before them
                    // is idle time, not the engine's).
                    let moved = transfer.read + transfer.rebuild;
                    copying += moved;
                    if !moved.is_zero() {
                        time.span(Instant::now() - moved, || Work::Receive { tokens: state.position() });
                    }
                    timings.transfer = transfer;
                    let a = Active::new(request, state, timings, submitted, lease);
                    let forks = forks(engine, &a);
                    for a in std::iter::once(a).chain(forks) {
                        if !a.holds_room(engine, host) {
                            // No room for it in the K/V cache yet: it waits with the swapped-out
                            // sequences, and comes in as they do.
                            batch.swapped.push(a);
                        } else {
                            batch.active.push(a);
                        }
                    }
                }
                Err(e) => {
                    let _ = request.events.send(Event::Failed { id: request.id, error: format!("receiving the state: {e:#}") });
                }
            }
        }
        fit_kv_cache(engine, host, &mut batch, time);
        if batch.active.is_empty() && !batch.swapped.is_empty() {
            // Waiting for blocks that others hold (a prefill engine sharing the pool).
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let stepping = Instant::now();
        for state in step(engine, &mut batch.active, time) {
            bridge.recycle(state);
        }
        last_step = stepping.elapsed();
    }
}

/// One engine that prefills and decodes (the study's pure modes), with chunked prefill: each
/// step first applies at most `max_prefill_tokens` prompt tokens of the requests being
/// admitted (in one forward where the engine packs prompts; a prompt longer than what the
/// budget leaves is applied a chunk per step), then decodes every running sequence. The budget
/// bounds how long a prefill holds up the running sequences' next tokens.
///
/// `host`: a CPU engine's memory budget.
pub(super) fn single_engine_loop(engine: &Engine, mut queue: Queue, max_batch: usize, max_prefill_tokens: usize, host: Option<&Arc<HostBudget>>, time: &EngineTime) {
    reserve_batch_padding(engine, max_batch);
    let mut batch = Batch::default();
    let mut prefilling: Vec<Prefill> = Vec::new();
    let kv_limit = kv_limit(engine, host);
    loop {
        // Admit new requests (waiting for one when idle) while the batch, this step's token
        // budget and the room in the K/V cache allow: room after a block for each running
        // sequence's next token and the blocks the prompts being applied still need.
        let starting = batch.active.len() + prefilling.len();
        let budget = max_prefill_tokens.saturating_sub(prefilling.iter().map(Prefill::remaining).sum());
        if starting < max_batch && (batch.swapped.is_empty() || batch.active.is_empty()) && budget > 0 {
            let idle = batch.is_empty() && prefilling.is_empty();
            let per_call = if engine.packs_prompts() { max_batch - starting } else { 1 };
            let reserve = batch.active.len() + prefilling.iter().map(Prefill::kv_blocks_short).sum::<usize>();
            let (room, per_call) = match KvRoom::of(engine, host, reserve) {
                // Nothing running will free blocks: the waiting request goes alone now (its
                // prefill says so if it cannot fit).
                Some(_) if idle && queue.holds_one() => (None, 1),
                room => (room, per_call),
            };
            let Some(taken) = queue.take(idle, budget, per_call, room, true) else { break };
            // Requests that found no free state slot wait at the head of the queue, in order.
            let mut no_slot = Vec::new();
            for (request, submitted) in taken {
                if let Some(limit) = kv_limit.filter(|&limit| kv_blocks(&request) > limit) {
                    let error = cannot_hold(kv_blocks(&request), limit);
                    let _ = request.events.send(Event::Failed { id: request.id, error });
                    continue;
                }
                match Prefill::start(engine, host, request, submitted, time) {
                    Ok(p) => prefilling.extend(p),
                    Err(request) => no_slot.push(*request),
                }
            }
            queue.put_back(no_slot);
        }
        prefill_chunks(engine, host, &mut prefilling, &mut batch, max_prefill_tokens, time);
        fit_kv_cache(engine, host, &mut batch, time);
        step(engine, &mut batch.active, time);
    }
}

/// Apply the next chunks of the prompts being prefilled, in order, up to `max_tokens` tokens
/// in all; a request whose whole prompt is applied joins the batch (a prefill-only one is
/// answered). A chunk that finds the K/V cache full waits for the next step, unless nothing
/// runs that could free blocks: then the request fails, saying so.
fn prefill_chunks(engine: &Engine, host: Option<&Arc<HostBudget>>, prefilling: &mut Vec<Prefill>, batch: &mut Batch, max_tokens: usize, time: &EngineTime) {
    prefilling.retain(|p| {
        let cancelled = p.request.cancel.load(Ordering::Relaxed);
        if cancelled {
            let _ = p.request.events.send(Event::Done { id: p.request.id, finish: Finish::Cancelled, timings: p.timings, state: None });
        }
        !cancelled
    });
    let mut budget = max_tokens;
    let take = |p: &Prefill| {
        let len = p.to_next_stop().min(budget);
        budget -= len;
        len
    };
    let outcomes = apply_chunks(engine, prefilling.iter_mut().map(Some), take, time);
    let stuck = batch.active.is_empty() && !outcomes.iter().any(|o| matches!(o, Some(Chunk::Applied)));
    let mut failed_one = false;
    for (p, outcome) in std::mem::take(prefilling).into_iter().zip(outcomes) {
        if matches!(outcome, Some(Chunk::Applied)) {
            p.send_snapshot(engine, time);
        }
        match outcome {
            Some(Chunk::Failed(error)) => p.fail(error),
            Some(Chunk::NoRoom(why)) if stuck && !failed_one => {
                failed_one = true;
                let error = format!("{why}: the K/V cache cannot hold this request's {} prompt tokens (raise --gpu-memory-utilization or --kv-cache-memory)", p.request.tokens.len());
                p.fail(error);
            }
            // More chunks to come (or room to wait for).
            _ if p.remaining() > 0 => prefilling.push(p),
            _ => {
                let Prefill { request, submitted, state, timings, lease, .. } = p;
                if request.max_tokens == 0 {
                    finish_prefill_only(request, state, timings);
                } else {
                    let a = Active::new(request, state, timings, submitted, lease);
                    let forks = forks(engine, &a);
                    batch.active.push(a);
                    // A fork without its room yet waits with the swapped-out sequences.
                    for f in forks {
                        if f.holds_room(engine, host) { batch.active.push(f) } else { batch.swapped.push(f) }
                    }
                }
            }
        }
    }
}

/// The padding rows' state of batched steps, taken from the engine's pools before any request
/// (where the budget counted it: `budget_kv_cache`).
fn reserve_batch_padding(engine: &Engine, max_batch: usize) {
    if max_batch > 1 {
        if let Err(e) = engine.reserve_batch_padding() {
            eprintln!("the decode engine could not take its batched steps' padding state now (it will try at its first batched step): {e:#}");
        }
    }
}

/// The most K/V blocks the engine's sequences may hold (None: no limit).
pub(super) fn kv_limit(engine: &Engine, host: Option<&Arc<HostBudget>>) -> Option<usize> {
    match host {
        Some(h) => Some(h.block_limit()),
        None => engine.kv_pool().and_then(|p| p.level().limit),
    }
}

/// Why a request fails whose positions take more K/V blocks than the cache has at all.
pub(super) fn cannot_hold(blocks: usize, limit: usize) -> String {
    format!("the K/V cache cannot hold this request: it needs {blocks} blocks of {KV_BLOCK} positions, the cache has {limit} (raise --gpu-memory-utilization or --kv-cache-memory)")
}

/// Keep the next step within the engine's K/V cache, where it has a limit. The swapped-out
/// sequences come back first, oldest first, while their blocks fit beside the running
/// sequences' next ones; then each running sequence takes the block its next token needs now
/// (so that the step itself never runs short), and while one cannot, the sequence admitted
/// last is swapped out: its state copied to host memory (a CPU engine's under a budget: to a
/// file) and its blocks freed. The last running sequence is never swapped: if even it does not
/// fit, its step fails saying so.
fn fit_kv_cache(engine: &Engine, host: Option<&Arc<HostBudget>>, batch: &mut Batch, time: &EngineTime) {
    let Some(limit) = kv_limit(engine, host) else { return };
    let available = || match host {
        Some(h) => h.available().0,
        None => engine.kv_room().unwrap_or(0),
    };
    // A request cancelled while swapped out is answered now (it would wait for room first).
    batch.swapped.retain(|a| {
        let cancelled = a.request.cancel.load(Ordering::Relaxed);
        if cancelled {
            let _ = a.request.events.send(Event::Done { id: a.request.id, finish: Finish::Cancelled, timings: a.timings, state: None });
        }
        !cancelled
    });
    let next = |a: &Active| a.state.position() + 1;
    while let Some(first) = batch.swapped.first() {
        let need = first.blocks_short(next(first));
        if need > limit {
            let a = batch.swapped.remove(0);
            let _ = a.request.events.send(Event::Failed { id: a.request.id, error: cannot_hold(need, limit) });
            continue;
        }
        let running: usize = batch.active.iter().map(|a| a.blocks_short(next(a))).sum();
        if running + need > available() {
            break;
        }
        let mut a = batch.swapped.remove(0);
        let end = next(&a);
        match a.reserve(engine, host, end) {
            Ok(()) => {
                if std::mem::take(&mut a.swapped_out) {
                    time.swapped_in.fetch_add(1, Ordering::Relaxed);
                }
                batch.active.push(a);
            }
            Err(e) if PoolFull::is(&e) => {
                batch.swapped.insert(0, a);
                break;
            }
            Err(e) => {
                let _ = a.request.events.send(Event::Failed { id: a.request.id, error: format!("bringing a swapped state back: {e:#}") });
            }
        }
    }
    let mut i = 0;
    while i < batch.active.len() {
        let end = next(&batch.active[i]);
        match batch.active[i].reserve(engine, host, end) {
            Err(e) if PoolFull::is(&e) && batch.active.len() > 1 => {
                // Swap out the last admitted (perhaps this one) and try again.
                let mut a = batch.active.pop().expect("more than one running");
                // Its blocks (and slot) go back with its place in the engine's memory.
                match a.swap_out(engine) {
                    Ok(()) => {
                        a.swapped_out = true;
                        // At the front: the sequences swapped out in one go come back oldest first.
                        batch.swapped.insert(0, a);
                        time.swapped_out.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        let _ = a.request.events.send(Event::Failed { id: a.request.id, error: format!("swapping the state out of the K/V cache: {e:#}") });
                    }
                }
            }
            // Taken; or an error the step will meet and report.
            _ => i += 1,
        }
    }
}

/// Sample one token for every active sequence (from the logits its state carries), answer the
/// finished ones, and decode the rest in one batched step. Returns the states of finished
/// requests that did not ask for them (their buffers can serve the next ones).
fn step(engine: &Engine, active: &mut Vec<Active>, time: &EngineTime) -> Vec<DeviceState> {
    let ctx = engine.net.config.max_position_embeddings;
    let mut tokens = Vec::with_capacity(active.len());
    let mut unused = Vec::new();
    // Every sequence's next token at once (a GPU draws all its rows in one launch).
    let cancelled: Vec<bool> = active.iter().map(|a| a.request.cancel.load(Ordering::Relaxed)).collect();
    let mut seqs: Vec<(&mut DeviceState, &mut Sampler)> = active.iter_mut().zip(&cancelled).filter(|(_, &c)| !c).map(|(a, _)| (&mut a.state, &mut a.sampler)).collect();
    let started = Instant::now();
    let mut picks = engine.sample(&mut seqs).into_iter();
    time.span(started, || Work::Sample { sequences: seqs.len() });
    drop(seqs);
    let mut i = 0;
    for cancelled in cancelled {
        let a = &mut active[i];
        let finish = if cancelled {
            Some(Finish::Cancelled)
        } else {
            let token = match picks.next().expect("a pick for each sequence not cancelled") {
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
                let logprobs = a.sampler.take_logprobs().map(Box::new);
                let _ = a.request.events.send(Event::Token { id: a.request.id, token, logprobs });
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
                    unused.push(a.state);
                    Event::Done { id: a.request.id, finish, timings: a.timings, state: None }
                };
                let _ = a.request.events.send(event);
            }
            None => i += 1,
        }
    }
    if active.is_empty() {
        return unused;
    }
    let (mut states, mut samplers): (Vec<&mut DeviceState>, Vec<&mut Sampler>) = active.iter_mut().map(|a| (&mut a.state, &mut a.sampler)).unzip();
    let started = Instant::now();
    // The grammars' masks for the next tokens depend only on the tokens taken so far: a GPU
    // engine's host computes them while the GPU runs the step (a CPU engine's cores are busy
    // with it, and its samplers compute them when they pick).
    let ahead = engine.gpu().is_some() && samplers.iter().any(|s| s.unprepared());
    let threads = engine.sampling_threads(samplers.len());
    let decoded = std::thread::scope(|scope| {
        if ahead {
            scope.spawn(|| crate::sampling::prepare_side_by_side(&mut samplers, threads));
        }
        engine.decode(&tokens, &mut states)
    });
    EngineTime::add(&time.decode_ns, started);
    time.span(started, || Work::Decode { sequences: states.len(), positions: states.iter().map(|s| s.position()).sum() });
    if let Err(e) = decoded {
        // A step that fails fails every sequence in it (inputs are checked before anything is
        // applied, so no state was changed).
        for a in active.drain(..) {
            let _ = a.request.events.send(Event::Failed { id: a.request.id, error: format!("decode step: {e:#}") });
        }
    }
    unused
}
