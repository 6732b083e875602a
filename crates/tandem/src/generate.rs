//! `tandem generate`: one or many prompts through the two-engine pipeline, with per-request
//! TTFT and tok/s and the aggregate throughput.

use std::io::Write;
use std::process::ExitCode;
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tandem_core::chat::Message;
use tandem_core::model::load::LoadedModel;
use tandem_core::pipeline::{self, Event, Finish, Mode, PipelineConfig, Request, Timings};
use tandem_core::sampling::{Penalties, SamplingParams};
use tandem_core::tokenizer::{StreamDecoder, Tokenizer};

use crate::args::{pipeline_config, sampling, SAMPLING_OPTIONS, Args, ENGINE_OPTIONS};
use crate::ms;

pub fn run(argv: &[String]) -> Result<ExitCode> {
    let mut with_value = vec!["model", "system", "token-ids", "prompts-file", "max-tokens"];
    with_value.extend(SAMPLING_OPTIONS);
    with_value.extend(ENGINE_OPTIONS);
    let args = Args::parse_with_lists(argv, &with_value, &["prompt"], &["chat", "ids-out", "enable-thinking"])?;
    let params = sampling(&args)?;
    let max_tokens: usize = args.get("max-tokens", 128)?;
    let config = pipeline_config(&args)?;
    let spec = args.required("model")?;

    let load_start = Instant::now();
    let model = crate::load_model(spec, &args)?;
    let load_time = load_start.elapsed();

    let prompts = prompts(&args, &model)?;
    let ctx = model.net.config.max_position_embeddings;
    for (i, p) in prompts.iter().enumerate() {
        if let Some(&bad) = p.iter().find(|&&id| id as usize >= model.net.config.vocab_size) {
            bail!("prompt {}: token id {bad} is outside the model's vocabulary (ids 0..{})", i + 1, model.net.config.vocab_size);
        }
        if p.is_empty() {
            bail!("prompt {} is empty", i + 1);
        }
        if p.len() >= ctx {
            bail!("prompt {} has {} tokens; the model's context is {ctx}", i + 1, p.len());
        }
    }
    let ids_out = args.flag("ids-out") || model.tokenizer.is_none();
    let streaming = prompts.len() == 1;
    let start = Instant::now();
    let results = pipeline::run(&model.net, &config, |pipeline| {
        let (events, rx) = channel();
        for (i, p) in prompts.iter().enumerate() {
            // The repetition penalty counts the prompt's tokens.
            let sampling = SamplingParams { penalties: Penalties { prompt: p.as_slice().into(), ..params.penalties.clone() }, ..params.clone() };
            pipeline.submit(Request { sampling, stop_ids: model.stop_ids.clone(), ..Request::new(i as u64, p.clone(), max_tokens, model.sampleable_vocab(), events.clone()) })?;
        }
        drop(events);
        let mut outputs = vec![Vec::new(); prompts.len()];
        let mut results: Vec<Option<(Finish, Timings, Duration)>> = vec![None; prompts.len()];
        let mut stdout = std::io::stdout().lock();
        let mut decoder = StreamDecoder::new();
        for event in rx {
            match event {
                Event::Token { id, token, .. } => {
                    outputs[id as usize].push(token);
                    if streaming {
                        write!(stdout, "{}", render(&model.tokenizer, ids_out, &mut decoder, &outputs[0], token)?)?;
                        stdout.flush()?;
                    }
                }
                Event::Done { id, finish, timings, .. } => {
                    let i = id as usize;
                    results[i] = Some((finish, timings, start.elapsed()));
                    if streaming {
                        if let (false, Some(tok)) = (ids_out, &model.tokenizer) {
                            write!(stdout, "{}", decoder.finish(tok)?)?;
                        }
                        writeln!(stdout)?;
                    } else {
                        let text = match (&model.tokenizer, ids_out) {
                            (Some(tok), false) => tok.decode(&outputs[i])?,
                            _ => ids_text(&outputs[i]),
                        };
                        writeln!(stdout, "### request {}\n{text}\n", i + 1)?;
                    }
                }
                Event::Failed { id, error } => bail!("request {}: {error}", id + 1),
                Event::Snapshot { .. } => {}
            }
        }
        Ok(results)
    })?;
    let wall = start.elapsed();
    report(&model, &config, load_time, &prompts, &results, wall);
    Ok(ExitCode::SUCCESS)
}

/// The prompts of `--prompt` (repeatable), `--prompts-file` (one per line) or `--token-ids`,
/// as token ids (wrapped in the chat template with `--chat`).
fn prompts(args: &Args, model: &LoadedModel) -> Result<Vec<Vec<u32>>> {
    let mut texts: Vec<String> = args.all("prompt").into_iter().map(String::from).collect();
    if let Some(path) = args.str("prompts-file") {
        let body = std::fs::read_to_string(path).with_context(|| format!("--prompts-file {path}"))?;
        texts.extend(body.lines().filter(|l| !l.trim().is_empty()).map(String::from));
        if texts.is_empty() {
            bail!("--prompts-file {path}: no prompts in it (one per line)");
        }
    }
    match (texts.is_empty(), args.str("token-ids")) {
        (false, Some(_)) => bail!("give either text prompts or --token-ids, not both"),
        (true, None) => bail!("give a prompt: --prompt TEXT (repeatable), --prompts-file FILE or --token-ids 1,2,3"),
        (true, Some(ids)) => return Ok(vec![crate::parse_ids(ids)?]),
        (false, None) => {}
    }
    let tok = model.tokenizer.as_ref().with_context(|| format!("{} has no {}: give --token-ids instead of text", model.name, model.tokenizer_source()))?;
    texts
        .iter()
        .map(|text| {
            let text = if args.flag("chat") {
                let mut messages = Vec::new();
                if let Some(sys) = args.str("system") {
                    messages.push(Message::new("system", sys));
                }
                messages.push(Message::new("user", text));
                model.chat_template.render(&messages, true, args.flag("enable-thinking"))?
            } else {
                text.clone()
            };
            tok.encode(&text)
        })
        .collect()
}

fn render(tok: &Option<Tokenizer>, ids_out: bool, decoder: &mut StreamDecoder, so_far: &[u32], id: u32) -> Result<String> {
    match (tok, ids_out) {
        (Some(tok), false) => decoder.push(tok, id),
        _ => Ok(format!("{}{id}", if so_far.len() > 1 { "," } else { "" })),
    }
}

fn ids_text(ids: &[u32]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

/// Per-request timings and the aggregate, on stderr (stdout carries the text).
fn report(model: &LoadedModel, config: &PipelineConfig, load: Duration, prompts: &[Vec<u32>], results: &[Option<(Finish, Timings, Duration)>], wall: Duration) {
    let peak = crate::rss::peak_rss_bytes().map(|b| format!(" | peak RSS {:.2} GB", b as f64 / 1e9)).unwrap_or_default();
    let engines = match config.mode {
        Mode::Hybrid => format!("prefill {} -> {} -> decode {}", config.prefill, config.transfer.name(), config.decode),
        Mode::AllOnPrefillEngine => format!("prefill and decode on {}", config.prefill),
        Mode::AllOnDecodeEngine => format!("prefill and decode on {}", config.decode),
    };
    eprintln!("[{}] {} | {engines} | load {:.2} s{peak}", model.name, config.mode.name(), load.as_secs_f64());
    let bridge = config.mode == Mode::Hybrid;
    eprintln!(
        "{:>4} {:>7} {:>6} {:>9} {:>10} {:>10} {:>9}{} {:>9} {:>10}  finish",
        "req",
        "prompt",
        "tokens",
        "queued ms",
        "prefill ms",
        "prefill/s",
        "handoff ms",
        if bridge { "  bridge s+r+rb ms" } else { "" },
        "TTFT ms",
        "decode/s"
    );
    let mut generated = 0;
    for (i, (prompt, r)) in prompts.iter().zip(results).enumerate() {
        let Some((finish, t, _)) = r else { continue };
        generated += t.generated;
        let prefill_rate = if t.prefill.time.is_zero() { 0.0 } else { t.prefill.tokens as f64 / t.prefill.time.as_secs_f64() };
        let transfer = if bridge {
            format!("{:>18}", format!("{:.2}+{:.2}+{:.2}", ms(t.transfer.serialize), ms(t.transfer.read), ms(t.transfer.rebuild)))
        } else {
            String::new()
        };
        eprintln!(
            "{:>4} {:>7} {:>6} {:>9.1} {:>10.1} {:>10.1} {:>10.3}{transfer} {:>9.1} {:>10.2}  {finish:?}",
            i + 1,
            prompt.len(),
            t.generated,
            ms(t.queued),
            ms(t.prefill.time),
            prefill_rate,
            ms(t.handoff),
            ms(t.ttft),
            t.decode_tok_s()
        );
    }
    eprintln!(
        "aggregate: {} requests, {} prompt tokens, {generated} generated in {:.2} s: {:.2} generated tok/s",
        prompts.len(),
        prompts.iter().map(Vec::len).sum::<usize>(),
        wall.as_secs_f64(),
        generated as f64 / wall.as_secs_f64()
    );
}
