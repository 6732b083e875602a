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
    let total = offset;
    let payload_checksum = checksum(arrays.iter().map(|a| as_bytes(a)));
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
    h.extend_from_slice(&payload_checksum.to_le_bytes());
    debug_assert_eq!(h.len(), FIXED - 8);
    let header_checksum = checksum([&h[..]].into_iter());
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

/// Write the image of `state` to `w`: header, table, then each payload at its aligned offset.
/// The payloads go out straight from the state's memory (no intermediate copy).
pub fn write_state(w: &mut impl Write, state: &State, fingerprint: Fingerprint) -> Result<()> {
    let lay = layout(state, fingerprint);
    w.write_all(&lay.header)?;
    let mut at = lay.header.len();
    let zeros = [0u8; ALIGN];
    for (a, span) in arrays(state).iter().zip(&lay.spans) {
        w.write_all(&zeros[..span.offset as usize - at])?;
        w.write_all(as_bytes(a))?;
        at = span.offset as usize + 4 * a.len();
    }
    w.write_all(&zeros[..lay.total - at])?;
    Ok(())
}

/// The validated header of an image: everything needed to rebuild the state from its bytes.
pub struct Header {
    pub position: usize,
    /// Per layer: its kind and the spans of its two arrays; then the logits' span.
    spans: Vec<Span>,
    kinds: Vec<u32>,
    pub total: usize,
    payload_checksum: u64,
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
    if checksum([&bytes[..FIXED - 8]].into_iter()) != u64::from_le_bytes(bytes[FIXED - 8..FIXED].try_into().unwrap()) {
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
    let (total, payload_checksum) = (u64_at(64) as usize, u64_at(72));
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
        if (s.offset as usize) < table_end || s.offset as usize % ALIGN != 0 || end as usize > total {
            bail!("malformed state: a payload at byte {} of {} values lies outside the image of {total} bytes", s.offset, s.count);
        }
    }
    Ok(Header { position, spans, kinds, total, payload_checksum })
}

impl Header {
    /// The state, its arrays copied out of `bytes` (the whole image) after the payload
    /// checksum was verified.
    fn rebuild(&self, bytes: &[u8]) -> Result<State> {
        if bytes.len() < self.total {
            bail!("truncated state: {} bytes, the header announces {}", bytes.len(), self.total);
        }
        let slice = |s: &Span| &bytes[s.offset as usize..s.offset as usize + 4 * s.count as usize];
        if checksum(self.spans.iter().map(slice)) != self.payload_checksum {
            bail!("corrupt state: the payload checksum does not match");
        }
        let array = |s: &Span| -> Vec<f32> {
            let mut v = vec![0f32; s.count as usize];
            // SAFETY: `slice(s)` holds exactly 4 · count bytes, the little-endian f32 values.
            unsafe { std::ptr::copy_nonoverlapping(slice(s).as_ptr(), v.as_mut_ptr() as *mut u8, 4 * v.len()) };
            v
        };
        let layers = self
            .kinds
            .iter()
            .enumerate()
            .map(|(i, &kind)| {
                let (a, b) = (array(&self.spans[2 * i]), array(&self.spans[2 * i + 1]));
                if kind == KIND_LINEAR {
                    LayerState::Linear { conv: a, recurrent: b }
                } else {
                    LayerState::Full { k: a, v: b }
                }
            })
            .collect();
        Ok(State { position: self.position, layers, last_logits: array(&self.spans[self.spans.len() - 1]) })
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

/// Save `state` to `path` (created or replaced).
pub fn save(path: &Path, state: &State, fingerprint: Fingerprint) -> Result<()> {
    let file = std::fs::File::create(path).with_context(|| format!("creating state file {}", path.display()))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    write_state(&mut w, state, fingerprint).with_context(|| format!("writing state file {}", path.display()))?;
    w.flush().with_context(|| format!("writing state file {}", path.display()))?;
    Ok(())
}

/// Load a state file written by `save`, for the model `cfg` with `fingerprint`, returning
/// the state and the time spent reading (map + checks) and rebuilding.
pub fn load(path: &Path, fingerprint: Fingerprint, cfg: &Qwen35Config) -> Result<(State, Duration, Duration)> {
    let t = Instant::now();
    let file = std::fs::File::open(path).with_context(|| format!("opening state file {}", path.display()))?;
    // SAFETY: the map is read-only and dropped before this function returns; a file changed
    // underneath would at worst fail the checksum.
    let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("mapping state file {}", path.display()))?;
    let header = parse_header(&map, fingerprint, cfg).with_context(|| format!("state file {}", path.display()))?;
    let read = t.elapsed();
    let t = Instant::now();
    let state = header.rebuild(&map).with_context(|| format!("state file {}", path.display()))?;
    Ok((state, read, t.elapsed()))
}

/// Send a state over a byte stream (a socket): the image, as `write_state` writes it.
pub fn send(stream: &mut impl Write, state: &State, fingerprint: Fingerprint) -> Result<()> {
    let mut w = std::io::BufWriter::with_capacity(1 << 20, stream);
    write_state(&mut w, state, fingerprint)?;
    w.flush()?;
    Ok(())
}

/// Receive one state from a byte stream, returning it with the time spent receiving (header
/// checks included) and rebuilding.
pub fn receive(stream: &mut impl Read, fingerprint: Fingerprint, cfg: &Qwen35Config) -> Result<(State, Duration, Duration)> {
    let t = Instant::now();
    let mut bytes = vec![0u8; FIXED];
    stream.read_exact(&mut bytes).context("receiving a state header: the stream ended")?;
    let table_end = check_fixed(&bytes, fingerprint, cfg)?;
    bytes.resize(table_end, 0);
    stream.read_exact(&mut bytes[FIXED..]).context("receiving a state's layer table: the stream ended")?;
    let header = parse_header(&bytes, fingerprint, cfg)?;
    bytes.resize(header.total, 0);
    stream.read_exact(&mut bytes[table_end..]).with_context(|| format!("receiving a state of {} bytes: the stream ended early", header.total))?;
    let read = t.elapsed();
    let t = Instant::now();
    let state = header.rebuild(&bytes)?;
    Ok((state, read, t.elapsed()))
}

fn as_bytes(a: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the format is
    // little-endian, the byte order of every target tandem builds for (checked below).
    unsafe { std::slice::from_raw_parts(a.as_ptr() as *const u8, std::mem::size_of_val(a)) }
}
#[cfg(target_endian = "big")]
compile_error!("the state format is little-endian and written from memory as is");

/// A 64-bit checksum of byte slices taken in order (four independent multiply-rotate lanes over
/// 8-byte words, so it runs at memory speed; a flipped bit anywhere changes it).
pub fn checksum<'a>(parts: impl Iterator<Item = &'a [u8]>) -> u64 {
    const K: [u64; 4] = [0x9E37_79B9_7F4A_7C15, 0xC2B2_AE3D_27D4_EB4F, 0x1656_67B1_9E37_79F9, 0x27D4_EB2F_1656_67C5];
    let mut lanes = K;
    let mut len = 0u64;
    for part in parts {
        len = len.wrapping_add(part.len() as u64).rotate_left(7);
        let words = part.chunks_exact(32);
        let tail = words.remainder();
        for w in words {
            for (j, lane) in lanes.iter_mut().enumerate() {
                let x = u64::from_le_bytes(w[8 * j..8 * j + 8].try_into().unwrap());
                *lane = (lane.rotate_left(29) ^ x).wrapping_mul(K[j] | 1);
            }
        }
        for (i, &b) in tail.iter().enumerate() {
            lanes[i % 4] = (lanes[i % 4].rotate_left(29) ^ b as u64).wrapping_mul(K[i % 4] | 1);
        }
    }
    let mut h = len;
    for (j, lane) in lanes.iter().enumerate() {
        h = (h ^ lane.rotate_left(13 * j as u32 + 1)).wrapping_mul(K[0] | 1);
    }
    h ^ (h >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_sees_a_flipped_bit_and_the_order_of_parts() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let base = checksum([&data[..]].into_iter());
        for i in [0, 31, 32, 500, 999] {
            let mut d = data.clone();
            d[i] ^= 0x10;
            assert_ne!(checksum([&d[..]].into_iter()), base, "bit flip at {i}");
        }
        assert_ne!(checksum([&data[..500], &data[500..]].into_iter()), checksum([&data[500..], &data[..500]].into_iter()));
    }
}
