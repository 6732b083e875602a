//! The HTTP endpoints. Each handler parses and checks its request, renders and tokenizes on a
//! blocking thread, and hands the tokens to a `Completion`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State as AppState;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use super::api::{self, ApiError, ChoiceOut, Endpoint, Options, Prompt, ResponseHead};
use super::completion::{remember, unix_now, Completion, Piece, Prepared};
use super::metrics::{add, CacheGauges, Gauges};
use super::{worker, App};
use tandem_core::grammar::Constraint;
use tandem_core::prefix_cache::Pin;
use tandem_core::state::Tier;

type Body = Result<Bytes, BytesRejection>;

fn json_response(v: Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// The request body, or the extractor's reason for refusing it (too large, unreadable).
fn body(body: Body) -> Result<Bytes, ApiError> {
    body.map_err(|e| ApiError { status: e.status(), message: e.body_text(), param: None, code: None, retry_after: None })
}

fn check_model(app: &App, asked: Option<&str>) -> Result<(), ApiError> {
    match asked {
        Some(m) if m != app.model_name => {
            let mut e = ApiError::new(StatusCode::NOT_FOUND, "model_not_found", format!("the model {m:?} does not exist here; this server serves {:?} (GET /v1/models)", app.model_name));
            e.param = Some("model".into());
            Err(e)
        }
        _ => Ok(()),
    }
}

/// Run `f` on a blocking thread (rendering and tokenizing are CPU work).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", format!("tokenizing: {e}"))))
}

pub async fn chat_completions(AppState(app): AppState<Arc<App>>, raw: Body) -> Response {
    let arrived = Instant::now();
    let result = async {
        let raw = body(raw)?;
        let mut prepared = prepare(&app, Endpoint::Chat, &raw, arrived).await?;
        prepared.prefilled = worker::prefilled_elsewhere(&app, &raw)?;
        serve(&app, prepared).await
    };
    result.await.unwrap_or_else(|e| refuse(&app, Endpoint::Chat, e))
}

pub async fn completions(AppState(app): AppState<Arc<App>>, raw: Body) -> Response {
    let arrived = Instant::now();
    let result = async {
        let raw = body(raw)?;
        let mut prepared = prepare(&app, Endpoint::Completion, &raw, arrived).await?;
        prepared.prefilled = worker::prefilled_elsewhere(&app, &raw)?;
        serve(&app, prepared).await
    };
    result.await.unwrap_or_else(|e| refuse(&app, Endpoint::Completion, e))
}

/// A chat or completion request read, checked and tokenized (the chat rendered with the
/// checkpoint's template), ready to run.
pub async fn prepare(app: &Arc<App>, endpoint: Endpoint, raw: &[u8], arrived: Instant) -> Result<Prepared, ApiError> {
    match endpoint {
        Endpoint::Chat => {
            let req = api::parse_chat(raw)?;
            check_model(app, req.options.model.as_deref())?;
            let a = Arc::clone(app);
            let (prompt, mut req) = blocking(move || a.chat_prompt(&req.conversation).map(|p| (p, req))).await?;
            req.options.sampling.constraint = constraint(app, &req.options).await?;
            let mut prepared = Prepared::new(app, Endpoint::Chat, prompt, req.options, arrived)?;
            prepared.conversation = Some(req.conversation);
            Ok(prepared)
        }
        Endpoint::Completion => {
            let mut req = api::parse_completion(raw)?;
            check_model(app, req.options.model.as_deref())?;
            req.options.sampling.constraint = constraint(app, &req.options).await?;
            let prompt = match req.prompt {
                Prompt::Ids(ids) => ids,
                Prompt::Text(text) => {
                    let a = Arc::clone(app);
                    blocking(move || a.tokenizer.encode(&text).map_err(|e| ApiError::invalid("prompt", format!("{e:#}")))).await?
                }
            };
            Prepared::new(app, Endpoint::Completion, prompt, req.options, arrived)
        }
    }
}

/// The request's grammar compiled (on a blocking thread: a schema can take milliseconds),
/// where it has one.
async fn constraint(app: &Arc<App>, options: &Options) -> Result<Option<Constraint>, ApiError> {
    let Some(format) = options.format.clone() else { return Ok(None) };
    let a = Arc::clone(app);
    blocking(move || a.constraint(&format).map(Some)).await
}

/// Count a refused request (a 429 was counted when it was refused) and answer it.
fn refuse(app: &App, endpoint: Endpoint, e: ApiError) -> Response {
    if e.status != StatusCode::TOO_MANY_REQUESTS {
        app.metrics.outcome(endpoint.name(), if e.status.is_client_error() { "invalid" } else { "error" });
    }
    e.into_response()
}

async fn serve(app: &Arc<App>, p: Prepared) -> Result<Response, ApiError> {
    let id = format!("{}-{}", if p.endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" }, app.request_id());
    let head = ResponseHead { endpoint: p.endpoint, token_ids: p.options.return_token_ids, logprobs: p.options.sampling.logprobs.is_some(), id, created: unix_now(), model: app.model_name.clone() };
    let Options { stream, include_usage, n, .. } = p.options;
    let mut generation = Completion::start(app, p).await?;
    if stream {
        return Ok(stream_response(head, generation, n, include_usage));
    }
    // Dropped with the handler when the client goes away: that cancels the request.
    let mut choices: Vec<ChoiceOut> = (0..n).map(|_| ChoiceOut { text: String::new(), ids: Vec::new(), logprobs: Vec::new(), calls: Vec::new(), finish: "" }).collect();
    while let Some(piece) = generation.next().await {
        match piece {
            Piece::Text { choice, text, ids, logprobs } => {
                let c = &mut choices[choice];
                c.text.push_str(&text);
                c.ids.extend(ids);
                c.logprobs.extend(logprobs);
            }
            Piece::Call { choice, call, ids, logprobs, .. } => {
                let c = &mut choices[choice];
                c.calls.push(call);
                c.ids.extend(ids);
                c.logprobs.extend(logprobs);
            }
            Piece::Ended { choice, finish, ids, logprobs } => {
                let c = &mut choices[choice];
                c.ids.extend(ids);
                c.logprobs.extend(logprobs);
                c.finish = finish;
            }
            Piece::Finished { usage } => return Ok(json_response(head.complete(&choices, &usage))),
            Piece::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", "the generation ended without finishing"))
}

/// Server-sent events: a chunk per text delta of each choice (a chat choice's first carries
/// the role), a chunk with each choice's finish reason, the usage chunk when asked for, then
/// `data: [DONE]`.
fn stream_response(head: ResponseHead, generation: Completion, n: usize, include_usage: bool) -> Response {
    let data = |v: Value| SseEvent::default().data(v.to_string());
    let head = Arc::new(head);
    let opening = match head.endpoint {
        Endpoint::Chat => (0..n).map(|i| data(head.chunk(i, "", &[], &[], true, None))).collect(),
        Endpoint::Completion => Vec::new(),
    };
    let events = stream::unfold(Some(generation), move |generation| {
        let head = Arc::clone(&head);
        async move {
            let mut g = generation?;
            let events = match g.next().await? {
                Piece::Text { choice, text, ids, logprobs } => vec![data(head.chunk(choice, &text, &ids, &logprobs, false, None))],
                Piece::Call { choice, index, call, ids, logprobs } => vec![data(head.call_chunk(choice, index, &call, &ids, &logprobs))],
                Piece::Ended { choice, finish, ids, logprobs } => vec![data(head.chunk(choice, "", &ids, &logprobs, false, Some(finish)))],
                Piece::Finished { usage } => {
                    let mut v = Vec::new();
                    if include_usage {
                        v.push(data(head.usage_chunk(&usage)));
                    }
                    v.push(SseEvent::default().data("[DONE]"));
                    v
                }
                Piece::Failed(e) => vec![data(e.body()), SseEvent::default().data("[DONE]")],
            };
            Some((stream::iter(events), Some(g)))
        }
    });
    let all = stream::iter(opening).chain(events.flatten()).map(Ok::<_, Infallible>);
    Sse::new(all).keep_alive(KeepAlive::new().interval(Duration::from_secs(5))).into_response()
}

/// `POST /v1/chat/typing` (tandem's extension): the conversation with the message being typed
/// as its last one. Prefills what can no longer change of the typed text (all but its last
/// tokens) and the whole prompt that sending the text as it stands would make, both kept for
/// the session; a chat request that then sends it finds its prompt already prefilled.
pub async fn typing(AppState(app): AppState<Arc<App>>, raw: Body) -> Response {
    let result = async {
        let req = api::parse_typing(&body(raw)?)?;
        check_model(&app, req.model.as_deref())?;
        let a = Arc::clone(&app);
        let (stable, full) = blocking(move || a.typing_prompts(&req.conversation)).await?;
        // As the chat endpoint says it (400): what is typed ahead must leave room to answer.
        if full.len() >= app.max_context {
            let mut e = ApiError::invalid("messages", format!("this model's context is {} tokens (--max-context); the conversation typed so far has {} tokens, which leaves no room to generate", app.max_context, full.len()));
            e.code = Some("context_length_exceeded");
            return Err(e);
        }
        let _slot = app.engines.admit().await.map_err(|full| {
            let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "queue_full", "the server is busy; typing ahead can wait");
            e.retry_after = Some(full.retry_after);
            e
        })?;
        add(&app.metrics.counters.typing_requests, 1);
        let mut prefilled = 0;
        let mut cached = 0;
        for (tokens, pin) in [(stable, Pin::Typed), (full, Pin::Speculative)] {
            let (have, applied) = remember(&app, req.cache_salt.clone(), tokens, 0, Some((req.session_id.clone(), pin))).await.map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "engine_error", format!("{e:#}")))?;
            if pin == Pin::Typed {
                cached = have;
            }
            prefilled += applied;
        }
        Ok(json_response(json!({"object": "chat.typing", "session_id": req.session_id, "cached_tokens": cached, "prefilled_tokens": prefilled})))
    };
    result.await.unwrap_or_else(|e: ApiError| e.into_response())
}

pub async fn models(AppState(app): AppState<Arc<App>>) -> Response {
    json_response(json!({"object": "list", "data": [{"id": app.model_name, "object": "model", "created": app.started, "owned_by": "tandem", "max_model_len": app.max_context}]}))
}

pub async fn health() -> Response {
    json_response(json!({"status": "ok"}))
}

pub async fn metrics(AppState(app): AppState<Arc<App>>) -> Response {
    let cache = {
        let c = app.cache.lock().expect("cache lock");
        let tiers = [Tier::Device, Tier::Host, Tier::Disk];
        CacheGauges { bytes: tiers.map(|t| c.bytes(t)), snapshots: tiers.map(|t| c.snapshots(t)), sessions: c.sessions(), stats: c.stats() }
    };
    let (prefill_busy, decode_busy) = app.engines.busy();
    let g = Gauges { kv: app.engines.kv_level(), slots: app.engines.slot_level(), swaps: app.engines.swaps(), queued: app.engines.queued(), active: app.engines.active(), cache, prefill_busy, decode_busy };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.metrics.render(&g) + &worker::metrics(&app)).into_response()
}

pub async fn not_found() -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint: see POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics").into_response()
}

pub async fn method_not_allowed() -> Response {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this endpoint does not take that method (completions and typing are POST; models, health and metrics GET)").into_response()
}
