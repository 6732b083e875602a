//! `tandem serve --role router`: the OpenAI endpoint in front of prefill and decode workers.
//!
//! request → the decode workers' plans (each tokenizes the request as it would run it and says
//! how much of the prompt its prefix cache holds, and its load) → `policy` (which decode
//! worker; prefill there or on a prefill worker) → for a remote prefill: a slot reserved on the
//! decode worker, the prompt prefilled by a prefill worker that writes the state into it
//! through NIXL (another prefill worker, or the decode worker itself, where one fails) → the
//! request forwarded to the decode worker, its answer or stream passed back as it comes.
//! Workers register themselves (`members`); the router holds no model.

mod members;
mod policy;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::State as AppState;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use serde_json::{json, Map, Value};

use crate::args::Args;
use crate::http_client;
use crate::serve::api::ApiError;
use members::Members;
use policy::{DecodeCandidate, Placement, RemoteCosts};

pub const USAGE: &str = "\
tandem serve --role router: the OpenAI endpoint in front of prefill and decode workers

USAGE:
  tandem serve --role router [--host 127.0.0.1] [--port 8000] [options]
  tandem serve --role decode  --model M --router http://ROUTER:PORT [--advertise URL] [serve options]
  tandem serve --role prefill --model M --router http://ROUTER:PORT [--advertise URL] [serve options]

Workers register with the router and renew every second; the router forgets one that stops
(or that fails a request, until it renews). For each request the router asks the decode
workers how much of the prompt their prefix caches hold, picks the one holding the most (then
the least loaded), and prefills the prompt there or on a prefill worker, which writes the state
through NIXL straight into a slot the decode worker reserved (the workers need a tandem built
with --features nixl). A prefill worker that fails is replaced by another, or by the decode
worker itself; the reserved slot is freed at once.

OPTIONS:
  --prefill-placement P    conditional (default): remote where it is expected to cost less,
                           from the rates measured while serving (the decode worker's prefill,
                           the prefill workers' prefill and transfer; a local prefill also
                           stalls the decode worker's running sequences); local: always on the
                           decode worker; remote: always on a prefill worker
  --remote-prefill-min-tokens N
                           the fewest uncached prompt tokens prefilled remotely under the
                           conditional placement (default 256)
  --prefill-timeout S      seconds a remote prefill and its transfer may take before the router
                           gives up on it (default 120)

ENDPOINTS: those of tandem serve (forwarded to a decode worker), /metrics (the router's:
placements and their reasons, transfers, workers and their load), /health.
";

/// How long the router waits for a worker's plan, reservation or release.
const ASK_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a forwarded request may take to answer (its head; a stream then runs on).
const FORWARD_TIMEOUT: Duration = Duration::from_secs(600);

struct Counters {
    local: AtomicU64,
    remote: AtomicU64,
    remote_failed: AtomicU64,
    worker_failures: AtomicU64,
    transfer_us: AtomicU64,
    prefill_us: AtomicU64,
    state_bytes: AtomicU64,
    reasons: std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

struct Routing {
    members: Arc<Members>,
    /// What remote prefills have cost so far (the conditional placement's input).
    costs: std::sync::Mutex<RemoteCosts>,
    /// Whether a remote prefill made to measure its cost is under way (one at a time: the
    /// requests meanwhile stay local).
    exploring: std::sync::atomic::AtomicBool,
    placement: Placement,
    min_remote_tokens: usize,
    prefill_timeout: Duration,
    counters: Counters,
}

pub fn run(argv: &[String]) -> Result<ExitCode> {
    let args = Args::parse(argv, &["role", "host", "port", "prefill-placement", "remote-prefill-min-tokens", "prefill-timeout"], &[])?;
    let host = args.str("host").unwrap_or("127.0.0.1");
    let port: u16 = args.get("port", 8000)?;
    let addr: SocketAddr = format!("{host}:{port}").parse().or_else(|_| format!("[{host}]:{port}").parse()).with_context(|| format!("--host {host:?} is not an IP address"))?;
    let routing = Arc::new(Routing {
        members: Arc::default(),
        costs: Default::default(),
        exploring: Default::default(),
        placement: Placement::parse(args.str("prefill-placement").unwrap_or("conditional"))?,
        min_remote_tokens: args.get("remote-prefill-min-tokens", 256)?,
        prefill_timeout: Duration::from_secs_f64(args.get("prefill-timeout", 120.0)?),
        counters: Counters {
            local: AtomicU64::new(0),
            remote: AtomicU64::new(0),
            remote_failed: AtomicU64::new(0),
            worker_failures: AtomicU64::new(0),
            transfer_us: AtomicU64::new(0),
            prefill_us: AtomicU64::new(0),
            state_bytes: AtomicU64::new(0),
            reasons: Default::default(),
        },
    });
    let listener = std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    listener.set_nonblocking(true)?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completion))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/internal/register", post(register))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint: see POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics").into_response() })
        .with_state(Arc::clone(&routing));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().context("starting the HTTP runtime")?;
    eprintln!("tandem router: prefill placement {:?}, remote from {} uncached tokens; workers register at POST /internal/register", routing.placement, routing.min_remote_tokens);
    eprintln!("listening on http://{bound}");
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        axum::serve(listener, app).with_graceful_shutdown(crate::serve::shutdown_signal()).await
    })?;
    eprintln!("tandem router: stopped");
    Ok(ExitCode::SUCCESS)
}

async fn register(AppState(r): AppState<Arc<Routing>>, raw: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct Registration {
        role: String,
        url: String,
        active: usize,
        queued: usize,
        max_concurrent: usize,
    }
    let reg: Registration = match serde_json::from_slice(&raw) {
        Ok(r) => r,
        Err(e) => return ApiError::bad_request(format!("a registration is {{role, url, active, queued, max_concurrent}}: {e}")).into_response(),
    };
    if reg.role != "prefill" && reg.role != "decode" {
        return ApiError::invalid("role", format!("{:?}: prefill or decode", reg.role)).into_response();
    }
    if let Err(e) = http_client::check_base(&reg.url) {
        return ApiError::invalid("url", format!("{e:#}")).into_response();
    }
    if r.members.register(&reg.role, &reg.url, reg.active, reg.queued, reg.max_concurrent) {
        eprintln!("tandem router: {} worker {} joined", reg.role, reg.url);
    }
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], "{\"registered\":true}").into_response()
}

async fn chat(AppState(r): AppState<Arc<Routing>>, raw: Bytes) -> Response {
    route(&r, "chat", "/v1/chat/completions", raw).await.unwrap_or_else(|e| e.into_response())
}

async fn completion(AppState(r): AppState<Arc<Routing>>, raw: Bytes) -> Response {
    route(&r, "completion", "/v1/completions", raw).await.unwrap_or_else(|e| e.into_response())
}

fn unavailable(message: String) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "no_worker", message)
}

/// A worker's answer that is not a success, passed to the client as it came (a bad request
/// gets the decode worker's own 400).
fn passed_on(status: StatusCode, body: Bytes) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// One decode worker's plan for a request.
struct Plan {
    url: String,
    prompt: Vec<u32>,
    hash: String,
    candidate: DecodeCandidate,
}

async fn route(r: &Arc<Routing>, endpoint: &str, path: &str, raw: Bytes) -> Result<Response, ApiError> {
    let body: Map<String, Value> = crate::serve::api::parse_object(&raw)?;
    let decoders = r.members.live("decode");
    if decoders.is_empty() {
        return Err(unavailable("no decode worker is registered with this router (tandem serve --role decode --router URL)".into()));
    }
    // Every decode worker's plan, side by side.
    let ask = json!({"endpoint": endpoint, "request": Value::Object(body.clone())});
    let answers = futures_util::future::join_all(decoders.iter().map(|m| http_client::post_json(&m.url, "/internal/plan", &ask, ASK_TIMEOUT))).await;
    let mut plans = Vec::new();
    for (m, answer) in decoders.iter().zip(answers) {
        match answer {
            Ok((s, b)) if s.is_success() => {
                let v: Value = serde_json::from_slice(&b).unwrap_or_default();
                let num = |k: &str| v[k].as_u64().unwrap_or(0) as usize;
                let prompt: Vec<u32> = v["prompt"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64().map(|n| n as u32)).collect()).unwrap_or_default();
                let candidate = DecodeCandidate { cached: num("cached"), active: num("active"), queued: num("queued"), in_flight: m.in_flight, max_concurrent: num("max_concurrent").max(1), prefill_rate: v["prefill_rate"].as_f64() };
                plans.push(Plan { url: m.url.clone(), prompt, hash: v["hash"].as_str().unwrap_or_default().to_string(), candidate });
            }
            // The request itself is wrong (or too long, or the model misnamed): the client hears it.
            Ok((s, b)) if s.is_client_error() && s != StatusCode::TOO_MANY_REQUESTS => return Ok(passed_on(s, b)),
            Ok((s, b)) => eprintln!("tandem router: decode worker {} could not plan a request ({s}): {}", m.url, String::from_utf8_lossy(&b)),
            Err(e) => {
                eprintln!("tandem router: decode worker {} is not answering, no more requests go there until it renews: {e:#}", m.url);
                r.members.failed(&m.url);
                r.counters.worker_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    let candidates: Vec<DecodeCandidate> = plans.iter().map(|p| p.candidate.clone()).collect();
    let Some(chosen) = policy::pick_decode(&candidates) else {
        return Err(unavailable("no decode worker could take the request (see the router's log)".into()));
    };
    let plan = &plans[chosen];
    let uncached = plan.prompt.len().saturating_sub(plan.candidate.cached);
    let mut prefillers = r.members.live("prefill");
    prefillers.sort_by_key(|m| m.in_flight * 1000 / m.max_concurrent.max(1));
    let least_busy = prefillers.first().map(|m| m.in_flight);
    let (mut go_remote, mut reason) = {
        let mut costs = r.costs.lock().expect("costs lock");
        let decided = policy::remote(r.placement, r.min_remote_tokens, plan.prompt.len(), uncached, &plan.candidate, least_busy, &costs);
        if decided.1 == policy::Reason::LocalCheaper {
            costs.kept_local();
        }
        decided
    };
    // Measuring prefills go one at a time.
    let measuring = matches!(reason, policy::Reason::Exploring | policy::Reason::Remeasuring);
    let explorer = measuring && !r.exploring.swap(true, Ordering::AcqRel);
    if measuring && !explorer {
        (go_remote, reason) = (false, policy::Reason::AwaitingMeasurement);
    }
    *r.counters.reasons.lock().expect("counters lock").entry(reason.name()).or_default() += 1;
    let mut prefilled = None;
    if go_remote {
        prefilled = prefill_remotely(r, plan, &body, &prefillers).await;
        if prefilled.is_none() {
            r.counters.remote_failed.fetch_add(1, Ordering::Relaxed);
        }
        if explorer {
            r.exploring.store(false, Ordering::Release);
        }
    }
    let counter = if prefilled.is_some() { &r.counters.remote } else { &r.counters.local };
    counter.fetch_add(1, Ordering::Relaxed);
    let mut forwarded = body;
    if let Some(p) = prefilled {
        forwarded.insert("tandem_prefilled".into(), p);
    }
    forward(r, &plan.url, path, Bytes::from(Value::Object(forwarded).to_string())).await
}

/// Prefill the plan's prompt on a prefill worker into a slot of the plan's decode worker: the
/// body's `tandem_prefilled` for the decode worker, or None where no prefill worker managed it
/// (each failure's slot freed at once; the decode worker then prefills itself).
async fn prefill_remotely(r: &Arc<Routing>, plan: &Plan, body: &Map<String, Value>, prefillers: &[members::Member]) -> Option<Value> {
    // Two tries at most: the least busy prefill worker, then the next.
    for m in prefillers.iter().take(2) {
        let reserve = json!({"tokens": plan.prompt.len()});
        let ticket = match http_client::post_json(&plan.url, "/internal/reserve", &reserve, ASK_TIMEOUT).await {
            Ok((s, b)) if s.is_success() => serde_json::from_slice::<Value>(&b).ok()?,
            Ok((s, b)) => {
                eprintln!("tandem router: decode worker {} reserved no slot ({s}): {}", plan.url, String::from_utf8_lossy(&b));
                return None;
            }
            Err(e) => {
                eprintln!("tandem router: decode worker {} reserved no slot: {e:#}", plan.url);
                return None;
            }
        };
        let slot = ticket["slot"].as_u64()?;
        let ask = json!({"prompt": plan.prompt, "ticket": ticket, "cache_salt": body.get("cache_salt")});
        let _in_flight = r.members.begin(&m.url);
        let started = Instant::now();
        match http_client::post_json(&m.url, "/internal/prefill", &ask, r.prefill_timeout).await {
            Ok((s, b)) if s.is_success() => {
                let v: Value = serde_json::from_slice(&b).unwrap_or_default();
                let us = |k: &str| (v[k].as_f64().unwrap_or(0.0) * 1e3) as u64;
                let prefilled = v["prefilled"].as_u64().unwrap_or(0) as usize;
                r.costs.lock().expect("costs lock").observe(prefilled, plan.prompt.len(), Duration::from_micros(us("prefill_ms")), started.elapsed());
                r.counters.transfer_us.fetch_add(us("transfer_ms") + us("serialize_ms"), Ordering::Relaxed);
                r.counters.prefill_us.fetch_add(us("prefill_ms"), Ordering::Relaxed);
                r.counters.state_bytes.fetch_add(v["state_bytes"].as_u64().unwrap_or(0), Ordering::Relaxed);
                return Some(json!({"slot": slot, "tokens": plan.prompt.len(), "hash": plan.hash, "cached": v["cached"]}));
            }
            outcome => {
                match &outcome {
                    Ok((s, b)) => eprintln!("tandem router: prefill worker {} failed a prefill ({s}) after {:.0} ms: {}", m.url, started.elapsed().as_secs_f64() * 1e3, String::from_utf8_lossy(b)),
                    Err(e) => {
                        eprintln!("tandem router: prefill worker {} failed a prefill after {:.0} ms, no more prefills go there until it renews: {e:#}", m.url, started.elapsed().as_secs_f64() * 1e3);
                        r.members.failed(&m.url);
                        r.counters.worker_failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
                // The slot will not be written: free it now.
                let _ = http_client::post_json(&plan.url, "/internal/release", &json!({"slot": slot}), ASK_TIMEOUT).await;
            }
        }
    }
    None
}

/// Forward a request to a decode worker and pass its answer back as it comes; a worker that
/// cannot be reached, or whose stream breaks off, gives the client an error (an error event
/// and `[DONE]` in a stream).
async fn forward(r: &Arc<Routing>, url: &str, path: &str, body: Bytes) -> Result<Response, ApiError> {
    let in_flight = r.members.begin(url);
    let response = match http_client::post_streaming(url, path, body, FORWARD_TIMEOUT).await {
        Ok(response) => response,
        Err(e) => {
            r.members.failed(url);
            r.counters.worker_failures.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::new(StatusCode::BAD_GATEWAY, "worker_failed", format!("the decode worker {url} failed: {e:#}")));
        }
    };
    let status = response.status();
    let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
    let streaming = content_type.as_ref().is_some_and(|c| c.as_bytes().starts_with(b"text/event-stream"));
    let retry_after = response.headers().get(header::RETRY_AFTER).cloned();
    let (members, url) = (Arc::clone(&r.members), url.to_string());
    let chunks = http_body_util::BodyStream::new(response.into_body()).filter_map(|frame| async move {
        match frame {
            Ok(f) => f.into_data().ok().map(Ok::<Bytes, std::io::Error>),
            Err(e) => Some(Err(std::io::Error::other(e))),
        }
    });
    // The in-flight count lasts as long as the body; a broken stream ends with an error.
    let body = futures_util::stream::unfold((Box::pin(chunks), Some(in_flight), false), move |(mut chunks, guard, ended)| {
        let (members, url) = (Arc::clone(&members), url.clone());
        async move {
            if ended {
                return None;
            }
            match chunks.next().await {
                Some(Ok(b)) => Some((Ok(b), (chunks, guard, false))),
                Some(Err(e)) => {
                    members.failed(&url);
                    let message = format!("the decode worker {url} failed mid-answer: {e}");
                    eprintln!("tandem router: {message}");
                    let end = if streaming {
                        let error = json!({"error": {"message": message, "type": "server_error", "param": null, "code": "worker_failed"}});
                        Bytes::from(format!("data: {error}\n\ndata: [DONE]\n\n"))
                    } else {
                        return Some((Err(std::io::Error::other(message)), (chunks, None, true)));
                    };
                    Some((Ok(end), (chunks, None, true)))
                }
                None => None,
            }
        }
    });
    let mut out = Response::builder().status(status);
    if let Some(c) = content_type {
        out = out.header(header::CONTENT_TYPE, c);
    }
    if let Some(ra) = retry_after {
        out = out.header(header::RETRY_AFTER, ra);
    }
    Ok(out.body(Body::from_stream(body)).expect("a response of parts that were valid"))
}

async fn models(AppState(r): AppState<Arc<Routing>>) -> Response {
    for m in r.members.live("decode") {
        if let Ok((s, b)) = http_client::get(&m.url, "/v1/models", ASK_TIMEOUT).await {
            return passed_on(s, b);
        }
    }
    unavailable("no decode worker is registered with this router".into()).into_response()
}

async fn health(AppState(r): AppState<Arc<Routing>>) -> Response {
    let workers: Vec<Value> = r.members.all().into_iter().map(|(m, live)| json!({"url": m.url, "role": m.role, "live": live})).collect();
    let status = if r.members.live("decode").is_empty() { "no_decode_worker" } else { "ok" };
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], json!({"status": status, "workers": workers}).to_string()).into_response()
}

async fn metrics(AppState(r): AppState<Arc<Routing>>) -> Response {
    use std::fmt::Write as _;
    let c = &r.counters;
    let mut out = String::new();
    let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
    let _ = writeln!(out, "# HELP tandem_router_requests_total Requests routed, by where their prompt was prefilled.\n# TYPE tandem_router_requests_total counter");
    let _ = writeln!(out, "tandem_router_requests_total{{prefill=\"local\"}} {}\ntandem_router_requests_total{{prefill=\"remote\"}} {}", load(&c.local), load(&c.remote));
    let _ = writeln!(out, "# HELP tandem_router_placement_reasons_total Why each prefill was placed where it was (the policy's inputs: prompt tokens not cached, the decode worker's load, the prefill workers' load).\n# TYPE tandem_router_placement_reasons_total counter");
    for (reason, n) in c.reasons.lock().expect("counters lock").iter() {
        let _ = writeln!(out, "tandem_router_placement_reasons_total{{reason=\"{reason}\"}} {n}");
    }
    let _ = writeln!(out, "# HELP tandem_router_remote_prefill_failures_total Remote prefills given up (the decode worker prefilled instead).\n# TYPE tandem_router_remote_prefill_failures_total counter\ntandem_router_remote_prefill_failures_total {}", load(&c.remote_failed));
    let _ = writeln!(out, "# HELP tandem_router_worker_failures_total Requests to a worker that could not reach it or broke off.\n# TYPE tandem_router_worker_failures_total counter\ntandem_router_worker_failures_total {}", load(&c.worker_failures));
    let _ = writeln!(out, "# HELP tandem_router_state_transfer_seconds_total Time prefill workers spent writing states into decode workers' slots (image and transfer).\n# TYPE tandem_router_state_transfer_seconds_total counter\ntandem_router_state_transfer_seconds_total {:.6}", load(&c.transfer_us) as f64 / 1e6);
    let _ = writeln!(out, "# HELP tandem_router_remote_prefill_seconds_total Time prefill workers spent prefilling.\n# TYPE tandem_router_remote_prefill_seconds_total counter\ntandem_router_remote_prefill_seconds_total {:.6}", load(&c.prefill_us) as f64 / 1e6);
    let _ = writeln!(out, "# HELP tandem_router_state_bytes_total Bytes of states written into decode workers' slots.\n# TYPE tandem_router_state_bytes_total counter\ntandem_router_state_bytes_total {}", load(&c.state_bytes));
    let (prefill, overhead) = {
        let costs = r.costs.lock().expect("costs lock");
        (costs.prefill(), costs.overhead())
    };
    let _ = writeln!(out, "# HELP tandem_router_remote_cost_seconds_per_token What remote prefills cost lately, medians of the last five: per token prefilled on a prefill worker, and per prompt token of the rest (the state's transfer, checks, HTTP).\n# TYPE tandem_router_remote_cost_seconds_per_token gauge");
    for (part, v) in [("prefill", prefill), ("overhead", overhead)] {
        if let Some(v) = v {
            let _ = writeln!(out, "tandem_router_remote_cost_seconds_per_token{{part=\"{part}\"}} {v:.9}");
        }
    }
    let _ = writeln!(out, "# HELP tandem_router_worker_live Whether a registered worker gets requests.\n# TYPE tandem_router_worker_live gauge");
    let all = r.members.all();
    for (m, live) in &all {
        let _ = writeln!(out, "tandem_router_worker_live{{role=\"{}\",url=\"{}\"}} {}", m.role, m.url, *live as u8);
    }
    let _ = writeln!(out, "# HELP tandem_router_worker_load A worker's load at its last renewal (active, queued) and the router's requests in flight on it.\n# TYPE tandem_router_worker_load gauge");
    for (m, _) in &all {
        for (what, n) in [("active", m.active), ("queued", m.queued), ("in_flight", m.in_flight)] {
            let _ = writeln!(out, "tandem_router_worker_load{{role=\"{}\",url=\"{}\",load=\"{what}\"}} {n}", m.role, m.url);
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}
