//! A copy of a request's state taken part way into its prompt or at its end, for a prefix
//! cache: in host memory (its attention K/V in spans that snapshots along one path share), or
//! kept on the GPU of the engine that took it (its K/V blocks shared with the state it came
//! from). Nothing writes into a snapshot; a request that continues one starts from a copy of
//! it (`Engine::restore`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::Result;

use super::{LayerState, State};
use crate::backend::cuda::qwen35::GpuSnapshot;

pub enum Snapshot {
    Host(HostSnapshot),
    Gpu(GpuSnapshot),
}

/// A number no other snapshot of this process has (a snapshot keeps its number as it moves
/// from the GPU to host memory).
pub fn new_snapshot_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The snapshots a state went on from: for each, its number and position, earliest first. A
/// state's attention K/V rows before such a position are that snapshot's, bit for bit (a
/// restore copies or shares them, and nothing writes a K/V row twice), so a copy of the state
/// can share that snapshot's rows without comparing them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lineage(Vec<(u64, usize)>);

impl Lineage {
    /// This lineage, then snapshot `id` of `position`.
    pub fn then(&self, id: u64, position: usize) -> Lineage {
        let mut l = self.0.clone();
        l.push((id, position));
        Lineage(l)
    }

    /// Whether the state went on from snapshot `id` (at `position`).
    pub fn holds(&self, id: u64, position: usize) -> bool {
        self.0.contains(&(id, position))
    }
}

/// A state in host memory whose attention keys and values are held as a chain of spans of
/// positions: a snapshot taken further along a prompt than another shares that one's spans
/// and holds only the positions past it, so that snapshots every N tokens of a long prompt
/// cost its K/V once rather than once per snapshot.
pub struct HostSnapshot {
    /// The state, its attention layers' K/V left empty (they are in `kv`).
    rest: State,
    kv: Arc<KvSpan>,
    /// Its number (`new_snapshot_id`), and the snapshots the state it was taken of went on from.
    pub id: u64,
    pub lineage: Lineage,
}

/// The K/V rows of positions `[from, to)` of every attention layer, after those of `before`
/// (positions `[0, from)`).
pub struct KvSpan {
    from: usize,
    to: usize,
    /// Per attention layer: keys, values.
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    before: Option<Arc<KvSpan>>,
}

impl KvSpan {
    /// The spans from this one back to position 0.
    fn chain(self: &Arc<KvSpan>) -> impl Iterator<Item = &Arc<KvSpan>> {
        std::iter::successors(Some(self), |s| s.before.as_ref())
    }

    pub fn bytes(&self) -> usize {
        4 * self.layers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
    }
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

impl HostSnapshot {
    /// `state` as a snapshot of its own (one span).
    pub fn new(state: State) -> HostSnapshot {
        Self::after(state, None)
    }

    /// A snapshot of `rest` (a state whose attention layers hold only the K/V rows past
    /// `before`'s end) that shares `before`'s spans: the caller knows those rows are the
    /// state's (its lineage holds the snapshot they belong to).
    pub fn sharing(mut rest: State, before: Arc<KvSpan>) -> HostSnapshot {
        let layers = rest.layers.iter_mut().filter_map(|l| if let LayerState::Full { k, v } = l { Some((std::mem::take(k), std::mem::take(v))) } else { None }).collect();
        let kv = Arc::new(KvSpan { from: before.to, to: rest.position, layers, before: Some(before) });
        HostSnapshot { rest, kv, id: new_snapshot_id(), lineage: Lineage::default() }
    }

    /// The snapshot under the number and lineage of the one it copies (a GPU snapshot's).
    pub fn numbered(self, id: u64, lineage: Lineage) -> HostSnapshot {
        HostSnapshot { id, lineage, ..self }
    }

    /// Its K/V spans, to be shared by a snapshot that goes on from it (`sharing`).
    pub fn kv(&self) -> &Arc<KvSpan> {
        &self.kv
    }

    /// The K/V rows of attention layer `a` at position `p` (key, value; `row` values each).
    pub fn kv_row(&self, a: usize, p: usize, row: usize) -> (&[f32], &[f32]) {
        let span = self.kv.chain().find(|s| s.from <= p).expect("the spans reach back to position 0");
        let at = (p - span.from) * row;
        let (k, v) = &span.layers[a];
        (&k[at..at + row], &v[at..at + row])
    }

    /// Its recurrent states, conv windows and logits: the state without its attention K/V.
    pub fn rest(&self) -> &State {
        &self.rest
    }

    /// `state` as a snapshot that shares `earlier`'s K/V spans where it continues it: where
    /// `earlier` lies at or before it and its K/V rows are, bit for bit, the first rows of
    /// `state`'s (a state that continued `earlier`, or went through the same tokens on an
    /// engine that computes them the same way). Otherwise a snapshot of its own.
    pub fn continuing(state: State, earlier: &HostSnapshot) -> HostSnapshot {
        let shares = earlier.position() <= state.position && {
            let rows = |k: &Vec<f32>| k.len() / state.position.max(1);
            let full = state.layers.iter().filter_map(|l| if let LayerState::Full { k, v } = l { Some((k, v)) } else { None });
            earlier.kv.chain().all(|span| {
                span.layers.iter().zip(full.clone()).all(|((ek, ev), (k, v))| {
                    let (at, n) = (span.from * rows(k), (span.to - span.from) * rows(k));
                    same_bits(ek, &k[at..at + n]) && same_bits(ev, &v[at..at + n])
                })
            })
        };
        Self::after(state, shares.then(|| earlier.kv.clone()))
    }

    /// `state` with its K/V rows past `before`'s in a new span.
    fn after(mut state: State, before: Option<Arc<KvSpan>>) -> HostSnapshot {
        let from = before.as_ref().map_or(0, |b| b.to);
        let position = state.position;
        let mut layers = Vec::new();
        for l in &mut state.layers {
            if let LayerState::Full { k, v } = l {
                let row = k.len() / position.max(1);
                let (mut k, mut v) = (std::mem::take(k), std::mem::take(v));
                if from > 0 {
                    k.drain(..from * row);
                    v.drain(..from * row);
                    k.shrink_to_fit();
                    v.shrink_to_fit();
                }
                layers.push((k, v));
            }
        }
        HostSnapshot { rest: state, kv: Arc::new(KvSpan { from, to: position, layers, before }), id: new_snapshot_id(), lineage: Lineage::default() }
    }

    pub fn position(&self) -> usize {
        self.rest.position
    }

    /// The whole state (moved out where it is one span, gathered from its spans otherwise).
    pub fn into_state(self) -> State {
        match Arc::try_unwrap(self.kv) {
            Ok(KvSpan { from: 0, layers, .. }) => {
                let mut state = self.rest;
                let mut kv = layers.into_iter();
                for l in &mut state.layers {
                    if let LayerState::Full { k, v } = l {
                        (*k, *v) = kv.next().expect("a span has K/V for every attention layer");
                    }
                }
                state
            }
            Ok(span) => HostSnapshot { kv: Arc::new(span), ..self }.to_state(),
            Err(kv) => HostSnapshot { kv, ..self }.to_state(),
        }
    }

    /// The whole state, its K/V gathered from the spans.
    pub fn to_state(&self) -> State {
        let spans: Vec<&Arc<KvSpan>> = self.kv.chain().collect();
        let mut state = self.rest.clone();
        let mut a = 0;
        for l in &mut state.layers {
            if let LayerState::Full { k, v } = l {
                for span in spans.iter().rev() {
                    k.extend_from_slice(&span.layers[a].0);
                    v.extend_from_slice(&span.layers[a].1);
                }
                a += 1;
            }
        }
        state
    }

    /// Bytes of its own (recurrent states, conv windows, logits), the K/V spans aside.
    pub fn own_bytes(&self) -> usize {
        self.rest.bytes()
    }

    /// Its K/V spans (some shared with other snapshots): an address to tell them apart, and
    /// their bytes.
    pub fn spans(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.kv.chain().map(|s| (Arc::as_ptr(s) as usize, s.bytes()))
    }

    /// Bytes it holds, its shared spans counted whole.
    pub fn bytes(&self) -> usize {
        self.own_bytes() + self.spans().map(|(_, b)| b).sum::<usize>()
    }
}

/// Where a snapshot lives (the prefix cache's tiers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

impl Tier {
    /// The name `/metrics` labels it with.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

impl Snapshot {
    /// Tokens the state has applied.
    pub fn position(&self) -> usize {
        match self {
            Snapshot::Host(s) => s.position(),
            Snapshot::Gpu(s) => s.position,
        }
    }

    pub fn tier(&self) -> Tier {
        match self {
            Snapshot::Host(_) => Tier::Host,
            Snapshot::Gpu(_) => Tier::Device,
        }
    }

    /// Bytes it holds where it lives (a GPU snapshot's shared blocks counted whole).
    pub fn bytes(&self) -> usize {
        match self {
            Snapshot::Host(s) => s.bytes(),
            Snapshot::Gpu(s) => s.bytes(),
        }
    }

    /// A host copy of it (for an engine on another device, or to keep in host memory).
    pub fn to_host(&self) -> Result<State> {
        match self {
            Snapshot::Host(s) => Ok(s.to_state()),
            Snapshot::Gpu(s) => s.download(),
        }
    }
}

impl From<State> for Snapshot {
    fn from(s: State) -> Snapshot {
        Snapshot::Host(HostSnapshot::new(s))
    }
}
