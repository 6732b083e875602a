//! Choosing the next token from logits: greedy, or temperature / top-k / top-p with a seeded
//! generator. Logit rows past the tokenizer's vocabulary (Qwen3.5 pads 248077 real ids to
//! 248320 rows) are never chosen.

use anyhow::{bail, Result};

use crate::rng::Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("temperature {} must be a finite number >= 0", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p {} must be in (0, 1]", self.top_p);
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Only ids below this are candidates.
    allowed: usize,
    candidates: Vec<(u32, f32)>,
}

/// Candidates whose logit is this far below the maximum (after temperature) have probability
/// below e^-30 ≈ 1e-13 each; dropping them before sorting changes no f32 probability sum.
const NEGLIGIBLE_LOGIT_GAP: f32 = 30.0;

impl Sampler {
    pub fn new(params: SamplingParams, allowed_vocab: usize) -> Self {
        let rng = Rng::new(params.seed);
        Sampler { params, rng, allowed: allowed_vocab, candidates: Vec::new() }
    }

    /// The token this sampler picks given `argmax`, the argmax of the model's whole logits row,
    /// where that alone decides it: greedy sampling, and an allowed id (the first largest of all
    /// rows is then also the first largest of the allowed ones).
    pub fn greedy_pick(&self, argmax: u32) -> Option<u32> {
        (self.params.temperature == 0.0 && (argmax as usize) < self.allowed).then_some(argmax)
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let logits = &logits[..self.allowed.min(logits.len())];
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        self.candidates.clear();
        for (i, &l) in logits.iter().enumerate() {
            let s = (l - max) * inv_t;
            if s > -NEGLIGIBLE_LOGIT_GAP {
                self.candidates.push((i as u32, s));
            }
        }
        let c = &mut self.candidates;
        let by_score_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.params.top_k > 0 && self.params.top_k < c.len() {
            c.select_nth_unstable_by(self.params.top_k - 1, by_score_desc);
            c.truncate(self.params.top_k);
        }
        c.sort_unstable_by(by_score_desc);
        // Softmax over the candidates, then the smallest prefix whose mass reaches top_p.
        let mut total = 0f64;
        for e in c.iter_mut() {
            e.1 = e.1.exp();
            total += e.1 as f64;
        }
        let mut keep = c.len();
        if self.params.top_p < 1.0 {
            let mut cum = 0f64;
            for (i, e) in c.iter().enumerate() {
                cum += e.1 as f64 / total;
                if cum >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept_total: f64 = c[..keep].iter().map(|e| e.1 as f64).sum();
        let mut r = self.rng.next_f64() * kept_total;
        for e in &c[..keep] {
            r -= e.1 as f64;
            if r < 0.0 {
                return e.0;
            }
        }
        c[keep - 1].0
    }
}

/// Index of the largest logit; the first one on ties (as torch.argmax). NaNs are passed over
/// (index 0 if every logit is NaN).
///
/// Two passes that the compiler vectorises: the largest value, in 16 lanes, then the first
/// index that holds it. The plain one-pass loop (`argmax_ref`) chains every compare through
/// the best index so far and does not vectorise; over a 248k-token vocabulary that is a
/// visible part of a small model's GPU decode step (`tandem bench --sections cuda` times this
/// one on the GPU machine's host).
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = if *m < v { v } else { *m };
        }
    }
    let max = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &v| if m < v { v } else { m });
    for (i, chunk) in logits.chunks(LANES).enumerate() {
        if chunk.iter().fold(false, |any, &v| any | (v == max)) {
            return (i * LANES + chunk.iter().position(|&v| v == max).expect("the chunk holds it")) as u32;
        }
    }
    0
}

/// The plain loop `argmax` must agree with.
#[cfg(test)]
fn argmax_ref(logits: &[f32]) -> u32 {
    let mut best: Option<usize> = None;
    for (i, &v) in logits.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|b| v > logits[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_argmax_decides_only_greedy_picks_of_allowed_ids() {
        let greedy = Sampler::new(SamplingParams::default(), 100);
        assert_eq!(greedy.greedy_pick(42), Some(42));
        // A padding row won: the allowed rows' argmax is another, so the logits must be read.
        assert_eq!(greedy.greedy_pick(100), None);
        let warm = Sampler::new(SamplingParams { temperature: 0.7, ..Default::default() }, 100);
        assert_eq!(warm.greedy_pick(42), None);
    }

    #[test]
    fn argmax_agrees_with_the_plain_loop() {
        let mut rng = crate::rng::Rng::new(7);
        for len in [0usize, 1, 15, 16, 17, 100, 1024, 248_320] {
            let mut x: Vec<f32> = (0..len).map(|_| (rng.next_f64() * 8.0 - 4.0) as f32).collect();
            assert_eq!(argmax(&x), argmax_ref(&x), "{len} random logits");
            if len > 3 {
                // Ties go to the first; NaNs, infinities and a maximum in the tail.
                let top = len - 1;
                x[top] = 9.0;
                x[len / 2] = 9.0;
                x[0] = f32::NAN;
                assert_eq!(argmax(&x), argmax_ref(&x), "{len}: ties and a NaN");
                assert_eq!(argmax(&x), (len / 2) as u32);
                x[1] = f32::INFINITY;
                assert_eq!(argmax(&x), 1, "{len}: +inf");
            }
        }
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, 2.0]), 2);
    }

    #[test]
    fn greedy_ignores_padded_vocabulary_rows() {
        let logits = [0.0, 3.0, 1.0, 9.0];
        let mut s = Sampler::new(SamplingParams::default(), 3);
        assert_eq!(s.sample(&logits), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_repeat() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect();
        let p = SamplingParams { temperature: 1.0, top_k: 1, top_p: 1.0, seed: 5 };
        assert_eq!(Sampler::new(p, 100).sample(&logits), argmax(&logits));
        let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.9, seed: 5 };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone(), 100);
            (0..20).map(|_| s.sample(&logits)).collect()
        };
        let mut s = Sampler::new(p, 100);
        let b: Vec<u32> = (0..20).map(|_| s.sample(&logits)).collect();
        assert_eq!(a, b);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1, "sampling at T=1 varies");
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Probabilities ~ [0.6, 0.3, 0.1]: top_p 0.5 leaves only the first.
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.5, seed: 1 }, 3);
        assert!((0..50).all(|_| s.sample(&logits) == 0));
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.85, seed: 1 }, 3);
        let picks: Vec<u32> = (0..200).map(|_| s.sample(&logits)).collect();
        assert!(picks.contains(&1) && !picks.contains(&2));
    }

    #[test]
    fn bad_parameters_are_named() {
        let e = SamplingParams { top_p: 0.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("top_p 0"));
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
    }
}
