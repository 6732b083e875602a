//! GGML's element types as a GGUF file names them: plain floats, and the block formats
//! (`model::blocks`, whose plain dequantizers are checked against the `gguf` Python package's
//! own on random blocks: `tests/fixtures/gguf/blocks.gguf`, written by
//! `scripts/gguf_fixtures.py`).

use anyhow::{bail, Result};
use half::{bf16, f16};

use crate::model::blocks::{self, BlockFormat};

/// An element type of a GGUF tensor that tandem reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    // The block formats (what each holds: model/blocks BlockFormat).
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl GgmlType {
    /// The type of GGML's id `id`, or an error naming it.
    pub fn from_id(id: u32) -> Result<GgmlType> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            10 | 11 => bail!("element type {} (GGML type {id}) is not supported yet: tandem reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K", if id == 10 { "Q2_K" } else { "Q3_K" }),
            _ => bail!("GGML element type {id} is not one tandem reads (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)"),
        })
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
        }
    }

    /// The block format of a quantized type (None for the float types).
    pub fn block_format(self) -> Option<BlockFormat> {
        Some(match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => return None,
            GgmlType::Q4_0 => BlockFormat::Q4_0,
            GgmlType::Q4_1 => BlockFormat::Q4_1,
            GgmlType::Q5_0 => BlockFormat::Q5_0,
            GgmlType::Q5_1 => BlockFormat::Q5_1,
            GgmlType::Q8_0 => BlockFormat::Q8_0,
            GgmlType::Q4_K => BlockFormat::Q4_K,
            GgmlType::Q5_K => BlockFormat::Q5_K,
            GgmlType::Q6_K => BlockFormat::Q6_K,
        })
    }

    /// The element type of block format `f`.
    pub fn of_blocks(f: BlockFormat) -> GgmlType {
        match f {
            BlockFormat::Q4_0 => GgmlType::Q4_0,
            BlockFormat::Q4_1 => GgmlType::Q4_1,
            BlockFormat::Q5_0 => GgmlType::Q5_0,
            BlockFormat::Q5_1 => GgmlType::Q5_1,
            BlockFormat::Q8_0 => GgmlType::Q8_0,
            BlockFormat::Q4_K => GgmlType::Q4_K,
            BlockFormat::Q5_K => GgmlType::Q5_K,
            BlockFormat::Q6_K => GgmlType::Q6_K,
        }
    }

    /// Values per block (1 for the float types).
    pub fn block_elements(self) -> usize {
        self.block_format().map_or(1, BlockFormat::elements)
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            _ => self.block_format().map_or(0, BlockFormat::bytes),
        }
    }
}

/// `out.len()` values from `bytes`, which hold exactly that many of type `t` (whole blocks).
///
/// # Panics
/// If the lengths do not match: callers size both from a checked tensor table.
pub fn dequantize(t: GgmlType, bytes: &[u8], out: &mut [f32]) {
    if t.block_format().is_none() {
        assert_eq!(bytes.len(), out.len() * t.block_bytes(), "{} bytes do not hold {} {} values", bytes.len(), out.len(), t.name());
    }
    match t {
        GgmlType::F32 => out.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(o, b)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => out.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(o, b)| *o = f16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::BF16 => out.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(o, b)| *o = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        _ => blocks::dequantize(t.block_format().expect("a quantized type"), bytes, out),
    }
}
