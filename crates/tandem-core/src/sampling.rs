//! Choosing the next token from logits: greedy, or temperature / top-k / top-p with a seeded
//! generator. Logit rows past the tokenizer's vocabulary (Qwen3.5 pads 248077 real ids to
//! 248320 rows) are never chosen. Weights are integers (exact sums in any order) and a draw walks
//! the kept tokens in id order, so that a temperature without cuts sorts nothing and a GPU can
//! draw the same token from a row it holds (kernels/sample.cu sample_rows).

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

/// A draw as `Sampler::sample_drawn` makes it, for a GPU to make from a row it holds: only ids
/// below `allowed`, 1 / temperature, the cuts (`top_k` 0 and `top_p` 1 for none) and the
/// uniform draw `u` in [0, 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuDraw {
    pub allowed: usize,
    pub inv_t: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub u: f64,
}

pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Only ids below this are candidates.
    allowed: usize,
    candidates: Vec<Candidate>,
}

/// A token that may be sampled: its id, its logit less the largest over the temperature, and
/// its weight exp(score) in units of 2^-40 (the largest logit's weight is exactly 2^40).
/// Integer weights make every sum exact, so a pick does not depend on the order the weights
/// are added in.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    id: u32,
    score: f32,
    weight: u64,
}

/// Candidates whose logit is this far below the maximum (after temperature) have probability
/// below e^-30 ≈ 1e-13 each; they are left out (each would still weigh 2^40 e^-30 ≈ 103).
const NEGLIGIBLE_LOGIT_GAP: f32 = 30.0;
const WEIGHT_ONE: f64 = (1u64 << 40) as f64;

/// Higher score first, then lower id: the order top-k and top-p cut in.
fn by_score_desc(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.score.total_cmp(&a.score).then(a.id.cmp(&b.id))
}

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

    /// The next token: greedy at temperature 0; else the candidates' softmax at the
    /// temperature, cut to the `top_k` highest and then to the shortest run of highest whose
    /// mass reaches `top_p`, and one drawn from what is kept (walking it in id order, so that
    /// no sort is needed without a cut).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature == 0.0 {
            return argmax(&logits[..self.allowed.min(logits.len())]);
        }
        let u = self.rng.next_f64();
        self.sample_drawn(logits, u)
    }

    /// The draw a GPU makes for this sampler's next token from a row of logits it holds
    /// (kernels/sample.cu sample_rows): at a temperature above 0, with the uniform taken from
    /// the generator now. The host draws with `sample_drawn` and the same uniform where the GPU
    /// cannot. None for greedy sampling.
    pub fn gpu_draw(&mut self) -> Option<GpuDraw> {
        let p = &self.params;
        (p.temperature > 0.0).then(|| GpuDraw { allowed: self.allowed, inv_t: 1.0 / p.temperature, top_k: p.top_k, top_p: p.top_p, u: self.rng.next_f64() })
    }

    /// `sample` with its uniform draw `u` (in [0, 1)) already taken; at a temperature above 0.
    pub fn sample_drawn(&mut self, logits: &[f32], u: f64) -> u32 {
        let logits = &logits[..self.allowed.min(logits.len())];
        let inv_t = 1.0 / self.params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        self.candidates.clear();
        for (i, &l) in logits.iter().enumerate() {
            let score = (l - max) * inv_t;
            if score > -NEGLIGIBLE_LOGIT_GAP {
                let weight = (score.exp() as f64 * WEIGHT_ONE).round() as u64;
                self.candidates.push(Candidate { id: i as u32, score, weight });
            }
        }
        if self.candidates.is_empty() {
            // Every logit NaN (or the row empty): as greedy does.
            return argmax(logits);
        }
        let c = &mut self.candidates[..];
        let mut keep = c.len();
        let top_k = self.params.top_k > 0 && self.params.top_k < keep;
        if top_k {
            c.select_nth_unstable_by(self.params.top_k - 1, by_score_desc);
            keep = self.params.top_k;
        }
        let top_p = self.params.top_p < 1.0;
        if top_p {
            keep = nucleus(&mut c[..keep], self.params.top_p);
        }
        let kept = &mut c[..keep];
        if top_k || top_p {
            // Back in id order (the cuts moved them).
            kept.sort_unstable_by_key(|e| e.id);
        }
        let total: u64 = kept.iter().map(|e| e.weight).sum();
        let r = ((u * total as f64) as u64).min(total - 1);
        let mut cum = 0u64;
        for e in kept.iter() {
            cum += e.weight;
            if r < cum {
                return e.id;
            }
        }
        unreachable!("r < total")
    }
}

/// How many of `c`'s highest (`by_score_desc`) hold at least `top_p` of its weight, the fewest
/// that do; they end up first in `c`. Only as many as needed are sorted: the highest 64, 256,
/// ... are selected until they hold enough.
fn nucleus(c: &mut [Candidate], top_p: f32) -> usize {
    let total: u64 = c.iter().map(|e| e.weight).sum();
    let target = ((top_p as f64 * total as f64).ceil() as u64).clamp(1, total);
    let mut n = 64;
    loop {
        if n >= c.len() {
            n = c.len();
        } else {
            c.select_nth_unstable_by(n - 1, by_score_desc);
        }
        let all = c.len();
        let head = &mut c[..n];
        if n == all || head.iter().map(|e| e.weight).sum::<u64>() >= target {
            head.sort_unstable_by(by_score_desc);
            let mut cum = 0u64;
            for (i, e) in head.iter().enumerate() {
                cum += e.weight;
                if cum >= target {
                    return i + 1;
                }
            }
            return n;
        }
        n *= 4;
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

    /// `Sampler::sample` the plain way: every candidate sorted, the cuts taken on the sorted
    /// list, the kept ones walked in id order; the same integer weights.
    fn sample_ref(params: &SamplingParams, rng: &mut Rng, logits: &[f32]) -> u32 {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut c: Vec<Candidate> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i, (l - max) * (1.0 / params.temperature)))
            .filter(|&(_, score)| score > -NEGLIGIBLE_LOGIT_GAP)
            .map(|(i, score)| Candidate { id: i as u32, score, weight: (score.exp() as f64 * WEIGHT_ONE).round() as u64 })
            .collect();
        c.sort_by(by_score_desc);
        if params.top_k > 0 {
            c.truncate(params.top_k);
        }
        let total: u64 = c.iter().map(|e| e.weight).sum();
        let target = ((params.top_p as f64 * total as f64).ceil() as u64).clamp(1, total);
        let mut cum = 0;
        let keep = c.iter().position(|e| {
            cum += e.weight;
            cum >= target
        });
        c.truncate(keep.map_or(c.len(), |k| k + 1));
        c.sort_by_key(|e| e.id);
        let total: u64 = c.iter().map(|e| e.weight).sum();
        let r = ((rng.next_f64() * total as f64) as u64).min(total - 1);
        let mut cum = 0;
        c.iter().find(|e| {
            cum += e.weight;
            r < cum
        }).unwrap().id
    }

    #[test]
    fn sampling_agrees_with_the_plain_way() {
        let mut gen = Rng::new(11);
        for (case, n) in [1usize, 3, 50, 64, 65, 300, 1000, 5000].into_iter().enumerate() {
            // Peaked and flat rows, with ties.
            let spread = if case % 2 == 0 { 20.0 } else { 2.0 };
            let logits: Vec<f32> = (0..n).map(|_| (gen.next_signed_f32() * spread * 8.0).round() / 8.0).collect();
            for (top_k, top_p, temperature) in [(0, 1.0, 1.0), (0, 0.9, 0.7), (40, 1.0, 1.3), (40, 0.5, 1.0), (1, 1.0, 1.0), (0, 0.999, 2.0)] {
                let params = SamplingParams { temperature, top_k, top_p, seed: n as u64 };
                let mut s = Sampler::new(params.clone(), n);
                let mut rng = Rng::new(params.seed);
                for draw in 0..30 {
                    assert_eq!(s.sample(&logits), sample_ref(&params, &mut rng, &logits), "{n} logits, {params:?}, draw {draw}");
                }
            }
        }
    }

    #[test]
    fn draws_follow_the_softmax() {
        // Probabilities 0.6, 0.3, 0.1: 20,000 seeded draws land within 1% of each.
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 7 }, 3);
        let mut counts = [0usize; 3];
        for _ in 0..20_000 {
            counts[s.sample(&logits) as usize] += 1;
        }
        for (count, p) in counts.iter().zip([0.6, 0.3, 0.1]) {
            assert!((*count as f64 / 20_000.0 - p).abs() < 0.01, "{counts:?}");
        }
    }

    #[test]
    fn bad_parameters_are_named() {
        let e = SamplingParams { top_p: 0.0, ..Default::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("top_p 0"));
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
    }
}
