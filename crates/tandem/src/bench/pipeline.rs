//! The two-engine sections of `tandem bench`: state transfer (serialize / read / rebuild for
//! each transfer kind), multi-turn conversations (per-turn TTFT with and without sessions) and
//! concurrency (batched decode steps, and requests through the pipeline).

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tandem_core::chat::Message;
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::engine::{Engine, EngineSpec};
use tandem_core::state::DeviceState;
use tandem_core::model::load::LoadedModel;
use tandem_core::model::Qwen35;
use tandem_core::pipeline::{self, Event, PipelineConfig, Request, RequestParams};
use tandem_core::session::{Scaffold, Session};
use tandem_core::bridge;
use tandem_core::state::{LayerState, State};

use super::svg::{Chart, Series};
use super::{progress, stats, Record};
use crate::ms;

/// `(median, min, max)` of durations, in ms.
fn ms_stats(v: &[Duration]) -> (f64, f64, f64) {
    stats(&mut v.iter().map(|d| ms(*d)).collect::<Vec<_>>())
}

/// A prompt of exactly `n` tokens (ids spread over the vocabulary).
pub fn prompt_of(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 17) % vocab) as u32).collect()
}

/// Run `work` on an engine of `placement` made on a thread of its own: an engine pinned to
/// cores pins the thread that makes it, which must not be the bench's.
pub fn on_engine<T: Send>(placement: &EngineSpec, net: &Qwen35, work: impl FnOnce(Engine) -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|s| s.spawn(|| work(Engine::new(placement, net)?)).join().expect("engine thread"))
}

/// `measure` on a pool of a CPU engine's workers, made on a thread of its own (a pinned pool
/// pins the thread that makes it).
pub fn on_own_thread(spec: &EngineSpec, measure: impl FnOnce(&Pool) -> f64 + Send) -> Result<f64> {
    std::thread::scope(|s| s.spawn(|| -> Result<f64> { Ok(measure(&spec.pool()?)) }).join().map_err(|_| anyhow::anyhow!("a measurement on {spec} panicked"))?)
}

/// Table 3: each transfer kind in its three parts, at the given prompt lengths.
pub fn transfer(rec: &mut Record, model: &LoadedModel, engine: &EngineSpec, lengths: &[usize], reps: usize, spec: &str) -> Result<()> {
    progress("state transfer");
    let net = &model.net;
    let fp = net.fingerprint();
    let cfg = &net.config;
    writeln!(rec.report, "\n## State transfer ({spec}; median of {reps}, min - max in brackets; ms)\n")?;
    writeln!(rec.report, "| transfer | prompt tokens | state | serialize | read | rebuild | total |")?;
    writeln!(rec.report, "|---|---|---|---|---|---|---|")?;
    let mut socket = SocketPeer::start(spec, fp)?;
    // A process that reserves slots for states written through NIXL, where this tandem has it.
    let mut nixl = super::nixl_peer::NixlPeer::start(spec, fp);
    let mut floors = Vec::new();
    for &n in lengths {
        let mut state = on_engine(engine, net, |engine| {
            let mut state = engine.new_state()?;
            engine.prefill(&prompt_of(n, model.sampleable_vocab()), &mut state)?;
            state.into_host()
        })?;
        let mb = state.bytes() as f64 / 1e6;
        type Parts = (Duration, Duration, Duration);
        let dir = bridge::file::default_dir();
        let in_place_row = format!("file ({}, the pipeline's: prefilled in the file, read in place)", dir.display());
        let file_row = format!("file ({}, kept mapped, state copied in, read in place)", dir.display());
        let fresh_row = format!("file ({}, new file, copied out)", dir.display());
        let mut rows: Vec<(&str, Vec<Parts>)> = vec![
            ("move (in-process)", vec![]),
            (&in_place_row, vec![]),
            (&file_row, vec![]),
            (&fresh_row, vec![]),
            ("socket (threads)", vec![]),
            ("socket (processes)", vec![]),
        ];
        if nixl.is_ok() {
            rows.push(("NIXL, UCX over TCP (processes, one-sided write into a reserved slot)", vec![]));
        }
        // The receiver rebuilds into the buffers of a state it no longer needs (as the
        // pipeline's decode engine does with finished requests), except in the fresh row.
        let mut recycled = Some(state.clone());
        // The pipeline's state file: created once, rewritten in place for every handoff.
        let kept_path = dir.join(format!("tandem-bench-{}.state", std::process::id()));
        let mut kept = std::sync::Arc::new(bridge::file::StateFile::create(&kept_path)?);
        for _ in 0..reps {
            // Move: the state itself crosses a channel to another thread.
            let (tx, rx) = channel::<(State, Instant)>();
            let (back_tx, back_rx) = channel::<(State, Duration)>();
            let receiver = std::thread::spawn(move || {
                if let Ok((s, t)) = rx.recv() {
                    let _ = back_tx.send((s, t.elapsed()));
                }
            });
            tx.send((state, Instant::now())).expect("receiver waits");
            let (s, moved) = back_rx.recv().expect("receiver answers");
            receiver.join().expect("receiver thread");
            state = s;
            rows[0].1.push((Duration::ZERO, moved, Duration::ZERO));

            // The pipeline's file transfer of a fresh request: its state was prefilled in the
            // file (recurrent states and conv windows in place; here the prefilled values are
            // put there untimed), so the handoff checksums them and copies in K/V and the
            // logits; the decode side checks everything and copies K/V and the logits out into
            // a recycled state's buffers.
            let mut prefilled_in_file = bridge::file::state_in_file(&mut kept, cfg, n, fp)?;
            copy_state(&mut prefilled_in_file, &state);
            let t = Instant::now();
            // SAFETY: `kept` is used by `prefilled_in_file` only, dropped before the read.
            unsafe { kept.write_shared(&prefilled_in_file, fp) }?;
            let serialize = t.elapsed();
            drop(prefilled_in_file);
            let (in_file, read, rebuild) = bridge::file::read_file(&kept, fp, cfg, recycled.take(), true)?;
            if in_file != state {
                bail!("the file bridge changed the state");
            }
            drop(in_file);
            rows[1].1.push((serialize, read, rebuild));
            // A state prefilled in memory (a request continuing a checkpoint): copied into a
            // file kept mapped, read in place.
            let t = Instant::now();
            std::sync::Arc::get_mut(&mut kept).expect("no state holds the file").write(&state, fp)?;
            let serialize = t.elapsed();
            let (in_file, read, rebuild) = bridge::file::read_file(&kept, fp, cfg, None, true)?;
            if in_file != state {
                bail!("the file bridge changed the state");
            }
            drop(in_file);
            rows[2].1.push((serialize, read, rebuild));
            // First handoff of a file from outside: a new file, mapped and copied out into new
            // memory (what `tandem` does with a state file it did not write).
            let new_path = dir.join(format!("tandem-bench-{}-new.state", std::process::id()));
            let t = Instant::now();
            bridge::file::save(&new_path, &state, fp)?;
            let serialize = t.elapsed();
            let (fresh, read, rebuild) = bridge::file::load(&new_path, fp, cfg, None)?;
            std::fs::remove_file(&new_path)?;
            drop(fresh);
            rows[3].1.push((serialize, read, rebuild));

            let (mut a, mut b) = UnixStream::pair()?;
            let cfg2 = cfg.clone();
            let reuse = Some(state.clone());
            let receiver = std::thread::spawn(move || bridge::socket::receive(&mut b, fp, &cfg2, reuse));
            let t = Instant::now();
            bridge::socket::send(&mut a, &state, fp)?;
            let serialize = t.elapsed();
            let (back, read, rebuild) = receiver.join().expect("receiver thread")?;
            if back != state {
                bail!("the socket bridge changed the state");
            }
            recycled = Some(back);
            rows[4].1.push((serialize, read, rebuild));

            rows[5].1.push(socket.send(&state, fp)?);

            if let Ok(peer) = &mut nixl {
                rows[6].1.push(peer.send(&state, fp)?.parts());
            }
        }
        drop(kept);
        let _ = std::fs::remove_file(&kept_path);
        // What a copy of the state costs on one core: a plain memcpy of the same bytes, now.
        let src = vec![1u8; state.bytes()];
        let mut dst = vec![0u8; state.bytes()];
        let mut copies = Vec::new();
        for _ in 0..reps.max(3) {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            copies.push(t.elapsed());
        }
        std::hint::black_box(&dst);
        floors.push((n, ms_stats(&copies).0));
        for (name, runs) in &rows {
            for p in runs {
                rec.run("transfer", serde_json::json!({"transfer": name, "prompt_tokens": n, "state_bytes": state.bytes(), "serialize_ms": ms(p.0), "read_ms": ms(p.1), "rebuild_ms": ms(p.2)}));
            }
            let part = |f: &dyn Fn(&Parts) -> Duration| {
                let (m, lo, hi) = ms_stats(&runs.iter().map(f).collect::<Vec<_>>());
                format!("{m:.2} ({lo:.2} - {hi:.2})")
            };
            writeln!(
                rec.report,
                "| {name} | {n} | {mb:.1} MB | {} | {} | {} | {} |",
                part(&|p| p.0),
                part(&|p| p.1),
                part(&|p| p.2),
                part(&|p| p.0 + p.1 + p.2)
            )?;
        }
    }
    socket.finish()?;
    if let Err(e) = &nixl {
        writeln!(rec.report, "\nNIXL: not measured: {e:#}")?;
    }
    drop(nixl);
    for (n, copy) in floors {
        writeln!(rec.report, "\nOne memcpy of the {n}-token state on one core, measured in this run: {copy:.2} ms (a transfer that copies the state twice, into a file and out of it, costs at least {:.1} ms here).", 2.0 * copy)?;
    }
    writeln!(rec.report, "\nMove: the time for the state to reach the other thread (no copy). Serialize: the state written out with its checksum; read: the header and layer table checked; rebuild: the checksum of every byte verified and the engine's state made from them. The pipeline's file row is the file transfer of `tandem generate --transfer file`: the prefill engine writes into a state file it keeps mapped (one copy, checksummed on the way), the decode engine checks it and uses the recurrent states and conv windows where they lie, copying only K/V and the logits into a finished request's buffers. The new-file row maps a file it did not write and copies everything out (a first handoff, new pages on both sides). The processes row streams to a separate `tandem state-receive` process. Over a socket the payload is received straight into the state, so rebuild includes the wait for the bytes. The NIXL row is the transfer of disaggregated serving: the sender writes the image into its registered memory (serialize), then NIXL writes it one-sided into the slot a separate `tandem state-receive --nixl` process reserved and notifies it (read: the write until complete, the receiver's wait for the notification and its header check; rebuild: the receiver's checksum and copy into a finished request's buffers).")?;
    Ok(())
}

/// A separate `tandem state-receive` process that reads states from its stdin, one end of a
/// Unix socket pair: the socket bridge between processes.
pub struct SocketPeer {
    to_child: UnixStream,
    child: std::process::Child,
    from_child: BufReader<std::process::ChildStdout>,
}

impl SocketPeer {
    pub fn start(spec: &str, fp: bridge::Fingerprint) -> Result<SocketPeer> {
        let (to_child, child_end) = UnixStream::pair().context("socket pair for the receiving process")?;
        let mut child = Command::new(std::env::current_exe()?)
            .args(["state-receive", "--model", spec, "--fingerprint", &format!("{fp:032x}")])
            .stdin(Stdio::from(std::os::fd::OwnedFd::from(child_end)))
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the receiving process (tandem state-receive)")?;
        let from_child = BufReader::new(child.stdout.take().expect("piped"));
        Ok(SocketPeer { to_child, child, from_child })
    }

    /// One state over the socket: the time to send it, and the receiver's times to check the
    /// header and to receive and rebuild the payloads.
    pub fn send(&mut self, state: &State, fp: bridge::Fingerprint) -> Result<(Duration, Duration, Duration)> {
        let t = Instant::now();
        bridge::socket::send(&mut self.to_child, state, fp)?;
        let serialize = t.elapsed();
        let mut line = String::new();
        self.from_child.read_line(&mut line)?;
        let f: Vec<f64> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        if f.len() != 3 || f[2] as usize != state.position {
            bail!("the receiving process answered {line:?}");
        }
        Ok((serialize, Duration::from_secs_f64(f[0] / 1e3), Duration::from_secs_f64(f[1] / 1e3)))
    }

    /// Close the socket and wait for the receiver to end.
    pub fn finish(mut self) -> Result<()> {
        self.to_child.shutdown(std::net::Shutdown::Both)?;
        self.child.wait()?;
        Ok(())
    }
}

/// `tandem state-receive`: read states from stdin (a socket) until it closes, answering each
/// with "read_ms rebuild_ms position" (the receiving side of the cross-process transfer).
pub fn state_receive(argv: &[String]) -> Result<std::process::ExitCode> {
    let args = crate::args::Args::parse(argv, &["model", "fingerprint", "gpu"], &["nixl"])?;
    let spec = args.required("model")?;
    let cfg = match spec.strip_prefix("synthetic:") {
        Some(name) => tandem_core::model::synthetic::config(name)?,
        None => {
            let path = std::path::Path::new(spec).join("config.json");
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            tandem_core::model::config::Qwen35Config::from_json_str(&text, &path.display().to_string())?
        }
    };
    let fp = u128::from_str_radix(args.required("fingerprint")?, 16).context("--fingerprint: not hex")?;
    if args.flag("nixl") {
        let gpu = args.str("gpu").map(|g| g.parse::<usize>().context("--gpu: a GPU number")).transpose()?;
        return super::nixl_peer::state_receive(&cfg, fp, gpu);
    }
    let mut stdin = std::io::stdin().lock();
    let mut stdout = std::io::stdout().lock();
    let mut spare = None;
    // Until the stream ends between two states.
    while !stdin.fill_buf()?.is_empty() {
        let (state, read, rebuild) = bridge::socket::receive(&mut stdin, fp, &cfg, spare.take())?;
        writeln!(stdout, "{:.4} {:.4} {}", ms(read), ms(rebuild), state.position)?;
        stdout.flush()?;
        spare = Some(state);
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// 74-token user messages (English, cut at a word boundary).
fn user_messages(model: &LoadedModel, turns: usize, tokens: usize) -> Result<Vec<String>> {
    const TEXT: &str = "A tandem bicycle carries two riders who pedal together, the captain in front steering and braking, \
        the stoker behind adding power and watching the road. Long ago tandems were used for courtship and racing; \
        today touring couples, blind athletes with sighted pilots and parents with children ride them. Pedalling in \
        step matters because the cranks are linked by a timing chain, so neither rider can coast alone. Tell me how \
        to start, shift gears, and stop smoothly on a loaded touring tandem, and what mistakes new teams make most. \
        Also explain how communication between the riders works on hills, at traffic lights and on rough gravel roads.";
    let tok = model.tokenizer.as_ref().context("the multi-turn section needs a tokenizer")?;
    let words: Vec<&str> = TEXT.split_whitespace().collect();
    (0..turns)
        .map(|t| {
            let mut msg = format!("Question {}:", t + 1);
            for w in words.iter().cycle().skip(t * 11) {
                let next = format!("{msg} {w}");
                if tok.encode(&next)?.len() > tokens {
                    break;
                }
                msg = next;
            }
            Ok(msg)
        })
        .collect()
}

/// One measured turn.
#[derive(Clone, Copy, Default)]
struct TurnTimes {
    ttft: Duration,
    total: Duration,
    at_send: usize,
    ahead: Duration,
}

/// Table 4: a conversation of `turns` turns (each a `msg_tokens`-token user message and a
/// `reply_tokens`-token reply) three ways: the whole conversation prefilled at each turn (no
/// session), a session whose messages are sent whole, and a session typed ahead.
#[allow(clippy::too_many_arguments)]
pub fn multiturn(rec: &mut Record, model: &LoadedModel, config: &PipelineConfig, turns: usize, msg_tokens: usize, reply_tokens: usize, words_per_update: usize, reps: usize, spec: &str) -> Result<()> {
    progress("multi-turn conversations");
    let messages = user_messages(model, turns, msg_tokens)?;
    let tok = model.tokenizer.as_ref().context("needs a tokenizer")?;
    let system = "You are a helpful cycling coach.";
    // Replies run to their length: no stop ids, so every variant decodes the same count.
    let generation = RequestParams { max_tokens: reply_tokens, sampling: Default::default(), vocab: model.sampleable_vocab(), stop_ids: vec![] };
    const VARIANTS: [&str; 3] = ["no session: whole history prefilled each turn", "session, message sent whole", "session, typed ahead"];
    let mut results: Vec<Vec<Vec<TurnTimes>>> = vec![Vec::new(); 3];
    pipeline::run(&model.net, config, |p| {
        for rep in 0..reps {
            // Interleaved: A B C, A B C, ...
            for (v, out) in results.iter_mut().enumerate() {
                progress(&format!("multi-turn: {} (repetition {}/{reps})", VARIANTS[v], rep + 1));
                out.push(if v == 0 { stateless(p, model, system, &messages, &generation)? } else { with_session(p, model, tok, system, &messages, &generation, (v == 2).then_some(words_per_update))? });
            }
        }
        Ok(())
    })?;
    writeln!(
        rec.report,
        "\n## Multi-turn ({spec}; {turns} turns, {msg_tokens}-token user messages, {reply_tokens}-token replies; prefill {} -> decode {}; {})\n",
        config.prefill,
        config.decode,
        if reps > 1 { format!("median of {reps} conversations per variant, min - max in brackets") } else { "one conversation per variant".to_string() }
    )?;
    for (v, runs) in results.iter().enumerate() {
        for (rep, run) in runs.iter().enumerate() {
            for (t, x) in run.iter().enumerate() {
                rec.run(
                    "multiturn",
                    serde_json::json!({"variant": VARIANTS[v], "repetition": rep, "turn": t + 1, "ttft_ms": ms(x.ttft), "total_ms": ms(x.total),
                        "tokens_prefilled_at_send": x.at_send, "ahead_ms": ms(x.ahead), "reply_tokens": reply_tokens}),
                );
            }
        }
    }
    rec.plot(
        "multiturn.svg",
        Chart {
            title: &format!("Time to first token per turn ({spec}, median)"),
            x_label: "turn",
            y_label: "TTFT ms (log scale)",
            log_x: false,
            log_y: true,
            series: results
                .iter()
                .enumerate()
                .map(|(v, runs)| Series { name: VARIANTS[v].split(':').next().unwrap_or(VARIANTS[v]).to_string(), points: (0..turns).map(|t| ((t + 1) as f64, ms_stats(&runs.iter().map(|r| r[t].ttft).collect::<Vec<_>>()).0)).collect() })
                .collect(),
        },
    );
    writeln!(rec.report, "| variant | turn | TTFT ms | turn total ms | tokens prefilled at send | engine work ahead of send ms |")?;
    writeln!(rec.report, "|---|---|---|---|---|---|")?;
    for (v, runs) in results.iter().enumerate() {
        for t in 0..turns {
            let col = |f: &dyn Fn(&TurnTimes) -> Duration| ms_stats(&runs.iter().map(|r| f(&r[t])).collect::<Vec<_>>());
            let (ttft, lo, hi) = col(&|x| x.ttft);
            let (total, _, _) = col(&|x| x.total);
            let (ahead, _, _) = col(&|x| x.ahead);
            let spread = if reps > 1 { format!(" ({lo:.1} - {hi:.1})") } else { String::new() };
            writeln!(rec.report, "| {} | {} | {ttft:.1}{spread} | {total:.0} | {} | {ahead:.0} |", VARIANTS[v], t + 1, runs[0][t].at_send)?;
        }
    }
    writeln!(
        rec.report,
        "\nTyped ahead: the message is fed {words_per_update} word(s) at a time as it is typed (as fast as the engine takes it: a person types slower), the next turn's template is applied as soon as a reply ends, and the closing template speculatively after each update. TTFT is from send to the first token sampled."
    )?;
    Ok(())
}

fn stateless(p: &pipeline::Pipeline, model: &LoadedModel, system: &str, messages: &[String], generation: &RequestParams) -> Result<Vec<TurnTimes>> {
    let tok = model.tokenizer.as_ref().context("needs a tokenizer")?;
    let mut history = vec![Message::new("system", system)];
    let mut out = Vec::new();
    for msg in messages {
        history.push(Message::new("user", msg));
        let ids = tok.encode(&model.chat_template.render(&history, true, false)?)?;
        let at_send = ids.len();
        let t = Instant::now();
        let g = p.generate(None, ids, generation, |_| Ok(()))?;
        out.push(TurnTimes { ttft: g.timings.ttft, total: t.elapsed(), at_send, ahead: Duration::ZERO });
        history.push(Message::new("assistant", &tok.decode(&g.tokens)?));
    }
    Ok(out)
}

/// A conversation on a session; with `typing`, each message is fed that many words at a time
/// before it is sent.
fn with_session(p: &pipeline::Pipeline, model: &LoadedModel, tok: &tandem_core::tokenizer::Tokenizer, system: &str, messages: &[String], generation: &RequestParams, typing: Option<usize>) -> Result<Vec<TurnTimes>> {
    let scaffold = Scaffold::from_template(&model.chat_template, Some(system), false)?;
    let mut session = Session::new(scaffold, |s: &str| tok.encode(s), &model.net.config);
    let mut prefill = |st: State, ids: &[u32]| p.prefill(st, ids).map(|(s, _)| s);
    let mut out = Vec::new();
    for msg in messages {
        let ahead = Instant::now();
        // Early prefill while the user reads the last reply.
        session.type_ahead("", &mut prefill)?;
        if let Some(step) = typing {
            let words: Vec<&str> = msg.split(' ').collect();
            for n in (step..words.len()).step_by(step).chain([words.len()]) {
                session.type_ahead(&words[..n].join(" "), &mut prefill)?;
            }
        }
        let ahead = ahead.elapsed();
        let t = Instant::now();
        let turn = session.send(msg)?;
        let at_send = turn.tokens.len();
        let g = p.generate(Some(turn.start), turn.tokens, generation, |_| Ok(()))?;
        let total = t.elapsed();
        session.finish(g.state.context("the turn's state came back")?, &g.tokens, g.finish)?;
        out.push(TurnTimes { ttft: g.timings.ttft, total, at_send, ahead });
    }
    Ok(out)
}

/// Table 5: aggregate decode throughput of batched steps, and N concurrent requests through
/// the pipeline.
pub fn concurrency(rec: &mut Record, model: &LoadedModel, config: &PipelineConfig, counts: &[usize], prompt_tokens: usize, max_tokens: usize, reps: usize, spec: &str) -> Result<()> {
    progress("concurrency");
    let net = &model.net;
    let vocab = model.sampleable_vocab();
    writeln!(rec.report, "\n## Concurrency ({spec}; decode engine {})\n", config.decode)?;
    // The decode engine alone: one step advances every sequence of the batch.
    let steps = max_tokens.clamp(4, 16);
    let mut step_rates: Vec<Vec<f64>> = on_engine(&config.decode, net, |engine| {
        let mut step_rates: Vec<Vec<f64>> = vec![Vec::new(); counts.len()];
        let mut bases = Vec::new();
        for i in 0..*counts.iter().max().unwrap_or(&1) {
            let mut st = engine.new_state()?;
            engine.prefill(&prompt_of(13 + i, vocab), &mut st)?;
            bases.push(st.into_host()?);
        }
        for _ in 0..reps {
            for (c, &n) in counts.iter().enumerate() {
                // Copies of the prefilled states, already on the engine's device.
                let mut states: Vec<DeviceState> = bases[..n].iter().map(|b| tandem_core::bridge::device::move_to(engine.gpu(), DeviceState::Host(b.clone()))).collect::<Result<_>>()?;
                let mut refs: Vec<&mut DeviceState> = states.iter_mut().collect();
                let tokens: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
                let t = Instant::now();
                for _ in 0..steps {
                    engine.decode(&tokens, &mut refs)?;
                }
                step_rates[c].push((n * steps) as f64 / t.elapsed().as_secs_f64());
            }
        }
        Ok(step_rates)
    })?;
    for (c, &n) in counts.iter().enumerate() {
        for r in &step_rates[c] {
            rec.run("concurrency", serde_json::json!({"kind": "decode step", "sequences": n, "steps": steps, "aggregate_tok_s": r}));
        }
    }
    writeln!(rec.report, "| sequences per step | aggregate decode tok/s | min - max | vs one sequence |")?;
    writeln!(rec.report, "|---|---|---|---|")?;
    let one = stats(&mut step_rates[0].clone()).0;
    for (c, &n) in counts.iter().enumerate() {
        let (m, lo, hi) = stats(&mut step_rates[c]);
        writeln!(rec.report, "| {n} | {m:.1} | {lo:.1} - {hi:.1} | {:.2}x |", m / one)?;
    }

    // Through the pipeline: N requests submitted at once.
    writeln!(rec.report, "\nThrough the pipeline ({} mode, prefill {} -> decode {}): N requests of {prompt_tokens} prompt tokens submitted at once, {max_tokens} tokens each; median of {reps}.\n", config.mode.name(), config.prefill, config.decode)?;
    writeln!(rec.report, "| requests | aggregate output tok/s | TTFT p50 ms | TTFT p99 ms | per-request decode tok/s (median) |")?;
    writeln!(rec.report, "|---|---|---|---|---|")?;
    let mut rows: Vec<Vec<(f64, f64, f64, f64)>> = vec![Vec::new(); counts.len()];
    let mut runs = Vec::new();
    pipeline::run(net, config, |p| {
        for _ in 0..reps {
            for (c, &n) in counts.iter().enumerate() {
                let (tx, rx) = channel();
                let start = Instant::now();
                for i in 0..n {
                    p.submit(Request::new(i as u64, prompt_of(prompt_tokens + i, vocab), max_tokens, vocab, tx.clone()))?;
                }
                drop(tx);
                let mut ttfts = Vec::new();
                let mut rates = Vec::new();
                let mut generated = 0;
                for e in rx {
                    match e {
                        Event::Done { timings, .. } => {
                            ttfts.push(ms(timings.ttft));
                            rates.push(timings.decode_tok_s());
                            generated += timings.generated;
                        }
                        Event::Failed { error, .. } => bail!("{error}"),
                        Event::Token { .. } | Event::Snapshot { .. } => {}
                    }
                }
                let wall = start.elapsed().as_secs_f64();
                ttfts.sort_by(f64::total_cmp);
                let p99 = ttfts[((ttfts.len() as f64 * 0.99).ceil() as usize).saturating_sub(1)];
                runs.push(serde_json::json!({"kind": "pipeline", "requests": n, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
                    "generated": generated, "wall_s": wall, "ttft_ms": ttfts, "decode_tok_s": rates}));
                rows[c].push((generated as f64 / wall, stats(&mut ttfts.clone()).0, p99, stats(&mut rates).0));
            }
        }
        Ok(())
    })?;
    for run in runs {
        rec.run("concurrency", run);
    }
    let col = |c: usize, f: fn(&(f64, f64, f64, f64)) -> f64| stats(&mut rows[c].iter().map(f).collect::<Vec<_>>()).0;
    for (c, &n) in counts.iter().enumerate() {
        writeln!(rec.report, "| {n} | {:.1} | {:.0} | {:.0} | {:.2} |", col(c, |r| r.0), col(c, |r| r.1), col(c, |r| r.2), col(c, |r| r.3))?;
    }
    let curve = |f: fn(&(f64, f64, f64, f64)) -> f64| counts.iter().enumerate().map(|(c, &n)| (n as f64, col(c, f))).collect();
    rec.plot(
        "concurrency.svg",
        Chart {
            title: &format!("Throughput against concurrency ({spec}, median)"),
            x_label: "concurrent requests (sequences per decode step)",
            y_label: "output tok/s",
            log_x: false,
            log_y: false,
            series: vec![
                Series { name: "decode steps alone".into(), points: counts.iter().enumerate().map(|(c, &n)| (n as f64, stats(&mut step_rates[c].clone()).0)).collect() },
                Series { name: "through the pipeline".into(), points: curve(|r| r.0) },
                Series { name: "per request (pipeline)".into(), points: curve(|r| r.3) },
            ],
        },
    );
    Ok(())
}

/// Put the values of `src` into `dst` (a state of the same shape whose arrays may live in a file).
fn copy_state(dst: &mut State, src: &State) {
    dst.position = src.position;
    for (d, s) in dst.layers.iter_mut().zip(&src.layers) {
        match (d, s) {
            (LayerState::Linear { conv, recurrent }, LayerState::Linear { conv: c, recurrent: r }) => {
                conv.copy_from_slice(c);
                recurrent.copy_from_slice(r);
            }
            (LayerState::Full { k, v }, LayerState::Full { k: k2, v: v2 }) => {
                k.clone_from(k2);
                v.clone_from(v2);
            }
            _ => unreachable!("states of one model"),
        }
    }
    dst.last_logits.clone_from(&src.last_logits);
}
