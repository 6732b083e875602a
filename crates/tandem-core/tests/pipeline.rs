//! Two engines in tandem: every mode, dispatch and transfer gives the reference's greedy
//! tokens on the golden fixture; the bridge round-trips exactly and refuses bad states; the
//! handoff never applies a prompt token twice.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::mpsc::channel;
use std::sync::Arc;

use tandem_core::engine::{Device, Dispatch, EngineSpec};
use tandem_core::model::load::LoadedModel;
use tandem_core::model::{Logits, Qwen35};
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::sampling::{argmax, SamplingParams};
use tandem_core::bridge::Transfer;
use tandem_core::pipeline::{self, Event, Finish, KvBudget, Mode, PipelineConfig, Request};
use tandem_core::bridge;
use tandem_core::state::State;

/// The golden fixture's prompts and the reference's 16 greedy tokens after each.
fn reference_prompts() -> Vec<(Vec<u32>, Vec<u32>)> {
    let bytes = std::fs::read(common::tiny_dir().join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = |name: &str| -> Vec<u32> { st.tensor(name).unwrap().data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect() };
    (0..5).map(|p| (ids(&format!("p{p}.input_ids")), ids(&format!("p{p}.greedy_ids")))).collect()
}

fn request(id: u64, tokens: Vec<u32>, max_tokens: usize, events: std::sync::mpsc::Sender<Event>) -> Request {
    Request::new(id, tokens, max_tokens, 1024, events)
}

/// Run `prompts` through a pipeline at once (all submitted before the first finishes) and
/// return each one's generated tokens.
fn run_pipeline(net: &Qwen35, config: &PipelineConfig, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    pipeline::run(net, config, |p| submit_all(p, prompts, max_tokens)).unwrap()
}

/// Submit `prompts` to a running pipeline at once, request i for prompt i: their events.
fn submit(p: &pipeline::Pipeline, prompts: &[Vec<u32>], max_tokens: usize) -> anyhow::Result<std::sync::mpsc::Receiver<Event>> {
    let (tx, rx) = channel();
    for (i, prompt) in prompts.iter().enumerate() {
        p.submit(request(i as u64, prompt.clone(), max_tokens, tx.clone()))?;
    }
    Ok(rx)
}

/// Submit `prompts` to a running pipeline at once and return each one's generated tokens
/// (every request must run to `max_tokens`).
fn submit_all(p: &pipeline::Pipeline, prompts: &[Vec<u32>], max_tokens: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    let rx = submit(p, prompts, max_tokens)?;
    let mut out = vec![Vec::new(); prompts.len()];
    let mut done = 0;
    for e in rx {
        match e {
            Event::Token { id, token, .. } => out[id as usize].push(token),
            Event::Done { finish, .. } => {
                assert_eq!(finish, Finish::Length);
                done += 1;
            }
            Event::Failed { id, error } => panic!("request {id} failed: {error}"),
            Event::Snapshot { .. } => {}
        }
    }
    assert_eq!(done, prompts.len());
    Ok(out)
}

fn config(mode: Mode, prefill: &str, decode: &str, transfer: Transfer, max_batch: usize) -> PipelineConfig {
    PipelineConfig { mode, prefill: EngineSpec::parse(prefill).unwrap(), decode: EngineSpec::parse(decode).unwrap(), transfer, max_batch, max_prefill_tokens: PipelineConfig::MAX_PREFILL_TOKENS, kv_cache: KvBudget::Unlimited, trace: None, prefix_cache_device: 0, device_snapshots: false }
}

#[test]
fn every_mode_dispatch_and_transfer_gives_the_reference_greedy_tokens() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let cases = reference_prompts();
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| c.0.clone()).collect();
    let dir = common::scratch("pipeline-files");
    let configs = [
        config(Mode::AllOnPrefillEngine, "cpu:threads=2", "cpu:threads=1", Transfer::Move, 8),
        config(Mode::AllOnDecodeEngine, "cpu:threads=2", "cpu:threads=1,dispatch=sequential", Transfer::Move, 8),
        config(Mode::Hybrid, "cpu:threads=1,dispatch=batched:32", "cpu:threads=1", Transfer::Move, 8),
        config(Mode::Hybrid, "cpu:threads=1,dispatch=buckets:16,64,128", "cpu:threads=1", Transfer::File(dir.clone()), 3),
        config(Mode::Hybrid, "cpu:threads=1,dispatch=dynamic", "cpu:threads=1", Transfer::Socket, 1),
        // Chunked prefill: the prompts applied 5 tokens a step, between decode steps.
        PipelineConfig { max_prefill_tokens: 5, ..config(Mode::AllOnDecodeEngine, "cpu:threads=2", "cpu:threads=2", Transfer::Move, 3) },
    ];
    assert_eq!(prompts.iter().filter(|p| p.len() > 5).count(), 4, "four of the fixture's prompts (of 1 to 300 tokens) are split by the chunked prefill");
    for c in &configs {
        let got = run_pipeline(&m.net, c, &prompts, 16);
        for (i, (g, (_, want))) in got.iter().zip(&cases).enumerate() {
            assert_eq!(g, want, "{:?} {} -> {} via {:?}: prompt p{i}", c.mode, c.prefill, c.decode, c.transfer);
        }
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "the decode side removes state files it loaded");
}

/// `--trace` writes every prefill call, sampling and decode step as a Chrome trace event: the
/// file is a JSON array whose prefills cover every prompt token once, whose samplings are the
/// decode steps' sequences plus each request's last token, on the engines' tracks.
#[test]
fn the_trace_accounts_for_every_prompt_token_and_step() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = reference_prompts().into_iter().map(|c| c.0).collect();
    let dir = common::scratch("pipeline-trace");
    let configs = [
        (config(Mode::Hybrid, "cpu:threads=1", "cpu:threads=1", Transfer::Move, 3), ["prefill engine", "decode engine"]),
        (PipelineConfig { max_prefill_tokens: 5, ..config(Mode::AllOnDecodeEngine, "cpu:threads=2", "cpu:threads=2", Transfer::Move, 3) }, ["engine", "engine"]),
    ];
    for (i, (c, tracks)) in configs.into_iter().enumerate() {
        let path = dir.join(format!("trace-{i}.json"));
        let c = PipelineConfig { trace: Some(path.clone()), ..c };
        let got = run_pipeline(&m.net, &c, &prompts, 6);
        assert!(got.iter().all(|g| !g.is_empty()));
        let events: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(&path).unwrap()).expect("the trace is a JSON array");
        let sum = |name: &str, field: &str| -> u64 { events.iter().filter(|e| e["name"] == name).map(|e| e["args"][field].as_u64().unwrap()).sum() };
        let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
        assert_eq!(sum("prefill", "tokens"), prompt_tokens as u64, "{:?}: prefilled tokens", c.mode);
        assert_eq!(sum("sample", "sequences"), sum("decode step", "sequences") + prompts.len() as u64, "{:?}: every sampled token is applied but each request's last", c.mode);
        for e in &events {
            assert_eq!(e["ph"], "X");
            assert!(e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0, "{e}");
            let track = if e["name"] == "prefill" { tracks[0] } else { tracks[1] };
            assert_eq!(e["tid"], track, "{:?}: {e}", c.mode);
        }
    }
}

/// The CUDA placements give the reference's greedy tokens: GPU with GPU, host to GPU, GPU to
/// host, GPU to GPU through a state file; one sequence per step (its CUDA graph) and several
/// (the batched step); the prompts submitted together prefilled in one packed forward, or in
/// several under a small token budget. Exact prefill products, so that the tiny fixture's greedy choices are
/// reproducible. Ignored by default (it needs an NVIDIA GPU): on a GPU machine, `cargo test
/// --release -- --include-ignored`.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn cuda_placements_give_the_reference_greedy_tokens() {
    gpus_at_least(1);
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let dir = common::scratch("pipeline-cuda-files");
    let gpu = "cuda:0,precision=exact";
    let configs = vec![
        config(Mode::AllOnDecodeEngine, "cpu:threads=1", gpu, Transfer::Move, 8),
        config(Mode::AllOnDecodeEngine, "cpu:threads=1", "cuda:0,precision=exact,dispatch=batched:32", Transfer::Move, 1),
        config(Mode::Hybrid, "cpu:threads=1", gpu, Transfer::Move, 1),
        config(Mode::Hybrid, gpu, "cpu:threads=1", Transfer::Move, 3),
        config(Mode::Hybrid, gpu, gpu, Transfer::Move, 8),
        config(Mode::Hybrid, gpu, gpu, Transfer::Move, 1),
        config(Mode::Hybrid, gpu, "cuda:0,precision=exact,graphs=off", Transfer::Move, 8),
        config(Mode::Hybrid, "cpu:threads=1", gpu, Transfer::Move, 8),
        config(Mode::Hybrid, "cpu:threads=1", "cuda:0,precision=exact,graphs=off", Transfer::Move, 8),
        config(Mode::Hybrid, gpu, gpu, Transfer::File(dir.clone()), 2),
        config(Mode::Hybrid, "cpu:threads=1", gpu, Transfer::Socket, 8),
        // Prompts packed into forwards of at most 64 tokens (a longer one alone).
        PipelineConfig { max_prefill_tokens: 64, ..config(Mode::Hybrid, gpu, gpu, Transfer::Move, 8) },
        PipelineConfig { max_prefill_tokens: 64, ..config(Mode::AllOnDecodeEngine, gpu, gpu, Transfer::Move, 3) },
        // Chunked prefill: 5 prompt tokens a step (of one prompt or two, packed), between
        // decode steps of the sequences already running.
        PipelineConfig { max_prefill_tokens: 5, ..config(Mode::AllOnDecodeEngine, gpu, gpu, Transfer::Move, 3) },
    ];
    assert_placements_give_the_reference_tokens(&m, &configs);
}

/// One GPU prefills, the other decodes: the state crosses by a peer copy (either way, one
/// sequence a step or several, prompts packed under a small token budget) or through a state
/// file; the second GPU also takes the host's states and runs both engines alone. Ignored by
/// default (it needs two NVIDIA GPUs).
#[test]
#[ignore = "needs two NVIDIA GPUs: run with --include-ignored on such a machine"]
fn cuda_0_to_cuda_1_gives_the_reference_greedy_tokens() {
    gpus_at_least(2);
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let (gpu0, gpu1) = ("cuda:0,precision=exact", "cuda:1,precision=exact");
    let dir = common::scratch("pipeline-two-gpus-files");
    assert_placements_give_the_reference_tokens(
        &m,
        &[
            config(Mode::Hybrid, gpu0, gpu1, Transfer::Move, 8),
            config(Mode::Hybrid, gpu0, gpu1, Transfer::Move, 1),
            config(Mode::Hybrid, gpu1, gpu0, Transfer::Move, 8),
            config(Mode::Hybrid, gpu0, gpu1, Transfer::File(dir), 2),
            PipelineConfig { max_prefill_tokens: 64, ..config(Mode::Hybrid, gpu0, gpu1, Transfer::Move, 8) },
            config(Mode::Hybrid, "cpu:threads=1", gpu1, Transfer::Move, 8),
            config(Mode::Hybrid, gpu1, gpu1, Transfer::Move, 8),
        ],
    );
}

/// GPU 0 prefills for GPU 1 under load: four times the fixture's prompts submitted at once,
/// eight decoding at a time, GPU 1's K/V cache too small for all of them (sequences wait for
/// room or are swapped out to host memory). Every request's greedy tokens are those it gets
/// alone in the same placement, and every block and state slot comes back. Ignored by default
/// (it needs two NVIDIA GPUs).
#[test]
#[ignore = "needs two NVIDIA GPUs: run with --include-ignored on such a machine"]
fn cuda_0_to_cuda_1_under_load_gives_each_request_its_tokens_alone() {
    use tandem_core::backend::cuda::qwen35::kv_cache::KV_BLOCK;
    gpus_at_least(2);
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = (0..4).flat_map(|_| reference_prompts()).map(|c| c.0).collect();
    let (max_tokens, blocks) = (48, 24);
    let placement = config(Mode::Hybrid, "cuda:0,precision=exact", "cuda:1,precision=exact", Transfer::Move, 8);
    let alone_config = PipelineConfig { max_batch: 1, ..placement.clone() };
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| run_pipeline(&m.net, &alone_config, std::slice::from_ref(p), max_tokens).remove(0)).collect();
    let c = PipelineConfig { kv_cache: KvBudget::Bytes(blocks * KV_BLOCK * m.net.config.kv_bytes_per_token()), ..placement };
    let (got, swaps, blocks_left, slots_left) = pipeline::run(&m.net, &c, |p| {
        let out = submit_all(p, &prompts, max_tokens)?;
        let waited = std::time::Instant::now();
        while (p.kv_level().unwrap().used > 1 || p.slot_level().unwrap().used > 1) && waited.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        Ok((out, p.swaps(), p.kv_level().unwrap().used, p.slot_level().unwrap().used))
    })
    .unwrap();
    for (i, (g, want)) in got.iter().zip(&alone).enumerate() {
        assert_eq!(g, want, "request {i} differs from its run alone");
    }
    eprintln!("cuda:0 -> cuda:1 under load: {} sequences swapped out, {} back", swaps.0, swaps.1);
    assert_eq!(swaps.0, swaps.1, "sequences swapped out and never back");
    // What is left: the batched step's padding rows' block and state slot.
    assert!(blocks_left <= 1 && slots_left <= 1, "{blocks_left} K/V blocks and {slots_left} state slots still in use");
}

/// Fail the test, saying why, where fewer than `n` GPUs are found.
fn gpus_at_least(n: usize) {
    match tandem_core::backend::cuda::gpu_count() {
        Ok(found) => assert!(found >= n, "this test needs {n} GPUs; the driver reports {found}"),
        Err(why) => panic!("this test needs {n} GPUs: {why:#}"),
    }
}

/// Every placement of `configs` gives the reference's greedy tokens for every fixture prompt;
/// the failures are listed together.
fn assert_placements_give_the_reference_tokens(m: &LoadedModel, configs: &[PipelineConfig]) {
    let cases = reference_prompts();
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| c.0.clone()).collect();
    let mut failures = Vec::new();
    for c in configs {
        let got = run_pipeline(&m.net, c, &prompts, 16);
        for (i, (g, (_, want))) in got.iter().zip(&cases).enumerate() {
            if g != want {
                failures.push(format!("{:?} {} -> {} via {:?}, batch {}: prompt p{i}: {g:?}, want {want:?}", c.mode, c.prefill, c.decode, c.transfer, c.max_batch));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The decode engine starts from the prefilled state's logits and applies only sampled
/// tokens. Applying the last prompt token a second time (the bug vLLM shipped) changes the
/// continuation, so the comparison above would catch it.
#[test]
fn the_handoff_never_applies_a_prompt_token_twice() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let pool = Pool::new(1);
    for (prompt, want) in reference_prompts() {
        let mut st = State::new(&m.net.config);
        m.net.forward(&pool, &prompt, &mut st, Logits::Last).unwrap();
        assert_eq!(st.position, prompt.len(), "the state covers exactly the prompt");
        // Correct: the first token comes from the carried logits.
        assert_eq!(argmax(&st.last_logits), want[0]);
        // Wrong: re-apply the last prompt token, then continue greedily.
        m.net.forward(&pool, &prompt[prompt.len() - 1..], &mut st, Logits::Last).unwrap();
        let mut wrong = Vec::new();
        for _ in 0..16 {
            let id = argmax(&st.last_logits);
            wrong.push(id);
            m.net.forward(&pool, &[id], &mut st, Logits::Last).unwrap();
        }
        assert_ne!(wrong, want, "a double-applied token must change the continuation");
    }
}

fn prefilled(m: &LoadedModel, n: usize) -> State {
    let mut st = State::new(&m.net.config);
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 53 + 3) % 1024).collect();
    m.net.forward(&Pool::new(1), &tokens, &mut st, Logits::Last).unwrap();
    st
}

#[test]
fn bridge_round_trips_are_exact_for_files_and_streams() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let fp = m.net.fingerprint();
    let dir = common::scratch("bridge-exact");
    for n in [1, 64, 300] {
        let st = prefilled(&m, n);
        let path = dir.join(format!("{n}.state"));
        bridge::file::save(&path, &st, fp).unwrap();
        let (back, _, _) = bridge::file::load(&path, fp, &m.net.config, None).unwrap();
        assert!(back == st, "file round trip at {n} tokens");
        // Rebuilt into the buffers of another state (longer and shorter K/V than this one).
        for other in [7, 301] {
            let (back, _, _) = bridge::file::load(&path, fp, &m.net.config, Some(prefilled(&m, other))).unwrap();
            assert!(back == st, "file round trip at {n} tokens into a recycled {other}-token state");
        }
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let sender = std::thread::spawn({
            let st = st.clone();
            move || bridge::socket::send(&mut a, &st, fp).unwrap()
        });
        let (back, _, _) = bridge::socket::receive(&mut b, fp, &m.net.config, Some(prefilled(&m, 5))).unwrap();
        sender.join().unwrap();
        assert!(back == st, "socket round trip at {n} tokens");
    }
    // A fresh state (no logits yet) travels too.
    let fresh = State::new(&m.net.config);
    let path = dir.join("fresh.state");
    bridge::file::save(&path, &fresh, fp).unwrap();
    assert!(bridge::file::load(&path, fp, &m.net.config, None).unwrap().0 == fresh);
}

/// The pipeline's file transfer: a state prefilled in a state file (its recurrent states and
/// conv windows in place), handed over with `write_shared`, read in place: bit for bit the
/// state prefilled in memory; the file is free again once the reader's state is dropped; a byte
/// changed in a recurrent state in the file is caught by the reader's checksum.
#[test]
fn a_state_prefilled_in_its_file_is_read_in_place_exactly() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let fp = m.net.fingerprint();
    let dir = common::scratch("bridge-in-place");
    let mut file = Arc::new(bridge::file::StateFile::create(&dir.join("in-place.state")).unwrap());
    for n in [1, 64, 300] {
        let want = prefilled(&m, n);
        let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 53 + 3) % 1024).collect();
        let mut st = bridge::file::state_in_file(&mut file, &m.net.config, n, fp).unwrap();
        assert!(st.in_file());
        m.net.forward(&Pool::new(1), &tokens, &mut st, Logits::Last).unwrap();
        unsafe { file.write_shared(&st, fp) }.unwrap();
        drop(st);
        let (back, _, _) = bridge::file::read_file(&file, fp, &m.net.config, Some(prefilled(&m, 3)), true).unwrap();
        assert!(back.in_file() && back == want, "{n} tokens");
        // Decoding goes on in the file, as it does from a state in memory.
        let (mut a, mut b) = (back, want);
        m.net.forward(&Pool::new(1), &[17], &mut a, Logits::Last).unwrap();
        m.net.forward(&Pool::new(1), &[17], &mut b, Logits::Last).unwrap();
        assert!(a == b, "a decode step on the state in the file, {n} tokens");
        assert!(Arc::get_mut(&mut file).is_none(), "the state holds its file");
        let owned = a.into_owned();
        assert!(!owned.in_file() && owned == b);
        assert!(Arc::get_mut(&mut file).is_some(), "the file is free once no state holds it");
    }
    // A flipped bit inside a recurrent state: refused.
    let mut st = bridge::file::state_in_file(&mut file, &m.net.config, 64, fp).unwrap();
    m.net.forward(&Pool::new(1), &(0..64).collect::<Vec<u32>>(), &mut st, Logits::Last).unwrap();
    unsafe { file.write_shared(&st, fp) }.unwrap();
    let tandem_core::state::LayerState::Linear { recurrent, .. } = &mut st.layers[0] else { panic!("layer 0 is a DeltaNet layer") };
    recurrent[5] += 1.0;
    drop(st);
    let e = format!("{:#}", bridge::file::read_file(&file, fp, &m.net.config, None, true).unwrap_err());
    assert!(e.contains("payload checksum"), "{e}");
}

#[test]
fn bad_state_files_are_refused_with_the_reason() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let fp = m.net.fingerprint();
    let dir = common::scratch("bridge-bad");
    let path = dir.join("good.state");
    bridge::file::save(&path, &prefilled(&m, 70), fp).unwrap();
    let good = std::fs::read(&path).unwrap();
    let try_bytes = |name: &str, bytes: &[u8]| -> String {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        let e = bridge::file::load(&p, fp, &m.net.config, None).err().unwrap_or_else(|| panic!("{name} was accepted"));
        format!("{e:#}")
    };
    let mut corrupt = good.clone();
    let at = good.len() - 5000;
    corrupt[at] ^= 1;
    assert!(try_bytes("corrupt.state", &corrupt).contains("payload checksum"));
    let mut header = good.clone();
    header[33] ^= 1; // the position
    assert!(try_bytes("header.state", &header).contains("header checksum"));
    assert!(try_bytes("truncated.state", &good[..good.len() / 2]).contains("truncated"));
    assert!(try_bytes("stub.state", &good[..40]).contains("truncated"));
    let mut version = good.clone();
    version[8] = 9;
    assert!(try_bytes("version.state", &version).contains("version 9"));
    assert!(try_bytes("text.state", b"hello, this is not a state file at all, not even close to one; it is text").contains("not a tandem state"));
    // Another model: the same file, read for a model with another fingerprint.
    let e = format!("{:#}", bridge::file::load(&path, fp ^ 1, &m.net.config, None).unwrap_err());
    assert!(e.contains("another model"), "{e}");
    // A state of the right model but for other shapes (a config with fewer layers).
    let mut cfg = m.net.config.clone();
    cfg.layer_types.pop();
    let e = format!("{:#}", bridge::file::load(&path, fp, &cfg, None).unwrap_err());
    assert!(e.contains("layers"), "{e}");
}

/// A state file cut short or rewritten while it is being loaded (another process's doing) is
/// refused with the reason, or read whole as saved: never a crash (a mapped file kills its
/// reader with SIGBUS at the first page past a new end).
#[test]
fn a_state_file_truncated_while_it_is_loaded_is_refused_never_a_crash() {
    use std::sync::atomic::Ordering;
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let fp = m.net.fingerprint();
    let path = common::scratch("bridge-truncating").join("cut.state");
    // Long enough (a few MB of K/V) that a load takes a while to read it.
    let saved = prefilled(&m, 3000);
    bridge::file::save(&path, &saved, fp).unwrap();
    let good = std::fs::read(&path).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let cutter = {
        let (path, stop, good) = (path.clone(), Arc::clone(&stop), good.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // Cut to a third, grow back with zeros, write it whole again.
                let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                f.set_len(if i.is_multiple_of(3) { good.len() as u64 / 3 } else { good.len() as u64 }).unwrap();
                if i % 3 == 2 {
                    std::fs::write(&path, &good).unwrap();
                }
                i += 1;
            }
        })
    };
    let (mut whole, mut refused) = (0, 0);
    for _ in 0..300 {
        match bridge::file::load(&path, fp, &m.net.config, None) {
            Ok((back, _, _)) => {
                assert!(back == saved, "a state loaded from the file differs from the one saved");
                whole += 1;
            }
            Err(e) => {
                let e = format!("{e:#}");
                assert!(["truncated", "checksum", "not a tandem state"].iter().any(|w| e.contains(w)), "{e}");
                refused += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    cutter.join().unwrap();
    eprintln!("300 loads while the file changed: {whole} whole, {refused} refused");
    assert!(refused > 0, "the file was never seen damaged: nothing was tested");
    // Whole again, it loads as saved.
    std::fs::write(&path, &good).unwrap();
    assert!(bridge::file::load(&path, fp, &m.net.config, None).unwrap().0 == saved);
}

/// bf16 and int8 forms of one checkpoint share a fingerprint (a state made by one can be
/// decoded by the other); another checkpoint does not.
#[test]
fn fingerprints_follow_the_checkpoint_not_the_quantization() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let q = LoadedModel::load_int8(common::tiny_dir().to_str().unwrap(), &Pool::new(1)).unwrap();
    assert_eq!(m.net.fingerprint(), q.net.fingerprint());
    let mut other = m.net.clone();
    other.map_matrices(|w| w.clone());
    assert_eq!(other.fingerprint(), m.net.fingerprint());
    let mut cfg_changed = m.net.config.clone();
    cfg_changed.rms_norm_eps *= 2.0;
    assert_ne!(format!("{cfg_changed:?}"), format!("{:?}", m.net.config));
}

/// A prefill in several dispatches counts its padding, and ends with the state and last
/// logits of one call (only its last dispatch computes logits).
#[test]
fn batched_dispatch_counts_its_padding() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tokens: Vec<u32> = (0..74).collect();
    let mut one = State::new(&m.net.config);
    m.net.forward(&Pool::new(1), &tokens, &mut one, Logits::Last).unwrap();
    for (spec, dispatch, dispatches, padded) in [("cpu:threads=1,dispatch=batched:32", Dispatch::Batched(32), 3, 22), ("cpu:threads=1,dispatch=sequential", Dispatch::Sequential, 74, 0)] {
        let engine = tandem_core::engine::Engine::new(&EngineSpec::parse(spec).unwrap(), &m.net).unwrap();
        assert_eq!(engine.spec.dispatch, dispatch);
        let mut st = engine.new_state().unwrap();
        let stats = engine.prefill(&tokens, &mut st).unwrap();
        assert_eq!((stats.tokens, stats.dispatches, stats.padded_rows), (74, dispatches, padded), "{spec}");
        assert_eq!(st.position(), 74);
        assert!(st.into_host().unwrap() == one, "{spec}: another state or last logits than one call");
    }
}

/// A request cancelled while it waits for the prefill engine is answered without being
/// prefilled; the engines' busy time counts the work they did.
#[test]
fn a_request_cancelled_in_the_queue_is_never_prefilled() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    for mode in [Mode::Hybrid, Mode::AllOnDecodeEngine] {
        let c = config(mode, "cpu:threads=1", "cpu:threads=1", Transfer::Move, 4);
        pipeline::run(&m.net, &c, |p| {
            let (tx, rx) = channel();
            let cancelled = request(1, vec![5; 40], 8, tx.clone());
            cancelled.cancel.store(true, std::sync::atomic::Ordering::Relaxed);
            p.submit(cancelled)?;
            p.submit(request(2, vec![6; 12], 3, tx))?;
            let mut tokens = [0, 0];
            for e in rx {
                match e {
                    Event::Token { id, .. } => tokens[id as usize - 1] += 1,
                    Event::Done { id: 1, finish, timings, .. } => {
                        assert_eq!((finish, timings.prefill.tokens), (Finish::Cancelled, 0), "{mode:?}");
                    }
                    Event::Done { id: 2, finish, .. } => assert_eq!(finish, Finish::Length),
                    Event::Done { .. } => unreachable!(),
                    Event::Failed { error, .. } => panic!("{error}"),
                    Event::Snapshot { .. } => {}
                }
            }
            assert_eq!(tokens, [0, 3], "{mode:?}");
            let (prefill, decode) = p.busy();
            assert!(prefill > std::time::Duration::ZERO && decode > std::time::Duration::ZERO, "{mode:?}: busy {prefill:?} {decode:?}");
            Ok(())
        })
        .unwrap();
    }
}

/// A CPU decode engine under a memory budget (`--kv-cache-memory` with a CPU decode engine):
/// 24 blocks of 16 positions (the longest prompt and its reply alone fit) and two state slots
/// a running sequence. Requests wait for room, running sequences are swapped out to files on
/// disk and back, and every request's greedy tokens are bit for bit those it gets alone in the
/// same placement; once all are answered every block and slot is back. One engine (whole
/// prompts, and 20 prompt tokens a step), and two CPU engines (states moved, and through files).
#[test]
fn a_cpu_budget_swaps_sequences_to_disk_and_keeps_their_tokens() {
    use tandem_core::backend::cuda::qwen35::kv_cache::KV_BLOCK;
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = reference_prompts().into_iter().chain(reference_prompts()).map(|c| c.0).collect();
    let (max_tokens, blocks) = (64, 24);
    assert!(prompts.iter().all(|p| (p.len() + max_tokens).div_ceil(KV_BLOCK) <= blocks), "a request that cannot fit alone");
    let budget = KvBudget::Bytes(blocks * KV_BLOCK * m.net.config.kv_bytes_per_token());
    let one = "cpu:threads=2";
    let (prefill, decode) = ("cpu:threads=1", "cpu:threads=1");
    let files = Transfer::File(std::env::temp_dir());
    let configs = [
        config(Mode::AllOnDecodeEngine, one, one, Transfer::Move, 4),
        PipelineConfig { max_prefill_tokens: 20, ..config(Mode::AllOnDecodeEngine, one, one, Transfer::Move, 4) },
        config(Mode::Hybrid, prefill, decode, Transfer::Move, 4),
        config(Mode::Hybrid, prefill, decode, files, 4),
    ];
    for c in configs {
        let alone: Vec<Vec<u32>> = prompts.iter().map(|p| run_pipeline(&m.net, &PipelineConfig { max_batch: 1, ..c.clone() }, std::slice::from_ref(p), max_tokens).remove(0)).collect();
        let c = PipelineConfig { kv_cache: budget, ..c };
        let (got, swaps, kv, slots) = pipeline::run(&m.net, &c, |p| {
            let capacity = p.kv_capacity().expect("a CPU budget reports its capacity");
            assert_eq!((capacity.device, capacity.blocks, capacity.slots), (Device::Cpu, blocks, 2 * c.max_batch));
            assert!(capacity.describe(c.max_batch).starts_with("cpu: up to 4 sequences decoding; K/V cache"), "{}", capacity.describe(c.max_batch));
            let rx = submit(p, &prompts, max_tokens)?;
            let mut out = vec![Vec::new(); prompts.len()];
            let mut peak = 0;
            for e in rx {
                let level = p.kv_level().unwrap();
                assert!(level.used <= blocks, "{} blocks held, over the budget of {blocks}", level.used);
                peak = peak.max(p.slot_level().unwrap().used);
                match e {
                    Event::Token { id, token, .. } => out[id as usize].push(token),
                    Event::Done { finish, .. } => assert_eq!(finish, Finish::Length),
                    Event::Failed { id, error } => panic!("{:?}: request {id} failed: {error}", c.mode),
                    Event::Snapshot { .. } => {}
                }
            }
            assert!(peak <= 2 * c.max_batch, "{peak} slots held");
            // A finished sequence's lease goes back just after its last event: wait for it.
            let waited = std::time::Instant::now();
            while (p.kv_level().unwrap().used > 0 || p.slot_level().unwrap().used > 0) && waited.elapsed() < std::time::Duration::from_secs(10) {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Ok((out, p.swaps(), p.kv_level().unwrap(), p.slot_level().unwrap()))
        })
        .unwrap();
        for (i, (g, want)) in got.iter().zip(&alone).enumerate() {
            assert_eq!(g, want, "{:?} {} -> {}: request {i} differs from its run alone", c.mode, c.prefill, c.decode);
        }
        eprintln!("{:?} {} -> {} ({}): {} sequences swapped out, {} back", c.mode, c.prefill, c.decode, c.transfer.name(), swaps.0, swaps.1);
        assert!(swaps.0 == swaps.1 && (swaps.0 > 0 || c.mode == Mode::Hybrid), "{:?}: {swaps:?} swaps out and in", c.mode);
        assert_eq!((kv.used, slots.used), (0, 0), "blocks and slots still held after every request finished");
    }
    // A budget in a fraction of a GPU's memory, or too small for one block, is refused.
    for (kv_cache, says) in [(KvBudget::GpuFraction(0.5), "give its budget in bytes with --kv-cache-memory"), (KvBudget::Bytes(100), "less than one K/V block")] {
        let c = PipelineConfig { kv_cache, ..config(Mode::AllOnDecodeEngine, one, one, Transfer::Move, 4) };
        let e = pipeline::run(&m.net, &c, |_| Ok(())).unwrap_err();
        assert!(format!("{e:#}").contains(says), "{e:#}");
    }
}

/// A K/V cache too small for every request at once (24 blocks of 16 positions: the longest
/// prompt and its reply alone fit): requests wait for room, sequences are swapped out to host
/// memory and back, and every request's greedy tokens are those it gets alone; once all are
/// answered the blocks are back in the pool. One engine (whole prompts, and 20 prompt tokens a
/// step), two engines sharing the GPU's pool, and a CPU prefill engine whose states wait in
/// host memory for room. Ignored by default (it needs an NVIDIA GPU).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn a_small_kv_cache_swaps_sequences_and_keeps_their_tokens() {
    use tandem_core::backend::cuda::qwen35::kv_cache::KV_BLOCK;
    gpus_at_least(1);
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = reference_prompts().into_iter().chain(reference_prompts()).map(|c| c.0).collect();
    let gpu = "cuda:0,precision=exact";
    let (max_tokens, blocks) = (64, 24);
    assert!(prompts.iter().all(|p| (p.len() + max_tokens).div_ceil(KV_BLOCK) <= blocks), "a request that cannot fit alone");
    // Each request alone, prefilled on the GPU and on the CPU.
    let solo = |prefill: &str| -> Vec<Vec<u32>> { prompts.iter().map(|p| run_pipeline(&m.net, &config(Mode::Hybrid, prefill, gpu, Transfer::Move, 1), std::slice::from_ref(p), max_tokens).remove(0)).collect() };
    let (alone_gpu, alone_cpu) = (solo(gpu), solo("cpu:threads=2"));
    let budget = KvBudget::Bytes(blocks * KV_BLOCK * m.net.config.kv_bytes_per_token());
    let chunked = PipelineConfig { max_prefill_tokens: 20, ..config(Mode::AllOnDecodeEngine, gpu, gpu, Transfer::Move, 8) };
    // The CPU prefills faster than the GPU decodes: its states wait on the host for room.
    let from_cpu = config(Mode::Hybrid, "cpu:threads=2", gpu, Transfer::Move, 8);
    for c in [config(Mode::AllOnDecodeEngine, gpu, gpu, Transfer::Move, 8), config(Mode::Hybrid, gpu, gpu, Transfer::Move, 8), chunked, from_cpu] {
        let c = PipelineConfig { kv_cache: budget, ..c };
        let alone = if c.prefill.device == Device::Cpu { &alone_cpu } else { &alone_gpu };
        let (got, swaps, level) = pipeline::run(&m.net, &c, |p| {
            assert_eq!(p.kv_capacity().map(|k| k.blocks), Some(blocks));
            let out = submit_all(p, &prompts, max_tokens)?;
            // A finished sequence's blocks come back just after its last event: wait for them.
            let waited = std::time::Instant::now();
            while p.kv_level().unwrap().used > 1 && waited.elapsed() < std::time::Duration::from_secs(10) {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            assert_eq!(p.kv_capacity().map(|k| k.slots), Some(2 * c.max_batch + 1), "state slots: the running sequences, as many prefilled ahead, the padding rows'");
            // What is left: the padding rows' state.
            let slots = p.slot_level().unwrap();
            assert!(slots.used <= 1 && slots.limit == Some(2 * c.max_batch + 1), "{:?}: {} state slots still in use of {:?}", c.mode, slots.used, slots.limit);
            Ok((out, p.swaps(), p.kv_level().unwrap()))
        })
        .unwrap();
        for (i, (g, want)) in got.iter().zip(alone).enumerate() {
            assert_eq!(g, want, "{:?} {}: request {i} differs from its run alone", c.mode, c.prefill);
        }
        eprintln!("{:?} {}: {} sequences swapped out, {} back; {} blocks in use at the end", c.mode, c.prefill, swaps.0, swaps.1, level.used);
        assert!(swaps.0 == swaps.1 && (swaps.0 > 0 || c.prefill.device == Device::Cpu), "{:?} {}: {swaps:?} swaps out and in", c.mode, c.prefill);
        // What is left: the block of the batched step's padding rows.
        assert!(level.used <= 1, "{:?}: {} blocks still in use", c.mode, level.used);
    }
}

/// Recurrent states kept in bf16 (`state=bf16`): each request's greedy tokens among others are
/// its tokens run alone in the same placement: packed prefills and batched steps on one GPU,
/// chunked prefill on one engine, and CPU prefill with the state rounded to bf16 as it goes to
/// the GPU. Ignored by default (it needs an NVIDIA GPU).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn bf16_states_give_each_request_its_tokens_alone() {
    gpus_at_least(1);
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = reference_prompts().into_iter().map(|c| c.0).collect();
    let gpu = "cuda:0,precision=exact,state=bf16";
    let configs = [
        config(Mode::Hybrid, gpu, gpu, Transfer::Move, 8),
        PipelineConfig { max_prefill_tokens: 20, ..config(Mode::AllOnDecodeEngine, gpu, gpu, Transfer::Move, 8) },
        config(Mode::Hybrid, "cpu:threads=2", gpu, Transfer::Move, 8),
    ];
    for c in configs {
        let together = run_pipeline(&m.net, &c, &prompts, 24);
        let alone_config = PipelineConfig { max_batch: 1, ..c.clone() };
        for (i, p) in prompts.iter().enumerate() {
            let alone = run_pipeline(&m.net, &alone_config, std::slice::from_ref(p), 24).remove(0);
            assert_eq!(together[i], alone, "{:?} {} -> {}: prompt p{i} differs from its run alone", c.mode, c.prefill, c.decode);
        }
    }
}

/// Under a memory budget the state slots bound the requests in flight: with two decoding at a
/// time, the GPU prefill engine sharing the decode engine's pools prefills at most two more
/// ahead and then waits for a slot (the pool reaches its limit of five, the padding rows'
/// state among them); every request still gets its tokens alone, and every slot but the
/// padding rows' comes back. Ignored by default (it needs an NVIDIA GPU).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn state_slots_bound_the_requests_in_flight() {
    gpus_at_least(1);
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let prompts: Vec<Vec<u32>> = (0..3).flat_map(|_| reference_prompts()).map(|c| c.0).collect();
    let gpu = "cuda:0,precision=exact";
    let max_tokens = 24;
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| run_pipeline(&m.net, &config(Mode::Hybrid, gpu, gpu, Transfer::Move, 1), std::slice::from_ref(p), max_tokens).remove(0)).collect();
    let c = PipelineConfig { kv_cache: KvBudget::Bytes(64 << 20), ..config(Mode::Hybrid, gpu, gpu, Transfer::Move, 2) };
    let (got, peak, level) = pipeline::run(&m.net, &c, |p| {
        assert_eq!(p.kv_capacity().map(|k| k.slots), Some(5));
        let rx = submit(p, &prompts, max_tokens)?;
        let (mut out, mut peak) = (vec![Vec::new(); prompts.len()], 0);
        for e in rx {
            peak = peak.max(p.slot_level().unwrap().used);
            match e {
                Event::Token { id, token, .. } => out[id as usize].push(token),
                Event::Done { finish, .. } => assert_eq!(finish, Finish::Length),
                Event::Failed { id, error } => panic!("request {id} failed: {error}"),
                Event::Snapshot { .. } => {}
            }
        }
        let waited = std::time::Instant::now();
        while p.slot_level().unwrap().used > 1 && waited.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        Ok((out, peak, p.slot_level().unwrap()))
    })
    .unwrap();
    for (i, (g, want)) in got.iter().zip(&alone).enumerate() {
        assert_eq!(g, want, "request {i} differs from its run alone");
    }
    eprintln!("state slots: at most {peak} of 5 in use, {} at the end", level.used);
    assert_eq!(peak, 5, "the prefill engine never waited for a slot");
    assert_eq!(level.used, 1, "slots still held after every request finished (the padding rows' one stays)");
}

/// Each choice's tokens when a prompt is decoded as one request with forks (OpenAI's `n`) beside
/// the fixture's other prompts: request 0 is the forked one (its forks ids 100, 101, ...,
/// seeded one further each), requests 1.. the others. Every token must carry log-probabilities.
fn run_forked(net: &Qwen35, config: &PipelineConfig, prompt: &[u32], others: &[Vec<u32>], sampling: &SamplingParams, forks: usize, max_tokens: usize) -> std::collections::HashMap<u64, Vec<u32>> {
    use tandem_core::pipeline::Fork;
    pipeline::run(net, config, |p| {
        let (tx, rx) = channel();
        let mut forked = request(0, prompt.to_vec(), max_tokens, tx.clone());
        forked.sampling = sampling.clone();
        forked.forks = (1..=forks as u64).map(|k| Fork { id: 99 + k, seed: sampling.seed + k, cancel: Arc::new(AtomicBool::new(false)) }).collect();
        p.submit(forked)?;
        for (i, o) in others.iter().enumerate() {
            p.submit(request(i as u64 + 1, o.clone(), max_tokens, tx.clone()))?;
        }
        drop(tx);
        let mut out: std::collections::HashMap<u64, Vec<u32>> = Default::default();
        for e in rx {
            match e {
                Event::Token { id, token, logprobs } => {
                    if id == 0 || id >= 100 {
                        let l = logprobs.unwrap_or_else(|| panic!("choice {id}: a token without its log-probabilities"));
                        assert!(l.token == token && l.logprob <= 0.0 && l.top.len() == 2, "{l:?}");
                    }
                    out.entry(id).or_default().push(token)
                }
                Event::Done { id, finish, .. } => assert_eq!(finish, Finish::Length, "choice {id}"),
                Event::Failed { id, error } => panic!("request {id} failed: {error}"),
                Event::Snapshot { .. } => {}
            }
        }
        Ok(out)
    })
    .unwrap()
}

/// Check `n` choices of one prompt in `configs`: each choice's tokens are those the prompt gets
/// alone with that choice's seed (and no log-probabilities asked for).
fn check_forks(net: &Qwen35, configs: &[PipelineConfig]) {
    let prompts: Vec<Vec<u32>> = reference_prompts().into_iter().map(|c| c.0).collect();
    let (prompt, others) = (&prompts[3], &prompts[..3]);
    let sampling = SamplingParams { temperature: 0.9, top_p: 0.95, seed: 40, logprobs: Some(2), ..Default::default() };
    let max_tokens = 24;
    for c in configs {
        let forks = 3;
        let alone: Vec<Vec<u32>> = (0..=forks as u64)
            .map(|k| {
                let solo = SamplingParams { seed: sampling.seed + k, logprobs: None, ..sampling.clone() };
                pipeline::run(net, &PipelineConfig { max_batch: 1, ..c.clone() }, |p| {
                    let (tx, rx) = channel();
                    let mut r = request(0, prompt.clone(), max_tokens, tx);
                    r.sampling = solo;
                    p.submit(r)?;
                    Ok(rx.into_iter().filter_map(|e| match e {
                        Event::Token { token, .. } => Some(token),
                        _ => None,
                    }).collect())
                })
                .unwrap()
            })
            .collect();
        assert!(alone.iter().skip(1).any(|a| a != &alone[0]), "the seeds give different choices");
        let got = run_forked(net, c, prompt, others, &sampling, forks, max_tokens);
        for (k, want) in alone.iter().enumerate() {
            let id = if k == 0 { 0 } else { 99 + k as u64 };
            assert_eq!(got.get(&id), Some(want), "{:?} {} -> {}: choice {k} differs from its request alone", c.mode, c.prefill, c.decode);
        }
        assert_eq!(got.len(), forks + 1 + others.len(), "every request and choice answered");
    }
}

/// n choices from one prompt: the prompt is prefilled once and its state copied for each
/// choice, which then decodes as the request alone with its seed, in the batch beside other
/// requests: in one engine, two, and under a memory budget too small for all of them at once
/// (a copy waits for room with the swapped-out sequences).
#[test]
fn forked_choices_decode_as_their_requests_alone() {
    use tandem_core::backend::cuda::qwen35::kv_cache::KV_BLOCK;
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let budget = KvBudget::Bytes(10 * KV_BLOCK * m.net.config.kv_bytes_per_token());
    check_forks(&m.net, &[
        config(Mode::Hybrid, "cpu:threads=1", "cpu:threads=1", Transfer::Move, 8),
        config(Mode::AllOnDecodeEngine, "cpu:threads=2", "cpu:threads=2", Transfer::Move, 8),
        PipelineConfig { kv_cache: budget, ..config(Mode::Hybrid, "cpu:threads=1", "cpu:threads=1", Transfer::Move, 8) },
        PipelineConfig { kv_cache: budget, max_prefill_tokens: 20, ..config(Mode::AllOnDecodeEngine, "cpu:threads=2", "cpu:threads=2", Transfer::Move, 8) },
    ]);
}

/// As `forked_choices_decode_as_their_requests_alone` on a GPU: the copies made on the GPU
/// (and, with a small K/V cache, in host memory first). Ignored by default (it needs an NVIDIA
/// GPU).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn forked_choices_on_a_gpu_decode_as_their_requests_alone() {
    gpus_at_least(1);
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let gpu = "cuda:0,precision=exact";
    check_forks(&m.net, &[
        config(Mode::Hybrid, gpu, gpu, Transfer::Move, 8),
        config(Mode::Hybrid, "cpu:threads=2", gpu, Transfer::Move, 8),
        PipelineConfig { kv_cache: KvBudget::Bytes(48 << 20), ..config(Mode::Hybrid, gpu, gpu, Transfer::Move, 8) },
    ]);
}
