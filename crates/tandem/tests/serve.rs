//! `tandem serve` against real clients: runs tests/serve/test_serve.py (the official `openai`
//! Python package and curl, each check starting its own server on a free loopback port). The
//! package is installed into a virtualenv under the target directory on first use.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The client version the checks were written against.
const OPENAI: &str = "openai==3.54.0";

fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed ({}):\n{text}", out.status);
    text
}

/// A Python with `openai` installed: target/tmp/openai-venv, made when missing.
fn python() -> PathBuf {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin/python");
    let ready = venv.join(format!("{OPENAI}.installed"));
    if !ready.exists() {
        run(Command::new("python3").args(["-m", "venv", "--clear"]).arg(&venv), "making a virtualenv (python3 -m venv; Debian: apt install python3-venv)");
        run(Command::new(&python).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", OPENAI]), "installing the openai package from PyPI");
        std::fs::write(&ready, "").expect("marking the virtualenv ready");
    }
    python
}

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
