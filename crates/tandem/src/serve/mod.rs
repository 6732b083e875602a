//! `tandem serve`: an OpenAI-compatible HTTP server over the two-engine pipeline.
//!
//! request → `routes` (parse, render the chat template, tokenize) → `completion` (the deepest
//! state of the prefix cache the prompt passes, snapshots asked of its prefill) → `engines` (admission,
//! the pipeline's engine threads, events routed back) → text deltas → JSON or SSE.
//!
//! The HTTP side runs on a small tokio runtime; the model runs only on the engines' threads.

pub mod api;
mod engines;
mod completion;
mod metrics;
mod routes;
mod transfer;
mod tool_calls;
mod worker;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use axum::routing::{get, post};
use axum::Router;
use tandem_core::chat::{ChatTemplate, Message};
use tandem_core::backend::cuda::qwen35::state_slots::SlotLayout;
use tandem_core::engine::Device;
use tandem_core::pipeline::{self, KvBudget, Mode};
use tandem_core::prefix_cache::{DiskTier, PrefixCache};
use tandem_core::session::HOLD_BACK;
use tandem_core::grammar::{Constraint, Grammars};
use tandem_core::tokenizer::Tokenizer;

use crate::args::{kv_budget, parse_size, pipeline_config, Args, ENGINE_OPTIONS};
use api::{ApiError, Conversation, Format};
use serde_json::Value;
use engines::Engines;
use metrics::{Metrics, Served};

pub const USAGE: &str = "\
tandem serve: an OpenAI-compatible server (chat completions, completions, streaming)

USAGE:
  tandem serve --model M [--host 127.0.0.1] [--port 8000] [options]

ENDPOINTS:
  POST /v1/chat/completions   messages -> reply (stream: server-sent events ending in [DONE])
  POST /v1/completions        prompt (text or token ids) -> continuation
  GET  /v1/models, GET /health, GET /metrics (Prometheus)
  POST /v1/chat/typing        tandem's extension: {messages, session_id}, the last message being
                              typed; prefills it ahead so that sending it costs no prefill
  Request options: max_tokens (max_completion_tokens), temperature (default 1), top_p, top_k,
  min_p, seed, stop (up to 4 strings), stop_token_ids, logit_bias, presence_penalty,
  frequency_penalty, repetition_penalty, logprobs (chat: with top_logprobs), n (up to 128),
  tools with tool_choice (auto, none, required, a named function), response_format
  (json_object, json_schema; enforced while sampling), stream, stream_options.include_usage, session_id (pins
  the conversation's latest states in the prefix cache and prefills each reply's end for the
  next turn), cache_salt (match only cached states made under the same salt),
  ignore_eos (generate max_tokens past end-of-turn tokens),
  chat_template_kwargs.enable_thinking (default off). Unknown fields are ignored.

OPTIONS:
  --prefill PLACEMENT, --decode PLACEMENT, --mode, --transfer, --threads, --cores, --quant, --isa
                           the engines, as for tandem generate (tandem --help)
  --max-prefill-tokens N   most prompt tokens prefilled in one forward: a CUDA engine packs the
                           prompts that wait into one, up to this many (default 8192); one
                           engine doing both (--mode decode-engine) applies this many per step
                           between decode steps, a longer prompt in chunks (chunked prefill)
  --trace FILE             a timeline of the engines' work, as for tandem generate
  --max-concurrent N       sequences running at once: the decode batch (default 8)
  --max-queue N            requests waiting for a sequence past that; more are refused with 429
                           and Retry-After (default 64)
  --max-context N          most tokens of prompt plus reply (default: the model's context)
  --gpu-memory-utilization F
                           a GPU decode engine's K/V cache takes what is left of this fraction
                           of the GPU's memory once the model is loaded, less room for the
                           state slots (two per --max-concurrent, running and prefilled ahead)
                           and workspaces (default 0.9); sequences that do not fit wait, or
                           are swapped out to host memory and back
  --kv-cache-memory SIZE   or a K/V cache of this size, e.g. 20GiB; a CPU decode engine's budget
                           (K/V of this size and two state slots per --max-concurrent; default:
                           no limit), its sequences swapped out to files in $TMPDIR and back
  --prefix-cache-memory SIZE
                           host memory for the prefix cache's state snapshots, e.g. 512MiB,
                           4GiB (default 2GiB with a CPU prefill engine, 0 with a GPU one,
                           which recomputes a prompt of a few thousand tokens faster than it
                           moves a state to host memory and back; given, the snapshots the
                           GPU's budget lets go move there; also --session-memory)
  --prefix-cache-device-memory SIZE
                           GPU memory for the snapshots a GPU prefill engine takes, taken from
                           the K/V cache's (default: a quarter of what the K/V cache would
                           get, at most 8GiB); their K/V blocks are shared with the requests
                           they come from and go to, so a snapshot past a cached prefix costs
                           its recurrent state and a block; the cache is off where both
                           budgets are 0
  --prefix-cache-dir DIR   keep the snapshots host memory (or the GPU's budget, where host
                           memory has no room) lets go in DIR, as checksummed state files with
                           the model's fingerprint (a file another model wrote is refused and
                           left, a damaged one refused and deleted); a server started on DIR
                           takes up what an earlier one left there
  --prefix-cache-disk-memory SIZE
                           the most DIR may hold (default 16GiB)
  --prefix-snapshot-every N
                           a prefill also stops for a snapshot every N prompt tokens, so that
                           prompts that part from a long prompt late continue near where they
                           part (default 1024; 0: only where prompts part and at their ends)
  --served-model-name NAME the model's name in the API (default: --model as given)
  --role ROLE              single (default: the whole server), or a part of disaggregated
                           serving: router, prefill or decode (below)
  --router URL             a worker's router (http://HOST:PORT), with which it registers
  --advertise URL          where the router reaches this worker (default: http://--host:--port)
  --state-transfer HOW     how a decode worker takes states from prefill workers: nixl
                           (one-sided writes into its memory: host, or its GPU engine's),
                           stream (the state's image POSTed to it, over any network) or
                           file[:DIR] (a state file in a directory both workers see; default
                           /dev/shm); default: nixl where this tandem has it, else stream

Prefixes are reused without any client change: a request continues the deepest cached state
its prompt passes (the end of an earlier prompt, the point where two prompts part, the last
turn boundary of a chat, every N tokens of a long prompt, a session's reply end) and prefills
only the rest; the result is the one a cold prefill of the whole prompt gives.
";

/// Everything the handlers share.
pub struct App {
    engines: Arc<Engines>,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    stop_ids: Vec<u32>,
    /// Ids that may be sampled and sent.
    vocab: usize,
    im_start: Option<u32>,
    model_name: String,
    max_context: usize,
    max_concurrent: usize,
    max_queue: usize,
    /// Whether the prefix cache has a budget in some tier.
    cache_on: bool,
    cache: Mutex<PrefixCache>,
    /// Whether a thread is copying the snapshots leaving the GPU (`completion::settle`).
    settling: std::sync::atomic::AtomicBool,
    /// The model's config and fingerprint (a state from another process is checked against them).
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    config: tandem_core::model::config::Qwen35Config,
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    fingerprint: tandem_core::bridge::Fingerprint,
    /// A worker's part in disaggregated serving (`--role prefill|decode`).
    worker: Option<worker::Worker>,
    /// Sessions whose reply end is being prefilled in the background: done when it is.
    replies: Mutex<HashMap<String, tokio::sync::watch::Receiver<bool>>>,
    metrics: Metrics,
    started: u64,
    next_id: AtomicU64,
    /// Turns true when a stop's grace period is over: the requests still running end then
    /// (finish reason `abort`), the ones still queued are refused (503).
    ending: tokio::sync::watch::Receiver<bool>,
    /// The grammar engine for this tokenizer, set up by the first request with a
    /// `response_format` or a required tool call (or why it could not be).
    grammars: std::sync::OnceLock<Result<Grammars, String>>,
}

/// `--gpu-memory-utilization` unless given (as the large serving engines default to).
const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// Stands for the message being typed while the conversation is rendered.
const TYPING_MARK: &str = "\u{E000}tandem-typing\u{E000}";

impl App {
    fn request_id(&self) -> String {
        format!("{:x}{:06x}", self.started, self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    fn render(&self, messages: &[Message], tools: Option<&Value>, generation_prompt: bool, enable_thinking: bool) -> Result<String, ApiError> {
        self.template.render_with_tools(messages, tools, generation_prompt, enable_thinking).map_err(|e| ApiError::invalid("messages", format!("the chat template refused the messages: {e:#}")))
    }

    /// The grammar a request's reply must follow, compiled (a 400 naming the field where it
    /// does not compile).
    fn constraint(&self, format: &Format) -> Result<Constraint, ApiError> {
        let grammars = self.grammars.get_or_init(|| Grammars::new(&self.tokenizer, &self.stop_ids).map_err(|e| format!("{e:#}")));
        let g = grammars.as_ref().map_err(|e| ApiError::new(axum::http::StatusCode::INTERNAL_SERVER_ERROR, "grammar_error", format!("constrained decoding is not available: {e}")))?;
        let compiled = match format {
            Format::JsonObject => g.json_schema(&serde_json::json!({"type": "object"})),
            Format::JsonSchema(schema) => g.json_schema(schema),
            Format::ToolCalls { tools, only } => g.tool_calls(tools, only.as_deref()),
        };
        compiled.map_err(|e| ApiError::invalid(format.param(), format!("{}: the grammar engine could not compile it: {e:#}", format.param())))
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.tokenizer.encode(text).map_err(|e| ApiError::invalid("messages", format!("{e:#}")))
    }

    /// The prompt of a chat request: the template with the generation prompt, tokenized.
    fn chat_prompt(&self, c: &Conversation) -> Result<Vec<u32>, ApiError> {
        self.encode(&self.render(&c.messages, c.tools.as_ref(), true, c.enable_thinking)?)
    }

    /// For typing ahead: the tokens of the conversation up to the typed text's last few tokens
    /// (which may still change as typing goes on), and the whole prompt sending it now makes.
    fn typing_prompts(&self, c: &Conversation) -> Result<(Vec<u32>, Vec<u32>), ApiError> {
        let (last, earlier) = c.messages.split_last().expect("parse_typing checks there is a message");
        let mut marked = earlier.to_vec();
        marked.push(Message::new(&last.role, TYPING_MARK));
        let rendered = self.render(&marked, c.tools.as_ref(), false, c.enable_thinking)?;
        let (before, _) = rendered.split_once(TYPING_MARK).ok_or_else(|| ApiError::bad_request("the chat template drops the last message, so it cannot be typed ahead"))?;
        let mut stable = self.encode(&format!("{before}{}", last.content))?;
        stable.truncate(stable.len().saturating_sub(HOLD_BACK));
        Ok((stable, self.chat_prompt(c)?))
    }

    /// The tokens a conversation's next turn starts with once `reply` answered it: the
    /// conversation rendered with the reply and a next user message, up to that message (less
    /// its last token, which may merge with the message's first characters).
    fn next_turn_lead(&self, c: &Conversation, reply: Message) -> Result<Vec<u32>, ApiError> {
        let mut marked = c.messages.clone();
        marked.push(reply);
        marked.push(Message::new("user", TYPING_MARK));
        let rendered = self.render(&marked, c.tools.as_ref(), false, c.enable_thinking)?;
        let (before, _) = rendered.split_once(TYPING_MARK).ok_or_else(|| ApiError::bad_request("the chat template drops the last message"))?;
        let mut lead = self.encode(before)?;
        lead.pop();
        Ok(lead)
    }
}

pub fn run(argv: &[String]) -> Result<ExitCode> {
    let role = match argv.iter().position(|a| a == "--role").and_then(|i| argv.get(i + 1)).map(String::as_str) {
        None | Some("single") => worker::Role::Single,
        Some("router") => return crate::router::run(argv),
        Some("prefill") => worker::Role::Prefill,
        Some("decode") => worker::Role::Decode,
        Some(other) => bail!("--role {other:?}: single (the default), prefill, decode or router"),
    };
    let mut with_value = vec!["model", "host", "port", "role", "router", "advertise", "state-transfer", "max-concurrent", "max-queue", "max-context", "prefix-cache-memory", "prefix-cache-device-memory", "prefix-cache-dir", "prefix-cache-disk-memory", "session-memory", "prefix-snapshot-every", "served-model-name"];
    with_value.extend(ENGINE_OPTIONS.iter().filter(|o| **o != "max-batch"));
    let args = Args::parse(argv, &with_value, &[])?;
    let max_concurrent: usize = args.get("max-concurrent", 8)?;
    if max_concurrent == 0 {
        bail!("--max-concurrent must be at least 1");
    }
    let max_queue: usize = args.get("max-queue", 64)?;
    let snapshot_every: usize = args.get("prefix-snapshot-every", 1024)?;
    let mut config = pipeline_config(&args)?;
    // The engine that prefills takes the snapshots and continues them. A GPU engine keeps them
    // on its GPU; a snapshot in host memory costs it a copy each way (state and K/V), more than
    // its own prefill of a prompt of a few thousand tokens: no host tier there unless asked.
    let prefiller = if config.mode == Mode::AllOnDecodeEngine { &config.decode } else { &config.prefill };
    let prefill_on_gpu = matches!(prefiller.device, Device::Cuda(_));
    // A prefill worker on a GPU sends its snapshots from there (GPU memory to GPU memory).
    config.device_snapshots = role == worker::Role::Prefill && prefill_on_gpu;
    let cache_memory = match (args.str("prefix-cache-memory"), args.str("session-memory")) {
        (Some(_), Some(_)) => bail!("--session-memory is the older name of --prefix-cache-memory: give one of them"),
        (Some(size), None) => parse_size("prefix-cache-memory", size)?,
        (None, Some(size)) => parse_size("session-memory", size)?,
        (None, None) if prefill_on_gpu => 0,
        (None, None) => 2 << 30,
    };
    config.max_batch = max_concurrent;
    // A GPU decode engine sizes its K/V cache from 90% of the GPU's memory unless told.
    let decoder = if config.mode == Mode::AllOnPrefillEngine { &config.prefill } else { &config.decode };
    if matches!(decoder.device, Device::Cuda(_)) {
        config.kv_cache = kv_budget(&args, KvBudget::GpuFraction(DEFAULT_GPU_MEMORY_UTILIZATION))?;
    }
    config.prefix_cache_device = match args.str("prefix-cache-device-memory") {
        Some(size) if prefill_on_gpu || parse_size("prefix-cache-device-memory", size)? == 0 => parse_size("prefix-cache-device-memory", size)?,
        Some(_) => bail!("--prefix-cache-device-memory: the prefill engine runs on the CPU, whose snapshots live in host memory (--prefix-cache-memory)"),
        None if !prefill_on_gpu => 0,
        None => tandem_core::pipeline::PipelineConfig::DEVICE_TIER_DEFAULT,
    };
    let disk = match (args.str("prefix-cache-dir"), args.str("prefix-cache-disk-memory")) {
        (Some(dir), size) => Some((PathBuf::from(dir), size.map(|s| parse_size("prefix-cache-disk-memory", s)).transpose()?.unwrap_or(16 << 30))),
        (None, Some(_)) => bail!("--prefix-cache-disk-memory sizes the directory --prefix-cache-dir names: give it too"),
        (None, None) => None,
    };
    let host = args.str("host").unwrap_or("127.0.0.1");
    let port: u16 = args.get("port", 8000)?;
    let addr: SocketAddr = format!("{host}:{port}").parse().or_else(|_| format!("[{host}]:{port}").parse()).with_context(|| format!("--host {host:?} is not an IP address"))?;

    let spec = args.required("model")?;
    let mut model = crate::load_model(spec, &args)?;
    crate::place_weights_for(&mut model, &[&config.prefill, &config.decode]);
    let vocab = model.sampleable_vocab();
    let Some(tokenizer) = model.tokenizer else {
        bail!("{spec} has no {}: the server takes and returns text, so it needs the model's tokenizer", model.tokenizer_source());
    };
    let model_context = model.net.config.max_position_embeddings;
    let max_context: usize = args.get("max-context", model_context)?;
    if max_context < 2 || max_context > model_context {
        bail!("--max-context {max_context}: give 2 to {model_context} tokens (the model's context)");
    }
    let model_name = args.str("served-model-name").unwrap_or(spec).to_string();
    let cfg = &model.net.config;
    // A GPU decode engine's states are slots in its state dtype; a CPU engine's are f32.
    let decoder = if config.mode == Mode::AllOnPrefillEngine { &config.prefill } else { &config.decode };
    let state_bytes = match decoder.device {
        Device::Cuda(_) => SlotLayout::new(cfg, decoder.state_dtype).bytes(),
        Device::Cpu => cfg.recurrent_state_bytes(),
    };
    let served = Served { decode_weight_bytes: model.net.weight_bytes_per_token(), state_bytes, kv_bytes_per_token: cfg.kv_bytes_per_token(), prefill_flops_per_token: model.net.projection_flops_per_token(), vocab, sequence_slots: max_concurrent };
    let listener = std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    listener.set_nonblocking(true)?;
    let bound = listener.local_addr()?;
    let router_url = args.str("router").map(str::to_string);
    if let Some(url) = &router_url {
        crate::http_client::check_base(url).context("--router")?;
    }
    if role != worker::Role::Single && router_url.is_none() {
        bail!("--role {}: give --router http://HOST:PORT, the router this worker registers with", role.name());
    }
    let advertise = args.str("advertise").map_or_else(|| format!("http://{bound}"), str::to_string);
    crate::http_client::check_base(&advertise).context("--advertise")?;
    if role != worker::Role::Decode && args.str("state-transfer").is_some() {
        bail!("--state-transfer: a decode worker's option (it reserves the slots; a prefill worker follows their tickets)");
    }
    let method = transfer::Method::parse(args.str("state-transfer"))?;
    let worker = worker::Worker::new(role, &format!("tandem-{}-{}-{}", role.name(), std::process::id(), bound.port()), method, &advertise)?;

    let fingerprint = model.net.fingerprint();
    pipeline::run(&model.net, &config, |pipeline| {
        let mut cache = PrefixCache::new(cache_memory, snapshot_every);
        if let Some(tier) = pipeline.device_tier() {
            cache = cache.with_device(Arc::clone(tier));
        }
        if let Some((dir, budget)) = &disk {
            let (tier, found) = DiskTier::open(dir, *budget, fingerprint, cfg)?;
            if !found.is_empty() {
                eprintln!("tandem serve: {} snapshots in {} from an earlier server (each checked as it is read)", found.len(), dir.display());
            }
            cache = cache.with_disk(tier, found);
        }
        let worker = worker.map(|w| w.on_gpu(pipeline, cfg.vocab_size)).transpose()?;
        let (end_requests, ending) = tokio::sync::watch::channel(false);
        let app = Arc::new(App {
            engines: Engines::start(pipeline.clone(), max_concurrent, max_queue),
            im_start: tokenizer.token_id("<|im_start|>"),
            tokenizer,
            template: model.chat_template,
            stop_ids: model.stop_ids,
            vocab,
            model_name,
            max_context,
            max_concurrent,
            max_queue,
            cache_on: cache_memory > 0 || pipeline.device_tier().is_some() || disk.is_some(),
            cache: Mutex::new(cache),
            settling: Default::default(),
            config: cfg.clone(),
            fingerprint,
            worker,
            replies: Mutex::default(),
            metrics: Metrics::new(served),
            started: completion::unix_now(),
            next_id: AtomicU64::new(1),
            ending,
            grammars: Default::default(),
        });
        let router = Router::new()
            .route("/v1/chat/completions", post(routes::chat_completions))
            .route("/v1/completions", post(routes::completions))
            .route("/v1/chat/typing", post(routes::typing))
            .route("/v1/models", get(routes::models))
            .route("/health", get(routes::health))
            .route("/metrics", get(routes::metrics))
            .route("/internal/plan", post(worker::plan))
            .route("/internal/reserve", post(worker::reserve))
            .route("/internal/release", post(worker::release))
            .route("/internal/prefill", post(worker::prefill))
            .route("/internal/state/{slot}", post(worker::state))
            .fallback(routes::not_found)
            .method_not_allowed_fallback(routes::method_not_allowed)
            .with_state(Arc::clone(&app));
        // Blocking threads render, tokenize and copy states; a few suffice, and each thread
        // that ever allocated keeps a malloc arena, so an unbounded pool grows memory under load.
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).max_blocking_threads(4).enable_all().build().context("starting the HTTP runtime")?;
        let device_tier = pipeline.device_tier().map_or(String::new(), |t| format!("{} MiB on cuda:{} and ", t.budget() >> 20, t.ordinal()));
        eprintln!(
            "tandem serve: {} ({}), mode {}, prefill {} -> decode {}, up to {max_concurrent} sequences, {max_queue} queued, context {max_context}, prefix cache {device_tier}{} MiB of host memory",
            app.model_name,
            app.template.origin,
            config.mode.name(),
            config.prefill,
            config.decode,
            cache_memory >> 20
        );
        if let Some(capacity) = pipeline.kv_capacity() {
            eprintln!("tandem serve: {}", capacity.describe(max_concurrent));
        }
        if config.prefix_cache_device > 0 && pipeline.device_tier().is_none() {
            eprintln!("tandem serve: the prefill engine keeps its snapshots in host memory: it has no pools of its own that the server can budget (prefill and decode engines on two GPUs)");
        }
        if !app.cache_on {
            eprintln!("tandem serve: the prefix cache is off (--prefix-cache-memory SIZE or --prefix-cache-device-memory SIZE turns it on)");
        }
        if let Some(t) = app.worker.as_ref().and_then(|w| w.transfer()) {
            eprintln!("tandem serve: states from prefill workers come by {t}");
        }
        eprintln!("listening on http://{bound}");
        let served = runtime.block_on(async {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            if let Some(router) = router_url {
                worker::register_with(&app, router, advertise, role);
            }
            let (stopping, mut stop_seen) = tokio::sync::watch::channel(false);
            let server = axum::serve(listener, router).with_graceful_shutdown(async move {
                shutdown_signal().await;
                eprintln!("tandem serve: stopping; requests in flight get {} s to finish", SHUTDOWN_GRACE.as_secs());
                let _ = stopping.send(true);
            });
            // Past the grace period the requests still running end (each stream with a finish
            // reason and [DONE]); whatever is left after a moment more goes with the runtime.
            let deadline = async {
                let _ = stop_seen.changed().await;
                tokio::time::sleep(SHUTDOWN_GRACE).await;
                eprintln!("tandem serve: the grace period is over; ending the requests still running");
                let _ = end_requests.send(true);
                tokio::time::sleep(ENDING_WAIT).await;
            };
            tokio::select! {
                served = server => served,
                _ = deadline => Ok(()),
            }
        });
        // Dropping the runtime drops every handler and with them their pipeline handles.
        drop(runtime);
        drop(app);
        eprintln!("tandem serve: stopped");
        served.context("serving HTTP")
    })?;
    Ok(ExitCode::SUCCESS)
}

/// How long requests in flight may run on after Ctrl-C or SIGTERM.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// How long the requests ended at the grace period's end have to send their last chunk.
const ENDING_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Ctrl-C or SIGTERM: stop taking connections and finish the requests in flight.
pub(crate) async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("session-memory", "0").unwrap(), 0);
        assert_eq!(parse_size("session-memory", "512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("session-memory", "2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("session-memory", "1.5g").unwrap(), 3 << 29);
        assert!(format!("{:#}", parse_size("session-memory", "2 parsecs").unwrap_err()).contains("unknown unit"));
        assert!(parse_size("session-memory", "-1G").is_err());
    }
}
