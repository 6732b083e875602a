//! `tandem serve` against real clients: runs tests/serve/test_serve.py (the official `openai`
//! Python package and curl, each check starting its own server on a free loopback port). The
//! package is installed into a virtualenv under the target directory on first use.

mod support;

use std::path::Path;
use std::process::Command;

use support::{python, run};

#[test]
fn openai_client_and_curl_against_a_running_server() {
    assert!(Command::new("curl").arg("--version").output().is_ok(), "curl is needed (Debian: apt install curl)");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve/test_serve.py");
    let out = run(Command::new(python()).arg(&script).env("TANDEM", env!("CARGO_BIN_EXE_tandem")).env("TANDEM_MODEL", "synthetic:tiny").env_remove("TANDEM_ENGINES"), "tests/serve/test_serve.py");
    println!("{out}");
    for check in ["api_and_sdk", "curl_checks", "multi_turn", "typing_ahead", "cancellation", "shutdown", "queue_and_429", "load_test"] {
        assert!(out.contains(&format!("{check}:\n")), "{check} did not run:\n{out}");
    }
}
