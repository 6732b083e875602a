//! The CUDA engine's recurrent states in f32 against bf16 (`state=bf16`): what the rounding
//! costs in logits, greedy tokens and the state itself after a long prompt, and what the halved
//! bytes buy in batched decode steps.

use std::fmt::Write as _;

use anyhow::{Context, Result};
use tandem_core::backend::cuda::qwen35::state_slots::StateDtype;
use tandem_core::backend::cuda::qwen35::{GpuQwen35, GpuState};
use tandem_core::model::Logits;
use tandem_core::sampling::argmax;
use tandem_core::state::LayerState;

use super::{progress, stats};

/// Tokens of the prompt after which the states are compared.
pub const PROMPT: usize = 2048;
/// Greedy steps after it.
pub const STEPS: usize = 128;

/// Rows of the error table and of the speed table for model `spec` on `g` (left keeping f32
/// states). `tokens` holds at least `PROMPT` + 64 ids.
pub fn compare(g: &mut GpuQwen35, spec: &str, tokens: &[u32], decode_steps: usize, reps: usize, errors: &mut String, speed: &mut String) -> Result<()> {
    progress(&format!("{spec}: f32 against bf16 states"));
    let prompt = tokens.get(..PROMPT).context("the bench's token list is shorter than the state comparison's prompt")?;
    let mut run = |dtype: StateDtype| -> Result<(GpuState, Vec<f32>)> {
        g.set_state_dtype(dtype)?;
        let mut st = g.new_state()?;
        let logits = g.forward(prompt, &mut st, Logits::Last)?;
        Ok((st, logits))
    };
    let (mut s32, l32) = run(StateDtype::F32)?;
    let (mut s16, l16) = run(StateDtype::Bf16)?;
    let after_prompt = max_diff(&l32, &l16);
    // Each step feeds both the f32 run's greedy token (teacher forcing), so that the two are
    // compared on the same sequence; the bf16 run's own greedy choices are counted until the
    // first that differs.
    let (mut agree, mut worst, mut diverged) = (usize::from(argmax(&l32) == argmax(&l16)), after_prompt, None);
    let mut next = argmax(&l32);
    for step in 0..STEPS {
        g.set_state_dtype(StateDtype::F32)?;
        let a = g.forward(&[next], &mut s32, Logits::Last)?;
        g.set_state_dtype(StateDtype::Bf16)?;
        let b = g.forward(&[next], &mut s16, Logits::Last)?;
        worst = worst.max(max_diff(&a, &b));
        if argmax(&a) == argmax(&b) {
            agree += 1;
        } else if diverged.is_none() {
            diverged = Some(step + 1);
        }
        next = argmax(&a);
    }
    let (h32, h16) = (s32.download()?, s16.download()?);
    let mut state_error = 0f64;
    for (a, b) in h32.layers.iter().zip(&h16.layers) {
        if let (LayerState::Linear { recurrent: a, .. }, LayerState::Linear { recurrent: b, .. }) = (a, b) {
            let (mut d, mut n) = (0f64, 0f64);
            for (x, y) in a.iter().zip(b.iter()) {
                d += (*x as f64 - *y as f64).powi(2);
                n += (*x as f64).powi(2);
            }
            state_error = state_error.max((d / n.max(f64::MIN_POSITIVE)).sqrt());
        }
    }
    writeln!(
        errors,
        "| {spec} | {after_prompt:.4} | {worst:.4} | {agree}/{} | {} | {:.2e} |",
        STEPS + 1,
        diverged.map_or(format!("none in {STEPS}"), |s| format!("step {s}")),
        state_error
    )?;

    // Batched decode steps of n sequences in each dtype, interleaved.
    for n in [64usize, 256] {
        progress(&format!("{spec}: {n} sequences, f32 against bf16 states"));
        let ids: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
        let mut make = |dtype: StateDtype| -> Result<Vec<GpuState>> {
            g.set_state_dtype(dtype)?;
            (0..n)
                .map(|i| {
                    let mut st = g.new_state()?;
                    g.forward(&tokens[i % 64..i % 64 + 13], &mut st, Logits::Last)?;
                    Ok(st)
                })
                .collect()
        };
        let mut sets = [(StateDtype::F32, make(StateDtype::F32)?), (StateDtype::Bf16, make(StateDtype::Bf16)?)];
        let mut rates = [Vec::new(), Vec::new()];
        for rep in 0..=reps {
            for (k, (dtype, states)) in sets.iter_mut().enumerate() {
                g.set_state_dtype(*dtype)?;
                let mut refs: Vec<_> = states.iter_mut().collect();
                // The first step captures the bucket's graph (and, first, warms up).
                g.decode_batch(&ids, &mut refs)?;
                if rep == 0 {
                    continue;
                }
                rates[k].push(super::cuda::batched_rate(g, &ids, &mut refs, decode_steps)?);
            }
        }
        let (f32_rate, f32_lo, f32_hi) = stats(&mut rates[0]);
        let (bf16_rate, bf16_lo, bf16_hi) = stats(&mut rates[1]);
        let slot = |dtype| tandem_core::backend::cuda::qwen35::state_slots::SlotLayout::new(&g.config, dtype).bytes() as f64 / (1 << 20) as f64;
        writeln!(
            speed,
            "| {spec} | {n} | {:.1} / {:.1} | {f32_rate:.0} ({f32_lo:.0} - {f32_hi:.0}) | {bf16_rate:.0} ({bf16_lo:.0} - {bf16_hi:.0}) | {:.2}x |",
            slot(StateDtype::F32),
            slot(StateDtype::Bf16),
            bf16_rate / f32_rate
        )?;
    }
    g.set_state_dtype(StateDtype::F32)?;
    Ok(())
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}
