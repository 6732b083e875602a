//! Conversation states kept between requests, found by token prefix.
//!
//! A Qwen3.5 state cannot be cut back to an earlier position (the DeltaNet layers' recurrent
//! state has folded every token in), so a cached state is reusable only by a prompt that starts
//! with exactly the tokens it covers. The server stores states where the next request of a
//! conversation is likely to continue: at the last turn boundary of each prompt (the start of
//! the generation prompt, which a client re-renders identically next turn) and at the end of
//! each reply (which matches when the template renders replies back as they were generated).
//! A request takes the longest entry that is a prefix of its prompt and prefills only the rest.
//!
//! Memory is bounded: entries are evicted least recently used first once their bytes pass the
//! budget (`--session-memory`). An entry made for a session (`session_id`) is found only by that
//! session's requests; a session keeps one state of each typed-ahead kind, replaced as typing
//! goes on.

use tandem_core::state::State;

/// Why an entry was stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A turn boundary or the end of a reply.
    Checkpoint,
    /// Typing ahead: the part of the typed message that can no longer change. One per session.
    Typed,
    /// Typing ahead: the whole prompt that sending the text typed so far would make. One per
    /// session.
    Speculative,
}

struct Entry {
    tokens: Vec<u32>,
    state: State,
    bytes: usize,
    session: Option<String>,
    kind: Kind,
    last_used: u64,
}

pub struct StateCache {
    budget: usize,
    used: usize,
    entries: Vec<Entry>,
    clock: u64,
}

/// A cached state to continue: it covers the prompt's first `reused` tokens.
pub struct Hit {
    pub state: State,
    pub reused: usize,
}

impl StateCache {
    pub fn new(budget: usize) -> StateCache {
        StateCache { budget, used: 0, entries: Vec::new(), clock: 0 }
    }

    pub fn bytes(&self) -> usize {
        self.used
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// A copy of the state of the longest entry that `prompt` starts with (visible to
    /// `session`), marked as used. The entry stays: a conversation can branch (a regenerated
    /// reply, an edited message) and come back to it.
    pub fn lookup(&mut self, prompt: &[u32], session: Option<&str>) -> Option<Hit> {
        let best = self
            .entries
            .iter_mut()
            .filter(|e| e.session.is_none() || e.session.as_deref() == session)
            .filter(|e| !e.tokens.is_empty() && prompt.starts_with(&e.tokens))
            .max_by_key(|e| (e.tokens.len(), e.last_used))?;
        self.clock += 1;
        best.last_used = self.clock;
        Some(Hit { state: best.state.clone(), reused: best.tokens.len() })
    }

    /// Keep `state`, which covers `tokens`. An entry with the same tokens (and session) is
    /// replaced, as is the session's earlier typed-ahead state of the same kind; a state larger
    /// than the whole budget is not kept.
    pub fn insert(&mut self, tokens: Vec<u32>, state: State, session: Option<String>, kind: Kind) {
        debug_assert_eq!(state.position, tokens.len());
        let bytes = state.bytes() + 4 * tokens.len();
        self.entries.retain(|e| {
            let same = e.session == session && (e.tokens == tokens || (kind != Kind::Checkpoint && e.kind == kind));
            !same
        });
        self.used = self.entries.iter().map(|e| e.bytes).sum();
        if bytes > self.budget {
            return;
        }
        while self.used + bytes > self.budget {
            let oldest = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i).expect("entries hold the bytes in use");
            self.used -= self.entries.swap_remove(oldest).bytes;
        }
        self.clock += 1;
        self.used += bytes;
        self.entries.push(Entry { tokens, state, bytes, session, kind, last_used: self.clock });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::model::config::Qwen35Config;

    fn state(cfg: &Qwen35Config, n: usize) -> State {
        let mut s = State::new(cfg);
        s.position = n;
        s.last_logits = vec![n as f32; 4];
        s
    }

    fn tokens(n: usize) -> Vec<u32> {
        (0..n as u32).collect()
    }

    #[test]
    fn the_longest_prefix_wins_and_the_least_recently_used_goes_first() {
        let cfg = Qwen35Config::preset("tiny").unwrap();
        let size = state(&cfg, 3).bytes() + 12;
        let mut c = StateCache::new(3 * size);
        c.insert(tokens(3), state(&cfg, 3), None, Kind::Checkpoint);
        c.insert(tokens(5), state(&cfg, 5), None, Kind::Checkpoint);
        // Not a prefix: [0, 1, 9] does not start with [0, 1, 2].
        assert!(c.lookup(&[0, 1, 9], None).is_none());
        let hit = c.lookup(&tokens(8), None).unwrap();
        assert_eq!((hit.reused, hit.state.last_logits[0]), (5, 5.0));
        assert_eq!(c.lookup(&tokens(4), None).unwrap().reused, 3);
        // Full: the entry of 5 tokens was used longest ago and goes.
        c.insert(vec![7, 7, 7], state(&cfg, 3), None, Kind::Checkpoint);
        c.insert(vec![8, 8, 8], state(&cfg, 3), None, Kind::Checkpoint);
        assert_eq!(c.lookup(&tokens(8), None).unwrap().reused, 3);
        assert_eq!(c.len(), 3);
        assert!(c.bytes() <= 3 * size + 8);
    }

    #[test]
    fn sessions_see_their_own_entries_and_keep_one_speculative_state() {
        let cfg = Qwen35Config::preset("tiny").unwrap();
        let mut c = StateCache::new(usize::MAX);
        c.insert(tokens(4), state(&cfg, 4), Some("a".into()), Kind::Speculative);
        assert!(c.lookup(&tokens(6), None).is_none());
        assert!(c.lookup(&tokens(6), Some("b")).is_none());
        assert_eq!(c.lookup(&tokens(6), Some("a")).unwrap().reused, 4);
        c.insert(tokens(5), state(&cfg, 5), Some("a".into()), Kind::Speculative);
        assert_eq!(c.len(), 1);
        c.insert(tokens(2), state(&cfg, 2), Some("a".into()), Kind::Checkpoint);
        c.insert(tokens(2), state(&cfg, 2), Some("a".into()), Kind::Checkpoint);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn a_zero_budget_keeps_nothing() {
        let cfg = Qwen35Config::preset("tiny").unwrap();
        let mut c = StateCache::new(0);
        c.insert(tokens(2), state(&cfg, 2), None, Kind::Checkpoint);
        assert_eq!((c.len(), c.bytes()), (0, 0));
    }
}
