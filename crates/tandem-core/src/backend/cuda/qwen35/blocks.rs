//! Block-format weights on the GPU (kernels/blocks.cu): how a matrix's rows of GGML blocks are
//! laid out there, and the kernels that read each format. Q4_K and Q5_K keep the file's layout
//! (their blocks are whole 16-byte units); Q4_0, Q8_0 and Q6_K, whose blocks are not, are split
//! so that every load the kernels make is aligned: each row holds its blocks without their f16
//! scale, then the row's scales, then zeros to a multiple of 16 bytes. Q4_1, Q5_0 and Q5_1
//! (which Qwen3.5's GGUF files do not use) are refused by name.

use anyhow::{bail, Result};

use super::super::kernels as k;
use super::super::launch::Kernel;
use super::super::kernels::{DequantizeRowsParams, EmbedBlocksParams, GemvBlocksParams};
use crate::model::blocks::BlockFormat;

/// Where a block of format `f` keeps its f16 scale, and the bytes of the block without it, in
/// the split layouts (None: the block is kept whole).
fn split(f: BlockFormat) -> Option<(usize, std::ops::Range<usize>)> {
    match f {
        BlockFormat::Q4_0 => Some((0, 2..18)),
        BlockFormat::Q8_0 => Some((0, 2..34)),
        BlockFormat::Q6_K => Some((208, 0..208)),
        _ => None,
    }
}

/// Whether the GPU kernels read format `f`, or an error naming it.
pub fn check(f: BlockFormat, what: &str) -> Result<()> {
    match f {
        BlockFormat::Q4_0 | BlockFormat::Q8_0 | BlockFormat::Q4_K | BlockFormat::Q5_K | BlockFormat::Q6_K => Ok(()),
        _ => bail!("{what}: the CUDA engine reads Q4_0, Q8_0, Q4_K, Q5_K and Q6_K blocks, not {f} (run it on a CPU engine, or take a file of another type)"),
    }
}

/// Bytes of a row of `k` values of format `f` on the GPU (blocks.cu block_row_bytes).
pub fn gpu_row_bytes(f: BlockFormat, k: usize) -> usize {
    let blocks = k / f.elements();
    let bytes = match split(f) {
        Some((_, body)) => blocks * (body.len() + 2),
        None => blocks * f.bytes(),
    };
    bytes.next_multiple_of(16)
}

/// `rows` (rows of `k` values, whole blocks, in the file's layout) in the GPU's layout.
pub fn gpu_layout(f: BlockFormat, k: usize, rows: &[u8]) -> Vec<u8> {
    let (per, file_row, row) = (k / f.elements(), f.bytes_of(k), gpu_row_bytes(f, k));
    let n = rows.len() / file_row;
    debug_assert_eq!(rows.len(), n * file_row);
    let Some((d_at, body)) = split(f) else {
        // Whole blocks, and rows already multiples of 16 bytes.
        debug_assert_eq!(file_row, row);
        return rows.to_vec();
    };
    let mut out = vec![0u8; n * row];
    for (src, dst) in rows.chunks_exact(file_row).zip(out.chunks_exact_mut(row)) {
        let (bodies, scales) = dst.split_at_mut(per * body.len());
        for (b, block) in src.chunks_exact(f.bytes()).enumerate() {
            bodies[b * body.len()..(b + 1) * body.len()].copy_from_slice(&block[body.clone()]);
            scales[2 * b..2 * b + 2].copy_from_slice(&block[d_at..d_at + 2]);
        }
    }
    out
}

/// The index of format `f` in the kernel tables (blocks.cu BLOCK_*, block_input's `format`).
pub fn index(f: BlockFormat) -> usize {
    match f {
        BlockFormat::Q4_0 => 0,
        BlockFormat::Q8_0 => 1,
        BlockFormat::Q4_K => 2,
        BlockFormat::Q5_K => 3,
        BlockFormat::Q6_K => 4,
        other => unreachable!("{other} was refused at upload (check)"),
    }
}

/// Values a GEMV lane reads at a time (blocks.cu BlockChunk<F>::U): Q4_K's and Q5_K's pairs of
/// runs, the others' 32.
pub fn unit_values(f: BlockFormat) -> usize {
    match f {
        BlockFormat::Q4_K | BlockFormat::Q5_K => 64,
        _ => 32,
    }
}

/// Blocks of kernels/blocks.cu block_input per input row (its BLOCK_INPUT_PARTS).
pub const BLOCK_INPUT_PARTS: usize = 8;

/// The decode GEMV of format `f` for `t` tokens (1, 2, 3-4, 5-8): [glu, plain].
pub fn gemv_kernels(f: BlockFormat, t: usize) -> [Kernel<GemvBlocksParams>; 2] {
    const ALL: [[[Kernel<GemvBlocksParams>; 2]; 4]; 5] = [
        [[k::GEMV_Q4_0_T1_GLU, k::GEMV_Q4_0_T1_PLAIN], [k::GEMV_Q4_0_T2_GLU, k::GEMV_Q4_0_T2_PLAIN], [k::GEMV_Q4_0_T4_GLU, k::GEMV_Q4_0_T4_PLAIN], [k::GEMV_Q4_0_T8_GLU, k::GEMV_Q4_0_T8_PLAIN]],
        [[k::GEMV_Q8_0_T1_GLU, k::GEMV_Q8_0_T1_PLAIN], [k::GEMV_Q8_0_T2_GLU, k::GEMV_Q8_0_T2_PLAIN], [k::GEMV_Q8_0_T4_GLU, k::GEMV_Q8_0_T4_PLAIN], [k::GEMV_Q8_0_T8_GLU, k::GEMV_Q8_0_T8_PLAIN]],
        [[k::GEMV_Q4_K_T1_GLU, k::GEMV_Q4_K_T1_PLAIN], [k::GEMV_Q4_K_T2_GLU, k::GEMV_Q4_K_T2_PLAIN], [k::GEMV_Q4_K_T4_GLU, k::GEMV_Q4_K_T4_PLAIN], [k::GEMV_Q4_K_T8_GLU, k::GEMV_Q4_K_T8_PLAIN]],
        [[k::GEMV_Q5_K_T1_GLU, k::GEMV_Q5_K_T1_PLAIN], [k::GEMV_Q5_K_T2_GLU, k::GEMV_Q5_K_T2_PLAIN], [k::GEMV_Q5_K_T4_GLU, k::GEMV_Q5_K_T4_PLAIN], [k::GEMV_Q5_K_T8_GLU, k::GEMV_Q5_K_T8_PLAIN]],
        [[k::GEMV_Q6_K_T1_GLU, k::GEMV_Q6_K_T1_PLAIN], [k::GEMV_Q6_K_T2_GLU, k::GEMV_Q6_K_T2_PLAIN], [k::GEMV_Q6_K_T4_GLU, k::GEMV_Q6_K_T4_PLAIN], [k::GEMV_Q6_K_T8_GLU, k::GEMV_Q6_K_T8_PLAIN]],
    ];
    ALL[index(f)][token_kernel(t)]
}

/// Which of a format's GEMV kernels (for 1, 2, 4 or 8 tokens) takes a launch of `t` tokens.
fn token_kernel(t: usize) -> usize {
    match t {
        1 => 0,
        2 => 1,
        3 | 4 => 2,
        _ => 3,
    }
}

/// The decode GEMV of k-quant `f` against int8 inputs (`Precision::Fast`) for `t` tokens,
/// [glu, plain], and the rows a block of it takes (blocks.cu BlockChunk8: 8 warps of R rows);
/// None for the formats that keep their 16-bit inputs under fast (Q4_0, Q8_0, as the CPU
/// engine's precision=fast keeps them exact).
pub fn gemv_a8_kernels(f: BlockFormat, t: usize) -> Option<([Kernel<GemvBlocksParams>; 2], usize)> {
    const ALL: [[[Kernel<GemvBlocksParams>; 2]; 4]; 3] = [
        [[k::GEMV_Q4_K_A8_T1_GLU, k::GEMV_Q4_K_A8_T1_PLAIN], [k::GEMV_Q4_K_A8_T2_GLU, k::GEMV_Q4_K_A8_T2_PLAIN], [k::GEMV_Q4_K_A8_T4_GLU, k::GEMV_Q4_K_A8_T4_PLAIN], [k::GEMV_Q4_K_A8_T8_GLU, k::GEMV_Q4_K_A8_T8_PLAIN]],
        [[k::GEMV_Q5_K_A8_T1_GLU, k::GEMV_Q5_K_A8_T1_PLAIN], [k::GEMV_Q5_K_A8_T2_GLU, k::GEMV_Q5_K_A8_T2_PLAIN], [k::GEMV_Q5_K_A8_T4_GLU, k::GEMV_Q5_K_A8_T4_PLAIN], [k::GEMV_Q5_K_A8_T8_GLU, k::GEMV_Q5_K_A8_T8_PLAIN]],
        [[k::GEMV_Q6_K_A8_T1_GLU, k::GEMV_Q6_K_A8_T1_PLAIN], [k::GEMV_Q6_K_A8_T2_GLU, k::GEMV_Q6_K_A8_T2_PLAIN], [k::GEMV_Q6_K_A8_T4_GLU, k::GEMV_Q6_K_A8_T4_PLAIN], [k::GEMV_Q6_K_A8_T8_GLU, k::GEMV_Q6_K_A8_T8_PLAIN]],
    ];
    let (fi, rows_per_warp) = match f {
        BlockFormat::Q4_K => (0, 1),
        BlockFormat::Q5_K => (1, 1),
        BlockFormat::Q6_K => (2, 2),
        _ => return None,
    };
    Some((ALL[fi][token_kernel(t)], 8 * rows_per_warp))
}

/// The kernel that dequantizes a matrix of format `f` (for a GEMM's weights).
pub fn dequantize_kernel(f: BlockFormat) -> Kernel<DequantizeRowsParams> {
    [k::DEQUANTIZE_ROWS_Q4_0, k::DEQUANTIZE_ROWS_Q8_0, k::DEQUANTIZE_ROWS_Q4_K, k::DEQUANTIZE_ROWS_Q5_K, k::DEQUANTIZE_ROWS_Q6_K][index(f)]
}

/// The embedding lookup of a table of format `f`.
pub fn embed_kernel(f: BlockFormat) -> Kernel<EmbedBlocksParams> {
    [k::EMBED_BLOCKS_Q4_0, k::EMBED_BLOCKS_Q8_0, k::EMBED_BLOCKS_Q4_K, k::EMBED_BLOCKS_Q5_K, k::EMBED_BLOCKS_Q6_K][index(f)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::blocks::tests::random_blocks;

    /// The GPU layout keeps each block's bytes and scale where the kernels read them: a split
    /// row is its blocks' bodies, then their scales, then zeros to 16 bytes; whole-block
    /// formats are the file's bytes. Every row starts on 16 bytes.
    #[test]
    fn the_gpu_layout_holds_every_blocks_bytes() {
        let mut seed = 1;
        for f in [BlockFormat::Q4_0, BlockFormat::Q8_0, BlockFormat::Q4_K, BlockFormat::Q5_K, BlockFormat::Q6_K] {
            for k in [256, 768] {
                let n = 3;
                let file = random_blocks(f, n * k / f.elements(), &mut seed);
                let gpu = gpu_layout(f, k, &file);
                let row = gpu_row_bytes(f, k);
                assert_eq!(gpu.len(), n * row);
                assert_eq!(row % 16, 0, "{f}: rows of {row} bytes");
                let per = k / f.elements();
                for r in 0..n {
                    for b in 0..per {
                        let block = &file[(r * per + b) * f.bytes()..][..f.bytes()];
                        match split(f) {
                            None => assert_eq!(&gpu[r * row + b * f.bytes()..][..f.bytes()], block, "{f} row {r} block {b}"),
                            Some((d_at, body)) => {
                                assert_eq!(&gpu[r * row + b * body.len()..][..body.len()], &block[body.clone()], "{f} row {r} block {b}'s body");
                                assert_eq!(&gpu[r * row + per * body.len() + 2 * b..][..2], &block[d_at..d_at + 2], "{f} row {r} block {b}'s scale");
                            }
                        }
                    }
                    let used = match split(f) {
                        Some((_, body)) => per * (body.len() + 2),
                        None => per * f.bytes(),
                    };
                    assert!(gpu[r * row + used..(r + 1) * row].iter().all(|&b| b == 0), "{f} row {r}: the padding is not zeros");
                }
            }
        }
        assert!(check(BlockFormat::Q5_1, "m").unwrap_err().to_string().contains("Q5_1"));
    }
}
