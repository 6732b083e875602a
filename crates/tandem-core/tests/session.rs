//! Multi-turn sessions: a conversation typed ahead (with edits) gives the same tokens and the
//! same replies as one whose messages are sent whole, and as prefilling its whole history at
//! once; each turn prefills only its own tokens; a message sent as typed needs no prefill.
//!
//! The tiny fixture model has a 1024-token vocabulary, so the real Qwen3.5 tokenizer's ids are
//! folded into it (id % 1024): the session's logic (what is tokenized, reused, and applied)
//! is what these tests check, and it is the same for every id.

mod common;

use tandem_core::chat::ChatTemplate;
use tandem_core::model::config::Qwen35Config;
use tandem_core::engine::EngineSpec;
use tandem_core::model::load::LoadedModel;
use tandem_core::model::Logits;
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::sampling::{argmax, SamplingParams};
use tandem_core::bridge::Transfer;
use tandem_core::pipeline::{self, Finish, KvBudget, Mode, Pipeline, PipelineConfig, RequestParams};
use tandem_core::session::{Scaffold, Session, Turn};
use tandem_core::state::{LayerState, State};
use tandem_core::tokenizer::Tokenizer;

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(&std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.5/tokenizer.json")).unwrap()
}

const MESSAGES: [&str; 3] = [
    "Tell me about the tandem bicycle, briefly.",
    "Why do the two riders need to pedal in step?",
    "And who steers it?",
];

/// Generate a reply for `turn` (greedy): the reply, the final state, how it ended, and how many
/// tokens were prefilled at send.
fn generate(p: &Pipeline, turn: Turn, max_tokens: usize, stop: Vec<u32>) -> (Vec<u32>, State, Finish, usize) {
    let at_send = turn.tokens.len();
    let params = RequestParams { max_tokens, sampling: SamplingParams::default(), vocab: 1024, stop_ids: stop };
    let g = p.generate(Some(turn.start), turn.tokens, &params, |_| Ok(())).unwrap();
    (g.tokens, g.state.unwrap(), g.finish, at_send)
}

struct Outcome {
    log: Vec<u32>,
    replies: Vec<Vec<u32>>,
    /// Tokens prefilled at send time, per turn.
    at_send: Vec<usize>,
    state: State,
}

/// Run the 3-turn conversation. With `typing`, each message is fed word by word first (with
/// a typo fixed on the way in turn 2) and the next turn's scaffolding right after each reply.
fn converse(p: &Pipeline, cfg: &Qwen35Config, tok: &Tokenizer, typing: bool, stop: &[u32]) -> Outcome {
    let template = ChatTemplate::qwen35();
    let scaffold = Scaffold::from_template(&template, Some("You are terse."), false).unwrap();
    let encode = |s: &str| Ok(tok.encode(s)?.into_iter().map(|id| id % 1024).collect());
    let mut session = Session::new(scaffold, encode, cfg);
    let mut prefill = |st: State, ids: &[u32]| p.prefill(st, ids).map(|(s, _)| s);
    let mut out = Outcome { log: vec![], replies: vec![], at_send: vec![], state: State { position: 0, layers: vec![], last_logits: vec![] } };
    for (t, msg) in MESSAGES.iter().enumerate() {
        if typing {
            let early = session.type_ahead("", &mut prefill).unwrap();
            assert!(early.applied > 0, "the scaffolding is prefilled early");
            let words: Vec<&str> = msg.split(' ').collect();
            for n in 1..=words.len() {
                let mut typed = words[..n].join(" ");
                if t == 1 && n == 3 {
                    typed.push_str(" tw"); // a typo, then deleted
                }
                session.type_ahead(&typed, &mut prefill).unwrap();
            }
        }
        let history = session.log().len();
        let turn = session.send(msg).unwrap();
        if typing {
            assert!(turn.tokens.is_empty(), "turn {t}: a message sent as typed needs no prefill");
        } else {
            assert_eq!((turn.reused, turn.start.position), (0, history), "turn {t}: the history is never prefilled again");
        }
        let (reply, state, finish, at_send) = generate(p, turn, 6, stop.to_vec());
        session.finish(state.clone(), &reply, finish).unwrap();
        out.replies.push(reply);
        out.at_send.push(at_send);
        out.state = state;
    }
    out.log = session.log().to_vec();
    out
}

fn max_rel_err(a: &State, b: &State) -> f32 {
    let mut worst = 0f32;
    let mut cmp = |x: &[f32], y: &[f32]| {
        assert_eq!(x.len(), y.len());
        let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        for (u, v) in x.iter().zip(y) {
            worst = worst.max((u - v).abs() / scale);
        }
    };
    for (la, lb) in a.layers.iter().zip(&b.layers) {
        match (la, lb) {
            (LayerState::Linear { conv: c1, recurrent: r1 }, LayerState::Linear { conv: c2, recurrent: r2 }) => {
                cmp(c1, c2);
                cmp(r1, r2);
            }
            (LayerState::Full { k: k1, v: v1 }, LayerState::Full { k: k2, v: v2 }) => {
                cmp(k1, k2);
                cmp(v1, v2);
            }
            _ => panic!("layer kinds differ"),
        }
    }
    cmp(&a.last_logits, &b.last_logits);
    worst
}

#[test]
fn typed_ahead_equals_sent_at_once_equals_the_whole_history() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tok = tokenizer();
    let config = PipelineConfig {
        mode: Mode::Hybrid,
        prefill: EngineSpec::parse("cpu:threads=1").unwrap(),
        decode: EngineSpec::parse("cpu:threads=1").unwrap(),
        transfer: Transfer::Move,
        max_batch: 4,
        max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS,
        kv_cache: KvBudget::Unlimited,
        trace: None,
        prefix_cache_device: 0,
        device_snapshots: false,
    };
    // Replies end at max_tokens (the last token carried into the next turn) and, with a stop
    // id the tiny model does sample, at a stop token.
    let plain = pipeline::run(&m.net, &config, |p| Ok(converse(p, &m.net.config, &tok, false, &[]))).unwrap();
    let stop = vec![plain.replies[0][2]];
    for stop in [vec![], stop] {
        let (at_once, typed) = pipeline::run(&m.net, &config, |p| Ok((converse(p, &m.net.config, &tok, false, &stop), converse(p, &m.net.config, &tok, true, &stop)))).unwrap();
        assert_eq!(typed.log, at_once.log, "typed ahead and sent at once apply the same tokens");
        assert_eq!(typed.replies, at_once.replies, "and give the same greedy replies");
        assert!(at_once.at_send.iter().all(|&n| n > 5));
        assert!(typed.at_send.iter().all(|&n| n == 0));
        let err = max_rel_err(&typed.state, &at_once.state);
        assert!(err < 1e-4, "final states differ by {err:.2e} (relative)");

        // The whole history prefilled in one go reaches the same state and the same next token.
        let mut whole = State::new(&m.net.config);
        m.net.forward(&Pool::new(1), &at_once.log, &mut whole, Logits::Last).unwrap();
        assert_eq!(whole.position, at_once.state.position);
        let err = max_rel_err(&at_once.state, &whole);
        assert!(err < 1e-4, "session vs whole history: {err:.2e}");
        assert_eq!(argmax(&whole.last_logits), argmax(&at_once.state.last_logits));
    }
}

#[test]
fn an_abandoned_turn_leaves_the_conversation_as_it_was() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tok = tokenizer();
    let config = PipelineConfig {
        mode: Mode::AllOnDecodeEngine,
        prefill: EngineSpec::parse("cpu:threads=1").unwrap(),
        decode: EngineSpec::parse("cpu:threads=1").unwrap(),
        transfer: Transfer::Move,
        max_batch: 1,
        max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS,
        kv_cache: KvBudget::Unlimited,
        trace: None,
        prefix_cache_device: 0,
        device_snapshots: false,
    };
    pipeline::run(&m.net, &config, |p| {
        let scaffold = Scaffold::from_template(&ChatTemplate::qwen35(), None, false).unwrap();
        let encode = |s: &str| Ok(tok.encode(s)?.into_iter().map(|id| id % 1024).collect());
        let mut s = Session::new(scaffold, encode, &m.net.config);
        let mut prefill = |st: State, ids: &[u32]| p.prefill(st, ids).map(|(s, _)| s);
        let turn = s.send(MESSAGES[0]).unwrap();
        let (reply, state, finish, _) = generate(p, turn, 4, vec![]);
        s.finish(state, &reply, finish).unwrap();
        let log = s.log().to_vec();
        // Turn 2 is sent and then dropped (a cancelled request returns no state).
        let _lost = s.send(MESSAGES[1]).unwrap();
        assert!(s.type_ahead("x", &mut prefill).is_err(), "no typing while a turn is out");
        s.abandon();
        assert_eq!(s.log(), &log[..]);
        // The next turn rebuilds the state from the conversation's tokens.
        s.type_ahead("And", &mut prefill).unwrap();
        let turn = s.send(MESSAGES[2]).unwrap();
        let (reply, state, finish, _) = generate(p, turn, 4, vec![]);
        s.finish(state, &reply, finish).unwrap();
        assert_eq!(&s.log()[..log.len()], &log[..]);
        assert!(s.finish(State::new(&m.net.config), &[], Finish::Stop).is_err(), "finish without a turn sent");
        Ok(())
    })
    .unwrap();
}

/// The session's states live in a prefix cache: typing a message word by word keeps a few of
/// them (the newest typed ones, the speculative send state, the conversation's end), which
/// share the conversation's attention K/V rather than each holding a copy; a finished turn
/// leaves one.
#[test]
fn typing_keeps_a_few_states_that_share_the_conversations_k_v() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tok = tokenizer();
    let spec = |s: &str| EngineSpec::parse(s).unwrap();
    let config = PipelineConfig { mode: Mode::AllOnDecodeEngine, prefill: spec("cpu:threads=1"), decode: spec("cpu:threads=1"), transfer: Transfer::Move, max_batch: 1, max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS, kv_cache: KvBudget::Unlimited, trace: None, prefix_cache_device: 0, device_snapshots: false };
    pipeline::run(&m.net, &config, |p| {
        let scaffold = Scaffold::from_template(&ChatTemplate::qwen35(), None, false).unwrap();
        let encode = |s: &str| Ok(tok.encode(s)?.into_iter().map(|id| id % 1024).collect());
        let mut s = Session::new(scaffold, encode, &m.net.config);
        let mut prefill = |st: State, ids: &[u32]| p.prefill(st, ids).map(|(s, _)| s);
        for (t, msg) in MESSAGES.iter().enumerate() {
            s.type_ahead("", &mut prefill).unwrap();
            let words: Vec<&str> = msg.split(' ').collect();
            for n in 1..=words.len() {
                s.type_ahead(&words[..n].join(" "), &mut prefill).unwrap();
            }
            let (kept, bytes) = s.kept();
            let turn = s.send(msg).unwrap();
            assert!(turn.tokens.is_empty());
            // The speculative state holds the most K/V; the others hold theirs as a prefix of it.
            let whole = &turn.start;
            let own = whole.bytes() - whole.kv_bytes() + 4 * whole.position;
            assert!(kept >= 3 && kept <= 4 + 2, "turn {t}: {kept} states kept");
            assert!(bytes <= kept * own + whole.kv_bytes(), "turn {t}: {kept} states take {bytes} bytes: more than one K/V ({}) and {kept} states' own ({own} each)", whole.kv_bytes());
            let (reply, state, finish, _) = generate(p, turn, 4, vec![]);
            s.finish(state, &reply, finish).unwrap();
            assert_eq!(s.kept().0, 1, "turn {t}: a finished turn leaves its end");
        }
        Ok(())
    })
    .unwrap();
}
