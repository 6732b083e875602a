//! Disaggregated serving against the official `openai` client: runs
//! tests/serve/test_disagg.py (a router, two prefill and two decode workers, each in a network
//! namespace of its own, the state through NIXL over TCP) inside a user, network and mount
//! namespace made for it (`unshare -rnm`), so that its addresses exist nowhere else. Where
//! namespaces cannot be made the script runs the same processes on loopback ports and says so.
#![cfg(feature = "nixl")]

mod support;

use std::path::Path;
use std::process::Command;

use support::{python, run};

#[test]
fn router_prefill_and_decode_workers_give_the_single_servers_outputs_and_survive_faults() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve/test_disagg.py");
    let python = python();
    let namespaces = Command::new("unshare").args(["-rnm", "true"]).output().is_ok_and(|o| o.status.success());
    let mut cmd = if namespaces {
        let mut c = Command::new("unshare");
        c.arg("-rnm").arg(&python);
        c
    } else {
        Command::new(&python)
    };
    let out = run(cmd.arg(&script).env("TANDEM", env!("CARGO_BIN_EXE_tandem")), "tests/serve/test_disagg.py");
    println!("{out}");
    assert!(out.contains("disagg: ok"), "the checks did not all run:\n{out}");
    if namespaces {
        assert!(out.contains("network: a namespace per process"), "unshare works here, so the script must use namespaces:\n{out}");
    }
}

/// On a GPU machine: a prefill and a decode worker as two processes on one GPU, each state
/// moved GPU memory to GPU memory through NIXL (CUDA IPC), outputs as a single GPU server's.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn gpu_workers_on_one_gpu_move_states_gpu_to_gpu() {
    gpu_workers("1");
}

/// On a machine with two GPUs: the prefill worker on cuda:0, the decode worker on cuda:1, each
/// state moved from one GPU's memory to the other's through NIXL.
#[test]
#[ignore = "needs two NVIDIA GPUs: run with --include-ignored on such a machine"]
fn gpu_workers_on_two_gpus_move_states_between_them() {
    gpu_workers("2");
}

/// test_disagg.py's GPU mode on `gpus` GPUs.
fn gpu_workers(gpus: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve/test_disagg.py");
    let out = run(Command::new(python()).arg(&script).env("TANDEM", env!("CARGO_BIN_EXE_tandem")).env("TANDEM_DISAGG_GPU", gpus), &format!("tests/serve/test_disagg.py (GPU mode {gpus})"));
    println!("{out}");
    assert!(out.contains("disagg gpu: ok"), "the checks did not all run:\n{out}");
}
