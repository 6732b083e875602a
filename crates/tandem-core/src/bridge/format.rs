//! The state as bytes (docs/state-format.md): a versioned header naming the model by its
//! fingerprint, a layer table, then each array at a 64-byte aligned offset, then a checksum of
//! the payloads. A reader checks everything before it builds a state: magic, version, the
//! model fingerprint (a state is never applied to another model), the header's own checksum,
//! the layer table against the model's shapes, every payload's bounds, and the payloads'
//! checksum. A state that fails any check is an error naming what failed; nothing is applied.

use std::io::{Read, Write};

use anyhow::{bail, Context, Result};

use super::checksum::{checksum, Hasher};
use super::Fingerprint;
use crate::model::config::{LayerType, Qwen35Config};
use crate::state::{LayerState, State, StateArray};

pub const MAGIC: [u8; 8] = *b"TNDMSTAT";
pub const VERSION: u32 = 1;
/// Fixed part of the header; the layer table follows, then the payloads.
pub(super) const FIXED: usize = 88;
/// One layer table entry: kind, reserved, then (offset, count) of its two arrays.
const ENTRY: usize = 40;
/// Payloads start on 64-byte boundaries, so a memory-mapped reader can use them in place.
const ALIGN: usize = 64;
pub(super) const KIND_LINEAR: u32 = 1;
pub(super) const KIND_FULL: u32 = 2;
const DTYPE_F32: u32 = 1;
/// The payload checksum, after the payloads.
pub(super) const TRAILER: usize = 8;
/// Payloads are checksummed and copied in pieces of this size, each while it is in cache.
pub(super) const CHUNK: usize = 256 << 10;

/// Where one array lives in the image: byte offset from the start, number of f32 values.
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    pub(super) offset: u64,
    pub(super) count: u64,
}

/// The header and layer table of a state image, and where its payloads go.
pub(super) struct Layout {
    pub(super) header: Vec<u8>,
    /// Per array (layer by layer, two each, then the logits): its span.
    pub(super) spans: Vec<Span>,
    pub(super) total: usize,
}

/// The arrays of a state in image order: per layer its two arrays, then the last logits.
pub(super) fn arrays(state: &State) -> Vec<&[f32]> {
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

pub(super) fn layout(state: &State, fingerprint: Fingerprint) -> Layout {
    let lens: Vec<usize> = arrays(state).iter().map(|a| a.len()).collect();
    layout_of(&kinds(state), &lens, state.position, fingerprint)
}

/// The layer table's kind code of each layer of `state`.
pub(super) fn kinds(state: &State) -> Vec<u32> {
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
pub(super) fn layout_of(kinds: &[u32], lens: &[usize], position: usize, fingerprint: Fingerprint) -> Layout {
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

/// The layout of the image of a state that has applied a prompt of `prompt` tokens (K/V
/// sized for them, the last logits present).
pub(super) fn prefilled_layout(cfg: &Qwen35Config, prompt: usize, fingerprint: Fingerprint) -> Layout {
    let empty = State::new(cfg);
    let kinds = kinds(&empty);
    let kv = prompt * cfg.num_key_value_heads * cfg.head_dim;
    // Two arrays per layer (K/V sized for the prompt), then the logits.
    let mut lens: Vec<usize> = arrays(&empty).iter().zip(kinds.iter().flat_map(|&k| [k, k])).map(|(a, k)| if k == KIND_FULL { kv } else { a.len() }).collect();
    lens.push(cfg.vocab_size);
    layout_of(&kinds, &lens, prompt, fingerprint)
}

/// The size in bytes of the image of a state that has applied `prompt` tokens: what a receiver
/// reserves for it before it is prefilled.
pub fn prefilled_image_bytes(cfg: &Qwen35Config, prompt: usize) -> usize {
    prefilled_layout(cfg, prompt, 0).total
}

/// The size in bytes of the image of `state`.
pub fn image_bytes(state: &State) -> usize {
    layout(state, 0).total
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
    pub(super) spans: Vec<Span>,
    pub(super) kinds: Vec<u32>,
    pub total: usize,
    pub(super) table_end: usize,
}

/// A state written for another model, or in another version of the format: not damaged, but
/// not this process's to apply (a directory of them may be shared).
#[derive(Debug)]
pub struct ForeignState(pub String);

impl std::fmt::Display for ForeignState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ForeignState {}

/// Check the fixed part of a header (the first `FIXED` bytes); returns where its layer table
/// ends.
///
/// A state of another model or format version is refused with a `ForeignState` error (a file
/// that someone else may still use); anything else wrong is damage.
pub(super) fn check_fixed(bytes: &[u8], expected: Fingerprint, cfg: &Qwen35Config) -> Result<usize> {
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
        return Err(ForeignState(format!("state format version {version}; this tandem reads version {VERSION}")).into());
    }
    if checksum(&bytes[..FIXED - 8]) != u64::from_le_bytes(bytes[FIXED - 8..FIXED].try_into().unwrap()) {
        bail!("corrupt state: the header checksum does not match");
    }
    let fingerprint = u128::from_le_bytes(bytes[16..32].try_into().unwrap());
    if fingerprint != expected {
        return Err(ForeignState(format!("the state was made by another model (fingerprint {fingerprint:032x}; this model is {expected:032x}): it cannot be applied here")).into());
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
pub(super) fn parse_header(bytes: &[u8], expected: Fingerprint, cfg: &Qwen35Config) -> Result<Header> {
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
    pub(super) fn read_body(&self, r: &mut impl Read, reuse: Option<State>) -> Result<State> {
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
    pub(super) fn assemble(&self, mut arrays: Vec<StateArray>) -> State {
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
pub(super) fn filled(spare: &mut Vec<Vec<f32>>, count: usize, fill: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<Vec<f32>> {
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
pub(super) fn spare_buffers(reuse: Option<State>) -> Vec<Vec<f32>> {
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

pub(super) fn as_bytes(a: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the format is
    // little-endian, the byte order of every target tandem builds for (checked below).
    unsafe { std::slice::from_raw_parts(a.as_ptr() as *const u8, std::mem::size_of_val(a)) }
}
#[cfg(target_endian = "big")]
compile_error!("the state format is little-endian and written from memory as is");

