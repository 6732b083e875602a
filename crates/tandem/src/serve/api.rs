//! The OpenAI wire format: request bodies read field by field (so that an error names the
//! field and what was wrong with it), the error object, and the response and chunk objects.
//! Fields tandem does not know are ignored, as OpenAI-compatible servers do, so that clients
//! sending extra options (`user`, `metadata`, ...) keep working; a known field of the wrong type
//! or out of range is a 400, and so is an option that would change what is generated and that
//! tandem does not do (at any value but the one that changes nothing).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use tandem_core::chat::Message;
use tandem_core::sampling::{Penalties, SamplingParams, TokenLogprobs, MAX_TOP_LOGPROBS};
use tandem_core::tokenizer::Tokenizer;

use super::tool_calls::ToolCall;

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}` with its status.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds, for a 429.
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), param: Some(param.into()), code: None, retry_after: None }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), param: None, code: None, retry_after: None }
    }

    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), param: None, code: Some(code), retry_after: None }
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, [(header::CONTENT_TYPE, "application/json")], self.body().to_string()).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

/// The most choices one request may ask for (`n`; OpenAI's limit).
pub const MAX_CHOICES: i64 = 128;

/// What both endpoints share.
#[derive(Clone, Debug)]
pub struct Options {
    /// The model asked for (None: the served one).
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// vLLM's extension: token ids that end a choice as the model's end-of-turn does (also
    /// with `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Choices to generate from the one prompt.
    pub n: usize,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage.
    pub include_usage: bool,
    /// tandem's extension: the conversation's latest states are pinned in the prefix cache
    /// while the session is live, and each reply's end is prefilled for its next turn.
    pub session_id: Option<String>,
    /// vLLM's extension: the prompt matches only cached states made under the same salt (to
    /// keep users' prefixes apart).
    pub cache_salt: Option<String>,
    /// vLLM's extension: each choice (each streamed delta) also carries the ids of its tokens
    /// (`token_ids`), so that a client can send them back exactly in its next prompt.
    pub return_token_ids: bool,
    /// vLLM's extension: generate `max_tokens` even past the model's end-of-turn tokens (what
    /// load generators send, so that every request has the asked-for length).
    pub ignore_eos: bool,
    /// The grammar the reply must follow (`response_format`, or `tool_choice` required or
    /// named), compiled into `sampling.constraint` before the request runs.
    pub format: Option<Format>,
}

/// What a reply's grammar is made from.
#[derive(Clone, Debug, PartialEq)]
pub enum Format {
    /// `response_format: {"type": "json_object"}`: any JSON object.
    JsonObject,
    /// `response_format: {"type": "json_schema", "json_schema": {"schema": ...}}`.
    JsonSchema(Value),
    /// `tool_choice: "required"` (`only` None: one call or more of the `tools`) or a named
    /// function (exactly one call of it).
    ToolCalls { tools: Value, only: Option<String> },
}

impl Format {
    /// The request field the grammar came from (what an error names).
    pub fn param(&self) -> &'static str {
        match self {
            Format::ToolCalls { .. } => "tool_choice",
            _ => "response_format",
        }
    }
}

/// What a chat prompt is rendered from.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    pub messages: Vec<Message>,
    /// The functions the model may call (OpenAI's `tools` as given), rendered into the prompt;
    /// None without tools or with `tool_choice: "none"`.
    pub tools: Option<Value>,
    /// `chat_template_kwargs.enable_thinking` (default off, as `tandem chat`).
    pub enable_thinking: bool,
}

pub struct ChatRequest {
    pub options: Options,
    pub conversation: Conversation,
}

pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

pub struct CompletionRequest {
    pub options: Options,
    pub prompt: Prompt,
}

/// The body as a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::bad_request(format!("the request body must be a JSON object, not {}", type_name(&other)))),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Typed, optional fields of a request object; null counts as absent.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn wrong(key: &str, want: &str, v: &Value) -> ApiError {
        ApiError::invalid(key, format!("{key} must be {want}, not {} ({v})", type_name(v)))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        self.get(key).map(|v| v.as_bool().ok_or_else(|| Self::wrong(key, "a boolean", v))).transpose()
    }

    fn str(&self, key: &str) -> Result<Option<&str>, ApiError> {
        self.get(key).map(|v| v.as_str().ok_or_else(|| Self::wrong(key, "a string", v))).transpose()
    }

    fn f64(&self, key: &str) -> Result<Option<f64>, ApiError> {
        self.get(key).map(|v| v.as_f64().ok_or_else(|| Self::wrong(key, "a number", v))).transpose()
    }

    fn i64(&self, key: &str) -> Result<Option<i64>, ApiError> {
        self.get(key).map(|v| v.as_i64().ok_or_else(|| Self::wrong(key, "an integer", v))).transpose()
    }

    fn object(&self, key: &str) -> Result<Option<Fields<'_>>, ApiError> {
        self.get(key).map(|v| v.as_object().map(Fields).ok_or_else(|| Self::wrong(key, "an object", v))).transpose()
    }

    /// A number that must lie in `[lo, hi]`.
    fn in_range(&self, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        match self.f64(key)? {
            Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::invalid(key, format!("{key} = {x} is out of range: it must be between {lo} and {hi}"))),
            x => Ok(x),
        }
    }

    /// Accepted only at the value that changes nothing (tandem does not implement it).
    fn only(&self, key: &str, neutral: &Value) -> Result<(), ApiError> {
        // Numbers by value: 0 and 0.0 are the same penalty.
        let same = |v: &Value| match (v.as_f64(), neutral.as_f64()) {
            (Some(a), Some(b)) => a == b,
            _ => v == neutral,
        };
        match self.get(key) {
            Some(v) if !same(v) => Err(ApiError::invalid(key, format!("{key} = {v} is not supported by tandem (only {neutral})"))),
            _ => Ok(()),
        }
    }
}

fn options(f: &Fields, max_tokens_keys: &[&str]) -> Result<Options, ApiError> {
    let mut max_tokens = None;
    for key in max_tokens_keys {
        if let Some(n) = f.i64(key)? {
            if n < 1 {
                return Err(ApiError::invalid(key, format!("{key} = {n} is out of range: at least 1 token must be generated")));
            }
            max_tokens = Some(n as usize);
        }
    }
    let top_k = match f.i64("top_k")? {
        // -1 (vLLM) and 0 both mean no limit.
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => return Err(ApiError::invalid("top_k", format!("top_k = {k} is out of range: give a positive number, or -1 or 0 for all tokens"))),
    };
    let top_p = f.in_range("top_p", 0.0, 1.0)?.unwrap_or(1.0);
    if top_p == 0.0 {
        return Err(ApiError::invalid("top_p", "top_p = 0 keeps no token: give a value in (0, 1]"));
    }
    let seed = match f.get("seed") {
        // Without a seed each request samples differently, as OpenAI's do.
        None => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
        Some(v) => v.as_u64().or_else(|| v.as_i64().map(|s| s as u64)).ok_or_else(|| Fields::wrong("seed", "an integer", v))?,
    };
    let logit_bias = match f.object("logit_bias")? {
        None => Vec::new(),
        Some(o) => {
            let mut bias = Vec::with_capacity(o.0.len());
            for (key, v) in o.0 {
                let id = key.parse::<u32>().map_err(|_| ApiError::invalid("logit_bias", format!("logit_bias: {key:?} is not a token id (the keys are token ids, as strings)")))?;
                let b = v.as_f64().ok_or_else(|| Fields::wrong(&format!("logit_bias[{key:?}]"), "a number", v))?;
                bias.push((id, b as f32));
            }
            bias.sort_unstable_by_key(|&(id, _)| id);
            bias
        }
    };
    let penalties = Penalties {
        presence: f.in_range("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        frequency: f.in_range("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        repetition: f.in_range("repetition_penalty", 0.0, 2.0)?.unwrap_or(1.0) as f32,
        // The prompt's tokens are set once it is tokenized.
        prompt: Default::default(),
    };
    let sampling = SamplingParams {
        temperature: f.in_range("temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32,
        top_k,
        top_p: top_p as f32,
        min_p: f.in_range("min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
        seed,
        logit_bias,
        penalties,
        // Each endpoint reads its own form of the option.
        logprobs: None,
        // Compiled from `format` once the request is checked.
        constraint: None,
    };
    sampling.validate().map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a.iter().map(|s| s.as_str().map(str::to_string).ok_or_else(|| Fields::wrong("stop", "a string or an array of strings", s))).collect::<Result<_, _>>()?,
        Some(v) => return Err(Fields::wrong("stop", "a string or an array of strings", v)),
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop takes up to 4 non-empty strings"));
    }
    let stop_token_ids = match f.get("stop_token_ids") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| ApiError::invalid("stop_token_ids", format!("stop_token_ids: {x} is not a token id")))).collect::<Result<_, _>>()?,
        Some(v) => return Err(Fields::wrong("stop_token_ids", "an array of token ids", v)),
    };
    let n = match f.i64("n")?.unwrap_or(1) {
        n @ 1..=MAX_CHOICES => n as usize,
        n => return Err(ApiError::invalid("n", format!("n = {n} is out of range: between 1 and {MAX_CHOICES} choices"))),
    };
    f.only("echo", &json!(false))?;
    f.only("best_of", &json!(1))?;
    let format = match f.object("response_format")? {
        None => None,
        Some(r) => match r.str("type")? {
            Some("text") => None,
            Some("json_object") => Some(Format::JsonObject),
            Some("json_schema") => match r.object("json_schema")?.and_then(|j| j.0.get("schema").cloned()) {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => Some(Format::JsonSchema(schema)),
                _ => return Err(ApiError::invalid("response_format", "response_format json_schema needs json_schema.schema, a JSON schema object")),
            },
            other => return Err(ApiError::invalid("response_format", format!("response_format.type {} is not supported: text, json_object or json_schema", other.map_or("(none)".into(), |t| format!("{t:?}"))))),
        },
    };
    // Options that would change what is generated: refused until tandem does them, never
    // accepted and ignored.
    for key in ["functions", "function_call", "prediction", "audio"] {
        f.only(key, &Value::Null)?;
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(o) => o.bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    let cache_salt = f.str("cache_salt")?.map(str::to_string);
    if cache_salt.as_deref() == Some("") {
        return Err(ApiError::invalid("cache_salt", "cache_salt must not be empty"));
    }
    let return_token_ids = f.bool("return_token_ids")?.unwrap_or(false);
    let session_id = f.str("session_id")?.map(str::to_string);
    if session_id.is_some() && n > 1 {
        return Err(ApiError::invalid("n", format!("n = {n} with a session_id: a session goes on from one reply, so it takes one choice")));
    }
    Ok(Options { model: f.str("model")?.map(str::to_string), max_tokens, sampling, stop, stop_token_ids, n, stream, include_usage, session_id, cache_salt, return_token_ids, ignore_eos, format })
}

/// The text of a message's `content`: a string, or an array of `{"type": "text", "text"}` parts.
fn content_text(i: usize, v: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some("text"), None) => return Err(ApiError::invalid(&param, format!("{param}[{j}]: a text part needs its text as a string"))),
                    (Some(kind), _) => return Err(ApiError::invalid(&param, format!("{param}[{j}]: only text parts are supported (this one's type is \"{kind}\")"))),
                    (None, _) => return Err(ApiError::invalid(&param, format!("{param}[{j}]: only text parts are supported (this one has no type)"))),
                }
            }
            Ok(text)
        }
        Some(other) => Err(ApiError::invalid(&param, format!("{param} must be a string or an array of text parts, not {}", type_name(other)))),
    }
}

/// An assistant message's `tool_calls` as the chat templates read them: each call's
/// `arguments` (JSON text on the wire) as the object it encodes.
fn tool_calls(i: usize, calls: &Value) -> Result<Value, ApiError> {
    let param = format!("messages[{i}].tool_calls");
    let Some(list) = calls.as_array() else { return Err(Fields::wrong(&param, "an array of tool calls", calls)) };
    let mut out = Vec::with_capacity(list.len());
    for (j, call) in list.iter().enumerate() {
        let at = format!("{param}[{j}]");
        let name = call.pointer("/function/name").and_then(Value::as_str).filter(|n| !n.is_empty());
        let Some(name) = name else { return Err(ApiError::invalid(&param, format!("{at}.function.name is required (a string)"))) };
        let arguments = match call.pointer("/function/arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
                Ok(v @ Value::Object(_)) => v,
                _ => return Err(ApiError::invalid(&param, format!("{at}.function.arguments must be a JSON object encoded as a string, not {text:?}"))),
            },
            Some(v @ Value::Object(_)) => v.clone(),
            Some(v) => return Err(Fields::wrong(&format!("{at}.function.arguments"), "a JSON object encoded as a string", v)),
        };
        out.push(json!({"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}}));
    }
    Ok(Value::Array(out))
}

pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let map = parse_object(body)?;
    let f = Fields(&map);
    let mut options = options(&f, &["max_tokens", "max_completion_tokens"])?;
    // Chat: `logprobs` switches them on, `top_logprobs` (which needs it) asks for the likeliest.
    let top = f.i64("top_logprobs")?;
    options.sampling.logprobs = match (f.bool("logprobs")?.unwrap_or(false), top) {
        (_, Some(k)) if !(0..=MAX_TOP_LOGPROBS as i64).contains(&k) => return Err(ApiError::invalid("top_logprobs", format!("top_logprobs = {k} is out of range: between 0 and {MAX_TOP_LOGPROBS}"))),
        (false, Some(k)) if k > 0 => return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs: true")),
        (false, _) => None,
        (true, k) => Some(k.unwrap_or(0) as usize),
    };
    let tools = match f.get("tools") {
        None => None,
        Some(Value::Array(list)) => {
            for (i, t) in list.iter().enumerate() {
                let param = format!("tools[{i}]");
                match t.get("type").and_then(Value::as_str) {
                    None | Some("function") => {}
                    Some(other) => return Err(ApiError::invalid(&param, format!("{param}.type {other:?} is not supported: only functions"))),
                }
                let name = t.pointer("/function/name").and_then(Value::as_str).unwrap_or_default();
                if name.is_empty() || name.contains(['<', '>', '\n']) {
                    return Err(ApiError::invalid(&param, format!("{param}.function.name must be a non-empty string without '<', '>' or newlines")));
                }
                if t.pointer("/function/parameters").is_some_and(|p| !p.is_object() && !p.is_null()) {
                    return Err(ApiError::invalid(&param, format!("{param}.function.parameters must be a JSON schema object")));
                }
            }
            (!list.is_empty()).then(|| Value::Array(list.clone()))
        }
        Some(v) => return Err(Fields::wrong("tools", "an array of functions", v)),
    };
    // "required" and a named function constrain the reply to calls (after any other format
    // the request asked for: both at once is refused).
    let only = match f.get("tool_choice") {
        None => None,
        Some(Value::String(c)) if c == "none" || c == "auto" || c == "required" => Some(c.clone()),
        Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(name) if v.get("type").is_none_or(|t| t == "function") => Some(format!("function:{name}")),
            _ => return Err(ApiError::invalid("tool_choice", format!("tool_choice = {v}: give \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"))),
        },
    };
    let tools = match only.as_deref() {
        Some("none") => None,
        None | Some("auto") => tools,
        Some(choice) => {
            let Some(list) = tools else { return Err(ApiError::invalid("tool_choice", format!("tool_choice {choice:?} needs tools"))) };
            let name = choice.strip_prefix("function:");
            if let Some(name) = name.filter(|n| !list.as_array().is_some_and(|a| a.iter().any(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(n)))) {
                return Err(ApiError::invalid("tool_choice", format!("tool_choice names {name:?}, which is not among the tools")));
            }
            if options.format.is_some() {
                return Err(ApiError::invalid("tool_choice", "tool_choice required or named together with a response_format: give one of them"));
            }
            options.format = Some(Format::ToolCalls { tools: list.clone(), only: name.map(str::to_string) });
            Some(list)
        }
    };
    let raw = match f.get("messages") {
        None => return Err(ApiError::invalid("messages", "messages is required")),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(Fields::wrong("messages", "an array of messages", v)),
    };
    if raw.is_empty() {
        return Err(ApiError::invalid("messages", "messages is empty: give at least one message"));
    }
    let mut messages = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(ApiError::invalid(&format!("messages[{i}]"), format!("messages[{i}] must be an object with role and content, not {}", type_name(m))));
        };
        let role = match obj.get("role") {
            Some(Value::String(r)) if ["system", "user", "assistant", "developer", "tool"].contains(&r.as_str()) => r.clone(),
            Some(Value::String(r)) => return Err(ApiError::invalid(&format!("messages[{i}].role"), format!("messages[{i}].role {r:?} is not supported: system, user, assistant, developer or tool"))),
            other => return Err(ApiError::invalid(&format!("messages[{i}].role"), format!("messages[{i}].role is required and must be a string (got {})", other.map_or("nothing", type_name)))),
        };
        // The Qwen3.5 template knows system, user and assistant; OpenAI's "developer" is the system.
        let role = if role == "developer" { "system".to_string() } else { role };
        let mut message = Message::new(&role, &content_text(i, obj.get("content"))?);
        if let Some(r) = obj.get("reasoning_content").and_then(Value::as_str) {
            message.reasoning_content = Some(r.to_string());
        }
        match (role.as_str(), obj.get("tool_calls").filter(|v| !v.is_null())) {
            ("assistant", Some(calls)) => message.tool_calls = Some(tool_calls(i, calls)?),
            (_, Some(_)) => return Err(ApiError::invalid(&format!("messages[{i}].tool_calls"), format!("messages[{i}]: only an assistant message makes tool calls"))),
            _ => {}
        }
        if role == "tool" {
            match obj.get("tool_call_id") {
                Some(Value::String(id)) => message.tool_call_id = Some(id.clone()),
                _ => return Err(ApiError::invalid(&format!("messages[{i}].tool_call_id"), format!("messages[{i}]: a tool message needs the tool_call_id (a string) of the call it answers"))),
            }
        }
        messages.push(message);
    }
    let enable_thinking = match f.object("chat_template_kwargs")? {
        Some(k) => k.bool("enable_thinking")?.unwrap_or(false),
        None => false,
    };
    Ok(ChatRequest { options, conversation: Conversation { messages, tools, enable_thinking } })
}

pub fn parse_completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let map = parse_object(body)?;
    let f = Fields(&map);
    let mut options = options(&f, &["max_tokens"])?;
    // Completions: `logprobs` is how many of the likeliest to report besides the chosen token.
    options.sampling.logprobs = match f.i64("logprobs")? {
        None => None,
        Some(k) if (0..=MAX_TOP_LOGPROBS as i64).contains(&k) => Some(k as usize),
        Some(k) => return Err(ApiError::invalid("logprobs", format!("logprobs = {k} is out of range: between 0 and {MAX_TOP_LOGPROBS}"))),
    };
    f.only("suffix", &Value::Null)?;
    let prompt = match f.get("prompt") {
        None => return Err(ApiError::invalid("prompt", "prompt is required")),
        Some(Value::String(s)) if s.is_empty() => return Err(ApiError::invalid("prompt", "prompt is empty")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.is_empty() => return Err(ApiError::invalid("prompt", "prompt is empty")),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => Prompt::Text(a[0].as_str().unwrap_or_default().to_string()),
        Some(Value::Array(a)) => Prompt::Ids(
            a.iter()
                .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| ApiError::invalid("prompt", format!("prompt: {x} is not a token id (one prompt per request: a string, or an array of token ids)"))))
                .collect::<Result<_, _>>()?,
        ),
        Some(v) => return Err(Fields::wrong("prompt", "a string or an array of token ids", v)),
    };
    Ok(CompletionRequest { options, prompt })
}

/// `typing` (tandem's extension): the conversation so far, its last message being typed.
pub struct TypingRequest {
    pub model: Option<String>,
    pub conversation: Conversation,
    pub session_id: String,
    pub cache_salt: Option<String>,
}

pub fn parse_typing(body: &[u8]) -> Result<TypingRequest, ApiError> {
    let chat = parse_chat(body)?;
    let session_id = chat.options.session_id.ok_or_else(|| ApiError::invalid("session_id", "session_id is required: typed-ahead states are kept for one session"))?;
    if chat.conversation.messages.last().is_some_and(|m| m.role != "user") {
        return Err(ApiError::invalid("messages", "the last message is the one being typed: its role must be user"));
    }
    Ok(TypingRequest { model: chat.options.model, conversation: chat.conversation, session_id, cache_salt: chat.options.cache_salt })
}

/// Which endpoint a response is for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completion => "completions",
        }
    }
}

/// The parts of a response that do not change from chunk to chunk.
pub struct ResponseHead {
    pub endpoint: Endpoint,
    /// Choices carry `token_ids` (`return_token_ids`).
    pub token_ids: bool,
    /// Choices carry `logprobs` (else `"logprobs": null`).
    pub logprobs: bool,
    pub id: String,
    pub created: u64,
    pub model: String,
}

pub struct Usage {
    pub prompt: usize,
    pub completion: usize,
    /// Prompt tokens whose state came from the prefix cache.
    pub cached: usize,
}

impl Usage {
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }
}

/// A sampled token's log-probability as a response reports it: the token's text (its bytes
/// read as UTF-8, a partial character replaced) and bytes, and the likeliest tokens likewise.
#[derive(Clone, Debug, PartialEq)]
pub struct Logprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(String, Vec<u8>, f32)>,
    /// Where the token's text starts in the choice's text (characters; completions'
    /// `text_offset`).
    pub offset: usize,
}

impl Logprob {
    pub fn of(tokenizer: &Tokenizer, l: &TokenLogprobs, offset: usize) -> Logprob {
        let text = |id: u32| {
            let bytes = tokenizer.token_bytes(id).unwrap_or_default();
            (String::from_utf8_lossy(&bytes).into_owned(), bytes)
        };
        let (token, bytes) = text(l.token);
        let top = l.top.iter().map(|&(id, lp)| {
            let (t, b) = text(id);
            (t, b, lp)
        });
        Logprob { token, bytes, logprob: l.logprob, top: top.collect(), offset }
    }
}

/// A log-probability as JSON: -inf (a token the model gives no chance) as the most negative
/// finite number, since JSON has no infinities.
fn logprob_json(lp: f32) -> Value {
    json!(if lp.is_finite() { lp } else { f32::MIN })
}

/// One choice of a whole response.
pub struct ChoiceOut {
    pub text: String,
    pub ids: Vec<u32>,
    pub logprobs: Vec<Logprob>,
    /// A chat choice's tool calls.
    pub calls: Vec<ToolCall>,
    pub finish: &'static str,
}

impl ResponseHead {
    fn object(&self, stream: bool) -> &'static str {
        match (self.endpoint, stream) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    fn wrap(&self, stream: bool, choices: Value, usage: Option<&Usage>) -> Value {
        let mut v = json!({"id": self.id, "object": self.object(stream), "created": self.created, "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u.json();
        }
        v
    }

    /// A choice's `logprobs` for these tokens: a chat's `content` list, a completion's parallel
    /// lists; null where not asked for.
    fn logprobs_json(&self, logprobs: &[Logprob]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.endpoint {
            Endpoint::Chat => {
                let entry = |token: &str, bytes: &[u8], lp: f32| json!({"token": token, "logprob": logprob_json(lp), "bytes": bytes});
                let content: Vec<Value> = logprobs
                    .iter()
                    .map(|l| {
                        let mut e = entry(&l.token, &l.bytes, l.logprob);
                        e["top_logprobs"] = l.top.iter().map(|(t, b, lp)| entry(t, b, *lp)).collect();
                        e
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Endpoint::Completion => json!({
                "tokens": logprobs.iter().map(|l| l.token.as_str()).collect::<Vec<_>>(),
                "token_logprobs": logprobs.iter().map(|l| logprob_json(l.logprob)).collect::<Vec<_>>(),
                "top_logprobs": logprobs.iter().map(|l| l.top.iter().map(|(t, _, lp)| (t.clone(), logprob_json(*lp))).collect::<Map<String, Value>>()).collect::<Vec<_>>(),
                "text_offset": logprobs.iter().map(|l| l.offset).collect::<Vec<_>>(),
            }),
        }
    }

    fn choice(&self, index: usize, body: Value, ids: &[u32], logprobs: &[Logprob], finish: Option<&str>) -> Value {
        let mut choice = json!({"index": index});
        for (k, v) in body.as_object().into_iter().flatten() {
            choice[k] = v.clone();
        }
        choice["logprobs"] = self.logprobs_json(logprobs);
        choice["finish_reason"] = json!(finish);
        if self.token_ids {
            choice["token_ids"] = json!(ids);
        }
        choice
    }

    /// The whole response of a request that did not stream.
    pub fn complete(&self, choices: &[ChoiceOut], usage: &Usage) -> Value {
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let body = match self.endpoint {
                    // With tool calls and no text besides, the content is null (as OpenAI's).
                    Endpoint::Chat if !c.calls.is_empty() => {
                        let content = if c.text.is_empty() { Value::Null } else { json!(c.text) };
                        json!({"message": {"role": "assistant", "content": content, "tool_calls": c.calls.iter().map(|t| t.json(None)).collect::<Vec<_>>()}})
                    }
                    Endpoint::Chat => json!({"message": {"role": "assistant", "content": c.text}}),
                    Endpoint::Completion => json!({"text": c.text}),
                };
                self.choice(i, body, &c.ids, &c.logprobs, Some(c.finish))
            })
            .collect();
        self.wrap(false, json!(choices), Some(usage))
    }

    /// A streamed chunk of choice `index`: the first one of a chat's choice carries the role; the
    /// last one the finish; `ids` and `logprobs`: the tokens sampled since the previous chunk.
    pub fn chunk(&self, index: usize, text: &str, ids: &[u32], logprobs: &[Logprob], first: bool, finish: Option<&str>) -> Value {
        let body = match self.endpoint {
            Endpoint::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) if text.is_empty() => json!({}),
                    _ => json!({"content": text}),
                };
                json!({"delta": delta})
            }
            Endpoint::Completion => json!({"text": text}),
        };
        self.wrap(true, json!([self.choice(index, body, ids, logprobs, finish)]), None)
    }

    /// A streamed chat chunk with one whole tool call of choice `index` (its `call_index`-th):
    /// the id, name and all the arguments in one delta, which clients put together as they do
    /// OpenAI's argument fragments.
    pub fn call_chunk(&self, index: usize, call_index: usize, call: &ToolCall, ids: &[u32], logprobs: &[Logprob]) -> Value {
        let body = json!({"delta": {"tool_calls": [call.json(Some(call_index))]}});
        self.wrap(true, json!([self.choice(index, body, ids, logprobs, None)]), None)
    }

    /// `stream_options.include_usage`: a chunk with no choices and the usage.
    pub fn usage_chunk(&self, usage: &Usage) -> Value {
        self.wrap(true, json!([]), Some(usage))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_err(body: &str) -> ApiError {
        parse_chat(body.as_bytes()).err().expect("refused")
    }

    #[test]
    fn a_chat_request_reads_every_option() {
        let r = parse_chat(br#"{"model":"m","messages":[{"role":"developer","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi"}]}],
            "max_completion_tokens":7,"temperature":0,"top_p":0.5,"top_k":-1,"seed":3,"stop":"x","stream":true,"stream_options":{"include_usage":true},
            "session_id":"s1","chat_template_kwargs":{"enable_thinking":true},"user":"ignored","presence_penalty":0,"frequency_penalty":0.0,"logit_bias":{},
            "response_format":{"type":"text"},"tool_choice":"none","ignore_eos":true,"n":1,"logprobs":true,"top_logprobs":2,"min_p":0.1,
            "repetition_penalty":1.1,"stop_token_ids":[7]}"#)
            .unwrap_or_else(|e| panic!("{}", e.message));
        assert_eq!(r.conversation.messages, vec![Message::new("system", "Be brief."), Message::new("user", "Hi")]);
        let o = r.options;
        assert_eq!((o.model.as_deref(), o.max_tokens, o.stream, o.include_usage, o.session_id.as_deref()), (Some("m"), Some(7), true, true, Some("s1")));
        assert_eq!((o.sampling.temperature, o.sampling.top_p, o.sampling.top_k, o.sampling.seed), (0.0, 0.5, 0, 3));
        assert_eq!(o.stop, vec!["x".to_string()]);
        assert!(r.conversation.enable_thinking && o.ignore_eos);
        assert_eq!((o.n, o.sampling.logprobs, o.sampling.min_p, o.sampling.penalties.repetition, o.stop_token_ids), (1, Some(2), 0.1, 1.1, vec![7]));
        let r = parse_chat(br#"{"messages":[{"role":"user","content":"x"}],"logit_bias":{"9":-100,"3":5.5},"presence_penalty":0.5,"frequency_penalty":-1}"#).unwrap_or_else(|e| panic!("{}", e.message));
        let s = r.options.sampling;
        assert_eq!((s.logit_bias, s.penalties.presence, s.penalties.frequency, s.logprobs), (vec![(3, 5.5), (9, -100.0)], 0.5, -1.0, None));
        // Completions: logprobs is the count of the likeliest.
        let c = parse_completion(br#"{"prompt":"x","logprobs":3,"n":4}"#).ok().map(|c| (c.options.sampling.logprobs, c.options.n));
        assert_eq!(c, Some((Some(3), 4)));
        assert!(parse_completion(br#"{"prompt":"x","logprobs":true}"#).err().is_some_and(|e| e.message.contains("must be an integer")));
    }

    #[test]
    fn bad_requests_name_the_field() {
        for (body, param, says) in [
            (r#"{"messages":[]}"#, "messages", "empty"),
            (r#"{"messages":"hi"}"#, "messages", "must be an array"),
            (r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":"5"}"#, "max_tokens", "must be an integer, not a string"),
            (r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":0}"#, "max_tokens", "out of range"),
            (r#"{"messages":[{"role":"user","content":"x"}],"temperature":3}"#, "temperature", "between 0 and 2"),
            (r#"{"messages":[{"role":"user","content":"x"}],"n":0}"#, "n", "between 1 and 128"),
            (r#"{"messages":[{"role":"user","content":"x"}],"n":2,"session_id":"s"}"#, "n", "a session goes on from one reply"),
            (r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"xml"}}"#, "response_format", "not supported"),
            (r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{"name":"x"}}}"#, "response_format", "needs json_schema.schema"),
            (r#"{"messages":[{"role":"user","content":"x"}],"tool_choice":{"type":"function","function":{"name":"f"}},"tools":[{"type":"function","function":{"name":"g"}}]}"#, "tool_choice", "not among the tools"),
            (r#"{"messages":[{"role":"user","content":"x"}],"logit_bias":{"five":1}}"#, "logit_bias", "\"five\" is not a token id"),
            (r#"{"messages":[{"role":"user","content":"x"}],"logit_bias":{"5":"up"}}"#, "logit_bias[\"5\"]", "must be a number"),
            (r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21}"#, "top_logprobs", "between 0 and 20"),
            (r#"{"messages":[{"role":"user","content":"x"}],"stop_token_ids":[-1]}"#, "stop_token_ids", "-1 is not a token id"),
            (r#"{"messages":[{"role":"user","content":"x"}],"presence_penalty":2.5}"#, "presence_penalty", "between -2 and 2"),
            (r#"{"messages":[{"role":"user","content":"x"}],"min_p":-0.1}"#, "min_p", "between 0 and 1"),
            (r#"{"messages":[{"role":"user","content":"x"}],"tool_choice":"required"}"#, "tool_choice", "needs tools"),
            (r#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":3}"#, "top_logprobs", "needs logprobs: true"),
            (r#"{"messages":[{"role":"user","content":"x"}],"repetition_penalty":3}"#, "repetition_penalty", "between 0 and 2"),
            (r#"{"messages":[{"role":"user","content":"x"}],"best_of":2}"#, "best_of", "not supported"),
            (r#"{"messages":[{"role":"user","content":"x"}],"functions":[]}"#, "functions", "not supported"),
            (r#"{"messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]}"#, "stop", "up to 4"),
            (r#"{"messages":[{"role":"robot","content":"x"}]}"#, "messages[0].role", "not supported"),
            (r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#, "messages[0].content", "only text parts are supported (this one's type is \"image_url\")"),
            (r#"{"messages":[{"role":"user","content":[{"text":"hi"}]}]}"#, "messages[0].content", "this one has no type"),
        ] {
            let e = chat_err(body);
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert!(e.message.contains(says), "{body}: {}", e.message);
        }
        let e = chat_err("{\"messages\": [");
        assert!(e.message.contains("not valid JSON") && e.param.is_none(), "{}", e.message);
        assert!(chat_err("[1]").message.contains("must be a JSON object"));
    }

    #[test]
    fn completion_prompts_are_text_or_ids() {
        assert!(matches!(parse_completion(br#"{"prompt":"hi"}"#).ok().map(|r| r.prompt), Some(Prompt::Text(t)) if t == "hi"));
        assert!(matches!(parse_completion(br#"{"prompt":[1,2]}"#).ok().map(|r| r.prompt), Some(Prompt::Ids(v)) if v == [1, 2]));
        let e = parse_completion(br#"{"prompt":[1,-2]}"#).err().unwrap();
        assert!(e.message.contains("-2 is not a token id"), "{}", e.message);
    }

    #[test]
    fn tool_calls_take_the_openai_shape_whole_and_streamed() {
        let head = ResponseHead { endpoint: Endpoint::Chat, token_ids: false, logprobs: false, id: "chatcmpl-1".into(), created: 0, model: "m".into() };
        let call = ToolCall { id: "call_a_0".into(), name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() };
        let choice = ChoiceOut { text: String::new(), ids: Vec::new(), logprobs: Vec::new(), calls: vec![call.clone()], finish: "tool_calls" };
        let whole = head.complete(&[choice], &Usage { prompt: 5, completion: 9, cached: 0 });
        let c = &whole["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls");
        assert_eq!(c["message"], json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_a_0", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}));
        let chunk = head.call_chunk(1, 0, &call, &[], &[]);
        assert_eq!(chunk["choices"][0]["index"], 1);
        assert_eq!(chunk["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
        assert_eq!(chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["name"], "get_weather");
        // Tool messages and an assistant's calls are read, arguments as objects for the template.
        let r = parse_chat(br#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}}]},{"role":"tool","tool_call_id":"c1","content":"ok"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#).unwrap_or_else(|e| panic!("{}", e.message));
        let m = &r.conversation.messages;
        assert_eq!(m[1].tool_calls, Some(json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}])));
        assert_eq!((m[2].role.as_str(), m[2].tool_call_id.as_deref()), ("tool", Some("c1")));
        assert!(r.conversation.tools.is_some());
    }

    #[test]
    fn errors_have_the_openai_shape() {
        let mut e = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "queue_full", "busy");
        e.retry_after = Some(2);
        assert_eq!(e.body(), json!({"error": {"message": "busy", "type": "rate_limit_error", "param": null, "code": "queue_full"}}));
        let r = e.into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
    }
}
