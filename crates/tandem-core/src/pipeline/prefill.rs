//! The prefill engine's loop: take the waiting requests (as many as fit a token budget, where
//! the engine packs prompts into one forward), apply each prompt to its state, and hand each
//! state over the bridge to the decode engine (or answer a prefill-only request with it).

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use super::decode::{cannot_hold, kv_limit, Handoff};
use super::host_budget::{HostBudget, Lease};
use super::request::{Event, Finish, Request, Start, Timings};
use super::trace::Work;
use super::EngineTime;
use crate::bridge::handoff::{self, SendError};
use crate::backend::cuda::qwen35::{device_pool::PoolFull, kv_cache::KV_BLOCK};
use crate::engine::{Engine, PrefillStats};
use crate::state::DeviceState;

/// Room in an engine's pools for new requests: K/V blocks of `KV_BLOCK` positions (what the
/// cache could give out now, and the most it ever holds) and state slots (one a request).
#[derive(Clone, Copy, Debug)]
pub(super) struct KvRoom {
    pub available: usize,
    pub limit: usize,
    pub slots: usize,
}

impl KvRoom {
    /// The room of `engine`'s pools (of the CPU decode engine's budget `host`, where there is
    /// one) after keeping `reserve` blocks back (for the running sequences' next blocks); None
    /// where nothing limits the K/V cache.
    pub(super) fn of(engine: &Engine, host: Option<&Arc<HostBudget>>, reserve: usize) -> Option<KvRoom> {
        if let Some(h) = host {
            let (available, slots) = h.available();
            return Some(KvRoom { available: available.saturating_sub(reserve), limit: h.block_limit(), slots });
        }
        let pool = engine.kv_pool()?;
        let (available, limit) = (pool.available()?, pool.level().limit?);
        let slots = engine.slot_pool().and_then(|p| p.available()).unwrap_or(usize::MAX);
        Some(KvRoom { available: available.saturating_sub(reserve), limit, slots })
    }
}

/// K/V blocks a sequence must still take to hold `end` positions: what its lease lacks under a
/// CPU decode engine's budget, else what its state lacks (all of them for a host state).
pub(super) fn blocks_short(lease: Option<&Lease>, state: &DeviceState, end: usize) -> usize {
    match lease {
        Some(l) => l.blocks_short(end),
        None => state.kv_blocks_short(end),
    }
}

/// K/V blocks a request takes to prefill its prompt and decode its first token.
pub(super) fn kv_blocks(r: &Request) -> usize {
    (r.start.as_ref().map_or(0, Start::position) + r.tokens.len() + 1).div_ceil(KV_BLOCK)
}

/// The requests waiting for a prefill, taken in batches.
pub(super) struct Queue {
    requests: Receiver<(Request, Instant)>,
    /// Requests taken from the channel that did not fit the last batch, or whose prefill found
    /// the K/V cache full (they lead the next batches, in order).
    held: std::collections::VecDeque<(Request, Instant)>,
}

impl Queue {
    pub(super) fn new(requests: Receiver<(Request, Instant)>) -> Queue {
        Queue { requests, held: Default::default() }
    }

    /// The next requests to prefill, in arrival order: the first (waiting for it when `block`),
    /// then whatever else is waiting while their prompts together stay within `max_tokens` and
    /// they number at most `max_requests` (a first prompt longer than the budget goes alone;
    /// with `split`, the last one taken may run past the budget, to be applied in chunks) and
    /// their K/V blocks and state slots fit `room` (where the pools have limits: a first
    /// request that does not fit waits, unless its blocks could never fit, which its prefill
    /// then reports). Empty when
    /// nothing waits and `block` is off, or the first waits for room; None once every sender
    /// is gone and nothing is left.
    pub(super) fn take(&mut self, block: bool, max_tokens: usize, max_requests: usize, room: Option<KvRoom>, split: bool) -> Option<Vec<(Request, Instant)>> {
        let first = match self.held.pop_front() {
            Some(r) => r,
            None if block => self.requests.recv().ok()?,
            None => match self.requests.try_recv() {
                Ok(r) => r,
                Err(_) => return Some(Vec::new()),
            },
        };
        let mut free = room.map(|r| r.available);
        if let Some(r) = room {
            let need = kv_blocks(&first.0);
            if (need > r.available && need <= r.limit) || r.slots == 0 {
                self.held.push_front(first);
                return Some(Vec::new());
            }
            free = Some(r.available.saturating_sub(need));
        }
        let max_requests = max_requests.min(room.map_or(usize::MAX, |r| r.slots));
        let mut tokens = first.0.tokens.len();
        let mut batch = vec![first];
        while batch.len() < max_requests && tokens < max_tokens {
            let next = match self.held.pop_front() {
                Some(r) => r,
                None => match self.requests.try_recv() {
                    Ok(r) => r,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                },
            };
            let need = kv_blocks(&next.0);
            if (!split && tokens + next.0.tokens.len() > max_tokens) || free.is_some_and(|f| need > f) {
                self.held.push_front(next);
                break;
            }
            free = free.map(|f| f - need);
            tokens += next.0.tokens.len();
            batch.push(next);
        }
        Some(batch)
    }

    /// Whether a request taken from the channel waits for the next batch.
    pub(super) fn holds_one(&self) -> bool {
        !self.held.is_empty()
    }

    /// Put requests back at the head of the queue, in this order (their prefill found the K/V
    /// cache full).
    pub(super) fn put_back(&mut self, requests: Vec<(Request, Instant)>) {
        for r in requests.into_iter().rev() {
            self.held.push_front(r);
        }
    }
}

/// `host`: the CPU decode engine's memory budget, where it has one (each request takes its
/// lease before its prefill, and hands it over with its state).
pub(super) fn prefill_loop(engine: &Engine, mut queue: Queue, mut bridge: handoff::Sender<Handoff>, max_tokens: usize, host: Option<&Arc<HostBudget>>, time: &EngineTime) {
    let max_requests = if engine.packs_prompts() { usize::MAX } else { 1 };
    // Blocks kept back for the decode engine's running sequences (where the two share a pool or
    // a budget): one in a hundred, as they take one more every KV_BLOCK tokens.
    let reserve = kv_limit(engine, host).map_or(0, |l| l.div_ceil(100));
    while let Some(mut batch) = queue.take(true, max_tokens, max_requests, KvRoom::of(engine, host, reserve), false) {
        if batch.is_empty() {
            // The next request waits for the decode engine to free blocks.
            std::thread::sleep(std::time::Duration::from_millis(1));
            continue;
        }
        // With the file transfer, a fresh request that will decode is prefilled by a CPU engine
        // straight into a state file (its recurrent states live there from the start). A
        // request that continues a checkpoint starts from that state.
        let mut failed = vec![false; batch.len()];
        for ((request, _), failed) in batch.iter_mut().zip(&mut failed) {
            if request.start.is_none() && !request.tokens.is_empty() && request.max_tokens > 0 && engine.gpu().is_none() {
                match bridge.fresh_state(request.tokens.len()) {
                    Ok(state) => request.start = state.map(Start::State),
                    Err(e) => {
                        let _ = request.events.send(Event::Failed { id: request.id, error: format!("{e:#}") });
                        *failed = true;
                    }
                }
            }
        }
        let mut kept = failed.iter();
        batch.retain(|_| !kept.next().copied().unwrap_or(false));
        let mut retry = Vec::new();
        for done in prefill_requests(engine, host, batch, time) {
            let p = match done {
                Prefilled::Done(p) => p,
                Prefilled::Answered => continue,
                Prefilled::NoRoom(request) => {
                    retry.push(*request);
                    continue;
                }
            };
            let Prefill { request, submitted, state, timings, lease, .. } = *p;
            if request.max_tokens == 0 {
                finish_prefill_only(request, state, timings);
                continue;
            }
            match bridge.send(Handoff { request, submitted, timings, prefilled: Instant::now(), lease }, state) {
                Ok(()) => {}
                Err(SendError::Failed(h, e)) => {
                    let _ = h.request.events.send(Event::Failed { id: h.request.id, error: format!("{e:#}") });
                }
                Err(SendError::Closed) => return,
            }
        }
        if !retry.is_empty() {
            // The decode engine took the blocks meanwhile: wait for it to free some.
            queue.put_back(retry);
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// What became of one request of a prefill batch.
pub(super) enum Prefilled {
    /// Prefilled.
    Done(Box<Prefill>),
    /// Failed or cancelled while it queued, and answered.
    Answered,
    /// The K/V cache had no room for it: the request to go back to the queue, from where it
    /// stopped (`Prefill::unstart`), or as it came where nothing was applied.
    NoRoom(Box<(Request, Instant)>),
}

/// Prefill `batch` on `engine`, each prompt whole: in one forward where the engine packs
/// prompts, else one after another; a request that asked for snapshots part way has its prompt
/// applied in pieces up to each (the pieces of the batch's requests packed together in turn).
/// Entry i is what became of request i.
pub(super) fn prefill_requests(engine: &Engine, host: Option<&Arc<HostBudget>>, batch: Vec<(Request, Instant)>, time: &EngineTime) -> Vec<Prefilled> {
    let mut started: Vec<Started> = batch.into_iter().map(|(request, submitted)| Prefill::start(engine, host, request, submitted, time)).collect();
    // What ended each prefill's run of pieces: None while it has more to apply, and for one
    // with nothing to apply (a checkpoint continued as it is).
    let mut ended: Vec<Option<Chunk>> = started.iter().map(|_| None).collect();
    loop {
        let running = started.iter_mut().zip(&ended).map(|(p, end)| p.as_mut().ok().and_then(Option::as_mut).filter(|p| end.is_none() && p.remaining() > 0));
        let outcomes = apply_chunks(engine, running, Prefill::to_next_stop, time);
        if outcomes.iter().all(Option::is_none) {
            break;
        }
        for ((p, end), outcome) in started.iter_mut().zip(&mut ended).zip(outcomes) {
            match outcome {
                Some(Chunk::Applied) => {
                    let p = p.as_mut().ok().and_then(Option::as_mut).expect("a prefill that applied a piece");
                    p.send_snapshot(engine, time);
                    if p.remaining() == 0 {
                        *end = Some(Chunk::Applied);
                    }
                }
                Some(other) => *end = Some(other),
                None => {}
            }
        }
    }
    started
        .into_iter()
        .zip(ended)
        .map(|(p, outcome)| match (p, outcome) {
            // No free state slot: back to the queue.
            (Err(request), _) => Prefilled::NoRoom(request),
            (Ok(None), _) => Prefilled::Answered,
            (Ok(Some(p)), None | Some(Chunk::Applied)) => Prefilled::Done(Box::new(p)),
            (Ok(Some(p)), Some(Chunk::NoRoom(why))) => match p.unstart() {
                (request, Ok(())) => Prefilled::NoRoom(Box::new(request)),
                ((request, _), Err(e)) => {
                    let _ = request.events.send(Event::Failed { id: request.id, error: format!("{why}; then bringing its state back: {e:#}") });
                    Prefilled::Answered
                }
            },
            (Ok(Some(p)), Some(Chunk::Failed(error))) => {
                p.fail(error);
                Prefilled::Answered
            }
        })
        .collect()
}

/// A request whose prompt is being applied to its state, perhaps in several forwards (the
/// one-engine schedule applies a long prompt a chunk per step, between decode steps).
pub(super) struct Prefill {
    pub request: Request,
    pub submitted: Instant,
    pub state: DeviceState,
    pub timings: Timings,
    /// Prompt tokens applied so far.
    pub applied: usize,
    /// Its share of a CPU decode engine's memory budget: a slot, and the blocks of the whole
    /// prompt and the first token.
    pub lease: Option<Lease>,
}

/// What `Prefill::start` made of a request: a prefill (None where the request was answered), or
/// the request as it came where no state slot was free.
pub(super) type Started = Result<Option<Prefill>, Box<(Request, Instant)>>;

/// What became of one chunk of a prompt.
pub(super) enum Chunk {
    /// Applied; the state's logits are those of the chunk's last token.
    Applied,
    /// The K/V cache had no room for it; nothing was applied.
    NoRoom(String),
    /// The engine failed it; the state must not be used.
    Failed(String),
}

impl Prefill {
    /// A request's starting state (fresh, or the checkpoint it continues), its prompt checked
    /// against the engine's context. A request cancelled while it queued, or that cannot start,
    /// is answered here and gives None; one that finds no free state slot (or, under a CPU
    /// decode engine's budget `host`, no room for its lease) comes back as it was (Err), to
    /// wait for one.
    pub(super) fn start(engine: &Engine, host: Option<&Arc<HostBudget>>, mut request: Request, submitted: Instant, time: &EngineTime) -> Started {
        let timings = Timings { queued: submitted.elapsed(), ..Default::default() };
        if request.cancel.load(Ordering::Relaxed) {
            let _ = request.events.send(Event::Done { id: request.id, finish: Finish::Cancelled, timings, state: None });
            return Ok(None);
        }
        let lease = match host {
            Some(h) => match h.lease(kv_blocks(&request) * KV_BLOCK) {
                Ok(lease) => Some(lease),
                Err(_) if kv_blocks(&request) > h.block_limit() => {
                    let _ = request.events.send(Event::Failed { id: request.id, error: cannot_hold(kv_blocks(&request), h.block_limit()) });
                    return Ok(None);
                }
                Err(_) => return Err(Box::new((request, submitted))),
            },
            None => None,
        };
        let state = match &request.start {
            Some(Start::State(_)) => match request.start.take() {
                Some(Start::State(state)) => Ok(DeviceState::Host(state)),
                _ => unreachable!("matched above"),
            },
            Some(Start::Cached(snapshot)) => {
                let started = Instant::now();
                let restored = engine.restore(snapshot, request.tokens.is_empty());
                time.span(started, || Work::Restore { tokens: snapshot.position(), tier: snapshot.tier().name() });
                restored
            }
            None => engine.new_state(),
        };
        // No slot or block free: the request waits as it came (its start still in it).
        let state = match state {
            Err(e) if PoolFull::is(&e) => return Err(Box::new((request, submitted))),
            made => made,
        };
        if matches!(request.start, Some(Start::Cached(_))) {
            request.start = None;
        }
        let checked = state.and_then(|state| {
            if request.tokens.is_empty() && !state.has_logits() {
                anyhow::bail!("nothing to prefill and no logits in the state to sample from");
            }
            if !request.tokens.is_empty() {
                engine.check_prompt(&request.tokens, state.position())?;
            }
            Ok(state)
        });
        match checked {
            Ok(state) => Ok(Some(Prefill { request, submitted, state, timings, applied: 0, lease })),
            Err(e) => {
                let _ = request.events.send(Event::Failed { id: request.id, error: format!("{e:#}") });
                Ok(None)
            }
        }
    }

    /// Prompt tokens still to apply.
    pub(super) fn remaining(&self) -> usize {
        self.request.tokens.len() - self.applied
    }

    /// Prompt tokens to apply before the next snapshot the request asked for (or its end).
    pub(super) fn to_next_stop(&self) -> usize {
        let end = self.request.tokens.len();
        self.request.snapshots.iter().find(|&&s| s > self.applied).map_or(end, |&s| s.min(end)) - self.applied
    }

    /// Send the snapshot the request asked for at this point, if it did. A copy that fails (a
    /// GPU that cannot copy out the state also fails the next forward, which answers the
    /// request) is left out, with a line on stderr: a snapshot only saves later work.
    pub(super) fn send_snapshot(&self, engine: &Engine, time: &EngineTime) {
        if self.applied == 0 || !self.request.snapshots.contains(&self.applied) {
            return;
        }
        let started = Instant::now();
        let taken = engine.snapshot(&self.state);
        time.span(started, || Work::Snapshot { tokens: self.state.position() });
        match taken {
            Ok(state) => {
                let _ = self.request.events.send(Event::Snapshot { id: self.request.id, state });
            }
            Err(e) => eprintln!("request {}: no snapshot after {} tokens: {e:#}", self.request.id, self.state.position()),
        }
    }

    /// K/V blocks the request still has to take to hold its whole prompt and first token (none
    /// under a CPU budget: its lease holds them from the start).
    pub(super) fn kv_blocks_short(&self) -> usize {
        blocks_short(self.lease.as_ref(), &self.state, self.state.position() + self.remaining() + 1)
    }

    /// The request to queue again, to go on where it stopped: what was applied of its prompt
    /// is in its starting state (`start`, in host memory; a fresh state where nothing was), the
    /// rest is its prompt. With an error where the state could not be brought back (the
    /// request must then be answered with it).
    pub(super) fn unstart(self) -> ((Request, Instant), anyhow::Result<()>) {
        let Prefill { mut request, submitted, state, applied, .. } = self;
        let mut brought = Ok(());
        if state.position() > 0 {
            match state.into_host() {
                Ok(s) => request.start = Some(Start::State(s)),
                Err(e) => brought = Err(e),
            }
        }
        request.tokens.drain(..applied);
        request.snapshots = request.snapshots.iter().filter(|&&s| s > applied).map(|&s| s - applied).collect();
        ((request, submitted), brought)
    }

    /// Answer the request with an error.
    pub(super) fn fail(self, error: String) {
        let _ = self.request.events.send(Event::Failed { id: self.request.id, error });
    }
}

/// Apply to each prefill the next `len(p)` tokens of its prompt (none where that is 0, or for
/// None): in one forward where the engine packs prompts, else one after another. Entry i is
/// what became of prefill i's chunk (None where it had none).
pub(super) fn apply_chunks<'p>(engine: &Engine, prefills: impl Iterator<Item = Option<&'p mut Prefill>>, mut len: impl FnMut(&Prefill) -> usize, time: &EngineTime) -> Vec<Option<Chunk>> {
    let mut outcomes = Vec::new();
    let mut at = Vec::new();
    let mut chunks: Vec<(&mut Prefill, usize)> = Vec::new();
    for (i, p) in prefills.enumerate() {
        outcomes.push(None);
        if let Some(p) = p {
            let n = len(p);
            if n > 0 {
                at.push(i);
                chunks.push((p, n));
            }
        }
    }
    let started = Instant::now();
    let results: Vec<anyhow::Result<PrefillStats>> = if chunks.len() > 1 && engine.packs_prompts() {
        let (mut prompts, mut states) = (Vec::with_capacity(chunks.len()), Vec::with_capacity(chunks.len()));
        for (p, len) in chunks.iter_mut() {
            let Prefill { request, state, applied, .. } = &mut **p;
            prompts.push(&request.tokens[*applied..*applied + *len]);
            states.push(state);
        }
        match engine.prefill_batch(&prompts, &mut states) {
            Ok(stats) => stats.into_iter().map(Ok).collect(),
            // What fails now is the device or the cache (the prompts were checked): every one.
            Err(e) => prompts.iter().map(|_| Err(anyhow::anyhow!("{e:#}"))).collect(),
        }
    } else {
        chunks.iter_mut().map(|(p, len)| engine.prefill(&p.request.tokens[p.applied..p.applied + *len], &mut p.state)).collect()
    };
    EngineTime::add(&time.prefill_ns, started);
    time.span(started, || Work::Prefill { prompts: chunks.len(), tokens: chunks.iter().map(|(_, len)| len).sum() });
    for ((i, (p, len)), result) in at.into_iter().zip(chunks).zip(results) {
        outcomes[i] = Some(match result {
            Ok(stats) => {
                p.applied += len;
                let t = &mut p.timings.prefill;
                t.tokens += stats.tokens;
                t.dispatches += stats.dispatches;
                t.padded_rows += stats.padded_rows;
                t.time += stats.time;
                Chunk::Applied
            }
            Err(e) if PoolFull::is(&e) => Chunk::NoRoom(format!("{e:#}")),
            Err(e) => Chunk::Failed(format!("{e:#}")),
        });
    }
    outcomes
}

/// Answer a prefill-only request.
pub(super) fn finish_prefill_only(request: Request, state: DeviceState, timings: Timings) {
    let event = match request.return_state.then(|| state.into_host()).transpose() {
        Ok(state) => Event::Done { id: request.id, finish: Finish::Prefilled, timings, state },
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
        let request = Request { id, start: None, tokens: vec![1; prompt], max_tokens: 1, sampling: SamplingParams::default(), vocab: 8, stop_ids: vec![], return_state: false, snapshots: vec![], cancel: Arc::new(AtomicBool::new(false)), events, forks: Vec::new() };
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
        assert_eq!(ids(queue.take(true, 512, usize::MAX, None, false)), Some(vec![0, 1]));
        assert_eq!(ids(queue.take(true, 512, usize::MAX, None, false)), Some(vec![2]));
        // A prompt longer than the budget goes alone.
        assert_eq!(ids(queue.take(true, 512, usize::MAX, None, false)), Some(vec![3]));
        // At most two requests a batch.
        assert_eq!(ids(queue.take(true, 512, 2, None, false)), Some(vec![4, 5]));
        assert_eq!(ids(queue.take(false, 512, 2, None, false)), Some(vec![6]));
        // Nothing waiting: empty without blocking; once the senders are gone, None.
        assert_eq!(ids(queue.take(false, 512, 2, None, false)), Some(vec![]));
        drop(tx);
        assert_eq!(ids(queue.take(true, 512, 2, None, false)), None);
    }

    #[test]
    fn a_split_batch_covers_the_token_budget() {
        let (tx, rx) = channel();
        let mut queue = Queue::new(rx);
        for (id, prompt) in [(0, 100), (1, 300), (2, 300), (3, 10)] {
            send(&tx, id, prompt);
        }
        // The second prompt runs past 256 tokens: it is taken (to be applied in chunks), and
        // nothing after it.
        assert_eq!(ids(queue.take(true, 256, usize::MAX, None, true)), Some(vec![0, 1]));
        assert_eq!(ids(queue.take(true, 256, usize::MAX, None, true)), Some(vec![2]));
        assert_eq!(ids(queue.take(true, 256, usize::MAX, None, true)), Some(vec![3]));
    }

    #[test]
    fn batches_fit_the_room_in_the_kv_cache() {
        let (tx, rx) = channel();
        let mut queue = Queue::new(rx);
        // Blocks of 16 positions, for the prompt and the first token: 2, 3, 1, 7.
        for (id, prompt) in [(0, 20), (1, 40), (2, 3), (3, 100)] {
            send(&tx, id, prompt);
        }
        let room = |available| Some(KvRoom { available, limit: 8, slots: usize::MAX });
        // The first waits while it does not fit; then as many as fit.
        assert_eq!(ids(queue.take(true, 512, usize::MAX, room(1), false)), Some(vec![]));
        assert!(queue.holds_one());
        assert_eq!(ids(queue.take(true, 512, usize::MAX, room(6), false)), Some(vec![0, 1, 2]));
        assert_eq!(ids(queue.take(true, 512, usize::MAX, room(6), false)), Some(vec![]));
        assert_eq!(ids(queue.take(true, 512, usize::MAX, room(7), false)), Some(vec![3]));
        // One that could never fit is taken (its prefill says why it fails).
        send(&tx, 4, 200);
        assert_eq!(ids(queue.take(true, 512, usize::MAX, room(2), false)), Some(vec![4]));
    }

    #[test]
    fn batches_take_one_free_state_slot_a_request() {
        let (tx, rx) = channel();
        let mut queue = Queue::new(rx);
        for id in 0..5 {
            send(&tx, id, 10);
        }
        let room = |slots| Some(KvRoom { available: 100, limit: 100, slots });
        // No free slot: the first waits; then as many as there are slots.
        assert_eq!(ids(queue.take(true, 512, usize::MAX, room(0), false)), Some(vec![]));
        assert_eq!(ids(queue.take(true, 512, usize::MAX, room(2), false)), Some(vec![0, 1]));
        assert_eq!(ids(queue.take(true, 512, usize::MAX, room(1), false)), Some(vec![2]));
        assert_eq!(ids(queue.take(true, 512, usize::MAX, room(5), false)), Some(vec![3, 4]));
    }
}
