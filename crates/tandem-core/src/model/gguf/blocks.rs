//! GGML's element types: plain floats, and blocks of quantized values with their own scales.
//! A row of a quantized tensor is a run of blocks (32 values for the `Qn_0`/`Qn_1` types, 256
//! for the k-quants). The dequantizers here are the plain definitions, one value at a time in
//! the order the format defines; fast kernels are tested against them, and they are checked
//! against the `gguf` Python package's own dequantizers on random blocks
//! (`tests/fixtures/gguf/blocks.gguf`, written by `scripts/gguf_fixtures.py`).

use anyhow::{bail, Result};
use half::{bf16, f16};

/// An element type of a GGUF tensor that tandem reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    /// 32 values: an f16 scale and 4-bit values, offset by 8.
    Q4_0,
    /// 32 values: an f16 scale and minimum, 4-bit values.
    Q4_1,
    /// 32 values: an f16 scale, 5-bit values (the fifth bits apart), offset by 16.
    Q5_0,
    /// 32 values: an f16 scale and minimum, 5-bit values.
    Q5_1,
    /// 32 values: an f16 scale and 8-bit values.
    Q8_0,
    /// 256 values: an f16 scale and minimum for the block, 6-bit scales and minimums for its
    /// eight runs of 32, 4-bit values.
    Q4_K,
    /// As `Q4_K` with a fifth bit per value.
    Q5_K,
    /// 256 values: 6-bit values, an 8-bit scale per run of 16, one f16 scale.
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

    /// Values per block (1 for the float types).
    pub fn block_elements(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => 32,
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q5_0 => 2 + 4 + 16,
            GgmlType::Q5_1 => 2 + 2 + 4 + 16,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q4_K => 2 + 2 + 12 + 128,
            GgmlType::Q5_K => 2 + 2 + 12 + 32 + 128,
            GgmlType::Q6_K => 128 + 64 + 16 + 2,
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// `out.len()` values from `bytes`, which hold exactly that many of type `t` (whole blocks).
///
/// # Panics
/// If the lengths do not match: callers size both from a checked tensor table.
pub fn dequantize(t: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let (be, bb) = (t.block_elements(), t.block_bytes());
    assert!(out.len().is_multiple_of(be) && bytes.len() == out.len() / be * bb, "{} bytes do not hold {} {} values", bytes.len(), out.len(), t.name());
    match t {
        GgmlType::F32 => out.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(o, b)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => out.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(o, b)| *o = f16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::BF16 => out.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(o, b)| *o = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        _ => {
            for (block, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
                dequantize_block(t, block, y);
            }
        }
    }
}

/// One block of a quantized type into `y` (its `block_elements()` values).
pub fn dequantize_block(t: GgmlType, b: &[u8], y: &mut [f32]) {
    match t {
        GgmlType::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                y[j] = ((qs[j] & 0xf) as i32 - 8) as f32 * d;
                y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qs = &b[4..20];
            for j in 0..16 {
                y[j] = (qs[j] & 0xf) as f32 * d + m;
                y[j + 16] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        GgmlType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            for j in 0..16 {
                // Value j's fifth bit is bit j of qh, value j + 16's is bit j + 16.
                let hi0 = ((qh >> j) & 1) << 4;
                let hi1 = ((qh >> (j + 16)) & 1) << 4;
                y[j] = (((qs[j] & 0xf) as u32 | hi0) as i32 - 16) as f32 * d;
                y[j + 16] = (((qs[j] >> 4) as u32 | hi1) as i32 - 16) as f32 * d;
            }
        }
        GgmlType::Q5_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let qs = &b[8..24];
            for j in 0..16 {
                let hi0 = ((qh >> j) & 1) << 4;
                let hi1 = ((qh >> (j + 16)) & 1) << 4;
                y[j] = ((qs[j] & 0xf) as u32 | hi0) as f32 * d + m;
                y[j + 16] = ((qs[j] >> 4) as u32 | hi1) as f32 * d + m;
            }
        }
        GgmlType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let (qh, qs) = if t == GgmlType::Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            // Four runs of 64 values: 32 bytes of qs each, low nibbles then high nibbles, each
            // half with its own scale and minimum; Q5_K's fifth bits are bits 2i and 2i + 1 of
            // qh's bytes for run i.
            for run in 0..4 {
                let (sc0, m0) = scale_min_k4(2 * run, scales);
                let (sc1, m1) = scale_min_k4(2 * run + 1, scales);
                let (d0, min0) = (d * sc0 as f32, dmin * m0 as f32);
                let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
                let q = &qs[32 * run..32 * run + 32];
                for l in 0..32 {
                    let (mut lo, mut hi) = ((q[l] & 0xf) as u32, (q[l] >> 4) as u32);
                    if let Some(qh) = qh {
                        lo |= ((qh[l] as u32 >> (2 * run)) & 1) << 4;
                        hi |= ((qh[l] as u32 >> (2 * run + 1)) & 1) << 4;
                    }
                    y[64 * run + l] = d0 * lo as f32 - min0;
                    y[64 * run + 32 + l] = d1 * hi as f32 - min1;
                }
            }
        }
        GgmlType::Q6_K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            // Two halves of 128 values: 64 bytes of low nibbles, 32 of high bit pairs, 8 scales.
            for half in 0..2 {
                let (ql, qh, sc) = (&ql[64 * half..], &qh[32 * half..], &sc[8 * half..]);
                let y = &mut y[128 * half..];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    let s = |i: usize| d * (sc[i] as i8) as f32;
                    y[l] = s(is) * q1 as f32;
                    y[l + 32] = s(is + 2) * q2 as f32;
                    y[l + 64] = s(is + 4) * q3 as f32;
                    y[l + 96] = s(is + 6) * q4 as f32;
                }
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => unreachable!("float types are not blocks"),
    }
}

/// Scale and minimum `j` (0..8) of a k-quant block's 12 packed bytes: 6 bits each, the first
/// four pairs in the low bits of bytes 0-7, the last four split between the low and high
/// nibbles of bytes 8-11 and the top two bits of bytes 0-7.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}
