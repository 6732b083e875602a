//! The batched decode step's DeltaNet mixer in its two kernels (kernels/deltanet.cu): a block
//! per 32 columns of a value head (deltanet_step_batch_*) and a block per value head
//! (deltanet_step_heads_*), which give the same bits: the whole step's rate with each,
//! interleaved, and the mixer's own time per step (CUDA events), at each batch size. The
//! engine takes the second from `step_heads_from` sequences.

use std::fmt::Write as _;

use anyhow::Result;
use tandem_core::backend::cuda::qwen35::{GpuQwen35, GpuState};
use tandem_core::model::Logits;

use super::cuda::{batched_rate, profile_batched_steps};
use super::{progress, stats};

/// Rows of the comparison for model `spec` on `g` (left with its default).
pub fn compare(g: &mut GpuQwen35, spec: &str, tokens: &[u32], decode_steps: usize, reps: usize, out: &mut String) -> Result<()> {
    let default_from = g.step_heads_from();
    // (first batch size of the per-head kernel, label)
    let kernels = [(usize::MAX, "per 32 columns"), (2, "per value head")];
    for n in [2usize, 4, 8, 16, 32, 64, 128, 256] {
        progress(&format!("{spec}: {n} sequences, the DeltaNet step per 32 columns against per value head"));
        let ids: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
        let mut states = (0..n)
            .map(|i| {
                let mut st = g.new_state()?;
                g.forward(&tokens[i % 64..i % 64 + 13], &mut st, Logits::Last)?;
                Ok(st)
            })
            .collect::<Result<Vec<GpuState>>>()?;
        let mut rates = [Vec::new(), Vec::new()];
        let mut mixer_ms = [0.0; 2];
        for rep in 0..=reps {
            for (k, &(from, _)) in kernels.iter().enumerate() {
                g.set_step_heads_from(from);
                let mut refs: Vec<_> = states.iter_mut().collect();
                if rep == 0 {
                    // Kernel by kernel once (the mixer's share), then the graph's capture.
                    let profiled = 4;
                    let profile = profile_batched_steps(g, &ids, &mut refs, profiled)?;
                    mixer_ms[k] = profile.iter().filter(|p| p.0.starts_with("deltanet_step")).map(|p| p.1).sum::<f64>() / profiled as f64;
                    g.decode_batch(&ids, &mut refs)?;
                    continue;
                }
                rates[k].push(batched_rate(g, &ids, &mut refs, decode_steps)?);
            }
        }
        let (a, a_lo, a_hi) = stats(&mut rates[0]);
        let (b, b_lo, b_hi) = stats(&mut rates[1]);
        let default = if n >= default_from { kernels[1].1 } else { kernels[0].1 };
        writeln!(out, "| {spec} | {n} | {:.3} / {:.3} | {a:.0} ({a_lo:.0} - {a_hi:.0}) | {b:.0} ({b_lo:.0} - {b_hi:.0}) | {:.2}x | {default} |", mixer_ms[0], mixer_ms[1], b / a)?;
    }
    g.set_step_heads_from(default_from);
    Ok(())
}
