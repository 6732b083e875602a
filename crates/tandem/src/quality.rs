//! How much `--quant` changes the model's outputs, measured against the same model with its
//! stored weights on a reference file's prompts: top-1 agreement of the prefill logits at
//! every position, the largest logit difference, and whether the greedy continuation (16
//! tokens, fed back through the state) stays identical.

use std::path::Path;

use anyhow::{Context, Result};

use tandem_core::model::load::LoadedModel;
use tandem_core::model::quant::Quant;
use tandem_core::model::{Logits, Qwen35};
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::sampling::argmax;
use tandem_core::state::{LayerState, State};

#[derive(Debug, Clone)]
pub struct QualityRow {
    pub prompt: String,
    pub positions: usize,
    pub top1_agree: usize,
    pub max_logit_diff: f32,
    pub greedy_identical: usize,
    pub greedy_total: usize,
    pub first_greedy_divergence: Option<usize>,
}

impl std::fmt::Display for QualityRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "| {} | {} | {}/{} ({:.1}%) | {:.3} | {}/{}{} |",
            self.prompt,
            self.positions,
            self.top1_agree,
            self.positions,
            100.0 * self.top1_agree as f64 / self.positions as f64,
            self.max_logit_diff,
            self.greedy_identical,
            self.greedy_total,
            self.first_greedy_divergence.map(|i| format!(" (first differs at step {i})")).unwrap_or_default()
        )
    }
}

/// Compare `quant` with the stored weights on the prompts (`pK.input_ids`) of a reference file.
pub fn quantized_vs_stored(pool: &Pool, model_dir: &str, quant: Quant, reference: &Path) -> Result<Vec<QualityRow>> {
    let model = LoadedModel::load(model_dir)?;
    let mut q = model.net.clone();
    q.quantize(quant, pool);
    let bytes = std::fs::read(reference).with_context(|| format!("reading {}", reference.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| anyhow::anyhow!("{}: {e}", reference.display()))?;
    let mut names: Vec<String> = st.names().iter().filter_map(|n| n.strip_suffix(".input_ids")).map(String::from).collect();
    names.sort();
    let mut rows = Vec::new();
    for p in names {
        let ids: Vec<u32> = st
            .tensor(&format!("{p}.input_ids"))?
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect();
        rows.push(compare(pool, &model.net, &q, &p, &ids, 16, model.sampleable_vocab())?);
    }
    Ok(rows)
}

/// Compare two versions of a model on one prompt.
pub fn compare(pool: &Pool, a: &Qwen35, b: &Qwen35, name: &str, ids: &[u32], greedy: usize, vocab: usize) -> Result<QualityRow> {
    let v = a.config.vocab_size;
    let (mut sa, mut sb) = (State::new(&a.config), State::new(&b.config));
    let la = a.forward(pool, ids, &mut sa, Logits::All)?;
    let lb = b.forward(pool, ids, &mut sb, Logits::All)?;
    let mut top1 = 0;
    for (ra, rb) in la.chunks(v).zip(lb.chunks(v)) {
        top1 += (argmax(&ra[..vocab]) == argmax(&rb[..vocab])) as usize;
    }
    let max_diff = la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    // Greedy continuations, each model following its own choices.
    let (mut ga, mut gb) = (Vec::new(), Vec::new());
    for _ in 0..greedy {
        let (ia, ib) = (argmax(&sa.last_logits[..vocab]), argmax(&sb.last_logits[..vocab]));
        ga.push(ia);
        gb.push(ib);
        a.decode_batch(pool, &[ia], &mut [&mut sa])?;
        b.decode_batch(pool, &[ib], &mut [&mut sb])?;
    }
    let first = ga.iter().zip(&gb).position(|(x, y)| x != y);
    Ok(QualityRow {
        prompt: name.to_string(),
        positions: ids.len(),
        top1_agree: top1,
        max_logit_diff: max_diff,
        greedy_identical: ga.iter().zip(&gb).filter(|(x, y)| x == y).count(),
        greedy_total: greedy,
        first_greedy_divergence: first,
    })
}

/// How far two versions of a model's states are apart after `tokens` tokens.
#[derive(Debug, Clone)]
pub struct DriftRow {
    pub tokens: usize,
    /// Largest over the DeltaNet layers of max |a - b| / max |a| of the recurrent state.
    pub recurrent: f32,
    /// The same over the attention layers' keys and values.
    pub kv: f32,
    /// Largest difference of the last position's logits.
    pub logits: f32,
    /// Whether the last position's largest logit is the same token.
    pub top1_same: bool,
}

impl std::fmt::Display for DriftRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "| {} | {:.2e} | {:.2e} | {:.3} | {} |", self.tokens, self.recurrent, self.kv, self.logits, if self.top1_same { "yes" } else { "no" })
    }
}

/// Feed `a` and `b` the same `tokens` in pieces of `every` (a prompt in pieces computes what
/// one call does) and compare their states after each piece: whether the difference the
/// recurrent state carries forward grows with the tokens or stays bounded.
pub fn drift(pool: &Pool, a: &Qwen35, b: &Qwen35, tokens: &[u32], every: usize, vocab: usize) -> Result<Vec<DriftRow>> {
    let (mut sa, mut sb) = (State::new(&a.config), State::new(&b.config));
    let mut rows = Vec::new();
    for piece in tokens.chunks(every.max(1)) {
        a.forward(pool, piece, &mut sa, Logits::Last)?;
        b.forward(pool, piece, &mut sb, Logits::Last)?;
        let (mut recurrent, mut kv) = (0f32, 0f32);
        for (la, lb) in sa.layers.iter().zip(&sb.layers) {
            match (la, lb) {
                (LayerState::Linear { recurrent: ra, .. }, LayerState::Linear { recurrent: rb, .. }) => recurrent = recurrent.max(relative_difference(ra, rb)),
                (LayerState::Full { k: ka, v: va }, LayerState::Full { k: kb, v: vb }) => kv = kv.max(relative_difference(ka, kb)).max(relative_difference(va, vb)),
                _ => anyhow::bail!("the two models' layers are of different kinds"),
            }
        }
        let (la, lb) = (&sa.last_logits[..vocab], &sb.last_logits[..vocab]);
        rows.push(DriftRow {
            tokens: sa.position,
            recurrent,
            kv,
            logits: la.iter().zip(lb).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max),
            top1_same: argmax(la) == argmax(lb),
        });
    }
    Ok(rows)
}

/// max |a - b| / max |a| (0 for two empty or all-zero tensors that agree).
fn relative_difference(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    if diff == 0.0 {
        0.0
    } else {
        diff / scale.max(f32::MIN_POSITIVE)
    }
}
