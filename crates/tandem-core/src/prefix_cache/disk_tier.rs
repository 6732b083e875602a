//! The prefix cache's disk tier: snapshots that the host tier lets go are written to a
//! directory as state files (the bridge's format: checksummed, with the model's fingerprint),
//! each beside a file of the tokens it covers, and read back when a prompt hits them. The
//! directory outlives the server: a server started on it finds the snapshots of the last one.
//! A file that does not read back whole, or that another model (or another version of this
//! one) wrote, is refused with the reason and never applied.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::bridge::{file, Fingerprint};
use crate::model::config::Qwen35Config;
use crate::state::State;

pub struct DiskTier {
    dir: PathBuf,
    budget: usize,
    fingerprint: Fingerprint,
    config: Qwen35Config,
}

/// One snapshot on disk.
pub struct DiskFile {
    /// The state file; the tokens beside it (`.tokens`: u32 little-endian).
    pub path: PathBuf,
    pub bytes: usize,
}

/// The snapshots a directory holds, each with its key.
pub type OnDisk = Vec<(Vec<u32>, DiskFile)>;

/// The name of the files of a key (FNV-1a of its entries: stable across runs).
fn stem(key: &[u32]) -> String {
    let h = key.iter().flat_map(|t| t.to_le_bytes()).fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3));
    format!("{h:016x}")
}

fn tokens_path(state: &Path) -> PathBuf {
    state.with_extension("tokens")
}

impl DiskTier {
    /// The tier in `dir` (made if missing) of `budget` bytes, for the model of `fingerprint`
    /// and `config`; with the snapshots already there, each with its key (the tokens files
    /// that do not read whole are skipped with a line on stderr).
    pub fn open(dir: &Path, budget: usize, fingerprint: Fingerprint, config: &Qwen35Config) -> Result<(DiskTier, OnDisk)> {
        std::fs::create_dir_all(dir).with_context(|| format!("making the prefix cache's directory {}", dir.display()))?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(dir).with_context(|| format!("reading the prefix cache's directory {}", dir.display()))? {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "state") {
                continue;
            }
            let key = match std::fs::read(tokens_path(&path)) {
                Ok(b) if b.len() % 4 == 0 && !b.is_empty() => b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<u32>>(),
                Ok(b) => {
                    eprintln!("prefix cache: {}: {} bytes, not a list of tokens: its snapshot is left out", tokens_path(&path).display(), b.len());
                    continue;
                }
                Err(e) => {
                    eprintln!("prefix cache: {}: {e}: its snapshot is left out", tokens_path(&path).display());
                    continue;
                }
            };
            let bytes = std::fs::metadata(&path).map(|m| m.len() as usize).unwrap_or(0);
            found.push((key, DiskFile { path, bytes }));
        }
        Ok((DiskTier { dir: dir.to_path_buf(), budget, fingerprint, config: config.clone() }, found))
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Write `state`, the state after `key`, to its files.
    pub fn write(&self, key: &[u32], state: &State) -> Result<DiskFile> {
        let path = self.dir.join(format!("{}.state", stem(key)));
        let tokens: Vec<u8> = key.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(tokens_path(&path), tokens).with_context(|| format!("writing {}", tokens_path(&path).display()))?;
        file::save(&path, state, self.fingerprint)?;
        let bytes = std::fs::metadata(&path).map(|m| m.len() as usize).with_context(|| format!("state file {}", path.display()))?;
        Ok(DiskFile { path, bytes })
    }

    /// Read a snapshot back: the whole file checked (checksums, the model's fingerprint, the
    /// shapes) and its position against the `tokens` it covers.
    pub fn read(&self, f: &DiskFile, tokens: usize) -> Result<State> {
        let (state, _, _) = file::load(&f.path, self.fingerprint, &self.config, None)?;
        if state.position != tokens {
            bail!("{}: a state after {} tokens, filed as the state after {tokens}", f.path.display(), state.position);
        }
        Ok(state)
    }

    /// Delete a snapshot's files.
    pub fn remove(&self, f: &DiskFile) {
        let _ = std::fs::remove_file(&f.path);
        let _ = std::fs::remove_file(tokens_path(&f.path));
    }
}
