//! The decode engine's loop: admit handed-over states (up to the batch), then step every
//! active sequence: sample its next token from the logits its state carries, answer the
//! finished ones, and apply the sampled tokens in one batched decode step. `single_engine_loop`
//! is the same step for one engine that also prefills (the study's pure modes).

use std::sync::atomic::Ordering;
use std::sync::mpsc::TryRecvError;
use std::time::Instant;

use super::prefill::{finish_prefill_only, prefill_requests, Queue};
use super::request::{Event, Finish, Request, Timings};
use super::EngineTime;
use crate::bridge::handoff;
use crate::engine::Engine;
use crate::sampling::Sampler;
use crate::state::DeviceState;

/// A prefilled request on its way to the decode engine (what travels beside its state).
pub(super) struct Handoff {
    pub request: Request,
    pub submitted: Instant,
    pub timings: Timings,
    pub prefilled: Instant,
}

/// A sequence being decoded.
struct Active {
    request: Request,
    state: DeviceState,
    sampler: Sampler,
    timings: Timings,
    submitted: Instant,
    first_token: Option<Instant>,
}

impl Active {
    fn new(request: Request, state: DeviceState, timings: Timings, submitted: Instant) -> Active {
        let sampler = Sampler::new(request.sampling.clone(), request.vocab);
        Active { request, state, sampler, timings, submitted, first_token: None }
    }
}

pub(super) fn decode_loop(engine: &Engine, mut bridge: handoff::Receiver<Handoff>, max_batch: usize, time: &EngineTime) {
    let mut active: Vec<Active> = Vec::new();
    let mut open = true;
    while open || !active.is_empty() {
        // Admit handed-over states: block when idle, else take what is waiting (up to the batch).
        while active.len() < max_batch && open {
            let (h, received) = match bridge.receive(active.is_empty(), engine.gpu()) {
                Ok(next) => next,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            };
            let Handoff { request, submitted, mut timings, prefilled } = h;
            timings.handoff = prefilled.elapsed();
            match received {
                Ok((state, transfer)) => {
                    timings.transfer = transfer;
                    active.push(Active::new(request, state, timings, submitted));
                }
                Err(e) => {
                    let _ = request.events.send(Event::Failed { id: request.id, error: format!("receiving the state: {e:#}") });
                }
            }
        }
        for state in step(engine, &mut active, time) {
            bridge.recycle(state);
        }
    }
}

pub(super) fn single_engine_loop(engine: &Engine, mut queue: Queue, max_batch: usize, max_prefill_tokens: usize, time: &EngineTime) {
    let mut active: Vec<Active> = Vec::new();
    loop {
        // Admit new requests between decode steps (waiting for one when idle), up to the batch:
        // prefilled in one forward where the engine packs prompts.
        let room = max_batch - active.len();
        if room > 0 {
            let per_call = if engine.packs_prompts() { room } else { 1 };
            let Some(mut batch) = queue.take(active.is_empty(), max_prefill_tokens, per_call) else { break };
            let prefilled = prefill_requests(engine, &mut batch, time);
            for ((request, submitted), done) in batch.into_iter().zip(prefilled) {
                let Some((state, timings)) = done else { continue };
                if request.max_tokens == 0 {
                    finish_prefill_only(request, state, timings);
                } else {
                    active.push(Active::new(request, state, timings, submitted));
                }
            }
        }
        step(engine, &mut active, time);
    }
}

/// Sample one token for every active sequence (from the logits its state carries), answer the
/// finished ones, and decode the rest in one batched step. Returns the states of finished
/// requests that did not ask for them (their buffers can serve the next ones).
fn step(engine: &Engine, active: &mut Vec<Active>, time: &EngineTime) -> Vec<DeviceState> {
    let ctx = engine.net.config.max_position_embeddings;
    let mut tokens = Vec::with_capacity(active.len());
    let mut unused = Vec::new();
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
    let mut states: Vec<&mut DeviceState> = active.iter_mut().map(|a| &mut a.state).collect();
    let started = Instant::now();
    let decoded = engine.decode(&tokens, &mut states);
    EngineTime::add(&time.decode_ns, started);
    if let Err(e) = decoded {
        // A step that fails fails every sequence in it (inputs are checked before anything is
        // applied, so no state was changed).
        for a in active.drain(..) {
            let _ = a.request.events.send(Event::Failed { id: a.request.id, error: format!("decode step: {e:#}") });
        }
    }
    unused
}
