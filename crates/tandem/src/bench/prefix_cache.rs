//! `tandem bench --sections prefix-cache`: the prefix cache of `tandem serve` on the workloads
//! it is for, each run with the cache on and off (a server of each, in alternating order per
//! repetition, so that every run starts from an empty cache):
//!
//! 1. **questions**: a shared system prompt and short questions after it, one at a time;
//!    beside them, the questions alone (on the server without a cache), the TTFT a cached
//!    system prompt should come close to.
//! 2. **agent**: conversations running at once, each turn adding a tool result to the whole
//!    history (the reply's token ids sent back as they came, `return_token_ids`), in sessions.
//! 3. **few-shot**: a long shared run of examples and different endings, one at a time: every
//!    match ends at the same, unaligned token.
//! 4. **no reuse**: random prompts at a concurrency, the cost of taking snapshots that no
//!    request uses.
//!
//! Prompts are token ids (`/v1/completions`), greedy, `ignore_eos`. The ideal a cache is held
//! to: for each request, the longest prefix of its prompt that a finished request applied (its
//! prompt and its reply), the tokens a cache with a snapshot after every token would skip.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;
use tandem_core::rng::Rng;

use super::load::{self, percentile, random_tokens, Outcome};
use super::serve::{gauge, metrics, Server};
use super::progress;
use crate::args::{Args, ENGINE_OPTIONS};

pub struct Options {
    pub model: String,
    pub system_len: usize,
    pub questions: usize,
    pub conversations: usize,
    pub turns: usize,
    /// Tool results' lengths, least and most.
    pub tool_len: (usize, usize),
    pub shared_len: usize,
    pub few_shot: usize,
    pub output_len: usize,
    /// The no-reuse load: requests, prompt length, concurrency.
    pub no_reuse: (usize, usize, usize),
    pub reps: usize,
    /// The workloads to run (all four by default).
    pub workloads: Vec<&'static str>,
}

const WORKLOADS: [&str; 4] = ["questions", "agent", "few-shot", "no reuse"];

impl Options {
    pub fn parse(args: &Args, quick: bool) -> Result<Options> {
        let q = |full: usize, small: usize| if quick { small } else { full };
        let o = Options {
            model: args.str("model").unwrap_or("synthetic:qwen3.5-0.8b").to_string(),
            system_len: args.get("system-len", q(2000, 200))?,
            questions: args.get("questions", q(200, 8))?,
            conversations: args.get("conversations", q(16, 3))?,
            turns: args.get("turns", q(10, 4))?,
            tool_len: (q(200, 20), q(1000, 60)),
            shared_len: args.get("shared-len", q(1500, 150))?,
            few_shot: args.get("few-shot", q(100, 8))?,
            output_len: args.get("output-len", q(32, 6))?,
            no_reuse: (args.get("no-reuse-requests", q(64, 12))?, args.get("no-reuse-len", q(512, 64))?, q(16, 4)),
            reps: args.get("reps", q(2, 1))?,
            workloads: match args.str("workloads") {
                None => WORKLOADS.to_vec(),
                Some(list) => list
                    .split(',')
                    .map(|w| {
                        let w = w.trim().replace('-', " ");
                        WORKLOADS.into_iter().find(|k| k.replace('-', " ") == w).with_context(|| format!("--workloads: {w:?} is not one of questions, agent, few-shot, no-reuse"))
                    })
                    .collect::<Result<_>>()?,
            },
        };
        if o.questions == 0 || o.conversations == 0 || o.turns < 2 || o.few_shot == 0 || o.output_len == 0 || o.reps == 0 || o.no_reuse.0 == 0 || o.no_reuse.1 == 0 {
            bail!("--questions, --conversations, --few-shot, --output-len, --no-reuse-requests, --no-reuse-len and --reps must be at least 1, --turns at least 2");
        }
        Ok(o)
    }
}

/// What finished requests applied (prompts and replies), to measure each prompt's ideal.
#[derive(Default)]
struct Applied {
    sequences: Vec<Vec<u32>>,
}

impl Applied {
    fn ideal(&self, prompt: &[u32]) -> usize {
        self.sequences.iter().map(|s| s.iter().zip(prompt).take_while(|(a, b)| a == b).count()).max().unwrap_or(0).min(prompt.len())
    }

    fn add(&mut self, prompt: &[u32], reply: &[u32]) {
        self.sequences.push([prompt, reply].concat());
    }
}

/// One request's outcome with its ideal and its turn (1 for single requests).
struct Timed {
    outcome: Outcome,
    ideal: usize,
    turn: usize,
}

/// One workload's run on one server.
struct Run {
    workload: &'static str,
    cache: bool,
    rep: usize,
    requests: Vec<Timed>,
    seconds: f64,
    /// The server's prefix cache after the run: (bytes, snapshots) on the GPU and in host
    /// memory.
    device: (f64, f64),
    host: (f64, f64),
}

impl Run {
    fn failed(&self) -> usize {
        self.requests.iter().filter(|r| r.outcome.error.is_some()).count()
    }

    fn sum(&self, f: impl Fn(&Timed) -> usize) -> usize {
        self.requests.iter().map(f).sum()
    }

    /// Tokens the cache skipped over tokens a perfect cache would have.
    fn hit_rate(&self) -> f64 {
        self.sum(|r| r.outcome.cached_tokens) as f64 / self.sum(|r| r.ideal).max(1) as f64
    }

    fn ttfts(&self, turn: Option<usize>) -> Vec<f64> {
        self.requests.iter().filter(|r| r.outcome.error.is_none() && turn.is_none_or(|t| r.turn == t)).map(|r| r.outcome.ttft * 1e3).collect()
    }

    fn output_rate(&self) -> f64 {
        self.sum(|r| r.outcome.output_tokens) as f64 / self.seconds
    }

    /// The run's row of the report's table.
    fn row(&self) -> String {
        let t = self.ttfts(None);
        format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.1}% | {} / {} | {:.1} | {:.0} / {:.0} | {:.0} / {:.0} |",
            self.workload,
            if self.cache { "on" } else { "off" },
            self.rep + 1,
            self.requests.len() - self.failed(),
            self.sum(|x| x.outcome.prompt_tokens),
            self.sum(|x| x.ideal),
            self.sum(|x| x.outcome.cached_tokens),
            100.0 * self.hit_rate(),
            ms(&t, 50.0),
            ms(&t, 99.0),
            self.output_rate(),
            self.device.1,
            self.host.1,
            self.device.0 / (1 << 20) as f64,
            self.host.0 / (1 << 20) as f64
        )
    }
}

/// A request's JSON body: `prompt` under `salt` (each workload's runs under their own, so
/// that they share nothing), in `session` where given.
fn body(model: &str, output_len: usize, prompt: &[u32], salt: &str, session: Option<&str>) -> String {
    let mut b = json!({
        "model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": true, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true}, "cache_salt": salt, "return_token_ids": true,
    });
    if let Some(s) = session {
        b["session_id"] = s.into();
    }
    b.to_string()
}

/// Random token ids, of a random length in lo..=hi.
fn random_run(rng: &mut Rng, (lo, hi): (usize, usize), vocab: usize) -> Vec<u32> {
    let n = between(rng, (lo, hi));
    random_tokens(rng, n, vocab)
}


fn between(rng: &mut Rng, (lo, hi): (usize, usize)) -> usize {
    lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize
}

/// Send `prompts` one after another; each request's ideal is taken when it is sent.
async fn one_at_a_time(o: &Options, addr: std::net::SocketAddr, prompts: &[Vec<u32>], salt: &str) -> Vec<Timed> {
    let mut applied = Applied::default();
    let mut out = Vec::new();
    for p in prompts {
        let ideal = applied.ideal(p);
        let outcome = load::send_body(addr, &body(&o.model, o.output_len, p, salt, None)).await;
        applied.add(p, &outcome.token_ids);
        out.push(Timed { outcome, ideal, turn: 1 });
    }
    out
}

/// The agent workload: conversations at once, turn after turn in each.
async fn agent(o: &Options, addr: std::net::SocketAddr, vocab: usize, seed: u64, salt: &str) -> Vec<Timed> {
    let mut rng = Rng::new(seed);
    let system = random_tokens(&mut rng, 400.min(o.system_len), vocab);
    let applied = Arc::new(Mutex::new(Applied::default()));
    let mut tasks = Vec::new();
    for c in 0..o.conversations {
        let mut rng = Rng::new(seed + 1 + c as u64);
        let mut prompt = [system.clone(), random_tokens(&mut rng, 100, vocab)].concat();
        let tools: Vec<Vec<u32>> = (1..o.turns).map(|_| random_run(&mut rng, o.tool_len, vocab)).collect();
        let (applied, session, salt) = (Arc::clone(&applied), format!("{salt}-conversation-{c}"), salt.to_string());
        let (model, output_len) = (o.model.clone(), o.output_len);
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for turn in 1..=tools.len() + 1 {
                let ideal = applied.lock().expect("applied lock").ideal(&prompt);
                let outcome = load::send_body(addr, &body(&model, output_len, &prompt, &salt, Some(&session))).await;
                applied.lock().expect("applied lock").add(&prompt, &outcome.token_ids);
                let failed = outcome.error.is_some();
                let reply = outcome.token_ids.clone();
                out.push(Timed { outcome, ideal, turn });
                if failed || turn > tools.len() {
                    break;
                }
                prompt.extend(reply);
                prompt.extend(&tools[turn - 1]);
            }
            out
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.extend(t.await.unwrap_or_default());
    }
    out
}

/// Random prompts, `concurrency` at a time (no prefix shared).
async fn no_reuse(o: &Options, addr: std::net::SocketAddr, vocab: usize, seed: u64, salt: &str) -> Vec<Timed> {
    let (n, len, concurrency) = o.no_reuse;
    let mut rng = Rng::new(seed);
    let prompts: Arc<Vec<String>> = Arc::new((0..n).map(|_| body(&o.model, o.output_len, &random_tokens(&mut rng, len, vocab), salt, None)).collect());
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (prompts, next) = (Arc::clone(&prompts), Arc::clone(&next));
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(b) = prompts.get(i) else { return out };
                out.push(Timed { outcome: load::send_body(addr, b).await, ideal: 0, turn: 1 });
            }
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.extend(t.await.unwrap_or_default());
    }
    out
}

fn server_args(o: &Options, args: &Args, cache: bool) -> Vec<String> {
    let mut v: Vec<String> = ["--model", &o.model, "--host", "127.0.0.1", "--port", "0", "--max-queue", "100000"].map(String::from).to_vec();
    // Cache on: the budgets given, else the server's defaults; off: none in either tier.
    for option in ["prefix-cache-memory", "prefix-cache-device-memory"] {
        match (cache, args.str(option)) {
            (true, Some(size)) => v.extend([format!("--{option}"), size.to_string()]),
            (true, None) => {}
            (false, _) => v.extend([format!("--{option}"), "0".to_string()]),
        }
    }
    v.extend(["--max-concurrent".to_string(), args.str("max-concurrent").map_or((o.conversations.max(o.no_reuse.2)).to_string(), str::to_string)]);
    if let Some(every) = args.str("prefix-snapshot-every") {
        v.extend(["--prefix-snapshot-every".to_string(), every.to_string()]);
    }
    for name in ENGINE_OPTIONS.iter().filter(|n| !["max-batch", "trace"].contains(*n)) {
        if let Some(value) = args.str(name) {
            v.extend([format!("--{name}"), value.to_string()]);
        }
    }
    v
}

pub fn run(report: &mut String, args: &Args, quick: bool) -> Result<()> {
    let o = Options::parse(args, quick)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("starting the load generator's runtime")?;
    let mut runs: Vec<Run> = Vec::new();
    let mut banners = Vec::new();
    for rep in 0..o.reps {
        let order = if rep % 2 == 0 { [true, false] } else { [false, true] };
        for cache in order {
            let mut sargs = server_args(&o, args, cache);
            if let Some(prefix) = args.str("trace") {
                sargs.extend(["--trace".to_string(), format!("{prefix}-cache-{}-{}.json", if cache { "on" } else { "off" }, rep + 1)]);
            }
            progress(&format!("repetition {}/{}: tandem serve {}", rep + 1, o.reps, sargs.join(" ")));
            let server = Server::start(&sargs)?;
            let addr = server.addr;
            let vocab = gauge(&metrics(&rt, addr)?, "tandem_model_vocab_size").context("the server's /metrics has no tandem_model_vocab_size")? as usize;
            banners.push((cache, sargs.join(" "), server.banner()));
            // Warm-up, not reported: the first requests of a process pay for lazily made buffers.
            let warm: Vec<Vec<u32>> = (0..4).map(|i| random_tokens(&mut Rng::new(7 + i), 64, vocab)).collect();
            rt.block_on(one_at_a_time(&o, addr, &warm, &format!("warm-up-{rep}")));
            let mut rng = Rng::new(11);
            let system = random_tokens(&mut rng, o.system_len, vocab);
            let questions: Vec<Vec<u32>> = (0..o.questions).map(|_| random_run(&mut rng, (20, 80), vocab)).collect();
            let shared = random_tokens(&mut rng, o.shared_len, vocab);
            let endings: Vec<Vec<u32>> = (0..o.few_shot).map(|_| random_run(&mut rng, (20, 200), vocab)).collect();
            let mut workloads = o.workloads.clone();
            if !cache && workloads.contains(&"questions") {
                workloads.push("questions alone");
            }
            for w in workloads {
                progress(&format!("{w}, cache {}", if cache { "on" } else { "off" }));
                let salt = format!("{w}-{rep}");
                let started = Instant::now();
                let requests = rt.block_on(async {
                    match w {
                        "questions" => one_at_a_time(&o, addr, &questions.iter().map(|q| [&system[..], q].concat()).collect::<Vec<_>>(), &salt).await,
                        "questions alone" => one_at_a_time(&o, addr, &questions[..questions.len().min(32)], &salt).await,
                        "agent" => agent(&o, addr, vocab, 500 + rep as u64, &salt).await,
                        "few-shot" => one_at_a_time(&o, addr, &endings.iter().map(|e| [&shared[..], e].concat()).collect::<Vec<_>>(), &salt).await,
                        _ => no_reuse(&o, addr, vocab, 900 + rep as u64, &salt).await,
                    }
                });
                let seconds = started.elapsed().as_secs_f64();
                let after = metrics(&rt, addr)?;
                let tier = |tier: &str| {
                    let read = |name: &str| gauge(&after, &format!("{name}{{tier=\"{tier}\"}}")).unwrap_or(0.0);
                    (read("tandem_prefix_cache_bytes"), read("tandem_prefix_cache_snapshots"))
                };
                let run = Run { workload: w, cache, rep, requests, seconds, device: tier("device"), host: tier("host") };
                if let Some(e) = run.requests.iter().find_map(|r| r.outcome.error.clone()) {
                    bail!("{w}: a request failed: {e}\nserver log:\n{}", server.log_tail());
                }
                // The row now too: a run cut short still leaves what it measured.
                progress(&run.row());
                runs.push(run);
            }
            server.stop()?;
        }
    }
    write_report(report, &o, &runs, &banners)
}

fn ms(v: &[f64], p: f64) -> String {
    format!("{:.1}", percentile(v, p))
}

/// The median of `v` with its min and max.
fn spread(v: &[f64], digits: usize) -> String {
    if v.is_empty() {
        return "-".into();
    }
    let (lo, hi) = (v.iter().copied().fold(f64::INFINITY, f64::min), v.iter().copied().fold(f64::NEG_INFINITY, f64::max));
    format!("{:.*} ({:.*}-{:.*})", digits, percentile(v, 50.0), digits, lo, digits, hi)
}

fn write_report(report: &mut String, o: &Options, runs: &[Run], banners: &[(bool, String, String)]) -> Result<()> {
    writeln!(report, "## Prefix cache ({})\n", o.model)?;
    writeln!(report, "| | |\n|---|---|")?;
    for (cache, args, banner) in banners.iter().take(2) {
        writeln!(report, "| server, cache {} | `tandem serve {args}`; {banner} |", if *cache { "on" } else { "off" })?;
    }
    writeln!(report, "| questions | a {}-token system prompt, then {} questions of 20-80 tokens, one at a time; the first 32 alone on the server without a cache |", o.system_len, o.questions)?;
    writeln!(report, "| agent | {} conversations at once, {} turns each: 400 shared and 100 own tokens, then each turn the reply's ids and a tool result of {}-{} tokens, in a session each |", o.conversations, o.turns, o.tool_len.0, o.tool_len.1)?;
    writeln!(report, "| few-shot | {} shared tokens of examples and {} endings of 20-200 tokens, one at a time |", o.shared_len, o.few_shot)?;
    writeln!(report, "| no reuse | {} random prompts of {} tokens, {} at a time |", o.no_reuse.0, o.no_reuse.1, o.no_reuse.2)?;
    writeln!(report, "| every request | {} output tokens (`ignore_eos`), greedy, streamed `/v1/completions` of token ids over loopback; repetitions {} (the servers' order alternating) |", o.output_len, o.reps)?;
    writeln!(report, "\nHit rate: prompt tokens the cache covered (`cached_tokens`) over the ideal, the prompt tokens that match what finished requests applied (a snapshot after every token). Snapshots and memory: the prefix cache on the GPU / in host memory after the workload (the server's, with what earlier workloads left; K/V blocks that snapshots share counted once).\n")?;
    writeln!(report, "| workload | cache | rep | requests | prompt tokens | ideal | cached | of ideal | TTFT p50 / p99 ms | output tok/s | snapshots GPU / host | MiB GPU / host |")?;
    writeln!(report, "|---|---|---|---|---|---|---|---|---|---|---|---|")?;
    for r in runs {
        writeln!(report, "{}", r.row())?;
    }
    // The targets, as medians over the repetitions (min-max).
    fn of<'a>(runs: &'a [Run], w: &'a str, cache: bool) -> impl Iterator<Item = &'a Run> {
        runs.iter().filter(move |r| r.workload == w && r.cache == cache)
    }
    let rates = |w: &str| of(runs, w, true).map(|r| 100.0 * r.hit_rate()).collect::<Vec<_>>();
    let reps: Vec<usize> = (0..o.reps).collect();
    let per_rep = |f: &dyn Fn(usize) -> Option<f64>| reps.iter().filter_map(|&rep| f(rep)).collect::<Vec<f64>>();
    let p50 = |w: &str, cache: bool, rep: usize, turn: Option<usize>| of(runs, w, cache).find(|r| r.rep == rep).map(|r| percentile(&r.ttfts(turn), 50.0));
    let ratio_questions = per_rep(&|rep| Some(p50("questions", true, rep, None)? / p50("questions alone", false, rep, None)?));
    let ratio_turns = per_rep(&|rep| Some(p50("agent", true, rep, Some(o.turns))? / p50("agent", true, rep, Some(2))?));
    let rate = |w: &str, cache: bool, rep: usize| of(runs, w, cache).find(|r| r.rep == rep).map(Run::output_rate);
    let overhead = per_rep(&|rep| Some(rate("no reuse", true, rep)? / rate("no reuse", false, rep)?));
    writeln!(report, "\n| target | measured: median (min-max) over repetitions |\n|---|---|")?;
    let ran = |w: &str| o.workloads.contains(&w);
    for w in ["questions", "agent", "few-shot"].into_iter().filter(|w| ran(w)) {
        writeln!(report, "| {w}: hit rate >= 95% of the ideal | {}% |", spread(&rates(w), 1))?;
    }
    if ran("questions") {
        writeln!(report, "| questions: TTFT p50 of a question after the cached system prompt / of the question alone | {}x |", spread(&ratio_questions, 2))?;
    }
    if ran("agent") {
        writeln!(report, "| agent: TTFT p50 of turn {} / of turn 2 (<= 1) | {}x |", o.turns, spread(&ratio_turns, 2))?;
    }
    if ran("no reuse") {
        writeln!(report, "| no reuse: output tok/s with the cache on / off (>= 0.95) | {} |", spread(&overhead, 3))?;
    }
    if !ran("agent") {
        return Ok(());
    }
    let turn_ttfts = |cache: bool| (1..=o.turns).map(|t| of(runs, "agent", cache).map(|r| percentile(&r.ttfts(Some(t)), 50.0)).collect::<Vec<_>>()).map(|v| spread(&v, 1)).collect::<Vec<_>>().join(" | ");
    writeln!(report, "\nAgent TTFT p50 ms by turn, median (min-max) over repetitions:\n")?;
    writeln!(report, "| cache | {} |", (1..=o.turns).map(|t| format!("turn {t}")).collect::<Vec<_>>().join(" | "))?;
    writeln!(report, "|---|{}", "---|".repeat(o.turns))?;
    writeln!(report, "| on | {} |\n| off | {} |", turn_ttfts(true), turn_ttfts(false))?;
    Ok(())
}
