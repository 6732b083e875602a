//! The state through NIXL (UCX over TCP, two agents in this process): written into the slot a
//! receiver reserved, it arrives bit for bit and decodes as the state that was sent; a state of
//! another model, another length, or with a byte changed on the way is refused; a released
//! slot cannot be written. Needs the NIXL libraries (`eval "$(scripts/nixl.sh)"`).
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
    // SAFETY: the slot is registered memory of this process, ticket.len bytes, not in use.
    let slot = unsafe { std::slice::from_raw_parts_mut(ticket.addr as *mut u8, ticket.len as usize) };
    slot[4096] ^= 0x10;
    let err = format!("{:#}", receiver.take(ticket.slot, fp, cfg, 10, None).unwrap_err());
    assert!(err.contains("checksum"), "{err}");

    // A state too long for the slot is not sent.
    let ticket = receiver.reserve_for_prompt(cfg, 10).unwrap();
    let long = prefilled(&m, 10 + ticket.len as usize / 1000);
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
    assert_ne!(next.addr, ticket.addr, "a released slot's memory is not reused at once");
    assert!(receiver.release(next.slot));
    // A slot whose state never comes: waiting ends with an error at the deadline.
    let ticket = receiver.reserve_for_prompt(cfg, 10).unwrap();
    let err = format!("{:#}", receiver.wait(ticket.slot, Duration::from_millis(50)).unwrap_err());
    assert!(err.contains("no state came"), "{err}");
    assert!(receiver.release(ticket.slot));
    assert_eq!(receiver.reserved(), 0);
}
