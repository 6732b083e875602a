//! The load generator of `tandem bench --sections serve`: streamed `/v1/completions` requests
//! over plain HTTP/1.1 on loopback, sent at a fixed concurrency or at Poisson arrival times,
//! each timed as `vllm bench serve` times them: time to first token from sending the request to
//! its first text chunk, inter-token latency between consecutive text chunks, and the token
//! counts from the usage chunk that ends the stream.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use tandem_core::rng::Rng;

/// The most one request may take before it counts as failed (a server that stops answering
/// must not hang the benchmark).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(900);

/// What every request of a load point asks for.
pub struct Workload {
    pub addr: SocketAddr,
    pub model: String,
    pub prompts: Vec<Vec<u32>>,
    pub output_len: usize,
    pub temperature: f64,
    /// 0: no top-k cut.
    pub top_k: usize,
    pub top_p: f64,
}

impl Workload {
    /// `n` prompts of `len` token ids drawn uniformly from `0..vocab` (the same for a seed).
    pub fn random_prompts(n: usize, len: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| random_tokens(&mut rng, len, vocab)).collect()
    }

    fn body(&self, i: usize) -> String {
        json!({
            "model": self.model,
            "prompt": self.prompts[i],
            "max_tokens": self.output_len,
            "ignore_eos": true,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string()
    }
}

/// `len` token ids drawn uniformly from `0..vocab`.
pub fn random_tokens(rng: &mut Rng, len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// How requests arrive.
#[derive(Clone, Copy, Debug)]
pub enum Arrivals {
    /// This many requests in flight: each client sends its next request when one finishes.
    Concurrency(usize),
    /// Requests at this mean rate per second, with exponential gaps (a Poisson process).
    Poisson { rate: f64, seed: u64 },
}

/// One request's outcome; times in seconds.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub error: Option<String>,
    pub prompt_tokens: usize,
    /// Prompt tokens the server's prefix cache covered (`prompt_tokens_details`).
    pub cached_tokens: usize,
    pub output_tokens: usize,
    /// The reply's token ids, where the request asked for them (`return_token_ids`).
    pub token_ids: Vec<u32>,
    /// From sending the request to its first text chunk.
    pub ttft: f64,
    /// Between consecutive text chunks.
    pub itl: Vec<f64>,
    /// From sending the request to the end of its stream.
    pub latency: f64,
}

impl Outcome {
    /// Mean time per output token after the first (0 for a request of one token).
    pub fn tpot(&self) -> f64 {
        if self.output_tokens > 1 {
            (self.latency - self.ttft) / (self.output_tokens - 1) as f64
        } else {
            0.0
        }
    }
}

/// Send every request of `w` as `arrivals` says; the outcomes (in request order) and the
/// seconds from the first send to the last answer.
pub async fn drive(w: Arc<Workload>, arrivals: Arrivals) -> (Vec<Outcome>, f64) {
    let n = w.prompts.len();
    let start = Instant::now();
    let mut handles = Vec::new();
    match arrivals {
        Arrivals::Concurrency(c) => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..c.min(n) {
                let (w, next) = (Arc::clone(&w), Arc::clone(&next));
                handles.push(tokio::spawn(async move {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            return done;
                        }
                        done.push((i, send(&w, i).await));
                    }
                }));
            }
        }
        Arrivals::Poisson { rate, seed } => {
            let mut rng = Rng::new(seed);
            let mut at = 0.0;
            for i in 0..n {
                tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
                let w = Arc::clone(&w);
                handles.push(tokio::spawn(async move { vec![(i, send(&w, i).await)] }));
                // Exponential gaps of mean 1/rate: -ln(1 - u) / rate, u in [0, 1).
                at += -(1.0 - rng.next_f64()).ln() / rate;
            }
        }
    }
    let mut outcomes = vec![Outcome::default(); n];
    for h in handles {
        match h.await {
            Ok(done) => {
                for (i, o) in done {
                    outcomes[i] = o;
                }
            }
            Err(e) => eprintln!("a load-generator task failed: {e}"),
        }
    }
    (outcomes, start.elapsed().as_secs_f64())
}

/// Request `i` of `w`, timed; a failure is an outcome with its error.
async fn send(w: &Workload, i: usize) -> Outcome {
    send_body(w.addr, &w.body(i)).await
}

/// One streamed `/v1/completions` request of this JSON body, timed; a failure is an outcome
/// with its error.
pub async fn send_body(addr: SocketAddr, body: &str) -> Outcome {
    let start = Instant::now();
    let result = tokio::time::timeout(REQUEST_TIMEOUT, stream_completion(addr, body, start)).await;
    let result = result.unwrap_or_else(|_| Err(anyhow::anyhow!("no complete answer within {} s", REQUEST_TIMEOUT.as_secs())));
    result.unwrap_or_else(|e| Outcome { error: Some(format!("{e:#}")), latency: start.elapsed().as_secs_f64(), ..Outcome::default() })
}

async fn stream_completion(addr: SocketAddr, body: &str, start: Instant) -> Result<Outcome> {
    let mut response = Response::send(addr, "POST", "/v1/completions", body).await?;
    if response.status != 200 {
        let text = response.text().await.unwrap_or_default();
        bail!("HTTP {}: {}", response.status, text.trim());
    }
    let mut out = Outcome::default();
    let mut pending: Vec<u8> = Vec::new();
    let mut last_text: Option<f64> = None;
    let mut done = false;
    while let Some(piece) = response.next().await? {
        pending.extend_from_slice(&piece);
        let now = start.elapsed().as_secs_f64();
        // Server-sent events end with a blank line.
        while let Some(end) = pending.windows(2).position(|p| p == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            for line in event.split(|&b| b == b'\n') {
                let Some(data) = line.strip_prefix(b"data: ") else { continue };
                if data == b"[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_slice(data).with_context(|| format!("an event that is not JSON: {}", String::from_utf8_lossy(data)))?;
                if let Some(e) = v.get("error") {
                    bail!("the stream ended in an error: {e}");
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                    out.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
                    out.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as usize;
                }
                if let Some(ids) = v["choices"].get(0).and_then(|c| c["token_ids"].as_array()) {
                    out.token_ids.extend(ids.iter().filter_map(Value::as_u64).map(|id| id as u32));
                }
                let text = v["choices"].get(0).and_then(|c| c["text"].as_str()).unwrap_or("");
                if !text.is_empty() {
                    match last_text {
                        None => out.ttft = now,
                        Some(t) => out.itl.push(now - t),
                    }
                    last_text = Some(now);
                }
            }
        }
    }
    if !done {
        bail!("the stream ended before `data: [DONE]`");
    }
    out.latency = start.elapsed().as_secs_f64();
    Ok(out)
}

/// `GET path`: the status and the body as text.
pub async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut r = Response::send(addr, "GET", path, "").await?;
    let text = r.text().await?;
    Ok((r.status, text))
}

/// An HTTP/1.1 response read as it arrives: its status, then its body in pieces (chunked
/// transfer encoding decoded, or a Content-Length body, or everything up to the close).
struct Response {
    stream: TcpStream,
    status: u16,
    /// Bytes read and not yet handed out.
    buf: Vec<u8>,
    body: Framing,
}

enum Framing {
    Chunked,
    Length(usize),
    UntilClose,
    Done,
}

impl Response {
    /// Send a request (one per connection) and read the response's head.
    async fn send(addr: SocketAddr, method: &str, path: &str, body: &str) -> Result<Response> {
        let mut stream = TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        let head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        let mut r = Response { stream, status: 0, buf: Vec::new(), body: Framing::UntilClose };
        let end = loop {
            if let Some(end) = r.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break end;
            }
            if !r.fill().await? {
                bail!("the connection closed before the response's head");
            }
        };
        let head = String::from_utf8_lossy(&r.buf[..end]).to_string();
        r.buf.drain(..end + 4);
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or("");
        r.status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).with_context(|| format!("not an HTTP status line: {status_line:?}"))?;
        for line in lines {
            let Some((name, value)) = line.split_once(':') else { continue };
            let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
            if name == "transfer-encoding" && value.eq_ignore_ascii_case("chunked") {
                r.body = Framing::Chunked;
            } else if name == "content-length" {
                r.body = Framing::Length(value.parse().with_context(|| format!("Content-Length {value:?}"))?);
            }
        }
        Ok(r)
    }

    /// Read more bytes into `buf`; false at the end of the connection.
    async fn fill(&mut self) -> Result<bool> {
        let mut chunk = [0u8; 16384];
        let n = self.stream.read(&mut chunk).await?;
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n > 0)
    }

    /// The next piece of the body, None after its end.
    async fn next(&mut self) -> Result<Option<Vec<u8>>> {
        loop {
            match self.body {
                Framing::Done => return Ok(None),
                Framing::Length(0) => {
                    self.body = Framing::Done;
                    return Ok(None);
                }
                Framing::Length(left) if !self.buf.is_empty() => {
                    let n = left.min(self.buf.len());
                    self.body = Framing::Length(left - n);
                    return Ok(Some(self.buf.drain(..n).collect()));
                }
                Framing::UntilClose if !self.buf.is_empty() => return Ok(Some(std::mem::take(&mut self.buf))),
                Framing::Chunked => {
                    // `SIZE-IN-HEX[;extension]\r\n` then SIZE bytes and `\r\n`; size 0 ends it.
                    if let Some(line_end) = self.buf.windows(2).position(|w| w == b"\r\n") {
                        let line = String::from_utf8_lossy(&self.buf[..line_end]).to_string();
                        let hex = line.split(';').next().unwrap_or("").trim();
                        let size = usize::from_str_radix(hex, 16).with_context(|| format!("a chunk size that is not hex: {line:?}"))?;
                        if size == 0 {
                            self.body = Framing::Done;
                            return Ok(None);
                        }
                        if self.buf.len() >= line_end + 2 + size + 2 {
                            let piece = self.buf[line_end + 2..line_end + 2 + size].to_vec();
                            self.buf.drain(..line_end + 2 + size + 2);
                            return Ok(Some(piece));
                        }
                    }
                }
                _ => {}
            }
            if !self.fill().await? {
                return match self.body {
                    Framing::UntilClose => {
                        self.body = Framing::Done;
                        Ok(None)
                    }
                    _ => bail!("the connection closed in the middle of the response"),
                };
            }
        }
    }

    /// The rest of the body as text.
    async fn text(&mut self) -> Result<String> {
        let mut all = Vec::new();
        while let Some(piece) = self.next().await? {
            all.extend_from_slice(&piece);
        }
        Ok(String::from_utf8_lossy(&all).into_owned())
    }
}

/// The `p`-th percentile (0-100) of `v`, interpolated between ranks as numpy's default is;
/// NaN for no values.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let at = p / 100.0 * (s.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    s[lo] + (s[hi] - s[lo]) * (at - lo as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert_eq!(percentile(&v, 100.0), 4.0);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12);
        assert!(percentile(&[], 50.0).is_nan());
    }

    /// A loopback server that reads one request and answers with `wire`, `piece` bytes at a
    /// time; its address.
    async fn answer_once(wire: Vec<u8>, piece: usize) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = vec![0u8; 4096];
            let _ = s.read(&mut req).await.unwrap();
            for part in wire.chunks(piece) {
                s.write_all(part).await.unwrap();
                s.flush().await.unwrap();
            }
        });
        addr
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
    }

    /// A chunked event stream split at awkward places: the client puts the events back
    /// together, times each text chunk (not the empty one) and reads the usage.
    #[test]
    fn a_chunked_event_stream_is_read_whole() {
        let events = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n";
        let mut wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n".to_vec();
        for part in events.as_bytes().chunks(7) {
            wire.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
            wire.extend_from_slice(part);
            wire.extend_from_slice(b"\r\n");
        }
        wire.extend_from_slice(b"0\r\n\r\n");
        let o = block_on(async { stream_completion(answer_once(wire, 5).await, "{}", Instant::now()).await }).unwrap();
        assert_eq!((o.prompt_tokens, o.output_tokens, o.itl.len()), (5, 3, 1));
        assert!(o.ttft > 0.0 && o.latency >= o.ttft);
    }

    #[test]
    fn a_refused_request_is_a_failed_outcome_naming_the_status() {
        let body = "{\"error\":{\"message\":\"busy\"}}";
        let wire = format!("HTTP/1.1 429 Too Many Requests\r\ncontent-length: {}\r\n\r\n{body}", body.len()).into_bytes();
        let o = block_on(async {
            let w = Workload { addr: answer_once(wire, 1 << 16).await, model: "m".into(), prompts: vec![vec![1, 2]], output_len: 4, temperature: 0.0, top_k: 0, top_p: 1.0 };
            send(&w, 0).await
        });
        let e = o.error.expect("failed");
        assert!(e.contains("HTTP 429") && e.contains("busy"), "{e}");
    }

    #[test]
    fn a_stream_cut_short_is_a_failure() {
        let wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n16\r\ndata: {\"choices\":[]}\n\n\r\n".to_vec();
        let e = block_on(async { stream_completion(answer_once(wire, 64).await, "{}", Instant::now()).await }).unwrap_err();
        assert!(format!("{e:#}").contains("closed in the middle"), "{e:#}");
    }
}
