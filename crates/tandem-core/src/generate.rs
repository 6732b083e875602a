//! The single-engine generation loop: prefill the prompt, then sample and decode one token at
//! a time from the state, with timings.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::model::{Logits, Qwen35};
use crate::pool::Pool;
use crate::sampling::Sampler;
use crate::state::State;

#[derive(Clone, Debug, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Prompt in, first token sampled.
    pub ttft: Duration,
    pub prefill: Duration,
    /// Time spent producing tokens 2..n.
    pub decode: Duration,
    /// True when a stop token ended generation (false: max_tokens or the context ran out).
    pub stopped: bool,
}

impl GenerationStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill.as_secs_f64()
    }
    pub fn decode_tok_s(&self) -> f64 {
        let n = self.generated_tokens.saturating_sub(1);
        if n == 0 {
            return 0.0;
        }
        n as f64 / self.decode.as_secs_f64()
    }
}

/// Generate up to `max_tokens` after `prompt`. `on_token` sees each new id as it is sampled
/// (stop tokens are not passed on and not returned).
pub fn generate(
    pool: &Pool,
    net: &Qwen35,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    stop_ids: &[u32],
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<(Vec<u32>, GenerationStats)> {
    let ctx = net.config.max_position_embeddings;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if prompt.len() > ctx {
        bail!("the prompt has {} tokens but the model's context is {ctx} tokens", prompt.len());
    }
    let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
    let start = Instant::now();
    let mut state = State::new(&net.config);
    let mut logits = net.forward(pool, prompt, &mut state, Logits::Last)?;
    stats.prefill = start.elapsed();
    let mut out = Vec::new();
    let decode_start = Instant::now();
    while out.len() < max_tokens {
        let id = sampler.sample(&logits);
        if out.is_empty() {
            stats.ttft = start.elapsed();
        }
        if stop_ids.contains(&id) {
            stats.stopped = true;
            break;
        }
        out.push(id);
        on_token(id)?;
        if out.len() == max_tokens || state.position >= ctx {
            break;
        }
        logits = net.forward(pool, &[id], &mut state, Logits::Last)?;
    }
    stats.generated_tokens = out.len();
    stats.decode = decode_start.elapsed().saturating_sub(stats.ttft.saturating_sub(stats.prefill));
    Ok((out, stats))
}
