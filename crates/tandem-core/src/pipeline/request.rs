//! What flows through the pipeline for one request: the `Request` a caller submits, the
//! `Event`s it gets back (snapshots of the state where asked, tokens as they are sampled, then
//! how it finished, with its timings and, when asked, its final state).

use std::sync::atomic::AtomicBool;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use crate::bridge::TransferTimes;
use crate::engine::PrefillStats;
use crate::sampling::{SamplingParams, TokenLogprobs};
use crate::state::{Snapshot, State};

/// One request: tokens to apply to a state (fresh, or a checkpoint of a conversation), then
/// up to `max_tokens` sampled tokens. With `max_tokens == 0` it is a prefill only, and its
/// `Done` carries the state.
pub struct Request {
    pub id: u64,
    /// The state to apply `tokens` to (None: a fresh one).
    pub start: Option<Start>,
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Ids that may be sampled (the tokenizer's vocabulary).
    pub vocab: usize,
    pub stop_ids: Vec<u32>,
    /// Send the final state back in `Done` (to checkpoint a conversation).
    pub return_state: bool,
    /// Where to send back a copy of the state while the prompt is applied (`Event::Snapshot`):
    /// after these many of `tokens`, ascending, each in 1..=tokens.len() (for a prefix cache).
    pub snapshots: Vec<usize>,
    /// Set to stop the request; its state is dropped.
    pub cancel: Arc<AtomicBool>,
    /// Where this request's events go.
    pub events: Sender<Event>,
    /// More sequences that continue the prompt's state beside this one (OpenAI's `n`): the
    /// prompt is prefilled once and its state copied for each.
    pub forks: Vec<Fork>,
}

/// A sequence forked from a request's prompt state: sampled as the request is but with its own
/// seed, stopped by its own flag, its events sent on the request's channel under its own id.
/// It never returns its state.
#[derive(Clone, Debug)]
pub struct Fork {
    pub id: u64,
    pub seed: u64,
    pub cancel: Arc<AtomicBool>,
}

impl Request {
    /// A request for `max_tokens` tokens after `tokens`, from a fresh state, sampled greedily
    /// over `vocab` ids with no stop tokens, its events to `events`; the other fields set by
    /// struct update where a caller wants more.
    pub fn new(id: u64, tokens: Vec<u32>, max_tokens: usize, vocab: usize, events: Sender<Event>) -> Request {
        Request {
            id,
            start: None,
            tokens,
            max_tokens,
            sampling: SamplingParams::default(),
            vocab,
            stop_ids: Vec::new(),
            return_state: false,
            snapshots: Vec::new(),
            cancel: Arc::new(AtomicBool::new(false)),
            events,
            forks: Vec::new(),
        }
    }

    /// The request a fork decodes as: this one's sampling, stops and channel, under the fork's
    /// id, seed and flag; no tokens of its own to apply.
    pub fn forked(&self, fork: &Fork) -> Request {
        Request {
            id: fork.id,
            start: None,
            tokens: Vec::new(),
            max_tokens: self.max_tokens,
            sampling: SamplingParams { seed: fork.seed, ..self.sampling.clone() },
            vocab: self.vocab,
            stop_ids: self.stop_ids.clone(),
            return_state: false,
            snapshots: Vec::new(),
            cancel: Arc::clone(&fork.cancel),
            events: self.events.clone(),
            forks: Vec::new(),
        }
    }
}

/// Where a request starts: a state of its own (a conversation's checkpoint), or a copy of a
/// snapshot a prefix cache holds (the engine makes the copy where it keeps its states: on its
/// GPU a snapshot kept there is copied without crossing to the host).
pub enum Start {
    State(State),
    Cached(Arc<Snapshot>),
}

impl Start {
    /// Tokens the state has applied.
    pub fn position(&self) -> usize {
        match self {
            Start::State(s) => s.position,
            Start::Cached(s) => s.position(),
        }
    }
}

impl From<State> for Start {
    fn from(s: State) -> Start {
        Start::State(s)
    }
}

/// How to sample one request (for `Pipeline::generate`).
#[derive(Clone, Debug)]
pub struct RequestParams {
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
    /// A copy of the state part way into the prompt (or at its end), as `snapshots` asked;
    /// before the request's tokens.
    Snapshot { id: u64, state: Snapshot },
    /// A sampled token, with its log-probabilities where the request asked for them.
    Token { id: u64, token: u32, logprobs: Option<Box<TokenLogprobs>> },
    Done { id: u64, finish: Finish, timings: Timings, state: Option<State> },
    Failed { id: u64, error: String },
}

impl Event {
    /// The request the event belongs to.
    pub fn id(&self) -> u64 {
        match self {
            Event::Snapshot { id, .. } | Event::Token { id, .. } | Event::Done { id, .. } | Event::Failed { id, .. } => *id,
        }
    }
}
