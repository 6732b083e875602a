//! What a worker of disaggregated serving adds to the server (`--role prefill|decode`).
//!
//! A decode worker is the whole server (it can prefill a prompt itself) that also reserves
//! slots for states prefilled elsewhere (`POST /internal/reserve`, a ticket: transfer.rs), frees
//! them (`/internal/release`), takes streamed states (`/internal/state/SLOT`), tells the router
//! what a request would cost it (`/internal/plan`: the prompt's tokens, the tokens its prefix
//! cache holds, its load), and runs a chat or completion request from the state a prefill
//! worker wrote (the body's `tandem_prefilled`). A prefill worker prefills a prompt (continuing
//! its own prefix cache) and puts the state where the ticket says (`/internal/prefill`). Both
//! register with the router (`--router URL`) and renew it every second; the router forgets a
//! worker that stops.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State as AppState;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{ApiError, Endpoint};
use super::completion::Cached;
use super::transfer::{Inbox, Method, Outbox, Sent};
use super::App;

/// How a `tandem serve` takes part in disaggregated serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The whole server on its own (the default).
    Single,
    Prefill,
    Decode,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Single => "single",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// How long a prefill worker waits for its write into a decode worker's slot (below the
/// quarantine of released NIXL slots, so that a write given up on never lands in a reused one)
/// or for its POST of a streamed state.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a decode worker waits for a state the router says was written (NIXL notifies
/// after the bytes, and the router forwards the request only once the write completed).
const ARRIVAL_TIMEOUT: Duration = Duration::from_secs(10);

/// A worker's part of the server: its role and its end of the state's transfer.
pub struct Worker {
    pub role: Role,
    inbox: Option<Inbox>,
    outbox: Option<Outbox>,
    /// States prefill workers wrote that requests here started from.
    used: AtomicU64,
    /// States a prefill worker wrote that this decode worker refused or could not find (the
    /// request was prefilled here instead).
    refused: AtomicU64,
}

impl Worker {
    /// The worker of `role` (None for the single server): a decode worker takes states by
    /// `method` (its NIXL agent named `name`), reachable at `url`.
    pub fn new(role: Role, name: &str, method: Method, url: &str) -> anyhow::Result<Option<Worker>> {
        let (inbox, outbox) = match role {
            Role::Single => return Ok(None),
            Role::Decode => (Some(Inbox::new(method, name, url).map_err(|e| e.context("--state-transfer"))?), None),
            Role::Prefill => (None, Some(Outbox::new(name))),
        };
        Ok(Some(Worker { role, inbox, outbox, used: Default::default(), refused: Default::default() }))
    }

    /// Move states GPU memory to GPU memory where this worker's engine is a GPU engine and the
    /// state goes by NIXL: a decode worker receives into its decode engine's pools, a prefill
    /// worker sends its prefill engine's snapshots from theirs. Called before the engines
    /// allocate (their pools are made exportable to other processes here).
    pub fn on_gpu(mut self, pipeline: &tandem_core::pipeline::Pipeline, vocab: usize) -> anyhow::Result<Worker> {
        if let Some(i) = self.inbox.take() {
            self.inbox = Some(i.on_gpu(pipeline, vocab)?);
        }
        if let Some(o) = self.outbox.take() {
            self.outbox = Some(o.on_gpu(pipeline, vocab)?);
        }
        Ok(self)
    }

    /// How states come to this worker (a decode worker's), for its start-up line.
    pub fn transfer(&self) -> Option<&'static str> {
        self.inbox.as_ref().map(Inbox::kind)
    }
}

/// Where a prefill worker put a request's state: the slot of this decode worker it wrote, and
/// the prompt it prefilled (its length and hash, checked against this worker's tokens).
#[derive(Clone, Debug, Deserialize)]
pub struct Prefilled {
    pub slot: u64,
    pub tokens: usize,
    pub hash: String,
    /// The prompt tokens the prefill worker's prefix cache held.
    #[serde(default)]
    pub cached: usize,
}

/// A hash of a prompt's token ids (FNV-1a, hex), to check that two processes tokenized a
/// request alike.
pub fn prompt_hash(ids: &[u32]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in ids.iter().flat_map(|id| id.to_le_bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// The body's `tandem_prefilled` (sent by the router to a decode worker), where there is one.
pub fn prefilled_elsewhere(app: &App, raw: &[u8]) -> Result<Option<Prefilled>, ApiError> {
    let Ok(Value::Object(body)) = serde_json::from_slice::<Value>(raw) else { return Ok(None) };
    let Some(v) = body.get("tandem_prefilled") else { return Ok(None) };
    if app.worker.as_ref().map(|w| w.role) != Some(Role::Decode) {
        return Err(ApiError::invalid("tandem_prefilled", "this server is not a decode worker (tandem serve --role decode): it holds no prefilled states"));
    }
    serde_json::from_value(v.clone()).map(Some).map_err(|e| ApiError::invalid("tandem_prefilled", format!("expected {{\"slot\", \"tokens\", \"hash\"}}: {e}")))
}

/// The state a prefill worker wrote for `prompt` into `remote`'s slot, checked, as the start of
/// the request. A state that does not come, or is refused (another model, another prompt,
/// damaged) is not applied: the slot is freed and the request prefilled here (counted in
/// `refused`).
pub async fn take_prefilled(app: &Arc<App>, remote: &Prefilled, prompt: &[u32]) -> Result<Cached, ApiError> {
    match take_state(app, remote, prompt).await {
        Ok(state) => {
            if let Some(w) = &app.worker {
                w.used.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(Cached { state: Some(state), reused: prompt.len(), cached: remote.cached, stops: Vec::new() });
        }
        Err(e) => {
            eprintln!("tandem serve: the state prefilled elsewhere for a {}-token prompt (slot {}) is not used, the prompt is prefilled here: {e:#}", prompt.len(), remote.slot);
            if let Some(w) = &app.worker {
                w.refused.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    Ok(super::completion::lookup(app, None, prompt, true).await)
}

async fn take_state(app: &Arc<App>, remote: &Prefilled, prompt: &[u32]) -> anyhow::Result<tandem_core::pipeline::Start> {
    use anyhow::Context;
    let inbox = app.worker.as_ref().and_then(|w| w.inbox.as_ref()).context("not a decode worker")?;
    if remote.tokens != prompt.len() || remote.hash != prompt_hash(prompt) {
        inbox.release(remote.slot);
        anyhow::bail!("it was prefilled for another prompt ({} tokens, hash {}; here {} tokens, hash {})", remote.tokens, remote.hash, prompt.len(), prompt_hash(prompt));
    }
    inbox.take(remote.slot, prompt.len(), app.fingerprint, &app.config, ARRIVAL_TIMEOUT).await
}

/// A worker's lines of `/metrics`: its role, and a decode worker's states from elsewhere.
pub fn metrics(app: &App) -> String {
    let Some(w) = &app.worker else { return String::new() };
    let mut out = format!("# HELP tandem_worker_role This server's role in disaggregated serving.\n# TYPE tandem_worker_role gauge\ntandem_worker_role{{role=\"{}\"}} 1\n", w.role.name());
    if w.role == Role::Decode {
        let inbox = w.inbox.as_ref().expect("a decode worker has an inbox");
        let (reserved, transfer) = (inbox.reserved(), inbox.kind());
        out += &format!(
            "# HELP tandem_remote_states_total States prefill workers wrote into this worker's slots: used (the request started from it) or refused (not applied; the request was prefilled here).\n# TYPE tandem_remote_states_total counter\ntandem_remote_states_total{{outcome=\"used\"}} {}\ntandem_remote_states_total{{outcome=\"refused\"}} {}\n# HELP tandem_state_slots_reserved Slots reserved for states on their way.\n# TYPE tandem_state_slots_reserved gauge\ntandem_state_slots_reserved {reserved}\n# HELP tandem_worker_state_transfer How states from prefill workers come: nixl-gpu (into the GPU engine's pools), nixl-host, stream or file.\n# TYPE tandem_worker_state_transfer gauge\ntandem_worker_state_transfer{{transfer=\"{transfer}\"}} 1\n",
            w.used.load(Ordering::Relaxed),
            w.refused.load(Ordering::Relaxed)
        );
    }
    out
}

fn json_response(status: StatusCode, v: Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// The worker of `app` if it has `role`, or the error for a worker that has another.
fn worker_as(app: &App, role: Role) -> Result<&Worker, ApiError> {
    app.worker.as_ref().filter(|w| w.role == role).ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("this server is not a {} worker (tandem serve --role {})", role.name(), role.name())))
}

fn parse<T: serde::de::DeserializeOwned>(raw: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(raw).map_err(|e| ApiError::bad_request(format!("{e}")))
}

/// `POST /internal/plan {"endpoint": "chat"|"completion", "request": {...}}` (decode worker):
/// the request read and tokenized as it would be run here, with what this worker holds of it
/// (the tokens its prefix cache covers) and its load. A bad request gets the error its run
/// would get.
pub async fn plan(AppState(app): AppState<Arc<App>>, raw: Bytes) -> Response {
    let result = async {
        worker_as(&app, Role::Decode)?;
        #[derive(Deserialize)]
        struct Plan {
            endpoint: String,
            request: Value,
        }
        let p: Plan = parse(&raw)?;
        let endpoint = match p.endpoint.as_str() {
            "chat" => Endpoint::Chat,
            "completion" => Endpoint::Completion,
            other => return Err(ApiError::invalid("endpoint", format!("{other:?}: chat or completion"))),
        };
        let prepared = super::routes::prepare(&app, endpoint, p.request.to_string().as_bytes(), Instant::now()).await?;
        let salt = prepared.options.cache_salt.clone();
        let cached = if prepared.options.session_id.is_some() || salt.is_some() || app.cache_on {
            super::completion::lookup(&app, salt.as_deref(), &prepared.prompt, false).await.reused
        } else {
            0
        };
        // Prompt tokens a second of its prefill engine so far (what the router weighs a remote
        // prefill against).
        let (busy, _) = app.engines.busy();
        let prefilled = app.metrics.counters.prefilled_tokens.load(Ordering::Relaxed);
        let prefill_rate = (busy.as_secs_f64() > 1e-3 && prefilled > 0).then(|| prefilled as f64 / busy.as_secs_f64());
        Ok(json_response(
            StatusCode::OK,
            json!({"prompt": prepared.prompt, "hash": prompt_hash(&prepared.prompt), "cached": cached, "active": app.engines.active(), "queued": app.engines.queued(), "max_concurrent": app.max_concurrent, "prefill_rate": prefill_rate}),
        ))
    };
    result.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// `POST /internal/reserve {"tokens": N}` (decode worker): a slot for the state of an
/// N-token prompt, as a NIXL ticket.
pub async fn reserve(AppState(app): AppState<Arc<App>>, raw: Bytes) -> Response {
    let result = (|| {
        let w = worker_as(&app, Role::Decode)?;
        #[derive(Deserialize)]
        struct Reserve {
            tokens: usize,
        }
        let r: Reserve = parse(&raw)?;
        if r.tokens == 0 || r.tokens > app.max_context {
            return Err(ApiError::invalid("tokens", format!("{} tokens: give 1 to {} (--max-context)", r.tokens, app.max_context)));
        }
        let inbox = w.inbox.as_ref().expect("a decode worker has an inbox");
        let ticket = inbox.reserve(&app.config, r.tokens).map_err(|e| {
            let code = if tandem_core::backend::cuda::qwen35::device_pool::PoolFull::is(&e) { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::INTERNAL_SERVER_ERROR };
            ApiError::new(code, "reserve_failed", format!("{e:#}"))
        })?;
        Ok(json_response(StatusCode::OK, ticket))
    })();
    result.unwrap_or_else(|e: ApiError| e.into_response())
}

/// `POST /internal/release {"slot": S}` (decode worker): free a slot whose state will not come.
pub async fn release(AppState(app): AppState<Arc<App>>, raw: Bytes) -> Response {
    let result = (|| {
        let w = worker_as(&app, Role::Decode)?;
        #[derive(Deserialize)]
        struct Release {
            slot: u64,
        }
        let r: Release = parse(&raw)?;
        let released = w.inbox.as_ref().expect("a decode worker has an inbox").release(r.slot);
        Ok(json_response(StatusCode::OK, json!({"released": released})))
    })();
    result.unwrap_or_else(|e: ApiError| e.into_response())
}

/// `POST /internal/state/SLOT` (decode worker taking states by stream): the state's image, as
/// the socket bridge sends it; checked before it is kept for the slot's request.
pub async fn state(AppState(app): AppState<Arc<App>>, axum::extract::Path(slot): axum::extract::Path<u64>, body: axum::body::Body) -> Response {
    let result = async {
        let w = worker_as(&app, Role::Decode)?;
        let inbox = w.inbox.as_ref().expect("a decode worker has an inbox");
        let limit = inbox.stream_limit(&app.config, slot).ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no slot {slot} waits for a streamed state here")))?;
        let image = axum::body::to_bytes(body, limit).await.map_err(|e| ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "state_too_large", format!("the state for slot {slot}: {e} (the slot holds {limit} bytes)")))?;
        tokio::task::block_in_place(|| inbox.deliver(slot, &image, app.fingerprint, &app.config)).map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "state_refused", format!("{e:#}")))?;
        Ok(json_response(StatusCode::OK, json!({"slot": slot, "bytes": image.len()})))
    };
    result.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// `POST /internal/prefill {"prompt": [ids], "ticket": {...}, "cache_salt": S?}` (prefill
/// worker): prefill the prompt (continuing this worker's prefix cache) and write the state
/// into the ticket's slot; answers once the write completed, with the tokens the cache
/// covered, those prefilled, and the times.
pub async fn prefill(AppState(app): AppState<Arc<App>>, raw: Bytes) -> Response {
    let result = async {
        worker_as(&app, Role::Prefill)?;
        #[derive(Deserialize)]
        struct Prefill {
            prompt: Vec<u32>,
            ticket: Value,
            cache_salt: Option<String>,
        }
        let p: Prefill = parse(&raw)?;
        if p.prompt.is_empty() || p.prompt.len() > app.max_context {
            return Err(ApiError::invalid("prompt", format!("{} tokens: give 1 to {} (--max-context)", p.prompt.len(), app.max_context)));
        }
        if let Some(&bad) = p.prompt.iter().find(|&&id| id as usize >= app.vocab) {
            return Err(ApiError::invalid("prompt", format!("token id {bad} is outside the vocabulary (ids 0..{})", app.vocab)));
        }
        let _slot = app.engines.admit().await.map_err(|full| {
            let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "queue_full", "the prefill worker is busy");
            e.retry_after = Some(full.retry_after);
            e
        })?;
        let engine_error = |e: anyhow::Error| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "engine_error", format!("{e:#}"));
        let transfer_failed = |e: anyhow::Error| ApiError::new(StatusCode::BAD_GATEWAY, "transfer_failed", format!("{e:#}"));
        let started = Instant::now();
        let (a, ticket) = (Arc::clone(&app), p.ticket);
        // The transfer's outcome is the closure's value, so that an engine error (500) and a
        // failed transfer (502: the router's to retry elsewhere) stay apart.
        let send = move |snapshot: &tandem_core::state::Snapshot| -> anyhow::Result<anyhow::Result<Sent>> {
            let outbox = a.worker.as_ref().and_then(|w| w.outbox.as_ref()).expect("a prefill worker has an outbox");
            Ok(outbox.send(&ticket, snapshot, a.fingerprint, SEND_TIMEOUT))
        };
        let (sent, cached, prefilled) = super::completion::prefill_then(&app, p.cache_salt, p.prompt, send).await.map_err(engine_error)?;
        let (times, bytes) = match sent.map_err(transfer_failed)? {
            Sent::Done { times, bytes } => (times, bytes),
            Sent::Post { url, path, image } => {
                let t = Instant::now();
                let bytes = image.len();
                let (status, answer) = crate::http_client::post_bytes(&url, &path, image, SEND_TIMEOUT).await.map_err(transfer_failed)?;
                if !status.is_success() {
                    return Err(transfer_failed(anyhow::anyhow!("{url}{path} refused the state ({status}): {}", String::from_utf8_lossy(&answer))));
                }
                (tandem_core::bridge::TransferTimes { read: t.elapsed(), ..Default::default() }, bytes)
            }
        };
        let prefill_ms = (started.elapsed().saturating_sub(times.total())).as_secs_f64() * 1e3;
        Ok(json_response(
            StatusCode::OK,
            json!({"cached": cached, "prefilled": prefilled, "prefill_ms": prefill_ms, "serialize_ms": times.serialize.as_secs_f64() * 1e3, "transfer_ms": times.read.as_secs_f64() * 1e3, "state_bytes": bytes}),
        ))
    };
    result.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// Register with the router at `router` as a worker of `role` reachable at `advertise`, and
/// renew it every second (with this worker's load) until the server stops.
pub fn register_with(app: &Arc<App>, router: String, advertise: String, role: Role) {
    let app = Arc::clone(app);
    tokio::spawn(async move {
        let mut registered = None;
        loop {
            let body = json!({"role": role.name(), "url": advertise, "active": app.engines.active(), "queued": app.engines.queued(), "max_concurrent": app.max_concurrent});
            let outcome = crate::http_client::post_json(&router, "/internal/register", &body, Duration::from_secs(2)).await;
            let ok = matches!(&outcome, Ok((s, _)) if s.is_success());
            if registered != Some(ok) {
                match &outcome {
                    _ if ok => eprintln!("tandem serve: registered with the router {router} as a {} worker at {advertise}", role.name()),
                    Ok((s, body)) => eprintln!("tandem serve: the router {router} refused the registration ({s}): {}", String::from_utf8_lossy(body)),
                    Err(e) => eprintln!("tandem serve: cannot reach the router {router} (retrying every second): {e:#}"),
                }
                registered = Some(ok);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
}
