//! The bridge: everything that moves a request's state from one engine to another. Within a
//! process the state itself moves (`Transfer::Move`); between devices it is copied host to GPU,
//! GPU to host or GPU to GPU (`device`); as bytes (`format`) it goes through a memory-mapped
//! file (`file`) or a byte stream (`socket`), checksummed on the way (`checksum`). The
//! pipeline uses one pair, `handoff::Sender` and `handoff::Receiver`, whatever the transfer.
//! Between processes and hosts a state goes through NIXL (`nixl`, with the cargo feature
//! `nixl`): written one-sided into a slot its receiver reserved.

pub mod checksum;
pub mod device;
pub mod file;
pub mod format;
pub mod handoff;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod socket;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};

/// What identifies a model for the bridge: a 128-bit hash of its config and of weights that
/// no quantization changes (see `Qwen35::fingerprint`).
pub type Fingerprint = u128;

/// Times of one transfer, in the three parts of the study's table.
#[derive(Clone, Copy, Debug, Default)]
pub struct TransferTimes {
    /// The sender turns the state into bytes and hands them on (a file write, a socket send).
    pub serialize: Duration,
    /// The receiver gets the bytes and checks them (mmap + header + checksum; socket receive).
    pub read: Duration,
    /// The receiver builds the `State` its engine works on.
    pub rebuild: Duration,
}

impl TransferTimes {
    pub fn total(&self) -> Duration {
        self.serialize + self.read + self.rebuild
    }
}

/// How a hybrid pipeline moves a state from the prefill to the decode engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transfer {
    /// The state itself moves to the other thread (no copy; copied between devices where the
    /// engines compute on different ones).
    Move,
    /// Written to a state file in this directory (default /dev/shm where there is one),
    /// memory-mapped by the reader.
    File(PathBuf),
    /// Streamed over a Unix socket.
    Socket,
}

impl Transfer {
    pub fn parse(s: &str) -> Result<Transfer> {
        Ok(match s.split_once(':') {
            None if s == "move" => Transfer::Move,
            None if s == "socket" => Transfer::Socket,
            None if s == "file" => Transfer::File(file::default_dir()),
            Some(("file", dir)) => Transfer::File(PathBuf::from(dir)),
            _ => bail!("unknown transfer {s:?}: choose move, file[:DIR] or socket"),
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Transfer::Move => "move",
            Transfer::File(_) => "file",
            Transfer::Socket => "socket",
        }
    }
}

/// The error for a NIXL transfer asked of a tandem built without the `nixl` feature.
pub fn nixl_not_built() -> anyhow::Error {
    anyhow::anyhow!("this tandem was built without NIXL: build it with `cargo build --release --features nixl` after `eval \"$(scripts/nixl.sh)\"` (which installs libclang for the build and the NIXL libraries for running)")
}
