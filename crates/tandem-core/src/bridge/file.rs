//! State files: the image of `format.rs` in a file that the reader memory-maps. The pipeline's
//! file transfer keeps a few and reuses them (`StateFile`); `save` and `load` are the same
//! format for a state kept on disk.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::checksum::Hasher;
use super::format::{arrays, as_bytes, filled, layout, parse_header, prefilled_layout, spare_buffers, Layout, KIND_LINEAR, TRAILER};
use super::Fingerprint;
use crate::model::config::Qwen35Config;
use crate::state::{LayerState, State, StateArray};

/// Save `state` to `path` (see `StateFile::write`).
pub fn save(path: &Path, state: &State, fingerprint: Fingerprint) -> Result<()> {
    StateFile::create(path)?.write(state, fingerprint)
}

/// Where state files go by default: memory-backed /dev/shm where there is one (a handoff on
/// one machine needs no disk), else the temp directory.
pub fn default_dir() -> std::path::PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// Load a state file written by `save`, for the model `cfg` with `fingerprint`, into this
/// process's memory, returning the state and the time spent reading (the file's bytes, header
/// checks) and rebuilding (payloads copied and checksummed). `reuse`: see `receive`.
///
/// The file is read, not mapped: it may come from another process or sit on disk, and a mapped
/// file that someone truncates kills the reader (SIGBUS) at the first page past its new end,
/// where a read just comes back short and the checks refuse it.
pub fn load(path: &Path, fingerprint: Fingerprint, cfg: &Qwen35Config, reuse: Option<State>) -> Result<(State, Duration, Duration)> {
    let t = Instant::now();
    let bytes = std::fs::read(path).with_context(|| format!("reading state file {}", path.display()))?;
    let opened = t.elapsed();
    let (state, read, rebuild) = read_image(&bytes, &|| format!("state file {}", path.display()), fingerprint, cfg, reuse, None)?;
    Ok((state, opened + read, rebuild))
}

/// A state file, memory-mapped read-write and shared. The pipeline's file transfer keeps a few
/// and reuses them: the prefill engine writes a state into one in place (`write`), the decode
/// engine reads it where it lies (`read_file` in place), so neither side maps pages or fills a
/// page cache per handoff, and the recurrent states, most of a state's bytes, are never copied
/// out: the decode engine's state keeps them in the file (`StateArray::InFile`) until the
/// request ends. The file is rewritten only when no state holds it (`Arc::get_mut`).
pub struct StateFile {
    path: PathBuf,
    file: std::fs::File,
    map: Option<memmap2::MmapMut>,
    /// Start of the mapping (null when the file is empty); all access goes through it.
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; who may touch which bytes when is the protocol
// above (one writer with `&mut`, then readers and the InFile arrays of one state).
unsafe impl Send for StateFile {}
unsafe impl Sync for StateFile {}

impl StateFile {
    /// Open `path` for writing states, creating it if needed (an existing file is reused in
    /// place: rewriting pages a file has is cheaper than getting new ones).
    pub fn create(path: &Path) -> Result<StateFile> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("creating state file {}", path.display()))?;
        Self::mapped(path, file)
    }

    fn mapped(path: &Path, file: std::fs::File) -> Result<StateFile> {
        let mut f = StateFile { path: path.to_path_buf(), file, map: None, base: std::ptr::null_mut(), len: 0 };
        let len = f.file.metadata().with_context(|| format!("state file {}", path.display()))?.len() as usize;
        f.map_len(len)?;
        Ok(f)
    }

    /// Map the file's first `len` bytes (populated: every page at once, not a fault each).
    fn map_len(&mut self, len: usize) -> Result<()> {
        self.map = None;
        self.base = std::ptr::null_mut();
        self.len = len;
        if len > 0 {
            // SAFETY: a shared mapping of a file this process writes only through this
            // mapping; a file changed by someone else would at worst fail the checksum.
            let mut map = unsafe { memmap2::MmapOptions::new().len(len).populate().map_mut(&self.file) }.with_context(|| format!("mapping state file {}", self.path.display()))?;
            self.base = map.as_mut_ptr();
            self.map = Some(map);
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn bytes(&self) -> &[u8] {
        if self.base.is_null() {
            return &[];
        }
        // SAFETY: the mapping holds `len` bytes at `base`.
        unsafe { std::slice::from_raw_parts(self.base, self.len) }
    }

    /// Write the image of `state` into the file, resized to it if needed: header and table,
    /// then each payload copied in with its checksum computed on the way (one pass over the
    /// state), then the trailer.
    pub fn write(&mut self, state: &State, fingerprint: Fingerprint) -> Result<()> {
        let lay = layout(state, fingerprint);
        self.resize(lay.total)?;
        // SAFETY: `&mut self`: no one else holds this file, so no array of `state` lives in it.
        unsafe { self.write_image(state, &lay) }
    }

    /// Give the file `total` bytes and map them (nothing to do when it has them already).
    fn resize(&mut self, total: usize) -> Result<()> {
        if self.len != total {
            self.file.set_len(total as u64).with_context(|| format!("setting the length of state file {}", self.path.display()))?;
            self.map_len(total)?;
        }
        Ok(())
    }

    /// `write` for a state whose fixed-size arrays may already live in this file at the places
    /// its image puts them (made by `state_in_file`): those are only checksummed, the rest is
    /// copied in. The file must already have the image's size.
    ///
    /// # Safety
    /// No one uses the file but `state` (whose arrays in it are only read here).
    pub unsafe fn write_shared(&self, state: &State, fingerprint: Fingerprint) -> Result<()> {
        let lay = layout(state, fingerprint);
        if self.len != lay.total {
            bail!("state file {}: {} bytes, the state's image needs {}", self.path.display(), self.len, lay.total);
        }
        self.write_image(state, &lay)
    }

    /// The writing of `write` and `write_shared`, into a file of the image's size.
    ///
    /// # Safety
    /// As `write_shared`.
    unsafe fn write_image(&self, state: &State, lay: &Layout) -> Result<()> {
        let base = self.base;
        let region = |start: usize, end: usize| std::slice::from_raw_parts_mut(base.add(start), end - start);
        region(0, lay.header.len()).copy_from_slice(&lay.header);
        let first = lay.spans.first().map_or(lay.total - TRAILER, |s| s.offset as usize);
        region(lay.header.len(), first).fill(0);
        let mut hash = Hasher::default();
        let mut at = first;
        for (a, span) in arrays(state).iter().zip(&lay.spans) {
            let (start, end) = (span.offset as usize, span.offset as usize + 4 * a.len());
            let pad = region(at, start);
            pad.fill(0);
            hash.update(pad);
            let ptr = a.as_ptr() as *const u8;
            if ptr == base.add(start) {
                hash.update(as_bytes(a));
            } else if ptr >= base as *const u8 && ptr < base.add(self.len) as *const u8 {
                bail!("state file {}: an array of the state lives in it, but not where its image puts it", self.path.display());
            } else {
                hash.copy_from(region(start, end), as_bytes(a));
            }
            at = end;
        }
        let end = lay.total - TRAILER;
        let pad = region(at, end);
        pad.fill(0);
        hash.update(pad);
        region(end, lay.total).copy_from_slice(&hash.finish().to_le_bytes());
        Ok(())
    }
}

/// A fresh state (no token applied) of a request whose prompt has `prompt` tokens, with its
/// conv windows and recurrent states already in `file`, zeroed, at the places the image of the
/// prefilled state puts them: the prefill engine works in the file, and handing the state over
/// (`StateFile::write_shared`) copies only K/V and the logits. `file` must be free (no other
/// holder); it is resized to that image.
pub fn state_in_file(file: &mut Arc<StateFile>, cfg: &Qwen35Config, prompt: usize, fingerprint: Fingerprint) -> Result<State> {
    let lay = prefilled_layout(cfg, prompt, fingerprint);
    let f = Arc::get_mut(file).context("state_in_file: the state file is in use")?;
    f.resize(lay.total)?;
    let base = f.base;
    let mut state = State::new(cfg);
    for (i, layer) in state.layers.iter_mut().enumerate() {
        if let LayerState::Linear { conv, recurrent } = layer {
            for (j, a) in [conv, recurrent].into_iter().enumerate() {
                let span = lay.spans[2 * i + j];
                let ptr = base.wrapping_add(span.offset as usize) as *mut f32;
                // SAFETY: the span lies inside the mapping (the file was sized to the layout);
                // each array gets its own span.
                unsafe { std::slice::from_raw_parts_mut(ptr, span.count as usize) }.fill(0.0);
                *a = StateArray::InFile { file: Arc::clone(file), ptr, len: span.count as usize };
            }
        }
    }
    Ok(state)
}

/// Read the state in `file` for the model `cfg` with `fingerprint`. With `in_place`, the conv
/// windows and recurrent states stay in the file (the returned state holds it until it is
/// dropped; the file must not be written meanwhile: `StateFile::write` needs it unshared), and
/// only K/V and the logits, which grow or are replaced, are copied; otherwise everything is
/// copied out. Every byte is checksummed before the state is returned. Returns the times spent
/// reading (header and table checks) and rebuilding (checksum, copies).
pub fn read_file(file: &Arc<StateFile>, fingerprint: Fingerprint, cfg: &Qwen35Config, reuse: Option<State>, in_place: bool) -> Result<(State, Duration, Duration)> {
    read_image(file.bytes(), &|| format!("state file {}", file.path.display()), fingerprint, cfg, reuse, in_place.then_some(file))
}

/// `read_file` of the image `bytes` (named by `name` in errors); with `in_place` (the mapped
/// file `bytes` are), the fixed-size arrays stay there.
fn read_image(bytes: &[u8], name: &dyn Fn() -> String, fingerprint: Fingerprint, cfg: &Qwen35Config, reuse: Option<State>, in_place: Option<&Arc<StateFile>>) -> Result<(State, Duration, Duration)> {
    let t = Instant::now();
    let header = parse_header(bytes, fingerprint, cfg).with_context(name)?;
    if bytes.len() != header.total {
        bail!("{}: {} bytes, its header announces {} (truncated or extended)", name(), bytes.len(), header.total);
    }
    let read = t.elapsed();
    let t = Instant::now();
    let mut spare = spare_buffers(reuse);
    let mut hash = Hasher::default();
    let first = header.spans.first().map_or(header.total - TRAILER, |s| s.offset as usize);
    let mut at = first;
    let mut arrays = Vec::with_capacity(header.spans.len());
    for (i, span) in header.spans.iter().enumerate() {
        let (start, count) = (span.offset as usize, span.count as usize);
        hash.update(&bytes[at..start]);
        let src = &bytes[start..start + 4 * count];
        // Arrays 2l and 2l+1 belong to layer l; the last one is the logits.
        let fixed_size = header.kinds.get(i / 2) == Some(&KIND_LINEAR);
        if let (Some(file), true) = (in_place, fixed_size) {
            hash.update(src);
            let ptr = file.base.wrapping_add(start) as *mut f32;
            arrays.push(StateArray::InFile { file: Arc::clone(file), ptr, len: count });
        } else {
            let v = filled(&mut spare, count, |dst| {
                hash.copy_from(dst, src);
                Ok(())
            })?;
            arrays.push(StateArray::Owned(v));
        }
        at = start + 4 * count;
    }
    let end = header.total - TRAILER;
    hash.update(&bytes[at..end]);
    if hash.finish() != u64::from_le_bytes(bytes[end..].try_into().expect("8-byte trailer")) {
        bail!("{}: corrupt state: the payload checksum does not match", name());
    }
    Ok((header.assemble(arrays), read, t.elapsed()))
}

