//! GGML's block formats: a row of a matrix as a run of blocks, each a few bytes of scales and
//! a group of small integers (32 values for the `Qn_0` / `Qn_1` formats, 256 for the k-quants).
//! These are the weights of the GGUF files the local runners read, and what `--quant q4_k` and
//! its siblings write (`quantize.rs`).
//!
//! Two descriptions of every format live here, each the plain definition:
//! - `dequantize_block`: the values as f32, one at a time in the order the format defines
//!   (checked against the `gguf` Python package's own dequantizers, `model/gguf/tests.rs`);
//! - `integer_form`: the same block as `value_i = d · w_i + c · m_i`, with `w_i` a 16-bit
//!   integer (the value's integer times its sub-block's integer scale) and `m_i` the integer
//!   of its sub-block's minimum. That is the arithmetic of the decode GEMV (kernels/matmul/
//!   blocks.rs), which multiplies the `w_i` by 16-bit inputs in exact integer sums. Both give
//!   the same f32 value, bit for bit (tested below): every product in them is exact in f32.

pub mod quantize;

use half::f16;

/// A block format tandem reads (and, for some, writes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum BlockFormat {
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

impl BlockFormat {
    pub const ALL: [BlockFormat; 8] = [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q5_0, BlockFormat::Q5_1, BlockFormat::Q8_0, BlockFormat::Q4_K, BlockFormat::Q5_K, BlockFormat::Q6_K];

    pub fn name(self) -> &'static str {
        match self {
            BlockFormat::Q4_0 => "Q4_0",
            BlockFormat::Q4_1 => "Q4_1",
            BlockFormat::Q5_0 => "Q5_0",
            BlockFormat::Q5_1 => "Q5_1",
            BlockFormat::Q8_0 => "Q8_0",
            BlockFormat::Q4_K => "Q4_K",
            BlockFormat::Q5_K => "Q5_K",
            BlockFormat::Q6_K => "Q6_K",
        }
    }

    /// Values per block.
    pub fn elements(self) -> usize {
        match self {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q5_0 | BlockFormat::Q5_1 | BlockFormat::Q8_0 => 32,
            BlockFormat::Q4_K | BlockFormat::Q5_K | BlockFormat::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 => 2 + 16,
            BlockFormat::Q4_1 => 2 + 2 + 16,
            BlockFormat::Q5_0 => 2 + 4 + 16,
            BlockFormat::Q5_1 => 2 + 2 + 4 + 16,
            BlockFormat::Q8_0 => 2 + 32,
            BlockFormat::Q4_K => 2 + 2 + 12 + 128,
            BlockFormat::Q5_K => 2 + 2 + 12 + 32 + 128,
            BlockFormat::Q6_K => 128 + 64 + 16 + 2,
        }
    }

    /// Bytes of `elements` values (a whole number of blocks).
    pub fn bytes_of(self, elements: usize) -> usize {
        elements / self.elements() * self.bytes()
    }

    /// Bits per value, scales included (4.5 for Q4_K).
    pub fn bits_per_value(self) -> f64 {
        8.0 * self.bytes() as f64 / self.elements() as f64
    }
}

impl std::fmt::Display for BlockFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a block of format `t` holds its f16 scales (and minimums).
pub fn scale_offsets(t: BlockFormat) -> &'static [usize] {
    match t {
        BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => &[0],
        BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q4_K | BlockFormat::Q5_K => &[0, 2],
        BlockFormat::Q6_K => &[208],
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// One block of format `t` into `y` (its `elements()` values).
pub fn dequantize_block(t: BlockFormat, b: &[u8], y: &mut [f32]) {
    match t {
        BlockFormat::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                y[j] = ((qs[j] & 0xf) as i32 - 8) as f32 * d;
                y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        BlockFormat::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let qs = &b[4..20];
            for j in 0..16 {
                y[j] = (qs[j] & 0xf) as f32 * d + m;
                y[j + 16] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        BlockFormat::Q5_0 => {
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
        BlockFormat::Q5_1 => {
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
        BlockFormat::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        BlockFormat::Q4_K | BlockFormat::Q5_K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let scales = &b[4..16];
            let (qh, qs) = if t == BlockFormat::Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
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
        BlockFormat::Q6_K => {
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
    }
}

/// `out.len()` values of format `t` from `bytes`, which hold exactly that many (whole blocks).
///
/// # Panics
/// If the lengths do not match: callers size both from a checked shape.
pub fn dequantize(t: BlockFormat, bytes: &[u8], out: &mut [f32]) {
    let (be, bb) = (t.elements(), t.bytes());
    assert!(out.len().is_multiple_of(be) && bytes.len() == out.len() / be * bb, "{} bytes do not hold {} {} values", bytes.len(), out.len(), t.name());
    for (block, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        dequantize_block(t, block, y);
    }
}

/// Scale and minimum `j` (0..8) of a k-quant block's 12 packed bytes: 6 bits each, the first
/// four pairs in the low bits of bytes 0-7, the last four split between the low and high
/// nibbles of bytes 8-11 and the top two bits of bytes 0-7.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// A block as integers: `value_i = d · w[i] + c · m[i / group]` (the second term only where
/// the format has minimums), which is its dequantized value bit for bit.
#[derive(Clone, Debug, PartialEq)]
pub struct IntegerBlock {
    /// The block's float scale.
    pub d: f32,
    /// Each value's integer times its sub-block's integer scale (|w| ≤ 4096).
    pub w: Vec<i16>,
    /// The factor of the minimums (`-dmin` for the k-quants, `m` for Q4_1 / Q5_1), 0 without.
    pub c: f32,
    /// The integer minimum of each run of `group` values (empty without).
    pub m: Vec<i32>,
    /// Values per minimum (32).
    pub group: usize,
}

/// The integer form of one block (see `IntegerBlock`).
pub fn integer_form(t: BlockFormat, b: &[u8]) -> IntegerBlock {
    let mut w = vec![0i16; t.elements()];
    let (mut c, mut m) = (0.0, Vec::new());
    let d = match t {
        BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q5_0 | BlockFormat::Q5_1 => {
            let (qh, qs, offset) = match t {
                BlockFormat::Q4_0 => (0, &b[2..18], 8),
                BlockFormat::Q4_1 => (0, &b[4..20], 0),
                BlockFormat::Q5_0 => (u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22], 16),
                _ => (u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24], 0),
            };
            for j in 0..16 {
                w[j] = ((qs[j] & 0xf) as i32 | (((qh >> j) & 1) << 4) as i32) as i16 - offset;
                w[j + 16] = ((qs[j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32) as i16 - offset;
            }
            if matches!(t, BlockFormat::Q4_1 | BlockFormat::Q5_1) {
                (c, m) = (f16_at(b, 2), vec![1]);
            }
            f16_at(b, 0)
        }
        BlockFormat::Q8_0 => {
            for j in 0..32 {
                w[j] = (b[2 + j] as i8) as i16;
            }
            f16_at(b, 0)
        }
        BlockFormat::Q4_K | BlockFormat::Q5_K => {
            let scales = &b[4..16];
            let (qh, qs) = if t == BlockFormat::Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for run in 0..4 {
                for half in 0..2 {
                    let (sc, mi) = scale_min_k4(2 * run + half, scales);
                    m.push(mi as i32);
                    for l in 0..32 {
                        let mut q = (qs[32 * run + l] >> (4 * half)) as i16 & 0xf;
                        if let Some(qh) = qh {
                            q |= (((qh[l] >> (2 * run + half)) & 1) as i16) << 4;
                        }
                        w[64 * run + 32 * half + l] = q * sc as i16;
                    }
                }
            }
            c = -f16_at(b, 2);
            f16_at(b, 0)
        }
        BlockFormat::Q6_K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            for half in 0..2 {
                for l in 0..32 {
                    let (lo, hi, h) = (ql[64 * half + l], ql[64 * half + l + 32], qh[32 * half + l]);
                    let q = [(lo & 0xf) | ((h & 3) << 4), (hi & 0xf) | (((h >> 2) & 3) << 4), (lo >> 4) | (((h >> 4) & 3) << 4), (hi >> 4) | ((h >> 6) << 4)];
                    for (part, &q) in q.iter().enumerate() {
                        let i = 32 * part + l;
                        w[128 * half + i] = (q as i16 - 32) * (sc[8 * half + i / 16] as i8) as i16;
                    }
                }
            }
            f16_at(b, 208)
        }
    };
    IntegerBlock { d, w, c, m, group: 32 }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn random_blocks(t: BlockFormat, n: usize, seed: &mut u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * t.bytes());
        for _ in 0..n * t.bytes() {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            out.push((*seed >> 56) as u8);
        }
        // Finite f16 scales (random bytes often make NaN or infinity).
        for (b, block) in out.chunks_exact_mut(t.bytes()).enumerate() {
            for (i, &at) in scale_offsets(t).iter().enumerate() {
                let v = f16::from_f32(((b * 7 + i * 3) % 11) as f32 * 0.013 - 0.06);
                block[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    /// The integer form of every format gives each dequantized value bit for bit.
    #[test]
    fn the_integer_form_is_the_dequantized_block() {
        let mut seed = 3;
        for t in BlockFormat::ALL {
            for block in random_blocks(t, 40, &mut seed).chunks_exact(t.bytes()) {
                let mut y = vec![0f32; t.elements()];
                dequantize_block(t, block, &mut y);
                let f = integer_form(t, block);
                for (i, &want) in y.iter().enumerate() {
                    let mut got = f.d * f.w[i] as f32;
                    if !f.m.is_empty() {
                        let m = f.m[(i / f.group).min(f.m.len() - 1)];
                        got += f.c * m as f32;
                    }
                    // Equal as numbers: a zero may come with either sign (d · sc · 0 with sc < 0).
                    assert!(got == want, "{t} value {i}: {got} vs {want}");
                }
                assert!(f.w.iter().all(|w| w.unsigned_abs() <= 4096), "{t}: an integer weight past 4096");
            }
        }
    }
}
