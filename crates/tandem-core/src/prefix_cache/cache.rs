//! The prefix cache a server shares across its requests: state snapshots found by the prompt
//! they cover (`PrefixTree`), in two tiers with a byte budget each (on the prefill engine's GPU,
//! `DeviceTier`, and in host memory), with the pins of live sessions and the counts `/metrics`
//! reports.
//!
//! A request looks up its prompt, continues the deepest snapshot at or before its match, and
//! asks its prefill to stop for snapshots where `stops` says (where the prompt leaves what
//! earlier requests applied, every `every` tokens, its end); each snapshot comes back and is
//! inserted. Nothing writes into a snapshot: a request continues a copy (on the GPU the copy
//! shares its full K/V blocks), and the request holds the snapshot while it copies, so eviction
//! never takes a state in use.
//!
//! The device tier's snapshots share K/V blocks with each other (a snapshot of a longer prompt
//! holds the blocks of the shorter one it continues): it counts each block once. Each tier's
//! snapshots go least recently used first where it passes its budget, down a tier where there
//! is one (device to host memory to disk); where pins hold more than a budget, the sessions
//! used longest ago let go of theirs. A snapshot leaving the GPU is copied by whoever calls
//! `settle`, with the cache's lock let go meanwhile (prompts still continue it on the GPU):
//! such a copy takes long enough (hundreds of MB for a long 9B conversation) that lookups
//! waiting for it would wait for nothing.
//!
//! A `salt` (the API's `cache_salt`) keeps requests apart: a prompt with a salt matches only
//! snapshots made under the same salt. It is a leading key entry outside the vocabulary.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Context as _;

use super::device_tier::DeviceTier;
use super::disk_tier::{DiskFile, DiskTier, OnDisk};
use super::tree::{NodeId, PrefixTree};
use crate::bridge::format::ForeignState;
use crate::backend::cuda::qwen35::GpuSnapshot;
use crate::state::{HostSnapshot, Snapshot, State, Tier};

/// A snapshot as the cache keeps it: in memory (the GPU's or the host's), or in the files of
/// the disk tier, read back when a prompt hits it.
#[derive(Clone)]
enum Kept {
    Memory(Arc<Snapshot>),
    /// A snapshot the device tier let go, on the GPU until `settle` has copied it to host
    /// memory (counted in no tier meanwhile).
    Leaving(Arc<Snapshot>),
    Disk(Arc<DiskFile>),
}

impl Kept {
    /// The tier whose budget it counts in (None: leaving the device tier).
    fn tier(&self) -> Option<Tier> {
        match self {
            Kept::Memory(s) => Some(s.tier()),
            Kept::Leaving(_) => None,
            Kept::Disk(_) => Some(Tier::Disk),
        }
    }
}

/// A snapshot on its way from the device tier to host memory (`PrefixCache::settle`).
pub struct Leaving {
    key: Vec<u32>,
    snapshot: Arc<Snapshot>,
    /// The deepest host snapshot on its path when it left: the K/V rows the copy may share.
    above: Option<Arc<Snapshot>>,
}

impl Leaving {
    /// The snapshot in host memory (the copy; run it without the cache's lock).
    fn copy(&self) -> anyhow::Result<HostSnapshot> {
        let earlier = self.above.as_deref().and_then(|s| match s {
            Snapshot::Host(h) => Some(h),
            Snapshot::Gpu(_) => None,
        });
        match &*self.snapshot {
            Snapshot::Gpu(g) => g.to_host_snapshot(earlier),
            Snapshot::Host(_) => anyhow::bail!("a host snapshot in the device tier"),
        }
    }
}

/// A snapshot of the disk tier that a lookup reads back (`PrefixCache::lookup_unlocked`).
struct Reading {
    key: Vec<u32>,
    lead: usize,
    prompt_len: usize,
    matched: usize,
    /// The key entries the snapshot covers.
    depth: usize,
    file: Arc<DiskFile>,
    disk: Arc<DiskTier>,
}

impl Reading {
    /// The state in the file, checked (run it without the cache's lock).
    fn read(&self) -> anyhow::Result<State> {
        self.disk.read(&self.file, self.depth - self.lead)
    }
}

/// What a lookup finds at one look.
enum Step {
    Found(Found),
    Read(Reading),
}

/// What a session keeps pinned: one snapshot of each kind, replaced as the session goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pin {
    /// The latest prompt or reply end of the session's conversation.
    Latest,
    /// Typing ahead: the part of the typed message that can no longer change.
    Typed,
    /// Typing ahead: the whole prompt that sending the text typed so far would make.
    Speculative,
}

struct Session {
    pins: HashMap<Pin, NodeId>,
    last_used: u64,
}

/// Counts since the cache was made (the `/metrics` counters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub lookups: u64,
    /// Lookups that found a snapshot to continue.
    pub hits: u64,
    /// Prompt tokens covered by the snapshots continued (not prefilled).
    pub hit_tokens: u64,
    /// Prompt tokens that matched what earlier requests applied (what a cache that kept a
    /// snapshot at every token would have covered).
    pub matched_tokens: u64,
    pub inserted: u64,
    pub evicted: u64,
    /// Sessions whose pins were let go to keep the budget.
    pub sessions_released: u64,
    /// Snapshots written to the disk tier (the host tier let them go).
    pub spilled: u64,
    /// Snapshots of the disk tier refused as they were read back (damaged, another model's).
    pub refused: u64,
    /// Snapshots the device tier let go that moved to host memory or disk.
    pub demoted: u64,
}

/// What a prompt finds.
pub struct Found {
    /// The snapshot to continue (None: start fresh).
    pub state: Option<Arc<Snapshot>>,
    /// The prompt tokens it covers.
    pub reused: usize,
    /// The prompt tokens that match what earlier requests applied (at least `reused`).
    pub matched: usize,
    /// Where the prefill should stop for snapshots, as counts of the prompt's tokens (each
    /// past `reused`, ascending, the prompt's end last).
    pub stops: Vec<usize>,
}

/// Pieces that several snapshots may hold (the device tier's K/V blocks, the host tier's K/V
/// spans), each counted once: how many snapshots hold it, and its bytes.
#[derive(Default)]
struct Shared {
    held: HashMap<u64, (usize, usize)>,
    bytes: usize,
}

impl Shared {
    fn hold(&mut self, piece: u64, bytes: usize) {
        let held = self.held.entry(piece).or_insert((0, bytes));
        if held.0 == 0 {
            self.bytes += bytes;
        }
        held.0 += 1;
    }

    fn let_go(&mut self, piece: u64) {
        match self.held.get_mut(&piece) {
            Some((1, bytes)) => {
                self.bytes -= *bytes;
                self.held.remove(&piece);
            }
            Some((n, _)) => *n -= 1,
            None => debug_assert!(false, "a piece the tier did not count"),
        }
    }
}

/// What the device tier holds: slots, and blocks counted once however many snapshots share
/// them.
#[derive(Default)]
struct DeviceUse {
    slot_bytes: usize,
    blocks: Shared,
    snapshots: usize,
}

impl DeviceUse {
    fn bytes(&self) -> usize {
        self.slot_bytes + self.blocks.bytes
    }

    fn add(&mut self, g: &GpuSnapshot) {
        self.slot_bytes += g.slot_bytes();
        for &b in g.blocks() {
            self.blocks.hold(b, g.block_bytes());
        }
        self.snapshots += 1;
    }

    fn subtract(&mut self, g: &GpuSnapshot) {
        self.slot_bytes -= g.slot_bytes();
        for &b in g.blocks() {
            self.blocks.let_go(b);
        }
        self.snapshots -= 1;
    }
}

/// What the host tier holds: each snapshot's own bytes (and its tokens), and K/V spans
/// counted once however many snapshots share them.
#[derive(Default)]
struct HostUse {
    own_bytes: usize,
    spans: Shared,
    snapshots: usize,
}

impl HostUse {
    fn bytes(&self) -> usize {
        self.own_bytes + self.spans.bytes
    }

    fn add(&mut self, s: &HostSnapshot, tokens: usize) {
        self.own_bytes += s.own_bytes() + 4 * tokens;
        for (span, bytes) in s.spans() {
            self.spans.hold(span as u64, bytes);
        }
        self.snapshots += 1;
    }

    fn subtract(&mut self, s: &HostSnapshot, tokens: usize) {
        self.own_bytes -= s.own_bytes() + 4 * tokens;
        for (span, _) in s.spans() {
            self.spans.let_go(span as u64);
        }
        self.snapshots -= 1;
    }
}

pub struct PrefixCache {
    tree: PrefixTree<Kept>,
    /// The host tier's budget.
    budget: usize,
    host_use: HostUse,
    device: Option<Arc<DeviceTier>>,
    device_use: DeviceUse,
    disk: Option<Arc<DiskTier>>,
    disk_bytes: usize,
    disk_snapshots: usize,
    /// Why the last snapshot refused by the disk tier was refused.
    last_refusal: Option<String>,
    every: usize,
    sessions: HashMap<String, Session>,
    /// Snapshots the device tier let go, to be copied to host memory by `settle`.
    leaving: Vec<Leaving>,
    clock: u64,
    stats: CacheStats,
}

/// The fewest tokens between two snapshots a prefill takes (but for the prompt's end).
pub const MIN_GAP: usize = 8;

/// The key entry of a salt: a hash of it with the top bit set (vocabularies stay far below 2^31).
fn salt_entry(salt: &str) -> u32 {
    // FNV-1a: stable across runs and builds (a std hasher is seeded per process).
    let h = salt.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193));
    h | 0x8000_0000
}

impl PrefixCache {
    /// A cache of `budget` bytes of host memory whose prefills stop for a snapshot every
    /// `every` tokens (0: only at branch points and prompt ends).
    pub fn new(budget: usize, every: usize) -> PrefixCache {
        PrefixCache {
            tree: PrefixTree::new(),
            budget,
            host_use: HostUse::default(),
            device: None,
            device_use: DeviceUse::default(),
            disk: None,
            disk_bytes: 0,
            disk_snapshots: 0,
            last_refusal: None,
            every,
            sessions: HashMap::new(),
            leaving: Vec::new(),
            clock: 0,
            stats: CacheStats::default(),
        }
    }

    /// Keep snapshots taken on the GPU there, within `tier`'s budget.
    pub fn with_device(mut self, tier: Arc<DeviceTier>) -> PrefixCache {
        self.device = Some(tier);
        self
    }

    /// Write the snapshots the host tier lets go to `tier`, and take in those its directory
    /// holds already (from an earlier server).
    pub fn with_disk(mut self, tier: DiskTier, found: OnDisk) -> PrefixCache {
        for (key, file) in found {
            let (bytes, kept) = (file.bytes, Kept::Disk(Arc::new(file)));
            self.add(&kept, 0);
            if let Some((_, Some(old))) = self.tree.insert(&key, kept, bytes) {
                self.subtract(&old, 0);
            }
        }
        self.disk = Some(Arc::new(tier));
        self.shrink_disk();
        self
    }

    /// Why the disk tier last refused a snapshot it read back (None: it never did).
    pub fn last_refusal(&self) -> Option<&str> {
        self.last_refusal.as_deref()
    }

    fn key(salt: Option<&str>, tokens: &[u32]) -> (Vec<u32>, usize) {
        match salt {
            Some(s) => (std::iter::once(salt_entry(s)).chain(tokens.iter().copied()).collect(), 1),
            None => (tokens.to_vec(), 0),
        }
    }

    /// The host tier's budget.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// The device tier's budget (0: none).
    pub fn device_budget(&self) -> usize {
        self.device.as_ref().map_or(0, |t| t.budget())
    }

    /// Bytes the snapshots of `tier` hold (the device's shared blocks counted once).
    pub fn bytes(&self, tier: Tier) -> usize {
        match tier {
            Tier::Host => self.host_use.bytes(),
            Tier::Device => self.device_use.bytes(),
            Tier::Disk => self.disk_bytes,
        }
    }

    pub fn snapshots(&self, tier: Tier) -> usize {
        match tier {
            Tier::Host => self.host_use.snapshots,
            Tier::Device => self.device_use.snapshots,
            Tier::Disk => self.disk_snapshots,
        }
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Sessions holding pins.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// The deepest snapshot `prompt` can continue, and where its prefill should stop. A
    /// snapshot of the disk tier is read back here (and kept in host memory where that tier
    /// has room); one that does not read back is refused, taken out, and the next deepest
    /// looked for.
    pub fn lookup(&mut self, salt: Option<&str>, prompt: &[u32]) -> Found {
        let (key, lead) = Self::key(salt, prompt);
        loop {
            match self.step(&key, lead, prompt.len()) {
                Step::Found(found) => return found,
                Step::Read(r) => {
                    let read = r.read();
                    if let Some(found) = self.read_done(r, read) {
                        return found;
                    }
                }
            }
        }
    }

    /// `lookup` on a cache that threads share: a snapshot of the disk tier is read back with
    /// the lock let go (a long state file takes a while to read and check, and other lookups
    /// need not wait for it).
    pub fn lookup_unlocked(cache: &std::sync::Mutex<PrefixCache>, salt: Option<&str>, prompt: &[u32]) -> Found {
        let lock = || cache.lock().unwrap_or_else(|e| e.into_inner());
        let (key, lead) = Self::key(salt, prompt);
        loop {
            let step = lock().step(&key, lead, prompt.len());
            match step {
                Step::Found(found) => return found,
                Step::Read(r) => {
                    let read = r.read();
                    if let Some(found) = lock().read_done(r, read) {
                        return found;
                    }
                }
            }
        }
    }

    /// What a lookup of `key` finds now: a snapshot in memory, or one of the disk tier to read.
    fn step(&mut self, key: &[u32], lead: usize, prompt_len: usize) -> Step {
        let m = self.tree.lookup(key);
        match (m.snapshot, &self.disk) {
            (Some((_, depth, Kept::Memory(state) | Kept::Leaving(state))), _) => Step::Found(self.found(key, lead, prompt_len, m.matched, Some(state), depth - lead)),
            (Some((_, depth, Kept::Disk(file))), Some(disk)) => Step::Read(Reading { key: key.to_vec(), lead, prompt_len, matched: m.matched, depth, file, disk: disk.clone() }),
            _ => Step::Found(self.found(key, lead, prompt_len, m.matched, None, 0)),
        }
    }

    /// A snapshot of the disk tier read back (`read`): kept in host memory where that tier has
    /// room and its node still holds that file, and found; or refused (its files deleted
    /// where they are its node's and this model's, the node emptied, the reason kept for
    /// `last_refusal`): None, to look again.
    fn read_done(&mut self, r: Reading, read: anyhow::Result<State>) -> Option<Found> {
        let tokens = r.depth - r.lead;
        let path = &r.key[..r.depth];
        let id = self.tree.find(path).filter(|&id| matches!(self.tree.get(id), Some(Kept::Disk(f)) if Arc::ptr_eq(f, &r.file)));
        match read {
            Ok(state) => {
                let state = Arc::new(Snapshot::Host(self.host_snapshot(path, state)));
                let size = Self::size(&state, tokens);
                if let Some(id) = id.filter(|_| size <= self.budget) {
                    self.put(id, Kept::Memory(state.clone()), size, tokens);
                    self.tree.pin(id);
                    self.evict(None);
                    self.tree.unpin(id);
                }
                Some(self.found(&r.key, r.lead, r.prompt_len, r.matched, Some(state), tokens))
            }
            Err(e) => {
                let why = format!("{e:#}");
                // Another model's (or format version's) file stays: the directory may be shared
                // by two servers. A damaged one of this model's is of no use to anyone.
                let foreign = e.downcast_ref::<ForeignState>().is_some();
                let delete = !foreign && id.is_some();
                eprintln!("prefix cache: a snapshot on disk is refused and left out{}: {why}", if delete { " (its files deleted)" } else { "" });
                self.last_refusal = Some(why);
                self.stats.refused += 1;
                if let Some(id) = id {
                    if delete {
                        r.disk.remove(&r.file);
                    }
                    if let Some(old) = self.tree.remove(id) {
                        self.subtract(&old, tokens);
                    }
                }
                None
            }
        }
    }

    /// What a prompt of `prompt_len` tokens (`key` past the salt's `lead`) finds: `state`
    /// covering `reused` of its tokens, `matched` of the key matching the tree, and where its
    /// prefill should stop.
    fn found(&self, key: &[u32], lead: usize, prompt_len: usize, matched: usize, state: Option<Arc<Snapshot>>, reused: usize) -> Found {
        // A snapshot a few tokens past another (or past the start) would save a later prompt
        // only those few tokens, for a whole state's memory: such stops are left out (the
        // prompt's end is always kept). So is a periodic stop less than half a period before
        // the end: the end's snapshot serves the prompts that share that far, and the stop
        // would cut the prefill of every prompt that runs a little past a multiple of the
        // period (on an H200, 2,000-token prompts stopping at 2,048 took a cached question's
        // TTFT from 7 to 11 ms).
        let matched = matched.saturating_sub(lead);
        let mut stops: Vec<usize> = Vec::new();
        for p in self.tree.stops(key, reused + lead, self.every).into_iter().map(|p| p - lead) {
            let last = stops.last().copied().unwrap_or(reused);
            let periodic = p != matched && p != prompt_len;
            if p == prompt_len || (p >= last + MIN_GAP && !(periodic && prompt_len - p < self.every / 2)) {
                stops.push(p);
            }
        }
        Found { state, reused, matched, stops }
    }

    /// Count a request's lookup in the stats (the cache's own lookups, to make a snapshot,
    /// are not counted).
    pub fn count(&mut self, found: &Found) {
        let s = &mut self.stats;
        s.lookups += 1;
        s.hits += u64::from(found.state.is_some());
        s.hit_tokens += found.reused as u64;
        s.matched_tokens += found.matched as u64;
    }

    /// `state`, to be kept in host memory as the snapshot of `key`, sharing the K/V spans of
    /// the deepest host snapshot above it on its path where it can (`HostSnapshot::continuing`).
    fn host_snapshot(&self, key: &[u32], state: State) -> HostSnapshot {
        match self.host_above(key).map(|s| &**s) {
            Some(Snapshot::Host(earlier)) => HostSnapshot::continuing(state, earlier),
            _ => HostSnapshot::new(state),
        }
    }

    /// The deepest snapshot in host memory above `key` on its path.
    fn host_above(&self, key: &[u32]) -> Option<&Arc<Snapshot>> {
        self.tree.deepest_above(key, |k| match k {
            Kept::Memory(s) if s.tier() == Tier::Host => Some(s),
            _ => None,
        })
    }

    /// Put `kept` (charged `bytes` in the tree) at node `id` in place of what it held there
    /// (a snapshot of `tokens` tokens), each counted in its tier.
    fn put(&mut self, id: NodeId, kept: Kept, bytes: usize, tokens: usize) {
        self.add(&kept, tokens);
        if let Some(old) = self.tree.replace(id, kept, bytes) {
            self.subtract(&old, tokens);
        }
    }

    /// `state` written to the disk tier as the snapshot of `key` (counted as spilled).
    fn spill(&mut self, key: &[u32], state: &State) -> anyhow::Result<(Kept, usize)> {
        let disk = self.disk.as_ref().filter(|d| d.budget() > 0).context("host memory has no room for it, and there is no disk tier")?;
        let file = disk.write(key, state)?;
        self.stats.spilled += 1;
        let bytes = file.bytes;
        Ok((Kept::Disk(Arc::new(file)), bytes))
    }

    /// Bytes a snapshot of `tokens` is charged in the tree (the device tier counts its own).
    fn size(snapshot: &Snapshot, tokens: usize) -> usize {
        snapshot.bytes() + 4 * tokens
    }

    fn add(&mut self, kept: &Kept, tokens: usize) {
        match kept {
            Kept::Leaving(_) => {}
            Kept::Disk(f) => {
                self.disk_bytes += f.bytes;
                self.disk_snapshots += 1;
            }
            Kept::Memory(s) => match &**s {
                Snapshot::Host(h) => self.host_use.add(h, tokens),
                Snapshot::Gpu(g) => self.device_use.add(g),
            },
        }
    }

    fn subtract(&mut self, kept: &Kept, tokens: usize) {
        match kept {
            Kept::Leaving(_) => {}
            Kept::Disk(f) => {
                self.disk_bytes -= f.bytes;
                self.disk_snapshots -= 1;
            }
            Kept::Memory(s) => match &**s {
                Snapshot::Host(h) => self.host_use.subtract(h, tokens),
                Snapshot::Gpu(g) => self.device_use.subtract(g),
            },
        }
    }

    /// Keep `snapshot`, the state after exactly `tokens` (its position is `tokens.len()`),
    /// pinned for a session when `pin` says so; one larger than its tier's whole budget is not
    /// kept (a host snapshot goes to the disk tier instead, where there is one), nor one that
    /// no session pins where sessions' pins hold its tier's budget. Evicts down to the budgets
    /// (see `evict`). Returns whether it was kept.
    pub fn insert(&mut self, salt: Option<&str>, tokens: &[u32], snapshot: Snapshot, pin: Option<(&str, Pin)>) -> bool {
        debug_assert_eq!(snapshot.position(), tokens.len());
        let too_big = match &snapshot {
            Snapshot::Host(_) => Self::size(&snapshot, tokens.len()) > self.budget,
            Snapshot::Gpu(g) => g.bytes() > self.device_budget(),
        };
        if tokens.is_empty() {
            return false;
        }
        let (key, lead) = Self::key(salt, tokens);
        let (kept, size) = match (snapshot, too_big, &self.disk) {
            (Snapshot::Host(h), false, _) => {
                let h = self.host_snapshot(&key, h.into_state());
                let size = h.bytes() + 4 * tokens.len();
                (Kept::Memory(Arc::new(Snapshot::Host(h))), size)
            }
            (snapshot, false, _) => {
                let size = Self::size(&snapshot, tokens.len());
                (Kept::Memory(Arc::new(snapshot)), size)
            }
            // Too big for host memory: straight to disk, where there is a disk tier.
            (Snapshot::Host(state), true, Some(disk)) if disk.budget() > 0 => match self.spill(&key, &state.to_state()) {
                Ok(spilled) => spilled,
                Err(e) => {
                    eprintln!("prefix cache: a snapshot could not be written to disk, and is not kept: {e:#}");
                    return false;
                }
            },
            _ => return false,
        };
        self.add(&kept, tokens.len());
        let Some((id, old)) = self.tree.insert(&key, kept, size) else { return false };
        if let Some(old) = old {
            self.subtract(&old, key.len() - lead);
        }
        self.stats.inserted += 1;
        // The new snapshot is kept through the eviction (it is the most recently used anyway),
        // but where sessions hold the rest of its tier and it is no session's.
        self.tree.pin(id);
        let newcomer = match pin {
            Some((session, kind)) => {
                self.pin(session, kind, id);
                None
            }
            None => Some(id),
        };
        let kept = self.evict(newcomer);
        if kept {
            self.tree.unpin(id);
        }
        kept
    }

    /// Pin the snapshot of exactly `tokens`, where there is one, as `session`'s of kind `pin`.
    pub fn pin_existing(&mut self, salt: Option<&str>, tokens: &[u32], session: &str, pin: Pin) -> bool {
        let (key, _) = Self::key(salt, tokens);
        match self.tree.lookup(&key).snapshot {
            Some((id, depth, _)) if depth == key.len() && !tokens.is_empty() => {
                self.pin(session, pin, id);
                true
            }
            _ => false,
        }
    }

    /// Drop the snapshot of exactly `tokens`, unless something pins it (a session that knows
    /// it no longer needs a state of its own). Returns whether it went.
    pub fn forget(&mut self, salt: Option<&str>, tokens: &[u32]) -> bool {
        let (key, _) = Self::key(salt, tokens);
        match self.tree.lookup(&key).snapshot {
            Some((id, depth, _)) if depth == key.len() && !self.tree.is_pinned(id) => {
                self.take_out(id);
                true
            }
            _ => false,
        }
    }

    /// Tokens of the snapshot at `id` (what a snapshot in memory says; a file's count is not
    /// charged by its tokens).
    fn tokens_at(&self, id: NodeId) -> usize {
        match self.tree.get(id) {
            Some(Kept::Memory(s) | Kept::Leaving(s)) => s.position(),
            _ => 0,
        }
    }

    /// Evict the snapshot of `id` (`take_out`), counted as an eviction.
    fn drop_snapshot(&mut self, id: NodeId) {
        if self.take_out(id) {
            self.stats.evicted += 1;
        }
    }

    /// Take the snapshot out of `id`, its files deleted for one on disk (not counted as an
    /// eviction). Returns whether there was one.
    fn take_out(&mut self, id: NodeId) -> bool {
        let tokens = self.tokens_at(id);
        let Some(kept) = self.tree.remove(id) else { return false };
        if let (Kept::Disk(f), Some(disk)) = (&kept, &self.disk) {
            disk.remove(f);
        }
        self.subtract(&kept, tokens);
        true
    }

    /// Bring the device tier within its budget: the snapshots used longest ago, but pinned
    /// ones, leave for host memory where it or the disk tier has a budget (`settle` copies
    /// them), or go.
    fn shrink_device(&mut self) {
        let budget = self.device_budget();
        let below = self.budget > 0 || self.disk.as_ref().is_some_and(|d| d.budget() > 0);
        while self.device_use.bytes() > budget {
            let Some(id) = self.tree.oldest(|s, pinned| s.tier() == Some(Tier::Device) && !pinned) else { break };
            let snapshot = match self.tree.get(id) {
                Some(Kept::Memory(s)) if below => s.clone(),
                _ => {
                    self.drop_snapshot(id);
                    continue;
                }
            };
            let key = self.tree.key_of(id);
            let above = self.host_above(&key).cloned();
            self.put(id, Kept::Leaving(snapshot.clone()), 0, snapshot.position());
            self.leaving.push(Leaving { key, snapshot, above });
        }
    }

    /// Whether snapshots wait to leave the GPU (`settle`).
    pub fn has_leaving(&self) -> bool {
        !self.leaving.is_empty()
    }

    /// Bytes of GPU memory the snapshots waiting to leave it hold (their shared blocks counted
    /// whole): room past the device tier's budget until they are copied.
    pub fn leaving_bytes(&self) -> usize {
        self.leaving.iter().map(|l| l.snapshot.bytes()).sum()
    }

    /// Copy the snapshots leaving the GPU to host memory, the lock of `cache` let go while each
    /// copies (lookups go on, and continue them on the GPU meanwhile); `copied(started,
    /// tokens)` after each copy.
    pub fn settle(cache: &std::sync::Mutex<PrefixCache>, mut copied: impl FnMut(std::time::Instant, usize)) {
        let lock = || cache.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let leaving = std::mem::take(&mut lock().leaving);
            if leaving.is_empty() {
                return;
            }
            for l in leaving {
                let started = std::time::Instant::now();
                let copy = l.copy();
                copied(started, l.snapshot.position());
                lock().land(l, copy);
            }
        }
    }

    /// `settle` for a cache its caller holds alone.
    pub fn settle_here(&mut self) {
        while let Some(l) = self.leaving.pop() {
            let copied = l.copy();
            self.land(l, copied);
        }
    }

    /// Put the host copy of a snapshot that left the GPU in its place (on disk where host memory
    /// has no room for it), unless the snapshot went meanwhile.
    fn land(&mut self, leaving: Leaving, copied: anyhow::Result<HostSnapshot>) {
        let Some(id) = self.tree.find(&leaving.key) else { return };
        if !matches!(self.tree.get(id), Some(Kept::Leaving(s)) if Arc::ptr_eq(s, &leaving.snapshot)) {
            return;
        }
        let tokens = leaving.snapshot.position();
        let moved = copied.and_then(|h| {
            let size = h.bytes() + 4 * tokens;
            if size <= self.budget {
                return Ok((Kept::Memory(Arc::new(Snapshot::Host(h))), size));
            }
            self.spill(&leaving.key, &h.to_state())
        });
        match moved {
            Ok((kept, bytes)) => {
                self.put(id, kept, bytes, tokens);
                self.stats.demoted += 1;
                self.evict(None);
            }
            Err(e) => {
                eprintln!("prefix cache: a snapshot leaving the GPU could not be kept elsewhere, and goes: {e:#}");
                self.drop_snapshot(id);
            }
        }
    }

    /// Bring the host tier within its budget: its snapshots used longest ago go (to the disk
    /// tier where there is one), but pinned ones.
    fn shrink_host(&mut self) {
        while self.host_use.bytes() > self.budget {
            let Some(id) = self.tree.oldest(|s, pinned| s.tier() == Some(Tier::Host) && !pinned) else { break };
            let to_disk = self.disk.as_ref().is_some_and(|d| d.budget() > 0);
            let state = match self.tree.get(id) {
                Some(Kept::Memory(s)) if to_disk => match &**s {
                    Snapshot::Host(h) => Some(h.to_state()),
                    Snapshot::Gpu(_) => None,
                },
                _ => None,
            };
            let spilled = state.map(|state| {
                let key = self.tree.key_of(id);
                self.spill(&key, &state)
            });
            match spilled {
                Some(Ok((kept, bytes))) => {
                    let tokens = self.tokens_at(id);
                    self.put(id, kept, bytes, tokens);
                }
                Some(Err(e)) => {
                    eprintln!("prefix cache: a snapshot could not be written to disk, and goes: {e:#}");
                    self.drop_snapshot(id);
                }
                None => self.drop_snapshot(id),
            }
        }
        self.shrink_disk();
    }

    /// Bring the disk tier within its budget: its snapshots used longest ago are deleted, but
    /// pinned ones.
    fn shrink_disk(&mut self) {
        let budget = self.disk.as_ref().map_or(0, |d| d.budget());
        while self.disk_bytes > budget {
            let Some(id) = self.tree.oldest(|s, pinned| s.tier() == Some(Tier::Disk) && !pinned) else { break };
            self.drop_snapshot(id);
        }
    }

    /// Bring every tier within its budget; where pins hold more than a budget, the sessions
    /// used longest ago let go of theirs. A `newcomer` (a snapshot just inserted, held through
    /// this, that no session holds) goes first instead: a snapshot no one holds never pushes out
    /// the states sessions hold (under a tight budget, a long prefill's snapshots would otherwise
    /// release every session's state, each of whose next turns would prefill it all again).
    /// Returns whether the newcomer stays.
    fn evict(&mut self, mut newcomer: Option<NodeId>) -> bool {
        let mut stays = true;
        loop {
            self.shrink_device();
            self.shrink_host();
            if let Some(tier) = &self.device {
                tier.rebalance(self.device_use.slot_bytes);
            }
            let disk_budget = self.disk.as_ref().map_or(0, |d| d.budget());
            let over = |c: &PrefixCache, tier: Tier| match tier {
                Tier::Device => c.device_use.bytes() > c.device_budget(),
                Tier::Host => c.host_use.bytes() > c.budget,
                Tier::Disk => c.disk_bytes > disk_budget,
            };
            if [Tier::Device, Tier::Host, Tier::Disk].into_iter().all(|t| !over(self, t)) {
                return stays;
            }
            if let Some(id) = newcomer.take() {
                if self.tree.get(id).and_then(Kept::tier).is_some_and(|t| over(self, t)) {
                    self.tree.unpin(id);
                    self.drop_snapshot(id);
                    stays = false;
                    continue;
                }
            }
            let Some(oldest) = self.sessions.iter().min_by_key(|(_, s)| s.last_used).map(|(name, _)| name.clone()) else { return stays };
            self.release(&oldest);
            self.stats.sessions_released += 1;
        }
    }

    /// Pin `node` as `session`'s snapshot of kind `pin`, in place of the one it had: it is not
    /// evicted while the session holds it.
    fn pin(&mut self, session: &str, pin: Pin, node: NodeId) {
        self.clock += 1;
        let s = self.sessions.entry(session.to_string()).or_insert(Session { pins: HashMap::new(), last_used: 0 });
        s.last_used = self.clock;
        self.tree.pin(node);
        if let Some(old) = s.pins.insert(pin, node) {
            self.tree.unpin(old);
        }
    }

    /// Let go of `session`'s pins (its snapshots stay, evictable).
    pub fn release(&mut self, session: &str) {
        if let Some(s) = self.sessions.remove(session) {
            for node in s.pins.into_values() {
                self.tree.unpin(node);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Qwen35Config;
    use crate::state::State;

    fn state(cfg: &Qwen35Config, tokens: &[u32]) -> State {
        let mut s = State::new(cfg);
        s.position = tokens.len();
        s.last_logits = tokens.iter().map(|&t| t as f32).collect();
        s
    }

    #[test]
    fn a_prompt_continues_the_deepest_snapshot_it_passes_and_salts_keep_requests_apart() {
        let cfg = Qwen35Config::preset("tiny").unwrap();
        let mut c = PrefixCache::new(usize::MAX, 16);
        let a: Vec<u32> = (0..40).collect();
        // A periodic stop less than half a period before the end is left out.
        assert_eq!(c.lookup(None, &a[..37]).stops, vec![16, 37]);
        let found = c.lookup(None, &a);
        assert!(found.state.is_none());
        assert_eq!(found.stops, vec![16, 32, 40]);
        for &stop in &found.stops {
            c.insert(None, &a[..stop], state(&cfg, &a[..stop]).into(), None);
        }
        let mut b = a[..26].to_vec();
        b.extend([90, 91, 92]);
        let found = c.lookup(None, &b);
        assert_eq!(found.reused, 16);
        assert_eq!(found.state.as_ref().unwrap().to_host().unwrap().last_logits[15], 15.0);
        // The branch point, the end (periodic 32 lies past it).
        assert_eq!(found.stops, vec![26, 29]);
        assert_eq!(found.matched, 26);
        c.count(&found);
        // A branch point a few tokens past the snapshot is not worth a state: only the end.
        let mut close = a[..20].to_vec();
        close.extend(50..55);
        assert_eq!(c.lookup(None, &close).stops, vec![25]);
        assert!(c.lookup(Some("other"), &b).state.is_none(), "a salted prompt sees no unsalted snapshot");
        c.insert(Some("other"), &b, state(&cfg, &b).into(), None);
        let salted = c.lookup(Some("other"), &b);
        assert_eq!((salted.reused, salted.matched), (29, 29));
        c.count(&salted);
        assert_eq!(c.lookup(None, &b).reused, 16);
        let s = c.stats();
        assert_eq!((s.lookups, s.hits, s.hit_tokens, s.matched_tokens), (2, 2, 16 + 29, 26 + 29));
    }

    /// A state after `tokens` whose attention K/V rows are made from the tokens before them
    /// (as a model's are): states along one path agree on their common rows. `skew` changes
    /// every row (a state computed differently).
    fn state_with_kv(cfg: &Qwen35Config, tokens: &[u32], skew: f32) -> State {
        let mut s = state(cfg, tokens);
        let row = cfg.num_key_value_heads * cfg.head_dim;
        for l in &mut s.layers {
            if let crate::state::LayerState::Full { k, v } = l {
                *k = (0..tokens.len() * row).map(|i| tokens[i / row] as f32 + (i % row) as f32 * 1e-3 + skew).collect();
                *v = k.iter().map(|x| -x).collect();
            }
        }
        s
    }

    #[test]
    fn host_snapshots_along_a_path_share_their_k_v_and_give_it_back_whole() {
        let cfg = Qwen35Config::preset("tiny").unwrap();
        let mut c = PrefixCache::new(usize::MAX, 0);
        let a: Vec<u32> = (0..64).collect();
        let (s16, s40, s64) = (state_with_kv(&cfg, &a[..16], 0.0), state_with_kv(&cfg, &a[..40], 0.0), state_with_kv(&cfg, &a, 0.0));
        let alone = |s: &State| s.bytes() + 4 * s.position;
        for s in [&s16, &s40, &s64] {
            c.insert(None, &a[..s.position], s.clone().into(), None);
        }
        // Each K/V row once: the longest state's, and the others' own parts.
        let shared = alone(&s64) + (alone(&s16) - s16.kv_bytes()) + (alone(&s40) - s40.kv_bytes());
        assert_eq!(c.bytes(Tier::Host), shared);
        assert!(shared < alone(&s16) + alone(&s40) + alone(&s64));
        let whole = |c: &mut PrefixCache, n: usize| c.lookup(None, &a[..n]).state.unwrap().to_host().unwrap();
        assert!(whole(&mut c, 40) == s40 && whole(&mut c, 64) == s64 && whole(&mut c, 16) == s16);
        // A state of another path's tokens, or whose rows differ, shares nothing.
        let mut b = a[..30].to_vec();
        b.push(1000);
        let skewed = state_with_kv(&cfg, &b, 0.5);
        c.insert(None, &b, skewed.clone().into(), None);
        assert_eq!(c.bytes(Tier::Host), shared + alone(&skewed));
        assert!(c.lookup(None, &b).state.unwrap().to_host().unwrap() == skewed);
        // The shorter snapshots evicted: the longer one keeps the rows it shares, whole.
        let mut small = PrefixCache::new(alone(&s64) + alone(&skewed), 0);
        for s in [&s16, &s40, &s64] {
            small.insert(None, &a[..s.position], s.clone().into(), None);
        }
        small.insert(None, &b, skewed.clone().into(), None);
        assert!(small.bytes(Tier::Host) <= small.budget());
        assert!(whole(&mut small, 64) == s64);
        assert_eq!(small.lookup(None, &a[..40]).reused, 0, "the shorter ones went");
        assert_eq!(small.bytes(Tier::Host), alone(&s64) + alone(&skewed));
    }

    #[test]
    fn pins_outlast_eviction_until_the_budget_needs_their_bytes() {
        let cfg = Qwen35Config::preset("tiny").unwrap();
        let t = |n: u32| vec![n; 3];
        let size = state(&cfg, &t(1)).bytes() + 12;
        let mut c = PrefixCache::new(3 * size, 0);
        assert!(c.insert(None, &t(1), state(&cfg, &t(1)).into(), Some(("s", Pin::Latest))));
        for n in 2..6 {
            c.insert(None, &t(n), state(&cfg, &t(n)).into(), None);
        }
        assert_eq!(c.snapshots(Tier::Host), 3);
        assert_eq!(c.lookup(None, &t(1)).reused, 3, "the session's snapshot is pinned");
        assert_eq!(c.lookup(None, &t(2)).reused, 0, "the oldest unpinned went");
        // Pinned more than the budget holds: the session used longest ago lets go.
        for (i, n) in (6..9).enumerate() {
            c.insert(None, &t(n), state(&cfg, &t(n)).into(), Some((&format!("p{i}"), Pin::Latest)));
        }
        assert!(c.bytes(Tier::Host) <= c.budget());
        assert_eq!(c.lookup(None, &t(1)).reused, 0, "session s was used longest ago");
        assert_eq!(c.stats().sessions_released, 1);
        // Pins hold the budget: a snapshot no session holds is not kept, and releases none.
        assert!(!c.insert(None, &t(9), state(&cfg, &t(9)).into(), None));
        assert_eq!(c.lookup(None, &t(9)).reused, 0);
        assert_eq!(c.stats().sessions_released, 1);
        // Replacing a pin lets go of the old one, which goes where the budget needs its bytes.
        assert!(c.insert(None, &t(9), state(&cfg, &t(9)).into(), Some(("p2", Pin::Latest))));
        assert_eq!(c.lookup(None, &t(8)).reused, 0, "p2's old snapshot, unpinned, went");
        assert_eq!(c.lookup(None, &t(6)).reused, 3);
        assert!(c.pin_existing(None, &t(9), "p2", Pin::Latest));
        assert!(!c.pin_existing(None, &[9, 9], "p2", Pin::Typed), "no snapshot of exactly these tokens");
        // A session let go: its snapshot stays, evictable, and makes room for one no session holds.
        c.release("p0");
        assert!(c.insert(None, &t(10), state(&cfg, &t(10)).into(), None));
        assert_eq!(c.lookup(None, &t(6)).reused, 0, "unpinned, and evicted");
        assert!(c.bytes(Tier::Host) <= c.budget());
    }
}
