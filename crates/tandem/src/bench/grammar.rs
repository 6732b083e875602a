//! What constrained decoding costs: the grammar engine's setup for the tokenizer and each
//! grammar's compile time, the sampler's time per token with and without a grammar (its mask
//! over the whole vocabulary, then the pick) for one sequence and for a serving batch, and the
//! decode rate through the pipeline with and without a grammar, interleaved, so that the
//! overhead is a fraction of this machine's own decode step.

use std::fmt::Write as _;
use std::sync::mpsc::channel;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;
use tandem_core::grammar::{Constraint, Grammars};
use tandem_core::model::load::LoadedModel;
use tandem_core::pipeline::{self, Event, Request};
use tandem_core::rng::Rng;
use tandem_core::sampling::{Sampler, SamplingParams};

use super::pipeline::prompt_of;
use super::{progress, stats};
use crate::args::Args;

/// The grammars measured: a JSON schema of the kind apps send, any JSON object, a tool call.
fn grammars(g: &Grammars) -> Result<Vec<(&'static str, Constraint)>> {
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
        "required": ["name", "age", "tags", "address"]});
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 14}, "units": {"type": "string", "enum": ["C", "F"]}}, "required": ["city"]}}}]);
    Ok(vec![
        ("JSON schema (5 fields, nested)", g.json_schema(&schema)?),
        ("any JSON object", g.json_schema(&json!({"type": "object"}))?),
        ("tool call (required)", g.tool_calls(&tools, None)?),
    ])
}

pub fn run(report: &mut String, args: &Args, quick: bool) -> Result<()> {
    let spec = args.str("model").unwrap_or("synthetic:qwen3.5-0.8b");
    let reps: usize = args.get("reps", if quick { 2 } else { 3 })?;
    let steps: usize = args.get("decode-tokens", if quick { 16 } else { 48 })?;
    let batches: Vec<usize> = match args.str("concurrency") {
        Some(list) => list.split(',').map(|s| s.trim().parse().with_context(|| format!("--concurrency {list:?}"))).collect::<Result<_>>()?,
        None if quick => vec![1, 8],
        None => vec![1, 32],
    };
    progress(&format!("loading {spec}"));
    let model = LoadedModel::load(spec)?;
    let Some(tok) = &model.tokenizer else { bail!("{spec} has no tokenizer: constrained decoding needs the tokens' bytes") };
    let vocab = model.sampleable_vocab();

    let started = Instant::now();
    let g = Grammars::new(tok, &model.stop_ids)?;
    let setup_ms = started.elapsed().as_secs_f64() * 1e3;
    let mut compile_ms = Vec::new();
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        grammars(&g)?;
        compile_ms.push(t.elapsed().as_secs_f64() * 1e3 / 3.0);
    }
    let constraints = grammars(&g)?;
    writeln!(report, "Model {spec} ({vocab} tokens). The grammar engine (llguidance) set up for the tokenizer in {setup_ms:.0} ms (once per server); a grammar compiles in {:.2} ms (mean of the three below, median of {} runs).\n", stats(&mut compile_ms).0, reps.max(1))?;

    // The sampler alone: random logits rows (a model with random weights gives such), greedy,
    // each sequence's next token in turn as the decode engine samples them.
    writeln!(report, "### The sampler per token, on the host\n")?;
    writeln!(report, "Greedy picks from random logits rows over the whole padded row ({} logits), {steps} tokens per sequence, each sequence of the batch in turn as a decode step samples them; a sequence whose grammar completes starts again. Median per token (min - max over {} runs).\n", model.net.config.vocab_size, reps.max(1))?;
    writeln!(report, "| grammar | sequences | us per token | min - max | over no grammar | per decode step (ms) |")?;
    writeln!(report, "|---|---|---|---|---|---|")?;
    let rows: Vec<Vec<f32>> = {
        let mut r = Rng::new(1);
        (0..16).map(|_| (0..model.net.config.vocab_size).map(|_| r.next_signed_f32() * 4.0).collect()).collect()
    };
    for &b in &batches {
        let mut plain = Vec::new();
        let mut per: Vec<Vec<f64>> = vec![Vec::new(); constraints.len()];
        for _ in 0..reps.max(1) {
            plain.push(sampler_us(None, &rows, b, steps, vocab, &model.stop_ids)?);
            for (k, (_, c)) in constraints.iter().enumerate() {
                per[k].push(sampler_us(Some(c), &rows, b, steps, vocab, &model.stop_ids)?);
            }
        }
        let base = stats(&mut plain).0;
        writeln!(report, "| none | {b} | {base:.1} | | | {:.3} |", base * b as f64 / 1e3)?;
        for (k, (name, _)) in constraints.iter().enumerate() {
            let (m, lo, hi) = stats(&mut per[k]);
            writeln!(report, "| {name} | {b} | {m:.1} | {lo:.1} - {hi:.1} | +{:.1} | {:.3} |", m - base, m * b as f64 / 1e3)?;
        }
    }

    // End to end: the decode engine's rate with the grammar against without, interleaved.
    let config = super::pipeline_config(args, &tandem_core::backend::cpu::pool::allowed_cores())?;
    writeln!(report, "\n### Decode through the pipeline\n")?;
    writeln!(report, "Prefill {} -> decode {}: the sequences submitted at once, 32-token prompts, up to {steps} tokens each, greedy; with the JSON schema above against no grammar, interleaved, {} runs. Per-request decode tok/s (median of the requests, then of the runs), and the decode step's time that it comes to.\n", config.prefill, config.decode, reps.max(1))?;
    writeln!(report, "| sequences | no grammar tok/s | JSON schema tok/s | min - max | step ms (none / schema) | overhead |")?;
    writeln!(report, "|---|---|---|---|---|---|")?;
    let schema = &constraints[0].1;
    for &b in &batches {
        progress(&format!("{b} sequences through the pipeline, with and without a grammar"));
        let mut rates = [Vec::new(), Vec::new()];
        pipeline::run(&model.net, &tandem_core::pipeline::PipelineConfig { max_batch: b.max(1), ..config.clone() }, |p| {
            for _ in 0..reps.max(1) {
                for (k, c) in [None, Some(schema)].into_iter().enumerate() {
                    let (tx, rx) = channel();
                    for i in 0..b {
                        let sampling = SamplingParams { constraint: c.cloned(), ..Default::default() };
                        p.submit(Request { sampling, stop_ids: model.stop_ids.clone(), ..Request::new(i as u64, prompt_of(32 + i, vocab), steps, vocab, tx.clone()) })?;
                    }
                    drop(tx);
                    let mut per_request = Vec::new();
                    for e in rx {
                        match e {
                            Event::Done { timings, .. } if timings.generated >= 2 => per_request.push(timings.decode_tok_s()),
                            Event::Failed { error, .. } => bail!("{error}"),
                            _ => {}
                        }
                    }
                    rates[k].push(stats(&mut per_request).0);
                }
            }
            Ok(())
        })?;
        let (none, _, _) = stats(&mut rates[0]);
        let (with, lo, hi) = stats(&mut rates[1]);
        // A request's decode rate is one token per step.
        writeln!(report, "| {b} | {none:.1} | {with:.1} | {lo:.1} - {hi:.1} | {:.1} / {:.1} | {:+.1}% |", 1e3 / none, 1e3 / with, (none / with - 1.0) * 100.0)?;
    }
    writeln!(report)?;
    Ok(())
}

/// Mean microseconds per token of `b` samplers (with `constraint`, or none) picking `steps`
/// tokens each from `rows`, in turn.
fn sampler_us(constraint: Option<&Constraint>, rows: &[Vec<f32>], b: usize, steps: usize, vocab: usize, ends: &[u32]) -> Result<f64> {
    let params = SamplingParams { constraint: constraint.cloned(), ..Default::default() };
    let mut samplers: Vec<Sampler> = (0..b).map(|_| Sampler::new(params.clone(), vocab)).collect();
    let started = Instant::now();
    for step in 0..steps {
        for (i, s) in samplers.iter_mut().enumerate() {
            let t = s.sample(&rows[(step * 7 + i) % rows.len()])?;
            if ends.contains(&t) {
                *s = Sampler::new(params.clone(), vocab);
            }
        }
    }
    Ok(started.elapsed().as_secs_f64() * 1e6 / (b * steps) as f64)
}
