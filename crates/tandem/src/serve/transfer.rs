//! How a request's state crosses from a prefill worker to a decode worker. The decode worker
//! chooses (`--state-transfer`): NIXL (one-sided writes into memory it reserved: host memory,
//! or its GPU engine's pools), or, where NIXL is not built or not installed, one of the bridges
//! every tandem has: `stream` (the state's image, as the socket bridge sends it, in the body of
//! a POST to the decode worker) or `file[:DIR]` (a state file the prefill worker writes into a
//! directory both see). Whichever it is, the decode worker reserves a slot for the request and
//! hands out a ticket (JSON) that says how to fill it; the prefill worker follows the ticket;
//! every state is checked (magic, version, model fingerprint, layout, checksums, position)
//! before it is used, and a slot whose state fails, or never comes, is freed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tandem_core::bridge::{self, Fingerprint};
use tandem_core::model::config::Qwen35Config;
use tandem_core::pipeline::Start;
use tandem_core::state::State;

/// How states come to this decode worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Method {
    Nixl,
    /// The image in the body of `POST /internal/state/SLOT`.
    Stream,
    /// A state file in this directory.
    File(PathBuf),
}

impl Method {
    /// `--state-transfer`: nixl, stream or file[:DIR]; None: NIXL where this tandem has it and
    /// its libraries load, else stream.
    pub fn parse(s: Option<&str>) -> Result<Method> {
        Ok(match s {
            None if nixl_available().is_ok() => Method::Nixl,
            None => Method::Stream,
            Some("nixl") => Method::Nixl,
            Some("stream") => Method::Stream,
            Some("file") => Method::File(bridge::file::default_dir()),
            Some(other) => match other.strip_prefix("file:") {
                Some(dir) if !dir.is_empty() => Method::File(PathBuf::from(dir)),
                _ => bail!("--state-transfer {other:?}: nixl, stream or file[:DIR]"),
            },
        })
    }
}

/// Whether NIXL can be used here: built in, its libraries found.
fn nixl_available() -> Result<()> {
    #[cfg(feature = "nixl")]
    return tandem_core::bridge::nixl::load_library();
    #[cfg(not(feature = "nixl"))]
    Err(bridge::nixl_not_built())
}

/// The decode side: slots reserved for states on their way.
pub enum Inbox {
    #[cfg(feature = "nixl")]
    Nixl(Mutex<tandem_core::bridge::nixl::Receiver>),
    Bridge(Mutex<BridgeSlots>),
}

/// Slots filled through a bridge (stream or file).
pub struct BridgeSlots {
    method: Method,
    /// Where prefill workers reach this worker (`--advertise`).
    url: String,
    next: u64,
    slots: HashMap<u64, Slot>,
}

struct Slot {
    tokens: usize,
    /// A streamed state, checked, once it came.
    state: Option<State>,
}

impl BridgeSlots {
    fn file(&self, slot: u64) -> Option<PathBuf> {
        match &self.method {
            Method::File(dir) => Some(dir.join(format!("tandem-slot-{}-{slot}.state", std::process::id()))),
            _ => None,
        }
    }
}

impl Inbox {
    /// The inbox of a decode worker reachable at `url`, its NIXL agent (where `method` is
    /// NIXL) named `name`.
    pub fn new(method: Method, name: &str, url: &str) -> Result<Inbox> {
        match method {
            #[cfg(feature = "nixl")]
            Method::Nixl => Ok(Inbox::Nixl(Mutex::new(tandem_core::bridge::nixl::Receiver::new(name, None)?))),
            #[cfg(not(feature = "nixl"))]
            Method::Nixl => {
                let _ = name;
                Err(bridge::nixl_not_built())
            }
            Method::File(ref dir) if !dir.is_dir() => bail!("--state-transfer file:{}: not a directory", dir.display()),
            method => Ok(Inbox::Bridge(Mutex::new(BridgeSlots { method, url: url.to_string(), next: 1, slots: HashMap::new() }))),
        }
    }

    /// States arrive in the GPU engine's pools where this worker decodes on a GPU and moves
    /// them by NIXL (see `Receiver::on_gpu`).
    #[cfg_attr(not(feature = "nixl"), allow(unused_variables))]
    pub fn on_gpu(self, pipeline: &tandem_core::pipeline::Pipeline, vocab: usize) -> Result<Inbox> {
        Ok(match (self, pipeline.decode_pools()) {
            #[cfg(feature = "nixl")]
            (Inbox::Nixl(r), Some(pools)) => {
                let transfer = tandem_core::backend::cuda::qwen35::transfer::TransferPools::new(pools, vocab)?;
                Inbox::Nixl(Mutex::new(r.into_inner().unwrap_or_else(|e| e.into_inner()).on_gpu(transfer)))
            }
            (inbox, _) => inbox,
        })
    }

    /// How states come here, for `/metrics`: nixl-gpu, nixl-host, stream or file.
    pub fn kind(&self) -> &'static str {
        match self {
            #[cfg(feature = "nixl")]
            Inbox::Nixl(r) if lock(r).is_on_gpu() => "nixl-gpu",
            #[cfg(feature = "nixl")]
            Inbox::Nixl(_) => "nixl-host",
            Inbox::Bridge(b) => match lock(b).method {
                Method::File(_) => "file",
                _ => "stream",
            },
        }
    }

    /// Reserve a slot for the state of an N-token prompt: its ticket.
    pub fn reserve(&self, cfg: &Qwen35Config, tokens: usize) -> Result<Value> {
        match self {
            #[cfg(feature = "nixl")]
            Inbox::Nixl(r) => Ok(serde_json::to_value(lock(r).reserve_for_prompt(cfg, tokens)?)?),
            Inbox::Bridge(b) => {
                let _ = cfg;
                let mut b = lock(b);
                let slot = b.next;
                b.next += 1;
                let memory = match b.file(slot) {
                    Some(path) => json!({"kind": "file", "path": path}),
                    None => json!({"kind": "stream", "url": b.url, "path": format!("/internal/state/{slot}")}),
                };
                b.slots.insert(slot, Slot { tokens, state: None });
                Ok(json!({"slot": slot, "memory": memory}))
            }
        }
    }

    /// Free a slot whose state will not come (or whose request went). Returns whether it was
    /// reserved.
    pub fn release(&self, slot: u64) -> bool {
        match self {
            #[cfg(feature = "nixl")]
            Inbox::Nixl(r) => lock(r).release(slot),
            Inbox::Bridge(b) => {
                let mut b = lock(b);
                if let Some(path) = b.file(slot) {
                    let _ = std::fs::remove_file(path);
                }
                b.slots.remove(&slot).is_some()
            }
        }
    }

    /// Slots reserved and not yet taken or released.
    pub fn reserved(&self) -> usize {
        match self {
            #[cfg(feature = "nixl")]
            Inbox::Nixl(r) => lock(r).reserved(),
            Inbox::Bridge(b) => lock(b).slots.len(),
        }
    }

    /// The most bytes a streamed state for `slot` may have (None: no such slot waits for a
    /// stream).
    pub fn stream_limit(&self, cfg: &Qwen35Config, slot: u64) -> Option<usize> {
        match self {
            Inbox::Bridge(b) => {
                let b = lock(b);
                b.slots.get(&slot).filter(|s| s.state.is_none() && b.method == Method::Stream).map(|s| bridge::format::prefilled_image_bytes(cfg, s.tokens))
            }
            #[cfg(feature = "nixl")]
            Inbox::Nixl(_) => None,
        }
    }

    /// A streamed state for `slot`: checked as the socket bridge checks every state (and its
    /// position against the slot's prompt) before it is kept. A state that fails frees the
    /// slot.
    pub fn deliver(&self, slot: u64, mut image: &[u8], fingerprint: Fingerprint, cfg: &Qwen35Config) -> Result<()> {
        let b = match self {
            Inbox::Bridge(b) => b,
            #[cfg(feature = "nixl")]
            Inbox::Nixl(_) => bail!("this decode worker takes states through NIXL, not streams"),
        };
        let tokens = lock(b).slots.get(&slot).map(|s| s.tokens).with_context(|| format!("state slot {slot} is not reserved here (released, or never reserved)"))?;
        let checked = bridge::socket::receive(&mut image, fingerprint, cfg, None).and_then(|(state, _, _)| {
            if state.position != tokens {
                bail!("the state holds {} tokens, the request {tokens}", state.position);
            }
            if !image.is_empty() {
                bail!("{} bytes past the state's end", image.len());
            }
            Ok(state)
        });
        let mut b = lock(b);
        match checked {
            Ok(state) => match b.slots.get_mut(&slot) {
                Some(s) => s.state = Some(state),
                None => bail!("state slot {slot} was released while its state came"),
            },
            Err(e) => {
                b.slots.remove(&slot);
                return Err(e.context(format!("the state streamed into slot {slot}, refused")));
            }
        }
        Ok(())
    }

    /// The state for `slot`, a prompt of `tokens` tokens, checked: through NIXL (waiting up to
    /// `wait` for its notification: the router forwards a request only once its write
    /// completed), streamed, or from its file. The slot is freed whatever the outcome.
    #[cfg_attr(not(feature = "nixl"), allow(unused_variables))]
    pub async fn take(&self, slot: u64, tokens: usize, fingerprint: Fingerprint, cfg: &Qwen35Config, wait: Duration) -> Result<Start> {
        match self {
            #[cfg(feature = "nixl")]
            Inbox::Nixl(r) => {
                let started = Instant::now();
                loop {
                    let arrived = lock(r).has_arrived(slot);
                    match arrived {
                        Ok(true) => break,
                        Ok(false) if started.elapsed() < wait => tokio::time::sleep(Duration::from_micros(200)).await,
                        Ok(false) => {
                            lock(r).release(slot);
                            bail!("no state came within {} s", wait.as_secs());
                        }
                        Err(e) => {
                            lock(r).release(slot);
                            return Err(e);
                        }
                    }
                }
                // A GPU slot is checked by its header alone and becomes a snapshot without a
                // copy; a host slot's image is checked and copied into a state (tens of ms for
                // long prompts) off the async threads and without holding the receiver, which
                // other requests' reservations need meanwhile.
                let arrived = {
                    let mut r = lock(r);
                    if r.is_on_gpu() {
                        let snapshot = r.take_gpu(slot, fingerprint, tokens)?;
                        return Ok(Start::Cached(std::sync::Arc::new(tandem_core::state::Snapshot::Gpu(snapshot))));
                    }
                    r.take_arrived(slot)?
                };
                let state = tokio::task::block_in_place(|| arrived.state(fingerprint, cfg, tokens, None));
                lock(r).recycle(arrived);
                Ok(state?.0.into())
            }
            Inbox::Bridge(b) => {
                let (slot_state, file) = {
                    let mut b = lock(b);
                    let file = b.file(slot);
                    (b.slots.remove(&slot).with_context(|| format!("state slot {slot} is not reserved here (released, or never reserved)"))?, file)
                };
                match (slot_state.state, file) {
                    (Some(state), _) => Ok(state.into()),
                    (None, Some(path)) => {
                        let loaded = tokio::task::block_in_place(|| bridge::file::load(&path, fingerprint, cfg, None));
                        let _ = std::fs::remove_file(&path);
                        let (state, _, _) = loaded.with_context(|| format!("the state file {}", path.display()))?;
                        if state.position != tokens {
                            bail!("the state file {} holds {} tokens, the request {tokens}", path.display(), state.position);
                        }
                        Ok(state.into())
                    }
                    (None, None) => bail!("no state was streamed into slot {slot}"),
                }
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The prefill side: NIXL where this worker has it; the bridges always.
pub struct Outbox {
    #[cfg(feature = "nixl")]
    nixl: Option<Mutex<tandem_core::bridge::nixl::Sender>>,
    /// Why this worker has no NIXL (a NIXL ticket gets this as its error).
    no_nixl: Option<String>,
}

/// What a prefill worker does with its state for a ticket: done (written through NIXL, or a
/// file), or an image to POST to the decode worker.
pub enum Sent {
    Done { times: bridge::TransferTimes, bytes: usize },
    Post { url: String, path: String, image: Vec<u8> },
}

impl Outbox {
    /// The outbox of a prefill worker, its NIXL agent named `name` (without NIXL, it still
    /// sends by stream and file; says why once).
    pub fn new(name: &str) -> Outbox {
        #[cfg(feature = "nixl")]
        {
            // Sender::new says what is missing where the libraries do not load.
            match tandem_core::bridge::nixl::Sender::new(name, None) {
                Ok(s) => Outbox { nixl: Some(Mutex::new(s)), no_nixl: None },
                Err(e) => {
                    eprintln!("tandem serve: no NIXL here, states go by stream or file only: {e:#}");
                    Outbox { nixl: None, no_nixl: Some(format!("{e:#}")) }
                }
            }
        }
        #[cfg(not(feature = "nixl"))]
        {
            let _ = name;
            Outbox { no_nixl: Some(format!("{:#}", bridge::nixl_not_built())) }
        }
    }

    /// Send GPU snapshots from the prefill engine's pools, GPU memory to GPU memory, where this
    /// worker prefills on a GPU and has NIXL.
    #[cfg_attr(not(feature = "nixl"), allow(unused_variables, unused_mut))]
    pub fn on_gpu(mut self, pipeline: &tandem_core::pipeline::Pipeline, vocab: usize) -> Result<Outbox> {
        #[cfg(feature = "nixl")]
        if let Some(pools) = pipeline.prefill_pools() {
            // (Taken only here: a CPU prefill engine keeps its sender as it is.)
            if let Some(s) = self.nixl.take() {
                let transfer = tandem_core::backend::cuda::qwen35::transfer::TransferPools::new(pools, vocab)?;
                self.nixl = Some(Mutex::new(s.into_inner().unwrap_or_else(|e| e.into_inner()).on_gpu(transfer)));
            }
        }
        Ok(self)
    }

    /// Send `snapshot` as `ticket` says (blocking: run off the async threads). A NIXL write
    /// waits at most `timeout`.
    pub fn send(&self, ticket: &Value, snapshot: &tandem_core::state::Snapshot, fingerprint: Fingerprint, timeout: Duration) -> Result<Sent> {
        let memory = &ticket["memory"];
        match memory["kind"].as_str() {
            Some("stream") => {
                let (Some(url), Some(path)) = (memory["url"].as_str(), memory["path"].as_str()) else { bail!("a stream ticket without its url and path: {ticket}") };
                let state = snapshot.to_host()?;
                let mut image = Vec::with_capacity(bridge::format::image_bytes(&state));
                bridge::socket::send(&mut image, &state, fingerprint)?;
                Ok(Sent::Post { url: url.to_string(), path: path.to_string(), image })
            }
            Some("file") => {
                let path = PathBuf::from(memory["path"].as_str().with_context(|| format!("a file ticket without its path: {ticket}"))?);
                let t = Instant::now();
                let state = snapshot.to_host()?;
                bridge::file::save(&path, &state, fingerprint).with_context(|| format!("writing the state file {} (the decode worker's --state-transfer file:DIR must be a directory this worker sees)", path.display()))?;
                Ok(Sent::Done { times: bridge::TransferTimes { serialize: t.elapsed(), ..Default::default() }, bytes: bridge::format::image_bytes(&state) })
            }
            Some("host") | Some("gpu") => self.send_nixl(ticket, snapshot, fingerprint, timeout),
            _ => bail!("a ticket of no known kind: {ticket}"),
        }
    }

    #[cfg_attr(not(feature = "nixl"), allow(unused_variables))]
    fn send_nixl(&self, ticket: &Value, snapshot: &tandem_core::state::Snapshot, fingerprint: Fingerprint, timeout: Duration) -> Result<Sent> {
        #[cfg(feature = "nixl")]
        if let Some(sender) = &self.nixl {
            use tandem_core::bridge::nixl::{SlotMemory, StateTicket};
            let ticket: StateTicket = serde_json::from_value(ticket.clone()).context("a NIXL ticket")?;
            let mut sender = lock(sender);
            return Ok(match (&ticket.memory, snapshot) {
                (SlotMemory::Gpu { .. }, tandem_core::state::Snapshot::Gpu(g)) => Sent::Done { times: sender.send_gpu(&ticket, g, fingerprint, timeout)?, bytes: g.bytes() },
                _ => {
                    let state = snapshot.to_host()?;
                    Sent::Done { times: sender.send(&ticket, &state, fingerprint, timeout)?, bytes: bridge::format::image_bytes(&state) }
                }
            });
        }
        bail!("the decode worker takes states through NIXL, which this prefill worker does not have ({}); start the decode worker with --state-transfer stream", self.no_nixl.as_deref().unwrap_or("unknown reason"))
    }
}
