//! The prefill engine's loop: take the waiting requests (as many as fit a token budget, where
//! the engine packs prompts into one forward), apply each prompt to its state, and hand each
//! state over the bridge to the decode engine (or answer a prefill-only request with it).

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

use super::decode::Handoff;
use super::request::{Event, Finish, Request, Timings};
use super::EngineTime;
use crate::bridge::handoff::{self, SendError};
use crate::engine::{Engine, PrefillStats};
use crate::state::DeviceState;

/// The requests waiting for a prefill, taken in batches.
pub(super) struct Queue {
    requests: Receiver<(Request, Instant)>,
    /// A request taken from the channel that did not fit the last batch (it leads the next).
    held: Option<(Request, Instant)>,
}

impl Queue {
    pub(super) fn new(requests: Receiver<(Request, Instant)>) -> Queue {
        Queue { requests, held: None }
    }

    /// The next requests to prefill, in arrival order: the first (waiting for it when `block`),
    /// then whatever else is waiting while their prompts together stay within `max_tokens` and
    /// they number at most `max_requests` (a first prompt longer than the budget goes alone).
    /// Empty when nothing waits and `block` is off; None once every sender is gone and nothing
    /// is left.
    pub(super) fn take(&mut self, block: bool, max_tokens: usize, max_requests: usize) -> Option<Vec<(Request, Instant)>> {
        let first = match self.held.take() {
            Some(r) => r,
            None if block => self.requests.recv().ok()?,
            None => match self.requests.try_recv() {
                Ok(r) => r,
                Err(_) => return Some(Vec::new()),
            },
        };
        let mut tokens = first.0.tokens.len();
        let mut batch = vec![first];
        while batch.len() < max_requests && tokens < max_tokens {
            let next = match self.requests.try_recv() {
                Ok(r) => r,
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            };
            if tokens + next.0.tokens.len() > max_tokens {
                self.held = Some(next);
                break;
            }
            tokens += next.0.tokens.len();
            batch.push(next);
        }
        Some(batch)
    }
}

pub(super) fn prefill_loop(engine: &Engine, mut queue: Queue, mut bridge: handoff::Sender<Handoff>, max_tokens: usize, time: &EngineTime) {
    let max_requests = if engine.packs_prompts() { usize::MAX } else { 1 };
    while let Some(mut batch) = queue.take(true, max_tokens, max_requests) {
        // With the file transfer, a fresh request that will decode is prefilled by a CPU engine
        // straight into a state file (its recurrent states live there from the start). A
        // request that continues a checkpoint starts from that state.
        let mut failed = vec![false; batch.len()];
        for ((request, _), failed) in batch.iter_mut().zip(&mut failed) {
            if request.start.is_none() && !request.tokens.is_empty() && request.max_tokens > 0 && engine.gpu().is_none() {
                match bridge.fresh_state(request.tokens.len()) {
                    Ok(state) => request.start = state,
                    Err(e) => {
                        let _ = request.events.send(Event::Failed { id: request.id, error: format!("{e:#}") });
                        *failed = true;
                    }
                }
            }
        }
        let mut kept = failed.iter();
        batch.retain(|_| !kept.next().copied().unwrap_or(false));
        let prefilled = prefill_requests(engine, &mut batch, time);
        for ((request, submitted), done) in batch.into_iter().zip(prefilled) {
            let Some((state, timings)) = done else { continue };
            if request.max_tokens == 0 {
                finish_prefill_only(request, state, timings);
                continue;
            }
            match bridge.send(Handoff { request, submitted, timings, prefilled: Instant::now() }, state) {
                Ok(()) => {}
                Err(SendError::Failed(h, e)) => {
                    let _ = h.request.events.send(Event::Failed { id: h.request.id, error: format!("{e:#}") });
                }
                Err(SendError::Closed) => return,
            }
        }
    }
}

/// Prefill `batch` on `engine`: in one forward where the engine packs prompts, else one after
/// another. Entry i is request i's state and timings, or None where the request failed or was
/// cancelled while it queued (it was answered).
pub(super) fn prefill_requests(engine: &Engine, batch: &mut [(Request, Instant)], time: &EngineTime) -> Vec<Option<(DeviceState, Timings)>> {
    // Each request's starting state (fresh, or the checkpoint it continues).
    let mut out: Vec<Option<(DeviceState, Timings)>> = Vec::with_capacity(batch.len());
    for (request, submitted) in batch.iter_mut() {
        let timings = Timings { queued: submitted.elapsed(), ..Default::default() };
        if request.cancel.load(Ordering::Relaxed) {
            let _ = request.events.send(Event::Done { id: request.id, finish: Finish::Cancelled, timings, state: None });
            out.push(None);
            continue;
        }
        let state = match request.start.take() {
            Some(state) => Ok(DeviceState::Host(state)),
            None => engine.new_state(),
        };
        match state {
            // Nothing new (a checkpoint continued as is): its logits must already be there.
            Ok(state) if request.tokens.is_empty() && !state.has_logits() => {
                let _ = request.events.send(Event::Failed { id: request.id, error: "nothing to prefill and no logits in the state to sample from".into() });
                out.push(None);
            }
            Ok(state) => out.push(Some((state, timings))),
            Err(e) => {
                let _ = request.events.send(Event::Failed { id: request.id, error: format!("{e:#}") });
                out.push(None);
            }
        }
    }
    // The prompts to apply: one call for all of them, or one each.
    let started = Instant::now();
    let mut todo: Vec<usize> = (0..batch.len()).filter(|&i| out[i].is_some() && !batch[i].0.tokens.is_empty()).collect();
    let results: Vec<anyhow::Result<PrefillStats>> = if todo.len() > 1 && engine.packs_prompts() {
        // A prompt the engine refuses (too long for the context) fails alone, not its batch.
        todo.retain(|&i| {
            let (request, state) = (&batch[i].0, &out[i].as_ref().expect("a state for every prompt to apply").0);
            match engine.check_prompt(&request.tokens, state.position()) {
                Ok(()) => true,
                Err(e) => {
                    let _ = request.events.send(Event::Failed { id: request.id, error: format!("{e:#}") });
                    out[i] = None;
                    false
                }
            }
        });
        let prompts: Vec<&[u32]> = todo.iter().map(|&i| &batch[i].0.tokens[..]).collect();
        let mut states: Vec<&mut DeviceState> = out.iter_mut().enumerate().filter(|(i, _)| todo.binary_search(i).is_ok()).map(|(_, o)| &mut o.as_mut().expect("a state for every prompt to apply").0).collect();
        match engine.prefill_batch(&prompts, &mut states) {
            Ok(stats) => stats.into_iter().map(Ok).collect(),
            // What fails now is the device (the prompts were checked): it fails every one.
            Err(e) => todo.iter().map(|_| Err(anyhow::anyhow!("{e:#}"))).collect(),
        }
    } else {
        todo.iter().map(|&i| engine.prefill(&batch[i].0.tokens, &mut out[i].as_mut().expect("a state for every prompt to apply").0)).collect()
    };
    EngineTime::add(&time.prefill_ns, started);
    for (&i, result) in todo.iter().zip(results) {
        match result {
            Ok(stats) => {
                if let Some((_, timings)) = &mut out[i] {
                    timings.prefill = stats;
                }
            }
            Err(e) => {
                let request = &batch[i].0;
                let _ = request.events.send(Event::Failed { id: request.id, error: format!("{e:#}") });
                out[i] = None;
            }
        }
    }
    out
}

/// Answer a prefill-only request.
pub(super) fn finish_prefill_only(request: Request, state: DeviceState, timings: Timings) {
    let event = match state.into_host() {
        Ok(state) => Event::Done { id: request.id, finish: Finish::Prefilled, timings, state: Some(state) },
        Err(e) => Event::Failed { id: request.id, error: format!("bringing the state back from the GPU: {e:#}") },
    };
    let _ = request.events.send(event);
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc::{channel, Sender};
    use std::sync::Arc;

    use super::*;
    use crate::sampling::SamplingParams;

    fn send(to: &Sender<(Request, Instant)>, id: u64, prompt: usize) {
        let (events, _) = channel();
        let request = Request { id, start: None, tokens: vec![1; prompt], max_tokens: 1, sampling: SamplingParams::default(), vocab: 8, stop_ids: vec![], return_state: false, cancel: Arc::new(AtomicBool::new(false)), events };
        to.send((request, Instant::now())).unwrap();
    }

    fn ids(batch: Option<Vec<(Request, Instant)>>) -> Option<Vec<u64>> {
        batch.map(|b| b.iter().map(|(r, _)| r.id).collect())
    }

    #[test]
    fn batches_fill_the_token_budget_in_arrival_order() {
        let (tx, rx) = channel();
        let mut queue = Queue::new(rx);
        for (id, prompt) in [(0, 100), (1, 200), (2, 300), (3, 5000), (4, 10), (5, 10), (6, 10)] {
            send(&tx, id, prompt);
        }
        // 100 + 200 fit 512; 300 more would not, and leads the next batch.
        assert_eq!(ids(queue.take(true, 512, usize::MAX)), Some(vec![0, 1]));
        assert_eq!(ids(queue.take(true, 512, usize::MAX)), Some(vec![2]));
        // A prompt longer than the budget goes alone.
        assert_eq!(ids(queue.take(true, 512, usize::MAX)), Some(vec![3]));
        // At most two requests a batch.
        assert_eq!(ids(queue.take(true, 512, 2)), Some(vec![4, 5]));
        assert_eq!(ids(queue.take(false, 512, 2)), Some(vec![6]));
        // Nothing waiting: empty without blocking; once the senders are gone, None.
        assert_eq!(ids(queue.take(false, 512, 2)), Some(vec![]));
        drop(tx);
        assert_eq!(ids(queue.take(true, 512, 2)), None);
    }
}
