//! The state bridge: a request's `State` as a versioned binary image, and the ways to move it
//! between engines (a file that the reader memory-maps, a byte stream over a socket; within a
//! process the `State` itself is moved). The format is documented in docs/state-format.md.
//!
//! A reader checks everything before it builds a state: magic, version, the model
//! fingerprint (a state is never applied to another model), the header's own checksum, the
//! layer table against the model's shapes, every payload's bounds, and the payloads'
//! checksum. A state that fails any check is an error naming what failed; nothing is applied.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::{LayerState, State, StateArray};
use crate::config::{LayerType, Qwen35Config};

pub const MAGIC: [u8; 8] = *b"TNDMSTAT";
pub const VERSION: u32 = 1;
/// Fixed part of the header; the layer table follows, then the payloads.
const FIXED: usize = 88;
/// One layer table entry: kind, reserved, then (offset, count) of its two arrays.
const ENTRY: usize = 40;
/// Payloads start on 64-byte boundaries, so a memory-mapped reader can use them in place.
const ALIGN: usize = 64;
const KIND_LINEAR: u32 = 1;
const KIND_FULL: u32 = 2;
const DTYPE_F32: u32 = 1;
/// The payload checksum, after the payloads.
const TRAILER: usize = 8;
/// Payloads are checksummed and copied in pieces of this size, each while it is in cache.
const CHUNK: usize = 256 << 10;

/// What identifies a model for the bridge: a 128-bit hash of its config and of weights that
/// no quantization changes (see `Qwen35::fingerprint`).
pub type Fingerprint = u128;

/// Where one array lives in the image: byte offset from the start, number of f32 values.
#[derive(Clone, Copy, Debug)]
struct Span {
    offset: u64,
    count: u64,
}

/// The header and layer table of a state image, and where its payloads go.
struct Layout {
    header: Vec<u8>,
    /// Per array (layer by layer, two each, then the logits): its span.
    spans: Vec<Span>,
    total: usize,
}

/// The arrays of a state in image order: per layer its two arrays, then the last logits.
fn arrays(state: &State) -> Vec<&[f32]> {
    let mut v: Vec<&[f32]> = Vec::with_capacity(2 * state.layers.len() + 1);
    for l in &state.layers {
        match l {
            LayerState::Linear { conv, recurrent } => v.extend([&conv[..], &recurrent[..]]),
            LayerState::Full { k, v: vv } => v.extend([&k[..], &vv[..]]),
        }
    }
    v.push(&state.last_logits);
    v
}

fn layout(state: &State, fingerprint: Fingerprint) -> Layout {
    let lens: Vec<usize> = arrays(state).iter().map(|a| a.len()).collect();
    layout_of(&kinds(state), &lens, state.position, fingerprint)
}

/// The layer table's kind code of each layer of `state`.
fn kinds(state: &State) -> Vec<u32> {
    state
        .layers
        .iter()
        .map(|l| match l {
            LayerState::Linear { .. } => KIND_LINEAR,
            LayerState::Full { .. } => KIND_FULL,
        })
        .collect()
}

/// The layout of a state of `position` tokens whose layers have `kinds` and whose arrays (two
/// per layer, then the logits) hold `lens` values.
fn layout_of(kinds: &[u32], lens: &[usize], position: usize, fingerprint: Fingerprint) -> Layout {
    let table_end = FIXED + ENTRY * kinds.len();
    let mut offset = table_end.next_multiple_of(ALIGN);
    let spans: Vec<Span> = lens
        .iter()
        .map(|&len| {
            let s = Span { offset: offset as u64, count: len as u64 };
            offset = (offset + 4 * len).next_multiple_of(ALIGN);
            s
        })
        .collect();
    // The payload checksum follows the payloads, so a writer computes it as it writes.
    let total = offset + TRAILER;
    let mut h = Vec::with_capacity(table_end);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&(table_end as u32).to_le_bytes());
    h.extend_from_slice(&fingerprint.to_le_bytes());
    h.extend_from_slice(&(position as u64).to_le_bytes());
    h.extend_from_slice(&(kinds.len() as u32).to_le_bytes());
    h.extend_from_slice(&DTYPE_F32.to_le_bytes());
    let logits = spans[spans.len() - 1];
    h.extend_from_slice(&logits.offset.to_le_bytes());
    h.extend_from_slice(&logits.count.to_le_bytes());
    h.extend_from_slice(&(total as u64).to_le_bytes());
    h.extend_from_slice(&0u64.to_le_bytes());
    debug_assert_eq!(h.len(), FIXED - 8);
    let header_checksum = checksum(&h);
    h.extend_from_slice(&header_checksum.to_le_bytes());
    for (i, kind) in kinds.iter().enumerate() {
        h.extend_from_slice(&kind.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        for s in &spans[2 * i..2 * i + 2] {
            h.extend_from_slice(&s.offset.to_le_bytes());
            h.extend_from_slice(&s.count.to_le_bytes());
        }
    }
    Layout { header: h, spans, total }
}

/// Write the image of `state` to `w`: header, table, then each payload at its aligned offset
/// and the checksum of everything from the first payload on. The payloads go out straight
/// from the state's memory, each piece checksummed just before it is written.
pub fn write_state(w: &mut impl Write, state: &State, fingerprint: Fingerprint) -> Result<()> {
    let lay = layout(state, fingerprint);
    w.write_all(&lay.header)?;
    let zeros = [0u8; ALIGN];
    let mut hash = Hasher::default();
    // Padding up to the first payload is outside the checksummed range.
    let first = lay.spans.first().map_or(lay.total - TRAILER, |s| s.offset as usize);
    w.write_all(&zeros[..first - lay.header.len()])?;
    let mut at = first;
    for (a, span) in arrays(state).iter().zip(&lay.spans) {
        let n = span.offset as usize - at;
        hash.update(&zeros[..n]);
        w.write_all(&zeros[..n])?;
        for piece in as_bytes(a).chunks(CHUNK) {
            hash.update(piece);
            w.write_all(piece)?;
        }
        at = span.offset as usize + 4 * a.len();
    }
    let n = lay.total - TRAILER - at;
    hash.update(&zeros[..n]);
    w.write_all(&zeros[..n])?;
    w.write_all(&hash.finish().to_le_bytes())?;
    Ok(())
}

/// The validated header of an image: everything needed to rebuild the state from its bytes.
pub struct Header {
    pub position: usize,
    /// Per layer: its kind and the spans of its two arrays; then the logits' span.
    spans: Vec<Span>,
    kinds: Vec<u32>,
    pub total: usize,
    table_end: usize,
}

/// Check the fixed part of a header (the first `FIXED` bytes); returns where its layer table
/// ends.
fn check_fixed(bytes: &[u8], expected: Fingerprint, cfg: &Qwen35Config) -> Result<usize> {
    let magic = &bytes[..bytes.len().min(8)];
    if magic != &MAGIC[..magic.len()] {
        bail!("not a tandem state (it starts with {:?}, a state with {:?})", String::from_utf8_lossy(magic), String::from_utf8_lossy(&MAGIC));
    }
    if bytes.len() < FIXED {
        bail!("truncated state: {} bytes, shorter than the {FIXED}-byte header", bytes.len());
    }
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
    let version = u32_at(8);
    if version != VERSION {
        bail!("state format version {version}; this tandem reads version {VERSION}");
    }
    if checksum(&bytes[..FIXED - 8]) != u64::from_le_bytes(bytes[FIXED - 8..FIXED].try_into().unwrap()) {
        bail!("corrupt state: the header checksum does not match");
    }
    let fingerprint = u128::from_le_bytes(bytes[16..32].try_into().unwrap());
    if fingerprint != expected {
        bail!("the state was made by another model (fingerprint {fingerprint:032x}; this model is {expected:032x}): it cannot be applied here");
    }
    let (layers, dtype) = (u32_at(40) as usize, u32_at(44));
    if dtype != DTYPE_F32 {
        bail!("state dtype code {dtype}: this tandem reads f32 states (code {DTYPE_F32})");
    }
    if layers != cfg.layer_types.len() {
        bail!("the state has {layers} layers, the model {}", cfg.layer_types.len());
    }
    let table_end = u32_at(12) as usize;
    if table_end != FIXED + ENTRY * layers {
        bail!("malformed state: a layer table ending at byte {table_end} for {layers} layers");
    }
    Ok(table_end)
}

/// Check the fixed header and the layer table (`bytes` holds at least both) against the model.
fn parse_header(bytes: &[u8], expected: Fingerprint, cfg: &Qwen35Config) -> Result<Header> {
    let table_end = check_fixed(bytes, expected, cfg)?;
    if bytes.len() < table_end {
        bail!("truncated state: {} bytes, the layer table ends at byte {table_end}", bytes.len());
    }
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap());
    let (position, layers) = (u64_at(32) as usize, cfg.layer_types.len());
    let total = u64_at(64) as usize;
    let mut spans = Vec::with_capacity(2 * layers + 1);
    let mut kinds = Vec::with_capacity(layers);
    let kv_len = (position * cfg.num_key_value_heads * cfg.head_dim) as u64;
    let conv_len = (cfg.linear_conv_kernel_dim * cfg.linear_conv_dim()) as u64;
    let rec_len = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim) as u64;
    for (i, lt) in cfg.layer_types.iter().enumerate() {
        let e = FIXED + ENTRY * i;
        let kind = u32_at(e);
        let a = Span { offset: u64_at(e + 8), count: u64_at(e + 16) };
        let b = Span { offset: u64_at(e + 24), count: u64_at(e + 32) };
        let want = match lt {
            LayerType::LinearAttention => (KIND_LINEAR, conv_len, rec_len),
            LayerType::FullAttention => (KIND_FULL, kv_len, kv_len),
        };
        if (kind, a.count, b.count) != want {
            bail!("state layer {i}: kind {kind} with {} + {} values, the model needs kind {} with {} + {}", a.count, b.count, want.0, want.1, want.2);
        }
        kinds.push(kind);
        spans.extend([a, b]);
    }
    let logits = Span { offset: u64_at(48), count: u64_at(56) };
    if logits.count != 0 && logits.count != cfg.vocab_size as u64 {
        bail!("state logits hold {} values, the model's vocabulary is {}", logits.count, cfg.vocab_size);
    }
    spans.push(logits);
    for s in &spans {
        let end = s.offset.checked_add(4 * s.count).context("state payload offset overflows")?;
        if (s.offset as usize) < table_end || s.offset as usize % ALIGN != 0 || end as usize + TRAILER > total {
            bail!("malformed state: a payload at byte {} of {} values lies outside the image of {total} bytes", s.offset, s.count);
        }
    }
    if spans.windows(2).any(|w| w[1].offset < w[0].offset + 4 * w[0].count) {
        bail!("malformed state: payloads overlap or are out of order");
    }
    Ok(Header { position, spans, kinds, total, table_end })
}

impl Header {
    /// Read the rest of the image (everything after the layer table) from `r` straight into
    /// the state's arrays, checksumming each piece as it arrives; the state is returned only
    /// if the checksum matches. `reuse` lends the buffers of a state that is no longer needed
    /// (a finished request's), which spares the page faults of fresh memory.
    fn read_body(&self, r: &mut impl Read, reuse: Option<State>) -> Result<State> {
        let truncated = |e: std::io::Error| -> anyhow::Error {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                anyhow::anyhow!("truncated state: it ends before the {} bytes its header announces", self.total)
            } else {
                anyhow::Error::new(e).context("reading a state")
            }
        };
        let mut spare = spare_buffers(reuse);
        let mut hash = Hasher::default();
        let mut pad = [0u8; ALIGN];
        let first = self.spans.first().map_or(self.total - TRAILER, |s| s.offset as usize);
        // Padding up to the first payload (outside the checksum).
        r.read_exact(&mut pad[..first - self.table_end]).map_err(truncated)?;
        let mut at = first;
        let mut arrays = Vec::with_capacity(self.spans.len());
        for span in &self.spans {
            let n = span.offset as usize - at;
            r.read_exact(&mut pad[..n]).map_err(truncated)?;
            hash.update(&pad[..n]);
            let count = span.count as usize;
            let v = filled(&mut spare, count, |dst| {
                for piece in dst.chunks_mut(CHUNK) {
                    r.read_exact(piece).map_err(truncated)?;
                    hash.update(piece);
                }
                Ok(())
            })?;
            arrays.push(StateArray::Owned(v));
            at = span.offset as usize + 4 * count;
        }
        let n = self.total - TRAILER - at;
        r.read_exact(&mut pad[..n]).map_err(truncated)?;
        hash.update(&pad[..n]);
        let mut trailer = [0u8; TRAILER];
        r.read_exact(&mut trailer).map_err(truncated)?;
        if hash.finish() != u64::from_le_bytes(trailer) {
            bail!("corrupt state: the payload checksum does not match");
        }
        Ok(self.assemble(arrays))
    }

    /// The state from its arrays in image order (two per layer, then the logits).
    fn assemble(&self, mut arrays: Vec<StateArray>) -> State {
        let logits = arrays.pop().expect("the logits span is always there").into_vec();
        let mut arrays = arrays.into_iter();
        let mut next = || arrays.next().expect("two arrays per layer");
        let layers = self
            .kinds
            .iter()
            .map(|&kind| {
                let (a, b) = (next(), next());
                if kind == KIND_LINEAR {
                    LayerState::Linear { conv: a, recurrent: b }
                } else {
                    LayerState::Full { k: a.into_vec(), v: b.into_vec() }
                }
            })
            .collect();
        State { position: self.position, layers, last_logits: logits }
    }
}

/// `count` values written by `fill` (as bytes, every one of them) into a spare buffer, or a new
/// one: no zeroing first, since every byte is about to be overwritten.
fn filled(spare: &mut Vec<Vec<f32>>, count: usize, fill: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<Vec<f32>> {
    let mut v = spare.pop().unwrap_or_default();
    v.clear();
    v.reserve_exact(count);
    // SAFETY: the spare capacity holds `count` f32 values; `fill` writes every byte of them (any
    // byte pattern is an f32) before `set_len` exposes them, or fails and `v` is dropped empty.
    let dst = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, 4 * count) };
    fill(dst)?;
    unsafe { v.set_len(count) };
    Ok(v)
}

/// The buffers of a state no longer needed, in the reverse of image order (so that `pop` gives
/// them in order); arrays that live in a file give none.
fn spare_buffers(reuse: Option<State>) -> Vec<Vec<f32>> {
    let mut spare: Vec<Vec<f32>> = Vec::new();
    if let Some(old) = reuse {
        for l in old.layers {
            match l {
                LayerState::Linear { conv, recurrent } => spare.extend([conv.into_vec(), recurrent.into_vec()]),
                LayerState::Full { k, v } => spare.extend([k, v]),
            }
        }
        spare.push(old.last_logits);
    }
    spare.reverse();
    spare
}

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
/// process's memory (a copy: the file may change after), returning the state and the time spent
/// reading (map + header checks) and rebuilding (payloads copied and checksummed). `reuse`: see
/// `receive`.
pub fn load(path: &Path, fingerprint: Fingerprint, cfg: &Qwen35Config, reuse: Option<State>) -> Result<(State, Duration, Duration)> {
    let t = Instant::now();
    let file = Arc::new(StateFile::open(path)?);
    let opened = t.elapsed();
    let (state, read, rebuild) = read_file(&file, fingerprint, cfg, reuse, false)?;
    Ok((state, opened + read, rebuild))
}

/// Send a state over a byte stream (a socket): the image, as `write_state` writes it.
pub fn send(stream: &mut impl Write, state: &State, fingerprint: Fingerprint) -> Result<()> {
    let mut w = std::io::BufWriter::with_capacity(16 << 10, stream);
    write_state(&mut w, state, fingerprint)?;
    w.flush()?;
    Ok(())
}

/// Receive one state from a byte stream, returning it with the time spent receiving the header
/// and checking it, and the time spent receiving the payloads, which go straight into the
/// state's arrays (so for a stream "rebuild" includes the wait for the bytes). `reuse` lends
/// the buffers of a state no longer needed.
pub fn receive(stream: &mut impl Read, fingerprint: Fingerprint, cfg: &Qwen35Config, reuse: Option<State>) -> Result<(State, Duration, Duration)> {
    let t = Instant::now();
    let mut bytes = vec![0u8; FIXED];
    stream.read_exact(&mut bytes).context("receiving a state header: the stream ended")?;
    let table_end = check_fixed(&bytes, fingerprint, cfg)?;
    bytes.resize(table_end, 0);
    stream.read_exact(&mut bytes[FIXED..]).context("receiving a state's layer table: the stream ended")?;
    let header = parse_header(&bytes, fingerprint, cfg)?;
    let read = t.elapsed();
    let t = Instant::now();
    let state = header.read_body(stream, reuse)?;
    Ok((state, read, t.elapsed()))
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

    /// Open an existing state file to read it.
    pub fn open(path: &Path) -> Result<StateFile> {
        let file = std::fs::OpenOptions::new().read(true).write(true).open(path).with_context(|| format!("opening state file {}", path.display()))?;
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
    let empty = State::new(cfg);
    let kinds = kinds(&empty);
    let kv = prompt * cfg.num_key_value_heads * cfg.head_dim;
    // Two arrays per layer (K/V sized for the prompt), then the logits.
    let mut lens: Vec<usize> = arrays(&empty).iter().zip(kinds.iter().flat_map(|&k| [k, k])).map(|(a, k)| if k == KIND_FULL { kv } else { a.len() }).collect();
    lens.push(cfg.vocab_size);
    let lay = layout_of(&kinds, &lens, prompt, fingerprint);
    let f = Arc::get_mut(file).context("state_in_file: the state file is in use")?;
    f.resize(lay.total)?;
    let base = f.base;
    let mut state = empty;
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
    let t = Instant::now();
    let bytes = file.bytes();
    let name = || format!("state file {}", file.path.display());
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
        if in_place && fixed_size {
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

fn as_bytes(a: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the format is
    // little-endian, the byte order of every target tandem builds for (checked below).
    unsafe { std::slice::from_raw_parts(a.as_ptr() as *const u8, std::mem::size_of_val(a)) }
}
#[cfg(target_endian = "big")]
compile_error!("the state format is little-endian and written from memory as is");

/// A 64-bit checksum of a byte string, fed in pieces of any size. Fletcher-style over 64-bit
/// words in eight lanes (`a += word; b += a` per lane, on 64-byte blocks), so that it runs as
/// fast as the bytes arrive (the compiler turns the lanes into vector adds): a flipped bit
/// changes `a`, moved words change `b`. The lanes, the trailing bytes and the length are
/// mixed into the result. It detects corruption; it is no cryptographic signature.
#[derive(Clone)]
pub struct Hasher {
    a: [u64; 8],
    b: [u64; 8],
    len: u64,
    buf: [u8; 64],
    buffered: usize,
}

const K: [u64; 4] = [0x9E37_79B9_7F4A_7C15, 0xC2B2_AE3D_27D4_EB4F, 0x1656_67B1_9E37_79F9, 0x27D4_EB2F_1656_67C5];

impl Default for Hasher {
    fn default() -> Self {
        Hasher { a: [0; 8], b: [0; 8], len: 0, buf: [0; 64], buffered: 0 }
    }
}

impl Hasher {
    #[inline(always)]
    fn blocks(&mut self, data: &[u8]) {
        for w in data.chunks_exact(64) {
            for j in 0..8 {
                let x = u64::from_le_bytes(w[8 * j..8 * j + 8].try_into().unwrap());
                self.a[j] = self.a[j].wrapping_add(x);
                self.b[j] = self.b[j].wrapping_add(self.a[j]);
            }
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        self.len = self.len.wrapping_add(data.len() as u64);
        if self.buffered > 0 {
            let take = (64 - self.buffered).min(data.len());
            self.buf[self.buffered..self.buffered + take].copy_from_slice(&data[..take]);
            self.buffered += take;
            data = &data[take..];
            if self.buffered < 64 {
                return;
            }
            let b = self.buf;
            self.blocks(&b);
            self.buffered = 0;
        }
        let whole = data.len() / 64 * 64;
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: `data` holds whole/64 blocks; the CPU has AVX-512F; no copy (null dst).
            unsafe { hash_copy_avx512(&mut self.a, &mut self.b, data.as_ptr(), std::ptr::null_mut(), whole / 64) };
            let tail = &data[whole..];
            self.buf[..tail.len()].copy_from_slice(tail);
            self.buffered = tail.len();
            return;
        }
        self.blocks(&data[..whole]);
        let tail = &data[whole..];
        self.buf[..tail.len()].copy_from_slice(tail);
        self.buffered = tail.len();
    }

    /// `dst.copy_from_slice(src)` and `self.update(src)` in one pass over the bytes.
    pub fn copy_from(&mut self, dst: &mut [u8], src: &[u8]) {
        assert_eq!(dst.len(), src.len(), "copy_from: lengths differ");
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if self.buffered == 0 && std::arch::is_x86_feature_detected!("avx512f") {
            let blocks = src.len() / 64;
            // SAFETY: both slices hold `blocks` 64-byte blocks; the CPU has AVX-512F.
            unsafe { hash_copy_avx512(&mut self.a, &mut self.b, src.as_ptr(), dst.as_mut_ptr(), blocks) };
            self.len = self.len.wrapping_add((blocks * 64) as u64);
            done = blocks * 64;
        }
        dst[done..].copy_from_slice(&src[done..]);
        self.update(&src[done..]);
    }

    pub fn finish(self) -> u64 {
        let mix = |h: u64, x: u64| (h ^ x).rotate_left(27).wrapping_mul(K[0] | 1).wrapping_add(K[1]);
        let mut h = mix(K[2], self.len);
        for j in 0..8 {
            h = mix(mix(h, self.a[j]), self.b[j]);
        }
        for &byte in &self.buf[..self.buffered] {
            h = mix(h, byte as u64 ^ K[3]);
        }
        h ^ (h >> 31)
    }
}

/// The lanes of `Hasher::blocks` in one register each (lane j of the vectors is word j of a
/// block, as in `blocks`), every block stored to `dst` as it goes unless `dst` is null: with
/// non-temporal stores when `dst` is 64-byte aligned (a state is far larger than the caches; its copy need not pass
/// through them), else plain ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn hash_copy_avx512(a: &mut [u64; 8], b: &mut [u64; 8], src: *const u8, dst: *mut u8, blocks: usize) {
    use std::arch::x86_64::*;
    let mut va = _mm512_loadu_si512(a.as_ptr() as *const _);
    let mut vb = _mm512_loadu_si512(b.as_ptr() as *const _);
    if !dst.is_null() && dst as usize % 64 != 0 && dst as usize % 4 == 0 && blocks > 1 {
        // A destination off the 64-byte grid (a Vec's buffer usually is, by 16 bytes): each
        // aligned 64-byte store takes the end of one source block and the start of the next.
        let head = 64 - dst as usize % 64;
        std::ptr::copy_nonoverlapping(src, dst, head);
        let s = (head / 4) as i32;
        let idx = _mm512_add_epi32(_mm512_set1_epi32(s), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        let mut prev = _mm512_loadu_si512(src as *const _);
        va = _mm512_add_epi64(va, prev);
        vb = _mm512_add_epi64(vb, va);
        for i in 1..blocks {
            let v = _mm512_loadu_si512(src.add(64 * i) as *const _);
            va = _mm512_add_epi64(va, v);
            vb = _mm512_add_epi64(vb, va);
            _mm512_stream_si512(dst.add(head + 64 * (i - 1)) as *mut _, _mm512_permutex2var_epi32(prev, idx, v));
            prev = v;
        }
        let done = head + 64 * (blocks - 1);
        std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), 64 * blocks - done);
        _mm_sfence();
        _mm512_storeu_si512(a.as_mut_ptr() as *mut _, va);
        _mm512_storeu_si512(b.as_mut_ptr() as *mut _, vb);
        return;
    }
    let stream = dst as usize % 64 == 0 && !dst.is_null();
    for i in 0..blocks {
        let v = _mm512_loadu_si512(src.add(64 * i) as *const _);
        va = _mm512_add_epi64(va, v);
        vb = _mm512_add_epi64(vb, va);
        if dst.is_null() {
            continue;
        }
        if stream {
            _mm512_stream_si512(dst.add(64 * i) as *mut _, v);
        } else {
            _mm512_storeu_si512(dst.add(64 * i) as *mut _, v);
        }
    }
    if stream {
        // Non-temporal stores are weakly ordered: fence before anyone else reads them.
        _mm_sfence();
    }
    _mm512_storeu_si512(a.as_mut_ptr() as *mut _, va);
    _mm512_storeu_si512(b.as_mut_ptr() as *mut _, vb);
}

/// The checksum of one byte string.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h = Hasher::default();
    h.update(bytes);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_sees_a_flipped_bit_and_does_not_depend_on_the_pieces() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let base = checksum(&data);
        for i in [0, 31, 32, 500, 999] {
            let mut d = data.clone();
            d[i] ^= 0x10;
            assert_ne!(checksum(&d), base, "bit flip at {i}");
        }
        for cuts in [vec![1, 2, 3], vec![31, 33, 64], vec![500], vec![0, 999]] {
            let mut h = Hasher::default();
            let mut at = 0;
            for c in cuts.into_iter().chain([1000]) {
                h.update(&data[at..c]);
                at = c;
            }
            assert_eq!(h.finish(), base);
        }
        // Copying while hashing gives the same copy and the same checksum, in any pieces and
        // to a destination on or off the 64-byte grid.
        for shift in [0, 4, 16, 36, 60] {
            for cuts in [vec![1000], vec![64, 640, 1000], vec![3, 130, 1000]] {
                let mut buf = vec![0u8; 1000 + 128];
                let off = (64 - buf.as_ptr() as usize % 64) % 64 + shift;
                let (mut h, mut at) = (Hasher::default(), 0);
                for c in cuts {
                    h.copy_from(&mut buf[off + at..off + c], &data[at..c]);
                    at = c;
                }
                assert_eq!((h.finish(), &buf[off..off + 1000]), (base, &data[..]), "copy_from, destination 64k + {shift}");
            }
        }
        let mut swapped = data[500..].to_vec();
        swapped.extend(&data[..500]);
        assert_ne!(checksum(&swapped), base);
    }
}
