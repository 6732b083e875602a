//! Two CPU engines on one machine. A CPU's prefill is bound by its cores' arithmetic and its
//! decode by memory bandwidth, so a prefill engine and a decode engine can share a socket only
//! if the prefill leaves the decode engine's cores their reads. Measured here: each engine
//! alone and both at once (decode tok/s and GB/s against the read ceiling of the decode
//! engine's own cores; prefill tok/s), and one sequence's decode on 1, 2, 4, ... of the
//! allowed cores against the whole machine's read bandwidth: how few cores reach it.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::Instant;

use anyhow::{anyhow, Result};
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::engine::{Device, Engine, EngineSpec};
use tandem_core::model::load::LoadedModel;
use tandem_core::model::Qwen35;
use tandem_core::pipeline::PipelineConfig;

use super::pipeline::{on_engine, on_own_thread, prompt_of};
use super::{limits, stats, Bar, Record};

/// A decode engine at this share of the machine's read bandwidth counts as reaching it.
const REACHES: f64 = 0.9;
/// Bytes each read-ceiling measurement streams (above any cache).
const CEILING_BYTES: usize = 256 << 20;

/// One repetition's measurements of the two engines.
#[derive(Default)]
struct Together {
    decode_alone: f64,
    decode_beside: f64,
    prefill_alone: f64,
    prefill_beside: f64,
    /// The decode engine's cores' read bandwidth, just before.
    ceiling: f64,
}

#[allow(clippy::too_many_arguments)]
pub fn section(rec: &mut Record, model: &LoadedModel, config: &PipelineConfig, allowed: &[usize], prompt_tokens: usize, decode_tokens: usize, reps: usize, spec: &str) -> Result<()> {
    let (p, d) = (&config.prefill, &config.decode);
    if p.device != Device::Cpu || d.device != Device::Cpu {
        writeln!(rec.report, "\n## Two CPU engines at once\n\nNot run: the prefill engine ({p}) and the decode engine ({d}) are not both CPU engines.")?;
        return Ok(());
    }
    let net = &model.net;
    let vocab = model.sampleable_vocab();
    let decode_bytes = super::decode_bytes_per_token(net, &Pool::new(1), decode_tokens)?;

    let mut bar = Bar::new("placement", reps * 3);
    let mut runs = Vec::new();
    for _ in 0..reps {
        runs.push(together(net, p, d, vocab, prompt_tokens, decode_tokens, &mut bar)?);
    }
    writeln!(rec.report, "\n## Two CPU engines at once ({spec}, prefill engine {p}, decode engine {d}, median of {reps})\n")?;
    writeln!(rec.report, "| engine | measure | alone | beside the other engine's work | beside / alone |")?;
    writeln!(rec.report, "|---|---|---|---|---|")?;
    let col = |f: &dyn Fn(&Together) -> f64| stats(&mut runs.iter().map(f).collect::<Vec<_>>());
    let (ceiling, _, _) = col(&|r| r.ceiling);
    let ((da, da_lo, da_hi), (db, db_lo, db_hi)) = (col(&|r| r.decode_alone), col(&|r| r.decode_beside));
    let ((pa, pa_lo, pa_hi), (pb, pb_lo, pb_hi)) = (col(&|r| r.prefill_alone), col(&|r| r.prefill_beside));
    writeln!(rec.report, "| decode | tok/s, one sequence | {da:.2} ({da_lo:.2} - {da_hi:.2}) | {db:.2} ({db_lo:.2} - {db_hi:.2}) | {:.2} |", db / da)?;
    writeln!(
        rec.report,
        "| decode | GB/s ({:.0} MB a token), of its cores' read ceiling | {:.1} ({:.0}%) | {:.1} ({:.0}%) | |",
        decode_bytes / 1e6,
        da * decode_bytes / 1e9,
        100.0 * da * decode_bytes / ceiling,
        db * decode_bytes / 1e9,
        100.0 * db * decode_bytes / ceiling
    )?;
    writeln!(rec.report, "| prefill | tok/s, {prompt_tokens}-token prompt | {pa:.1} ({pa_lo:.1} - {pa_hi:.1}) | {pb:.1} ({pb_lo:.1} - {pb_hi:.1}) | {:.2} |", pb / pa)?;
    writeln!(
        rec.report,
        "\nThe decode engine's cores' read ceiling: {:.1} GB/s (median, measured on its pool before each repetition). Beside: the decode engine decodes one sequence step after step for as long as the prefill engine takes to prefill the prompt once.",
        ceiling / 1e9
    )?;
    for r in &runs {
        rec.run(
            "placement",
            serde_json::json!({"prefill_engine": p.to_string(), "decode_engine": d.to_string(), "prompt_tokens": prompt_tokens, "decode_bytes_per_token": decode_bytes,
                "decode_alone_tok_s": r.decode_alone, "decode_beside_tok_s": r.decode_beside, "prefill_alone_tok_s": r.prefill_alone,
                "prefill_beside_tok_s": r.prefill_beside, "decode_cores_read_bytes_per_s": r.ceiling}),
        );
    }
    decode_by_cores(rec, net, d, allowed, vocab, decode_tokens, decode_bytes, reps, spec)
}

/// One sequence's decode on `engine` after a 13-token prompt: tok/s over the steps it takes
/// while `more(steps taken)` says so.
fn decode_rate(engine: &Engine, vocab: usize, more: &mut dyn FnMut(usize) -> bool) -> Result<f64> {
    let id = |i: usize| ((i * 7919 + 17) % vocab) as u32;
    let mut st = engine.new_state()?;
    engine.prefill(&prompt_of(13, vocab), &mut st)?;
    engine.decode(&[id(0)], &mut [&mut st])?;
    let (t, mut n) = (Instant::now(), 0);
    while more(n) {
        engine.decode(&[id(n + 1)], &mut [&mut st])?;
        n += 1;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// One repetition: decode alone, prefill alone, then both at once, each engine on its own
/// thread (its pool pinned where its placement names cores) and the phases kept in step.
fn together(net: &Qwen35, p: &EngineSpec, d: &EngineSpec, vocab: usize, prompt_tokens: usize, decode_tokens: usize, bar: &mut Bar) -> Result<Together> {
    let phase = Barrier::new(2);
    let prefilling = AtomicBool::new(false);
    let prompt = prompt_of(prompt_tokens, vocab);
    // Each side passes every barrier even after an error, so that the other never waits for
    // ever; errors are returned at the end.
    std::thread::scope(|s| -> Result<Together> {
        let decoder = s.spawn(|| -> Result<(f64, f64, f64)> {
            let engine = Engine::new(d, net);
            let run = |more: &mut dyn FnMut(usize) -> bool| -> Result<f64> {
                decode_rate(engine.as_ref().map_err(|e| anyhow!("the decode engine {d}: {e:#}"))?, vocab, more)
            };
            phase.wait(); // the prefill engine's warm-up
            let ceiling = engine.as_ref().ok().and_then(|e| e.pool()).map_or(f64::NAN, |pool| limits::read_bandwidth(pool, CEILING_BYTES, 2));
            let alone = run(&mut |n| n < decode_tokens);
            phase.wait();
            phase.wait(); // the prefill engine alone; then it prefills again, and this decodes
            // at least one step, then as long as that prefill runs.
            let beside = run(&mut |n| n == 0 || prefilling.load(Ordering::Acquire));
            Ok((alone?, beside?, ceiling))
        });
        let prefiller = s.spawn(|| -> Result<(f64, f64)> {
            let engine = Engine::new(p, net);
            let run = || -> Result<f64> {
                let engine = engine.as_ref().map_err(|e| anyhow!("the prefill engine {p}: {e:#}"))?;
                let mut st = engine.new_state()?;
                let t = Instant::now();
                engine.prefill(&prompt, &mut st)?;
                Ok(prompt_tokens as f64 / t.elapsed().as_secs_f64())
            };
            // Warm-up: the pages of the weights and of the pool's buffers.
            let warm = engine.as_ref().map_err(|e| anyhow!("the prefill engine {p}: {e:#}")).and_then(|e| {
                let mut st = e.new_state()?;
                e.prefill(&prompt_of(8, vocab), &mut st).map(|_| ())
            });
            phase.wait();
            phase.wait(); // the decode engine alone
            let alone = run();
            prefilling.store(true, Ordering::Release);
            phase.wait();
            let beside = run();
            prefilling.store(false, Ordering::Release);
            warm?;
            Ok((alone?, beside?))
        });
        let panicked = |_| anyhow!("a placement engine's thread panicked");
        let (decode_alone, decode_beside, ceiling) = decoder.join().map_err(panicked)??;
        let (prefill_alone, prefill_beside) = prefiller.join().map_err(panicked)??;
        (0..3).for_each(|_| bar.tick());
        Ok(Together { decode_alone, decode_beside, prefill_alone, prefill_beside, ceiling })
    })
}

/// One sequence's decode on the first 1, 2, 4, ... and all of the allowed cores (the decode
/// engine's placement otherwise), against the read bandwidth of all of them.
#[allow(clippy::too_many_arguments)]
fn decode_by_cores(rec: &mut Record, net: &Qwen35, d: &EngineSpec, allowed: &[usize], vocab: usize, decode_tokens: usize, decode_bytes: f64, reps: usize, spec: &str) -> Result<()> {
    let mut counts: Vec<usize> = std::iter::successors(Some(1usize), |n| Some(n * 2)).take_while(|&n| n < allowed.len()).collect();
    counts.push(allowed.len());
    let everywhere = EngineSpec { cores: Some(allowed.to_vec()), threads: None, ..d.clone() };
    let machine = on_own_thread(&everywhere, |pool| limits::read_bandwidth(pool, CEILING_BYTES * 4, 5))?;
    let mut bar = Bar::new("decode by cores", reps * counts.len());
    let mut rates: Vec<Vec<f64>> = counts.iter().map(|_| Vec::new()).collect();
    for _ in 0..reps {
        for (i, &n) in counts.iter().enumerate() {
            let placement = EngineSpec { cores: Some(allowed[..n].to_vec()), threads: None, ..d.clone() };
            let rate = on_engine(&placement, net, |engine| decode_rate(&engine, vocab, &mut |k| k < decode_tokens))?;
            rec.run("placement", serde_json::json!({"decode_cores": n, "decode_tok_s": rate, "decode_bytes_per_token": decode_bytes, "machine_read_bytes_per_s": machine}));
            rates[i].push(rate);
            bar.tick();
        }
    }
    writeln!(
        rec.report,
        "\n## Decode by cores ({spec}, one sequence, {decode_tokens} tokens after a 13-token prompt, {:.0} MB a token; the machine's read bandwidth on all {} allowed cores: {:.1} GB/s)\n",
        decode_bytes / 1e6,
        allowed.len(),
        machine / 1e9
    )?;
    writeln!(rec.report, "| cores | tok/s (median) | min - max | GB/s | of the machine's bandwidth |")?;
    writeln!(rec.report, "|---|---|---|---|---|")?;
    let mut fewest = None;
    for (&n, r) in counts.iter().zip(&mut rates) {
        let (med, lo, hi) = stats(r);
        let share = med * decode_bytes / machine;
        if share >= REACHES && fewest.is_none() {
            fewest = Some(n);
        }
        writeln!(rec.report, "| {n} | {med:.2} | {lo:.2} - {hi:.2} | {:.1} | {:.0}% |", med * decode_bytes / 1e9, 100.0 * share)?;
    }
    match fewest {
        Some(n) => writeln!(rec.report, "\nThe fewest cores whose decode reads at {:.0}% of the machine's bandwidth or more: {n}.", 100.0 * REACHES)?,
        None => writeln!(rec.report, "\nNo number of cores measured decodes at {:.0}% of the machine's bandwidth.", 100.0 * REACHES)?,
    }
    Ok(())
}
