//! Whether a C++ compiler is here: the test that runs the CUDA kernels on CPU threads
//! (tests/cuda_on_cpu.rs) needs one, and is marked ignored where there is none, so that the
//! test runner's own count says it did not run.

use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(tandem_cxx)");
    println!("cargo::rerun-if-env-changed=CXX");
    let candidates = std::env::var("CXX").into_iter().chain(["c++", "g++", "clang++"].map(String::from));
    let works = |c: &String| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success());
    if candidates.into_iter().any(|c| works(&c)) {
        println!("cargo::rustc-cfg=tandem_cxx");
    }
}
