//! State slots: the fixed-size part of a sequence's state (every DeltaNet layer's conv window
//! and recurrent state) in one piece of the engine's slot pool, taken when the state is made
//! and given back when it is dropped. One slot per sequence, whatever its length; a serving
//! engine limits their number from its memory budget (`Pipeline`'s capacity line), and a
//! request waits for a slot as it waits for K/V blocks (`PoolFull`).
//!
//! A slot holds the conv windows first (f32, layer after layer), then the recurrent states, in
//! the engine's state dtype: f32, or bf16 (half the bytes that every decode step reads and
//! writes per sequence; the kernels widen each value to f32 as they load it and round once as
//! they store it). One piece also moves in one copy: to and from the host, and between engines.

use std::sync::Arc;

use anyhow::{bail, Result};
use cudarc::driver::CudaContext;

use super::device_pool::{DevicePool, PoolLevel};
use crate::model::config::{LayerType, Qwen35Config};
use crate::model::tensor::{bf16_to_f32, f32_to_bf16};

/// Slots per allocation when the pool grows: one (a slot of the 9B is 50 MB; a one-sequence
/// engine should not take 64 of them).
const SLAB_SLOTS: usize = 1;

/// Bytes per allocation of a pool of snapshot slots (`SlotPool::for_snapshots`), at least one
/// slot: a prefix cache takes snapshots as requests come, and each allocation stalls the
/// engine that takes the snapshot (on an H200, a prefill engine of the 0.8B model spent
/// 0.1-0.8 ms a snapshot, mostly there). The free slots of the last allocation lie outside the
/// cache's budget: at most this much.
const SNAPSHOT_SLAB_BYTES: usize = 128 << 20;

/// The element type of the recurrent states on the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StateDtype {
    /// Exactly the CPU engine's state (the default).
    #[default]
    F32,
    /// Rounded to bf16 after each forward call: half the bytes.
    Bf16,
}

impl StateDtype {
    pub fn bytes(self) -> usize {
        match self {
            StateDtype::F32 => 4,
            StateDtype::Bf16 => 2,
        }
    }

    pub fn parse(s: &str) -> Result<StateDtype> {
        match s {
            "f32" | "float32" => Ok(StateDtype::F32),
            "bf16" | "bfloat16" => Ok(StateDtype::Bf16),
            _ => bail!("state dtype {s:?}: choose f32 or bf16"),
        }
    }
}

impl std::fmt::Display for StateDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StateDtype::F32 => "f32",
            StateDtype::Bf16 => "bf16",
        })
    }
}

/// Where a slot's arrays are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLayout {
    /// DeltaNet layers.
    pub linear_layers: usize,
    /// f32 values of one layer's conv window.
    pub conv_values: usize,
    /// Values of one layer's recurrent state.
    pub recurrent_values: usize,
    pub dtype: StateDtype,
}

impl SlotLayout {
    pub fn new(c: &Qwen35Config, dtype: StateDtype) -> SlotLayout {
        SlotLayout {
            linear_layers: c.layer_types.iter().filter(|t| **t == LayerType::LinearAttention).count(),
            conv_values: c.linear_conv_kernel_dim * c.linear_conv_dim(),
            recurrent_values: c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim,
            dtype,
        }
    }

    /// Bytes of one slot's arrays.
    pub fn bytes(&self) -> usize {
        self.linear_layers * (4 * self.conv_values + self.dtype.bytes() * self.recurrent_values)
    }

    /// Where DeltaNet layer `i`'s conv window starts, in bytes from the slot's start.
    pub fn conv_at(&self, i: usize) -> usize {
        4 * self.conv_values * i
    }

    /// Where DeltaNet layer `i`'s recurrent state starts, in bytes from the slot's start.
    pub fn recurrent_at(&self, i: usize) -> usize {
        4 * self.conv_values * self.linear_layers + self.dtype.bytes() * self.recurrent_values * i
    }

    /// The slot's bytes for host arrays `layers` (each DeltaNet layer's conv window and
    /// recurrent state, f32): the recurrent states rounded to the dtype (nearest even).
    /// (Written in place, not pushed byte by byte from an iterator: a 9B state is some 50 MB.)
    pub fn image<'a>(&self, layers: impl Iterator<Item = (&'a [f32], &'a [f32])>) -> Vec<u8> {
        let mut image = vec![0u8; self.bytes()];
        for (i, (conv, recurrent)) in layers.enumerate().take(self.linear_layers) {
            let conv_out = &mut image[self.conv_at(i)..self.conv_at(i) + 4 * self.conv_values];
            for (out, v) in conv_out.chunks_exact_mut(4).zip(conv) {
                out.copy_from_slice(&v.to_le_bytes());
            }
            let at = self.recurrent_at(i);
            let recurrent_out = &mut image[at..at + self.dtype.bytes() * self.recurrent_values];
            match self.dtype {
                StateDtype::F32 => recurrent_out.chunks_exact_mut(4).zip(recurrent).for_each(|(out, v)| out.copy_from_slice(&v.to_le_bytes())),
                StateDtype::Bf16 => recurrent_out.chunks_exact_mut(2).zip(recurrent).for_each(|(out, v)| out.copy_from_slice(&f32_to_bf16(*v).to_le_bytes())),
            }
        }
        image
    }

    /// The inverse of `image`: each DeltaNet layer's conv window and recurrent state as f32.
    pub fn layers(&self, image: &[u8]) -> Vec<(Vec<f32>, Vec<f32>)> {
        debug_assert_eq!(image.len(), self.bytes());
        let f32s = |b: &[u8]| b.chunks_exact(4).map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect::<Vec<f32>>();
        (0..self.linear_layers)
            .map(|i| {
                let conv = f32s(&image[self.conv_at(i)..self.conv_at(i) + 4 * self.conv_values]);
                let bytes = &image[self.recurrent_at(i)..self.recurrent_at(i) + self.dtype.bytes() * self.recurrent_values];
                let recurrent = match self.dtype {
                    StateDtype::F32 => f32s(bytes),
                    StateDtype::Bf16 => bytes.chunks_exact(2).map(|h| bf16_to_f32(u16::from_le_bytes([h[0], h[1]]))).collect(),
                };
                (conv, recurrent)
            })
            .collect()
    }
}

/// An engine's pool of state slots; shared with the states that hold one.
pub struct SlotPool {
    pieces: DevicePool,
    layout: SlotLayout,
    /// Where in a piece the room past the slot begins (a snapshot's logits), if there is any.
    tail_at: Option<usize>,
}

impl SlotPool {
    /// An empty pool on the GPU of `ctx` for slots of `layout`.
    pub fn new(ctx: &Arc<CudaContext>, layout: SlotLayout) -> Result<SlotPool> {
        Ok(SlotPool { pieces: DevicePool::new(ctx, "state slots", layout.bytes(), SLAB_SLOTS)?, layout, tail_at: None })
    }

    /// An empty pool for snapshots' slots, each with `tail_bytes` past it (for the snapshot's
    /// logits), which grows by several slots at a time.
    pub fn for_snapshots(ctx: &Arc<CudaContext>, layout: SlotLayout, tail_bytes: usize) -> Result<SlotPool> {
        let tail_at = layout.bytes().next_multiple_of(256);
        let piece = tail_at + tail_bytes;
        Ok(SlotPool { pieces: DevicePool::new(ctx, "snapshot slots", piece, SNAPSHOT_SLAB_BYTES / piece.max(1))?, layout, tail_at: Some(tail_at) })
    }

    pub fn layout(&self) -> &SlotLayout {
        &self.layout
    }

    pub fn ordinal(&self) -> usize {
        self.pieces.ordinal()
    }

    /// Let the pool hold at most `slots`.
    pub fn set_limit(&self, slots: Option<usize>) {
        self.pieces.set_limit(slots);
    }

    pub fn level(&self) -> PoolLevel {
        self.pieces.level()
    }

    /// Slots states could still take under the limit (None: no limit set).
    pub fn available(&self) -> Option<usize> {
        self.pieces.available()
    }

    /// Allocate from now on memory another process can map (`DevicePool::set_exportable`).
    pub fn set_exportable(&self) {
        self.pieces.set_exportable();
    }

    /// The pool's allocations, (address, bytes) each.
    pub fn slabs(&self) -> Vec<(u64, usize)> {
        self.pieces.slabs()
    }
}

/// One state's slot of a pool; given back when dropped. Its bytes are what the last holder left
/// until the state writes them (zeroes, a host state's image, another state's slot).
pub struct StateSlot {
    pool: Arc<SlotPool>,
    addr: u64,
}

impl StateSlot {
    /// A slot of `pool` (a `PoolFull` error where the pool is at its limit).
    pub fn take(pool: &Arc<SlotPool>) -> Result<StateSlot> {
        let addr = pool.pieces.take(1)?[0];
        Ok(StateSlot { pool: pool.clone(), addr })
    }

    /// The slot's first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn layout(&self) -> &SlotLayout {
        &self.pool.layout
    }

    /// Bytes it takes in its pool (the slot and any room past it).
    pub fn bytes(&self) -> usize {
        self.pool.pieces.piece_bytes()
    }

    /// The room past the slot, in a pool that has it (`SlotPool::for_snapshots`).
    pub fn tail(&self) -> Option<u64> {
        self.pool.tail_at.map(|t| self.addr + t as u64)
    }

    /// DeltaNet layer `i`'s conv window (f32).
    pub fn conv(&self, i: usize) -> u64 {
        self.addr + self.layout().conv_at(i) as u64
    }

    /// DeltaNet layer `i`'s recurrent state (in the layout's dtype).
    pub fn recurrent(&self, i: usize) -> u64 {
        self.addr + self.layout().recurrent_at(i) as u64
    }
}

impl Drop for StateSlot {
    fn drop(&mut self) {
        self.pool.pieces.give(&mut vec![self.addr]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host state's arrays laid out in a slot and read back: exactly for f32; for bf16 each
    /// recurrent value is its nearest bf16 (so within 2^-9 of it, relatively), the conv windows
    /// exact; the arrays at the offsets the kernels are given.
    #[test]
    fn a_slot_image_holds_a_host_states_arrays() {
        let c = Qwen35Config::preset("qwen3.5-0.8b").unwrap();
        for dtype in [StateDtype::F32, StateDtype::Bf16] {
            let l = SlotLayout::new(&c, dtype);
            assert_eq!(l.linear_layers, c.num_hidden_layers - c.num_full_attention_layers());
            let mut next = 0.37f32;
            let mut fill = |n: usize| -> Vec<f32> { (0..n).map(|_| { next = (next * 3.7 + 0.11).fract() - 0.5; next * 1000.0 }).collect() };
            let arrays: Vec<(Vec<f32>, Vec<f32>)> = (0..l.linear_layers).map(|_| (fill(l.conv_values), fill(l.recurrent_values))).collect();
            let image = l.image(arrays.iter().map(|(a, b)| (&a[..], &b[..])));
            assert_eq!(image.len(), l.bytes());
            // Layer 1's recurrent state where recurrent_at says.
            let at = l.recurrent_at(1);
            let first = match dtype {
                StateDtype::F32 => f32::from_le_bytes(image[at..at + 4].try_into().unwrap()),
                StateDtype::Bf16 => bf16_to_f32(u16::from_le_bytes(image[at..at + 2].try_into().unwrap())),
            };
            assert_eq!(first, match dtype { StateDtype::F32 => arrays[1].1[0], StateDtype::Bf16 => bf16_to_f32(f32_to_bf16(arrays[1].1[0])) });
            let back = l.layers(&image);
            for ((conv, rec), (conv0, rec0)) in back.iter().zip(&arrays) {
                assert_eq!(conv, conv0);
                match dtype {
                    StateDtype::F32 => assert_eq!(rec, rec0),
                    StateDtype::Bf16 => {
                        for (a, b) in rec.iter().zip(rec0) {
                            assert_eq!(*a, bf16_to_f32(f32_to_bf16(*b)));
                            assert!((a - b).abs() <= b.abs() / 256.0, "{a} vs {b}");
                        }
                    }
                }
            }
        }
        let l = SlotLayout::new(&c, StateDtype::Bf16);
        assert_eq!(l.bytes(), l.linear_layers * (4 * l.conv_values + 2 * l.recurrent_values));
    }
}
