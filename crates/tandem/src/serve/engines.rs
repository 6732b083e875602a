//! From the async handlers to the engine threads and back. Handlers never compute: they submit
//! requests to the pipeline (whose engines run on their own threads) and await its events,
//! which one router thread hands to each request's channel. A request's handle cancels it when
//! dropped, so a client that goes away (its stream or handler future dropped) stops its
//! sequence at the next decode step, or before its prefill if it is still queued.
//!
//! Admission: at most `--max-concurrent` requests hold a sequence slot (the decode batch);
//! up to `--max-queue` more wait for one; past that a request is refused at once (429).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_core::sampling::SamplingParams;
use tandem_core::pipeline::{Event, Fork, Pipeline, Request, RequestParams, Start};
use tandem_core::state::Snapshot;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

type Routes = Arc<Mutex<HashMap<u64, mpsc::UnboundedSender<Event>>>>;

pub struct Engines {
    pipeline: Pipeline,
    /// The one sender every request's events go to (read by the router thread).
    events: std::sync::mpsc::Sender<Event>,
    routes: Routes,
    next_id: AtomicU64,
    slots: Arc<Semaphore>,
    max_concurrent: usize,
    max_queue: usize,
    waiting: Arc<AtomicUsize>,
    /// Mean seconds a request held its slot (for Retry-After), as f64 bits.
    mean_hold: AtomicU64,
}

/// A request refused because the queue is full; `retry_after` in seconds.
pub struct QueueFull {
    pub retry_after: u64,
}

/// A sequence slot; the request holding it is counted as active.
pub struct Slot {
    _permit: OwnedSemaphorePermit,
}

/// A submitted request: its events, in order (those of all its choices). Dropping it cancels
/// the request.
pub struct Running {
    /// Each choice's id in the pipeline and its stop flag; the first is the request's own.
    choices: Vec<(u64, Arc<AtomicBool>)>,
    pub events: mpsc::UnboundedReceiver<Event>,
    routes: Routes,
}

impl Drop for Running {
    fn drop(&mut self) {
        // After the request finished this changes nothing; before, the engine drops it.
        self.cancel();
        let mut routes = self.routes.lock().expect("routes lock");
        for (id, _) in &self.choices {
            routes.remove(id);
        }
    }
}

impl Running {
    /// Stop the request now (every choice): its states are dropped.
    pub fn cancel(&self) {
        for (_, flag) in &self.choices {
            flag.store(true, Ordering::Relaxed);
        }
    }

    /// Stop one choice (a stop string matched in it).
    pub fn cancel_choice(&self, choice: usize) {
        self.choices[choice].1.store(true, Ordering::Relaxed);
    }

    /// The choice (0..n) an event belongs to.
    pub fn choice_of(&self, event: &Event) -> Option<usize> {
        self.choices.iter().position(|&(id, _)| id == event.id())
    }
}

impl Engines {
    pub fn start(pipeline: Pipeline, max_concurrent: usize, max_queue: usize) -> Arc<Engines> {
        let (events, rx) = std::sync::mpsc::channel::<Event>();
        let routes: Routes = Arc::default();
        let router_routes = Arc::clone(&routes);
        std::thread::Builder::new()
            .name("tandem-router".into())
            .spawn(move || {
                // Ends when every sender is gone: the Engines and the pipeline's requests.
                for event in rx {
                    let id = event.id();
                    let last = !matches!(event, Event::Token { .. } | Event::Snapshot { .. });
                    let mut routes = router_routes.lock().expect("routes lock");
                    let target = if last { routes.remove(&id) } else { routes.get(&id).cloned() };
                    drop(routes);
                    // A request whose handle is gone was cancelled: its events are dropped.
                    if let Some(tx) = target {
                        let _ = tx.send(event);
                    }
                }
            })
            .expect("spawning the router thread");
        Arc::new(Engines {
            pipeline,
            events,
            routes,
            next_id: AtomicU64::new(1),
            slots: Arc::new(Semaphore::new(max_concurrent)),
            max_concurrent,
            max_queue,
            waiting: Arc::new(AtomicUsize::new(0)),
            mean_hold: AtomicU64::new(1f64.to_bits()),
        })
    }

    /// Wait for a sequence slot, or be refused when the queue is full.
    pub async fn admit(&self) -> Result<Slot, QueueFull> {
        if let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() {
            return Ok(Slot { _permit: permit });
        }
        // Counted while waiting, and uncounted however the wait ends (the client may go away).
        struct Waiting(Arc<AtomicUsize>);
        impl Drop for Waiting {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= self.max_queue {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            // Roughly when a slot frees for this request: the queue ahead of it, served
            // max_concurrent at a time, at the mean time a request holds a slot.
            let mean = f64::from_bits(self.mean_hold.load(Ordering::Relaxed));
            let rounds = (self.max_queue + 1) as f64 / self.max_concurrent as f64;
            return Err(QueueFull { retry_after: (mean * rounds).ceil().clamp(1.0, 60.0) as u64 });
        }
        let _waiting = Waiting(Arc::clone(&self.waiting));
        let permit = Arc::clone(&self.slots).acquire_owned().await.expect("the slot semaphore is never closed");
        Ok(Slot { _permit: permit })
    }

    /// Record how long a finished request held its slot (for Retry-After).
    pub fn held(&self, d: Duration) {
        let old = f64::from_bits(self.mean_hold.load(Ordering::Relaxed));
        self.mean_hold.store((0.9 * old + 0.1 * d.as_secs_f64()).to_bits(), Ordering::Relaxed);
    }

    pub fn queued(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    pub fn active(&self) -> usize {
        self.max_concurrent - self.slots.available_permits()
    }

    /// How full the decode engine's K/V cache is (a GPU engine's).
    pub fn kv_level(&self) -> Option<tandem_core::backend::cuda::qwen35::device_pool::PoolLevel> {
        self.pipeline.kv_level()
    }

    /// How full the decode engine's pool of state slots is (a GPU engine's).
    pub fn slot_level(&self) -> Option<tandem_core::backend::cuda::qwen35::device_pool::PoolLevel> {
        self.pipeline.slot_level()
    }

    /// Sequences swapped out of the K/V cache and back so far.
    pub fn swaps(&self) -> (u64, u64) {
        self.pipeline.swaps()
    }

    /// Engine time spent on (prefill, decode) work.
    pub fn busy(&self) -> (Duration, Duration) {
        self.pipeline.busy()
    }

    /// Trace `work` done on the calling thread from `started` to now (with `--trace`).
    pub fn trace(&self, started: std::time::Instant, work: tandem_core::pipeline::trace::Work) {
        self.pipeline.trace(started, work);
    }

    /// Run `tokens` applied to `start` (a fresh state when None), then sample as `params` says
    /// (`max_tokens` 0: prefill only, the state comes back in `Done`), `choices` sequences from
    /// the one prompt (the others forks of it, each seeded one further); `snapshots`: where the
    /// prefill sends back copies of the state (`Event::Snapshot`, counts of `tokens`).
    pub fn submit(&self, start: Option<Start>, tokens: Vec<u32>, params: RequestParams, snapshots: Vec<usize>, choices: usize) -> anyhow::Result<Running> {
        let (tx, rx) = mpsc::unbounded_channel();
        let choices: Vec<(u64, Arc<AtomicBool>)> = (0..choices.max(1)).map(|_| (self.next_id.fetch_add(1, Ordering::Relaxed), Arc::new(AtomicBool::new(false)))).collect();
        let mut routes = self.routes.lock().expect("routes lock");
        for (id, _) in &choices {
            routes.insert(*id, tx.clone());
        }
        drop(routes);
        let seed = params.sampling.seed;
        let forks = choices[1..].iter().zip(1u64..).map(|((id, cancel), k)| Fork { id: *id, seed: seed.wrapping_add(k), cancel: Arc::clone(cancel) }).collect();
        let (id, cancel) = (choices[0].0, Arc::clone(&choices[0].1));
        let running = Running { choices, events: rx, routes: Arc::clone(&self.routes) };
        self.pipeline.submit(Request { start, sampling: params.sampling, stop_ids: params.stop_ids, snapshots, cancel, forks, ..Request::new(id, tokens, params.max_tokens, params.vocab, self.events.clone()) })?;
        Ok(running)
    }

    /// Prefill `tokens` into `start` (fresh when None) for the snapshots taken where
    /// `snapshots` says (counts of `tokens`, ascending; the last one its end).
    pub async fn prefill(&self, start: Option<Start>, tokens: Vec<u32>, snapshots: Vec<usize>) -> anyhow::Result<Vec<Snapshot>> {
        let prefill_only = RequestParams { max_tokens: 0, sampling: SamplingParams::default(), vocab: usize::MAX, stop_ids: Vec::new() };
        let mut running = self.submit(start, tokens, prefill_only, snapshots, 1)?;
        let mut taken = Vec::new();
        loop {
            match running.events.recv().await {
                Some(Event::Snapshot { state, .. }) => taken.push(state),
                Some(Event::Done { .. }) => return Ok(taken),
                Some(Event::Failed { error, .. }) => anyhow::bail!("{error}"),
                _ => anyhow::bail!("the engines stopped before the prefill finished"),
            }
        }
    }
}
