//! The study's tables that compare engines, modes and dispatch shapes: the three modes on its
//! prompt sets (its tables 1-2), batched against sequential dispatch, and the prefill crossover
//! between the two engines.

use std::fmt::Write as _;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::Scope;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use tandem_core::engine::{Device, Dispatch, Engine, EngineSpec, PrefillStats};
use tandem_core::model::load::LoadedModel;
use tandem_core::model::Qwen35;
use tandem_core::pipeline::{self, Mode, PipelineConfig, RequestParams};
use crate::rss::{peak_rss_bytes, reset_peak_rss};

use super::pipeline::prompt_of;
use super::svg::{Chart, Series};
use super::{stats, Bar, Record};
use crate::ms;

const MODES: [Mode; 3] = [Mode::AllOnPrefillEngine, Mode::AllOnDecodeEngine, Mode::Hybrid];

/// Untimed repetitions before the measured ones: one where a GPU engine takes part, because a
/// GPU loads each kernel (cuBLAS's included) the first time a shape needs it, which made the
/// first run of each prompt length 2-9x slower on an H100. A CPU engine's warm-up is the
/// short untimed pass each section starts with.
fn warm_up_repetitions(placements: &[&EngineSpec]) -> usize {
    usize::from(placements.iter().any(|p| p.device != Device::Cpu))
}

struct ModeRun {
    prefill_tok_s: f64,
    decode_tok_s: f64,
    ttft: Duration,
    total: Duration,
    peak_rss: Option<u64>,
}

/// Tables 1-2: each prompt as a whole request (prefill, then `decode_tokens` tokens) through a
/// pipeline of each mode: the prefill engine alone, the decode engine alone, and hybrid.
pub fn modes(rec: &mut Record, model: &LoadedModel, config: &PipelineConfig, prompts: &[usize], decode_tokens: usize, reps: usize, spec: &str) -> Result<()> {
    let vocab = model.sampleable_vocab();
    let generation = RequestParams { max_tokens: decode_tokens, sampling: Default::default(), vocab, stop_ids: vec![] };
    let mut runs: Vec<Vec<Vec<ModeRun>>> = MODES.iter().map(|_| prompts.iter().map(|_| Vec::new()).collect()).collect();
    let peak_measurable = reset_peak_rss();
    let warm = warm_up_repetitions(&[&config.prefill, &config.decode]);
    let mut bar = Bar::new("modes", (warm + reps) * MODES.len() * prompts.len());
    for rep in 0..warm + reps {
        // Interleaved: the three modes in turn, each a pipeline of its own.
        for (m, &mode) in MODES.iter().enumerate() {
            let cfg = PipelineConfig { mode, ..config.clone() };
            pipeline::run(&model.net, &cfg, |p| {
                // Warm-up: the engines' first pass (pages, pools, a GPU's graphs).
                p.generate(None, prompt_of(8, vocab), &RequestParams { max_tokens: 2, ..generation.clone() }, |_| Ok(()))?;
                for (i, &n) in prompts.iter().enumerate() {
                    reset_peak_rss();
                    let t = Instant::now();
                    let g = p.generate(None, prompt_of(n, vocab), &generation, |_| Ok(()))?;
                    let total = t.elapsed();
                    bar.tick();
                    if rep < warm {
                        continue;
                    }
                    let prefill = &g.timings.prefill;
                    let run = ModeRun {
                        prefill_tok_s: prefill.tokens as f64 / prefill.time.as_secs_f64(),
                        decode_tok_s: g.timings.decode_tok_s(),
                        ttft: g.timings.ttft,
                        total,
                        peak_rss: peak_rss_bytes().filter(|_| peak_measurable),
                    };
                    rec.run(
                        "modes",
                        serde_json::json!({"mode": mode.name(), "repetition": rep - warm, "prompt_tokens": n, "generated": g.timings.generated,
                            "prefill_ms": ms(prefill.time), "prefill_tok_s": run.prefill_tok_s, "decode_tok_s": run.decode_tok_s,
                            "ttft_ms": ms(run.ttft), "total_ms": ms(total), "transfer_ms": ms(g.timings.handoff), "peak_rss_bytes": run.peak_rss}),
                    );
                    runs[m][i].push(run);
                }
                Ok(())
            })?;
        }
    }

    let engines = |mode: Mode| match mode {
        Mode::AllOnPrefillEngine => format!("{}", config.prefill),
        Mode::AllOnDecodeEngine => format!("{}", config.decode),
        Mode::Hybrid => format!("{} -> {}", config.prefill, config.decode),
    };
    writeln!(rec.report, "\n## Modes ({spec}; each prompt a whole request of {decode_tokens} generated tokens; median of {reps}, min - max in brackets)\n")?;
    writeln!(rec.report, "| prompt tokens | mode | engines | prefill tok/s | decode tok/s | TTFT ms | total ms | peak RSS |")?;
    writeln!(rec.report, "|---|---|---|---|---|---|---|---|")?;
    for (i, &n) in prompts.iter().enumerate() {
        for (m, &mode) in MODES.iter().enumerate() {
            let r = &runs[m][i];
            let col = |f: &dyn Fn(&ModeRun) -> f64| stats(&mut r.iter().map(f).collect::<Vec<_>>());
            let (prefill, _, _) = col(&|x| x.prefill_tok_s);
            let (decode, _, _) = col(&|x| x.decode_tok_s);
            let (ttft, lo, hi) = col(&|x| ms(x.ttft));
            let (total, _, _) = col(&|x| ms(x.total));
            let peak = r.iter().filter_map(|x| x.peak_rss).max().map(|b| format!("{:.2} GB", b as f64 / 1e9)).unwrap_or_else(|| "not measurable here".into());
            writeln!(rec.report, "| {n} | {} | {} | {prefill:.1} | {decode:.2} | {ttft:.0} ({lo:.0} - {hi:.0}) | {total:.0} | {peak} |", mode.name(), engines(mode))?;
        }
    }
    writeln!(
        rec.report,
        "\nPrefill tok/s: the prompt over the prefill engine's time; decode tok/s: tokens after the first over the time from the first to the last; TTFT: submit to the first token sampled (in hybrid, the state's move to the decode engine included). Peak RSS: the whole process's peak resident memory during the request (weights included{}), reset before each request.",
        if config.prefill.device != Device::Cpu || config.decode.device != Device::Cpu { "; GPU memory is not in it" } else { "" }
    )?;
    rec.plot(
        "modes.svg",
        Chart {
            title: &format!("Time to first token by mode ({spec}, median)"),
            x_label: "prompt tokens",
            y_label: "TTFT ms",
            log_x: false,
            log_y: false,
            series: MODES
                .iter()
                .enumerate()
                .map(|(m, mode)| {
                    let mut points: Vec<(f64, f64)> = prompts.iter().enumerate().map(|(i, &n)| (n as f64, stats(&mut runs[m][i].iter().map(|x| ms(x.ttft)).collect::<Vec<_>>()).0)).collect();
                    points.sort_by(|a, b| a.0.total_cmp(&b.0));
                    Series { name: mode.name().to_string(), points }
                })
                .collect(),
        },
    );
    Ok(())
}

/// An engine on its own thread (a pinned engine pins the thread that makes it) that prefills
/// the prompts sent to it one at a time, each with the dispatch given, into a fresh state.
struct PrefillWorker {
    jobs: Sender<(Dispatch, Vec<u32>)>,
    results: Receiver<Result<(Duration, PrefillStats)>>,
}

impl PrefillWorker {
    /// Start the engine; an error says why it could not start.
    fn start<'s, 'm: 's>(scope: &'s Scope<'s, 'm>, placement: &'m EngineSpec, net: &'m Qwen35) -> Result<PrefillWorker> {
        let (jobs, job_rx) = channel::<(Dispatch, Vec<u32>)>();
        let (result_tx, results) = channel();
        scope.spawn(move || {
            let mut engine = match Engine::new(placement, net) {
                Ok(e) => e,
                Err(e) => return drop(result_tx.send(Err(e))),
            };
            let _ = result_tx.send(Ok((Duration::ZERO, PrefillStats::default())));
            for (dispatch, prompt) in job_rx {
                engine.spec.dispatch = dispatch;
                let run = || -> Result<(Duration, PrefillStats)> {
                    let mut state = engine.new_state()?;
                    let t = Instant::now();
                    let stats = engine.prefill(&prompt, &mut state)?;
                    Ok((t.elapsed(), stats))
                };
                if result_tx.send(run()).is_err() {
                    return;
                }
            }
        });
        let worker = PrefillWorker { jobs, results };
        worker.answer()?;
        Ok(worker)
    }

    fn prefill(&self, dispatch: &Dispatch, prompt: Vec<u32>) -> Result<(Duration, PrefillStats)> {
        self.send(dispatch, prompt)?;
        self.answer()
    }

    /// Start a prefill; `answer` waits for it.
    fn send(&self, dispatch: &Dispatch, prompt: Vec<u32>) -> Result<()> {
        self.jobs.send((dispatch.clone(), prompt)).map_err(|_| anyhow!("the engine's thread has stopped"))
    }

    fn answer(&self) -> Result<(Duration, PrefillStats)> {
        self.results.recv().map_err(|_| anyhow!("the engine's thread has stopped"))?
    }
}

/// Table 2: a `prompt_tokens`-token prompt on the prefill engine in one-token dispatches, fixed
/// 32-token dispatches (the study's Neural Engine shape) and one dispatch of the whole prompt.
pub fn dispatch(rec: &mut Record, model: &LoadedModel, placement: &EngineSpec, prompt_tokens: usize, reps: usize, spec: &str) -> Result<()> {
    let vocab = model.sampleable_vocab();
    let dispatches = [Dispatch::Sequential, Dispatch::Batched(32), Dispatch::Dynamic];
    let mut runs: Vec<Vec<(Duration, PrefillStats)>> = vec![Vec::new(); dispatches.len()];
    let warm = warm_up_repetitions(&[placement]);
    let mut bar = Bar::new("dispatch", (warm + reps) * dispatches.len());
    std::thread::scope(|s| -> Result<()> {
        let worker = PrefillWorker::start(s, placement, &model.net)?;
        for d in &dispatches {
            worker.prefill(d, prompt_of(8, vocab))?;
        }
        for rep in 0..warm + reps {
            // Interleaved: sequential, batched, dynamic, sequential, ...
            for (i, d) in dispatches.iter().enumerate() {
                let (time, st) = worker.prefill(d, prompt_of(prompt_tokens, vocab))?;
                bar.tick();
                if rep < warm {
                    continue;
                }
                rec.run(
                    "dispatch",
                    serde_json::json!({"engine": placement.to_string(), "dispatch": d.to_string(), "repetition": rep - warm, "prompt_tokens": prompt_tokens,
                        "ms": ms(time), "dispatches": st.dispatches, "padded_rows": st.padded_rows}),
                );
                runs[i].push((time, st));
            }
        }
        Ok(())
    })?;
    let rate = |r: &[(Duration, PrefillStats)]| stats(&mut r.iter().map(|(t, _)| prompt_tokens as f64 / t.as_secs_f64()).collect::<Vec<_>>());
    let sequential = rate(&runs[0]).0;
    writeln!(rec.report, "\n## Batched against sequential dispatch ({spec}; a {prompt_tokens}-token prompt on the prefill engine {placement}; median of {reps})\n")?;
    writeln!(rec.report, "| dispatch | dispatches | rows computed (padding) | tok/s | min - max | vs sequential |")?;
    writeln!(rec.report, "|---|---|---|---|---|---|")?;
    for (d, r) in dispatches.iter().zip(&runs) {
        let (med, lo, hi) = rate(r);
        let st = r[0].1;
        writeln!(rec.report, "| {d} | {} | {} ({}) | {med:.1} | {lo:.1} - {hi:.1} | {:.1}x |", st.dispatches, prompt_tokens + st.padded_rows, st.padded_rows, med / sequential)?;
    }
    writeln!(rec.report, "\nThe study's numbers (Qwen3.5-0.8B on the Neural Engine of its M2 Ultra, the same 74-token prompt): sequential 23.7 tok/s, 32-token batched dispatches 268 tok/s, 11.3x.")?;
    Ok(())
}

/// Whether two engines share no compute: different devices, or CPU engines pinned to disjoint
/// cores (unpinned CPU engines may land on the same cores).
fn apart(a: &EngineSpec, b: &EngineSpec) -> bool {
    match (a.device, b.device) {
        (Device::Cpu, Device::Cpu) => matches!((&a.cores, &b.cores), (Some(x), Some(y)) if x.iter().all(|c| !y.contains(c))),
        (x, y) => x != y,
    }
}

/// Table 6: prefill tok/s of each engine (with its own dispatch) against prompt length, and
/// where one overtakes the other. Engines that share no compute run each length at the same
/// time, as they do in the pipeline (and in half the time); others take turns.
pub fn crossover(rec: &mut Record, model: &LoadedModel, config: &PipelineConfig, lengths: &[usize], reps: usize, spec: &str) -> Result<()> {
    let vocab = model.sampleable_vocab();
    let engines = [("prefill engine", &config.prefill), ("decode engine", &config.decode)];
    let together = apart(&config.prefill, &config.decode);
    let mut rates: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); lengths.len()]; engines.len()];
    let warm = warm_up_repetitions(&[&config.prefill, &config.decode]);
    let mut bar = Bar::new("crossover", (warm + reps) * lengths.len() * engines.len());
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<PrefillWorker> = engines.iter().map(|(_, p)| PrefillWorker::start(s, p, &model.net)).collect::<Result<_>>()?;
        for (w, (_, p)) in workers.iter().zip(&engines) {
            w.prefill(&p.dispatch, prompt_of(8, vocab))?;
        }
        for rep in 0..warm + reps {
            for (l, &n) in lengths.iter().enumerate() {
                // Both at once, or one engine then the other.
                let mut times = Vec::new();
                if together {
                    for (w, (_, p)) in workers.iter().zip(&engines) {
                        w.send(&p.dispatch, prompt_of(n, vocab))?;
                    }
                    for w in &workers {
                        times.push(w.answer()?.0);
                    }
                } else {
                    for (w, (_, p)) in workers.iter().zip(&engines) {
                        times.push(w.prefill(&p.dispatch, prompt_of(n, vocab))?.0);
                    }
                }
                for (e, (time, (name, p))) in times.into_iter().zip(&engines).enumerate() {
                    bar.tick();
                    if rep < warm {
                        continue;
                    }
                    rec.run("crossover", serde_json::json!({"engine": name, "placement": p.to_string(), "repetition": rep - warm, "prompt_tokens": n, "ms": ms(time), "at_the_same_time": together}));
                    rates[e][l].push(n as f64 / time.as_secs_f64());
                }
            }
        }
        Ok(())
    })?;
    writeln!(
        rec.report,
        "\n## Crossover ({spec}; prefill tok/s against prompt length, each engine with its own dispatch, {}; median of {reps}, min - max in brackets)\n",
        if together { "both engines at the same time (they share no compute)" } else { "the engines taking turns (they share compute)" }
    )?;
    writeln!(rec.report, "| prompt tokens | prefill engine ({}) | decode engine ({}) | faster |", config.prefill, config.decode)?;
    writeln!(rec.report, "|---|---|---|---|")?;
    let mut winners = Vec::new();
    for (l, &n) in lengths.iter().enumerate() {
        let a = stats(&mut rates[0][l].clone());
        let b = stats(&mut rates[1][l].clone());
        let winner = if reps >= 2 { faster(a, b) } else { None };
        writeln!(rec.report, "| {n} | {:.1} ({:.1} - {:.1}) | {:.1} ({:.1} - {:.1}) | {} |", a.0, a.1, a.2, b.0, b.1, b.2, winner.map_or("neither (within 5% or the spread)", |w| engines[w].0))?;
        winners.push(winner);
    }
    if reps >= 2 {
        writeln!(rec.report, "\n{}", crossing(lengths, &winners, &engines.map(|e| e.0)))?;
    } else {
        writeln!(rec.report, "\nOne run per engine and length: too few to call either engine faster (--reps 2 or more decides).")?;
    }
    writeln!(rec.report, "\nThe study's number (its M2 Ultra, 0.8B): the Neural Engine's prefill reached the GPU's at about 410 tokens.")?;
    rec.plot(
        "crossover.svg",
        Chart {
            title: &format!("Prefill rate against prompt length ({spec}, median)"),
            x_label: "prompt tokens (log scale)",
            y_label: "prefill tok/s",
            log_x: true,
            log_y: false,
            series: engines
                .iter()
                .enumerate()
                .map(|(e, (name, p))| Series { name: format!("{name} ({p})"), points: lengths.iter().enumerate().map(|(l, &n)| (n as f64, stats(&mut rates[e][l].clone()).0)).collect() })
                .collect(),
        },
    );
    Ok(())
}

/// Which engine is faster: 0 or 1 where its slowest run beats the other's fastest and its
/// median by 5% or more, None otherwise (the difference is not measurable on this run, or too
/// small to matter: two engines on the same GPU differ by 0.5-4% from one length to the next).
/// Needs two runs or more of each: one run has no spread.
fn faster(a: (f64, f64, f64), b: (f64, f64, f64)) -> Option<usize> {
    const MARGIN: f64 = 1.05;
    if a.1 > b.2 && a.0 >= MARGIN * b.0 {
        Some(0)
    } else if b.1 > a.2 && b.0 >= MARGIN * a.0 {
        Some(1)
    } else {
        None
    }
}

/// The sentence that says where one engine overtakes the other.
fn crossing(lengths: &[usize], winners: &[Option<usize>], names: &[&str; 2]) -> String {
    let decided: Vec<(usize, usize)> = lengths.iter().zip(winners).filter_map(|(&n, w)| w.map(|w| (n, w))).collect();
    let changes: Vec<String> = decided.windows(2).filter(|p| p[0].1 != p[1].1).map(|p| format!("the {} overtakes the {} between {} and {} tokens", names[p[1].1], names[p[0].1], p[0].0, p[1].0)).collect();
    match (decided.first(), changes.is_empty()) {
        (None, _) => "No crossover: at no length is either engine faster by more than the spread of its runs and 5%.".into(),
        (Some(&(_, w)), true) if decided.len() == lengths.len() => format!("No crossover: the {} is faster at every length.", names[w]),
        (Some(&(_, w)), true) => format!("No crossover: the {} is faster wherever either is ({} of {} lengths; at the others neither is faster by more than the spread and 5%).", names[w], decided.len(), lengths.len()),
        (_, false) => format!("Crossover: {}.", changes.join("; ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_run_together_only_where_they_share_no_compute() {
        let p = |s: &str| EngineSpec::parse(s).unwrap();
        assert!(apart(&p("cpu:cores=0"), &p("cpu:cores=1,dispatch=batched:32")));
        assert!(!apart(&p("cpu:cores=0-1"), &p("cpu:cores=1")));
        assert!(!apart(&p("cpu:threads=1"), &p("cpu:threads=1")));
        assert!(apart(&p("cpu:threads=4"), &p("cuda:0")));
        assert!(apart(&p("cuda:0"), &p("cuda:1")));
        assert!(!apart(&p("cuda:0"), &p("cuda:0,precision=exact")));
    }

    #[test]
    fn a_crossover_is_where_the_measurably_faster_engine_changes() {
        let names = ["prefill engine", "decode engine"];
        let lengths = [8, 32, 128, 512];
        assert_eq!(crossing(&lengths, &[Some(1), None, Some(0), Some(0)], &names), "Crossover: the prefill engine overtakes the decode engine between 8 and 128 tokens.");
        assert!(crossing(&lengths, &[None, Some(0), None, Some(0)], &names).starts_with("No crossover: the prefill engine is faster"));
        assert!(crossing(&lengths, &[None; 4], &names).starts_with("No crossover: at no length"));
        assert!(crossing(&lengths, &[Some(1); 4], &names).ends_with("the decode engine is faster at every length."));
        // Spreads that overlap decide nothing, nor do differences under 5%.
        assert_eq!(faster((10.0, 9.0, 11.0), (10.5, 10.5, 12.0)), None);
        assert_eq!(faster((100.0, 99.9, 100.1), (103.0, 102.9, 103.1)), None);
        assert_eq!(faster((20.0, 19.0, 21.0), (10.5, 10.0, 12.0)), Some(0));
        assert_eq!(faster((10.5, 10.0, 12.0), (20.0, 19.0, 21.0)), Some(1));
    }
}
