//! The few HTTP requests one tandem process makes of another (a worker registering with the
//! router, the router asking workers and forwarding requests to them): HTTP/1 over a new TCP
//! connection each, through hyper's client (the server's HTTP stack).

use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

/// `http://host:port` (with or without a trailing slash) to `host:port`.
fn authority(base: &str) -> Result<&str> {
    let rest = base.strip_prefix("http://").with_context(|| format!("{base:?}: expected http://HOST:PORT"))?;
    let host = rest.trim_end_matches('/');
    if host.is_empty() || host.contains('/') {
        bail!("{base:?}: expected http://HOST:PORT");
    }
    Ok(host)
}

/// Check that `base` is an `http://HOST:PORT` address.
pub fn check_base(base: &str) -> Result<()> {
    authority(base).map(|_| ())
}

/// Send `request` to `base` over a new connection; the response comes with its body still
/// coming. `timeout` bounds the connection and the response's head.
async fn exchange(base: &str, request: Request<Full<Bytes>>, timeout: Duration) -> Result<Response<Incoming>> {
    let host = authority(base)?.to_string();
    let path = request.uri().to_string();
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(&host).await.with_context(|| format!("connecting to {base}"))?;
        stream.set_nodelay(true)?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.with_context(|| format!("HTTP with {base}"))?;
        // The connection is driven on its own until the response's body has been read.
        tokio::spawn(connection);
        sender.send_request(request).await.with_context(|| format!("{base}{path}: no response"))
    };
    tokio::time::timeout(timeout, exchange).await.with_context(|| format!("{base}{path}: no response within {:.1} s", timeout.as_secs_f64()))?
}

/// Read a whole response within `timeout`.
async fn whole(base: &str, path: &str, response: impl std::future::Future<Output = Result<Response<Incoming>>>, timeout: Duration) -> Result<(StatusCode, Bytes)> {
    let read = async {
        let response = response.await?;
        let status = response.status();
        let bytes = response.into_body().collect().await.with_context(|| format!("{base}{path}: the answer broke off"))?.to_bytes();
        Ok((status, bytes))
    };
    tokio::time::timeout(timeout, read).await.with_context(|| format!("{base}{path}: no whole answer within {:.1} s", timeout.as_secs_f64()))?
}

/// POST `body` (JSON) to `base` + `path`; the response comes with its body still coming (for
/// a stream to pass on).
pub async fn post_streaming(base: &str, path: &str, body: Bytes, timeout: Duration) -> Result<Response<Incoming>> {
    let request = Request::post(path)
        .header(hyper::header::HOST, authority(base)?)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .context("building a request")?;
    exchange(base, request, timeout).await
}

/// POST bytes (`application/octet-stream`: a state's image) and read the whole answer within
/// `timeout`.
pub async fn post_bytes(base: &str, path: &str, body: Vec<u8>, timeout: Duration) -> Result<(StatusCode, Bytes)> {
    let request = Request::post(path)
        .header(hyper::header::HOST, authority(base)?)
        .header(hyper::header::CONTENT_TYPE, "application/octet-stream")
        .body(Full::new(Bytes::from(body)))
        .context("building a request")?;
    whole(base, path, exchange(base, request, timeout), timeout).await
}

/// POST JSON and read the whole answer within `timeout`.
pub async fn post_json(base: &str, path: &str, body: &serde_json::Value, timeout: Duration) -> Result<(StatusCode, Bytes)> {
    whole(base, path, post_streaming(base, path, Bytes::from(body.to_string()), timeout), timeout).await
}

/// GET `base` + `path` and read the whole answer within `timeout`.
pub async fn get(base: &str, path: &str, timeout: Duration) -> Result<(StatusCode, Bytes)> {
    let request = Request::get(path).header(hyper::header::HOST, authority(base)?).body(Full::new(Bytes::new())).context("building a request")?;
    whole(base, path, exchange(base, request, timeout), timeout).await
}
