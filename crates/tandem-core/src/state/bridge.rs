//! The state bridge: a request's `State` as a versioned binary image, and the ways to move it
//! between engines (a file that the reader memory-maps, a byte stream over a socket; within a
//! process the `State` itself is moved). The format is documented in docs/state-format.md.
//!
//! A reader checks everything before it builds a state: magic, version, the model
//! fingerprint (a state is never applied to another model), the header's own checksum, the
//! layer table against the model's shapes, every payload's bounds, and the payloads'
//! checksum. A state that fails any check is an error naming what failed; nothing is applied.

use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::{LayerState, State};
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
    let arrays = arrays(state);
    let table_end = FIXED + ENTRY * state.layers.len();
    let mut offset = table_end.next_multiple_of(ALIGN);
    let spans: Vec<Span> = arrays
        .iter()
        .map(|a| {
            let s = Span { offset: offset as u64, count: a.len() as u64 };
            offset = (offset + 4 * a.len()).next_multiple_of(ALIGN);
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
    h.extend_from_slice(&(state.position as u64).to_le_bytes());
    h.extend_from_slice(&(state.layers.len() as u32).to_le_bytes());
    h.extend_from_slice(&DTYPE_F32.to_le_bytes());
    let logits = spans[spans.len() - 1];
    h.extend_from_slice(&logits.offset.to_le_bytes());
    h.extend_from_slice(&logits.count.to_le_bytes());
    h.extend_from_slice(&(total as u64).to_le_bytes());
    h.extend_from_slice(&0u64.to_le_bytes());
    debug_assert_eq!(h.len(), FIXED - 8);
    let header_checksum = checksum(&h);
    h.extend_from_slice(&header_checksum.to_le_bytes());
    for (i, l) in state.layers.iter().enumerate() {
        let kind = match l {
            LayerState::Linear { .. } => KIND_LINEAR,
            LayerState::Full { .. } => KIND_FULL,
        };
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
        let mut spare: Vec<Vec<f32>> = Vec::new();
        if let Some(old) = reuse {
            for l in old.layers {
                match l {
                    LayerState::Linear { conv, recurrent } => spare.extend([conv, recurrent]),
                    LayerState::Full { k, v } => spare.extend([k, v]),
                }
            }
            spare.push(old.last_logits);
        }
        spare.reverse();
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
            let mut v = spare.pop().unwrap_or_default();
            v.clear();
            v.reserve_exact(count);
            // SAFETY: the spare capacity holds `count` f32 values; every byte of it is written
            // by read_exact below before `set_len` exposes it.
            let dst = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, 4 * count) };
            for piece in dst.chunks_mut(CHUNK) {
                r.read_exact(piece).map_err(truncated)?;
                hash.update(piece);
            }
            // SAFETY: all 4 · count bytes were just written.
            unsafe { v.set_len(count) };
            arrays.push(v);
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
        let logits = arrays.pop().expect("the logits span is always there");
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
                    LayerState::Full { k: a, v: b }
                }
            })
            .collect();
        Ok(State { position: self.position, layers, last_logits: logits })
    }
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

/// Save `state` to `path`. An existing file is overwritten in place and then cut to length,
/// not truncated first: rewriting pages the file already has is much cheaper than getting new
/// ones (a pipeline reuses its state files for that reason).
pub fn save(path: &Path, state: &State, fingerprint: Fingerprint) -> Result<()> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("creating state file {}", path.display()))?;
    // Small buffer: the header and padding are gathered, payload pieces go straight through.
    let mut w = std::io::BufWriter::with_capacity(16 << 10, file);
    let written = write_state(&mut w, state, fingerprint).and_then(|()| Ok(w.into_inner().map_err(|e| e.into_error())?));
    let file = written.with_context(|| format!("writing state file {}", path.display()))?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let total = layout_size(state) as u64;
    if len != total {
        file.set_len(total).with_context(|| format!("setting the length of state file {}", path.display()))?;
    }
    Ok(())
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

/// Bytes of the image of `state`.
pub fn layout_size(state: &State) -> usize {
    layout(state, 0).total
}

/// Load a state file written by `save`, for the model `cfg` with `fingerprint`, returning
/// the state and the time spent reading (map + header checks) and rebuilding (payloads copied
/// into the state and checksummed). `reuse`: see `receive`.
pub fn load(path: &Path, fingerprint: Fingerprint, cfg: &Qwen35Config, reuse: Option<State>) -> Result<(State, Duration, Duration)> {
    let t = Instant::now();
    let file = std::fs::File::open(path).with_context(|| format!("opening state file {}", path.display()))?;
    // SAFETY: the map is read-only and dropped before this function returns; a file changed
    // underneath would at worst fail the checksum.
    // Populated: the kernel maps every page at once rather than on a fault per page.
    let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }.with_context(|| format!("mapping state file {}", path.display()))?;
    let header = parse_header(&map, fingerprint, cfg).with_context(|| format!("state file {}", path.display()))?;
    if map.len() != header.total {
        bail!("state file {}: {} bytes, its header announces {} (truncated or extended)", path.display(), map.len(), header.total);
    }
    let read = t.elapsed();
    let t = Instant::now();
    let state = header.read_body(&mut &map[header.table_end..], reuse).with_context(|| format!("state file {}", path.display()))?;
    Ok((state, read, t.elapsed()))
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
        self.blocks(&data[..whole]);
        let tail = &data[whole..];
        self.buf[..tail.len()].copy_from_slice(tail);
        self.buffered = tail.len();
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
        let mut swapped = data[500..].to_vec();
        swapped.extend(&data[..500]);
        assert_ne!(checksum(&swapped), base);
    }
}
