//! One request from prompt tokens to text: continue the deepest state in the prefix cache that
//! the prompt passes, run the rest through the engines (their prefill sending back snapshots
//! for the cache where the prompt leaves what earlier requests applied, at its last turn
//! boundary, every so many tokens, at its end), and turn the sampled tokens into text deltas
//! (stopping at a stop string). The same `Completion` feeds a streamed and a whole response.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use tandem_core::chat::Message;
use tandem_core::pipeline::{self, Event, Finish};
use tandem_core::prefix_cache::{Pin, PrefixCache};
use tandem_core::pipeline::trace::Work;
use tandem_core::pipeline::Start;
use tandem_core::state::Snapshot;
use tandem_core::sampling::TokenLogprobs;
use tandem_core::tokenizer::StreamDecoder;

use super::api::{ApiError, Conversation, Endpoint, Logprob, Options, Usage};
use super::tool_calls::{Out, Tool, ToolCall, ToolCallReader};
use super::engines::{Running, Slot};
use super::metrics::add;
use super::App;

/// A request ready to run: its prompt tokens and how many tokens it may generate.
pub struct Prepared {
    pub endpoint: Endpoint,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub options: Options,
    pub arrived: Instant,
    /// A chat's conversation (to find the tokens its next turn starts with, and the tools it
    /// may call).
    pub conversation: Option<Conversation>,
    /// Where a prefill worker put the prompt's state (a decode worker's request from the
    /// router), to start from instead of prefilling.
    pub prefilled: Option<super::worker::Prefilled>,
}

impl Prepared {
    /// Check the prompt against `--max-context` and settle `max_tokens` (default: the rest of
    /// the context, as vLLM does).
    pub fn new(app: &App, endpoint: Endpoint, prompt: Vec<u32>, options: Options, arrived: Instant) -> Result<Prepared, ApiError> {
        let param = if endpoint == Endpoint::Chat { "messages" } else { "prompt" };
        if prompt.is_empty() {
            return Err(ApiError::invalid(param, "the prompt has no tokens"));
        }
        if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= app.vocab) {
            return Err(ApiError::invalid(param, format!("token id {bad} is outside the vocabulary (ids 0..{})", app.vocab)));
        }
        for (param, ids) in [("logit_bias", options.sampling.logit_bias.iter().map(|b| b.0).collect::<Vec<_>>()), ("stop_token_ids", options.stop_token_ids.clone())] {
            if let Some(bad) = ids.into_iter().find(|&id| id as usize >= app.vocab) {
                return Err(ApiError::invalid(param, format!("{param}: token id {bad} is outside the vocabulary (ids 0..{})", app.vocab)));
            }
        }
        let room = app.max_context.saturating_sub(prompt.len());
        let too_long = |asked: String| {
            let mut e = ApiError::invalid(param, format!("this model's context is {} tokens (--max-context); the prompt has {} tokens{asked}", app.max_context, prompt.len()));
            e.code = Some("context_length_exceeded");
            e
        };
        let max_tokens = match options.max_tokens {
            Some(n) if n > room => return Err(too_long(format!(" and {n} more were asked for"))),
            Some(n) => n,
            None if room == 0 => return Err(too_long(", which leaves no room to generate".into())),
            None => room,
        };
        Ok(Prepared { endpoint, prompt, max_tokens, options, arrived, conversation: None, prefilled: None })
    }
}

/// What a generation yields, in order: each choice's text deltas (with the ids, and where asked
/// the log-probabilities, of the tokens sampled since its previous piece) and its end (with the
/// ids not yet given), then one `Finished` once every choice has ended; or `Failed`.
pub enum Piece {
    Text { choice: usize, text: String, ids: Vec<u32>, logprobs: Vec<Logprob> },
    /// A tool call the choice made (its `index` among the choice's calls).
    Call { choice: usize, index: usize, call: ToolCall, ids: Vec<u32>, logprobs: Vec<Logprob> },
    Ended { choice: usize, finish: &'static str, ids: Vec<u32>, logprobs: Vec<Logprob> },
    Finished { usage: Usage },
    Failed(ApiError),
}

/// One choice of a request (OpenAI's `n`): its tokens, its text as sent, and its end.
struct Choice {
    /// Tokens sampled so far, and how many of them went out with a piece.
    ids: Vec<u32>,
    ids_given: usize,
    /// The log-probabilities of the tokens not yet given (where asked for).
    logprobs: Vec<Logprob>,
    /// Where the next token's text starts in the choice's text (characters).
    offset: usize,
    /// The text sent so far.
    text: String,
    decoder: StreamDecoder,
    stops: StopStrings,
    last_token: Option<Instant>,
    /// Reads the tool calls out of the text (a chat that offers tools); taken at the end.
    tools: Option<ToolCallReader>,
    calls: Vec<ToolCall>,
    finish: Option<&'static str>,
}

impl Choice {
    fn new(stops: Vec<String>, tools: Option<ToolCallReader>) -> Choice {
        Choice { ids: Vec::new(), ids_given: 0, logprobs: Vec::new(), offset: 0, text: String::new(), decoder: StreamDecoder::new(), stops: StopStrings::new(stops), last_token: None, tools, calls: Vec::new(), finish: None }
    }

    /// The choice as the assistant message a client sends back next turn.
    fn message(&self) -> Message {
        let mut m = Message::new("assistant", &self.text);
        if !self.calls.is_empty() {
            let calls = self.calls.iter().map(|c| {
                let arguments: serde_json::Value = serde_json::from_str(&c.arguments).unwrap_or_default();
                serde_json::json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}})
            });
            m.tool_calls = Some(calls.collect());
        }
        m
    }
}

pub struct Completion {
    app: Arc<App>,
    endpoint: Endpoint,
    running: Running,
    _slot: Slot,
    admitted: Instant,
    prompt: Vec<u32>,
    /// Prompt tokens a prefix cache held (here or on the prefill worker).
    cached: usize,
    salt: Option<String>,
    session: Option<String>,
    conversation: Option<Conversation>,
    choices: Vec<Choice>,
    /// Whether the request's first token came (for the time to it).
    answered: bool,
    arrived: Instant,
    pending: VecDeque<Piece>,
    done: bool,
    /// The snapshots of the prompt going into the cache (off the tokens' way, in order), done
    /// before the reply's end is answered.
    keeping: Option<tokio::task::JoinHandle<()>>,
    /// The server's end of the grace period after a stop (`App::ending`).
    ending: tokio::sync::watch::Receiver<bool>,
}

/// Where the prompt's last turn begins: the last `<|im_start|>` (the generation prompt's, in a
/// chat). A client re-renders everything before it the same way next turn.
fn turn_boundary(app: &App, prompt: &[u32]) -> Option<usize> {
    let im_start = app.im_start?;
    prompt.iter().rposition(|&t| t == im_start).filter(|&b| b > 0)
}

/// What the prefix cache has for a prompt.
pub struct Cached {
    /// The snapshot to continue (None: start fresh); the request's prefill engine copies it.
    pub state: Option<Start>,
    /// The prompt tokens it covers.
    pub reused: usize,
    /// Of those, the tokens a prefix cache held (reported as the usage's cached tokens; less
    /// than `reused` for a state a prefill worker computed).
    pub cached: usize,
    /// Where the prefill should stop for snapshots (counts of the prompt's tokens, past
    /// `reused`, the prompt's end last; none with the cache off).
    pub stops: Vec<usize>,
}

/// The deepest cached state `prompt` passes; `count`: a request's own lookup, counted in the
/// metrics. On a blocking thread: a snapshot of the disk tier is read back in the lookup (with
/// the cache's lock let go meanwhile).
pub async fn lookup(app: &Arc<App>, salt: Option<&str>, prompt: &[u32], count: bool) -> Cached {
    let none = || Cached { state: None, reused: 0, cached: 0, stops: Vec::new() };
    if !app.cache_on {
        return none();
    }
    let (app, prompt, salt) = (Arc::clone(app), prompt.to_vec(), salt.map(str::to_string));
    let found = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let found = PrefixCache::lookup_unlocked(&app.cache, salt.as_deref(), &prompt);
        if count {
            app.cache.lock().expect("cache lock").count(&found);
        }
        app.engines.trace(started, Work::Cache { snapshots: 0 });
        Cached { state: found.state.map(Start::Cached), reused: found.reused, cached: found.reused, stops: found.stops }
    });
    found.await.unwrap_or_else(|_| none())
}

/// Keep snapshots in the cache (on a blocking thread: eviction frees states), the last one
/// pinned as `session`'s `pin` where given; those the eviction moves off the GPU are copied
/// after (`settle`).
async fn keep(app: &Arc<App>, salt: Option<String>, tokens: Vec<u32>, states: Vec<Snapshot>, pin: Option<(String, Pin)>) {
    let cache_app = Arc::clone(app);
    let leaving = tokio::task::spawn_blocking(move || {
        let app = cache_app;
        let mut cache = app.cache.lock().expect("cache lock");
        let held = Instant::now();
        let (last, snapshots) = (states.len().saturating_sub(1), states.len());
        for (i, state) in states.into_iter().enumerate() {
            let n = state.position();
            let pin = pin.as_ref().filter(|_| i == last).map(|(s, p)| (s.as_str(), *p));
            cache.insert(salt.as_deref(), &tokens[..n], state, pin);
        }
        app.engines.trace(held, Work::Cache { snapshots });
        // Snapshots copied more slowly than they leave would hold ever more of the GPU: past the
        // tier's budget waiting, the request that made them copies too (copies side by side
        // wait for each other: one thread alone copies the most).
        let (behind, leaving) = (cache.leaving_bytes() > cache.device_budget(), cache.has_leaving());
        drop(cache);
        if behind {
            copy_leaving(&app);
        }
        leaving && !behind
    })
    .await;
    if leaving.unwrap_or(false) {
        settle(app);
    }
}

/// Copy the snapshots leaving the GPU to host memory on this thread, each copy traced.
fn copy_leaving(app: &App) {
    PrefixCache::settle(&app.cache, |started, tokens| app.engines.trace(started, Work::Demote { tokens }));
}

/// Copy the snapshots leaving the GPU to host memory (`PrefixCache::settle`) on a thread of
/// their own, one at a time (they share the engine's copy stream): nothing waits for them, as
/// prompts continue them on the GPU until they have moved.
fn settle(app: &Arc<App>) {
    if app.settling.swap(true, Ordering::AcqRel) {
        return;
    }
    let app = Arc::clone(app);
    tokio::task::spawn_blocking(move || loop {
        copy_leaving(&app);
        app.settling.store(false, Ordering::Release);
        // Snapshots that left after the last look, with no one else copying: go on.
        if !app.cache.lock().expect("cache lock").has_leaving() || app.settling.swap(true, Ordering::AcqRel) {
            break;
        }
    });
}

/// Make sure the cache holds the state after exactly `tokens`: prefill what the deepest
/// snapshot on their path lacks (stopping for snapshots where they leave the tree, and so on),
/// and pin it for `pin`'s session; but nothing where that snapshot covers fewer than `least`
/// tokens. Returns the tokens the cache covered and those prefilled.
pub async fn remember(app: &Arc<App>, salt: Option<String>, tokens: Vec<u32>, least: usize, pin: Option<(String, Pin)>) -> anyhow::Result<(usize, usize)> {
    let found = lookup(app, salt.as_deref(), &tokens, false).await;
    if found.reused < least {
        return Ok((found.reused, 0));
    }
    if found.reused == tokens.len() {
        if let Some((session, kind)) = &pin {
            app.cache.lock().expect("cache lock").pin_existing(salt.as_deref(), &tokens, session, *kind);
        }
        return Ok((found.reused, 0));
    }
    let stops: Vec<usize> = found.stops.iter().map(|&s| s - found.reused).collect();
    let states = app.engines.prefill(found.state, tokens[found.reused..].to_vec(), stops).await?;
    if states.last().map(Snapshot::position) != Some(tokens.len()) {
        anyhow::bail!("the prefill gave no snapshot of the prompt's end");
    }
    let prefilled = tokens.len() - found.reused;
    keep(app, salt, tokens, states, pin).await;
    Ok((found.reused, prefilled))
}

/// The state after exactly `tokens` (for a prefill worker to send), handed to `send` on a
/// blocking thread as the snapshot the engine took: the prefix cache's deepest snapshot on their
/// path continued with the rest (stopping for snapshots, kept in the cache once `send` is done,
/// as a request's prefill does). Returns what `send` returned, with the tokens the cache covered
/// and those prefilled.
pub async fn prefill_then<T: Send + 'static>(app: &Arc<App>, salt: Option<String>, tokens: Vec<u32>, send: impl FnOnce(&Snapshot) -> anyhow::Result<T> + Send + 'static) -> anyhow::Result<(T, usize, usize)> {
    let found = lookup(app, salt.as_deref(), &tokens, true).await;
    let reused = found.reused;
    let mut stops: Vec<usize> = found.stops.iter().map(|&s| s - reused).collect();
    if stops.last() != Some(&(tokens.len() - reused)) {
        stops.push(tokens.len() - reused);
    }
    let states = if reused == tokens.len() {
        match found.state {
            Some(Start::Cached(s)) => return Ok((tokio::task::spawn_blocking(move || send(&s)).await??, reused, 0)),
            _ => anyhow::bail!("the prefix cache covers the prompt but gave no state"),
        }
    } else {
        app.engines.prefill(found.state, tokens[reused..].to_vec(), stops).await?
    };
    if states.last().map(Snapshot::position) != Some(tokens.len()) {
        anyhow::bail!("the prefill gave no snapshot of the prompt's end");
    }
    let (sent, states) = tokio::task::spawn_blocking(move || (send(states.last().expect("checked above")), states)).await?;
    if app.cache_on {
        keep(app, salt, tokens.clone(), states, None).await;
    }
    Ok((sent?, reused, tokens.len() - reused))
}

/// The longest a session's request waits for its previous reply end's prefill.
const REPLY_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

fn server_error(e: anyhow::Error) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "engine_error", format!("{e:#}"))
}

impl Completion {
    /// Admit the request (or refuse it: 429), take what the cache has, and start it.
    pub async fn start(app: &Arc<App>, p: Prepared) -> Result<Completion, ApiError> {
        // A request whose client leaves while it waits for a slot is counted as cancelled.
        let waiting = Waiting { app, endpoint: p.endpoint };
        let mut ending = app.ending.clone();
        let admitted = tokio::select! {
            admitted = app.engines.admit() => Some(admitted),
            _ = ending.wait_for(|e| *e) => None,
        };
        std::mem::forget(waiting);
        // Past a stop's grace period nothing starts (a slot freed by a request ended then
        // would otherwise let one in).
        let Some(admitted) = admitted.filter(|_| !*app.ending.borrow()) else {
            app.metrics.outcome(p.endpoint.name(), "refused");
            return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", "the server is stopping; retry on another"));
        };
        let slot = admitted.map_err(|full| {
            app.metrics.outcome(p.endpoint.name(), "refused");
            let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "queue_full", format!("the server is busy: {} requests are running and {} waiting (--max-concurrent, --max-queue); retry later", app.max_concurrent, app.max_queue));
            e.retry_after = Some(full.retry_after);
            e
        })?;
        let admitted = Instant::now();
        let (session, salt) = (p.options.session_id.clone(), p.options.cache_salt.clone());
        // A session's previous reply end may still be on the prefill engine: its next turn
        // continues it rather than prefilling the same tokens beside it.
        let pending = session.as_ref().and_then(|s| app.replies.lock().expect("replies lock").get(s).cloned());
        if let Some(mut done) = pending {
            let _ = tokio::time::timeout(REPLY_WAIT, done.wait_for(|d| *d)).await;
        }
        // The state a prefill worker wrote for this request, or the prefix cache's deepest.
        let found = match &p.prefilled {
            Some(remote) => super::worker::take_prefilled(app, remote, &p.prompt).await?,
            None => lookup(app, salt.as_deref(), &p.prompt, true).await,
        };
        let c = &app.metrics.counters;
        let (reused, cached) = (found.reused, found.cached);
        add(&c.prompt_tokens, p.prompt.len());
        add(&c.prefilled_tokens, p.prompt.len() - reused);
        // Besides the cache's stops, one at the prompt's last turn boundary: the part of a chat
        // prompt that its next turn renders the same way.
        let mut stops = found.stops;
        if let Some(b) = turn_boundary(app, &p.prompt).filter(|&b| !stops.is_empty() && b > reused) {
            stops.push(b);
            stops.sort_unstable();
            stops.dedup();
        }
        let snapshots = stops.iter().map(|&s| s - reused).collect();
        let mut sampling = p.options.sampling.clone();
        if sampling.penalties.repetition != 1.0 {
            // The repetition penalty counts the whole prompt's tokens.
            sampling.penalties.prompt = p.prompt.as_slice().into();
        }
        let mut stop_ids = if p.options.ignore_eos { Vec::new() } else { app.stop_ids.clone() };
        stop_ids.extend(&p.options.stop_token_ids);
        let params = pipeline::RequestParams { max_tokens: p.max_tokens, sampling, vocab: app.vocab, stop_ids };
        let running = app.engines.submit(found.state, p.prompt[reused..].to_vec(), params, snapshots, p.options.n).map_err(server_error)?;
        Ok(Completion {
            app: Arc::clone(app),
            endpoint: p.endpoint,
            running,
            _slot: slot,
            admitted,
            prompt: p.prompt,
            cached,
            salt,
            session,
            choices: (0..p.options.n)
                .map(|_| {
                    let tools = p.conversation.as_ref().and_then(|c| c.tools.as_ref());
                    Choice::new(p.options.stop.clone(), tools.map(|t| ToolCallReader::new(Tool::list(t), format!("call_{}", app.request_id()))))
                })
                .collect(),
            conversation: p.conversation,
            answered: false,
            arrived: p.arrived,
            pending: VecDeque::new(),
            done: false,
            keeping: None,
            ending: app.ending.clone(),
        })
    }

    pub async fn next(&mut self) -> Option<Piece> {
        loop {
            if let Some(p) = self.pending.pop_front() {
                return Some(p);
            }
            if self.done {
                return None;
            }
            let (events, ending) = (&mut self.running.events, &mut self.ending);
            let next = tokio::select! {
                event = events.recv() => Some(event),
                _ = async { let _ = ending.wait_for(|e| *e).await; } => None,
            };
            let Some(event) = next else {
                // The server's stop: its grace period is over.
                self.running.cancel();
                for c in 0..self.choices.len() {
                    if self.choices[c].finish.is_none() {
                        self.end(c, "abort");
                    }
                }
                continue;
            };
            let Some(event) = event else {
                self.fail(anyhow::anyhow!("the engines stopped before the request finished"));
                continue;
            };
            // The events of a choice already ended (by a stop string) are let go.
            let Some(c) = self.running.choice_of(&event).filter(|&c| self.choices[c].finish.is_none()) else { continue };
            match event {
                Event::Snapshot { state, .. } => self.snapshot(state),
                Event::Token { token, logprobs, .. } => self.token(c, token, logprobs.map(|l| *l)),
                Event::Done { finish, .. } => {
                    // A request sent after this reply ends finds its prompt's snapshots.
                    if let Some(keeping) = self.keeping.take() {
                        let _ = keeping.await;
                    }
                    self.finish(c, finish)
                }
                Event::Failed { error, .. } => self.fail(anyhow::anyhow!(error)),
            }
        }
    }

    /// A snapshot of the prompt's prefill, for the cache; the prompt's end is pinned as the
    /// session's latest state. Kept by a task of its own (after the request's earlier ones):
    /// the first token does not wait for the cache's lock.
    fn snapshot(&mut self, state: Snapshot) {
        let n = state.position();
        if n > self.prompt.len() {
            return;
        }
        let pin = self.session.clone().filter(|_| n == self.prompt.len()).map(|s| (s, Pin::Latest));
        let (app, salt, tokens, before) = (Arc::clone(&self.app), self.salt.clone(), self.prompt[..n].to_vec(), self.keeping.take());
        self.keeping = Some(tokio::spawn(async move {
            if let Some(before) = before {
                let _ = before.await;
            }
            keep(&app, salt, tokens, vec![state], pin).await;
        }));
    }

    fn token(&mut self, c: usize, token: u32, logprobs: Option<TokenLogprobs>) {
        let now = Instant::now();
        let m = &self.app.metrics;
        let choice = &mut self.choices[c];
        match choice.last_token {
            None if !self.answered => m.ttft(now - self.arrived),
            None => {}
            Some(last) => m.tpot(now - last),
        }
        self.answered = true;
        choice.last_token = Some(now);
        add(&m.counters.generation_tokens, 1);
        choice.ids.push(token);
        if let Some(l) = logprobs {
            let entry = Logprob::of(&self.app.tokenizer, &l, choice.offset);
            choice.offset += entry.token.chars().count();
            choice.logprobs.push(entry);
        }
        let text = match choice.decoder.push(&self.app.tokenizer, token) {
            Ok(t) => t,
            Err(e) => return self.fail(e),
        };
        let (out, stopped) = choice.stops.push(&text);
        self.send_text(c, out);
        if stopped {
            // The rest of the choice is not wanted: the engine drops the sequence.
            self.running.cancel_choice(c);
            self.end(c, "stop");
        }
    }

    /// Queue `out` (where there is any) with the ids sampled since the choice's last piece,
    /// read for tool calls where the chat offers tools.
    fn send_text(&mut self, c: usize, out: String) {
        let outs = match &mut self.choices[c].tools {
            Some(reader) => reader.push(&out),
            None if out.is_empty() => Vec::new(),
            None => vec![Out::Text(out)],
        };
        self.give(c, outs);
    }

    /// Queue the text and calls of choice `c`, the first with the ids (and log-probabilities)
    /// sampled since its last piece.
    fn give(&mut self, c: usize, outs: Vec<Out>) {
        for o in outs {
            let choice = &mut self.choices[c];
            let ids = choice.ids[choice.ids_given..].to_vec();
            choice.ids_given = choice.ids.len();
            let logprobs = std::mem::take(&mut choice.logprobs);
            let piece = match o {
                Out::Text(text) => {
                    choice.text.push_str(&text);
                    Piece::Text { choice: c, text, ids, logprobs }
                }
                Out::Call(call) => {
                    choice.calls.push(call.clone());
                    Piece::Call { choice: c, index: choice.calls.len() - 1, call, ids, logprobs }
                }
            };
            self.pending.push_back(piece);
        }
    }

    fn finish(&mut self, c: usize, finish: Finish) {
        let choice = &mut self.choices[c];
        let tail = match choice.decoder.finish(&self.app.tokenizer) {
            Ok(t) => t,
            Err(e) => return self.fail(e),
        };
        let (mut out, stopped) = choice.stops.push(&tail);
        if !stopped {
            out.push_str(&choice.stops.flush());
        }
        self.send_text(c, out);
        self.end(c, if stopped || finish == Finish::Stop { "stop" } else { "length" });
    }

    /// In a session, the state its next turn starts from: the prompt and the reply as the next
    /// request will send them (a chat's history rendered again, which may differ from what
    /// the model saw: Qwen3.5's template drops an earlier reply's thinking block), prefilled
    /// in the background by the prefill engine and pinned for the session. The prefill gives
    /// the bits a cold prefill of those tokens gives (the decode engine's own state does not).
    fn remember_reply(&self) {
        let Some(session) = self.session.clone().filter(|_| self.app.cache_on) else { return };
        let (app, salt) = (Arc::clone(&self.app), self.salt.clone());
        // A chat's next turn starts as its template renders the history; a completion's, with
        // the prompt and the reply's ids.
        enum Lead {
            Ids(Vec<u32>),
            Chat(Box<(Conversation, Message)>),
        }
        let lead = match &self.conversation {
            Some(c) => Lead::Chat(Box::new((c.clone(), self.choices[0].message()))),
            None => Lead::Ids([&self.prompt[..], &self.choices[0].ids[..]].concat()),
        };
        // Where the cache no longer holds the prompt's snapshot (its last turn's start, for a
        // chat, which the history renders the same way; its end otherwise), evicted under a
        // tight budget, the next turn prefills the conversation once itself instead of waiting
        // here for the same prefill first.
        let least = match &self.conversation {
            Some(_) => turn_boundary(&self.app, &self.prompt).unwrap_or(0),
            None => self.prompt.len(),
        };
        // The session's next request waits for this prefill (see `start`): registered before
        // the client can see the reply end.
        let (done, waiting) = tokio::sync::watch::channel(false);
        app.replies.lock().expect("replies lock").insert(session.clone(), waiting.clone());
        tokio::spawn(async move {
            let made = async {
                let tokens = match lead {
                    Lead::Ids(ids) => ids,
                    Lead::Chat(chat) => {
                        let (a, (conversation, reply)) = (Arc::clone(&app), *chat);
                        tokio::task::spawn_blocking(move || a.next_turn_lead(&conversation, reply)).await.map_err(|e| anyhow::anyhow!("{e}"))?.map_err(|e| anyhow::anyhow!("{}", e.message))?
                    }
                };
                remember(&app, salt, tokens, least, Some((session.clone(), Pin::Latest))).await
            };
            match made.await {
                Ok((_, prefilled)) if prefilled > 0 => add(&app.metrics.counters.reply_prefills, 1),
                Ok(_) => {}
                Err(e) => eprintln!("tandem serve: prefilling a reply's end for its session: {e:#}"),
            }
            let _ = done.send(true);
            let mut replies = app.replies.lock().expect("replies lock");
            if replies.get(&session).is_some_and(|w| w.same_channel(&waiting)) {
                replies.remove(&session);
            }
        });
    }

    /// End choice `c`; once every choice has ended, the request.
    fn end(&mut self, c: usize, finish: &'static str) {
        // The text a tool-call reader still holds (a block never closed) goes out as text.
        if let Some(mut reader) = self.choices[c].tools.take() {
            let outs = reader.finish();
            self.give(c, outs);
        }
        let choice = &mut self.choices[c];
        // A reply that ends after its calls ends for them (OpenAI's "tool_calls").
        let finish = if finish == "stop" && !choice.calls.is_empty() { "tool_calls" } else { finish };
        choice.finish = Some(finish);
        let ids = choice.ids[choice.ids_given..].to_vec();
        choice.ids_given = choice.ids.len();
        let logprobs = std::mem::take(&mut choice.logprobs);
        self.pending.push_back(Piece::Ended { choice: c, finish, ids, logprobs });
        if self.choices.iter().all(|c| c.finish.is_some()) {
            self.done = true;
            // A session takes one choice (checked with the request).
            self.remember_reply();
            self.app.metrics.outcome(self.endpoint.name(), self.choices[0].finish.unwrap_or(finish));
            let usage = Usage { prompt: self.prompt.len(), completion: self.choices.iter().map(|c| c.ids.len()).sum(), cached: self.cached };
            self.pending.push_back(Piece::Finished { usage });
        }
    }

    fn fail(&mut self, e: anyhow::Error) {
        self.done = true;
        self.running.cancel();
        self.app.metrics.outcome(self.endpoint.name(), "error");
        self.pending.push_back(Piece::Failed(server_error(e)));
    }
}

/// A request waiting for a sequence slot; dropped there (its client gone), it is counted.
struct Waiting<'a> {
    app: &'a App,
    endpoint: Endpoint,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.app.metrics.outcome(self.endpoint.name(), "cancelled");
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if !self.done {
            // The client went away first; dropping `running` cancels the sequence.
            self.app.metrics.outcome(self.endpoint.name(), "cancelled");
        }
        self.app.engines.held(self.admitted.elapsed());
    }
}

/// Text held back while it could still be the start of a stop string.
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> StopStrings {
        StopStrings { stops, held: String::new() }
    }

    /// Add text; returns what can be sent and whether a stop string ended the reply (the stop
    /// string and what follows it are not sent).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest tail that a stop string starts with.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(|&n| s.is_char_boundary(n)).filter(|&n| self.held.ends_with(&s[..n])))
            .max()
            .unwrap_or(0);
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// The text held back, at the end of the reply.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// Seconds since the Unix epoch (the `created` field).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_cut_the_text_even_across_deltas() {
        let mut s = StopStrings::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(s.push("Hello E"), ("Hello ".to_string(), false));
        assert_eq!(s.push("N"), (String::new(), false));
        assert_eq!(s.push("Dless"), (String::new(), true));
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.push("EN"), (String::new(), false));
        assert_eq!(s.push("d"), ("ENd".to_string(), false));
        let mut s = StopStrings::new(vec!["xyz".into()]);
        assert_eq!(s.push("a x"), ("a ".to_string(), false));
        assert_eq!(s.flush(), "x");
        let mut none = StopStrings::new(Vec::new());
        assert_eq!(none.push("é"), ("é".to_string(), false));
    }
}
