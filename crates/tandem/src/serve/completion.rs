//! One request from prompt tokens to text: find the longest cached state the prompt starts
//! with, checkpoint the prompt's last turn boundary for the conversation's next request, run
//! the rest through the engines, and turn the sampled tokens into text deltas (stopping at a
//! stop string). The same `Completion` feeds a streamed and a whole response.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use tandem_core::pipeline::{self, Event, Finish};
use tandem_core::state::State;
use tandem_core::tokenizer::StreamDecoder;

use super::api::{ApiError, Endpoint, Options, Usage};
use super::cache::{Hit, Kind};
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
        Ok(Prepared { endpoint, prompt, max_tokens, options, arrived })
    }
}

/// What a generation yields, in order: text deltas, then one `Finished` or `Failed`.
pub enum Piece {
    Text(String),
    Finished { finish: &'static str, usage: Usage },
    Failed(ApiError),
}

pub struct Completion {
    app: Arc<App>,
    endpoint: Endpoint,
    running: Running,
    _slot: Slot,
    admitted: Instant,
    prompt: Vec<u32>,
    reused: usize,
    session: Option<String>,
    /// Tokens sampled so far.
    ids: Vec<u32>,
    decoder: StreamDecoder,
    stops: StopStrings,
    arrived: Instant,
    last_token: Option<Instant>,
    pending: VecDeque<Piece>,
    done: bool,
}

/// Where the prompt's last turn begins: the last `<|im_start|>` (the generation prompt's, in a
/// chat). A client re-renders everything before it the same way next turn.
fn turn_boundary(app: &App, prompt: &[u32]) -> Option<usize> {
    let im_start = app.im_start?;
    prompt.iter().rposition(|&t| t == im_start).filter(|&b| b > 0)
}

/// The cached state to start from (on a blocking thread: it copies a state).
pub async fn lookup(app: &Arc<App>, prompt: &[u32], session: Option<&str>) -> Option<Hit> {
    let (app, prompt, session) = (Arc::clone(app), prompt.to_vec(), session.map(str::to_string));
    tokio::task::spawn_blocking(move || app.cache.lock().expect("cache lock").lookup(&prompt, session.as_deref())).await.ok().flatten()
}

/// Keep a copy of `state` in the cache (on a blocking thread).
async fn checkpoint(app: &Arc<App>, tokens: Vec<u32>, state: &State, session: Option<String>, kind: Kind) {
    checkpoint_owned(app, tokens, state.clone(), session, kind).await
}

/// Keep `state` in the cache (on a blocking thread: eviction frees states).
pub async fn checkpoint_owned(app: &Arc<App>, tokens: Vec<u32>, state: State, session: Option<String>, kind: Kind) {
    let app = Arc::clone(app);
    let _ = tokio::task::spawn_blocking(move || app.cache.lock().expect("cache lock").insert(tokens, state, session, kind)).await;
}

fn server_error(e: anyhow::Error) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "engine_error", format!("{e:#}"))
}

impl Completion {
    /// Admit the request (or refuse it: 429), take what the cache has, and start it.
    pub async fn start(app: &Arc<App>, p: Prepared) -> Result<Completion, ApiError> {
        let slot = app.engines.admit().await.map_err(|full| {
            app.metrics.outcome(p.endpoint.name(), "refused");
            let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "queue_full", format!("the server is busy: {} requests are running and {} waiting (--max-concurrent, --max-queue); retry later", app.max_concurrent, app.max_queue));
            e.retry_after = Some(full.retry_after);
            e
        })?;
        let admitted = Instant::now();
        let session = p.options.session_id.clone();
        let caching = app.session_memory > 0;
        let hit = if caching { lookup(app, &p.prompt, session.as_deref()).await } else { None };
        let c = &app.metrics.counters;
        let (mut start, mut done) = match hit {
            Some(h) => {
                add(&c.session_hits, 1);
                (Some(h.state), h.reused)
            }
            None => {
                add(&c.session_misses, 1);
                (None, 0)
            }
        };
        let reused = done;
        add(&c.prompt_tokens, p.prompt.len());
        add(&c.reused_tokens, reused);
        add(&c.prefilled_tokens, p.prompt.len() - reused);
        // Prefill up to the turn boundary first and keep that state for the next turn.
        if let Some(b) = turn_boundary(app, &p.prompt).filter(|&b| caching && b > done) {
            let state = app.engines.prefill(start.take(), p.prompt[done..b].to_vec()).await.map_err(server_error)?;
            checkpoint(app, p.prompt[..b].to_vec(), &state, session.clone(), Kind::Checkpoint).await;
            start = Some(state);
            done = b;
        }
        let params = pipeline::RequestParams { max_tokens: p.max_tokens, sampling: p.options.sampling.clone(), vocab: app.vocab, stop_ids: if p.options.ignore_eos { Vec::new() } else { app.stop_ids.clone() } };
        let running = app.engines.submit(start, p.prompt[done..].to_vec(), params, caching).map_err(server_error)?;
        Ok(Completion {
            app: Arc::clone(app),
            endpoint: p.endpoint,
            running,
            _slot: slot,
            admitted,
            prompt: p.prompt,
            reused,
            session,
            ids: Vec::new(),
            decoder: StreamDecoder::new(),
            stops: StopStrings::new(p.options.stop),
            arrived: p.arrived,
            last_token: None,
            pending: VecDeque::new(),
            done: false,
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
            match self.running.events.recv().await {
                Some(Event::Token { token, .. }) => self.token(token),
                Some(Event::Done { finish, state, .. }) => self.finish(finish, state),
                Some(Event::Failed { error, .. }) => self.fail(anyhow::anyhow!(error)),
                None => self.fail(anyhow::anyhow!("the engines stopped before the request finished")),
            }
        }
    }

    fn token(&mut self, token: u32) {
        let now = Instant::now();
        let m = &self.app.metrics;
        match self.last_token {
            None => m.ttft(now - self.arrived),
            Some(last) => m.tpot(now - last),
        }
        self.last_token = Some(now);
        add(&m.counters.generation_tokens, 1);
        self.ids.push(token);
        let text = match self.decoder.push(&self.app.tokenizer, token) {
            Ok(t) => t,
            Err(e) => return self.fail(e),
        };
        let (out, stopped) = self.stops.push(&text);
        if !out.is_empty() {
            self.pending.push_back(Piece::Text(out));
        }
        if stopped {
            // The rest of the reply is not wanted: the engine drops the sequence.
            self.running.cancel();
            self.end("stop");
        }
    }

    fn finish(&mut self, finish: Finish, state: Option<State>) {
        let tail = match self.decoder.finish(&self.app.tokenizer) {
            Ok(t) => t,
            Err(e) => return self.fail(e),
        };
        let (mut out, stopped) = self.stops.push(&tail);
        if !stopped {
            out.push_str(&self.stops.flush());
        }
        if !out.is_empty() {
            self.pending.push_back(Piece::Text(out));
        }
        // The final state covers the prompt and the reply's tokens that were applied: all of a
        // stopped reply's (the stop token is not), all but the last of one that hit its length.
        if let Some(state) = state {
            let applied = match finish {
                Finish::Length => self.ids.len().saturating_sub(1),
                _ => self.ids.len(),
            };
            let mut tokens = self.prompt.clone();
            tokens.extend(&self.ids[..applied]);
            if state.position == tokens.len() {
                self.app.cache.lock().expect("cache lock").insert(tokens, state, self.session.clone(), Kind::Checkpoint);
            }
        }
        self.end(if stopped || finish == Finish::Stop { "stop" } else { "length" });
    }

    fn end(&mut self, finish: &'static str) {
        self.done = true;
        self.app.metrics.outcome(self.endpoint.name(), finish);
        let usage = Usage { prompt: self.prompt.len(), completion: self.ids.len(), cached: self.reused };
        self.pending.push_back(Piece::Finished { finish, usage });
    }

    fn fail(&mut self, e: anyhow::Error) {
        self.done = true;
        self.running.cancel();
        self.app.metrics.outcome(self.endpoint.name(), "error");
        self.pending.push_back(Piece::Failed(server_error(e)));
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
