//! The prefix cache a server shares across its requests: state snapshots in host memory under a
//! byte budget, found by the prompt they cover (`PrefixTree`), with the pins of live sessions
//! and the counts `/metrics` reports.
//!
//! A request looks up its prompt, continues the deepest snapshot at or before its match, and
//! asks its prefill to stop for snapshots where `stops` says (where the prompt leaves what
//! earlier requests applied, every `every` tokens, its end); each snapshot comes back and is
//! inserted. Snapshots are whole host states (the K/V of their attention layers included), so
//! a state in use is a copy and eviction never touches it.
//!
//! A `salt` (the API's `cache_salt`) keeps requests apart: a prompt with a salt matches only
//! snapshots made under the same salt. It is a leading key entry outside the vocabulary.

use std::collections::HashMap;
use std::sync::Arc;

use super::tree::{NodeId, PrefixTree};
use crate::state::State;

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
}

/// What a prompt finds.
pub struct Found {
    /// The snapshot to continue (None: start fresh).
    pub state: Option<Arc<State>>,
    /// The prompt tokens it covers.
    pub reused: usize,
    /// The prompt tokens that match what earlier requests applied (at least `reused`).
    pub matched: usize,
    /// Where the prefill should stop for snapshots, as counts of the prompt's tokens (each
    /// past `reused`, ascending, the prompt's end last).
    pub stops: Vec<usize>,
}

pub struct PrefixCache {
    tree: PrefixTree<Arc<State>>,
    budget: usize,
    every: usize,
    sessions: HashMap<String, Session>,
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
    /// A cache of `budget` bytes whose prefills stop for a snapshot every `every` tokens (0:
    /// only at branch points and prompt ends).
    pub fn new(budget: usize, every: usize) -> PrefixCache {
        PrefixCache { tree: PrefixTree::new(), budget, every, sessions: HashMap::new(), clock: 0, stats: CacheStats::default() }
    }

    fn key(salt: Option<&str>, tokens: &[u32]) -> (Vec<u32>, usize) {
        match salt {
            Some(s) => (std::iter::once(salt_entry(s)).chain(tokens.iter().copied()).collect(), 1),
            None => (tokens.to_vec(), 0),
        }
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    pub fn bytes(&self) -> usize {
        self.tree.bytes()
    }

    pub fn snapshots(&self) -> usize {
        self.tree.snapshots()
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Sessions holding pins.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// The deepest snapshot `prompt` can continue, and where its prefill should stop.
    pub fn lookup(&mut self, salt: Option<&str>, prompt: &[u32]) -> Found {
        let (key, lead) = Self::key(salt, prompt);
        let m = self.tree.lookup(&key);
        let (state, reused) = match m.snapshot {
            Some((_, depth, state)) => (Some(state), depth - lead),
            None => (None, 0),
        };
        // A snapshot a few tokens past another (or past the start) would save a later prompt
        // only those few tokens, for a whole state's memory: such stops are left out (the
        // prompt's end is always kept).
        let mut stops: Vec<usize> = Vec::new();
        for p in self.tree.stops(&key, reused + lead, self.every).into_iter().map(|p| p - lead) {
            let last = stops.last().copied().unwrap_or(reused);
            if p == prompt.len() || p >= last + MIN_GAP {
                stops.push(p);
            }
        }
        Found { state, reused, matched: m.matched.saturating_sub(lead), stops }
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

    /// Keep `state`, the state after exactly `tokens` (`state.position == tokens.len()`), pinned
    /// for a session when `pin` says so; a state larger than the whole budget is not kept.
    /// Evicts down to the budget, least recently used first; where pins hold too much, the
    /// sessions used longest ago let go of theirs. Returns whether it was kept.
    pub fn insert(&mut self, salt: Option<&str>, tokens: &[u32], state: State, pin: Option<(&str, Pin)>) -> bool {
        debug_assert_eq!(state.position, tokens.len());
        let bytes = state.bytes() + 4 * tokens.len();
        if bytes > self.budget || tokens.is_empty() {
            return false;
        }
        let (key, _) = Self::key(salt, tokens);
        let Some(id) = self.tree.insert(&key, Arc::new(state), bytes) else { return false };
        self.stats.inserted += 1;
        // The new snapshot is kept through the eviction (it is the most recently used anyway).
        self.tree.pin(id);
        if let Some((session, kind)) = pin {
            self.pin(session, kind, id);
        }
        self.evict();
        self.tree.unpin(id);
        true
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

    fn evict(&mut self) {
        loop {
            self.stats.evicted += self.tree.evict_to(self.budget) as u64;
            if self.tree.bytes() <= self.budget {
                return;
            }
            let Some(oldest) = self.sessions.iter().min_by_key(|(_, s)| s.last_used).map(|(name, _)| name.clone()) else { return };
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
        let found = c.lookup(None, &a);
        assert!(found.state.is_none());
        assert_eq!(found.stops, vec![16, 32, 40]);
        for &stop in &found.stops {
            c.insert(None, &a[..stop], state(&cfg, &a[..stop]), None);
        }
        let mut b = a[..26].to_vec();
        b.extend([90, 91, 92]);
        let found = c.lookup(None, &b);
        assert_eq!(found.reused, 16);
        assert_eq!(found.state.as_ref().unwrap().last_logits[15], 15.0);
        // The branch point, the end (periodic 32 lies past it).
        assert_eq!(found.stops, vec![26, 29]);
        assert_eq!(found.matched, 26);
        c.count(&found);
        // A branch point a few tokens past the snapshot is not worth a state: only the end.
        let mut close = a[..20].to_vec();
        close.extend(50..55);
        assert_eq!(c.lookup(None, &close).stops, vec![25]);
        assert!(c.lookup(Some("other"), &b).state.is_none(), "a salted prompt sees no unsalted snapshot");
        c.insert(Some("other"), &b, state(&cfg, &b), None);
        let salted = c.lookup(Some("other"), &b);
        assert_eq!((salted.reused, salted.matched), (29, 29));
        c.count(&salted);
        assert_eq!(c.lookup(None, &b).reused, 16);
        let s = c.stats();
        assert_eq!((s.lookups, s.hits, s.hit_tokens, s.matched_tokens), (2, 2, 16 + 29, 26 + 29));
    }

    #[test]
    fn pins_outlast_eviction_until_the_budget_needs_their_bytes() {
        let cfg = Qwen35Config::preset("tiny").unwrap();
        let t = |n: u32| vec![n; 3];
        let size = state(&cfg, &t(1)).bytes() + 12;
        let mut c = PrefixCache::new(3 * size, 0);
        assert!(c.insert(None, &t(1), state(&cfg, &t(1)), Some(("s", Pin::Latest))));
        for n in 2..6 {
            c.insert(None, &t(n), state(&cfg, &t(n)), None);
        }
        assert_eq!(c.snapshots(), 3);
        assert_eq!(c.lookup(None, &t(1)).reused, 3, "the session's snapshot is pinned");
        assert_eq!(c.lookup(None, &t(2)).reused, 0, "the oldest unpinned went");
        // Pinned more than the budget holds: the session used longest ago lets go.
        for (i, n) in (6..9).enumerate() {
            c.insert(None, &t(n), state(&cfg, &t(n)), Some((&format!("p{i}"), Pin::Latest)));
        }
        assert!(c.bytes() <= c.budget());
        assert_eq!(c.lookup(None, &t(1)).reused, 0, "session s was used longest ago");
        assert_eq!(c.stats().sessions_released, 1);
        // Replacing a pin lets go of the old one.
        c.insert(None, &t(9), state(&cfg, &t(9)), None);
        assert_eq!(c.lookup(None, &t(8)).reused, 3);
        assert!(c.pin_existing(None, &t(9), "p2", Pin::Latest));
        assert!(!c.pin_existing(None, &[9, 9], "p2", Pin::Typed), "no snapshot of exactly these tokens");
        c.insert(None, &t(10), state(&cfg, &t(10)), None);
        c.insert(None, &t(11), state(&cfg, &t(11)), None);
        assert_eq!(c.lookup(None, &t(8)).reused, 0, "unpinned, and evicted");
        assert!(c.bytes() <= c.budget());
    }
}
