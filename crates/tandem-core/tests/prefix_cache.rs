//! The prefix cache changes nothing but the work: a prompt that continues a cached snapshot
//! (taken at another prompt's end, where two prompts part, every N tokens, at any token)
//! ends with the bits a cold prefill of the whole prompt gives, through the pipeline's CPU
//! engines, with requests that share and branch running together and snapshots evicted under
//! a tight budget meanwhile.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::mpsc::channel;
use std::sync::Arc;

use tandem_core::backend::cpu::pool::Pool;
use tandem_core::bridge::Transfer;
use tandem_core::engine::EngineSpec;
use tandem_core::model::load::LoadedModel;
use tandem_core::model::Logits;
use tandem_core::pipeline::{self, Event, KvBudget, Mode, PipelineConfig, Request};
use tandem_core::prefix_cache::PrefixCache;
use tandem_core::sampling::SamplingParams;
use tandem_core::state::State;

/// Random prompts that share prefixes: each starts as a copy of part of an earlier one (cut
/// at any token) and goes on with tokens of its own; some repeat an earlier prompt or stop
/// inside one.
fn prompts(seed: &mut u64, n: usize, vocab: u32) -> Vec<Vec<u32>> {
    let mut next = || {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*seed >> 33) as usize
    };
    let mut out: Vec<Vec<u32>> = Vec::new();
    for _ in 0..n {
        let mut p = if out.is_empty() || next() % 6 == 0 {
            Vec::new()
        } else {
            let base = &out[next() % out.len()];
            base[..1 + next() % base.len()].to_vec()
        };
        // A third only repeat (part of) an earlier prompt: a hit at a prompt's end or inside it.
        let extra = if p.is_empty() || next() % 3 != 0 { 1 + next() % 90 } else { 0 };
        p.extend((0..extra).map(|_| (next() % vocab as usize) as u32));
        out.push(p);
    }
    out
}

fn cold(m: &LoadedModel, tokens: &[u32]) -> State {
    let mut st = State::new(&m.net.config);
    m.net.forward(&Pool::new(1), tokens, &mut st, Logits::Last).unwrap();
    st
}

#[test]
fn a_hit_anywhere_gives_the_bits_of_a_cold_prefill() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let vocab = m.net.config.vocab_size as u32;
    let spec = |s: &str| EngineSpec::parse(s).unwrap();
    let configs = [
        PipelineConfig { mode: Mode::Hybrid, prefill: spec("cpu:threads=2"), decode: spec("cpu:threads=1"), transfer: Transfer::Move, max_batch: 4, max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS, kv_cache: KvBudget::Unlimited, trace: None },
        // Chunked prefill, 7 tokens a step: the snapshots fall inside and across chunks.
        PipelineConfig { mode: Mode::AllOnDecodeEngine, prefill: spec("cpu:threads=2"), decode: spec("cpu:threads=2"), transfer: Transfer::Move, max_batch: 4, max_prefill_tokens: 7, kv_cache: KvBudget::Unlimited, trace: None },
    ];
    let mut seed = 7;
    for config in &configs {
        let ps = prompts(&mut seed, 36, vocab);
        let want: Vec<State> = ps.iter().map(|p| cold(&m, p)).collect();
        // Room for 32 snapshots of the longer prompts: evictions as the requests run.
        let budget = 32 * want.iter().map(State::bytes).max().unwrap();
        let mut cache = PrefixCache::new(budget, 16);
        let mut snapshots = 0;
        pipeline::run(&m.net, config, |p| {
            // Four at a time, looked up before any of them runs: requests that share a prefix
            // and branch run together.
            for (wave, group) in ps.chunks(4).enumerate() {
                let (tx, rx) = channel();
                for (i, prompt) in group.iter().enumerate() {
                    let found = cache.lookup(None, prompt);
                    cache.count(&found);
                    p.submit(Request {
                        id: i as u64,
                        start: found.state.map(|s| State::clone(&s)),
                        tokens: prompt[found.reused..].to_vec(),
                        max_tokens: 0,
                        sampling: SamplingParams::default(),
                        vocab: vocab as usize,
                        stop_ids: vec![],
                        return_state: true,
                        snapshots: found.stops.iter().map(|s| s - found.reused).collect(),
                        cancel: Arc::new(AtomicBool::new(false)),
                        events: tx.clone(),
                    })?;
                }
                drop(tx);
                for e in rx {
                    match e {
                        Event::Snapshot { id, state } => {
                            let prompt = &group[id as usize];
                            let n = state.position;
                            assert!(state == cold(&m, &prompt[..n]), "{:?}: wave {wave}: the snapshot after {n} tokens is not a cold prefill's", config.mode);
                            cache.insert(None, &prompt[..n], state, None);
                            snapshots += 1;
                        }
                        Event::Done { id, state, .. } => {
                            let i = 4 * wave + id as usize;
                            let state = state.expect("a prefill-only request returns its state");
                            assert!(state == want[i], "{:?}: prompt {i} ({} tokens) differs from its cold prefill", config.mode, ps[i].len());
                        }
                        Event::Failed { error, .. } => panic!("{error}"),
                        Event::Token { .. } => unreachable!("prefill only"),
                    }
                }
                assert!(cache.bytes() <= budget);
            }
            Ok(())
        })
        .unwrap();
        let s = cache.stats();
        assert!(s.hits >= 12 && s.evicted > 0 && snapshots > 36, "{:?}: the test should exercise hits and eviction: {s:?}, {snapshots} snapshots", config.mode);
        assert!(s.hit_tokens <= s.matched_tokens);
    }
}

/// A request that continues a snapshot samples the tokens a cold run samples (greedy), the
/// snapshot being taken at the prompt's end, part way, or at a point where prompts part.
#[test]
fn greedy_tokens_after_a_hit_are_a_cold_runs() {
    let spec = |s: &str| EngineSpec::parse(s).unwrap();
    greedy_after_hits(PipelineConfig { mode: Mode::Hybrid, prefill: spec("cpu:threads=2"), decode: spec("cpu:threads=1"), transfer: Transfer::Move, max_batch: 4, max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS, kv_cache: KvBudget::Unlimited, trace: None });
}

/// The same on a GPU, prefill and decode (the snapshots copied from the GPU and back), and
/// with a CPU prefill handing over to a GPU decode.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn cuda_greedy_tokens_after_a_hit_are_a_cold_runs() {
    let spec = |s: &str| EngineSpec::parse(s).unwrap();
    let gpu = "cuda:0,precision=exact";
    for (prefill, decode) in [(gpu, gpu), ("cpu:threads=2", gpu)] {
        greedy_after_hits(PipelineConfig { mode: Mode::Hybrid, prefill: spec(prefill), decode: spec(decode), transfer: Transfer::Move, max_batch: 4, max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS, kv_cache: KvBudget::Unlimited, trace: None });
    }
}

fn greedy_after_hits(config: PipelineConfig) {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let vocab = m.net.config.vocab_size as u32;
    let mut seed = 99;
    let ps = prompts(&mut seed, 24, vocab);
    let params = pipeline::RequestParams { max_tokens: 8, sampling: SamplingParams::default(), vocab: vocab as usize, stop_ids: vec![] };
    pipeline::run(&m.net, &config, |p| {
        let mut cache = PrefixCache::new(usize::MAX, 32);
        let mut hits = 0;
        for prompt in &ps {
            let found = cache.lookup(None, prompt);
            hits += usize::from(found.reused > 0);
            let (tx, rx) = channel();
            p.submit(Request {
                id: 0,
                start: found.state.map(|s| State::clone(&s)),
                tokens: prompt[found.reused..].to_vec(),
                max_tokens: params.max_tokens,
                sampling: params.sampling.clone(),
                vocab: params.vocab,
                stop_ids: vec![],
                return_state: false,
                snapshots: found.stops.iter().map(|s| s - found.reused).collect(),
                cancel: Arc::new(AtomicBool::new(false)),
                events: tx,
            })?;
            let mut got = Vec::new();
            for e in rx {
                match e {
                    Event::Snapshot { state, .. } => {
                        let n = state.position;
                        cache.insert(None, &prompt[..n], state, None);
                    }
                    Event::Token { token, .. } => got.push(token),
                    Event::Done { .. } => {}
                    Event::Failed { error, .. } => panic!("{error}"),
                }
            }
            let want = p.generate(None, prompt.clone(), &params, |_| Ok(()))?.tokens;
            assert_eq!(got, want, "{} -> {}: prompt of {} tokens, {} from the cache", config.prefill, config.decode, prompt.len(), found.reused);
        }
        assert!(hits >= 8, "{hits} hits of {}", ps.len());
        Ok(())
    })
    .unwrap();
}
