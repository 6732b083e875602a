//! A sequence's state swapped out of a CPU engine's memory budget (`host_budget.rs`): written
//! to a state file (the bridge's format: checksummed, with the model's fingerprint) in the
//! temp directory (`$TMPDIR`, not the memory-backed directory the file transfer prefers: the
//! point is to free memory), and read back bit for bit once there is room. The file is removed
//! when it is read back or dropped.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};

use crate::bridge::{file, Fingerprint};
use crate::model::config::Qwen35Config;
use crate::state::State;

pub struct SwapFile {
    path: PathBuf,
}

impl SwapFile {
    /// Write `state` to a new file (the state is dropped: its memory goes back).
    pub fn write(state: State, fingerprint: Fingerprint) -> Result<SwapFile> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!("tandem-swap-{}-{}.state", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let swap = SwapFile { path: std::env::temp_dir().join(name) };
        // (A file left half written is removed when `swap` is dropped.)
        file::save(&swap.path, &state, fingerprint).with_context(|| format!("swapping a state out to {}", swap.path.display()))?;
        Ok(swap)
    }

    /// The state, as it was written; the file is removed.
    pub fn read(self, fingerprint: Fingerprint, cfg: &Qwen35Config) -> Result<State> {
        let (state, _, _) = file::load(&self.path, fingerprint, cfg, None).with_context(|| format!("swapping a state back in from {}", self.path.display()))?;
        Ok(state)
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
