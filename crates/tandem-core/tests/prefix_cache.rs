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
use tandem_core::pipeline::{self, Event, KvBudget, Mode, PipelineConfig, Request, Start};
use tandem_core::prefix_cache::PrefixCache;
use tandem_core::sampling::SamplingParams;
use tandem_core::state::{State, Tier};

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
        PipelineConfig { mode: Mode::Hybrid, prefill: spec("cpu:threads=2"), decode: spec("cpu:threads=1"), transfer: Transfer::Move, max_batch: 4, max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS, kv_cache: KvBudget::Unlimited, trace: None, prefix_cache_device: 0, device_snapshots: false },
        // Chunked prefill, 7 tokens a step: the snapshots fall inside and across chunks.
        PipelineConfig { mode: Mode::AllOnDecodeEngine, prefill: spec("cpu:threads=2"), decode: spec("cpu:threads=2"), transfer: Transfer::Move, max_batch: 4, max_prefill_tokens: 7, kv_cache: KvBudget::Unlimited, trace: None, prefix_cache_device: 0, device_snapshots: false },
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
                    let snapshots = found.stops.iter().map(|s| s - found.reused).collect();
                    let request = Request::new(i as u64, prompt[found.reused..].to_vec(), 0, vocab as usize, tx.clone());
                    p.submit(Request { start: found.state.map(Start::Cached), return_state: true, snapshots, ..request })?;
                }
                drop(tx);
                for e in rx {
                    match e {
                        Event::Snapshot { id, state } => {
                            let prompt = &group[id as usize];
                            let n = state.position();
                            assert!(state.to_host()? == cold(&m, &prompt[..n]), "{:?}: wave {wave}: the snapshot after {n} tokens is not a cold prefill's", config.mode);
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
                assert!(cache.bytes(Tier::Host) <= budget);
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
    let (hits, _) = greedy_after_hits(PipelineConfig { mode: Mode::Hybrid, prefill: spec("cpu:threads=2"), decode: spec("cpu:threads=1"), transfer: Transfer::Move, max_batch: 4, max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS, kv_cache: KvBudget::Unlimited, trace: None, prefix_cache_device: 0, device_snapshots: false }, usize::MAX, None);
    assert!(hits >= 8, "{hits} hits of 24");
}

/// The same on a GPU, prefill and decode: snapshots kept on the GPU (a tier that holds them
/// all; one of 1 MiB, some seven snapshots of this model, that evicts as the requests run;
/// the same with the snapshots it lets go moved to host memory, or to the disk tier), or in
/// host memory (copied from the GPU and back); and a CPU prefill handing over to a GPU decode.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn cuda_greedy_tokens_after_a_hit_are_a_cold_runs() {
    let spec = |s: &str| EngineSpec::parse(s).unwrap();
    let gpu = "cuda:0,precision=exact";
    let dir = common::scratch("prefix-cache-gpu-disk");
    let cases = [(gpu, 1 << 30, 0, false), (gpu, 1 << 20, 0, false), (gpu, 1 << 20, usize::MAX, false), (gpu, 1 << 20, 0, true), (gpu, 0, usize::MAX, false), ("cpu:threads=2", 0, usize::MAX, false)];
    for (prefill, device, host, disk) in cases {
        let config = PipelineConfig { mode: Mode::Hybrid, prefill: spec(prefill), decode: spec(gpu), transfer: Transfer::Move, max_batch: 4, max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS, kv_cache: KvBudget::Unlimited, trace: None, prefix_cache_device: device, device_snapshots: false };
        let (hits, stats) = greedy_after_hits(config, host, disk.then_some(dir.as_path()));
        eprintln!("{prefill} -> {gpu}, device tier {device}, host tier {host}, disk tier {disk}: {hits} hits, {stats:?}");
        if device == 1 << 20 && host == 0 && !disk {
            assert!(stats.evicted > 0 && hits >= 3, "a device tier of 1 MiB evicts, and hits what it keeps: {hits} hits, {stats:?}");
        } else if device == 1 << 20 {
            assert!(stats.demoted > 0 && stats.evicted == 0 && hits >= 8, "what a device tier of 1 MiB lets go moves down a tier and hits there: {hits} hits, {stats:?}");
        } else {
            assert!(hits >= 8, "{hits} hits of 24");
        }
    }
}

/// With the GPU's own precision (bf16 tensor cores) where a prefill is cut matters: a piece of
/// up to 8 rows runs the DeltaNet recurrence token by token and a longer one the chunked delta
/// rule on tensor cores, so a prompt prefilled in the pieces the cache leaves (from a snapshot
/// on, and stopping where snapshots are taken) rounds differently from the same prompt in one
/// piece. What the cache owes is that it adds nothing of its own: a prompt that continues
/// snapshots kept on the GPU ends with the bits of a cold prefill cut at the same positions
/// (every position where a prefill in its history started or stopped). How far either is
/// from the exact logits (the CPU engine's) is printed beside a cold prefill in one piece.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn cuda_logits_after_a_device_hit_are_a_cold_prefill_cut_at_the_same_places() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let vocab = m.net.config.vocab_size as u32;
    let spec = |s: &str| EngineSpec::parse(s).unwrap();
    let config = PipelineConfig { mode: Mode::AllOnDecodeEngine, prefill: spec("cuda:0"), decode: spec("cuda:0"), transfer: Transfer::Move, max_batch: 4, max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS, kv_cache: KvBudget::Unlimited, trace: None, prefix_cache_device: 1 << 30, device_snapshots: false };
    let mut seed = 5;
    let ps = prompts(&mut seed, 24, vocab);
    let prefill = |p: &pipeline::Pipeline, start: Option<Start>, tokens: &[u32], stops: Vec<usize>| -> anyhow::Result<(Vec<tandem_core::state::Snapshot>, State)> {
        let (tx, rx) = channel();
        p.submit(Request { id: 0, start, tokens: tokens.to_vec(), max_tokens: 0, sampling: SamplingParams::default(), vocab: vocab as usize, stop_ids: vec![], return_state: true, snapshots: stops, cancel: Arc::new(AtomicBool::new(false)), events: tx, forks: Vec::new() })?;
        let mut taken = Vec::new();
        for e in rx {
            match e {
                Event::Snapshot { state, .. } => taken.push(state),
                Event::Done { state, .. } => return Ok((taken, state.expect("a prefill-only request returns its state"))),
                Event::Failed { error, .. } => anyhow::bail!("{error}"),
                Event::Token { .. } => {}
            }
        }
        anyhow::bail!("no answer")
    };
    pipeline::run(&m.net, &config, |p| {
        let mut cache = PrefixCache::new(0, 16).with_device(p.device_tier().expect("a device tier").clone());
        // For each snapshot's tokens: the positions where the prefills that made it were cut.
        let mut cuts_of: std::collections::HashMap<Vec<u32>, Vec<usize>> = Default::default();
        let (mut hits, mut cut, mut worst_whole, mut worst_cut) = (0, 0, 0.0f32, 0.0f32);
        for prompt in &ps {
            let found = cache.lookup(None, prompt);
            hits += usize::from(found.reused > 0);
            let mut cuts = if found.reused > 0 { cuts_of[&prompt[..found.reused]].clone() } else { Vec::new() };
            cuts.push(found.reused);
            cuts.extend(&found.stops);
            cuts.retain(|&c| c > 0 && c < prompt.len());
            cuts.dedup();
            let (taken, got) = prefill(p, found.state.map(Start::Cached), &prompt[found.reused..], found.stops.iter().map(|s| s - found.reused).collect())?;
            for snapshot in taken {
                assert_eq!(snapshot.tier(), Tier::Device);
                let n = snapshot.position();
                cuts_of.insert(prompt[..n].to_vec(), cuts.iter().copied().filter(|&c| c < n).collect());
                cache.insert(None, &prompt[..n], snapshot, None);
            }
            let (_, cold_cut) = prefill(p, None, prompt, cuts.clone())?;
            assert!(
                got.last_logits == cold_cut.last_logits,
                "prompt of {} tokens, {} from the cache, cut at {cuts:?}: the logits differ from a cold prefill cut there by up to {}",
                prompt.len(),
                found.reused,
                got.last_logits.iter().zip(&cold_cut.last_logits).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max)
            );
            let (_, cold_whole) = prefill(p, None, prompt, Vec::new())?;
            let exact = cold(&m, prompt).last_logits;
            let off = |l: &[f32]| l.iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max) / tandem_core::verify::logit_tolerance(&exact);
            cut += usize::from(!cuts.is_empty());
            worst_whole = worst_whole.max(off(&cold_whole.last_logits));
            worst_cut = worst_cut.max(off(&got.last_logits));
        }
        eprintln!(
            "{hits} hits of {} ({cut} prompts prefilled in pieces), each the bits of a cold prefill cut at the same places; logits from the exact ones, in verify tolerances: up to {worst_whole:.0} in one piece, {worst_cut:.0} as the cache cut them; {} snapshots on the GPU, {} KiB",
            ps.len(),
            cache.snapshots(Tier::Device),
            cache.bytes(Tier::Device) >> 10
        );
        assert!(hits >= 8, "{hits} hits of {}", ps.len());
        Ok(())
    })
    .unwrap();
}

/// Greedy tokens of prompts that continue cached snapshots against cold runs, with a host tier
/// of `host` bytes (and the pipeline's device tier, if it has one); the prompts that hit and
/// the cache's counts.
fn greedy_after_hits(config: PipelineConfig, host: usize, disk: Option<&std::path::Path>) -> (usize, tandem_core::prefix_cache::CacheStats) {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let vocab = m.net.config.vocab_size as u32;
    let mut seed = 99;
    let ps = prompts(&mut seed, 24, vocab);
    let params = pipeline::RequestParams { max_tokens: 8, sampling: SamplingParams::default(), vocab: vocab as usize, stop_ids: vec![] };
    pipeline::run(&m.net, &config, |p| {
        let mut cache = PrefixCache::new(host, 32);
        if let Some(tier) = p.device_tier() {
            cache = cache.with_device(tier.clone());
        }
        if let Some(dir) = disk {
            let (tier, found) = tandem_core::prefix_cache::DiskTier::open(dir, usize::MAX, m.net.fingerprint(), &m.net.config)?;
            cache = cache.with_disk(tier, found);
        }
        let mut hits = 0;
        for (i, prompt) in ps.iter().enumerate() {
            // Snapshots leaving the GPU are copied after every other prompt: the prompt between
            // continues them on the GPU while they wait.
            if i % 2 == 0 {
                cache.settle_here();
            }
            let found = cache.lookup(None, prompt);
            hits += usize::from(found.reused > 0);
            let (tx, rx) = channel();
            let snapshots = found.stops.iter().map(|s| s - found.reused).collect();
            let request = Request::new(0, prompt[found.reused..].to_vec(), params.max_tokens, params.vocab, tx);
            p.submit(Request { start: found.state.map(Start::Cached), sampling: params.sampling.clone(), snapshots, ..request })?;
            let mut got = Vec::new();
            for e in rx {
                match e {
                    Event::Snapshot { state, .. } => {
                        let n = state.position();
                        cache.insert(None, &prompt[..n], state, None);
                    }
                    Event::Token { token, .. } => got.push(token),
                    Event::Done { .. } => {}
                    Event::Failed { error, .. } => panic!("{error}"),
                }
            }
            if std::env::var_os("TANDEM_TEST_TRACE").is_some() {
                eprintln!("prompt of {}: reused {}, matched {}, stops {:?}", prompt.len(), found.reused, found.matched, found.stops);
            }
            let want = p.generate(None, prompt.clone(), &params, |_| Ok(()))?.tokens;
            assert_eq!(got, want, "{} -> {}: prompt of {} tokens, {} from the cache", config.prefill, config.decode, prompt.len(), found.reused);
        }
        cache.settle_here();
        assert!(cache.bytes(Tier::Device) <= cache.device_budget() && cache.bytes(Tier::Host) <= cache.budget());
        Ok((hits, cache.stats()))
    })
    .unwrap()
}

/// The disk tier: snapshots that host memory lets go are written to state files and read back
/// bit for bit when a prompt hits them, also by a cache made anew on the same directory (a
/// restarted server). A file another model wrote, or one damaged on disk, is refused with the
/// reason, naming the file, and never applied: the prompt starts from what is left.
#[test]
fn the_disk_tier_reads_back_exactly_and_refuses_damaged_or_foreign_files() {
    use tandem_core::prefix_cache::DiskTier;
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let (cfg, fingerprint) = (&m.net.config, m.net.fingerprint());
    let dir = common::scratch("prefix-cache-disk");
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % cfg.vocab_size as u32).collect();
    let (short, long) = (cold(&m, &prompt[..20]), cold(&m, &prompt));
    // Host memory for the longer snapshot only: the other goes to disk.
    let budget = long.bytes() + 4 * prompt.len();
    let open = |fingerprint| {
        let (tier, found) = DiskTier::open(&dir, usize::MAX, fingerprint, cfg).unwrap();
        PrefixCache::new(budget, 0).with_disk(tier, found)
    };
    let mut cache = open(fingerprint);
    assert!(cache.insert(None, &prompt[..20], short.clone().into(), None));
    assert!(cache.insert(None, &prompt, long.clone().into(), None));
    assert_eq!((cache.stats().spilled, cache.snapshots(Tier::Disk), cache.snapshots(Tier::Host)), (1, 1, 1));
    let found = cache.lookup(None, &prompt[..30]);
    assert_eq!(found.reused, 20);
    assert!(found.state.unwrap().to_host().unwrap() == short, "the snapshot read back from disk is not the one written");
    // Read back, it is kept in host memory again, and the longer one goes to disk.
    assert_eq!((cache.snapshots(Tier::Host), cache.snapshots(Tier::Disk)), (1, 1));
    drop(cache);

    // A new cache on the directory (a restarted server) finds both; a server's lookup reads
    // the file with the lock let go, and gets the same.
    let cache = std::sync::Mutex::new(open(fingerprint));
    assert_eq!(cache.lock().unwrap().snapshots(Tier::Disk), 2);
    let found = PrefixCache::lookup_unlocked(&cache, None, &prompt);
    assert_eq!(found.reused, 40);
    assert!(found.state.unwrap().to_host().unwrap() == long);
    assert_eq!(cache.lock().unwrap().snapshots(Tier::Host), 1, "read back into host memory");
    drop(cache);

    // Another model's: refused, never applied, and its files left where they are.
    let mut foreign = open(fingerprint ^ 1);
    let found = foreign.lookup(None, &prompt);
    assert!(found.state.is_none() && found.reused == 0);
    let why = foreign.last_refusal().expect("a refusal").to_string();
    assert!(why.contains("another model") && why.contains(".state"), "{why}");
    assert_eq!(foreign.stats().refused, 2);
    drop(foreign);

    // Damaged on disk: a byte of each file's payload flipped.
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "state")).collect();
    assert_eq!(files.len(), 2);
    for f in &files {
        let mut bytes = std::fs::read(f).unwrap();
        let at = bytes.len() - 1000;
        bytes[at] ^= 0x40;
        std::fs::write(f, bytes).unwrap();
    }
    let cache = std::sync::Mutex::new(open(fingerprint));
    let found = PrefixCache::lookup_unlocked(&cache, None, &prompt);
    assert!(found.state.is_none() && found.reused == 0, "a damaged snapshot was applied");
    let cache = cache.into_inner().unwrap();
    let why = cache.last_refusal().expect("a refusal").to_string();
    assert!(why.contains("checksum") && why.contains(".state"), "{why}");
    assert_eq!(cache.stats().refused, 2);
    assert!(files.iter().all(|f| !f.exists() && !f.with_extension("tokens").exists()), "a damaged file of this model's is deleted once refused (another model's were left: above)");
    std::fs::remove_dir_all(&dir).unwrap();
}
