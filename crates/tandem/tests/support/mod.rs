//! What the tests that drive `tandem serve` with real clients share: a Python with the
//! official `openai` package, installed into a virtualenv under the target directory on first
//! use.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The client version the checks were written against, and the JSON-schema validator that
/// checks structured output.
const PACKAGES: [&str; 2] = ["openai==3.54.0", "jsonschema==4.25.1"];

pub fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed ({}):\n{text}", out.status);
    text
}

/// A Python with `openai` and `jsonschema` installed: target/tmp/openai-venv, made when missing.
pub fn python() -> PathBuf {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin/python");
    let ready = venv.join(format!("{}.installed", PACKAGES.join("+")));
    if !ready.exists() {
        run(Command::new("python3").args(["-m", "venv", "--clear"]).arg(&venv), "making a virtualenv (python3 -m venv; Debian: apt install python3-venv)");
        run(Command::new(&python).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"]).args(PACKAGES), "installing the openai and jsonschema packages from PyPI");
        std::fs::write(&ready, "").expect("marking the virtualenv ready");
    }
    python
}

