//! Choosing the next token from logits: greedy, or temperature / min-p / top-k / top-p with a
//! seeded generator, after the request's logit bias and repetition penalties, reporting
//! log-probabilities where asked. Logit rows past the tokenizer's vocabulary (Qwen3.5 pads
//! 248077 real ids to 248320 rows) are never chosen. Weights are integers (exact sums in any
//! order) and a draw walks the kept tokens in id order, so that a temperature without cuts sorts
//! nothing and a GPU can draw the same token from a row it holds (kernels/sample.cu
//! sample_rows).
//!
//! The order is vLLM's: logit bias, then the penalties, then the temperature, then the cuts
//! (min-p, top-k, top-p). Log-probabilities are those of the model's own logits (vLLM's
//! default): what the model thought of the token, before the request changed the odds.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use anyhow::{bail, Result};

use crate::grammar::{self, Constraint};
use crate::rng::Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    /// 0 means no cut: tokens less likely than `min_p` times the likeliest are left out.
    pub min_p: f32,
    pub seed: u64,
    /// Added to these tokens' logits (OpenAI's `logit_bias`), in id order.
    pub logit_bias: Vec<(u32, f32)>,
    pub penalties: Penalties,
    /// Report each token's log-probability and those of this many of the likeliest
    /// (OpenAI's `logprobs` / `top_logprobs`). None: nothing reported.
    pub logprobs: Option<usize>,
    /// A grammar the tokens must follow (structured output, tool-call arguments).
    pub constraint: Option<Constraint>,
}

/// OpenAI's presence and frequency penalties (subtracted from the logits of tokens generated
/// so far: once, and once per time generated) and the repetition penalty of transformers and
/// vLLM (a positive logit divided by it, a negative one multiplied, for every token in the
/// prompt or generated).
#[derive(Clone, Debug, PartialEq)]
pub struct Penalties {
    pub presence: f32,
    pub frequency: f32,
    /// 1 means none.
    pub repetition: f32,
    /// The prompt's tokens, for the repetition penalty.
    pub prompt: Arc<[u32]>,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties { presence: 0.0, frequency: 0.0, repetition: 1.0, prompt: Arc::from(Vec::new()) }
    }
}

impl Penalties {
    fn any(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0, logit_bias: Vec::new(), penalties: Penalties::default(), logprobs: None, constraint: None }
    }
}

/// The most log-probabilities reported per token besides the chosen one's (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("temperature {} must be a finite number >= 0", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p {} must be in (0, 1]", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("min_p {} must be in [0, 1]", self.min_p);
        }
        let p = &self.penalties;
        for (name, v) in [("presence_penalty", p.presence), ("frequency_penalty", p.frequency)] {
            if !(-2.0..=2.0).contains(&v) {
                bail!("{name} {v} must be in [-2, 2]");
            }
        }
        if !(p.repetition > 0.0 && p.repetition <= 2.0) {
            bail!("repetition_penalty {} must be in (0, 2]", p.repetition);
        }
        if let Some(&(id, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            bail!("logit_bias {b} for token {id} must be in [-100, 100]");
        }
        if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            bail!("top_logprobs {} must be at most {MAX_TOP_LOGPROBS}", self.logprobs.unwrap_or_default());
        }
        Ok(())
    }

    /// Whether the logits are changed before a token is chosen (so that only the host, with
    /// the row in hand, chooses).
    fn adjusts(&self) -> bool {
        !self.logit_bias.is_empty() || self.penalties.any() || (self.temperature > 0.0 && self.min_p > 0.0) || self.constraint.is_some()
    }
}

/// The log-probabilities reported for one sampled token (of the model's own logits).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The likeliest tokens, likeliest first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
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
    /// The row after the bias and penalties (where the request has them).
    adjusted: Vec<f32>,
    /// How many times each token was generated (for the presence and frequency penalties).
    generated: HashMap<u32, u32>,
    /// The prompt's distinct tokens (for the repetition penalty).
    in_prompt: HashSet<u32>,
    /// The last token's log-probabilities, until taken.
    logprobs: Option<TokenLogprobs>,
    /// Where the request has a grammar: this sequence's place in it.
    grammar: Option<grammar::Follower>,
}

/// A pick a GPU makes from a row it holds after masking it with a grammar's mask
/// (`Sampler::gpu_masked_pick`; kernels/sample.cu mask_rows): over ids below `allowed`, only
/// those whose bit in `mask` is set; greedy, or `draw`.
#[derive(Clone, Copy, Debug)]
pub struct MaskedPick<'a> {
    pub allowed: usize,
    pub mask: &'a [u32],
    pub draw: Option<GpuDraw>,
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
        let in_prompt = if params.penalties.repetition != 1.0 { params.penalties.prompt.iter().copied().collect() } else { HashSet::new() };
        let grammar = params.constraint.as_ref().map(grammar::Follower::new);
        Sampler { params, rng, allowed: allowed_vocab, candidates: Vec::new(), adjusted: Vec::new(), generated: HashMap::new(), in_prompt, logprobs: None, grammar }
    }

    /// Compute the grammar's mask for the next token now (where there is a grammar and it is
    /// not computed yet): it depends only on the tokens taken so far, so a decode loop computes
    /// it while the GPU computes the logits it will mask. The pick is the same either way.
    pub fn prepare(&mut self) {
        if let Some(g) = &mut self.grammar {
            g.prepare();
        }
    }

    /// Whether this sampler's next pick waits on a grammar's mask that `prepare` has not
    /// computed yet.
    pub fn unprepared(&self) -> bool {
        self.grammar.as_ref().is_some_and(|g| !g.prepared())
    }

    /// Where a grammar is all that changes this sampler's logits and nothing else reads them:
    /// the pick a GPU makes by masking the row it holds (the mask computed now where `prepare`
    /// has not; the draw's uniform taken from the generator now). The GPU's token goes back
    /// through `took`; where the GPU cannot pick, `sample_drawn` with the draw's uniform (or
    /// `sample` for a greedy pick) picks the same on the host. An error where the grammar
    /// engine fails.
    pub fn gpu_masked_pick(&mut self) -> Option<Result<MaskedPick<'_>>> {
        let p = &self.params;
        let only_grammar = p.logit_bias.is_empty() && !p.penalties.any() && !(p.temperature > 0.0 && p.min_p > 0.0) && p.logprobs.is_none();
        if self.grammar.is_none() || !only_grammar {
            return None;
        }
        let draw = (p.temperature > 0.0).then(|| GpuDraw { allowed: self.allowed, inv_t: 1.0 / p.temperature, top_k: p.top_k, top_p: p.top_p, u: self.rng.next_f64() });
        let allowed = self.allowed;
        self.grammar.as_mut().map(|g| g.mask().map(|mask| MaskedPick { allowed, mask, draw }))
    }

    /// Note `token`, which a GPU picked for this sampler (`gpu_masked_pick`).
    pub fn took(&mut self, token: u32) {
        self.chose(&[], token)
    }

    /// Whether this sampler must see the logits row itself: it changes the logits, or reports
    /// log-probabilities. Then a GPU's own pick (`greedy_pick`, `gpu_draw`) is not taken.
    pub fn reads_logits(&self) -> bool {
        self.params.adjusts() || self.params.logprobs.is_some()
    }

    /// The token this sampler picks given `argmax`, the argmax of the model's whole logits row,
    /// where that alone decides it: greedy sampling of the logits as they are, and an allowed
    /// id (the first largest of all rows is then also the first largest of the allowed ones).
    pub fn greedy_pick(&self, argmax: u32) -> Option<u32> {
        (self.params.temperature == 0.0 && !self.reads_logits() && (argmax as usize) < self.allowed).then_some(argmax)
    }

    /// The next token: greedy at temperature 0; else the candidates' softmax at the
    /// temperature, cut to those at least `min_p` as likely as the likeliest, to the `top_k`
    /// highest and then to the shortest run of highest whose mass reaches `top_p`, and one
    /// drawn from what is kept (walking it in id order, so that no sort is needed without a
    /// cut). The logit bias and the penalties first change the row where the request has them,
    /// and a grammar leaves only the tokens it allows. An error where the grammar engine fails
    /// or allows nothing.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        let logits = &logits[..self.allowed.min(logits.len())];
        let u = (self.params.temperature > 0.0).then(|| self.rng.next_f64());
        let row = if self.params.adjusts() {
            self.adjust(logits)?;
            &self.adjusted[..]
        } else {
            logits
        };
        let token = match u {
            None => argmax(row),
            Some(u) => draw(&mut self.candidates, &self.params, row, u),
        };
        self.chose(logits, token);
        Ok(token)
    }

    /// The draw a GPU makes for this sampler's next token from a row of logits it holds
    /// (kernels/sample.cu sample_rows): at a temperature above 0, with the uniform taken from
    /// the generator now, where the logits are drawn from as they are. The host draws with
    /// `sample_drawn` and the same uniform where the GPU cannot. None otherwise.
    pub fn gpu_draw(&mut self) -> Option<GpuDraw> {
        let p = &self.params;
        (p.temperature > 0.0 && !self.reads_logits()).then(|| GpuDraw { allowed: self.allowed, inv_t: 1.0 / p.temperature, top_k: p.top_k, top_p: p.top_p, u: self.rng.next_f64() })
    }

    /// `sample` with its uniform draw `u` (in [0, 1)) already taken (by `gpu_draw` or
    /// `gpu_masked_pick`).
    pub fn sample_drawn(&mut self, logits: &[f32], u: f64) -> Result<u32> {
        let logits = &logits[..self.allowed.min(logits.len())];
        let row = if self.params.adjusts() {
            self.adjust(logits)?;
            &self.adjusted[..]
        } else {
            logits
        };
        let token = draw(&mut self.candidates, &self.params, row, u);
        self.chose(logits, token);
        Ok(token)
    }

    /// The log-probabilities of the token chosen last (where the request asked for them).
    pub fn take_logprobs(&mut self) -> Option<TokenLogprobs> {
        self.logprobs.take()
    }

    /// `logits` with the bias, the penalties and the grammar's mask, into `adjusted`.
    fn adjust(&mut self, logits: &[f32]) -> Result<()> {
        let row = &mut self.adjusted;
        row.clear();
        row.extend_from_slice(logits);
        for &(id, bias) in &self.params.logit_bias {
            if let Some(l) = row.get_mut(id as usize) {
                *l += bias;
            }
        }
        let p = &self.params.penalties;
        if p.repetition != 1.0 {
            let repeated = |l: &mut f32| *l = if *l > 0.0 { *l / p.repetition } else { *l * p.repetition };
            for &id in self.in_prompt.iter().filter(|id| !self.generated.contains_key(id)).chain(self.generated.keys()) {
                if let Some(l) = row.get_mut(id as usize) {
                    repeated(l);
                }
            }
        }
        for (&id, &count) in &self.generated {
            if let Some(l) = row.get_mut(id as usize) {
                *l -= p.frequency * count as f32 + p.presence;
            }
        }
        if let Some(g) = &mut self.grammar {
            grammar::apply(g.mask()?, row);
        }
        Ok(())
    }

    /// Note the chosen token (for the penalties and the grammar) and its log-probabilities
    /// (where asked for).
    fn chose(&mut self, logits: &[f32], token: u32) {
        if self.params.penalties.any() {
            *self.generated.entry(token).or_insert(0) += 1;
        }
        if let Some(n) = self.params.logprobs {
            self.logprobs = Some(logprobs(logits, token, n));
        }
        if let Some(g) = &mut self.grammar {
            g.take(token);
        }
    }
}

/// Each sampler's next token from its row, the rows split over up to `threads` threads (the
/// rows of a step are independent; each sampler is used by one thread). The same picks as one
/// after another.
pub fn sample_side_by_side(rows: &mut [(&[f32], &mut Sampler)], threads: usize) -> Vec<Result<u32>> {
    if threads <= 1 || rows.len() <= 1 {
        return rows.iter_mut().map(|(row, s)| s.sample(row)).collect();
    }
    let per = rows.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let parts: Vec<_> = rows.chunks_mut(per).map(|part| scope.spawn(move || part.iter_mut().map(|(row, s)| s.sample(row)).collect::<Vec<_>>())).collect();
        parts.into_iter().flat_map(|p| p.join().unwrap_or_else(|_| vec![Err(anyhow::anyhow!("a sampling thread panicked"))])).collect()
    })
}

/// `Sampler::prepare` for every sampler whose grammar's mask is not computed yet, split over up
/// to `threads` threads.
pub fn prepare_side_by_side(samplers: &mut [&mut Sampler], threads: usize) {
    let mut waiting: Vec<&mut Sampler> = samplers.iter_mut().filter(|s| s.unprepared()).map(|s| &mut **s).collect();
    if threads <= 1 || waiting.len() <= 1 {
        waiting.iter_mut().for_each(|s| s.prepare());
        return;
    }
    let per = waiting.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for part in waiting.chunks_mut(per) {
            scope.spawn(move || part.iter_mut().for_each(|s| s.prepare()));
        }
    });
}

/// One token drawn from `logits` (already cut to the allowed ids) at the temperature, with the
/// cuts, by the uniform `u`.
fn draw(candidates: &mut Vec<Candidate>, params: &SamplingParams, logits: &[f32], u: f64) -> u32 {
    let inv_t = 1.0 / params.temperature;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // min-p: a probability below min_p times the largest is a score below ln(min_p).
    let floor = params.min_p.ln();
    let kept = |score: f32| if params.min_p > 0.0 { score >= floor && score > -NEGLIGIBLE_LOGIT_GAP } else { score > -NEGLIGIBLE_LOGIT_GAP };
    candidates.clear();
    for (i, &l) in logits.iter().enumerate() {
        let score = (l - max) * inv_t;
        if kept(score) {
            let weight = (score.exp() as f64 * WEIGHT_ONE).round() as u64;
            candidates.push(Candidate { id: i as u32, score, weight });
        }
    }
    if candidates.is_empty() {
        // Every logit NaN (or the row empty): as greedy does.
        return argmax(logits);
    }
    let c = &mut candidates[..];
    let mut keep = c.len();
    let top_k = params.top_k > 0 && params.top_k < keep;
    if top_k {
        c.select_nth_unstable_by(params.top_k - 1, by_score_desc);
        keep = params.top_k;
    }
    let top_p = params.top_p < 1.0;
    if top_p {
        keep = nucleus(&mut c[..keep], params.top_p);
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

/// The log-softmax of `logits` at `token` and at the `n` largest (the first ones on ties).
/// The sum of the exponentials is taken in f64, over the whole row.
pub fn logprobs(logits: &[f32], token: u32, n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - log_z) as f32;
    // The n largest, kept sorted (largest first, then lower id) as the row is read once.
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if top.len() < n || top.last().is_some_and(|&(_, least)| l > least) {
                let at = top.partition_point(|&(_, v)| v >= l);
                top.insert(at, (i as u32, l));
                top.truncate(n);
            }
        }
    }
    TokenLogprobs { token, logprob: logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| lp(l)), top: top.into_iter().map(|(id, l)| (id, lp(l))).collect() }
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
        assert_eq!(s.sample(&logits).unwrap(), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_repeat() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect();
        let p = SamplingParams { temperature: 1.0, top_k: 1, seed: 5, ..Default::default() };
        assert_eq!(Sampler::new(p, 100).sample(&logits).unwrap(), argmax(&logits));
        let p = SamplingParams { temperature: 1.0, top_p: 0.9, seed: 5, ..Default::default() };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone(), 100);
            (0..20).map(|_| s.sample(&logits).unwrap()).collect()
        };
        let mut s = Sampler::new(p, 100);
        let b: Vec<u32> = (0..20).map(|_| s.sample(&logits).unwrap()).collect();
        assert_eq!(a, b);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1, "sampling at T=1 varies");
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Probabilities ~ [0.6, 0.3, 0.1]: top_p 0.5 leaves only the first.
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_p: 0.5, seed: 1, ..Default::default() }, 3);
        assert!((0..50).all(|_| s.sample(&logits).unwrap() == 0));
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_p: 0.85, seed: 1, ..Default::default() }, 3);
        let picks: Vec<u32> = (0..200).map(|_| s.sample(&logits).unwrap()).collect();
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
            // min-p on the probabilities: at least min_p times the largest (whose score is 0).
            .filter(|&(_, score)| params.min_p == 0.0 || (score as f64).exp() >= params.min_p as f64 * (1.0 - 1e-6))
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
            for (top_k, top_p, temperature, min_p) in [(0, 1.0, 1.0, 0.0), (0, 0.9, 0.7, 0.0), (40, 1.0, 1.3, 0.0), (40, 0.5, 1.0, 0.0), (1, 1.0, 1.0, 0.0), (0, 0.999, 2.0, 0.0), (0, 1.0, 1.0, 0.05), (20, 0.95, 0.7, 0.2), (0, 1.0, 1.0, 1.0)] {
                let params = SamplingParams { temperature, top_k, top_p, min_p, seed: n as u64, ..Default::default() };
                let mut s = Sampler::new(params.clone(), n);
                let mut rng = Rng::new(params.seed);
                for draw in 0..30 {
                    assert_eq!(s.sample(&logits).unwrap(), sample_ref(&params, &mut rng, &logits), "{n} logits, {params:?}, draw {draw}");
                }
            }
        }
    }

    #[test]
    fn draws_follow_the_softmax() {
        // Probabilities 0.6, 0.3, 0.1: 20,000 seeded draws land within 1% of each.
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, seed: 7, ..Default::default() }, 3);
        let mut counts = [0usize; 3];
        for _ in 0..20_000 {
            counts[s.sample(&logits).unwrap() as usize] += 1;
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

    /// The bias and penalties the plain way: the row copied, each rule applied to every token
    /// it names, in vLLM's order.
    fn adjusted_ref(params: &SamplingParams, logits: &[f32], generated: &[u32]) -> Vec<f32> {
        let mut row = logits.to_vec();
        for &(id, b) in &params.logit_bias {
            row[id as usize] += b;
        }
        let p = &params.penalties;
        for (id, l) in row.iter_mut().enumerate() {
            let id = id as u32;
            let count = generated.iter().filter(|&&g| g == id).count();
            if p.prompt.contains(&id) || count > 0 {
                *l = if *l > 0.0 { *l / p.repetition } else { *l * p.repetition };
            }
            *l -= p.frequency * count as f32;
            if count > 0 {
                *l -= p.presence;
            }
        }
        row
    }

    #[test]
    fn bias_and_penalties_agree_with_the_plain_way() {
        let mut gen = Rng::new(3);
        let n = 300;
        let logits: Vec<f32> = (0..n).map(|_| gen.next_signed_f32() * 4.0).collect();
        let prompt: Arc<[u32]> = Arc::from((0..40).map(|i| (i * 7 % n) as u32).collect::<Vec<_>>());
        for (temperature, presence, frequency, repetition) in [(0.0, 0.5, 0.0, 1.0), (0.0, 0.0, 0.7, 1.0), (0.0, 0.0, 0.0, 1.3), (0.8, 1.5, 0.3, 1.1), (1.0, -0.5, 0.0, 0.8)] {
            let params = SamplingParams {
                temperature,
                seed: 9,
                logit_bias: vec![(3, 5.0), (17, -100.0), (250, 2.5)],
                penalties: Penalties { presence, frequency, repetition, prompt: prompt.clone() },
                ..Default::default()
            };
            params.validate().unwrap();
            let mut s = Sampler::new(params.clone(), n);
            assert!(s.reads_logits() && s.greedy_pick(0).is_none());
            let mut rng = Rng::new(params.seed);
            let mut generated = Vec::new();
            for step in 0..40 {
                let row = adjusted_ref(&params, &logits, &generated);
                let want = if temperature == 0.0 { argmax_ref(&row) } else { sample_ref(&params, &mut rng, &row) };
                let got = s.sample(&logits).unwrap();
                assert_eq!(got, want, "{params:?}, step {step}");
                generated.push(got);
            }
            if frequency > 0.0 {
                // The penalty grows with each repeat: greedy does not repeat one token 40 times.
                assert!(generated.iter().collect::<HashSet<_>>().len() > 1, "{params:?}: {generated:?}");
            }
            assert!(!generated.contains(&17), "a -100 bias leaves the token out");
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_of_the_model_logits() {
        let mut gen = Rng::new(5);
        let logits: Vec<f32> = (0..1000).map(|_| (gen.next_signed_f32() * 16.0).round() / 4.0).collect();
        let params = SamplingParams { logprobs: Some(5), logit_bias: vec![(10, 50.0)], ..Default::default() };
        let mut s = Sampler::new(params, 1000);
        assert_eq!(s.sample(&logits).unwrap(), 10, "the bias decides the pick");
        let lp = s.take_logprobs().expect("asked for");
        assert!(s.take_logprobs().is_none(), "taken once");
        // The plain way: f64 softmax, every token sorted.
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let want = |id: usize| ((logits[id] as f64).exp() / z).ln() as f32;
        assert_eq!(lp.token, 10);
        assert!((lp.logprob - want(10)).abs() < 1e-5, "{} vs {}", lp.logprob, want(10));
        let mut order: Vec<usize> = (0..1000).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        assert_eq!(lp.top.iter().map(|t| t.0 as usize).collect::<Vec<_>>(), order[..5].to_vec());
        for &(id, l) in &lp.top {
            assert!((l - want(id as usize)).abs() < 1e-5);
        }
        assert!(logprobs(&logits, 0, 0).top.is_empty());
        // Sampling that reports log-probabilities still follows its seed.
        let p = SamplingParams { temperature: 0.9, seed: 4, ..Default::default() };
        let mut plain = Sampler::new(p.clone(), 1000);
        let mut reporting = Sampler::new(SamplingParams { logprobs: Some(0), ..p }, 1000);
        for _ in 0..20 {
            assert_eq!(plain.sample(&logits).unwrap(), reporting.sample(&logits).unwrap());
            assert!(reporting.take_logprobs().is_some_and(|l| l.top.is_empty()));
        }
    }

    #[test]
    fn out_of_range_options_are_named() {
        let bad = |p: SamplingParams| p.validate().unwrap_err().to_string();
        assert!(bad(SamplingParams { min_p: 1.5, ..Default::default() }).contains("min_p"));
        assert!(bad(SamplingParams { penalties: Penalties { presence: 3.0, ..Default::default() }, ..Default::default() }).contains("presence_penalty"));
        assert!(bad(SamplingParams { penalties: Penalties { repetition: 0.0, ..Default::default() }, ..Default::default() }).contains("repetition_penalty"));
        assert!(bad(SamplingParams { logit_bias: vec![(4, 101.0)], ..Default::default() }).contains("token 4"));
        assert!(bad(SamplingParams { logprobs: Some(21), ..Default::default() }).contains("at most 20"));
    }
}
