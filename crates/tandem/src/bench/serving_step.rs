//! A batched decode step as a server runs it: many sequences at a prompt's length of context
//! (the other batched measurements start from 13-token prompts, where attention reads almost
//! nothing). 256 sequences of a model whose weights fit in 4 GB, 64 of a larger one (the
//! serving targets' batches), each prefilled with `context` tokens (packed, 16 prompts a
//! forward); then the step's rate with its graph replayed, and its kernels one by one.

use anyhow::Result;
use tandem_core::backend::cuda::qwen35::{GpuQwen35, GpuState};

use super::cuda::{batched_rate, batched_step_profile};
use super::{progress, stats};

/// The batch of a serving step for a model of `weight_bytes`.
pub fn sequences(weight_bytes: usize) -> usize {
    if weight_bytes < 4 << 30 {
        256
    } else {
        64
    }
}

/// A row of the rate table, and the step's kernel profile.
pub fn measure(g: &mut GpuQwen35, spec: &str, vocab: usize, context: usize, decode_steps: usize, reps: usize) -> Result<(String, String)> {
    let n = sequences(g.weight_bytes());
    progress(&format!("{spec}: {n} sequences at {context} positions"));
    // Each sequence a different window of one token stream.
    let tokens: Vec<u32> = (0..(context + 64) as u32).map(|i| (i * 7919 + 13) % vocab as u32).collect();
    let mut states = (0..n).map(|_| g.new_state()).collect::<Result<Vec<GpuState>>>()?;
    for (i, group) in states.chunks_mut(16).enumerate() {
        let prompts: Vec<&[u32]> = (0..group.len()).map(|j| &tokens[(16 * i + j) % 64..(16 * i + j) % 64 + context]).collect();
        let mut refs: Vec<_> = group.iter_mut().collect();
        g.prefill_batch(&prompts, &mut refs)?;
    }
    let ids: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
    let mut refs: Vec<_> = states.iter_mut().collect();
    // The graph's capture and a warm-up.
    g.decode_batch(&ids, &mut refs)?;
    let mut samples = Vec::new();
    for _ in 0..reps {
        samples.push(batched_rate(g, &ids, &mut refs, decode_steps)?);
    }
    let (rate, lo, hi) = stats(&mut samples);
    // The prompt, the warm-up step, then the timed steps.
    let last = context + 1 + reps * decode_steps;
    let row = format!("| {spec} | {n} | {context} to {last} | {:.2} | {rate:.0} ({lo:.0} - {hi:.0}) |\n", 1e3 * n as f64 / rate);
    let profile = batched_step_profile(g, &ids, &mut refs, &format!("{spec}, a step of {n} sequences at {last} positions and on"))?;
    Ok((row, profile))
}
