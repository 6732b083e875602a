//! Multi-turn sessions. A conversation's state persists between turns, so a turn prefills only
//! its own tokens, never the history again; and most of those are prefilled before the user
//! sends the message:
//!
//! - **Early prefill**: when a reply ends, the closing of the assistant turn and the next user
//!   turn's scaffolding (`<|im_end|>\n<|im_start|>user\n` in Qwen3.5's template) are known at
//!   once, so they are applied while the user reads (`type_ahead("")`).
//! - **Prefill while typing**: partial text is fed with `type_ahead(text)`; the turn's tokens
//!   are prefilled up to a few tokens short of the end (a token near the end of partial text may
//!   still change as typing goes on), with a snapshot of the state there. The closing template
//!   (`<|im_end|>\n<|im_start|>assistant\n…`) is also applied speculatively, to a copy, so that a
//!   message sent as typed needs no prefill at all.
//! - **Send**: the whole turn is tokenized again, as one text, exactly as sending it at once
//!   would. The speculative state is used only if its tokens are exactly these; otherwise the
//!   latest snapshot whose tokens are a prefix of them is continued. So correctness never
//!   depends on the guess of which tokens are stable: an edit or a retokenization only costs a
//!   longer prefill at send time.
//!
//! A session appends: its state holds the conversation as the model saw it, including the
//! generation prompt of each reply (with thinking off, Qwen3.5's `<think>\n\n</think>\n\n`),
//! which the template leaves out when it re-renders earlier turns. That is what the model
//! conditioned on while replying, and it is what makes turn-by-turn reuse possible.
//!
//! The session does no compute itself: it is given a `prefill` function (a prefill-only
//! request to the pipeline's prefill engine) and hands each turn's generation to the caller.
//! Its states live in a prefix cache (`PrefixCache`, the server's too), keyed by every token
//! they cover and pinned for the session: the conversation's latest state, the typed part of
//! the next turn, the speculative send state. A few earlier typed states stay there unpinned
//! (`MAX_TYPED`), sharing the conversation's K/V; a lookup finds the deepest state a turn
//! passes, and a finished turn leaves only its end.

use anyhow::{bail, Context, Result};

use crate::chat::{ChatTemplate, Message};
use crate::model::config::Qwen35Config;
use crate::pipeline::Finish;
use crate::prefix_cache::{Pin, PrefixCache};
use crate::state::State;

/// Tokens held back from the end of partially typed text: the last word may still grow (and
/// merge into longer tokens) as typing goes on.
pub const HOLD_BACK: usize = 2;
/// States the session keeps part way into a turn (besides the turn's start and the
/// speculative send state); an older one is forgotten first, which only lengthens the prefill
/// after an edit. Along a conversation they share their attention K/V (`HostSnapshot`): each
/// costs its recurrent state.
const MAX_TYPED: usize = 4;

/// The name the session pins its states under in its cache.
const PINS: &str = "session";

/// The template's text around a user message, found by rendering conversations with marker
/// strings in place of the contents.
#[derive(Clone, Debug, PartialEq)]
pub struct Scaffold {
    /// Before the first user message: the system turn, then the user turn's opening.
    pub first_lead: String,
    /// Between a reply's last token and the next user message: the assistant turn's closing,
    /// then the next user turn's opening.
    pub next_lead: String,
    /// After a user message: its closing and the assistant's generation prompt.
    pub closer: String,
}

const MARK_USER1: &str = "\u{E000}tandem-user-1\u{E000}";
const MARK_REPLY: &str = "\u{E000}tandem-reply\u{E000}";
const MARK_USER2: &str = "\u{E000}tandem-user-2\u{E000}";

impl Scaffold {
    pub fn from_template(template: &ChatTemplate, system: Option<&str>, enable_thinking: bool) -> Result<Scaffold> {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(Message::new("system", s));
        }
        messages.push(Message::new("user", MARK_USER1));
        let one = template.render(&messages, true, enable_thinking)?;
        messages.push(Message::new("assistant", MARK_REPLY));
        messages.push(Message::new("user", MARK_USER2));
        let two = template.render(&messages, true, enable_thinking)?;
        let not_append_only = || format!("the chat template ({}) does not render turns one after another, so a session cannot continue it", template.origin);
        let (first_lead, closer) = one.split_once(MARK_USER1).with_context(not_append_only)?;
        let (_, after_reply) = two.split_once(MARK_REPLY).with_context(not_append_only)?;
        let (next_lead, closer2) = after_reply.split_once(MARK_USER2).with_context(not_append_only)?;
        if closer != closer2 || !two.starts_with(first_lead) {
            bail!(not_append_only());
        }
        Ok(Scaffold { first_lead: first_lead.into(), next_lead: next_lead.into(), closer: closer.into() })
    }
}

/// What a `type_ahead` call did.
#[derive(Clone, Copy, Debug, Default)]
pub struct TypeAhead {
    /// Tokens prefilled into the turn's snapshots.
    pub applied: usize,
    /// Tokens prefilled for the speculative send state.
    pub speculative: usize,
}

/// A turn ready to generate: apply `tokens` to `start`, then sample the reply.
pub struct Turn {
    pub start: State,
    pub tokens: Vec<u32>,
    /// Tokens of this turn that were prefilled before it was sent.
    pub reused: usize,
}

/// Prefill `tokens` into a state (on whichever engine the caller chooses).
pub type Prefill<'a> = dyn FnMut(State, &[u32]) -> Result<State> + 'a;

pub struct Session<'a> {
    scaffold: Scaffold,
    encode: Box<dyn Fn(&str) -> Result<Vec<u32>> + 'a>,
    config: Qwen35Config,
    /// Completed turns.
    turns: usize,
    /// Reply tokens sampled but not yet applied (the last one, when a reply hit max_tokens).
    carry: Vec<u32>,
    /// The conversation's states, each under every token it covers.
    cache: PrefixCache,
    /// The keys of the states typed ahead this turn (oldest first) and of the speculative one.
    typed: std::collections::VecDeque<Vec<u32>>,
    speculative: Option<Vec<u32>>,
    /// The turn sent and not yet finished.
    in_flight: Option<Vec<u32>>,
    /// Every token applied to the conversation's state, in order.
    log: Vec<u32>,
}

impl<'a> Session<'a> {
    /// A new conversation. `encode` tokenizes text as the model sees it (special tokens whole).
    pub fn new(scaffold: Scaffold, encode: impl Fn(&str) -> Result<Vec<u32>> + 'a, config: &Qwen35Config) -> Session<'a> {
        Session {
            scaffold,
            encode: Box::new(encode),
            config: config.clone(),
            turns: 0,
            carry: Vec::new(),
            // No byte budget: the session keeps a few states (MAX_TYPED) and forgets the rest.
            cache: PrefixCache::new(usize::MAX, 0),
            typed: std::collections::VecDeque::new(),
            speculative: None,
            in_flight: None,
            log: Vec::new(),
        }
    }

    /// Every token the conversation's state covers, in order.
    pub fn log(&self) -> &[u32] {
        &self.log
    }

    pub fn turns(&self) -> usize {
        self.turns
    }

    /// The states the session keeps, and their bytes (K/V they share counted once).
    pub fn kept(&self) -> (usize, usize) {
        use crate::state::Tier;
        (self.cache.snapshots(Tier::Host), self.cache.bytes(Tier::Host))
    }

    /// The tokens of the next turn with `text` as the user's message (with the closing
    /// template and generation prompt when `sent`), tokenized as one text.
    pub fn turn_ids(&self, text: &str, sent: bool) -> Result<Vec<u32>> {
        let lead = if self.turns == 0 { &self.scaffold.first_lead } else { &self.scaffold.next_lead };
        let mut s = String::with_capacity(lead.len() + text.len() + self.scaffold.closer.len());
        s.push_str(lead);
        s.push_str(text);
        if sent {
            s.push_str(&self.scaffold.closer);
        }
        let mut ids = self.carry.clone();
        ids.extend((self.encode)(&s)?);
        Ok(ids)
    }

    /// Feed the message as typed so far (`""` right after a reply: the early prefill of the
    /// closing and the next turn's scaffolding). Prefills what can no longer change, and the
    /// speculative send state.
    pub fn type_ahead(&mut self, typed: &str, prefill: &mut Prefill) -> Result<TypeAhead> {
        if self.in_flight.is_some() {
            bail!("a turn is still generating; type ahead after it finishes");
        }
        let target = self.turn_ids(typed, false)?;
        let stable = target.len().saturating_sub(HOLD_BACK);
        let mut done = TypeAhead::default();
        done.applied = self.prefill_to(&target[..stable], Pin::Typed, prefill)?;
        if !typed.is_empty() {
            let full = self.turn_ids(typed, true)?;
            done.speculative = self.prefill_to(&full, Pin::Speculative, prefill)?;
        }
        Ok(done)
    }

    /// Make sure the cache holds the state after the conversation and `turn`, pinned as `pin`:
    /// prefill what the deepest state it passes lacks. Returns the tokens prefilled.
    fn prefill_to(&mut self, turn: &[u32], pin: Pin, prefill: &mut Prefill) -> Result<usize> {
        let key = [&self.log[..], turn].concat();
        if key.is_empty() {
            return Ok(0);
        }
        let (start, reused) = self.deepest(&key)?;
        if reused == key.len() {
            self.cache.pin_existing(None, &key, PINS, pin);
            return Ok(0);
        }
        let state = prefill(start, &key[reused..])?;
        self.cache.insert(None, &key, state.into(), Some((PINS, pin)));
        let applied = key.len() - reused;
        if pin == Pin::Speculative {
            if let Some(old) = self.speculative.replace(key) {
                self.cache.forget(None, &old);
            }
        } else {
            self.typed.push_back(key);
            if self.typed.len() > MAX_TYPED {
                let oldest = self.typed.pop_front().expect("more than MAX_TYPED");
                self.cache.forget(None, &oldest);
            }
        }
        Ok(applied)
    }

    /// A copy of the deepest state `key` passes, and the tokens it covers (a fresh state where
    /// the cache holds none).
    fn deepest(&mut self, key: &[u32]) -> Result<(State, usize)> {
        let found = self.cache.lookup(None, key);
        Ok(match found.state {
            Some(s) => (s.to_host()?, found.reused),
            None => (State::new(&self.config), 0),
        })
    }

    /// Send `text` as the user's message: the state to continue and the tokens still to
    /// prefill. Give the outcome back with `finish` (or `abandon` if the turn failed).
    pub fn send(&mut self, text: &str) -> Result<Turn> {
        if self.in_flight.is_some() {
            bail!("a turn is still generating");
        }
        let full = self.turn_ids(text, true)?;
        let key = [&self.log[..], &full[..]].concat();
        let (start, reused) = self.deepest(&key)?;
        let turn = Turn { start, tokens: key[reused..].to_vec(), reused: reused.saturating_sub(self.log.len()) };
        self.in_flight = Some(full);
        Ok(turn)
    }

    /// The turn sent last finished: `state` is its final state, `reply` the tokens it emitted.
    pub fn finish(&mut self, state: State, reply: &[u32], finish: Finish) -> Result<()> {
        let Some(turn) = self.in_flight.take() else { bail!("no turn was sent") };
        // Emitted tokens were applied, except the last one when the reply hit its length (a
        // stop token is never emitted nor applied: the closing template supplies it).
        let (applied, carry) = match (finish, reply.split_last()) {
            (Finish::Length, Some((last, rest))) => (rest, vec![*last]),
            (Finish::Stop, _) | (Finish::Length, None) => (reply, Vec::new()),
            (Finish::Cancelled | Finish::Prefilled, _) => bail!("a {finish:?} turn did not finish; abandon it instead"),
        };
        let log = [&self.log[..], &turn[..], applied].concat();
        if state.position != log.len() {
            bail!("the finished state covers {} tokens but the conversation has {}", state.position, log.len());
        }
        let before = std::mem::replace(&mut self.log, log);
        self.carry = carry;
        self.cache.insert(None, &self.log, state.into(), Some((PINS, Pin::Latest)));
        // The turn's typed states and the last turn's end are of no more use: the next turn
        // continues this one's end.
        self.cache.release(PINS);
        self.cache.pin_existing(None, &self.log, PINS, Pin::Latest);
        for key in self.typed.drain(..).chain(self.speculative.take()).chain(Some(before)) {
            self.cache.forget(None, &key);
        }
        self.turns += 1;
        Ok(())
    }

    /// The turn sent last did not finish (cancelled or failed): the conversation stays as it
    /// was before it (its states in the cache as they were).
    pub fn abandon(&mut self) {
        self.in_flight = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen35_scaffold_comes_from_the_template() {
        let s = Scaffold::from_template(&ChatTemplate::qwen35(), Some("Be brief."), false).unwrap();
        assert_eq!(s.first_lead, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n");
        assert_eq!(s.next_lead, "<|im_end|>\n<|im_start|>user\n");
        assert_eq!(s.closer, "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
        let s = Scaffold::from_template(&ChatTemplate::chatml(), None, true).unwrap();
        assert_eq!(s.first_lead, "<|im_start|>user\n");
        assert_eq!(s.closer, "<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn a_template_that_reorders_turns_is_refused() {
        let t = ChatTemplate::new("{% for m in messages|reverse %}{{ m.content }};{% endfor %}".into(), "reversed.jinja".into()).unwrap();
        let e = format!("{:#}", Scaffold::from_template(&t, None, false).unwrap_err());
        assert!(e.contains("reversed.jinja") && e.contains("one after another"), "{e}");
    }
}
