//! The prefill engine's loop: take each request, apply its prompt to its state, and hand the
//! state over the bridge to the decode engine (or answer a prefill-only request with it).

use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::time::Instant;

use anyhow::bail;

use super::decode::Handoff;
use super::request::{Event, Finish, Request, Timings};
use super::EngineTime;
use crate::bridge::handoff::{self, SendError};
use crate::engine::{Engine, PrefillStats};
use crate::state::DeviceState;

pub(super) fn prefill_loop(engine: &Engine, requests: Receiver<(Request, Instant)>, mut bridge: handoff::Sender<Handoff>, time: &EngineTime) {
    while let Ok((mut request, submitted)) = requests.recv() {
        // With the file transfer, a fresh request that will decode is prefilled by a CPU engine
        // straight into a state file (its recurrent states live there from the start). A
        // request that continues a checkpoint starts from that state.
        if request.start.is_none() && !request.tokens.is_empty() && request.max_tokens > 0 && engine.gpu().is_none() {
            match bridge.fresh_state(request.tokens.len()) {
                Ok(state) => request.start = state,
                Err(e) => {
                    let _ = request.events.send(Event::Failed { id: request.id, error: format!("{e:#}") });
                    continue;
                }
            }
        }
        let Some((state, timings)) = prefill_request(engine, &mut request, submitted, time) else { continue };
        if request.max_tokens == 0 {
            finish_prefill_only(request, state, timings);
            continue;
        }
        match bridge.send(Handoff { request, submitted, timings, prefilled: Instant::now() }, state) {
            Ok(()) => {}
            Err(SendError::Failed(h, e)) => {
                let _ = h.request.events.send(Event::Failed { id: h.request.id, error: format!("{e:#}") });
            }
            Err(SendError::Closed) => break,
        }
    }
}

/// Prefill `request` on `engine`; None means the request failed or was cancelled while it
/// queued, and was answered.
pub(super) fn prefill_request(engine: &Engine, request: &mut Request, submitted: Instant, time: &EngineTime) -> Option<(DeviceState, Timings)> {
    let mut timings = Timings { queued: submitted.elapsed(), ..Default::default() };
    if request.cancel.load(Ordering::Relaxed) {
        let _ = request.events.send(Event::Done { id: request.id, finish: Finish::Cancelled, timings, state: None });
        return None;
    }
    let started = Instant::now();
    let result = match request.start.take() {
        Some(state) => Ok(DeviceState::Host(state)),
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
    EngineTime::add(&time.prefill_ns, started);
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
pub(super) fn finish_prefill_only(request: Request, state: DeviceState, timings: Timings) {
    let event = match state.into_host() {
        Ok(state) => Event::Done { id: request.id, finish: Finish::Prefilled, timings, state: Some(state) },
        Err(e) => Event::Failed { id: request.id, error: format!("bringing the state back from the GPU: {e:#}") },
    };
    let _ = request.events.send(event);
}
