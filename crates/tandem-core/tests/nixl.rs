//! The state through NIXL (UCX over TCP, two agents in this process): written into the slot a
//! receiver reserved, it arrives bit for bit and decodes as the state that was sent; a state of
//! another model, another length, or with a byte changed on the way is refused; a released
//! slot cannot be written. On a GPU (ignored elsewhere): a GPU state moved GPU memory to GPU
//! memory, piece by piece, restores bit for bit and decodes as the original; a mismatched one is
//! refused. Needs the NIXL libraries (`eval "$(scripts/nixl.sh)"`).
#![cfg(feature = "nixl")]

mod common;

use std::time::Duration;

use tandem_core::backend::cpu::pool::Pool;
use tandem_core::bridge::nixl::{Receiver, Sender, tcp};
use tandem_core::model::load::LoadedModel;
use tandem_core::model::Logits;
use tandem_core::sampling::argmax;
use tandem_core::state::State;

const TIMEOUT: Duration = Duration::from_secs(20);

fn prefilled(m: &LoadedModel, n: usize) -> State {
    let mut st = State::new(&m.net.config);
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 53 + 3) % 1024).collect();
    m.net.forward(&Pool::new(1), &tokens, &mut st, Logits::Last).unwrap();
    st
}

/// Greedy tokens decoded from `state`.
fn greedy(m: &LoadedModel, mut state: State, n: usize) -> Vec<u32> {
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&state.last_logits) as u32;
        out.push(t);
        m.net.forward(&Pool::new(1), &[t], &mut state, Logits::Last).unwrap();
    }
    out
}

#[test]
fn states_written_through_nixl_arrive_exactly_and_bad_ones_are_refused() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let (fp, cfg) = (m.net.fingerprint(), &m.net.config);
    let pid = std::process::id();
    let mut receiver = Receiver::new(&format!("test-decode-{pid}"), Some(tcp())).unwrap();
    let mut sender = Sender::new(&format!("test-prefill-{pid}"), Some(tcp())).unwrap();

    // Exact, at several lengths; the later slots reuse memory of the earlier ones, and a
    // longer state makes the receiver register more (the sender reloads its metadata).
    for n in [1, 64, 300, 64] {
        let st = prefilled(&m, n);
        let ticket = receiver.reserve_for_prompt(cfg, n).unwrap();
        // The ticket crosses processes as JSON.
        let ticket = serde_json::from_str(&serde_json::to_string(&ticket).unwrap()).unwrap();
        sender.send(&ticket, &st, fp, TIMEOUT).unwrap();
        receiver.wait(ticket.slot, TIMEOUT).unwrap();
        let (back, _, _) = receiver.take(ticket.slot, fp, cfg, n, Some(prefilled(&m, 5))).unwrap();
        assert!(back == st, "{n} tokens through NIXL");
        assert_eq!(greedy(&m, back, 8), greedy(&m, st, 8), "greedy tokens after {n} tokens through NIXL");
    }
    assert_eq!(receiver.reserved(), 0, "every slot taken is freed");

    // A state of another model: refused, naming the reason; the slot is freed.
    let st = prefilled(&m, 10);
    let ticket = receiver.reserve_for_prompt(cfg, 10).unwrap();
    sender.send(&ticket, &st, fp ^ 1, TIMEOUT).unwrap();
    receiver.wait(ticket.slot, TIMEOUT).unwrap();
    let err = format!("{:#}", receiver.take(ticket.slot, fp, cfg, 10, None).unwrap_err());
    assert!(err.contains("another model"), "{err}");
    assert_eq!(receiver.reserved(), 0);

    // A state of another length than the request's: refused.
    let ticket = receiver.reserve_for_prompt(cfg, 11).unwrap();
    sender.send(&ticket, &st, fp, TIMEOUT).unwrap();
    receiver.wait(ticket.slot, TIMEOUT).unwrap();
    let err = format!("{:#}", receiver.take(ticket.slot, fp, cfg, 11, None).unwrap_err());
    assert!(err.contains("holds 10 tokens, the request 11"), "{err}");

    // A byte changed in a recurrent state on the way (the slot is memory of this process, so
    // the test can play the faulty link): the payload checksum refuses it.
    let ticket = receiver.reserve_for_prompt(cfg, 10).unwrap();
    sender.send(&ticket, &st, fp, TIMEOUT).unwrap();
    receiver.wait(ticket.slot, TIMEOUT).unwrap();
    let (addr, len) = ticket.host().expect("a host slot");
    // SAFETY: the slot is registered memory of this process, `len` bytes, not in use.
    let slot = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) };
    slot[4096] ^= 0x10;
    let err = format!("{:#}", receiver.take(ticket.slot, fp, cfg, 10, None).unwrap_err());
    assert!(err.contains("checksum"), "{err}");

    // A state too long for the slot is not sent.
    let ticket = receiver.reserve_for_prompt(cfg, 10).unwrap();
    let long = prefilled(&m, 10 + ticket.host().unwrap().1 as usize / 1000);
    let err = format!("{:#}", sender.send(&ticket, &long, fp, TIMEOUT).unwrap_err());
    assert!(err.contains("does not fit"), "{err}");
    // A released slot: a late write to it (a sender thought dead) lands in memory that no
    // other request is given, and is never reported as a state.
    assert!(receiver.release(ticket.slot));
    sender.send(&ticket, &st, fp, TIMEOUT).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(receiver.poll().unwrap().is_empty(), "a state in a released slot is not reported");
    let err = format!("{:#}", receiver.wait(ticket.slot, Duration::from_millis(10)).unwrap_err());
    assert!(err.contains("not reserved"), "{err}");
    let next = receiver.reserve_for_prompt(cfg, 10).unwrap();
    assert_ne!(next.host(), ticket.host(), "a released slot's memory is not reused at once");
    assert!(receiver.release(next.slot));
    // A slot whose state never comes: waiting ends with an error at the deadline.
    let ticket = receiver.reserve_for_prompt(cfg, 10).unwrap();
    let err = format!("{:#}", receiver.wait(ticket.slot, Duration::from_millis(50)).unwrap_err());
    assert!(err.contains("no state came"), "{err}");
    assert!(receiver.release(ticket.slot));
    assert_eq!(receiver.reserved(), 0);
}

/// Two GPU engines on one GPU (each with pools of its own, as two processes would have): a
/// prefilled state's snapshot written by NIXL from the one's pools into pieces the other
/// reserved arrives bit for bit, restores, and decodes as the original; states of another
/// model or another length are refused; every reserved piece comes back.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn gpu_states_move_gpu_memory_to_gpu_memory_and_bad_ones_are_refused() {
    gpu_states_move(0, 0);
}

/// The same from an engine on GPU 0 to one on GPU 1.
#[test]
#[ignore = "needs two NVIDIA GPUs: run with --include-ignored on such a machine"]
fn gpu_states_move_from_one_gpu_to_another_and_bad_ones_are_refused() {
    gpu_states_move(0, 1);
}

fn gpu_states_move(from: usize, to: usize) {
    use tandem_core::backend::cuda::qwen35::transfer::TransferPools;
    use tandem_core::backend::cuda::qwen35::{GpuQwen35, Precision};
    use tandem_core::backend::cuda::Gpu;

    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let (fp, cfg) = (m.net.fingerprint(), &m.net.config);
    let engine = |ordinal| {
        let mut e = GpuQwen35::upload(Gpu::open(ordinal).unwrap_or_else(|e| panic!("cuda:{ordinal}: {e:#}")), &m.net, Precision::Exact).unwrap();
        e.keep_snapshots_on_device().unwrap();
        e
    };
    let (prefill, decode) = (engine(from), engine(to));
    let pid = std::process::id();
    let mut sender = Sender::new(&format!("test-gpu-prefill-{pid}"), None).unwrap().on_gpu(TransferPools::new(&prefill.pools(), cfg.vocab_size).unwrap());
    let mut receiver = Receiver::new(&format!("test-gpu-decode-{pid}"), None).unwrap().on_gpu(TransferPools::new(&decode.pools(), cfg.vocab_size).unwrap());
    let tokens: Vec<u32> = (0..300u32).map(|i| (i * 53 + 3) % 1024).collect();
    let greedy_gpu = |e: &GpuQwen35, mut s: tandem_core::backend::cuda::qwen35::GpuState| {
        let mut out = Vec::new();
        for _ in 0..8 {
            let t = argmax(s.last_logits().unwrap()) as u32;
            out.push(t);
            e.forward(&[t], &mut s, Logits::Last).unwrap();
        }
        out
    };
    let kv_used = decode.kv_pool().level().used;
    for n in [1, 16, 37, 300] {
        let mut st = prefill.new_state().unwrap();
        prefill.forward(&tokens[..n], &mut st, Logits::Last).unwrap();
        let snap = prefill.snapshot_state(&st).unwrap().expect("snapshots on the GPU");
        let ticket = receiver.reserve_for_prompt(cfg, n).unwrap();
        let ticket = serde_json::from_str(&serde_json::to_string(&ticket).unwrap()).unwrap();
        sender.send_gpu(&ticket, &snap, fp, TIMEOUT).unwrap();
        receiver.wait(ticket.slot, TIMEOUT).unwrap();
        let got = receiver.take_gpu(ticket.slot, fp, n).unwrap();
        let back = decode.restore_state(&got, true).unwrap();
        assert!(back.download().unwrap() == st.download().unwrap(), "{n} tokens cuda:{from} to cuda:{to} through NIXL");
        assert_eq!(greedy_gpu(&decode, back), greedy_gpu(&prefill, st), "greedy tokens after {n} tokens cuda:{from} to cuda:{to}");
    }
    assert_eq!(receiver.reserved(), 0, "every slot taken is freed");
    assert_eq!(decode.kv_pool().level().used, kv_used, "every reserved K/V block came back");

    let mut st = prefill.new_state().unwrap();
    prefill.forward(&tokens[..40], &mut st, Logits::Last).unwrap();
    let snap = prefill.snapshot_state(&st).unwrap().unwrap();
    // Another model: refused, the slot freed.
    let ticket = receiver.reserve_for_prompt(cfg, 40).unwrap();
    sender.send_gpu(&ticket, &snap, fp ^ 1, TIMEOUT).unwrap();
    receiver.wait(ticket.slot, TIMEOUT).unwrap();
    let err = format!("{:#}", receiver.take_gpu(ticket.slot, fp, 40).err().expect("refused"));
    assert!(err.contains("another model"), "{err}");
    // Reserved for another length: the sender sees it does not fit, or the receiver refuses it.
    let ticket = receiver.reserve_for_prompt(cfg, 41).unwrap();
    sender.send_gpu(&ticket, &snap, fp, TIMEOUT).unwrap();
    receiver.wait(ticket.slot, TIMEOUT).unwrap();
    let err = format!("{:#}", receiver.take_gpu(ticket.slot, fp, 41).err().expect("refused"));
    assert!(err.contains("holds 40 tokens, the request 41"), "{err}");
    let ticket = receiver.reserve_for_prompt(cfg, 10).unwrap();
    let err = format!("{:#}", sender.send_gpu(&ticket, &snap, fp, TIMEOUT).unwrap_err());
    assert!(err.contains("does not fit"), "{err}");
    assert!(receiver.release(ticket.slot));
    // A host state for a GPU slot, and a GPU state for a host slot: refused before any write.
    let ticket = receiver.reserve_for_prompt(cfg, 40).unwrap();
    let err = format!("{:#}", sender.send(&ticket, &st.download().unwrap(), fp, TIMEOUT).unwrap_err());
    assert!(err.contains("engines of one kind"), "{err}");
    assert!(receiver.release(ticket.slot));
    assert_eq!(receiver.reserved(), 0);
}
